"""Data side of a run: samplers, accumulation cycles and the LightningDataModule around the facade's loaders.

The pieces (the samplers are ``hflight.run.samplers``', how a loader is dealt to the processes
``hflight.run.loaders``'):

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
- ``to_device``: a batch's tensors on the device, with accelerate's ``non_blocking`` setting.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sized
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch.utils.data import IterableDataset

from hflight.checkpoints.parts import rng_states
from hflight.run.backend import StepGeometry, backend_of
from hflight.run.distributed import World
from hflight.run.loaders import release_workers, shard_loader
from hflight.run.position import DataTracker
from hflight.run.samplers import (  # noqa: F401 (EpochSeededRandomSampler, ShardedBatchSampler: their former home)
    EpochSeededRandomSampler,
    ShardedBatchSampler,
    check_even_shards,
)
from hflight.surface import RunView, TrainerSurface


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
    #: accelerator_config's gradient_accumulation_kwargs['sync_each_batch']: every micro-batch synchronises the
    #: gradients across the processes (not only the cycle's last)
    sync_each_batch: bool = False
    #: the cycle's last micro-batch: the training loader's position after it (``hflight.run.position``), which a
    #: checkpoint taken once its optimizer step is over records
    position: dict[str, Any] | None = None

    @property
    def is_last(self) -> bool:
        return self.index == self.cycle_size - 1


class AccumulationCycles:
    """Iterates a training loader as HF's loop does: ``accumulation`` batches at a time, each tagged as a
    ``MicroBatch``. ``batch_samples(iterator, n)`` reads a cycle and counts its label items (the facade's
    ``get_batch_samples``, as transformers calls it once per cycle). ``start`` is where the next pass begins (a
    resumed run: ``hflight.run.position.Start``). A loader that reads one batch ahead itself (``reads_ahead``: a
    dispatching loader) is not read ahead again. The loader's ``position()`` after each batch it yields goes with
    the cycle's last micro-batch."""

    def __init__(
        self,
        loader: Any,
        accumulation: int,
        batch_samples: Callable[[Iterator, int], tuple[list[Any], torch.Tensor | int | None]],
        epoch_fn: Callable[[], int],
        sync_each_batch: bool = False,
    ) -> None:
        self.loader = loader
        self.accumulation = accumulation
        self.batch_samples = batch_samples
        self.epoch_fn = epoch_fn
        self.sync_each_batch = sync_each_batch
        self.start: Any = None  # hflight.run.position.Start of the next pass (a resumed run's)
        self.restore_rng: Callable[[], None] | None = None
        self.restore_epoch_start_rng: Callable[[], None] | None = None
        #: The RNG streams as the epoch in progress drew its data order (a checkpoint records them).
        self.epoch_start_rng: dict[str, Any] | None = None

    def __len__(self) -> int:
        # The full epoch length, also while a resumed epoch skips batches: Lightning reads it once and bounds
        # every later epoch by it; the shortened first pass simply ends early (Lightning handles StopIteration).
        return len(self.loader)

    def __iter__(self) -> Iterator[MicroBatch]:
        epoch = self.epoch_fn()
        set_loader_epoch(self.loader, epoch)
        start, self.start = self.start, None
        iterator, start = self._positioned(start)
        skip = start.batches if start is not None else 0
        if start is not None and start.reading:
            skip_batches(iterator, skip)
        # ... and the checkpoint's streams back for what follows the trained batches, as HF sets them after its skip
        restore, self.restore_rng = self.restore_rng, None
        if restore is not None and skip > 0:
            restore()
        positions: collections.deque[tuple[Any, bool]] = collections.deque()
        position = getattr(self.loader, "position", None)
        if callable(position):
            iterator = _positions_into(iterator, position, positions)
        if not getattr(self.loader, "reads_ahead", False):
            iterator = read_one_ahead(iterator)
        step, last = skip - 1, None
        while True:
            cycle, num_items = self.batch_samples(iterator, self.accumulation)
            if not cycle:
                if last is not None:  # the pass has ended (a stream without a length says so only now)
                    last["end_of_pass"] = True
                return
            step += len(cycle)
            last = _cycle_position(positions, len(cycle), epoch, step)
            for index, inputs in enumerate(cycle):
                at = step - len(cycle) + 1 + index
                yield MicroBatch(inputs, index, len(cycle), num_items, at, self.sync_each_batch,
                                 last if index == len(cycle) - 1 else None)  # fmt: skip

    def _positioned(self, start: Any) -> tuple[Iterator[Any], Any]:
        """The pass's iterator, created where a resumed run's data starts (``start``), and the start as it is taken
        up. A resumed run gets its RNG streams back where the uninterrupted run had them: before the epoch's iterator
        is created at an epoch boundary; mid-epoch, the iterator is created from the streams the epoch began with, so
        that it draws the same order (a sampler on torch's global generator, a loader's base seed), when the
        checkpoint recorded them, and the checkpoint's are set back after the trained batches (:meth:`__iter__`). A
        loader that cannot continue from a position (not one hflight prepared) reads and drops the trained batches
        instead (as a prepared one does where its dataset refuses the state: ``hflight.run.loaders``)."""
        skip = start.batches if start is not None else 0
        restore, restore_epoch_start = self.restore_rng, self.restore_epoch_start_rng
        self.restore_epoch_start_rng = None
        if restore is not None and skip == 0:
            self.restore_rng = None
            restore()
        elif restore_epoch_start is not None and skip > 0:
            restore_epoch_start()
        self.epoch_start_rng = rng_states()
        if start is not None and skip and not callable(getattr(self.loader, "resume_from", None)):
            start = dataclasses.replace(start, how="read", why="the training loader is not one hflight prepared")
        if start is None or start.reading or not (skip or start.state is not None):
            return iter(self.loader), start
        # a stream's state loaded (where its dataset refuses it, the loader reads and drops instead), or the sampler's
        # skip
        self.loader.resume_from(skip, start.state)
        return iter(self.loader), start


