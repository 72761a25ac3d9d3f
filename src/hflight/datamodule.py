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
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Iterator, Sized
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch.utils.data import DataLoader, IterableDataset, Sampler, SequentialSampler

from hflight import console
from hflight.backend import StepGeometry, backend_of
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

    def __len__(self) -> int:
        # The full epoch length, also while a resumed epoch skips batches: Lightning reads it once and bounds
        # every later epoch by it; the shortened first pass simply ends early (Lightning handles StopIteration).
        return len(self.loader)

    def __iter__(self) -> Iterator[MicroBatch]:
        set_loader_epoch(self.loader, self.epoch_fn())
        skip, self.skip_batches = self.skip_batches, 0
        restore, self.restore_rng = self.restore_rng, None
        # A resumed run gets its RNG streams back where the uninterrupted run had them: before the epoch's
        # iterator is created at an epoch boundary, after the skipped batches mid-epoch (as HF does).
        if restore is not None and skip == 0:
            restore()
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


# ---- loaders the facade's getters build ----------------------------------------------------------------------
def remove_unused_columns(
    dataset: Any, signature_columns: list[str], description: str | None = None, model_name: str = "model"
) -> Any:
    """Drop the columns of a ``datasets.Dataset`` that the model's ``forward`` does not take (HF's rule, with its
    note naming them; ``model_name``: the model's class name, for the note)."""
    import datasets

    if not isinstance(dataset, datasets.Dataset):
        return dataset
    ignored = [c for c in dataset.column_names if c not in signature_columns]
    if ignored:
        console.columns_ignored(ignored, description, model_name)
    if len(ignored) == len(dataset.column_names):
        raise ValueError(
            f"No columns in the {description or ''} dataset match the model's forward method signature: "
            f"({', '.join(signature_columns)}). The following columns have been ignored: [{', '.join(ignored)}]. "
            "Please check the dataset and model. "
            "You may need to set `remove_unused_columns=False` in `TrainingArguments`."
        )
    return dataset.remove_columns(ignored) if ignored else dataset


def _group_by_length(dataset: Any, args: Any, processing_class: Any, seed: int) -> Sampler[int]:
    import datasets
    from transformers.trainer_pt_utils import LengthGroupedSampler

    lengths = None
    if isinstance(dataset, datasets.Dataset) and args.length_column_name in dataset.column_names:
        lengths = dataset[args.length_column_name]
    input_name = processing_class.model_input_names[0] if processing_class is not None else None
    return LengthGroupedSampler(
        args.train_batch_size * args.gradient_accumulation_steps,
        dataset=dataset,
        lengths=lengths,
        model_input_name=input_name,
        generator=torch.Generator().manual_seed(seed),
    )


TRAIN_SAMPLERS: dict[str, Callable[[Any, Any, Any, int], Sampler[int]]] = {
    "random": lambda dataset, args, processing_class, seed: EpochSeededRandomSampler(len(dataset), seed),
    "sequential": lambda dataset, args, processing_class, seed: SequentialSampler(dataset),
    "group_by_length": _group_by_length,
}


def train_sampler(dataset: Any, args: Any, processing_class: Any) -> Sampler[int]:
    """The sampler ``args.train_sampling_strategy`` names, seeded with ``data_seed`` (else ``seed``)."""
    strategy = str(getattr(args.train_sampling_strategy, "value", args.train_sampling_strategy))
    seed = args.data_seed if args.data_seed is not None else args.seed
    return TRAIN_SAMPLERS[strategy](dataset, args, processing_class, seed)


def make_dataloader(
    dataset: Any,
    args: Any,
    collator: Callable,
    batch_size: int,
    sampler: Sampler[int] | None,
    world_size: int,
    rank: int,
) -> DataLoader:
    """A DataLoader with ``args``' worker settings; under several processes, batches dealt round-robin."""
    params: dict[str, Any] = {
        "collate_fn": collator,
        "num_workers": args.dataloader_num_workers,
        "pin_memory": args.dataloader_pin_memory and torch.cuda.is_available(),
        "persistent_workers": args.dataloader_persistent_workers and args.dataloader_num_workers > 0,
        "prefetch_factor": args.dataloader_prefetch_factor,
    }
    if args.dataloader_num_workers > 0:  # only worker processes have a start method and an order to keep
        params["multiprocessing_context"] = args.dataloader_multiprocessing_context
        params["in_order"] = args.dataloader_in_order
    if isinstance(dataset, IterableDataset) or sampler is None:
        return DataLoader(dataset, batch_size=batch_size, **params)
    if world_size > 1:
        batches = ShardedBatchSampler(sampler, batch_size, args.dataloader_drop_last, world_size, rank)
        return DataLoader(dataset, batch_sampler=batches, **params)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=args.dataloader_drop_last, **params)


class DataLoadersMixin:
    """transformers' data surface of the ``Trainer`` (loader getters, samplers, column pruning), over its public
    attributes; the processes to shard across come from ``self.accelerator`` (the run's world)."""

    _signature_columns: list[str] | None = None  # the model's forward arguments and label names, found once

    def _set_signature_columns_if_needed(self) -> None:
        if self._signature_columns is None:
            columns = list(inspect.signature(self.model.forward).parameters)
            self._signature_columns = columns + list({"label", "label_ids", *self.label_names})

    def _remove_unused_columns(self, dataset: Any, description: str | None = None) -> Any:
        if not self.args.remove_unused_columns:
            return dataset
        self._set_signature_columns_if_needed()
        return remove_unused_columns(dataset, self._signature_columns, description, type(self.model).__name__)

    def _get_dataloader(
        self,
        dataset: Any,
        description: str,
        batch_size: int,
        sampler_fn: Callable[[Any], Sampler[int]] | None = None,
        is_training: bool = False,
        dataloader_key: str | None = None,
    ) -> DataLoader:
        """``dataset`` in batches of ``batch_size``: unused columns removed (``_remove_unused_columns``), the sampler
        from ``sampler_fn`` (none for iterable datasets), batches dealt across the processes."""
        if dataset is None:
            raise ValueError(f"Trainer: {description.lower()} requires a dataset.")
        dataset = self._remove_unused_columns(dataset, description)
        sampler = None
        if not isinstance(dataset, IterableDataset) and sampler_fn is not None:
            sampler = sampler_fn(dataset)
        processes, rank = self.accelerator.num_processes, self.accelerator.process_index
        return make_dataloader(dataset, self.args, self.data_collator, batch_size, sampler, processes, rank)

    def _get_train_sampler(self, train_dataset: Any = None) -> Sampler[int]:
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        return train_sampler(dataset, self.args, self.processing_class)

    def _get_eval_sampler(self, eval_dataset: Any) -> Sampler[int]:
        return SequentialSampler(eval_dataset)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError(
                "Trainer: evaluation requires an eval_dataset. Pass `eval_dataset=` to the Trainer or to evaluate()."
            )
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        return self._get_dataloader(dataset, "Evaluation", self.args.eval_batch_size, self._get_eval_sampler)

    def get_test_dataloader(self, test_dataset: Any) -> DataLoader:
        return self._get_dataloader(test_dataset, "test", self.args.eval_batch_size, self._get_eval_sampler)

    def num_examples(self, dataloader: DataLoader) -> int:
        try:
            return len(dataloader.dataset)
        except (NameError, AttributeError, TypeError):
            return len(dataloader) * self.args.per_device_train_batch_size
