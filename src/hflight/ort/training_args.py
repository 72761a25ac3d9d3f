"""``ORTTrainingArguments`` and ``ORTOptimizerNames`` at the module path optimum's imports use
(``optimum.onnxruntime.training_args`` becomes ``hflight.ort.training_args``).

hflight's ``TrainingArguments`` plus optimum's ORT fields (``use_module_with_loss``, ``save_onnx``, ``onnx_prefix``,
``onnx_log_level``, with optimum's validation: ``save_onnx=True`` needs an ``onnx_prefix``) and the ORT strategy's own
options (``ort_training``, ``ort_inference``, ``ort_quantize``, ``ort_exporter``). ``optim`` also takes the names of
:class:`ORTOptimizerNames` (``"adamw_ort_fused"``: onnxruntime-training's FusedAdam).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from transformers.utils import ExplicitEnum

from hflight.arguments.training_args import TrainingArguments
from hflight.ort.session import EXPORTERS

__all__ = ["ORT_LOG_LEVELS", "ORTOptimizerNames", "ORTTrainingArguments", "TRAINING_CHOICES"]

# ruff: noqa: UP045 - dataclass field types stay parser-friendly (HfArgumentParser, OmegaConf)

#: onnx_log_level -> ONNX Runtime's logger severity.
ORT_LOG_LEVELS = {"VERBOSE": 0, "INFO": 1, "WARNING": 2, "ERROR": 3, "FATAL": 4}
#: ort_training -> ORTStrategy's ``training``.
TRAINING_CHOICES: dict[str, Any] = {"auto": "auto", "true": True, "false": False}


class ORTOptimizerNames(ExplicitEnum):
    """The ``optim`` names of optimizers implemented by ONNX Runtime (optimum's enum)."""

    ADAMW_ORT_FUSED = "adamw_ort_fused"


def ort_optimizer_name(optim: Any) -> ORTOptimizerNames | None:
    """``optim`` as an :class:`ORTOptimizerNames` member, or None when it names another optimizer."""
    try:
        return ORTOptimizerNames(getattr(optim, "value", optim))
    except ValueError:
        return None


@dataclass
class ORTTrainingArguments(TrainingArguments):
    """hflight's ``TrainingArguments`` plus optimum's ORT fields and the ORT strategy's options.

    ``use_module_with_loss=True`` trains through :class:`~hflight.ort.trainer.ModuleWithLoss` (the loss computed
    inside the module ORTModule runs, as optimum does). ``save_onnx=True`` exports the trained model to
    ``{output_dir}/{onnx_prefix}model.onnx`` at the end of ``train()`` and, as in optimum, requires ``onnx_prefix``.
    """

    use_module_with_loss: bool = field(
        default=False,
        metadata={"help": "Compute the loss inside the module ORTModule runs (optimum's ModuleWithLoss wrapper)."},
    )
    save_onnx: bool = field(
        default=False, metadata={"help": "Export the trained model to ONNX in output_dir (needs onnx_prefix)."}
    )
    onnx_prefix: Optional[str] = field(
        default=None, metadata={"help": "File name prefix of the saved ONNX model. Must be provided if save_onnx."}
    )
    onnx_log_level: str = field(
        default="WARNING", metadata={"help": "ONNX Runtime log level.", "choices": list(ORT_LOG_LEVELS)}
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
        # "adamw_ort_fused" is a registered backend optimizer, which the parent accepts as a string; optimum gives it
        # as an ORTOptimizerNames member.
        super().__post_init__()
        ort_optim = ort_optimizer_name(self.optim)
        if ort_optim is not None:
            self.optim = ort_optim
        if self.save_onnx and not self.onnx_prefix:
            raise ValueError("onnx_prefix must be provided if save_onnx is True")
        if self.onnx_log_level not in ORT_LOG_LEVELS:
            raise ValueError(f"onnx_log_level must be one of {', '.join(ORT_LOG_LEVELS)}, got {self.onnx_log_level!r}")
        if str(self.ort_training).lower() not in TRAINING_CHOICES:
            raise ValueError(f"ort_training must be auto, true or false, got {self.ort_training!r}")
        if self.ort_exporter not in EXPORTERS:
            raise ValueError(f"ort_exporter must be one of {', '.join(EXPORTERS)}, got {self.ort_exporter!r}")
        if self.ort_quantize not in (None, "dynamic"):
            raise ValueError(f"ort_quantize must be None or 'dynamic', got {self.ort_quantize!r}")
