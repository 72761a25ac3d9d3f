"""The ``poptorch_double`` fixture: installs the CPU double of poptorch for one test (tests/ipu/poptorch_double.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

DOUBLE_PATH = Path(__file__).with_name("poptorch_double.py")


@pytest.fixture
def poptorch_double(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A fresh copy of the double (its own IPU pool, wrapper registry and options) installed as ``poptorch``,
    ``poptorch.optim`` and ``poptorch.enums`` for this test only."""
    spec = importlib.util.spec_from_file_location("poptorch", DOUBLE_PATH)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "poptorch", module)  # before executing it: its dataclasses look it up
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "poptorch.optim", module.optim)
    monkeypatch.setitem(sys.modules, "poptorch.enums", module.enums)
    yield module


@pytest.fixture
def executors(poptorch_double, monkeypatch):
    """Every PoplarExecutor the run creates, kept after teardown for inspection."""
    created = []
    for name in ("trainingModel", "inferenceModel"):
        original = getattr(poptorch_double, name)

        def spy(*args, _original=original, **kwargs):
            executor = _original(*args, **kwargs)
            created.append(executor)
            return executor

        monkeypatch.setattr(poptorch_double, name, spy)
    return created
