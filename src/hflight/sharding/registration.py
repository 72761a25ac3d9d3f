"""Registers the sharding strategies with the arguments (their builders; nothing is imported until one is built)."""

from __future__ import annotations

from typing import Any


def _fsdp2(plan: Any, process_group: dict[str, Any]) -> Any:
    from hflight.sharding.fsdp import FSDP2Strategy

    return FSDP2Strategy(plan, **process_group)


def _deepspeed(resolver: Any, process_group: dict[str, Any]) -> Any:
    from hflight.sharding.deepspeed import HFDeepSpeedStrategy

    return HFDeepSpeedStrategy(resolver, **process_group)


def register(accelerator_registry: Any, strategy_registry: Any) -> None:
    from hflight.arguments.registry import SHARDING_STRATEGIES

    SHARDING_STRATEGIES.setdefault("fsdp2", _fsdp2)
    SHARDING_STRATEGIES.setdefault("deepspeed", _deepspeed)
