"""ONNX Runtime for hflight: ORT evaluation on the current stack, ORTModule training where onnxruntime-training is
installed, and optimum's ``ORTTrainer`` API.

``from hflight.ort import ORTStrategy, ORTTrainer, ORTTrainingArguments``; optimum's module paths work too
(``hflight.ort.trainer``, ``hflight.ort.training_args``). Importing this package does not import onnxruntime;
evaluating through ONNX Runtime does, and a missing package raises one error that says what to install.

May import: the Lightning side (``strategy``, ``session``, ``checks``, ``runtime``) only the run's backend hooks
(``hflight.run.backend``), the arguments and the checkpoints; the optimum-compatible ``trainer`` also the facade.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hflight._util import lazy_exports
from hflight.arguments.registry import register_backends

_EXPORTS = {
    "ModuleWithLoss": "hflight.ort.trainer",
    "ORTEvaluationModel": "hflight.ort.session",
    "ORTOptimizerNames": "hflight.ort.training_args",
    "ORTStrategy": "hflight.ort.strategy",
    "ORTTrainer": "hflight.ort.trainer",
    "ORTTrainingArguments": "hflight.ort.training_args",
}

__all__ = [
    "ModuleWithLoss",
    "ORTEvaluationModel",
    "ORTOptimizerNames",
    "ORTStrategy",
    "ORTTrainer",
    "ORTTrainingArguments",
]

if TYPE_CHECKING:
    from hflight.ort.session import ORTEvaluationModel
    from hflight.ort.strategy import ORTStrategy
    from hflight.ort.trainer import ModuleWithLoss, ORTTrainer
    from hflight.ort.training_args import ORTOptimizerNames, ORTTrainingArguments


register_backends()  # lightning.Trainer(strategy=...) resolves hflight's names once this package is imported

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
