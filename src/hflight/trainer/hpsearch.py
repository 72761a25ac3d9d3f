"""``Trainer.hyperparameter_search`` with transformers' semantics, on optuna.

Each trial builds a fresh model through ``model_init``, trains with the trial's hyperparameters written into a
copy of ``TrainingArguments`` (validated like any other) in ``output_dir/run-{trial}``, reports every evaluation's
objective to optuna (so pruners can stop bad trials) and is scored by ``compute_objective`` on its last
evaluation. The default search space and objective are transformers' own (``default_hp_space_optuna``: learning
rate, epochs, seed, batch size; ``default_compute_objective``: ``eval_loss`` alone, else the sum of the metrics).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from transformers.trainer_utils import BestRun, default_compute_objective, default_hp_space_optuna

from hflight.run.events import dispatch

if TYPE_CHECKING:
    from hflight.surface import TrainerSurface


def _optuna():
    try:
        import optuna
    except ImportError as exc:
        raise ImportError(
            "hyperparameter_search(backend='optuna') needs optuna: "
            "pip install 'hflight[optuna]' (or pip install optuna)"
        ) from exc
    return optuna


def _run_optuna(
    trainer: TrainerSurface, base_args: Any, n_trials: int, direction: str | list[str], **kwargs: Any
) -> BestRun | list[BestRun]:
    optuna = _optuna()

    def objective(trial: Any) -> float | list[float]:
        trainer.objective = None
        trainer.args = apply_trial(trainer, base_args, trial)
        trainer.train(trial=trial)
        if trainer.objective is None:
            trainer.objective = trainer.compute_objective(trainer.evaluate())
        return trainer.objective

    optimize_kwargs = {k: kwargs.pop(k) for k in ("timeout", "n_jobs", "gc_after_trial", "catch") if k in kwargs}
    directions = direction if isinstance(direction, list) else None
    study = optuna.create_study(direction=None if directions else direction, directions=directions, **kwargs)
    study.optimize(objective, n_trials=n_trials, **optimize_kwargs)
    if directions is None:
        best = study.best_trial
        return BestRun(str(best.number), best.value, best.params)
    return [BestRun(str(t.number), t.values, t.params) for t in study.best_trials]


BACKENDS: dict[str, dict[str, Callable]] = {
    "optuna": {"run": _run_optuna, "default_hp_space": default_hp_space_optuna},
}


def hyperparameter_search(
    trainer: TrainerSurface,
    hp_space: Callable[[Any], dict[str, Any]] | None,
    compute_objective: Callable[[dict[str, float]], float] | None,
    n_trials: int,
    direction: str | list[str],
    backend: str | None,
    hp_name: Callable[[Any], str] | None,
    **kwargs: Any,
) -> BestRun | list[BestRun]:
    name = getattr(backend, "value", backend) or "optuna"
    if name not in BACKENDS:
        raise ValueError(f"hyperparameter_search: unknown backend {name!r}; hflight supports: {', '.join(BACKENDS)}")
    if trainer.model_init is None:
        raise RuntimeError("To use hyperparameter search, you need to pass your model through a model_init function.")
    spec = BACKENDS[name]
    trainer.hp_space = hp_space if hp_space is not None else spec["default_hp_space"]
    trainer.hp_name = hp_name
    trainer.compute_objective = compute_objective if compute_objective is not None else default_compute_objective
    trainer.hp_search_backend = name
    base_args = trainer.args
    try:
        return spec["run"](trainer, base_args, n_trials, direction, **kwargs)
    finally:
        trainer.args = base_args
        trainer.hp_search_backend = None


def apply_trial(trainer: TrainerSurface, base_args: Any, trial: Any) -> Any:
    """A copy of ``base_args`` with the trial's hyperparameters and its own ``run-{id}`` output folder."""
    params = trainer.hp_space(trial) if trainer.hp_search_backend == "optuna" else dict(trial)
    fields = {f.name for f in dataclasses.fields(base_args)}
    unknown = sorted(set(params) - fields)
    if unknown:
        raise ValueError(f"hp_space returned {unknown}, which are not TrainingArguments fields.")
    run_name = trainer.hp_name(trial) if trainer.hp_name is not None else f"run-{getattr(trial, 'number', 0)}"
    output_dir = os.path.join(base_args.output_dir, run_name)
    return dataclasses.replace(base_args, **params, output_dir=output_dir)


def report(trainer: TrainerSurface, trial: Any, step: int, metrics: dict[str, float]) -> None:
    """Tell optuna the objective after an evaluation; stop the trial if its pruner says so."""
    if trainer.hp_search_backend is None or trial is None:
        return
    trainer.objective = trainer.compute_objective(metrics.copy())
    if trainer.hp_search_backend == "optuna" and hasattr(trial, "report") and not isinstance(trainer.objective, list):
        trial.report(trainer.objective, step)
        if trial.should_prune():
            dispatch(trainer, "on_train_end")
            raise _optuna().TrialPruned()


class HyperparameterSearchMixin:
    """``Trainer.hyperparameter_search`` (see :func:`hyperparameter_search`)."""

    def hyperparameter_search(
        self,
        hp_space: Callable[[Any], dict[str, Any]] | None = None,
        compute_objective: Callable[[dict[str, float]], float] | None = None,
        n_trials: int = 20,
        direction: str | list[str] = "minimize",
        backend: str | None = None,
        hp_name: Callable[[Any], str] | None = None,
        **kwargs: Any,
    ) -> BestRun | list[BestRun]:
        """Search hyperparameters with optuna (transformers' semantics; needs ``model_init``)."""
        return hyperparameter_search(self, hp_space, compute_objective, n_trials, direction, backend, hp_name, **kwargs)

    def _report_to_hp_search(self, trial: Any, step: int, metrics: dict[str, float]) -> None:
        report(self, trial, step, metrics)

    def _get_output_dir(self, trial: Any) -> str:
        """Where this run writes: during a search, the trial's ``run-{n}`` folder is already ``args.output_dir``
        (see :func:`apply_trial`)."""
        return self.args.output_dir
