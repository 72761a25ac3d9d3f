"""A run as a job of a sweep: its torch threads beside the launcher's other jobs, its trial in an Optuna search
(reported to at every evaluation; ``pruned.json`` when pruned), and submitit's requeue signal on SLURM."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from hflight.sweeps.trial import ReportToTrial, job_trial

__all__ = ["PRUNED_FILE"]

log = logging.getLogger(__name__)

#: File a job of an Optuna search leaves when its trial was pruned (trial number, step, last value).
PRUNED_FILE = "pruned.json"


def _set_cpu_threads(threads: Any, hydra_config: Any = None) -> None:
    """``torch.set_num_threads(cpu_threads)``; unset, a job that shares the machine with the sweep's other jobs
    (joblib, submitit's local executor) gets the cores divided between them."""
    if threads is None and hydra_config is not None:
        from hflight.sweeps.launchers import threads_per_job

        threads = threads_per_job(hydra_config)
        if threads is not None:
            log.info(f"cpu_threads={threads}: this machine's cores shared by the sweep's jobs running together")
    if threads is None:
        return
    import torch

    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"cpu_threads must be a positive integer or null, got {threads!r}")
    torch.set_num_threads(threads)


def _requeue_signal_under_launcher(cfg: DictConfig) -> None:
    """A job that submitit runs on SLURM requeues on submitit's signal (SIGUSR2), unless configured otherwise."""
    from omegaconf import open_dict

    from hflight.sweeps.launchers import requeue_signal_under_launcher

    args = cfg.get("args")
    if args is None or "requeue_signal" not in args:
        return
    wanted = requeue_signal_under_launcher(args.requeue_signal)
    if wanted != args.requeue_signal:
        log.info(f"Run by submitit on SLURM: args.requeue_signal={wanted} (the signal submitit asks SLURM for)")
        with open_dict(args):
            args.requeue_signal = wanted


def _job_hydra_config() -> Any:
    """The Hydra config of this job of a multirun (None otherwise)."""
    return HydraConfig.get() if _in_multirun() else None


def _trial_reporter(cfg: DictConfig) -> Any:
    """:class:`hflight.sweeps.trial.ReportToTrial` for a job of hflight's Optuna sweeper, else None."""
    hydra_config = _job_hydra_config()
    if hydra_config is None:
        return None
    trial = job_trial(hydra_config)
    return None if trial is None else ReportToTrial(trial, cfg.get("optimized_metric"))


def _search_folder() -> Path | None:
    """The sweep folder of the Optuna search this job is a trial of, absolute: ``resume=`` continues the search from
    there (its interrupted trials from their checkpoints, in new job folders); None for any other run."""
    hydra_config = _job_hydra_config()
    if hydra_config is None or job_trial(hydra_config) is None:
        return None
    return Path(hydra_config.runtime.cwd, hydra_config.sweep.dir).resolve()  # relative to where the command ran


def _in_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
