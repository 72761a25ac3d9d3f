"""hflight: the Hugging Face ``Trainer`` API, running on PyTorch Lightning.

Callbacks, state, control and result objects are transformers' own classes, re-exported, so a ``TrainerCallback``
written for ``transformers.Trainer`` works unchanged. Names are imported on first use (PEP 562): ``import hflight``
loads neither torch nor Lightning. hflight's backends (``hflight.ipu``, ``hflight.ort``) join Lightning's registries
when the training arguments are first imported (``hflight.arguments.registry``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hflight._util import lazy_exports  # also registers a stopped process's last exit callback
from hflight.version import __version__ as __version__

_EXPORTS = {
    "Trainer": "hflight.trainer.facade",
    "TrainingArguments": "hflight.arguments.training_args",
    "Seq2SeqTrainer": "hflight.trainer.seq2seq",
    "Seq2SeqTrainingArguments": "hflight.arguments.seq2seq_args",
    "TrainerCallback": "transformers.trainer_callback",
    "TrainerState": "transformers.trainer_callback",
    "TrainerControl": "transformers.trainer_callback",
    "EarlyStoppingCallback": "transformers.trainer_callback",
    "EvalPrediction": "transformers.trainer_utils",
    "TrainOutput": "transformers.trainer_utils",
    "EvalLoopOutput": "transformers.trainer_utils",
    "PredictionOutput": "transformers.trainer_utils",
    "get_last_checkpoint": "hflight.checkpoints.manifest",
    "verify_checkpoint": "hflight.checkpoints.manifest",
    "CheckpointWriteError": "hflight.checkpoints.folders",
    "IncompatibleTrainingState": "hflight.checkpoints.optim_state",
    "IncompleteCheckpointError": "hflight.checkpoints.manifest",
    "OutputDirInUse": "hflight.checkpoints.writelock",
    "UnsafeCheckpointFile": "hflight.checkpoints.manifest",
    "set_seed": "transformers.trainer_utils",
}

__all__ = [
    "CheckpointWriteError",
    "EarlyStoppingCallback",
    "EvalLoopOutput",
    "EvalPrediction",
    "IncompatibleTrainingState",
    "IncompleteCheckpointError",
    "OutputDirInUse",
    "PredictionOutput",
    "Seq2SeqTrainer",
    "Seq2SeqTrainingArguments",
    "TrainOutput",
    "Trainer",
    "TrainerCallback",
    "TrainerControl",
    "TrainerState",
    "TrainingArguments",
    "UnsafeCheckpointFile",
    "get_last_checkpoint",
    "set_seed",
    "verify_checkpoint",
]

if TYPE_CHECKING:
    from transformers.trainer_callback import EarlyStoppingCallback, TrainerCallback, TrainerControl, TrainerState
    from transformers.trainer_utils import EvalLoopOutput, EvalPrediction, PredictionOutput, TrainOutput, set_seed

    from hflight.arguments.seq2seq_args import Seq2SeqTrainingArguments
    from hflight.arguments.training_args import TrainingArguments
    from hflight.checkpoints.folders import CheckpointWriteError
    from hflight.checkpoints.manifest import get_last_checkpoint, verify_checkpoint
    from hflight.checkpoints.optim_state import IncompatibleTrainingState
    from hflight.checkpoints.writelock import OutputDirInUse
    from hflight.checkpoints.writers.files import IncompleteCheckpointError, UnsafeCheckpointFile
    from hflight.trainer.facade import Trainer
    from hflight.trainer.seq2seq import Seq2SeqTrainer


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
