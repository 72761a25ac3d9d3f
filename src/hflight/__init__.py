"""hflight: the Hugging Face ``Trainer`` API, running on PyTorch Lightning.

Callbacks, state and control objects are transformers' own classes, re-exported, so a ``TrainerCallback``
written for ``transformers.Trainer`` works unchanged. Names are imported on first use (PEP 562). Importing the
package registers hflight's backends (``hflight.ipu``, ``hflight.ort``) with Lightning's registries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hflight._lazy import lazy_exports
from hflight.version import __version__ as __version__

_EXPORTS = {
    "Trainer": "hflight.trainer",
    "TrainingArguments": "hflight.training_args",
    "Seq2SeqTrainer": "hflight.seq2seq_trainer",
    "Seq2SeqTrainingArguments": "hflight.seq2seq_args",
    "TrainerCallback": "transformers.trainer_callback",
    "TrainerState": "transformers.trainer_callback",
    "TrainerControl": "transformers.trainer_callback",
    "EarlyStoppingCallback": "transformers.trainer_callback",
    "EvalPrediction": "hflight.outputs",
    "TrainOutput": "hflight.outputs",
    "EvalLoopOutput": "hflight.outputs",
    "PredictionOutput": "hflight.outputs",
    "get_last_checkpoint": "hflight.checkpoint",
    "set_seed": "transformers.trainer_utils",
}

__all__ = [
    "EarlyStoppingCallback",
    "EvalLoopOutput",
    "EvalPrediction",
    "PredictionOutput",
    "Seq2SeqTrainer",
    "Seq2SeqTrainingArguments",
    "TrainOutput",
    "Trainer",
    "TrainerCallback",
    "TrainerControl",
    "TrainerState",
    "TrainingArguments",
    "get_last_checkpoint",
    "set_seed",
]

if TYPE_CHECKING:
    from transformers.trainer_callback import EarlyStoppingCallback, TrainerCallback, TrainerControl, TrainerState
    from transformers.trainer_utils import set_seed

    from hflight.checkpoint import get_last_checkpoint
    from hflight.outputs import EvalLoopOutput, EvalPrediction, PredictionOutput, TrainOutput
    from hflight.seq2seq_args import Seq2SeqTrainingArguments
    from hflight.seq2seq_trainer import Seq2SeqTrainer
    from hflight.trainer import Trainer
    from hflight.training_args import TrainingArguments


def _register_backends() -> None:
    # Explicit and idempotent: hflight's accelerators and strategies ("ipu", "ort") join Lightning's registries, so
    # TrainingArguments(accelerator="ipu") and lightning.Trainer(strategy="ort") resolve them. No poptorch/onnxruntime.
    from hflight.backend import register_backends

    register_backends()


_register_backends()


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
