"""ONNX Runtime for hflight: ORT evaluation on the current stack, ORTModule training where onnxruntime-training is
installed, and optimum's ``ORTTrainer`` API.

``from hflight.ort import ORTStrategy, ORTTrainer, ORTTrainingArguments``. Importing this package does not import
onnxruntime; building a strategy does, and a missing package raises one error that says what to install.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hflight._lazy import lazy_exports

_EXPORTS = {
    "ORTStrategy": "hflight.ort.strategy",
    "ORTTrainer": "hflight.ort.trainer",
    "ORTTrainingArguments": "hflight.ort.trainer",
    "ORTEvaluationModel": "hflight.ort.session",
}

__all__ = ["ORTEvaluationModel", "ORTStrategy", "ORTTrainer", "ORTTrainingArguments"]

if TYPE_CHECKING:
    from hflight.ort.session import ORTEvaluationModel
    from hflight.ort.strategy import ORTStrategy
    from hflight.ort.trainer import ORTTrainer, ORTTrainingArguments


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
