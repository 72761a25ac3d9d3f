"""The LightningModule around a transformers model: one optimizer step per accumulation cycle, HF's order.

Manual optimization, because HF's step differs from Lightning's automatic one in ways that change numbers:
the loss of an epoch's last, shorter cycle is divided by that cycle's length, the gradient norm is clipped
after unscaling and *then* ``on_pre_optimizer_step`` fires, and the scheduler steps only when the optimizer
really stepped. Lightning still owns devices, precision (gradient scaling; autocast covers the model's forward
only, as accelerate's: ``hflight.run.autocast``), strategy wrapping and the loop; the facade's override points
(``training_step``, ``compute_loss``, ``create_optimizer``, ...) do the
per-batch work, so subclasses of the facade keep working. What a backend changes in a step (the model that runs
it, where the optimizer steps) comes from its hooks (``hflight.run.backend``). The step events go to the run's
training loop (``hflight.run.loop``), evaluation batches to the run's evaluator (``hflight.run.evaluation``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import lightning as L
import torch
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from typing_extensions import override

from hflight.arguments.launcher_env import compile_model
from hflight.arguments.optimizers import fused_backward, steps_on_metrics
from hflight.run.backend import HFBackend, backend_of
from hflight.run.datamodule import MicroBatch
from hflight.surface import RunView, TrainerSurface


class HFModule(L.LightningModule):
    """Wraps ``model`` (a ``PreTrainedModel`` or any ``nn.Module`` returning a loss) for a ``lightning.Trainer``."""

    def __init__(self, facade: TrainerSurface, run: RunView, model: torch.nn.Module) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.model = model
        self.facade = facade
        self.run = run
        self._evaluation = contextlib.ExitStack()
        self._compiled: torch.nn.Module | None = None  # args.torch_compile: the model as torch.compile returned it

    @property
    def backend(self) -> HFBackend:
        return backend_of(self.trainer.strategy)

    @override
    def forward(self, **inputs: Any) -> Any:
        return self.model(**inputs)

    @override
    def configure_model(self) -> None:
        # a sharding strategy shards the model here (it is called with the processes connected, before the
        # optimizer is built over the model's parameters)
        self.backend.hf_configure_model(self.model)

    @override
    def configure_optimizers(self) -> OptimizerLRScheduler:
        facade = self.facade
        facade.create_optimizer()  # transformers' train() calls these two (not create_optimizer_and_scheduler)
        facade.create_scheduler(num_training_steps=self.run.plan.max_steps)
        self.backend.hf_configure_optimizer(facade)
        if getattr(facade.lr_scheduler, "optimizer", None) is not facade.optimizer:
            # a scheduler over another optimizer (transformers' over a layer-wise one sees it through a wrapper):
            # hflight steps it; Lightning, which would refuse it, need not know it (manual optimization)
            return facade.optimizer
        return {
            "optimizer": facade.optimizer,
            "lr_scheduler": {"scheduler": facade.lr_scheduler, "interval": "step"},
        }

    @override
    def on_fit_start(self) -> None:
        # HF's training_step puts the model in train mode at every step; doing it once before the fit loop starts
        # also spares every run of a from_pretrained model (loaded in eval mode) Lightning's "module(s) in eval mode
        # at the start of training" warning.
        self.model.train()
        args = self.facade.args
        if args.torch_compile:
            self._compiled = compile_model(self.model, args)  # as accelerate's TorchDynamoPlugin

    @override
    def on_train_batch_start(self, batch: MicroBatch, batch_idx: int) -> int | None:
        # Returning -1 is Lightning's way to end the epoch now: HF's should_epoch_stop.
        if self.facade.control.should_epoch_stop:
            return -1
        return None

    @override
    def training_step(self, batch: MicroBatch, batch_idx: int) -> None:
        facade, loop = self.facade, self.run.loop
        if batch.index == 0:
            loop.step_begin()
        facade.current_gradient_accumulation_steps = batch.cycle_size
        model = self.backend.hf_training_model(self.model)
        if self._compiled is not None and model is self.model:  # a backend that runs its own graph is not compiled
            model = self._compiled
        # a micro-batch before the cycle's last keeps its gradients local (DDP's no_sync, as accelerate's accumulate)
        with self.backend.hf_micro_batch(self.trainer.strategy, batch.is_last, batch.sync_each_batch):
            loss = facade.training_step(model, batch.inputs, batch.num_items_in_batch)
        loop.add_loss(loss, batch.inputs)
        if batch.is_last:
            self._optimizer_step(batch)
        else:
            loop.substep_end()
        if facade.control.should_training_stop:
            self.trainer.should_stop = True

    def _optimizer_step(self, batch: MicroBatch) -> None:
        facade, backend, loop = self.facade, self.backend, self.run.loop
        stepped = backend.hf_optimizer_step(self)
        loop.optimizer_stepped()
        learning_rate = facade._get_learning_rate()
        if stepped and not steps_on_metrics(facade.lr_scheduler):  # those step after an evaluation, on its metric
            facade.lr_scheduler.step()
        backend.hf_after_scheduler_step(facade.optimizer)
        self.optimizers().zero_grad(set_to_none=True)
        loop.trained_through(batch.position)  # a checkpoint from here on records the data after this cycle
        loop.step_end(batch.step_in_epoch, learning_rate)

    @override
    def backward(self, loss: torch.Tensor, *args: Any, learning_rate: float | None = None, **kwargs: Any) -> None:
        """Lightning's backward hook, as accelerate's ``backward``: given the ``learning_rate`` (transformers'
        ``training_step`` passes it for "lomo"/"adalomo"), LOMO's ``fused_backward`` updates the parameters during the
        pass; otherwise ``loss.backward()``."""
        fused = fused_backward(self.facade.args, self.facade.optimizer) if learning_rate is not None else None
        if fused is None:
            if learning_rate is not None:  # as accelerate, which hands it on to torch
                kwargs["learning_rate"] = learning_rate
            super().backward(loss, *args, **kwargs)
        else:
            fused(loss, learning_rate)

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.run.loop.clip_and_pre_step(self.trainer.strategy.model)

    def pre_optimizer_step(self, grad_norm: torch.Tensor | float | None) -> None:
        """HF's ``on_pre_optimizer_step`` for a step whose gradients never reach the host (clipped elsewhere)."""
        self.run.loop.pre_optimizer_step(grad_norm)

    # Evaluation through Lightning's validate loop (``Trainer.evaluate``/``predict`` outside of ``fit``).
    @override
    def on_validation_start(self) -> None:
        evaluation = self.backend.hf_evaluation_model(self.model, self.facade.label_names)
        self.run.evaluator.model = self._evaluation.enter_context(evaluation)

    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.run.evaluator.step(batch)

    @override
    def on_validation_end(self) -> None:
        self.close_evaluation()

    def close_evaluation(self) -> None:
        """Leave the backend's evaluation model (also when validation failed half-way)."""
        self._evaluation.close()
