"""The LightningModule around a transformers model: one optimizer step per accumulation cycle, HF's order.

Manual optimization, because HF's step differs from Lightning's automatic one in ways that change numbers:
the loss of an epoch's last, shorter cycle is divided by that cycle's length, the gradient norm is clipped
after unscaling and *then* ``on_pre_optimizer_step`` fires, and the scheduler steps only when the optimizer
really stepped. Lightning still owns devices, precision (autocast, gradient scaling), strategy wrapping and
the loop; the facade's override points (``training_step``, ``compute_loss``, ``create_optimizer``, ...) do the
per-batch work, so subclasses of the facade keep working.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from typing_extensions import override

from hflight.datamodule import MicroBatch

if TYPE_CHECKING:
    from hflight.trainer import Trainer


class HFModule(L.LightningModule):
    """Wraps ``model`` (a ``PreTrainedModel`` or any ``nn.Module`` returning a loss) for a ``lightning.Trainer``."""

    def __init__(self, facade: Trainer, model: torch.nn.Module) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.model = model
        self._facade = facade

    @override
    def forward(self, **inputs: Any) -> Any:
        return self.model(**inputs)

    @override
    def configure_optimizers(self) -> OptimizerLRScheduler:
        facade = self._facade
        facade.create_optimizer_and_scheduler(num_training_steps=facade._plan.max_steps)
        return {
            "optimizer": facade.optimizer,
            "lr_scheduler": {"scheduler": facade.lr_scheduler, "interval": "step"},
        }

    @override
    def on_train_batch_start(self, batch: MicroBatch, batch_idx: int) -> int | None:
        # Returning -1 is Lightning's way to end the epoch now: HF's should_epoch_stop.
        if self._facade.control.should_epoch_stop:
            return -1
        return None

    @override
    def training_step(self, batch: MicroBatch, batch_idx: int) -> None:
        facade = self._facade
        loop = facade._loop
        if batch.index == 0:
            loop.step_begin()
        facade.current_gradient_accumulation_steps = batch.cycle_size
        loss = facade.training_step(self.model, batch.inputs, batch.num_items_in_batch)
        loop.add_loss(loss, batch.inputs)
        if batch.is_last:
            self._optimizer_step(batch)
        else:
            loop.substep_end()
        if facade.control.should_training_stop:
            self.trainer.should_stop = True

    def _optimizer_step(self, batch: MicroBatch) -> None:
        facade = self._facade
        optimizer = self.optimizers()
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        scale_before = scaler.get_scale() if scaler is not None else None
        # Clipping and on_pre_optimizer_step run inside step(), in on_before_optimizer_step: that is the only
        # point where mixed-precision gradients are already unscaled.
        optimizer.step()
        facade._loop.optimizer_stepped()
        learning_rate = facade._get_learning_rate()
        skipped = scaler is not None and scaler.get_scale() < scale_before
        if not skipped and not isinstance(facade.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            facade.lr_scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        facade._loop.step_end(batch.step_in_epoch, learning_rate)

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._facade._loop.clip_and_pre_step(self.trainer.strategy.model)

    # Evaluation through Lightning's validate loop (``Trainer.evaluate``/``predict`` outside of ``fit``).
    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._facade._evaluator.step(batch)
