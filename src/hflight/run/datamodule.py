"""Data side of a run: samplers, accumulation cycles and the LightningDataModule around the facade's loaders.

Three pieces:

- ``EpochSeededRandomSampler`` and ``ShardedBatchSampler``: the training order is a permutation drawn from
  ``seed + epoch``, so every run, and every resume, sees the same order without restoring RNG state; under
  several processes each rank takes every ``world_size``-th batch (as accelerate shards), so gathering batch by
  batch restores the dataset order.
- ``AccumulationCycles``: wraps the training loader and reads ``gradient_accumulation_steps`` batches ahead,
  as transformers' ``get_batch_samples`` does (plus one batch, as accelerate's loader reads one ahead), so every
  micro-batch knows the size of its cycle and the number of label items in it (the loss normaliser). Lightning
  still sees one batch per micro-batch, so DDP gets exactly one backward per forward.
- ``HFDataModule``: asks the facade for its loaders (``get_train_dataloader`` and friends, so subclass overrides
  are used) once Lightning has launched the processes; the loss normaliser of a cycle comes from the facade's
  ``_get_num_items_in_batch`` (transformers' override point), the epoch from the run.
- ``EvaluationData``: hands an evaluation loader to Lightning's ``validate`` sharded for the processes it runs in
  (``shard_loader``). ``evaluate()``/``predict()`` build their loader before the run exists; when such a call is
  the one that launches the processes (Lightning's subprocess launcher), the launching process built it for one
  process while each launched rank built its shard, so it is re-dealt after the launch, as accelerate's
  ``prepare`` shards a loader.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sized
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch.utils.data import BatchSampler, DataLoader, Sampler

from hflight.checkpoints.parts import rng_states
from hflight.run.backend import StepGeometry, backend_of
from hflight.surface import RunView, TrainerSurface


class EpochSeededRandomSampler(Sampler[int]):
    """A random permutation of ``range(length)`` drawn from a generator seeded with ``seed + epoch``.

    Example:
        >>> sampler = EpochSeededRandomSampler(4, seed=0)
        >>> sampler.set_epoch(1)
        >>> sorted(sampler)
        [0, 1, 2, 3]
    """

    def __init__(self, length: int, seed: int) -> None:
        self.length = length
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        yield from torch.randperm(self.length, generator=generator).tolist()

    def __len__(self) -> int:
        return self.length


class ShardedBatchSampler(Sampler[list[int]]):
    """Batches of ``sampler`` dealt round-robin to ``num_replicas`` ranks, as accelerate shards them.

    Every rank gets the same number of full batches, so collectives (gathering evaluation outputs) see equal
    shapes: a short final batch is filled with samples from the start of the order, and ranks left without a
    batch repeat batches from the start. Gathering batch by batch then yields the sampler's order followed by the
    repeats, which the evaluation loop cuts off at the dataset length.
    """

    def __init__(self, sampler: Sampler[int], batch_size: int, drop_last: bool, num_replicas: int, rank: int):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas}), got {rank}")
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_replicas = num_replicas
        self.rank = rank

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def _batches(self) -> list[list[int]]:
        order = list(self.sampler)
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        if batches and len(batches[-1]) < self.batch_size:
            if self.drop_last:
                batches.pop()
            else:
                missing = self.batch_size - len(batches[-1])
                batches[-1] = batches[-1] + [order[i % len(order)] for i in range(missing)]
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._batches()
        if not batches:
            return
        per_rank = math.ceil(len(batches) / self.num_replicas)
        padded = batches + [batches[i % len(batches)] for i in range(per_rank * self.num_replicas - len(batches))]
        yield from padded[self.rank :: self.num_replicas]

    def __len__(self) -> int:
        n = len(self.sampler)
        batches = n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)
        return math.ceil(batches / self.num_replicas)


def set_loader_epoch(loader: Any, epoch: int) -> None:
    """Tell whichever sampler the loader uses which epoch it is (no-op for samplers without ``set_epoch``)."""
    for holder in (loader, getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None)):
        if holder is not None and hasattr(holder, "set_epoch"):
            holder.set_epoch(epoch)
            return


def read_one_ahead(iterator: Iterator[Any]) -> Iterator[Any]:
    """``iterator``'s items, each handed out only once the next one has been read (collated), as accelerate's
    ``DataLoaderShard`` feeds transformers' loop. A collator or dataset that draws from torch's global RNG (the
    masked-LM collator's masks, augmentations) then draws in transformers' order relative to the model's dropout:
    batch ``k + 1`` is collated before the forward of batch ``k``."""
    try:
        current = next(iterator)
    except StopIteration:
        return
    for following in iterator:
        yield current
        current = following
    yield current


@dataclass
class MicroBatch:
    """One micro-batch and its place in the accumulation cycle (what HF's loop knows from prefetching)."""

    inputs: Any
    index: int  # position in the cycle, 0-based
    cycle_size: int  # micro-batches in this cycle (the remainder for an epoch's last cycle)
    num_items_in_batch: torch.Tensor | int | None
    step_in_epoch: int  # micro-batch index within the epoch, 0-based

    @property
    def is_last(self) -> bool:
        return self.index == self.cycle_size - 1


class AccumulationCycles:
    """Iterates a training loader as HF's loop does: ``accumulation`` batches at a time, each tagged as a
    ``MicroBatch``. ``batch_samples(iterator, n)`` reads a cycle and counts its label items (the facade's
    ``get_batch_samples``, as transformers calls it once per cycle). ``skip_batches`` drops the first batches of the
    next pass (used to resume mid-epoch)."""

    def __init__(
        self,
        loader: Any,
        accumulation: int,
        batch_samples: Callable[[Iterator, int], tuple[list[Any], torch.Tensor | int | None]],
        epoch_fn: Callable[[], int],
    ) -> None:
        self.loader = loader
        self.accumulation = accumulation
        self.batch_samples = batch_samples
        self.epoch_fn = epoch_fn
        self.skip_batches = 0
        self.restore_rng: Callable[[], None] | None = None
        self.restore_epoch_start_rng: Callable[[], None] | None = None
        #: The RNG streams as the epoch in progress drew its data order (a checkpoint records them).
        self.epoch_start_rng: dict[str, Any] | None = None

    def __len__(self) -> int:
        # The full epoch length, also while a resumed epoch skips batches: Lightning reads it once and bounds
        # every later epoch by it; the shortened first pass simply ends early (Lightning handles StopIteration).
        return len(self.loader)

    def __iter__(self) -> Iterator[MicroBatch]:
        set_loader_epoch(self.loader, self.epoch_fn())
        skip, self.skip_batches = self.skip_batches, 0
        restore, self.restore_rng = self.restore_rng, None
        restore_epoch_start, self.restore_epoch_start_rng = self.restore_epoch_start_rng, None
        # A resumed run gets its RNG streams back where the uninterrupted run had them: before the epoch's
        # iterator is created at an epoch boundary, after the skipped batches mid-epoch (as HF does); mid-epoch,
        # the iterator is created from the streams the epoch began with, so that it draws the same order (a sampler
        # on torch's global generator, a loader's base seed), when the checkpoint recorded them.
        if restore is not None and skip == 0:
            restore()
        elif restore_epoch_start is not None and skip > 0:
            restore_epoch_start()
        self.epoch_start_rng = rng_states()
        iterator = iter(self.loader)
        for _ in range(skip):
            next(iterator, None)
        if restore is not None and skip > 0:
            restore()
        iterator = read_one_ahead(iterator)
        step = skip - 1
        while True:
            cycle, num_items = self.batch_samples(iterator, self.accumulation)
            if not cycle:
                return
            for index, inputs in enumerate(cycle):
                step += 1
                yield MicroBatch(inputs, index, len(cycle), num_items, step)


class HFDataModule(L.LightningDataModule):
    """Builds the loaders through the facade after Lightning has launched the processes, so a loader knows the
    world size and rank it runs under. Only the training side is needed by ``fit``; evaluation loaders are built
    on demand by ``Trainer.get_eval_dataloader``."""

    def __init__(self, facade: TrainerSurface, run: RunView) -> None:
        super().__init__()
        self.facade = facade
        self.run = run
        self.train_loader: Any = None
        self.cycles: AccumulationCycles | None = None
        self.geometry: StepGeometry | None = None  # the running backend's step geometry, set with the loader

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        # Only a micro-batch's tensors travel; Lightning's generic path would deep-copy the whole dataclass
        # on every step.
        if isinstance(batch, MicroBatch):
            return dataclasses.replace(
                batch,
                inputs=move_data_to_device(batch.inputs, device),
                num_items_in_batch=move_data_to_device(batch.num_items_in_batch, device),
            )
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def setup(self, stage: str) -> None:
        if stage != "fit" or self.cycles is not None:
            return
        facade, backend = self.facade, backend_of(self.trainer.strategy)
        self.geometry = backend.hf_geometry(facade.args, self.trainer.world_size, self.run.train_batch_size)
        self.train_loader = backend.hf_prepare_loader(facade.get_train_dataloader(), training=True)
        self.cycles = AccumulationCycles(
            self.train_loader,
            self.geometry.accumulation,
            lambda iterator, num_batches: facade.get_batch_samples(iterator, num_batches, None),
            epoch_fn=lambda: self.run.epochs_offset + self.trainer.current_epoch,
        )

    def resume_at(
        self,
        skip_batches: int,
        restore_rng: Callable[[], None],
        restore_epoch_start_rng: Callable[[], None] | None = None,
    ) -> None:
        """A resumed run: skip the first ``skip_batches`` micro-batches of the first epoch, and call ``restore_rng``
        (the checkpoint's RNG streams) once they are skipped, before the first batch trains; mid-epoch,
        ``restore_epoch_start_rng`` (the streams the checkpoint recorded for the start of its epoch) before the
        epoch's iterator is created."""
        self.cycles.skip_batches = skip_batches
        self.cycles.restore_rng = restore_rng
        self.cycles.restore_epoch_start_rng = restore_epoch_start_rng

    def train_dataloader(self) -> AccumulationCycles:
        if self.cycles is None:
            raise RuntimeError("HFDataModule.setup('fit') must run before train_dataloader()")
        return self.cycles


def loader_length(loader: Any) -> int | None:
    """``len(loader)`` when the loader has one, else None (iterable datasets)."""
    try:
        return len(loader) if isinstance(loader, Sized) or hasattr(loader, "__len__") else None
    except TypeError:
        return None


def shard_loader(loader: Any, world_size: int, rank: int) -> Any:
    """``loader`` with its batches dealt round-robin to ``world_size`` processes (``ShardedBatchSampler``), this
    process taking those of ``rank``: a loader built for another number of processes (a plain ``BatchSampler``, or
    shards of another world) is rebuilt with the same dataset, sampler, batch size and worker settings; one already
    dealt for this world, one process, or a loader without a batch sampler (iterable datasets) is returned as is."""
    batches = getattr(loader, "batch_sampler", None)
    if world_size <= 1 or not isinstance(loader, DataLoader):
        return loader
    if isinstance(batches, ShardedBatchSampler):
        if (batches.num_replicas, batches.rank) == (world_size, rank):
            return loader
    elif type(batches) is not BatchSampler:  # iterable datasets, or a batch sampler of the user's own
        return loader
    sharded = ShardedBatchSampler(batches.sampler, batches.batch_size, batches.drop_last, world_size, rank)
    params: dict[str, Any] = {
        "collate_fn": loader.collate_fn,
        "num_workers": loader.num_workers,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "generator": loader.generator,
    }
    if loader.num_workers > 0:
        params.update(
            multiprocessing_context=loader.multiprocessing_context,
            prefetch_factor=loader.prefetch_factor,
            persistent_workers=loader.persistent_workers,
            in_order=getattr(loader, "in_order", True),
        )
    return DataLoader(loader.dataset, batch_sampler=sharded, **params)


class EvaluationData(L.LightningDataModule):
    """The loader of one evaluation outside training, given to Lightning's ``validate``: Lightning asks for it after
    it launched the processes, when the world is known, and gets it sharded for this process (``shard_loader``)."""

    def __init__(self, loader: Any) -> None:
        super().__init__()
        self.loader = loader

    def val_dataloader(self) -> Any:
        return shard_loader(self.loader, self.trainer.world_size, self.trainer.global_rank)
