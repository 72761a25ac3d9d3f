"""``ORTTrainer``: optimum's ONNX Runtime trainer API as an hflight ``Trainer``, at the module path optimum's imports
use (``optimum.onnxruntime.trainer`` becomes ``hflight.ort.trainer``).

Code written for optimum's ``ORTTrainer`` (its last version with ORT training is optimum 1.27; optimum 2 removed it)
changes one import::

    from hflight.ort import ORTTrainer, ORTTrainingArguments   # was: from optimum.onnxruntime import ...

The trainer is the facade on an :class:`~hflight.ort.ORTStrategy`: ORTModule training where onnxruntime-training
is installed (eager PyTorch otherwise, said once), evaluation and prediction through an ONNX Runtime session whose
answers are checked against eager PyTorch. Kept from optimum: ``optim="adamw_ort_fused"`` (onnxruntime-training's
FusedAdam) and :meth:`ORTTrainer.get_ort_optimizer_cls_and_kwargs`, ``use_module_with_loss`` with
:class:`ModuleWithLoss` and :meth:`ORTTrainer.create_model_with_loss`, and optimum 1.13's
``evaluate/predict(inference_with_ort=...)``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from transformers.trainer_utils import PredictionOutput, TrainOutput

from hflight.arguments.training_args import TrainingArguments
from hflight.callbacks.hooks import evaluation_weights
from hflight.ort.registration import adamw_ort_fused
from hflight.ort.runtime import require_onnxruntime
from hflight.ort.session import export_logits
from hflight.ort.strategy import ORTStrategy
from hflight.ort.training_args import (
    ORT_LOG_LEVELS,
    TRAINING_CHOICES,
    ORTOptimizerNames,
    ORTTrainingArguments,
    ort_optimizer_name,
)
from hflight.trainer.facade import Trainer

log = logging.getLogger(__name__)

__all__ = ["ModuleWithLoss", "ORTOptimizerNames", "ORTTrainer", "ORTTrainingArguments"]


class ModuleWithLoss(nn.Module):
    """optimum's ``ModuleWithLoss``: the model and its loss in one module, so that ORTModule exports and runs the
    loss together with the forward pass (less peak memory than returning the outputs to PyTorch first).

    ``forward(inputs, return_outputs, num_items_in_batch)`` returns what the trainer's ``compute_loss`` returns for
    the wrapped model; :meth:`ORTTrainer.create_model_with_loss` sets that function as
    ``compute_model_plus_loss_internal``. Unlike optimum's, it is a plain ``nn.Module`` (optimum derived it from
    ``PreTrainedModel`` without a configuration of its own); ``config`` is the wrapped model's.
    """

    def __init__(self, model: nn.Module, args: TrainingArguments, label_smoother: Any) -> None:
        super().__init__()
        self._original_model = model
        self.args = args
        self.label_smoother = label_smoother
        self.compute_model_plus_loss_internal: Callable[..., Any] | None = None

    def forward(self, inputs: dict[str, Any], return_outputs: bool, num_items_in_batch: Any) -> Any:
        if self.compute_model_plus_loss_internal is None:
            raise RuntimeError("ModuleWithLoss: build it with ORTTrainer.create_model_with_loss().")
        return self.compute_model_plus_loss_internal(self._original_model, inputs, return_outputs, num_items_in_batch)

    @property
    def module(self) -> nn.Module:
        """The wrapped model (its ``.module`` when it is itself a wrapper, as with DDP)."""
        return getattr(self._original_model, "module", self._original_model)

    @property
    def config(self) -> Any:
        return self._original_model.config


class ORTTrainer(Trainer):
    """optimum's ``ORTTrainer`` signature on hflight's facade and the ORT strategy."""

    def __init__(
        self,
        model: nn.Module | None = None,
        args: TrainingArguments | None = None,
        data_collator: Callable | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        tokenizer: Any = None,
        model_init: Callable[..., nn.Module] | None = None,
        compute_metrics: Callable[[Any], dict] | None = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, Any] = (None, None),
        preprocess_logits_for_metrics: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        args = ORTTrainingArguments.from_args(args, "ORTTrainer")
        self.model_with_loss: ModuleWithLoss | None = None
        self.ort_strategy = ORTStrategy(
            inference=args.ort_inference,
            training=TRAINING_CHOICES[str(args.ort_training).lower()],
            quantize=args.ort_quantize,
            exporter=args.ort_exporter,
            loss_module=self._loss_module if args.use_module_with_loss else None,
        )
        self.lightning_strategy = self.ort_strategy
        _set_ort_log_level(args.onnx_log_level)
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=tokenizer,
            model_init=model_init,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )

    # ---- optimum's loss-in-module training --------------------------------------------------------------------
    def create_model_with_loss(self) -> ModuleWithLoss:
        """A :class:`ModuleWithLoss` around ``self.model`` computing ``hflight.Trainer.compute_loss`` (the loss of
        the base trainer, as optimum binds transformers' ``Trainer.compute_loss``)."""
        model_with_loss = ModuleWithLoss(self.model, self.args, self.label_smoother)
        model_with_loss.compute_model_plus_loss_internal = functools.partial(Trainer.compute_loss, self)
        return model_with_loss

    def _loss_module(self, model: nn.Module) -> ModuleWithLoss:
        """What the ORT strategy trains when ``use_module_with_loss`` is on (rebuilt when the model changed)."""
        if self.model_with_loss is None or self.model_with_loss._original_model is not model:
            self.model_with_loss = self.create_model_with_loss()
        return self.model_with_loss

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None):
        wrapped = getattr(model, "wrapped", model)  # the strategy's ORTModule wrapper keeps what it wraps here
        if isinstance(wrapped, ModuleWithLoss):
            # ORTModule takes plain dicts (not BatchEncoding), as optimum converts them
            return model(dict(inputs.items()), return_outputs, num_items_in_batch)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    # ---- optimizers ONNX Runtime implements -------------------------------------------------------------------
    @staticmethod
    def get_ort_optimizer_cls_and_kwargs(args: ORTTrainingArguments) -> tuple[Any, dict[str, Any]]:
        """The class and keyword arguments of the ONNX Runtime optimizer ``args.optim`` names (optimum's)."""
        if ort_optimizer_name(args.optim) is not ORTOptimizerNames.ADAMW_ORT_FUSED:
            name = getattr(args.optim, "value", args.optim)
            raise ValueError(f"ORTTrainer cannot instantiate unsupported optimizer: {name}")
        return adamw_ort_fused(args)

    @staticmethod
    def get_optimizer_cls_and_kwargs(args: Any, model: nn.Module | None = None) -> tuple[Any, Any]:
        if ort_optimizer_name(args.optim) is not None:
            return ORTTrainer.get_ort_optimizer_cls_and_kwargs(args)
        return Trainer.get_optimizer_cls_and_kwargs(args, model)

    # ---- evaluation and prediction, through ONNX Runtime or not (optimum <= 1.13's inference_with_ort) ----------
    def evaluate(
        self,
        eval_dataset: Any = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
        inference_with_ort: bool | None = None,
    ) -> dict[str, float]:
        """``inference_with_ort``: True evaluates through ONNX Runtime, False in eager PyTorch; None (the default)
        follows ``args.ort_inference`` (optimum 1.13's default was False: PyTorch)."""
        with self._inference_backend(inference_with_ort, "Evaluating"):
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def predict(
        self,
        test_dataset: Any,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "test",
        inference_with_ort: bool | None = None,
    ) -> PredictionOutput:
        """As :meth:`evaluate`, for predictions."""
        with self._inference_backend(inference_with_ort, "Predicting"):
            return super().predict(test_dataset, ignore_keys, metric_key_prefix)

    @contextlib.contextmanager
    def _inference_backend(self, inference_with_ort: bool | None, doing: str) -> Iterator[None]:
        if inference_with_ort is None:
            yield
            return
        log.info("%s with %s.", doing, "ONNX Runtime" if inference_with_ort else "PyTorch")
        with self.ort_strategy.inference_through_ort(inference_with_ort):
            yield

    # ---- the trained model as ONNX ------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, **kwargs: Any) -> TrainOutput:
        output = super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)
        if self.args.save_onnx and self.is_world_process_zero():
            self.save_onnx()
        return output

    def save_onnx(self, output_dir: str | None = None) -> str:
        """Export the model's logits to ``{output_dir}/{onnx_prefix}model.onnx`` (traced on one evaluation batch, or
        a training batch when there is no evaluation set). Returns the path."""
        output_dir = output_dir or self.args.output_dir
        os.makedirs(output_dir, exist_ok=True)
        dataset = self.eval_dataset if self.eval_dataset is not None else self.train_dataset
        loader = self._get_dataloader(dataset, "ONNX export", self.args.eval_batch_size, self._get_eval_sampler)
        batch = next(iter(loader))
        path = os.path.join(output_dir, f"{self.args.onnx_prefix or ''}model.onnx")
        with evaluation_weights(self.callback_handler.callbacks, self.model):
            export_logits(self.model, batch, path, self.label_names, self.args.ort_exporter)
        log.info("Saved the ONNX model to %s", path)
        return path


def _set_ort_log_level(level: str) -> None:
    """ONNX Runtime's log severity, where onnxruntime is installed (evaluating in PyTorch does not need it)."""
    try:
        ort = require_onnxruntime()
    except ModuleNotFoundError:
        return
    ort.set_default_logger_severity(ORT_LOG_LEVELS[level])
