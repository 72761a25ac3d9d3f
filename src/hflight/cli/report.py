"""What a run shows and returns at its end: the final metrics' table, ``optimized_metric`` for a sweeper, and
``training_curves.png``."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hflight.arguments.training_args import TrainingArguments
from hflight.cli.failures import _describe

__all__ = ["format_metrics_table", "optimized_value"]

log = logging.getLogger(__name__)


def optimized_value(metrics: Mapping[str, float], name: str | None) -> float | None:
    """``metrics[name]`` as a float (None for no name); an unknown name raises, listing the available ones."""
    if not name:
        return None
    if name not in metrics:
        raise KeyError(f"optimized_metric={name!r} is not among the final metrics: {', '.join(sorted(metrics))}")
    return float(metrics[name])


def format_metrics_table(metrics: Mapping[str, Any], title: str) -> str:
    """A boxed two-column table of ``metrics`` under ``title`` (which may span several lines)."""
    rows = [(str(k), str(v)) for k, v in metrics.items()]
    kw = max(len("metric"), *(len(k) for k, _ in rows))
    vw = max(len("value"), *(len(v) for _, v in rows))
    rule = f"+-{'-' * kw}-+-{'-' * vw}-+"
    lines = [title, rule, f"| {'metric':<{kw}} | {'value':>{vw}} |", rule]
    lines += [f"| {k:<{kw}} | {v:>{vw}} |" for k, v in rows]
    lines.append(rule)
    return "\n".join(lines)


def _draw_curves(trainer: Any, args: TrainingArguments) -> None:
    """``training_curves.png`` in the run folder. The results are on disk by now, so a figure that cannot be drawn
    (a full disk, say) is reported as an error in the log, not as a failed run."""
    from hflight.cli.curves import FILE_NAME, plot_training_curves

    try:
        path = plot_training_curves(trainer.state.log_history, Path(args.output_dir) / FILE_NAME, args.run_name)
    except (OSError, ValueError) as exc:
        log.error(f"Could not draw {FILE_NAME} in {args.output_dir}: {_describe(exc)}")
        return
    if path is None:
        log.info(f"No {FILE_NAME}: nothing was logged (log_history is empty)")
    else:
        log.info(f"Training curves: {path}")
