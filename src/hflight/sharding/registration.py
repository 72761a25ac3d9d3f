"""Registers the sharding strategies' builders with the arguments (``hflight.arguments.registry.SHARDING``), and the
checkpoint forms' answer to ``save_async`` (``hflight.arguments.registry.CHECKPOINTS``: the forms a sharded run writes
are the ones that cannot be written in the background); nothing heavy is imported until one is built."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning.pytorch.strategies import Strategy
    from torch import nn
    from transformers import TrainingArguments

    from hflight.arguments.deepspeed import DeepSpeedConfigResolver
    from hflight.arguments.registry import ProcessGroupSettings


def build_fsdp(
    args: TrainingArguments, model: nn.Module, world_size: int, process_group: ProcessGroupSettings
) -> Strategy:
    """``fsdp``/``fsdp_config`` (checked by the arguments): FSDP2's strategy on its plan (``version`` 2), or
    Lightning's ``FSDPStrategy`` on FSDP1's settings (``version`` 1, CUDA only)."""
    from hflight.sharding import plans

    plans.check_save_settings(args)
    if args.fsdp_plugin_args["fsdp_version"] == 2:
        from hflight.sharding.fsdp import FSDP2Strategy

        return FSDP2Strategy(plans.fsdp2_plan(args, model, world_size), **process_group)
    from lightning.pytorch.strategies import FSDPStrategy

    return FSDPStrategy(**plans.fsdp1_plan(args, model, process_group).strategy_kwargs())


def build_deepspeed(resolver: DeepSpeedConfigResolver, process_group: ProcessGroupSettings) -> Strategy:
    """``deepspeed``: hflight's DeepSpeed strategy on the config resolved from the arguments."""
    from hflight.sharding.deepspeed import HFDeepSpeedStrategy

    return HFDeepSpeedStrategy(resolver, **process_group)


def build_tensor_parallel(model: nn.Module, world_size: int, process_group: ProcessGroupSettings) -> Strategy:
    """A model transformers loaded tensor-parallel: the strategy that trains its DTensors on its mesh."""
    from hflight.sharding.tensor_parallel import TensorParallelStrategy, check_layout

    return TensorParallelStrategy(check_layout(model, world_size), **process_group)


def save_async_refusal(args: TrainingArguments) -> str | None:
    """Why ``save_async`` cannot write the checkpoints of a run of ``args``: the checkpoint forms' answer."""
    from hflight.checkpoints.forms import save_async_refusal

    return save_async_refusal(args)


def register(accelerator_registry: Any, strategy_registry: Any) -> None:
    from hflight.arguments.registry import CHECKPOINTS, SHARDING

    if CHECKPOINTS.save_async_refusal is None:
        CHECKPOINTS.save_async_refusal = save_async_refusal
    if SHARDING.fsdp is None:
        SHARDING.fsdp = build_fsdp
    if SHARDING.deepspeed is None:
        SHARDING.deepspeed = build_deepspeed
    if SHARDING.tensor_parallel is None:
        SHARDING.tensor_parallel = build_tensor_parallel
