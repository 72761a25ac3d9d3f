"""Cross-process tensor operations through the running Lightning strategy (identity with one process).

What HF's evaluation loop gets from accelerate (``pad_across_processes``, ``gather_for_metrics``), done with the
strategy's own collectives so hflight does not need accelerate. Values may be nested lists/tuples/dicts of tensors
(a QA model's ``(start_logits, end_logits)``); non-tensor leaves pass through unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import Strategy
from torch.utils._pytree import tree_map


def is_distributed(strategy: Strategy | None) -> bool:
    return strategy is not None and strategy.world_size > 1


def _group(whole_world: bool) -> Any:
    """The process group of a collective: the strategy's own (None; the data-parallel ranks under tensor
    parallelism), or every process (``whole_world``)."""
    return torch.distributed.group.WORLD if whole_world else None


def pad_across_processes(
    strategy: Strategy | None, value: Any, dim: int = 1, pad_index: Any = -100, whole_world: bool = False,
    pad_first: bool = False,
) -> Any:  # fmt: skip
    """Pad every tensor along ``dim`` (negative: from the last) to the largest size any process has, so that they can
    be gathered (over the strategy's processes, or every process with ``whole_world``); at the start with
    ``pad_first``. As accelerate pads: the padding is ``zeros + pad_index`` (its type promotes the tensor's), and a
    tensor without that dimension is left as it is."""
    if not is_distributed(strategy):
        return value

    def pad(tensor: Any) -> Any:
        if not torch.is_tensor(tensor) or not -tensor.dim() <= dim < tensor.dim():
            return tensor
        axis = dim % tensor.dim()
        size = torch.tensor(tensor.shape[axis], device=tensor.device)
        longest = int(strategy.all_gather(size, group=_group(whole_world)).max())
        if longest == tensor.shape[axis]:
            return tensor
        shape = list(tensor.shape)
        shape[axis] = longest
        padded = tensor.new_zeros(shape) + pad_index
        start = longest - tensor.shape[axis] if pad_first else 0
        padded.narrow(axis, start, tensor.shape[axis]).copy_(tensor)
        return padded

    return tree_map(pad, value)


def gather(strategy: Strategy | None, value: Any, pad_dim: int | None = None, whole_world: bool = False) -> Any:
    """Concatenate every process's tensors along dim 0, in rank order (padding ``pad_dim`` first if given): over the
    strategy's processes (the data-parallel ranks under tensor parallelism), or every process with
    ``whole_world``."""
    if not is_distributed(strategy):
        return value
    if pad_dim is not None:
        value = pad_across_processes(strategy, value, dim=pad_dim, whole_world=whole_world)
    group = _group(whole_world)

    def gather_one(tensor: Any) -> Any:
        if not torch.is_tensor(tensor):
            return tensor
        gathered = strategy.all_gather(tensor.contiguous(), group=group)  # (processes, *shape)
        return gathered.flatten(0, 1) if tensor.dim() else gathered

    return tree_map(gather_one, value)


def join_parts(parts: list[Any]) -> Any:
    """Per-process values of one structure joined along the first axis: tensors and arrays concatenated (on the
    first part's device), lists extended, tuples and dicts joined item by item."""
    import numpy as np

    first = parts[0]
    if torch.is_tensor(first):
        return torch.cat([torch.atleast_1d(p).to(first.device) for p in parts])
    if isinstance(first, np.ndarray):
        return np.concatenate([np.atleast_1d(p) for p in parts])
    if isinstance(first, list):
        return [item for part in parts for item in part]
    if isinstance(first, tuple):
        return type(first)(join_parts([p[i] for p in parts]) for i in range(len(first)))
    if isinstance(first, dict):
        return type(first)({k: join_parts([p[k] for p in parts]) for k in first})
    return list(parts)


def reduce_mean(strategy: Strategy | None, value: torch.Tensor) -> torch.Tensor:
    if not is_distributed(strategy):
        return value
    return strategy.reduce(value, reduce_op="mean")


def barrier(strategy: Strategy | None, name: str = "hflight") -> None:
    if is_distributed(strategy):
        strategy.barrier(name)


class World:
    """The processes a run spans: size, rank and collectives, through the run's Lightning strategy.

    Built from a ``lightning.Trainer`` (read when used, so ranks are right once Lightning has launched the
    processes), or, before any run exists, from the ``TrainingArguments`` (``torch.distributed``/the environment),
    with collectives that are the identity.
    """

    def __init__(self, lightning_trainer: Any = None, args: Any = None) -> None:
        if lightning_trainer is None and args is None:
            raise ValueError("World needs a lightning.Trainer or the TrainingArguments")
        self.lightning_trainer = lightning_trainer
        self.args = args

    @property
    def strategy(self) -> Strategy | None:
        return self.lightning_trainer.strategy if self.lightning_trainer is not None else None

    @property
    def size(self) -> int:
        return self.lightning_trainer.world_size if self.lightning_trainer is not None else self.args.world_size

    @property
    def rank(self) -> int:
        return self.lightning_trainer.global_rank if self.lightning_trainer is not None else self.args.process_index

    @property
    def data_parallel(self) -> tuple[int, int]:
        """The data-parallel replicas and this process's replica (the running strategy's ``hf_data_parallel``; every
        process its own replica before any run)."""
        if self.strategy is None:
            return self.size, self.rank
        from hflight.run.backend import backend_of

        return backend_of(self.strategy).hf_data_parallel(self.size, self.rank)

    def gather(self, value: Any, pad_dim: int | None = None, whole_world: bool = False) -> Any:
        """Every process's tensors concatenated along dim 0 (:func:`gather`): the loop's gathers, over the
        strategy's processes (one per data-parallel replica under tensor parallelism); ``whole_world``: over every
        process, as accelerate's ``gather``."""
        return gather(self.strategy, value, pad_dim, whole_world)

    def pad_across_processes(
        self, value: Any, dim: int = 1, pad_index: Any = -100, whole_world: bool = False, pad_first: bool = False
    ) -> Any:
        return pad_across_processes(self.strategy, value, dim, pad_index, whole_world, pad_first)

    def gather_objects(self, values: list[Any]) -> list[Any]:
        """Every process's list of picklable objects, concatenated in rank order (``values`` itself with one)."""
        if not is_distributed(self.strategy):
            return values
        return [item for part in self._replica_objects(values) for item in part]

    def _replica_objects(self, value: Any) -> list[Any]:
        """Every data-parallel replica's ``value`` (pickled), in replica order: the processes that share a replica's
        batches (tensor parallelism) count once."""
        gathered: list[Any] = [None] * self.size
        torch.distributed.all_gather_object(gathered, (self.data_parallel[1], value))
        return list(dict(sorted(dict(reversed(gathered)).items())).values())

    def gather_as_objects(self, value: Any, pad_dim: int | None = None) -> Any:
        """``gather`` through pickling (``eval_use_gather_object``): every process's ``value`` (tensors, arrays,
        lists or dicts of them) joined in rank order (``pad_dim`` padded first, as ``gather``); ``value`` itself with
        one process."""
        if not is_distributed(self.strategy):
            return value
        if pad_dim is not None:
            value = self.pad_across_processes(value, dim=pad_dim)
        return join_parts(self._replica_objects(value))

    def reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        return reduce_mean(self.strategy, value)

    def reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        if not is_distributed(self.strategy):
            return value
        return self.strategy.reduce(value, reduce_op="sum")

    def every_process(self, value: torch.Tensor) -> torch.Tensor:
        """Every process's ``value`` stacked in rank order, over the whole world even where the strategy's own
        collectives span the data-parallel ranks only (tensor parallelism): transformers' ``accelerator.gather`` and
        ``distributed_broadcast_scalars``, whose sums (``num_input_tokens_seen``, ``total_flos``) count each
        tensor-parallel copy of a batch. ``value`` with a leading dimension of one process alone."""
        return self.gather(value[None], whole_world=True)

    def barrier(self) -> None:
        barrier(self.strategy)