def skip_batches(iterator: Iterator[Any], count: int) -> None:
    """The first ``count`` batches read and dropped (a stream resumed from a checkpoint without its position, as
    transformers resumes), with a progress bar naming ``ignore_data_skip``, which starts the data over instead."""
    from tqdm.auto import tqdm

    description = "Skipping the batches trained before the checkpoint (ignore_data_skip=True starts the data over)"
    for _ in tqdm(range(count), desc=description, unit="batch", leave=False):
        if next(iterator, _END) is _END:
            return


_END = object()


def _positions_into(iterator: Iterator[Any], position: Callable[[], tuple[Any, bool]],
                    positions: collections.deque) -> Iterator[Any]:  # fmt: skip
    """``iterator``'s batches, the loader's ``position()`` after each put into ``positions`` (in their order)."""
    for batch in iterator:
        positions.append(position())
        yield batch


def _cycle_position(positions: collections.deque, count: int, epoch: int, step: int) -> dict[str, Any] | None:
    """The position after a cycle of ``count`` batches whose last is micro-batch ``step`` of pass ``epoch``: the
    loader's after its last batch (the positions of the batches read ahead stay for the next cycles)."""
    if len(positions) < count:
        positions.clear()
        return None
    for _ in range(count - 1):
        positions.popleft()
    state, end_of_pass = positions.popleft()
    return {"epoch": epoch, "batches": step + 1, "end_of_pass": bool(end_of_pass), "state": state}


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
        self.tracker: DataTracker | None = None  # the training data's position for the checkpoints

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        # Only a micro-batch's tensors travel; Lightning's generic path would deep-copy the whole dataclass
        # on every step. Lightning calls this right before the micro-batch's step: from here until the next one,
        # trainer.accelerator.sync_gradients says whether it ends its cycle (as transformers sets it per micro-batch).
        non_blocking = accelerate_setting(getattr(self.facade, "args", None), "non_blocking")
        if isinstance(batch, MicroBatch):
            state = getattr(getattr(self.facade, "accelerator", None), "gradient_state", None)
            if state is not None:
                state.sync_gradients = batch.is_last
            return dataclasses.replace(
                batch,
                inputs=to_device(batch.inputs, device, non_blocking),
                num_items_in_batch=to_device(batch.num_items_in_batch, device, non_blocking),
            )
        return to_device(batch, device, non_blocking)

    def setup(self, stage: str) -> None:
        if stage != "fit" or self.cycles is not None:
            return
        facade, backend = self.facade, backend_of(self.trainer.strategy)
        replicas, _ = self.run.world.data_parallel
        self.geometry = backend.hf_geometry(facade.args, replicas, self.run.train_batch_size)
        self.train_loader = backend.hf_prepare_loader(facade.get_train_dataloader(), training=True)
        self.cycles = AccumulationCycles(
            self.train_loader,
            self.geometry.accumulation,
            lambda iterator, num_batches: facade.get_batch_samples(iterator, num_batches, None),
            epoch_fn=lambda: self.run.epochs_offset + self.trainer.current_epoch,
            sync_each_batch=bool(accumulation_setting(facade.args, "sync_each_batch")),
        )
        self.tracker = DataTracker(self.train_loader, facade.train_dataset, replicas)
        self._check_evaluation_shards()

    def _check_evaluation_shards(self) -> None:
        """``even_batches=False``: the evaluations during training (``eval_strategy``) are checked before it starts
        (``check_even_shards``), not when the first one comes."""
        args, (processes, _) = self.facade.args, self.run.world.data_parallel
        if processes == 1 or accelerate_setting(args, "even_batches") is not False or args.eval_strategy == "no":
            return
        if accelerate_setting(args, "dispatch_batches"):  # dispatched batches are always even
            return
        evaluated = self.facade.eval_dataset
        for dataset in evaluated.values() if isinstance(evaluated, dict) else [evaluated]:
            if dataset is not None and not isinstance(dataset, IterableDataset) and hasattr(dataset, "__len__"):
                split = bool(accelerate_setting(args, "split_batches"))
                check_even_shards(len(dataset), args.eval_batch_size, args.dataloader_drop_last, processes, split,
                                  training=False)  # fmt: skip

    def resume_at(
        self,
        start: Any,
        restore_rng: Callable[[], None],
        restore_epoch_start_rng: Callable[[], None] | None = None,
    ) -> None:
        """A resumed run: its first pass begins at ``start`` (``hflight.run.position.Start``: after the trained
        micro-batches of its epoch), and ``restore_rng`` (the checkpoint's RNG streams) is called once they are passed,
        before the first batch trains; mid-epoch, ``restore_epoch_start_rng`` (the streams the checkpoint recorded for
        the start of its epoch) before the epoch's iterator is created."""
        self.cycles.start = start
        self.cycles.restore_rng = restore_rng
        self.cycles.restore_epoch_start_rng = restore_epoch_start_rng

    def train_dataloader(self) -> AccumulationCycles:
        if self.cycles is None:
            raise RuntimeError("HFDataModule.setup('fit') must run before train_dataloader()")
        return self.cycles

    def release_workers(self) -> None:
        """At the end of ``fit``: the training loader's worker processes shut down (``loaders.release_workers``)."""
        if self.cycles is not None:
            release_workers(self.cycles.loader)


