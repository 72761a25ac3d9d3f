"""Samplers of hflight's loaders, as accelerate's: the seedable random order, and batches dealt to processes.

- :class:`EpochSeededRandomSampler`: accelerate's ``SeedableRandomSampler`` (``use_seedable_sampler``, transformers'
  default): the order of each epoch drawn from ``data_seed + epoch``, the same on every process and in a resumed run.
- :class:`ShardedBatchSampler`: accelerate's ``BatchSamplerShard`` (``split_batches``, ``even_batches``): which batches,
  or which slices of them, a process takes.
- :func:`check_even_shards`: ``even_batches=False`` where it would leave the processes unpaired in a collective.

tests/test_accelerator_config.py compares each with accelerate's own class.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import BatchSampler, RandomSampler, Sampler


class EpochSeededRandomSampler(RandomSampler):
    """A ``RandomSampler`` whose generator is seeded with ``seed + epoch`` at each pass (accelerate's
    ``SeedableRandomSampler``: the same order on every process, and in a resumed run, without RNG state); a finished
    pass moves to the next epoch unless ``set_epoch`` says otherwise.

    Example:
        >>> sampler = EpochSeededRandomSampler(4, seed=0)
        >>> sampler.set_epoch(1)
        >>> sorted(sampler)
        [0, 1, 2, 3]
    """

    def __init__(
        self, data_source: Sized | int, seed: int, replacement: bool = False, num_samples: int | None = None
    ) -> None:
        source = range(data_source) if isinstance(data_source, int) else data_source
        super().__init__(source, replacement=replacement, num_samples=num_samples)
        self.seed = seed
        self.epoch = 0

    @property
    def length(self) -> int:
        return len(self.data_source)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        self.generator = torch.Generator()
        self.generator.manual_seed(self.seed + self.epoch)
        yield from super().__iter__()
        self.set_epoch(self.epoch + 1)


class ShardedBatchSampler(Sampler[list[int]]):
    """The batches of ``sampler`` (or of ``batch_sampler``) for process ``rank`` of ``num_replicas``, as accelerate's
    ``BatchSamplerShard`` deals them.

    Without ``split_batches``, rank ``r`` takes batches ``r, r + n, ...`` of complete rounds; gathering batch by batch
    restores the sampler's order. With ``even_batches`` the last round is completed from the first ``n`` batches'
    samples (a short last batch filled, missing batches made of the samples that follow), so every rank gets as many
    full batches; without it a rank gets what the last round holds for it. With ``split_batches`` every batch is cut
    into ``n`` slices of ``batch_size // n``; the short last batch is filled from the first batch (``even_batches``),
    or cut as it is. ``drop_last`` (the batch sampler's) drops the short batch and an incomplete round.
    """

    def __init__(
        self,
        sampler: Sampler[int] | None,
        batch_size: int | None,
        drop_last: bool,
        num_replicas: int,
        rank: int,
        *,
        split_batches: bool = False,
        even_batches: bool = True,
        batch_sampler: Iterable[list[int]] | None = None,
    ) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
        if batch_sampler is None:
            batch_sampler = BatchSampler(sampler, batch_size, drop_last)
        self.batch_sampler = batch_sampler
        self.sampler = getattr(self.batch_sampler, "sampler", sampler)
        self.batch_size = getattr(self.batch_sampler, "batch_size", None)
        self.drop_last = getattr(self.batch_sampler, "drop_last", False)
        self.num_replicas, self.rank = num_replicas, rank
        self.split_batches, self.even_batches = split_batches, even_batches
        if split_batches and (self.batch_size is None or self.batch_size % num_replicas != 0):
            raise split_batches_error(self.batch_size, num_replicas)

    @property
    def total_batch_size(self) -> int | None:
        """Samples in one step of all processes together."""
        if self.batch_size is None:
            return None
        return self.batch_size if self.split_batches else self.batch_size * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        batches = len(self.batch_sampler)
        if self.split_batches:
            return batches
        rounds, left = divmod(batches, self.num_replicas)
        if left == 0 or self.drop_last:
            return rounds
        return rounds + 1 if self.even_batches or self.rank < left else rounds

    def __iter__(self) -> Iterator[list[int]]:
        return self._split() if self.split_batches else self._dealt()

    def _full(self, batch: list[int]) -> bool:
        return self.batch_size is None or len(batch) == self.batch_size

    def _dealt(self) -> Iterator[list[int]]:
        n, rank = self.num_replicas, self.rank
        head: list[Any] = []  # the first n batches' samples (whole batches without a batch size): the padding
        mine: list[int] | None = None
        index, batch = -1, []
        for index, batch in enumerate(self.batch_sampler):
            if not self.drop_last and index < n:
                head.extend([batch] if self.batch_size is None else batch)
            if index % n == rank:
                mine = batch
            if index % n == n - 1 and self._full(batch):  # a complete round: every rank has its batch
                yield mine
                mine = None
        if self.drop_last or not head:
            return
        if not self.even_batches:
            if mine:
                yield mine
            return
        yield from self._evened(head, mine, index, batch)

    def _evened(self, head: list[Any], mine: list[int] | None, index: int, last: list[int]) -> Iterator[list[int]]:
        """The end of an uneven last round: this rank's full batch of it, then the batches made from ``head``."""
        n = self.num_replicas
        if mine and self._full(mine):
            yield mine
        needed = n * self.batch_size if self.batch_size is not None else n
        while len(head) < needed:
            head = head + head
        batch = last
        if self._full(last):  # the last batch was yielded in full: the padding starts at the next position
            batch, index = [], index + 1
        taken = 0
        while index % n != 0 or batch:
            if self.batch_size is None:
                batch, taken = head[taken], taken + 1
            else:
                end = taken + self.batch_size - len(batch)
                batch, taken = batch + head[taken:end], end
            if index % n == self.rank:
                yield batch
            batch, index = [], index + 1

    def _split(self) -> Iterator[list[int]]:
        size = self.batch_size // self.num_replicas
        mine = slice(size * self.rank, size * (self.rank + 1))
        first: list[int] = []
        batch: list[int] = []
        for index, batch in enumerate(self.batch_sampler):
            if index == 0:
                first = list(batch)
            if len(batch) == self.batch_size:
                yield batch[mine]
        if self.drop_last or not first or len(batch) == self.batch_size:
            return
        if not self.even_batches:
            if len(batch) > size * self.rank:
                yield batch[mine]
            return
        while len(first) < self.batch_size:
            first = first + first
        yield (batch + first)[mine]


def split_batches_error(batch_size: int | None, processes: int) -> ValueError:
    return ValueError(
        f"accelerator_config['split_batches']=True cuts every batch into one slice per process, so the batch size "
        f"({batch_size}) must be a multiple of the number of processes ({processes}): set per_device_train_batch_size "
        "(per_device_eval_batch_size for evaluation) to a multiple of it, or split_batches=False."
    )


def uneven_shards(samples: int, batch_size: int, drop_last: bool, processes: int, split: bool) -> list[tuple[int, int]]:
    """With ``even_batches=False``: for each process, (batches it gets, size of its last one, 0 without any) out of
    ``samples`` in batches of ``batch_size`` (:class:`ShardedBatchSampler`'s dealing, computed without iterating)."""
    batches = samples // batch_size if drop_last else math.ceil(samples / batch_size)
    if batches == 0:
        return [(0, 0)] * processes
    last = samples - (batches - 1) * batch_size
    if split:
        size = batch_size // processes
        if drop_last or last == batch_size:
            shards = [(batches, size)] * processes
        else:
            shards = [(batches, min(size, last - size * r)) if last > size * r else (batches - 1, size)
                      for r in range(processes)]  # fmt: skip
    else:
        rounds, left = divmod(batches, processes)
        if drop_last or left == 0:
            shards = [(rounds, batch_size)] * (processes - 1) + [(rounds, batch_size if drop_last else last)]
        else:
            shards = [(rounds + 1, last if r == left - 1 else batch_size) if r < left else (rounds, batch_size)
                      for r in range(processes)]  # fmt: skip
    return [(count, size if count else 0) for count, size in shards]


def check_even(loader: Any, training: bool) -> None:
    """:func:`check_even_shards` for a loader dealt by a :class:`ShardedBatchSampler` with ``even_batches=False``."""
    batches = getattr(loader, "batch_sampler", None)
    if not isinstance(batches, ShardedBatchSampler) or batches.even_batches or batches.batch_size is None:
        return
    check_even_shards(len(batches.sampler), batches.batch_size, batches.drop_last, batches.num_replicas,
                      batches.split_batches, training)  # fmt: skip


def check_even_shards(samples: int, batch_size: int, drop_last: bool, processes: int, split: bool, training: bool):
    """``even_batches=False`` where the processes would get different numbers of batches (their gradient
    synchronisations or gatherings would not pair: transformers' processes hang or abort), or, in an evaluation,
    last batches of different sizes (accelerate's ``gather`` aborts the processes): a ``ValueError`` naming it."""
    shards = uneven_shards(samples, batch_size, drop_last, processes, split)
    counts, sizes = {count for count, _ in shards}, {size for _, size in shards}
    if len(counts) == 1 and (training or len(sizes) == 1):
        return
    what = "training" if training else "evaluation"
    raise ValueError(
        f"accelerator_config['even_batches']=False: {samples} samples in batches of {batch_size} on {processes} "
        f"processes give them (batches, size of the last) {shards}; the {what} "
        f"{'synchronises gradients' if training else 'gathers every batch'} across the processes, which needs "
        f"{'as many batches' if training else 'batches of one size'} on each (transformers' processes hang or abort "
        "there). Set even_batches=True (the last batches are completed from the start, as by default), or "
        "dataloader_drop_last=True, or a dataset size that divides evenly."
    )
