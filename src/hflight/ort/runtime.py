"""onnxruntime, imported on demand: hflight imports it only when an ORT backend object is built."""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

logger = logging.getLogger(__name__)

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


#: Module names whose absence means onnxruntime-training is not installed (anything else is a broken install).
_ORTMODULE_PACKAGES = ("onnxruntime", "onnxruntime.training", "onnxruntime.training.ortmodule")


def _import_ortmodule() -> tuple[type | None, BaseException | None]:
    try:
        return importlib.import_module("onnxruntime.training.ortmodule").ORTModule, None
    except Exception as exc:  # ImportError, or what a broken install raises (OSError for a missing library, ...)
        return None, exc


def _not_installed(exc: BaseException | None) -> bool:
    return isinstance(exc, ModuleNotFoundError) and exc.name in _ORTMODULE_PACKAGES


def _broken(exc: BaseException) -> str:
    return (
        f"onnxruntime-training is installed, but ORTModule does not import: {type(exc).__name__}: {exc}. "
        "(A missing CUDA/ROCm library, a torch version it was not built for, or `python -m torch_ort.configure` not "
        "run.)"
    )


def ortmodule_class() -> type | None:
    """``onnxruntime.training.ortmodule.ORTModule`` where onnxruntime-training is installed, else None; an install
    that is there but does not import says why (a warning with its real error), then None."""
    cls, exc = _import_ortmodule()
    if exc is not None and not _not_installed(exc):
        logger.warning(_broken(exc))
    return cls


def require_ortmodule() -> type:
    """ORTModule, or an error: "not installed" (what to install) only when it is not; else the real import error."""
    cls, exc = _import_ortmodule()
    if cls is not None:
        return cls
    if _not_installed(exc):
        raise ModuleNotFoundError(ORTMODULE_MISSING) from exc
    raise ImportError(f"{_broken(exc)} {ORTMODULE_MISSING}") from exc
