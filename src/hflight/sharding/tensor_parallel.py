"""Tensor parallelism as transformers loads it: a model from ``from_pretrained(..., tp_plan="auto")`` (or
``distributed_config=DistributedConfig(tp_size=N)``) under torchrun holds DTensor weights on its own device mesh
(``model._device_mesh``: ``pp`` x ``fsdp`` x ``tp``, the whole launch), sharded by its ``tp_plan``.

transformers' Trainer hands such a model to accelerate, which wraps nothing (no DDP over tensor-parallel weights) and
treats the ``tp`` dimension as ranks that share one batch. :class:`TensorParallelStrategy` does the same on Lightning's
``ModelParallelStrategy``:

- the mesh is ``data_parallel`` x ``tensor_parallel`` = (world // tp) x tp, the layout of transformers' mesh (the
  ``tp`` dimension innermost: the ranks of one tensor-parallel group are consecutive);
- the model is not wrapped nor re-sharded (``configure_model`` does nothing: transformers did it at load time);
- the loop's data and collectives are per data-parallel rank: the loaders are dealt to ``world // tp`` replicas (the
  ranks of one tensor-parallel group get the same batches, as transformers' ``get_tp_size()`` arithmetic), and the
  strategy's ``all_gather``/``reduce`` (evaluation gathers, the label-item count that normalises the loss, tokens
  seen) run over the data-parallel group, so that no tensor-parallel copy is counted twice;
- gradient clipping and the logged gradient norm are over the whole model (:func:`clip_grad_norm`: each DTensor
  gradient's norm is completed across its mesh, the replicated plain gradients counted once);
- checkpoints are torch distributed checkpoints (``hflight.checkpoints.forms.ShardedState``: every process writes
  its shards), which resume on another layout (one process, several).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from typing_extensions import override

from hflight._util import model_tp_size
from hflight.checkpoints.forms import CheckpointForm, ShardedState
from hflight.run.backend import HFBackend


def model_mesh_size(model: nn.Module) -> int | None:
    """The number of processes ``model``'s layout spans (None without a device mesh): its mesh (``pp`` x ``fsdp`` x
    ``tp``) times the replicas of HSDP (``DistributedConfig(dp_replicate_size=R)``: transformers' whole mesh is
    ``pp`` x ``dp_replicate`` x ``fsdp`` x ``tp``, of which the model keeps the dimensions without the replicas)."""
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None:
        return None
    layout = getattr(getattr(model, "config", None), "distributed_config", None)
    return math.prod(mesh.shape) * (getattr(layout, "dp_replicate_size", None) or 1)


def check_layout(model: nn.Module, world_size: int) -> int:
    """The tensor-parallel size of ``model`` checked against a launch of ``world_size`` processes (refused before any
    training: a mesh that is not the launch's, a world the tensor-parallel groups do not divide)."""
    tp = model_tp_size(model)
    mesh = model_mesh_size(model)
    if mesh is not None and mesh != world_size:
        raise ValueError(
            f"The model's tensor-parallel device mesh spans {mesh} processes (tp_size={tp}), but this run has "
            f"{world_size}: load the model (from_pretrained(..., tp_plan=...)) in the launch that trains it."
        )
    if world_size % tp:
        raise ValueError(
            f"tp_size={tp} does not divide the run's {world_size} processes: each data-parallel replica needs {tp}."
        )
    return tp


class TensorParallelStrategy(ModelParallelStrategy, HFBackend):
    """Lightning's ``ModelParallelStrategy`` for a model transformers loaded tensor-parallel (see the module
    docstring).

    Args:
        tp_size: the model's tensor-parallel size (``model._tp_size``).
        process_group_backend: ``ddp_backend`` (default: NCCL on CUDA, gloo on the CPU).
        timeout: ``ddp_timeout``.
    """

    strategy_name = "hflight_tensor_parallel"

    def __init__(self, tp_size: int, process_group_backend: str | None = None, timeout: timedelta | None = None):
        kwargs: dict[str, Any] = {"process_group_backend": process_group_backend}
        if timeout is not None:
            kwargs["timeout"] = timeout
        super().__init__(save_distributed_checkpoint=True, **kwargs)
        self.tp_size = tp_size

    @override
    def setup_environment(self) -> None:
        world = self.num_nodes * self.num_processes
        if world % self.tp_size:
            raise ValueError(f"tp_size={self.tp_size} does not divide the run's {world} processes.")
        self._data_parallel_size = world // self.tp_size
        self._tensor_parallel_size = self.tp_size
        super().setup_environment()

    def _data_parallel_group(self) -> Any:
        return self.device_mesh["data_parallel"].get_group()

    # ---- the loop's collectives: over the data-parallel ranks --------------------------------------------------
    @override
    def all_gather(self, tensor: torch.Tensor, group: Any | None = None, sync_grads: bool = False) -> torch.Tensor:
        return super().all_gather(tensor, group=group if group is not None else self._data_parallel_group(),
                                  sync_grads=sync_grads)  # fmt: skip

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        return super().reduce(tensor, group=group if group is not None else self._data_parallel_group(),
                              reduce_op=reduce_op)  # fmt: skip

    # ---- HFBackend ------------------------------------------------------------------------------------------------
    @override
    def hf_data_parallel(self, world_size: int, rank: int) -> tuple[int, int]:
        mesh = self.device_mesh["data_parallel"]
        return mesh.size(), mesh.get_local_rank()

    @override
    def hf_configure_model(self, model: nn.Module) -> None:
        check_layout(model, self.world_size)

    @override
    def hf_clip_grad_norm(self, parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
        return clip_grad_norm(parameters, max_norm)

    @override
    def hf_checkpoint_state(self) -> CheckpointForm:
        return ShardedState()


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float, eps: float = 1e-6) -> torch.Tensor:
    """The 2-norm of all the gradients of a tensor-parallel model, every gradient scaled by ``max_norm / norm`` when
    that is below 1 (torch's ``clip_grad_norm_``, whose foreach kernels refuse a mix of DTensor and plain gradients):
    a DTensor gradient's squared norm is completed over its mesh (``full_tensor``), a plain (replicated) one is the
    same on every process and taken as it is."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    squares = []
    for grad in grads:
        square = torch.linalg.vector_norm(grad, 2, dtype=torch.float32) ** 2
        squares.append(square.full_tensor() if isinstance(square, DTensor) else square)
    total = torch.stack(squares).sum().sqrt()
    coefficient = float(torch.clamp(max_norm / (total + eps), max=1.0))
    if coefficient < 1.0:
        for grad in grads:
            grad.mul_(coefficient)
    return total
