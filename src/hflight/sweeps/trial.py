"""The job's side of an Optuna search: the trial this job is, reported to at every evaluation.

hflight's sweeper (``hydra_plugins.hflight_optuna_sweeper``) gives each job three Hydra overrides:
``hydra.sweeper.storage`` (the study's database, resolved), ``hydra.sweeper.study_name`` and ``hydra.sweeper.trial``
(the trial's number). :func:`job_trial` reads them from the job's Hydra config, so the job reaches its trial through
the database whether it runs in the sweeper's process (the basic launcher), in a joblib worker or on another
machine (submitit). :class:`ReportToTrial` reports ``optimized_metric`` to it after every evaluation, at the
global step; when the study's pruner (``hydra.sweeper.pruner``; null: never) says so, training stops there with a
checkpoint, the trial records the step (``hflight:pruned_at_step``), and :func:`hflight.cli.train` raises
:class:`JobPruned`: the sweeper marks the trial PRUNED.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from transformers import TrainerCallback

__all__ = ["SWEEPER_PID", "JobPruned", "JobTrial", "ReportToTrial", "job_in_worker_process", "job_trial"]

log = logging.getLogger(__name__)

#: Set by hflight's sweeper while it launches jobs: a job running in another process (a joblib worker, a submitit
#: job) that a signal stopped returns instead of raising, so that the launcher waits for the other jobs'
#: checkpoints (joblib kills its workers when one job raises).
SWEEPER_PID = "HFLIGHT_SWEEPER_PID"

#: The module prefix of the sweeper whose jobs have a trial (hydra.sweeper._target_).
SWEEPER_MODULE = "hydra_plugins.hflight_optuna_sweeper."


class JobPruned(Exception):
    """The job's trial was pruned at ``step`` (its last reported value: ``value``); its checkpoint is saved."""

    def __init__(self, number: int, step: int, value: float) -> None:
        super().__init__(f"trial {number} pruned at step {step} ({value:g})")
        self.number, self.step, self.value = number, step, value


@dataclass
class JobTrial:
    """One trial of a study in a database, as a job reaches it."""

    storage: str
    study_name: str
    number: int
    pruner: Any = None  # the pruner's config node (a _target_), or None: never prune

    def _trial(self) -> Any:
        import optuna

        from hflight.sweeps.study import open_storage

        storage = open_storage(self.storage)
        pruner = optuna.pruners.NopPruner()
        if self.pruner is not None:
            from hydra.utils import instantiate

            pruner = instantiate(self.pruner)
        study = optuna.load_study(study_name=self.study_name, storage=storage, pruner=pruner)
        trial_id = storage.get_trial_id_from_study_id_trial_number(
            storage.get_study_id_from_name(self.study_name), self.number
        )
        return optuna.Trial(study, trial_id)

    def report(self, value: float, step: int) -> bool:
        """Report ``value`` at ``step``; whether the pruner stops the trial here (then recorded in the study)."""
        from hflight.sweeps.study import PRUNED_AT

        trial = self._trial()
        trial.report(value, step)
        if not trial.should_prune():
            return False
        trial.set_user_attr(PRUNED_AT, step)
        return True


def job_trial(hydra_config: Any) -> JobTrial | None:
    """The trial of this job (``HydraConfig.get()`` of a job of hflight's sweeper); None outside such a sweep."""
    sweeper = hydra_config.get("sweeper") if hydra_config is not None else None
    if not sweeper or not str(sweeper.get("_target_", "")).startswith(SWEEPER_MODULE):
        return None
    if sweeper.get("trial") is None:
        return None
    return JobTrial(str(sweeper.storage), str(sweeper.study_name), int(sweeper.trial), sweeper.get("pruner"))


class ReportToTrial(TrainerCallback):
    """Reports ``metric`` (e.g. ``eval_f1``) to the job's trial after every evaluation; stops training with a
    checkpoint when the trial is pruned (``pruned`` then holds the step and the value)."""

    def __init__(self, trial: JobTrial, metric: str | None) -> None:
        self.trial, self.metric = trial, metric
        self.pruned: tuple[int, float] | None = None
        self._missing_said = False
        self._training = False

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._training = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._training = False

    def on_evaluate(
        self, args: Any, state: Any, control: Any, metrics: dict[str, float] | None = None, **kwargs: Any
    ) -> Any:
        # the evaluations during training (the final one, after it, is the value main returns)
        if not self.metric or not state.is_world_process_zero or not self._training:
            return control
        key = self.metric if self.metric in (metrics or {}) else f"eval_{self.metric}"
        value = (metrics or {}).get(key)
        if value is None or not math.isfinite(float(value)):
            if not self._missing_said:
                log.warning(f"optimized_metric={self.metric} is not among the evaluation's metrics: not reported")
                self._missing_said = True
            return control
        if self.trial.report(float(value), state.global_step):
            log.warning(
                f"Trial {self.trial.number} pruned at step {state.global_step} ({key}={float(value):g}): "
                "stopping with a checkpoint"
            )
            self.pruned = (state.global_step, float(value))
            control.should_training_stop = True
            control.should_save = True
        return control


def job_in_worker_process() -> bool:
    """Whether this job runs in a process of its own, launched by hflight's sweeper (see :data:`SWEEPER_PID`)."""
    import os

    pid = os.environ.get(SWEEPER_PID, "")
    return pid.isdigit() and int(pid) != os.getpid()
