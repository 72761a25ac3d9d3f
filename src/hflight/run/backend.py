"""How a Lightning strategy takes part in hflight's HF loop.

hflight's loop (``module``, ``datamodule``, ``evaluation``, ``checkpoint``) is written for eager PyTorch under any
Lightning strategy (single device, DDP, FSDP, DeepSpeed): Lightning places the model and wraps it, hflight runs the
steps. A few backends change *what runs a step*, not only where: on a Graphcore IPU, poptorch runs forward,
backward and the optimizer step in one compiled call and accumulates gradients on the device; with ONNX Runtime,
evaluation runs an exported graph and training may run through ``ORTModule``. Such a strategy also subclasses
:class:`HFBackend` and overrides the hooks it needs. The loop asks :func:`backend_of` for the running strategy's
hooks and never tests which backend it runs on; every other strategy gets the defaults below, which are exactly
the eager behaviour.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hflight.arguments.optimizers import step_taken_in_backward, updates_in_backward
from hflight.checkpoints.forms import CheckpointForm, ProcessZeroState

if TYPE_CHECKING:
    import lightning as L

    from hflight.surface import TrainerSurface

__all__ = [
    "HFBackend",
    "StepGeometry",
    "backend_of",
]


@dataclass(frozen=True)
class StepGeometry:
    """How many host micro-batches make one optimizer step, and how many samples that step consumes in all."""

    accumulation: int
    samples_per_step: int


class HFBackend:
    """Hooks through which a strategy changes hflight's loop. The defaults are eager PyTorch.

    Method names carry an ``hf_`` prefix so they never collide with Lightning's own ``Strategy`` methods
    (``training_step``, ``optimizer_step``, ``process_dataloader``, ...), which keep their Lightning meaning.
    """

    #: whether the loss may be normalised by the label items counted on the host (transformers' ``num_items_in_batch``)
    hf_counts_loss_items: bool = True
    #: whether a mixed-precision run autocasts the model's forward, as accelerate's ``prepare_model`` wraps it
    #: (``hflight.run.autocast``); a backend that casts by other means (FSDP2's ``MixedPrecisionPolicy``) says False
    hf_forward_autocast: bool = True

    def hf_geometry(self, args: Any, world_size: int, batch_size: int) -> StepGeometry:
        """Gradient accumulation on the host: ``gradient_accumulation_steps`` micro-batches of ``batch_size`` (the
        run's per-device training batch: ``per_device_train_batch_size``, or less after ``auto_find_batch_size``) per
        optimizer step."""
        accumulation = args.gradient_accumulation_steps
        return StepGeometry(accumulation, batch_size * accumulation * world_size)

    def hf_data_parallel(self, world_size: int, rank: int) -> tuple[int, int]:
        """The data-parallel replicas of a run of ``world_size`` processes and this process's replica (``rank``: its
        global rank): the loaders are dealt per replica. Every process is one, except where several processes share
        one batch (tensor parallelism: the ranks of a tensor-parallel group)."""
        return world_size, rank

    def hf_clip_grad_norm(self, parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        """The gradients' total 2-norm, the gradients clipped to ``max_norm`` (torch's ``clip_grad_norm_``)."""
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)

    def hf_run_planned(self, args: Any, model: torch.nn.Module, num_training_steps: int) -> None:
        """Once a fit knows its length (``num_training_steps`` optimizer steps; the loaders built, the model not set
        up by the strategy yet): a backend whose configuration needs the model or the run's length completes it here
        (DeepSpeed's ``"auto"`` values)."""

    def hf_prepare_loader(self, loader: Any, training: bool) -> Any:
        """The loader the loop iterates (a backend may re-batch it, e.g. into poptorch's combined batches)."""
        return loader

    def hf_evaluation_rows(self, eval_batch_size: int) -> int:
        """The rows one evaluation batch's loss stands for in ``eval_loss`` (transformers repeats each batch's loss
        ``eval_batch_size`` times before it gathers and cuts the losses); a backend whose evaluation loader re-batches
        (:meth:`hf_prepare_loader`) says how many rows its batches hold."""
        return eval_batch_size

    def hf_micro_batch(
        self, strategy: Any, last: bool, sync_each_batch: bool = False
    ) -> contextlib.AbstractContextManager[Any]:
        """The context of one micro-batch's forward and backward; ``last``: it ends its accumulation cycle. Those
        before the last keep their gradients local, added to the process's own without a collective (DDP's
        ``no_sync``, which accelerate's ``accumulate`` enters, through Lightning's ``block_backward_sync``); the last
        synchronises the sum once. ``sync_each_batch`` (accelerator_config's ``gradient_accumulation_kwargs``):
        every micro-batch synchronises, as transformers then enters no ``no_sync``."""
        block = getattr(strategy, "block_backward_sync", None)
        return block() if block is not None and not (last or sync_each_batch) else contextlib.nullcontext()

    def hf_configure_optimizer(self, facade: TrainerSurface) -> None:
        """Called once the facade built its optimizer and scheduler for a fit (a backend may convert them)."""

    def hf_training_model(self, model: torch.nn.Module) -> Callable[..., Any]:
        """What the facade's ``training_step``/``compute_loss`` call as ``model`` during a fit."""
        return model

    def hf_optimizer_step(self, module: L.LightningModule) -> bool:
        """One optimizer step on the host; False when mixed precision skipped it (inf/NaN gradients; never for a
        fused optimizer, as accelerate's ``optimizer_step_was_skipped``). An optimizer
        that updated the parameters during the backward pass (LOMO, layer-wise GaLore/APOLLO) takes no step, as in
        transformers: clipping and ``on_pre_optimizer_step`` run all the same."""
        optimizer = module.optimizers()
        if updates_in_backward(optimizer.optimizer):
            module.on_before_optimizer_step(optimizer.optimizer)
            step_taken_in_backward(module.facade.lr_scheduler)
            return True
        scaler = getattr(module.trainer.precision_plugin, "scaler", None)
        scale_before = scaler.get_scale() if scaler is not None else None
        # Clipping and on_pre_optimizer_step run inside step(), in on_before_optimizer_step: the one point
        # where mixed-precision gradients are already unscaled.
        optimizer.step()
        if getattr(optimizer.optimizer, "_step_supports_amp_scaling", False):
            # a fused optimizer skips an overflowed update inside its own step, which GradScaler calls all the same:
            # accelerate never reports that step skipped, so transformers steps the scheduler
            return True
        return not (scaler is not None and scaler.get_scale() < scale_before)

    def hf_after_scheduler_step(self, optimizer: torch.optim.Optimizer) -> None:
        """After the scheduler stepped (a backend whose optimizer runs elsewhere pushes the new learning rate)."""

    @contextlib.contextmanager
    def hf_evaluation_model(self, model: torch.nn.Module, label_names: list[str]) -> Iterator[Callable[..., Any]]:
        """What evaluation and prediction call as ``model``, for one evaluation run (``label_names``: the batch keys
        that are labels, not model inputs)."""
        yield model

    def hf_sync_to_host(self) -> None:
        """Before a checkpoint or ``save_model``: make the host model's weights current."""

    def hf_configure_model(self, model: torch.nn.Module) -> None:
        """Lightning's ``configure_model`` moment (the processes are connected, nothing is set up): a strategy that
        shards the model (FSDP2's ``fully_shard``) does it here, in place; the model may be sharded already (a later
        ``train()``/``evaluate()`` of the same trainer)."""

    def hf_checkpoint_state(self) -> CheckpointForm:
        """How the run's model and optimizer states go into a checkpoint: its form (``hflight.checkpoints.forms``: the
        optimizer file or folder, the model files beside ``save_model``'s, the whole state dict ``save_model`` writes,
        gathered from the shards of a sharded model, whether it can be written in the background)."""
        return ProcessZeroState()

    def hf_save_files(self, output_dir: str) -> None:
        """Extra files a backend writes next to a saved model (e.g. its own config)."""


_EAGER = HFBackend()


def backend_of(strategy: Any) -> HFBackend:
    """The hooks of ``strategy``: its own when it is an :class:`HFBackend`, the eager defaults otherwise."""
    return strategy if isinstance(strategy, HFBackend) else _EAGER
