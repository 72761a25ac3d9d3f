"""What the rest of hflight sees of the facade: transformers' ``Trainer`` surface, and nothing private.

``hflight.trainer.Trainer`` is the HF surface; the work runs in collaborators (``hflight.run``: module, datamodule,
loop, evaluation; ``hflight.checkpoints``; the backends). Each receives what it uses as arguments: the
``hflight.run.run.Run`` of the call (the Lightning side: ``lightning.Trainer``, module, datamodule, loop, plan,
resume point, world, backend hooks) and the facade as a :class:`TrainerSurface`, i.e. as a
subclass of ``transformers.Trainer`` sees it: public attributes (``args``, ``state``, ``control``, ``model``,
``optimizer``, ``lr_scheduler``, ``callback_handler``, ...) and methods.

The only underscore names a collaborator uses on the facade are transformers' protected methods listed in
:data:`OVERRIDE_POINTS`. They are called through the facade so that a subclass's override takes effect (PrimeQA's
and transformers' example trainers override several). ``tests/test_structure.py`` walks the source and fails on any
other private read, and on any name here that ``transformers.Trainer`` does not have.

This module sits below every collaborator and imports none of them, so typing a collaborator against the facade
creates no import circle.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader
    from transformers.trainer_callback import CallbackHandler, TrainerControl, TrainerState

#: transformers' protected ``Trainer`` methods that hflight calls through the facade (so overrides take effect).
#: Every name is a method of ``transformers.Trainer`` with transformers' signature.
OVERRIDE_POINTS: frozenset[str] = frozenset(
    {
        "_maybe_log_save_evaluate",  # (tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, lr)
        "_evaluate",  # (trial, ignore_keys_for_eval, skip_scheduler=False): evaluation during training
        "_determine_best_metric",  # (metrics, trial): best metric and step
        "_save_checkpoint",  # (model, trial): write checkpoint-N
        "_save",  # (output_dir=None, state_dict=None): the model files (weights, config, processing class)
        "_get_output_dir",  # (trial): the folder a checkpoint is written into (a search's trial folder)
        "_load_from_checkpoint",  # (resume_from_checkpoint, model=None): a checkpoint's weights into the model
        "_load_best_model",  # (): load_best_model_at_end
        "_load_optimizer_and_scheduler",  # (checkpoint): a resumed run's optimizer, scheduler, scaler at train start
        "_get_learning_rate",  # (): the learning rate logged
        "_prepare_inputs",  # (inputs): move a batch to the model's device
        "_prepare_input",  # (data): one element of a batch (called by _prepare_inputs, recursively)
        "_get_num_items_in_batch",  # (batch_samples, device): the loss normaliser of an accumulation cycle
        "_get_dataloader",  # (dataset, description, batch_size, sampler_fn, is_training, dataloader_key)
        "_remove_unused_columns",  # (dataset, description=None): drop what the model's forward does not take
        "_get_train_sampler",  # (train_dataset=None)
        "_get_eval_sampler",  # (eval_dataset)
        "_report_to_hp_search",  # (trial, step, metrics): after an evaluation during a search
        "_tune_save_checkpoint",  # (checkpoint_dir): a Ray Tune trial's checkpoint, reported with its evaluation
        "_push_from_checkpoint",  # (checkpoint_folder): hub_strategy uploads after a checkpoint save
        "_finish_current_push",  # (): wait for the checkpoint uploads still running
        "_load_callback_state",  # (): a resumed run's saved callback states into the callbacks (after the state loaded)
    }
)


class TrainerSurface(Protocol):
    """The facade as its collaborators use it: transformers' public ``Trainer`` attributes and methods, plus the
    :data:`OVERRIDE_POINTS`."""

    args: Any
    state: TrainerState
    control: TrainerControl
    model: nn.Module
    model_init: Callable[..., nn.Module] | None
    processing_class: Any
    data_collator: Callable[..., Any]
    train_dataset: Any
    eval_dataset: Any
    optimizer: torch.optim.Optimizer | None
    lr_scheduler: Any
    callback_handler: CallbackHandler
    accelerator: Any  # hflight.accelerator_compat.RunAccelerator
    gather_function: Callable[..., Any]  # accelerator.gather_for_metrics, or .gather (transformers' Seq2SeqTrainer)
    compute_metrics: Callable[..., dict] | None
    compute_loss_func: Callable[..., Any] | None
    preprocess_logits_for_metrics: Callable[..., Any] | None
    label_names: list[str]
    label_smoother: Any
    model_accepts_loss_kwargs: bool
    can_return_loss: bool
    loss_is_scaled_for_ga: bool | None
    restore_callback_attributes: bool
    current_gradient_accumulation_steps: int
    current_flos: float
    is_in_train: bool
    hp_search_backend: str | None
    hp_space: Callable[[Any], dict[str, Any]]
    hp_name: Callable[[Any], str] | None
    compute_objective: Callable[[dict[str, float]], float]
    objective: Any

    # ---- public methods -----------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, **kwargs: Any) -> Any: ...
    def evaluate(
        self, eval_dataset: Any = None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]: ...  # noqa: E501
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None: ...
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer: ...
    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None: ...
    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any: ...
    def get_train_dataloader(self) -> DataLoader: ...
    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader: ...
    def get_test_dataloader(self, test_dataset: Any) -> DataLoader: ...
    def evaluation_loop(
        self,
        dataloader: DataLoader,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> Any: ...  # noqa: E501
    def num_examples(self, dataloader: DataLoader) -> int: ...
    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor: ...  # noqa: E501
    def compute_loss(
        self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any: ...  # noqa: E501
    def prediction_step(
        self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys: list[str] | None = None
    ) -> tuple[Any, Any, Any]: ...  # noqa: E501
    def floating_point_ops(self, inputs: dict[str, Any]) -> int: ...
    def compute_loss_context_manager(self) -> contextlib.ExitStack: ...
    def set_initial_training_values(self, args: Any, dataloader: DataLoader) -> tuple[int, ...]: ...
    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list, Any]: ...
    def store_flos(self) -> None: ...
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None: ...
    def is_world_process_zero(self) -> bool: ...
    def is_local_process_zero(self) -> bool: ...

    # ---- transformers' protected override points (OVERRIDE_POINTS) ----------------------------------------------
    def _evaluate(
        self, trial: Any, ignore_keys_for_eval: list[str] | None, skip_scheduler: bool = False
    ) -> dict[str, float]: ...  # noqa: E501
    def _determine_best_metric(self, metrics: dict[str, float], trial: Any) -> bool: ...
    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None: ...
    def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None: ...
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None: ...
    def _load_best_model(self) -> None: ...
    def _load_optimizer_and_scheduler(self, checkpoint: str) -> None: ...
    def _get_learning_rate(self) -> float: ...
    def _prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]: ...
    def _prepare_input(self, data: Any) -> Any: ...
    def _get_output_dir(self, trial: Any) -> str: ...
    def _get_num_items_in_batch(self, batch_samples: list[Any], device: torch.device | None) -> Any: ...
    def _remove_unused_columns(self, dataset: Any, description: str | None = None) -> Any: ...
    def _report_to_hp_search(self, trial: Any, step: int, metrics: dict[str, float]) -> None: ...
    def _load_callback_state(self) -> None: ...


class RunView(Protocol):
    """A run as the Lightning pieces use it. ``hflight.run.Run`` implements it; its docstring says what each field is
    and who sets it. (Typed loosely on purpose: the concrete types live in the pieces that take a ``RunView``, and
    importing them here would close an import circle.)"""

    facade: TrainerSurface
    fitting: bool
    lightning_trainer: L.Trainer
    module: Any  # hflight.run.module.HFModule
    world: Any  # hflight.run.distributed.World
    resume: Any  # hflight.checkpoints.resume.ResumePoint | None
    loop: Any  # hflight.run.loop.TrainingLoop (training runs)
    evaluator: Any  # hflight.run.evaluation.Evaluator while an evaluation runs
    checkpoint_writer: Any  # hflight.checkpoints.asynchronous.CheckpointWriter (save_async: a background writer)

    @property
    def plan(self) -> Any: ...  # hflight.run.plan.TrainingPlan, set by the loop when the fit starts
    @property
    def epochs_offset(self) -> int: ...
    @property
    def epoch_start_rng(self) -> dict[str, Any] | None: ...  # the RNG streams as the epoch drew its data order
    @property
    def data_position(self) -> tuple[dict, dict, dict | None, str | None] | None: ...  # for a checkpoint

    train_batch_size: int

    @property
    def backend(self) -> Any: ...  # hflight.run.backend.HFBackend
    def weight_hooks(self, method: str) -> list[Any]: ...
    def evaluation_weights(self) -> contextlib.ExitStack: ...
    def evaluating(self, evaluator: Any) -> contextlib.AbstractContextManager[Any]: ...


def weight_hooks(callbacks: Any, method: str) -> list[Any]:
    """The weights protocol's discovery (``hflight.callbacks.hooks``): the callbacks that take part in it through
    ``method`` (``averaged_weights``, ``save_checkpoint_state``, ``check_checkpoint_state``,
    ``load_checkpoint_state``), i.e. those that define it. Here, at the bottom, so that ``hflight.checkpoints`` finds
    them without importing the callbacks' package above it."""
    return [cb for cb in callbacks if callable(getattr(cb, method, None))]