def loader_length(loader: Any) -> int | None:
    """``len(loader)`` when the loader has one, else None (iterable datasets)."""
    try:
        return len(loader) if isinstance(loader, Sized) or hasattr(loader, "__len__") else None
    except TypeError:
        return None


class EvaluationData(L.LightningDataModule):
    """The loader of one evaluation outside training, given to Lightning's ``validate``: Lightning asks for it after
    it launched the processes, when the world is known, and gets it sharded for this process (``shard_loader``)."""

    def __init__(self, loader: Any) -> None:
        super().__init__()
        self.loader = loader
        self.dealt: Any = None  # the loader this process iterated

    def val_dataloader(self) -> Any:
        self.dealt = shard_loader(self.loader, *World(self.trainer).data_parallel)
        return self.dealt

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        sharding = getattr(self.loader, "sharding", None)  # a prepared loader's accelerator_config settings
        return to_device(batch, device, getattr(sharding, "non_blocking", False))


def accelerate_setting(args: Any, name: str) -> Any:
    """A field of ``args.accelerator_config`` (transformers' ``AcceleratorConfig``), None when it has none."""
    return getattr(getattr(args, "accelerator_config", None), name, None)


def accumulation_setting(args: Any, name: str) -> Any:
    """A key of ``accelerator_config``'s ``gradient_accumulation_kwargs``, None when unset."""
    return (accelerate_setting(args, "gradient_accumulation_kwargs") or {}).get(name)


def to_device(data: Any, device: torch.device, non_blocking: bool | None = False) -> Any:
    """``data`` on ``device`` as accelerate's ``send_to_device`` moves a batch: anything with a ``to`` (tensors, a
    tokenizer's ``BatchEncoding``) moved with ``non_blocking`` (accelerator_config's), lists, tuples and mappings item
    by item, anything else as it is."""
    if hasattr(data, "to") and not isinstance(data, type):
        try:
            return data.to(device, non_blocking=bool(non_blocking))
        except TypeError:  # a .to without non_blocking
            return move_data_to_device(data, device)
    if isinstance(data, Mapping):
        return type(data)({key: to_device(value, device, non_blocking) for key, value in data.items()})
    if isinstance(data, (list, tuple)):
        moved = [to_device(value, device, non_blocking) for value in data]
        return type(data)(*moved) if hasattr(data, "_fields") else type(data)(moved)
    return data
