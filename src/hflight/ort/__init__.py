"""ONNX Runtime for hflight: ORT evaluation on the current stack, ORTModule training where onnxruntime-training is
installed, and optimum's ``ORTTrainer`` API.

``from hflight.ort import ORTStrategy, ORTTrainer, ORTTrainingArguments`` (and ``ORTSeq2SeqTrainer``,
``ORTSeq2SeqTrainingArguments``); optimum's module paths work too (``hflight.ort.trainer``,
``hflight.ort.training_args``, ``hflight.ort.trainer_seq2seq``, ``hflight.ort.training_args_seq2seq``). Importing
this package does not import onnxruntime; evaluating through ONNX Runtime does, and a missing package raises one
error that says what to install.

Generation of encoder-decoder models through ONNX Runtime (encoder and decoder sessions under transformers'
``generate``, checked against eager generation): ``hflight.ort.generation``, used by ``ORTSeq2SeqTrainer``.

May import: the Lightning side (``strategy``, ``session``, ``generation``, ``checks``, ``runtime``) only the run's
backend hooks (``hflight.run.backend``), the arguments and the checkpoints; the optimum-compatible trainers also the
facade.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hflight._util import lazy_exports
from hflight.arguments.registry import register_backends

_EXPORTS = {
    "ModuleWithLoss": "hflight.ort.trainer",
    "ORTEvaluationModel": "hflight.ort.session",
    "ORTOptimizerNames": "hflight.ort.training_args",
    "ORTSeq2SeqTrainer": "hflight.ort.trainer_seq2seq",
    "ORTSeq2SeqTrainingArguments": "hflight.ort.training_args_seq2seq",
    "ORTStrategy": "hflight.ort.strategy",
    "ORTTrainer": "hflight.ort.trainer",
    "ORTTrainingArguments": "hflight.ort.training_args",
}

__all__ = [
    "ModuleWithLoss",
    "ORTEvaluationModel",
    "ORTOptimizerNames",
    "ORTSeq2SeqTrainer",
    "ORTSeq2SeqTrainingArguments",
    "ORTStrategy",
    "ORTTrainer",
    "ORTTrainingArguments",
]

if TYPE_CHECKING:
    from hflight.ort.session import ORTEvaluationModel
    from hflight.ort.strategy import ORTStrategy
    from hflight.ort.trainer import ModuleWithLoss, ORTTrainer
    from hflight.ort.trainer_seq2seq import ORTSeq2SeqTrainer
    from hflight.ort.training_args import ORTOptimizerNames, ORTTrainingArguments
    from hflight.ort.training_args_seq2seq import ORTSeq2SeqTrainingArguments


register_backends()  # lightning.Trainer(strategy=...) resolves hflight's names once this package is imported

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
