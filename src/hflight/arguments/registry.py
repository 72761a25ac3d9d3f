"""hflight's backends in Lightning's registries.

:func:`register_backends` adds hflight's accelerators and strategy names to Lightning's registries, so
``TrainingArguments(accelerator="ipu")``, ``strategy="ipu"``, ``strategy="ort"`` and the Hydra options ``trainer=ipu`` /
``trainer=ort`` select them, and so does ``lightning.Trainer(strategy="ort")`` once ``hflight.ort`` (or
``hflight.ipu``) is imported. It runs when the arguments are first imported, not at ``import hflight``, and imports
neither poptorch nor onnxruntime: those are needed only when a backend is constructed, which then fails with one
message saying what to install.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = [
    "BACKEND_PACKAGES",
    "DEFAULT_STRATEGIES",
    "SHARDING_STRATEGIES",
    "STRATEGY_ACCELERATORS",
    "register_backends",
]

#: accelerator name -> the strategy hflight selects for it when ``strategy="auto"`` (filled by registration).
DEFAULT_STRATEGIES: dict[str, str] = {}
#: strategy name -> the accelerator hflight selects for it when ``accelerator="auto"`` (filled by registration).
STRATEGY_ACCELERATORS: dict[str, str] = {}

#: the sharding strategies for transformers' ``fsdp``/``deepspeed`` arguments: name -> builder(settings, process-group
#: settings) -> a Lightning strategy (filled by ``hflight.sharding.registration``).
SHARDING_STRATEGIES: dict[str, Callable[..., Any]] = {}

#: hflight's backend modules; each has ``register(accelerator_registry, strategy_registry)``.
BACKEND_PACKAGES: tuple[str, ...] = (
    "hflight.ipu.registration",
    "hflight.ort.registration",
    "hflight.sharding.registration",
)


def register_backends() -> None:
    """Add hflight's accelerators and strategies to Lightning's registries (idempotent)."""
    from lightning.pytorch.accelerators import AcceleratorRegistry
    from lightning.pytorch.strategies import StrategyRegistry

    for name in BACKEND_PACKAGES:
        importlib.import_module(name).register(AcceleratorRegistry, StrategyRegistry)
