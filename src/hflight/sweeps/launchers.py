"""What a job of a sweep needs to know about the launcher running it beside other jobs: how many CPU threads it may
use. Hydra's joblib launcher (``hydra/launcher=joblib``) runs ``n_jobs`` jobs at once on one machine, and
submitit's local executor (``hydra/launcher=submitit_local``) runs a whole batch at once; each job's torch then gets
the machine's cores divided by the jobs running together (at least one), unless ``cpu_threads`` is set. Other
launchers (the basic one, submitit on SLURM with its own CPUs per task) leave torch's default.

A job that submitit runs on SLURM takes SIGUSR2 as its requeue signal (:func:`requeue_signal_under_launcher`).
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["SUBMITIT_REQUEUE_SIGNAL", "concurrent_jobs", "requeue_signal_under_launcher", "threads_per_job"]

#: The signal submitit asks SLURM to send before a job's time limit (``sbatch --signal=USR2@<signal_delay_s>``).
SUBMITIT_REQUEUE_SIGNAL = "SIGUSR2"

_JOBLIB = "hydra_plugins.hydra_joblib_launcher."
_SUBMITIT_LOCAL = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _batch_size(hydra_config: Any) -> int | None:
    """How many jobs the sweeper hands the launcher at once (None: all of them)."""
    sweeper = hydra_config.get("sweeper") or {}
    for key in ("n_jobs", "max_batch_size"):  # hflight's Optuna sweeper, Hydra's basic sweeper
        value = sweeper.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def concurrent_jobs(hydra_config: Any) -> int:
    """How many jobs of this sweep run at once on this machine (1 outside a local parallel launcher)."""
    launcher = hydra_config.get("launcher") or {}
    target = str(launcher.get("_target_", ""))
    cores = _cores()
    if target.startswith(_JOBLIB):
        n_jobs = int(launcher.get("n_jobs", -1))
        running = cores + 1 + n_jobs if n_jobs < 0 else n_jobs  # joblib's reading of a negative n_jobs
    elif target == _SUBMITIT_LOCAL:
        running = cores
    else:
        return 1
    batch = _batch_size(hydra_config)
    return max(1, min(running, batch) if batch else running)


def threads_per_job(hydra_config: Any) -> int | None:
    """torch threads for one job: cores / :func:`concurrent_jobs`, or None when the job runs alone."""
    running = concurrent_jobs(hydra_config)
    return None if running <= 1 else max(1, _cores() // running)


def requeue_signal_under_launcher(configured: str | None) -> str | None:
    """The requeue signal for this job: :data:`SUBMITIT_REQUEUE_SIGNAL` when submitit runs it on SLURM
    (``SUBMITIT_EXECUTOR=slurm``) and ``args.requeue_signal`` is the default SIGUSR1; else ``configured``."""
    if os.environ.get("SUBMITIT_EXECUTOR") == "slurm" and configured == "SIGUSR1":
        return SUBMITIT_REQUEUE_SIGNAL
    return configured
