"""A multirun's summary: ``summary.csv`` and ``summary.md`` at the sweep's root, one row per job.

:class:`SweepSummary` is a Hydra callback (``conf/hydra/default.yaml`` configures it under ``hydra.callbacks``); at
the end of a multirun it reads every job folder below the sweep folder (each has ``.hydra/overrides.yaml``, and
``all_results.json`` when it finished, ``pruned.json`` when an Optuna pruner stopped it, ``error.txt`` when it
failed or a signal stopped it) and writes a row per job: its number, its
overrides, its ``state`` (Optuna's names: COMPLETE, PRUNED, FAIL; FAIL also for a job that left neither results nor an
error: killed; RESUMED for a job stopped before its end whose training another job of the sweep continued from its
checkpoint: an Optuna search's retry of an interrupted trial, whose ``args.resume_from_checkpoint`` names it), its
final metrics (every ``eval_*``, ``predict_*`` and ``train_loss`` value) and its folder (absolute, however the sweep
folder was given: a sweep and its continuation by ``resume=`` write the same form). The best finished job by
``optimized_metric`` is marked in the ``best`` column: highest, or lowest when the sweeper minimizes
(``hydra.sweeper.direction``) or, without a direction, when the metric is a loss. ``summary.md``'s title counts the
jobs (an Optuna search's trials: ``n_trials``), a RESUMED job and the job that continued it as one, and names the
job that continued each.
It works for any sweeper (the basic one, Optuna) and any launcher, since it reads only what the jobs left on disk.
"""

from __future__ import annotations

import csv
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from hflight import durable

__all__ = ["CSV_NAME", "MARKDOWN_NAME", "JobRow", "SweepSummary", "collect_jobs", "write_summary"]

log = logging.getLogger(__name__)

CSV_NAME = "summary.csv"
MARKDOWN_NAME = "summary.md"
_TRAINING_METRICS = ("train_loss",)


@dataclass
class JobRow:
    """One job of the sweep, as it left its folder."""

    folder: Path
    overrides: list[str]
    state: str  # "COMPLETE", "PRUNED", "FAIL" or "RESUMED"
    metrics: dict[str, float] = field(default_factory=dict)
    resumed_by: str | None = None  # RESUMED: the number of the job that continued it

    @property
    def number(self) -> str:
        return self.folder.name


def _final_metrics(results: dict[str, Any]) -> dict[str, float]:
    return {
        key: float(value)
        for key, value in results.items()
        if (key.startswith(("eval_", "predict_")) or key in _TRAINING_METRICS)
        and isinstance(value, (int, float))
        and not key.endswith(("_runtime", "_per_second", "_samples"))
    }


def collect_jobs(sweep_dir: str | Path) -> list[JobRow]:
    """Every job folder below ``sweep_dir`` (one holding ``.hydra/overrides.yaml``), in job-number order, each
    folder absolute; a job another one continued is RESUMED (:func:`_mark_resumed`)."""
    rows = []
    for overrides_file in Path(sweep_dir).resolve().glob("**/.hydra/overrides.yaml"):
        folder = overrides_file.parent.parent
        overrides = yaml.safe_load(overrides_file.read_text(encoding="utf-8")) or []
        results = folder / "all_results.json"
        if (folder / "pruned.json").is_file():
            row = JobRow(folder, overrides, "PRUNED")
        elif results.is_file():
            row = JobRow(folder, overrides, "COMPLETE", _final_metrics(json.loads(results.read_text("utf-8"))))
        else:
            row = JobRow(folder, overrides, "FAIL")  # error.txt, or killed before it could write one
        rows.append(row)
    _mark_resumed(rows)
    return sorted(rows, key=lambda r: (int(r.number) if r.number.isdigit() else math.inf, str(r.folder)))


def _resumed_from(overrides: list[str]) -> Path | None:
    """The folder whose checkpoint a job continued (its ``args.resume_from_checkpoint=<folder>/checkpoint-N``)."""
    for override in overrides:
        key, _, value = override.partition("=")
        if key.lstrip("+") == "args.resume_from_checkpoint" and "/" in value:
            return Path(value.strip("'\"")).parent.resolve()
    return None


