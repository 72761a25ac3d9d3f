"""Fixtures of the IPU tests: the CPU double of poptorch installed for one test (tests/ipu/poptorch_double.py), and
the executors a run creates (see double_runner.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

_spec = importlib.util.spec_from_file_location("ipu_double_runner", Path(__file__).with_name("double_runner.py"))
double_runner = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(double_runner)


@pytest.fixture
def poptorch_double(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A fresh copy of the double (its own IPU pool, wrapper registry and options) installed as ``poptorch``,
    ``poptorch.optim`` and ``poptorch.enums`` for this test only."""
    yield double_runner.install(lambda name, module: monkeypatch.setitem(sys.modules, name, module))


@pytest.fixture
def executors(poptorch_double, monkeypatch):
    """Every PoplarExecutor the run creates, kept after teardown for inspection."""
    return double_runner.record_executors(poptorch_double, monkeypatch.setattr)
