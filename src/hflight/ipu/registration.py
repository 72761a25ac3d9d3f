"""Registers the IPU backend with Lightning: accelerator ``"ipu"`` and strategy ``"ipu"`` (no poptorch import)."""

from __future__ import annotations

from typing import Any


def register(accelerator_registry: Any, strategy_registry: Any) -> None:
    from hflight.arguments.registry import DEFAULT_STRATEGIES, STRATEGY_ACCELERATORS
    from hflight.ipu.accelerator import IPUAccelerator
    from hflight.ipu.strategy import IPUStrategy

    IPUAccelerator.register_accelerators(accelerator_registry)
    IPUStrategy.register_strategies(strategy_registry)
    DEFAULT_STRATEGIES[IPUAccelerator.name()] = IPUStrategy.strategy_name
    STRATEGY_ACCELERATORS[IPUStrategy.strategy_name] = IPUAccelerator.name()
