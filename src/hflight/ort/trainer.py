"""``ORTTrainer`` and ``ORTTrainingArguments``: optimum's ONNX Runtime trainer API as an hflight ``Trainer``.

Code written for optimum's ``ORTTrainer`` (removed in optimum 2.x) changes one import::

    from hflight.ort import ORTTrainer, ORTTrainingArguments   # was: from optimum.onnxruntime import ...

The trainer is the facade on an :class:`~hflight.ort.ORTStrategy`: ORTModule training where onnxruntime-training
is installed (eager PyTorch otherwise, said once), evaluation and prediction through an ONNX Runtime session.
``optim="adamw_ort_fused"`` selects onnxruntime-training's FusedAdam.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from transformers.trainer_utils import TrainOutput

from hflight.callbacks.hooks import evaluation_weights
from hflight.ort.session import EXPORTERS, export_logits
from hflight.ort.strategy import ORTStrategy
from hflight.trainer import Trainer
from hflight.training_args import TrainingArguments

log = logging.getLogger(__name__)

__all__ = ["ORTTrainer", "ORTTrainingArguments"]

# ruff: noqa: UP045 - dataclass field types stay parser-friendly (HfArgumentParser, OmegaConf)

_ORT_LOG_LEVELS = {"VERBOSE": 0, "INFO": 1, "WARNING": 2, "ERROR": 3, "FATAL": 4}
_TRAINING_CHOICES = {"auto": "auto", "true": True, "false": False}


@dataclass
class ORTTrainingArguments(TrainingArguments):
    """hflight's ``TrainingArguments`` plus optimum's ORT fields and the ORT strategy's options.

    ``optim`` also accepts ``"adamw_ort_fused"``. ``use_module_with_loss`` is accepted for compatibility: hflight
    always runs the model's own loss inside ORTModule.
    """

    use_module_with_loss: bool = field(
        default=False, metadata={"help": "optimum's flag; hflight always computes the model's loss inside ORTModule."}
    )
    save_onnx: bool = field(default=False, metadata={"help": "Export the trained model to ONNX in output_dir."})
    onnx_prefix: Optional[str] = field(default=None, metadata={"help": "File name prefix of the saved ONNX model."})
    onnx_log_level: str = field(
        default="WARNING", metadata={"help": "ONNX Runtime log level.", "choices": list(_ORT_LOG_LEVELS)}
    )
    ort_training: str = field(
        default="auto", metadata={"help": "ORTModule training: auto (where installed), true or false."}
    )
    ort_inference: bool = field(default=True, metadata={"help": "Evaluate and predict through ONNX Runtime."})
    ort_quantize: Optional[str] = field(
        default=None, metadata={"help": "None, or 'dynamic': int8 dynamic quantization of the evaluation graph."}
    )
    ort_exporter: str = field(
        default="torchscript", metadata={"help": "ONNX exporter: torchscript or dynamo.", "choices": list(EXPORTERS)}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.onnx_log_level not in _ORT_LOG_LEVELS:
            raise ValueError(f"onnx_log_level must be one of {', '.join(_ORT_LOG_LEVELS)}, got {self.onnx_log_level!r}")
        if str(self.ort_training).lower() not in _TRAINING_CHOICES:
            raise ValueError(f"ort_training must be auto, true or false, got {self.ort_training!r}")
        if self.ort_exporter not in EXPORTERS:
            raise ValueError(f"ort_exporter must be one of {', '.join(EXPORTERS)}, got {self.ort_exporter!r}")
        if self.ort_quantize not in (None, "dynamic"):
            raise ValueError(f"ort_quantize must be None or 'dynamic', got {self.ort_quantize!r}")


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
        self.ort_strategy = ORTStrategy(
            inference=args.ort_inference,
            training=_TRAINING_CHOICES[str(args.ort_training).lower()],
            quantize=args.ort_quantize,
            exporter=args.ort_exporter,
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
    from hflight.ort.runtime import require_onnxruntime

    require_onnxruntime().set_default_logger_severity(_ORT_LOG_LEVELS[level])
