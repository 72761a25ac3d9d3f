"""``Trainer.hyperparameter_search`` as transformers runs it: optuna, Ray Tune or W&B sweeps.

The backend is the one named, else the one transformers picks (``default_hp_search_backend``: the first installed of
optuna, ray, wandb). Each trial builds a fresh model through ``model_init`` and, in ``train(trial=...)`` right after
it (``_hp_search_setup``, transformers' moment), sets the trial's hyperparameters on ``args`` in place, validated as
any ``TrainingArguments`` (other names are the model's, for ``model_init(trial)``); its checkpoints go into
``output_dir/run-{id}`` (``_get_output_dir``), every evaluation reports the objective (``_report_to_hp_search``:
optuna's pruners, Ray Tune's schedulers and checkpoints), and it is scored by ``compute_objective`` on its last
evaluation. As in transformers, ``args`` keep the last trial's values afterwards. The backends, and how a search
spans the processes of a launcher, are in :mod:`hflight.trainer.hpsearch_backends`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from transformers.trainer_callback import TrainerControl
from transformers.trainer_utils import (
    PREFIX_CHECKPOINT_DIR,
    BestRun,
    HPSearchBackend,
    default_compute_objective,
    number_of_arguments,
)

from hflight.checkpoints import names
from hflight.trainer.hpsearch_backends import BACKENDS, SearchBackend

if TYPE_CHECKING:
    from hflight.surface import TrainerSurface

logger = logging.getLogger(__name__)


def backend_named(name: str | HPSearchBackend | None) -> SearchBackend:
    """The backend ``name`` names, else transformers' default (the first installed of optuna, ray, wandb).

    Raises:
        ValueError: an unknown name. RuntimeError: the backend (or, unnamed, every backend) is not installed.
    """
    if name is None:
        from transformers.hyperparameter_search import default_hp_search_backend

        try:
            name = default_hp_search_backend()
        except RuntimeError:
            raise RuntimeError(
                "hyperparameter_search needs a search backend, and none is installed: pip install 'hflight[optuna]' "
                "(or 'hflight[ray]' for Ray Tune, 'hflight[wandb]' for W&B sweeps)"
            ) from None
    try:
        backend = BACKENDS[HPSearchBackend(getattr(name, "value", name))]
    except ValueError:
        known = ", ".join(repr(b.value) for b in BACKENDS)
        raise ValueError(f"hyperparameter_search: unknown backend {name!r}; hflight supports: {known}") from None
    backend.ensure_available()
    return backend


def hyperparameter_search(
    trainer: TrainerSurface,
    hp_space: Callable[[Any], dict[str, Any]] | None,
    compute_objective: Callable[[dict[str, float]], Any] | None,
    n_trials: int,
    direction: str | list[str],
    backend: str | HPSearchBackend | None,
    hp_name: Callable[[Any], str] | None,
    **kwargs: Any,
) -> BestRun | list[BestRun] | None:
    chosen = backend_named(backend)
    if trainer.model_init is None:
        raise RuntimeError("To use hyperparameter search, you need to pass your model through a model_init function.")
    trainer.hp_search_backend = chosen.name
    trainer.hp_space = hp_space if hp_space is not None else chosen.default_hp_space
    trainer.hp_name = hp_name
    trainer.compute_objective = compute_objective if compute_objective is not None else default_compute_objective
    try:
        return chosen.run(trainer, n_trials, direction, **kwargs)
    finally:
        trainer.hp_search_backend = None


def set_hyperparameters(args: Any, params: dict[str, Any], model_init_takes_trial: bool) -> None:
    """``params`` onto ``args`` in place, as transformers sets a trial's values (a number cast to the field's current
    type: ``num_train_epochs`` 3 -> 3.0, a Ray ``seed`` 7.9 -> 7), validated first on a copy of ``args``. A name that
    is not a ``TrainingArguments`` field is skipped with transformers' warning when ``model_init`` takes the trial
    (which carries it: a model's hyperparameter, as transformers' own Ray and W&B tests search them).

    Raises:
        ValueError: such a name while ``model_init`` takes no trial (nothing would use the value), or a value the
            field refuses.
    """
    fields = {f.name for f in dataclasses.fields(args) if f.init}
    unknown = sorted(set(params) - fields)
    if unknown and not model_init_takes_trial:
        raise ValueError(
            f"hp_space returned {unknown}, which are not TrainingArguments fields, and model_init takes no trial, so "
            "nothing would use them: read them in model_init(trial), or return only TrainingArguments fields."
        )
    for key in unknown:
        logger.warning(
            f"Trying to set {key} in the hyperparameter search but there is no corresponding field in "
            "`TrainingArguments`."
        )
    values = {}
    for key, value in ((k, v) for k, v in params.items() if k in fields):
        current = getattr(args, key)
        is_number = isinstance(current, (int, float)) and not isinstance(current, bool)
        values[key] = type(current)(value) if is_number and isinstance(value, (int, float)) else value
    checked = dataclasses.replace(args, **values)
    for key in values:
        setattr(args, key, getattr(checked, key))


class HyperparameterSearchMixin:
    """``Trainer.hyperparameter_search`` and the trial hooks ``train()`` calls (transformers' names)."""

    def hyperparameter_search(
        self,
        hp_space: Callable[[Any], dict[str, Any]] | None = None,
        compute_objective: Callable[[dict[str, float]], Any] | None = None,
        n_trials: int = 20,
        direction: str | list[str] = "minimize",
        backend: str | HPSearchBackend | None = None,
        hp_name: Callable[[Any], str] | None = None,
        **kwargs: Any,
    ) -> BestRun | list[BestRun] | None:
        """Search hyperparameters with optuna, Ray Tune or a W&B sweep, as transformers does (needs ``model_init``).

        Returns the ``BestRun`` (a list of them for several objectives); under a launcher, on rank 0 (``None`` on
        the other ranks, which train every trial with rank 0). There, a trial that fails on one rank fails on every
        rank: the others raise ``TrialFailedOnAnotherRank``, or, when ``catch`` names the error's type, go on to the
        next trial with it (``hflight.trainer.hpsearch_backends``)."""
        return hyperparameter_search(self, hp_space, compute_objective, n_trials, direction, backend, hp_name, **kwargs)

    def _hp_search_setup(self, trial: Any) -> None:
        """The trial's hyperparameters onto ``self.args`` (called by ``train()`` after ``model_init``)."""
        if self.hp_search_backend is None or trial is None:
            return
        params = BACKENDS[self.hp_search_backend].params(self, trial)
        set_hyperparameters(self.args, params, number_of_arguments(self.model_init) == 1)
        logger.info(f"Trial: {params}")
        self.create_accelerator_and_postprocess()

    def _report_to_hp_search(self, trial: Any, step: int, metrics: dict[str, float]) -> None:
        """The objective of an evaluation during a trial, to the backend (optuna's pruner may stop the trial)."""
        if self.hp_search_backend is None or trial is None:
            return
        metrics = metrics.copy()
        self.objective = self.compute_objective(metrics)
        BACKENDS[self.hp_search_backend].report(self, trial, step, metrics)

    def _get_output_dir(self, trial: Any) -> str:
        """Where a checkpoint goes: during a search, the trial's folder ``output_dir/run-{id}`` (or ``hp_name``'s)."""
        if self.hp_search_backend is None or trial is None:
            return self.args.output_dir
        run_id = BACKENDS[self.hp_search_backend].run_id(trial) if self.hp_name is None else None
        name = self.hp_name(trial) if self.hp_name is not None else f"run-{run_id}"
        return os.path.join(self.args.output_dir, name)

    def _tune_save_checkpoint(self, checkpoint_dir: str) -> None:
        """A Ray Tune checkpoint: ``checkpoint-{step}`` in ``checkpoint_dir`` with the model, the trainer state,
        optimizer and scheduler (the files transformers writes there)."""
        output_dir = os.path.join(checkpoint_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        self.save_model(output_dir, _internal_call=True)
        if self.args.should_save:
            self.state.stateful_callbacks[TrainerControl.__name__] = self.control.state()
            self.state.save_to_json(os.path.join(output_dir, names.TRAINER_STATE_NAME))
            torch.save(self.optimizer.state_dict(), os.path.join(output_dir, names.OPTIMIZER_NAME))
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, names.SCHEDULER_NAME))
