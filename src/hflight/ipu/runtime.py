"""poptorch, imported on demand: hflight imports it only when an IPU backend object is built."""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

POPTORCH_MISSING = (
    "The IPU backend needs poptorch, Graphcore's PyTorch for IPUs, and it could not be imported. Install Graphcore's "
    "Poplar SDK, enable it (`source <poplar-sdk>/enable`) and install the poptorch wheel built for the torch in use "
    "(`pip install <poplar-sdk>/poptorch-*.whl`). Note that the last public poptorch (Poplar SDK 3.4) requires exactly "
    "torch==2.0.1, and this environment has torch=={torch}."
)


def require_poptorch() -> ModuleType:
    """The ``poptorch`` module, or one ``ModuleNotFoundError`` that says what to install."""
    try:
        return importlib.import_module("poptorch")
    except (ImportError, AssertionError) as exc:  # poptorch asserts the torch version it was built for at import
        raise ModuleNotFoundError(f"{POPTORCH_MISSING.format(torch=torch.__version__)} ({exc})") from exc


def poptorch_available() -> bool:
    try:
        require_poptorch()
    except ModuleNotFoundError:
        return False
    return True