def _mark_resumed(rows: list[JobRow]) -> None:
    """A FAIL job (stopped by a signal, or killed) whose checkpoint another job of the sweep continued is RESUMED:
    its trial goes on in that job (an Optuna search's retry), and counts once."""
    by_folder = {row.folder: row for row in rows}
    for row in rows:
        stopped = by_folder.get(_resumed_from(row.overrides))
        if stopped is not None and stopped is not row and stopped.state == "FAIL":
            stopped.state, stopped.resumed_by = "RESUMED", row.number


def best_job(rows: list[JobRow], metric: str | None, direction: str | None) -> JobRow | None:
    """The finished job with the best ``metric`` (None without a metric or a job that has it)."""
    if direction not in (None, "maximize", "minimize"):
        raise ValueError(f"hydra.sweeper.direction must be 'maximize' or 'minimize', got {direction!r}")
    scored = [r for r in rows if metric and math.isfinite(r.metrics.get(metric, math.nan))]
    if not scored:
        return None
    minimize = direction == "minimize" or (direction is None and "loss" in metric)
    return (min if minimize else max)(scored, key=lambda r: r.metrics[metric])


def write_summary(
    sweep_dir: str | Path, metric: str | None = None, direction: str | None = None, noun: str = "jobs"
) -> list[Path]:
    """Write ``summary.csv`` and ``summary.md`` into ``sweep_dir``; return their paths (none for no job). ``noun``:
    what ``summary.md``'s title counts (an Optuna search's ``trials``)."""
    sweep_dir = Path(sweep_dir)
    rows = collect_jobs(sweep_dir)
    if not rows:
        return []
    best = best_job(rows, metric, direction)
    names = sorted({name for row in rows for name in row.metrics}, key=lambda n: (n != metric, n))
    header = ["job", "best", "state", "overrides", *names, "folder"]
    table = [
        [
            row.number,
            "*" if row is best else "",
            row.state,
            " ".join(row.overrides),
            *(f"{row.metrics[n]:.6g}" if n in row.metrics else "" for n in names),
            str(row.folder),
        ]
        for row in rows
    ]
    with open(sweep_dir / CSV_NAME, "w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows([header, *table])
    (sweep_dir / MARKDOWN_NAME).write_text(_markdown(header, rows, table, metric, best, noun), encoding="utf-8")
    written = [sweep_dir / CSV_NAME, sweep_dir / MARKDOWN_NAME]
    # on disk before the sweep reports success: the files, the sweep folder's entries (the study's database file
    # too), and the sweep folder's own entry
    durable.sync_files(written)
    durable.fsync_dir(sweep_dir.resolve().parent)
    return written


def _markdown(
    header: list[str], rows: list[JobRow], table: list[list[str]], metric: str | None, best: JobRow | None, noun: str
) -> str:
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    resumed = [row for row in rows if row.resumed_by is not None]
    count = len(rows) - len(resumed)
    lines = [f"# Sweep summary ({count} {noun if count != 1 else noun.rstrip('s')})", ""]
    for row in resumed:
        lines.append(f"Job {row.number} stopped before its end; job {row.resumed_by} continued it (RESUMED).")
    lines += [""] if resumed else []
    if best is not None:
        lines += [f"Best by `{metric}`: job {best.number} ({best.metrics[metric]:.6g}), marked `*`.", ""]
    lines += [line(header), line(["---"] * len(header)), *(line(row) for row in table)]
    return "\n".join(lines) + "\n"


class SweepSummary(Callback):
    """Hydra callback: :func:`write_summary` at the end of every multirun."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from hflight.sweeps.trial import SWEEPER_MODULE

        sweeper = config.hydra.get("sweeper") or {}
        noun = "trials" if str(sweeper.get("_target_", "")).startswith(SWEEPER_MODULE) else "jobs"
        written = write_summary(config.hydra.sweep.dir, config.get("optimized_metric"), sweeper.get("direction"), noun)
        if written:
            log.info(f"Sweep summary: {written[0]} and {written[1]}")
