"""A run you can look at: ``training_curves.png`` drawn from ``trainer.state.log_history``.

One panel for the training loss and one for the learning rate, per optimizer step (the entries ``Trainer.log``
writes every ``logging_steps``), then one panel per evaluation metric (``eval_loss``, ``eval_f1``, ...) per
evaluation. Matplotlib's non-interactive ``Agg`` backend draws it, so it works without a display (a job on a
cluster, a sweep) and leaves an interactive session's backend alone.

Example:
    >>> from hflight.cli.curves import plot_training_curves  # doctest: +SKIP
    >>> plot_training_curves(trainer.state.log_history, "outputs/run/training_curves.png")  # doctest: +SKIP
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from hflight import durable

__all__ = ["FILE_NAME", "curves", "plot_training_curves"]

#: The figure's name in the run folder.
FILE_NAME = "training_curves.png"

#: Per-step training series: log_history key -> panel title.
TRAINING_SERIES = {"loss": "training loss", "learning_rate": "learning rate"}
#: Keys of an evaluation entry that are timings or positions, not metrics.
_NOT_METRICS = ("_runtime", "_samples_per_second", "_steps_per_second", "_jit_compilation_time")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_metric(key: str) -> bool:
    return key.startswith("eval_") and not key.endswith(_NOT_METRICS)


def curves(log_history: Iterable[Mapping[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """``panel title -> [(step, value), ...]``: the training loss and learning rate of every logging step, then each
    evaluation metric of every evaluation (in first-seen order). Entries without a ``step`` are skipped."""
    series: dict[str, list[tuple[float, float]]] = {title: [] for title in TRAINING_SERIES.values()}
    for entry in log_history:
        step = entry.get("step")
        if not _number(step):
            continue
        for key, title in TRAINING_SERIES.items():
            if _number(entry.get(key)):
                series[title].append((step, float(entry[key])))
        for key, value in entry.items():
            if _is_metric(key) and _number(value):
                series.setdefault(key, []).append((step, float(value)))
    return {title: points for title, points in series.items() if points}


def plot_training_curves(
    log_history: Iterable[Mapping[str, Any]], path: str | os.PathLike, title: str | None = None
) -> Path | None:
    """Draw :func:`curves` of ``log_history`` into the PNG ``path``; None (and no file) when nothing was logged."""
    panels = curves(log_history)
    if not panels:
        return None
    # A Figure on an Agg canvas of its own: no pyplot state, no display, and a notebook's backend stays as it was.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure = Figure(figsize=(4.2 * columns, 3.0 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    for index, (name, points) in enumerate(panels.items()):
        axes = figure.add_subplot(rows, columns, index + 1)
        steps, values = zip(*points)
        per_evaluation = name.startswith("eval_")
        axes.plot(steps, values, marker="o" if per_evaluation else None, markersize=4, linewidth=1.5)
        axes.set_title(name + (" (per evaluation)" if per_evaluation else " (per step)"), fontsize=10)
        axes.set_xlabel("optimizer step", fontsize=9)
        axes.grid(alpha=0.3)
        axes.tick_params(labelsize=8)
        if name == "learning rate":
            axes.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    if title:
        figure.suptitle(title, fontsize=11)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    durable.sync_files([path])  # on disk before the run names it
    return path
