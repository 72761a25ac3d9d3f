"""onnxruntime, imported on demand: hflight imports it only when an ORT backend object is built."""

from __future__ import annotations

import importlib
from types import ModuleType

ONNXRUNTIME_MISSING = (
    'ONNX Runtime evaluation needs onnxruntime and onnx: pip install "hflight[ort]" '
    "(onnxruntime, onnx, onnxscript). For ORTModule training install onnxruntime-training instead of onnxruntime "
    "(never both: they share the package name); see requirements/ortmodule.txt."
)
ORTMODULE_MISSING = (
    "ORTModule training needs onnxruntime-training (its last release, 1.19.2, runs with torch 2.6.0) and torch-ort, "
    "configured with `python -m torch_ort.configure`; see requirements/ortmodule.txt and .ci/ortmodule-env."
)


def require_onnxruntime() -> ModuleType:
    """The ``onnxruntime`` module (with ``onnx`` importable), or one error that says what to install."""
    try:
        importlib.import_module("onnx")
        return importlib.import_module("onnxruntime")
    except ImportError as exc:
        raise ModuleNotFoundError(f"{ONNXRUNTIME_MISSING} ({exc})") from exc


def ortmodule_class() -> type | None:
    """``onnxruntime.training.ortmodule.ORTModule`` where onnxruntime-training is installed, else None."""
    try:
        return importlib.import_module("onnxruntime.training.ortmodule").ORTModule
    except Exception:  # ImportError, or the extension not configured (torch_ort.configure not run)
        return None


def require_ortmodule() -> type:
    cls = ortmodule_class()
    if cls is None:
        raise ModuleNotFoundError(ORTMODULE_MISSING)
    return cls
