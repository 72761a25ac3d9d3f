"""FSDP2 as transformers runs it (``fsdp`` + ``fsdp_config`` version 2), on Lightning's model-parallel strategy.

Lightning's ``ModelParallelStrategy`` connects the processes, builds the device mesh and calls the LightningModule's
``configure_model`` before the optimizer is built; hflight's module hands that moment to this strategy
(``HFBackend.hf_configure_model``), which shards the model the way accelerate's ``fsdp2_prepare_model`` does:

1. ``activation_checkpointing``: each unit-to-be is wrapped in torch's ``checkpoint_wrapper`` (``preserve_rng_state``
   off, as accelerate);
2. every submodule the wrap policy names (``transformer_layer_cls_to_wrap``, else ``_no_split_modules``; or
   ``min_num_params``), bottom-up, becomes an FSDP unit of its own (``fully_shard``), then the whole model;
   ``reshard_after_forward`` frees the gathered parameters after each unit's forward (``full_shard``) or keeps them
   (``shard_grad_op``); ``cpu_offload`` keeps the shards on the CPU (``CPUOffloadPolicy``); under bf16 the gathered
   parameters, gradients' reduction and outputs are bf16 (``MixedPrecisionPolicy``, as accelerate sets it);
3. ``cpu_ram_efficient_loading``: global rank 0's weights are broadcast into the shards (transformers loads the real
   weights on rank 0 only in that mode).

FSDP2 shards each parameter along its first dimension whatever the units are, so the arithmetic of a step is DDP's:
the same gradients (reduce-scattered instead of all-reduced), the same element-wise optimizer step on each shard.
What differs is the gradient norm, summed from each process's shard (its last bits). With gradient accumulation the
gradients are reduce-scattered at every micro-batch, as accelerate does for FSDP2.

One data-parallel dimension spans every process (Lightning's ``"auto"`` sizes would split nodes x devices into data x
tensor parallelism). Checkpoints: ``hflight.checkpoints.forms`` (``state_dict_type``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from typing_extensions import override

from hflight.checkpoints.forms import CheckpointForm, GatheredState, ShardedState
from hflight.run.backend import HFBackend
from hflight.sharding.plans import FSDP2Plan, WrapPolicy


class FSDP2Strategy(ModelParallelStrategy, HFBackend):
    """Lightning's ``ModelParallelStrategy`` with transformers' FSDP2 sharding (see the module docstring).

    Args:
        plan: what to shard and how (``hflight.sharding.plans.fsdp2_plan``).
        process_group_backend: ``ddp_backend`` (default: NCCL on CUDA, gloo on the CPU).
        timeout: ``ddp_timeout``.
    """

    strategy_name = "hflight_fsdp2"
    #: accelerate's FSDP2 ``prepare`` casts through the ``MixedPrecisionPolicy`` and wraps no forward in autocast
    hf_forward_autocast = False

    def __init__(
        self, plan: FSDP2Plan, process_group_backend: str | None = None, timeout: timedelta | None = None
    ) -> None:
        kwargs: dict[str, Any] = {"process_group_backend": process_group_backend}
        if timeout is not None:
            kwargs["timeout"] = timeout
        super().__init__(save_distributed_checkpoint=plan.state_dict_type == "SHARDED_STATE_DICT", **kwargs)
        self.plan = plan

    @override
    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes  # every process: one data-parallel dimension
        self._tensor_parallel_size = 1
        super().setup_environment()

    # ---- HFBackend ------------------------------------------------------------------------------------------------
    @override
    def hf_configure_model(self, model: nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule

        if isinstance(model, FSDPModule):  # a later train()/evaluate() of the same trainer
            return
        shard_model(model, self.plan, self._sharding_mesh())

    def _sharding_mesh(self) -> Any:
        """Every process shards one copy (Lightning's data-parallel dimension), or, with ``parallelism_config``'s
        replication (HSDP), each group of ``dp_shard_size`` processes shards a copy: a 2-D mesh, replicate x shard."""
        if self.plan.hybrid is None:
            return self.device_mesh["data_parallel"]
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.root_device.type, self.plan.hybrid, mesh_dim_names=("dp_replicate", "dp_shard"))

    @override
    def hf_sync_to_host(self) -> None:
        """Before a checkpoint or ``save_model``: every FSDP unit holds its shard again. A forward without a backward
        (an evaluation) leaves the root unit's parameters gathered (FSDP2 keeps the root's last gather), and the
        module then holds whole tensors the optimizer does not know."""
        _reshard(self.lightning_module.model)

    @override
    @contextlib.contextmanager
    def hf_evaluation_model(self, model: nn.Module, label_names: list[str]) -> Iterator[nn.Module]:
        try:
            yield model
        finally:
            _reshard(model)

    @override
    def hf_checkpoint_state(self) -> CheckpointForm:
        form = ShardedState if self.plan.state_dict_type == "SHARDED_STATE_DICT" else GatheredState
        return form(rank0_only=not self.plan.gather_to_every_writer)


def _reshard(model: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def shard_model(model: nn.Module, plan: FSDP2Plan, mesh: Any) -> None:
    """``model`` sharded in place over ``mesh`` as ``plan`` says (accelerate's ``fsdp2_prepare_model`` order)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    rank0_state = None
    if plan.cpu_ram_efficient_loading:  # global rank 0's weights, broadcast once the model is sharded
        rank0_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if plan.activation_checkpointing and plan.wrap is not None:
        _checkpoint_units(model, plan.wrap)
    dtype = plan.param_dtype
    settings: dict[str, Any] = {
        "mesh": mesh,
        "offload_policy": CPUOffloadPolicy() if plan.cpu_offload else OffloadPolicy(),
        "mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype, output_dtype=dtype)
        if dtype is not None
        else MixedPrecisionPolicy(),
    }
    if plan.wrap is not None:
        units = [m for m in _bottom_up(model) if m is not model and plan.wrap(m)]
        for unit in units:
            fully_shard(unit, reshard_after_forward=plan.reshard_after_forward, **settings)
    fully_shard(model, **settings)  # the root: torch's own choice of resharding (it keeps the last gather)
    if rank0_state is not None:
        _broadcast_from_rank0(model, rank0_state)


def _bottom_up(model: nn.Module) -> list[nn.Module]:
    """Every submodule, children before their parents (the order FSDP units must be made in)."""
    order: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        order.append(module)

    visit(model)
    return list(dict.fromkeys(order))


def _checkpoint_units(model: nn.Module, wrap: WrapPolicy) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    names = {id(m): name for name, m in model.named_modules()}
    for unit in [m for m in _bottom_up(model) if m is not model and wrap(m)]:
        model.set_submodule(names[id(unit)], checkpoint_wrapper(unit, preserve_rng_state=False))


def _broadcast_from_rank0(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Global rank 0's weights into every process's shards (``cpu_ram_efficient_loading``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    set_model_state_dict(model, state, options=options)
