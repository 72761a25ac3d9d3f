"""Registers the ORT backend: strategy ``"ort"`` and ``optim="adamw_ort_fused"`` (no onnxruntime import)."""

from __future__ import annotations

from typing import Any


def adamw_ort_fused(args: Any) -> tuple[type, dict[str, Any]]:
    """onnxruntime-training's FusedAdam (what transformers 4.x mapped ``adamw_ort_fused`` to)."""
    try:
        from onnxruntime.training.optim import FusedAdam
    except ImportError as exc:
        from hflight.ort.runtime import ORTMODULE_MISSING

        raise ModuleNotFoundError(
            f"optim='adamw_ort_fused' is onnxruntime-training's FusedAdam, which is not importable here. "
            f"{ORTMODULE_MISSING} ({exc})"
        ) from exc
    return FusedAdam, {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon}


def register(accelerator_registry: Any, strategy_registry: Any) -> None:
    from hflight.arguments.optimizers import OPTIMIZERS
    from hflight.ort.strategy import ORTStrategy

    ORTStrategy.register_strategies(strategy_registry)
    OPTIMIZERS.setdefault("adamw_ort_fused", adamw_ort_fused)
