"""ONNX Runtime for hflight: ORT evaluation on the current stack, ORTModule training where onnxruntime-training is
installed, and optimum's ``ORTTrainer`` API.

``from hflight.ort import ORTStrategy, ORTTrainer, ORTTrainingArguments``. Importing this package does not import
onnxruntime; building a strategy does, and a missing package raises one error that says what to install.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hflight.ort' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
