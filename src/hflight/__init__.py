"""hflight: the Hugging Face ``Trainer`` API, running on PyTorch Lightning.

Callbacks, state and control objects are transformers' own classes, re-exported, so a ``TrainerCallback``
written for ``transformers.Trainer`` works unchanged.
"""

from transformers.trainer_callback import (
    EarlyStoppingCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
)
from transformers.trainer_utils import set_seed

from hflight.checkpoint import get_last_checkpoint
from hflight.outputs import EvalLoopOutput, EvalPrediction, PredictionOutput, TrainOutput
from hflight.trainer import Trainer
from hflight.training_args import TrainingArguments

__version__ = "0.1.0"

__all__ = [
    "EarlyStoppingCallback",
    "EvalLoopOutput",
    "EvalPrediction",
    "PredictionOutput",
    "TrainOutput",
    "Trainer",
    "TrainerCallback",
    "TrainerControl",
    "TrainerState",
    "TrainingArguments",
    "get_last_checkpoint",
    "set_seed",
]
