"""The poptorch test double for a test or for a whole script (test code, never shipped).

- :func:`install` loads ``poptorch_double.py`` as ``poptorch`` (and its ``optim``/``enums`` submodules);
  ``conftest.py``'s fixture installs it per test, this module's ``main`` for a child process.
- :func:`record_executors` keeps every ``PoplarExecutor`` a run creates (after teardown too), to inspect what the
  simulated device received.
- ``python double_runner.py RECORD.json SCRIPT.py [ARGS...]`` runs ``SCRIPT.py`` as ``__main__`` (as ``python
  SCRIPT.py ARGS...`` would) against the double, then writes what each executor received to ``RECORD.json``: its
  options (replication, device iterations, gradient accumulation, output mode, seed, the option calls) and each call
  (input shapes, micro-batches, optimizer steps). The record is written even when the script fails, so a test can
  tell what reached the device before the failure.
"""

from __future__ import annotations

import importlib.util
import json
import runpy
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

DOUBLE_PATH = Path(__file__).with_name("poptorch_double.py")


def install(register: Callable[[str, ModuleType], Any]) -> ModuleType:
    """Load a fresh copy of the double and ``register(name, module)`` it as ``poptorch``, ``poptorch.optim`` and
    ``poptorch.enums`` (``register`` puts it in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location("poptorch", DOUBLE_PATH)
    module = importlib.util.module_from_spec(spec)
    register("poptorch", module)  # before executing it: its dataclasses look it up
    spec.loader.exec_module(module)
    register("poptorch.optim", module.optim)
    register("poptorch.enums", module.enums)
    return module


def record_executors(poptorch: ModuleType, patch: Callable[[Any, str, Any], Any]) -> list[Any]:
    """Every executor ``poptorch.trainingModel``/``inferenceModel`` creates from now on (``patch(obj, name, value)``
    replaces the two functions with recording ones)."""
    created: list[Any] = []
    for name in ("trainingModel", "inferenceModel"):
        original = getattr(poptorch, name)

        def spy(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            executor = _original(*args, **kwargs)
            created.append(executor)
            return executor

        patch(poptorch, name, spy)
    return created


def describe(executor: Any) -> dict[str, Any]:
    """What the device received through ``executor``: its options and its calls, as JSON values."""
    options = executor.options
    return {
        "training": executor._training,
        "replication_factor": options.replication_factor,
        "device_iterations": options.device_iterations,
        "gradient_accumulation": options.Training.gradient_accumulation,
        "output_mode": options.output_mode,
        "random_seed": options.random_seed,
        "option_calls": [[name, [repr(a) for a in args]] for name, args in options.calls],
        "calls": [
            {"input_shapes": call.input_shapes, "micro_batches": call.micro_batches, "steps": call.optimizer_steps}
            for call in executor.calls
        ],
    }


def main() -> None:
    record_path, script, *script_args = sys.argv[1:]
    poptorch = install(sys.modules.__setitem__)
    executors = record_executors(poptorch, setattr)
    sys.argv = [script, *script_args]
    sys.path.insert(0, str(Path(script).resolve().parent))  # as `python SCRIPT.py` puts the script's folder first
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        Path(record_path).write_text(json.dumps([describe(e) for e in executors], indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
