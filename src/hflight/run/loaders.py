"""How a data loader is dealt to the processes of a run: accelerate's ``prepare_data_loader``, on hflight's runs.

transformers' ``Trainer`` passes every loader it builds through ``accelerator.prepare``, which gives each process its
part as ``TrainingArguments.accelerator_config`` says. hflight has no accelerate state; :func:`prepare_loader` does the
same with the run's processes, batch for batch (tests/test_accelerator_config.py compares each piece with accelerate's
own class):

- ``split_batches=False`` (the default): each process takes whole batches, dealt round-robin; ``True``: every batch is
  cut into one slice per process, so the batch size is the global one (:class:`ShardedBatchSampler`).
- ``even_batches=True`` (the default): the last round is completed with samples from the start of the order, so that
  every process gets as many batches, all full; ``False``: each process gets what is left for it.
- ``dispatch_batches``: process 0 alone reads the loader and sends each global batch to the others, which keep their
  slice (:class:`DispatchedLoader`); ``None`` (the default) means True for iterable datasets only.
- ``use_seedable_sampler=True`` (the default): a ``RandomSampler`` becomes an :class:`EpochSeededRandomSampler`
  (accelerate's ``SeedableRandomSampler``: the order is drawn from ``data_seed + epoch``); ``False``: torch's sampler
  as it is, whose generator process 0 shares with the others at each pass.
- an iterable dataset that is not dispatched is read by every process, each keeping its slice of every global batch
  (:class:`IterableShard`).

Batches are not moved to the device here (accelerate's loaders do it): Lightning moves them, with ``non_blocking`` as
configured. Each prepared loader reports to a :class:`LoaderState` while it is iterated (the innermost loader's
``end_of_dataloader`` and ``remainder``, as accelerate's ``GradientState`` knows them), which
``trainer.accelerator.gather_for_metrics`` reads to drop the samples that evened out the last batch.
"""

from __future__ import annotations

import collections
import copy
import itertools
import logging
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler
from torch.utils.data.dataloader import _DatasetKind
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader import sampler as torchdata_sampler
from torchdata.stateful_dataloader import stateful_dataloader as torchdata_loader
from transformers.trainer_pt_utils import find_batch_size

from hflight.arguments import cluster
from hflight.run.samplers import EpochSeededRandomSampler, ShardedBatchSampler, split_batches_error

_SINGLE_PROCESS, _ITERABLE = torchdata_loader._StatefulSingleProcessDataLoaderIter, _DatasetKind.Iterable
_BATCH_SAMPLER_ITERATOR = torchdata_sampler._BatchSamplerIterator
logger = logging.getLogger(__name__)
_END = object()

# torchdata's loader says at each construction that a private switch of torch's it sets is deprecated: not the user's
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)

#: DataLoader settings a prepared loader keeps from the loader it was built from (batching aside).
_WORKER_SETTINGS = ("collate_fn", "num_workers", "pin_memory", "timeout", "worker_init_fn", "generator")
_WORKER_PROCESS_SETTINGS = ("multiprocessing_context", "prefetch_factor", "persistent_workers", "in_order")


@dataclass(frozen=True)
class LoaderSharding:
    """The data-loader part of transformers' ``AcceleratorConfig`` (same names, same defaults), and ``data_seed``."""

    split_batches: bool = False
    dispatch_batches: bool | None = None
    even_batches: bool = True
    use_seedable_sampler: bool = True
    non_blocking: bool = False
    data_seed: int | None = None

    @classmethod
    def from_config(cls, config: Any, data_seed: int | None = None) -> LoaderSharding:
        """From an ``AcceleratorConfig`` (or a mapping with its field names; None: the defaults)."""
        values = config if isinstance(config, Mapping) else vars(config) if config is not None else {}
        names = {f.name for f in fields(cls)} - {"data_seed"}
        return cls(**{k: v for k, v in values.items() if k in names}, data_seed=data_seed)


class LoaderState:
    """The prepared loaders being iterated, innermost last: what accelerate's ``GradientState`` knows of them."""

    def __init__(self) -> None:
        self.loaders: list[Any] = []

    @property
    def active_dataloader(self) -> Any:
        return self.loaders[-1] if self.loaders else None

    @property
    def in_dataloader(self) -> bool:
        return bool(self.loaders)

    @property
    def end_of_dataloader(self) -> bool:
        """Whether the batch being processed is the last one of the innermost loader."""
        return bool(self.loaders) and self.loaders[-1].end_of_dataloader

    @property
    def remainder(self) -> int:
        """Samples of the innermost loader's last global batch that are real (the rest evened it out); -1 unknown."""
        return self.loaders[-1].remainder if self.loaders else -1

    def enter(self, loader: Any) -> None:
        self.loaders.append(loader)

    def leave(self, loader: Any) -> None:
        self.loaders = [other for other in self.loaders if other is not loader]


class IterableShard(IterableDataset):
    """Process ``rank``'s samples of an iterable dataset, as accelerate's ``IterableDatasetShard``: every process reads
    the whole stream and keeps its slice of each global batch (``batch_size * num_processes`` samples, or
    ``batch_size`` with ``split_batches``); the last global batch is completed from the first one unless
    ``drop_last``."""

    def __init__(
        self, dataset: Any, batch_size: int, drop_last: bool, num_processes: int, rank: int, split_batches: bool
    ) -> None:
        if split_batches and batch_size % num_processes != 0:
            raise split_batches_error(batch_size, num_processes)
        self.dataset, self.batch_size, self.drop_last = dataset, batch_size, drop_last
        self.num_processes, self.rank, self.split_batches = num_processes, rank, split_batches
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __len__(self) -> int:
        rounds = len(self.dataset) / (self.batch_size * self.num_processes)
        return (math.floor(rounds) if self.drop_last else math.ceil(rounds)) * self.batch_size

    def __iter__(self) -> Iterator[Any]:
        generator = getattr(self.dataset, "generator", None)
        if not hasattr(self.dataset, "set_epoch") and isinstance(generator, torch.Generator):
            generator.manual_seed(self.epoch)
        whole = self.batch_size if self.split_batches else self.batch_size * self.num_processes
        size = self.batch_size // self.num_processes if self.split_batches else self.batch_size
        mine = range(self.rank * size, (self.rank + 1) * size)
        first: list[Any] | None = None
        current: list[Any] = []
        for item in self.dataset:
            current.append(item)
            if len(current) == whole:
                yield from (current[i] for i in mine)
                first = current if first is None else first
                current = []
        if not self.drop_last and current:
            first = list(current) if first is None else first
            while len(current) < whole:
                current = current + first
            yield from (current[i] for i in mine)


class _Prepared:
    """What every prepared loader has: where it came from (to deal it again for another world), its epoch, and its
    report to the :class:`LoaderState` while it is iterated."""

    end_of_dataloader = False
    remainder = -1
    reads_ahead = False  # whether iterating it already reads one batch ahead (as accelerate's loaders do)
    #: how a checkpoint records where this loader is (``hflight.run.position``): ``sampler``, the batches drawn from
    #: a map-style dataset (skipped by the sampler alone); ``dispatched``, process 0's stream; ``per_process``, each
    #: process's own stream
    how = "sampler"
    _skip_next = 0  # micro-batches the next pass skips by its sampler (a resumed map-style run)
    _restoring = 0  # a stream's position given: the batches it stands for (read and dropped if the dataset refuses it)

    def position(self) -> tuple[Any, bool]:
        """Where this loader is after the batch it yielded last: (its state, or None where the batch count says it,
        whether that batch was its pass's last)."""
        return None, self.end_of_dataloader

    def resume_from(self, batches: int, state: Any) -> None:
        """The next pass continues after ``batches`` batches of it, from ``state`` (a stream's, as :meth:`position`
        gave it) or, for a map-style dataset, by its sampler alone: the skipped batches' samples are drawn, never
        read."""
        self._skip_next = batches

    def forget_position(self) -> None:
        """The next pass starts from its beginning (its dataset refused the position :meth:`resume_from` gave)."""
        self._skip_next = 0

    def _restored(self, start: Callable[[], Iterator[Any]]) -> Iterator[Any]:
        """The iterator ``start()`` makes from the stream's position :meth:`resume_from` gave, its first batch read
        already: where the dataset refuses the position (in its ``load_state_dict``, at its first batch, in a loader
        worker), the pass from its beginning with the batches the position stands for read and dropped, as
        transformers resumes, and a warning naming the error. Here, in the loader, so that a dispatched stream's
        other processes see nothing of it."""
        restoring, self._restoring = self._restoring, 0
        try:
            inner = start()
            first = next(inner, _END)
        except Exception as exc:  # noqa: BLE001 - the dataset's own error, said, then transformers' way
            logger.warning(
                f"The training stream's dataset refused the checkpoint's data position ({type(exc).__name__}: {exc}); "
                f"reading and dropping the {restoring} batches it stands for instead, as transformers does."
            )
            self.forget_position()
            try:
                inner = start()
                for _ in range(restoring):
                    if next(inner, _END) is _END:
                        break
            except Exception as again:  # noqa: BLE001 - a dataset that keeps the state it refused
                raise ValueError(
                    f"The training stream's dataset refused the checkpoint's data position ({type(exc).__name__}: "
                    f"{exc}) and then its own start ({type(again).__name__}: {again}): set ignore_data_skip=True to "
                    "start the data over."
                ) from again
            return inner
        return inner if first is _END else itertools.chain([first], inner)

    @property
    def positioned(self) -> Any:
        """The dataset whose own state a stream's position holds (None: the position is a batch count)."""
        return None

    def _prepared_from(self, origin: DataLoader, sharding: LoaderSharding, processes: int, rank: int, state: Any):
        self.origin, self.sharding, self.num_processes, self.process_index = origin, sharding, processes, rank
        self.state = state
        self.iteration = 0

    def _begin(self, drop_last: bool, total_batch_size: int | None) -> None:
        self.end_of_dataloader, self.remainder = False, -1
        try:
            if not drop_last and total_batch_size:
                self.remainder = len(self.dataset) % total_batch_size
        except TypeError:  # no length
            pass
        if self.state is not None:
            self.state.enter(self)

    def _end(self) -> None:
        if self.state is not None:
            self.state.leave(self)

    def _set_sampler_epoch(self, batch_sampler: Any, epoch: int) -> None:
        self.iteration = epoch
        for holder in (batch_sampler, getattr(batch_sampler, "sampler", None)):
            if holder is not None and hasattr(holder, "set_epoch"):
                holder.set_epoch(epoch)
                return
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)


class ShardedLoader(_Prepared, DataLoader):
    """One process's part of a loader (accelerate's ``DataLoaderShard``, without the move to the device)."""

    def __init__(
        self,
        dataset: Any,
        *,
        prepared_from: tuple[DataLoader, LoaderSharding, int, int, Any],
        generator_to_share: torch.Generator | None = None,
        **settings: Any,
    ) -> None:
        super().__init__(dataset, **settings)
        self._prepared_from(*prepared_from)
        self.generator_to_share = generator_to_share

    @property
    def total_batch_size(self) -> int | None:
        """Samples in one step of all processes together (accelerate's: an iterable dataset's shard counts its own)."""
        total = getattr(self.batch_sampler, "total_batch_size", None)
        return total if total is not None else getattr(self.batch_sampler, "batch_size", None)

    def set_epoch(self, epoch: int) -> None:
        self._set_sampler_epoch(self.batch_sampler, epoch)

    def __iter__(self) -> Iterator[Any]:
        """The pass's batches; its loader iterator is created here, not at the first batch (it draws the loader's base
        seed from torch's generator: a resumed run creates it before it sets the checkpoint's generator states back)."""
        if self.generator_to_share is not None:
            share_generator(self.generator_to_share)
        self.set_epoch(self.iteration)
        skip, self._skip_next = self._skip_next, 0
        self._begin(self.origin.drop_last, self.total_batch_size)
        try:
            if skip:
                inner = _skipping(self, self.batch_sampler, skip)
            elif self._restoring:
                inner = self._restored(lambda: StatefulDataLoader.__iter__(self))
            else:
                inner = super().__iter__()
        except BaseException:
            self._end()
            raise
        return self._batches(inner, skip)

    def _batches(self, inner: Iterator[Any], skipped: int) -> Iterator[Any]:
        try:
            try:
                last = len(self) - 1
            except TypeError:
                last = -1
            for index, batch in enumerate(inner, start=skipped):
                self.end_of_dataloader = index == last
                yield batch
            self.iteration += 1
        finally:
            self._end()


class StreamShard(ShardedLoader, StatefulDataLoader):
    """One process's part of an iterable dataset it reads itself (not dispatched), on torchdata's
    ``StatefulDataLoader``: its ``state_dict()`` (each worker's dataset state and what it had read) is the position a
    checkpoint records, and a resumed run loads it rather than reading the trained batches again."""

    how = "per_process"

    def position(self) -> tuple[Any, bool]:
        return loader_state(self), self.end_of_dataloader

    def resume_from(self, batches: int, state: Any) -> None:
        self.load_state_dict(state)
        self._restoring = max(batches, 1)

    def forget_position(self) -> None:
        _forget_state(self)

    @property
    def positioned(self) -> Any:
        return self.dataset


class _SkipBatches:
    """A batch sampler's pass without its first ``count`` batches: their indices are drawn (the sampler draws its order
    as it would), no sample is read. Drawn at the first index asked for, as the sampler itself draws: a loader with
    workers asks when its iterator is created, one without at its first batch (:func:`_skipping` asks then)."""

    def __init__(self, batch_sampler: Any, count: int) -> None:
        self.batch_sampler, self.count = batch_sampler, count
        self._iterator: Iterator[Any] | None = None

    def __len__(self) -> int:
        return max(len(self.batch_sampler) - self.count, 0)

    def draw(self) -> None:
        if self._iterator is None:
            self._iterator = iter(self.batch_sampler)
            for _ in range(self.count):
                next(self._iterator, None)

    def __iter__(self) -> Iterator[Any]:
        self.draw()
        yield from self._iterator


def _skipping(loader: DataLoader, batch_sampler: Any, count: int) -> Iterator[Any]:
    """``loader``'s pass (its dataset, worker settings and ``batch_sampler``) without its first ``count`` batches,
    skipped by the sampler alone (accelerate's ``skip_first_batches``); the iterator created now, its sampler's order
    drawn after the loader's base seed, as in a pass of its own."""
    skipper = _SkipBatches(batch_sampler, count)
    inner = iter(DataLoader(loader.dataset, batch_sampler=skipper, **_settings(loader)))
    skipper.draw()
    return inner


def share_generator(generator: torch.Generator) -> None:
    """Process 0's state of ``generator`` on every process (accelerate's ``synchronize_rng_state`` for a generator)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    if torch.distributed.get_world_size() == 1:
        return
    state = [generator.get_state()]
    torch.distributed.broadcast_object_list(state, src=0)
    generator.set_state(state[0])


class DispatchedLoader(_Prepared, DataLoader):
    """Process 0 reads ``base`` and sends each global batch to the others, which keep their slice (accelerate's
    ``DataLoaderDispatcher``, with its numbers). Without ``split_batches`` a global batch is ``num_processes`` batches
    of ``base`` put end to end, so each process gets a whole batch; with it, one batch of ``base`` is cut. An uneven
    last global batch is cut into equal slices, completed with the first samples of the first global batch when it
    does not divide (``drop_last`` drops it). The loader reads one global batch ahead, as accelerate's does, to know
    the last one.

    A ``DataLoader`` as accelerate's dispatcher is (``isinstance`` holds), whose loader settings are ``base``'s: it
    iterates ``base`` rather than a loader of its own, so ``DataLoader.__init__`` is not run."""

    reads_ahead = True

    def __init__(
        self, base: DataLoader, prepared_from: tuple[DataLoader, LoaderSharding, int, int, Any], drop_last: bool
    ) -> None:
        self._prepared_from(*prepared_from)
        self.base, self.drop_last = base, drop_last
        self.split_batches = self.sharding.split_batches
        self._stopped = False
        self.how = "dispatched" if isinstance(base, StatefulDataLoader) else "sampler"
        # process 0: the base's state after each global batch read and not yet handed out, and the handed-out one's
        self._read_states: collections.deque[Any] = collections.deque()
        self._position_state: Any = None

    def position(self) -> tuple[Any, bool]:
        return self._position_state, self.end_of_dataloader

    def resume_from(self, batches: int, state: Any) -> None:
        if self.how == "sampler":  # a map-style dataset: its base batches skipped by the sampler
            self._skip_next = batches * (1 if self.split_batches else self.num_processes)
        elif self.process_index == 0 and state is not None:
            self.base.load_state_dict(state)
            self._restoring = max(batches * (1 if self.split_batches else self.num_processes), 1)

    def forget_position(self) -> None:
        self._skip_next = 0
        if isinstance(self.base, StatefulDataLoader):
            _forget_state(self.base)

    @property
    def positioned(self) -> Any:
        return self.base.dataset if self.how == "dispatched" else None

    def __getattr__(self, name: str) -> Any:  # the rest of the DataLoader settings (num_workers, collate_fn, ...)
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)

    dataset = property(lambda self: self.base.dataset)
    sampler = property(lambda self: self.base.sampler)
    batch_sampler = property(lambda self: self.base.batch_sampler)
    batch_size = property(lambda self: self.base.batch_size)

    @property
    def total_batch_size(self) -> int | None:
        size = self.base.batch_size
        return None if size is None else size if self.split_batches else size * self.num_processes

    def set_epoch(self, epoch: int) -> None:
        self._set_sampler_epoch(self.base.batch_sampler, epoch)

    def __len__(self) -> int:
        whole = len(self.base)
        if self.split_batches:
            return whole
        return whole // self.num_processes if self.drop_last else math.ceil(whole / self.num_processes)

    def __iter__(self) -> Iterator[Any]:
        """The pass's slices; ``base``'s iterator is created here, not at the first batch (see
        :meth:`ShardedLoader.__iter__`)."""
        self.set_epoch(self.iteration)
        skip, self._skip_next = self._skip_next, 0
        self._begin(self.drop_last, self.total_batch_size)
        self._read_states.clear()
        try:
            # every process creates the iterator (it draws the loader's base seed, on each as in accelerate); only
            # process 0 reads from it
            if skip:
                reader = _skipping(self.base, self.base.batch_sampler, skip)
            elif self._restoring:  # process 0 (the others read nothing): a refused position read and dropped here
                reader = self._restored(lambda: iter(self.base))
            else:
                reader = iter(self.base)
        except BaseException:
            self._end()
            raise
        return self._pass(reader)

    def _pass(self, reader: Iterator[Any]) -> Iterator[Any]:
        try:
            yield from self._dispatched(reader)
            self.iteration += 1
        finally:
            self._end()

    def _dispatched(self, reader: Iterator[Any]) -> Iterator[Any]:
        n, rank = self.num_processes, self.process_index
        self._stopped = False
        first = None
        batch = self._fetch(reader)
        while True:
            if batch is None:
                raise ValueError("dispatch_batches=True: the loader gave no batch (an empty dataset?)")
            if not self.drop_last and first is None:
                first = slice_batch(batch, slice(0, n))
            observed = find_batch_size(batch) or 0
            size, last = observed // n, self._stopped
            if not last:
                following = self._fetch(reader)
                last = self._stopped and following is None
            if last and not self.drop_last and observed % n != 0:
                batch, size = concatenate([batch, first]), size + 1
            if last:
                self.end_of_dataloader, self.remainder = True, observed
            # each process's slice as tensors of its own, as transformers' model gets them (its ``_prepare_input``
            # moves every tensor to ``args.device``, ``cpu:0`` there, which copies it): a view into the global batch
            # starts where its rows do, not on the allocator's 64-byte boundary, and on some CPUs (AVX2) the matmul
            # kernels then round the last bit differently (issue: one ulp apart from step 2 on an AMD EPYC)
            if self._read_states:  # process 0 of a stream: where the base is once this batch is read
                self._position_state = self._read_states.popleft()
            yield slice_batch(batch, slice(rank * size, (rank + 1) * size), copy=True)
            if last:
                return
            batch = following

    def _fetch(self, reader: Iterator[Any]) -> Any:
        """The next global batch on every process (None at the end); ``_stopped`` once ``base`` is exhausted."""
        message: list[Any] = [None]
        if self.process_index == 0:
            message[0] = self._read(reader)
        if self.num_processes > 1:
            torch.distributed.broadcast_object_list(message, src=0)
        batch, stopped, error = message[0]
        if error is not None:
            raise RuntimeError(error)
        self._stopped = stopped
        return batch

    def _read(self, reader: Iterator[Any]) -> tuple[Any, bool, str | None]:
        """Process 0's read: (global batch or None, base exhausted, an error every process raises)."""
        batches: list[Any] = []
        stopped = False
        try:
            for _ in range(1 if self.split_batches else self.num_processes):
                batches.append(next(reader))
        except StopIteration:
            stopped = True
        if self.how == "dispatched" and batches:
            self._read_states.append(loader_state(self.base))
        if not batches or (stopped and (self.split_batches or self.drop_last)):
            return None, stopped, None
        try:
            return (batches[0] if self.split_batches else concatenate(batches)), stopped, None
        except (RuntimeError, TypeError) as error:
            return None, stopped, (
                f"accelerator_config['dispatch_batches']: process 0 could not put {len(batches)} batches end to end "
                f"({error}). Batches of different shapes cannot be dispatched: set dispatch_batches=False (each "
                "process reads its own batches) or split_batches=True (one batch is read and cut)."
            )  # fmt: skip


def _rebuilt(like: Any, items: Iterable[Any]) -> Any:
    if isinstance(like, Mapping):
        return type(like)(dict(items))
    items = list(items)
    return type(like)(*items) if hasattr(like, "_fields") else type(like)(items)


def slice_batch(batch: Any, rows: slice, copy: bool = False) -> Any:
    """``batch``'s tensors cut along the first dimension (other leaves as they are); ``copy``: each cut a tensor of
    its own (contiguous, in storage of its own) rather than a view into ``batch``'s."""
    if torch.is_tensor(batch):
        return batch[rows].clone(memory_format=torch.contiguous_format) if copy else batch[rows]
    if isinstance(batch, Mapping):
        return _rebuilt(batch, ((k, slice_batch(v, rows, copy)) for k, v in batch.items()))
    if isinstance(batch, (list, tuple)):
        return _rebuilt(batch, (slice_batch(v, rows, copy) for v in batch))
    return batch


def concatenate(batches: list[Any]) -> Any:
    """Batches of one structure put end to end along the first dimension (tensors only, as accelerate's)."""
    first = batches[0]
    if torch.is_tensor(first):
        return torch.cat(batches, dim=0)
    if isinstance(first, Mapping):
        return _rebuilt(first, ((k, concatenate([b[k] for b in batches])) for k in first))
    if isinstance(first, (list, tuple)):
        return _rebuilt(first, (concatenate([b[i] for b in batches]) for i in range(len(first))))
    raise TypeError(f"only tensors can be put end to end, got {type(first).__name__}")


# ---- prepare -----------------------------------------------------------------------------------------------------
_STATEFUL: dict[type, bool] = {}


def _stateful(thing: Any) -> bool:
    """torchdata's ``isinstance(thing, Stateful)``, checked once per type (a type that forwards attributes,
    ``__getattr__``, object by object: it is Stateful over a stateful source only)."""
    kind = type(thing)
    stateful = _STATEFUL.get(kind)
    if stateful is None:
        stateful = isinstance(thing, torchdata_loader.Stateful)
        if not hasattr(kind, "__getattr__"):
            _STATEFUL[kind] = stateful
    return stateful


def _state_of(thing: Any) -> Any:
    """torchdata's ``try_to_serialize``: ``thing.state_dict()`` where it is ``Stateful`` (:func:`_stateful`; the
    batch sampler's iterator, which checks what it holds at every call, read here as it reads itself)."""
    kind = type(thing)
    if kind is _BATCH_SAMPLER_ITERATOR:
        state = {kind._SAMPLES_YIELDED: thing.samples_yielded}
        for key, held in ((kind._SAMPLER_STATE, thing.sampler), (kind._SAMPLER_ITER_STATE, thing.sampler_iter)):
            if _stateful(held):
                state[key] = _state_of(held)
        return state
    return thing.state_dict() if _stateful(thing) else None


def loader_state(loader: StatefulDataLoader) -> Any:
    """``loader.state_dict()`` as it is after the batch it yielded last, a structure of its own (a dataset's
    ``state_dict()`` may return the dict it keeps updating while the loader reads ahead; with workers, torchdata builds
    it afresh from what they sent). torchdata's one-process iterator over a stream is read here as its own
    ``state_dict()`` reads it (torchdata 0.11, tests/test_data_position.py compares both), with its ``Stateful``
    checks cached by type: Python 3.11 spends ~30 µs on each check of a runtime protocol, six a batch."""
    iterator = loader._iterator
    if type(iterator) is not _SINGLE_PROCESS or iterator._dataset_kind != _ITERABLE:
        state = loader.state_dict()
        return state if loader.num_workers > 0 else copied(state)
    fetcher = iterator._dataset_fetcher
    dataset_state = None if fetcher.dataset_iter is fetcher.dataset else _state_of(fetcher.dataset)
    if not _copies_its_state(fetcher.dataset):
        dataset_state = copied(dataset_state)
    return {
        torchdata_loader._INDEX_SAMPLER_STATE: _state_of(iterator._index_sampler),
        torchdata_loader._SAMPLER_ITER_STATE: _state_of(iterator._sampler_iter),
        torchdata_loader._SAMPLER_ITER_YIELDED: iterator._sampler_iter_yielded,
        iterator._NUM_YIELDED: iterator._num_yielded,
        torchdata_loader._ITERABLEDATASET_LEN_CALLED: iterator._IterableDataset_len_called,
        torchdata_loader._SHARED_SEED: iterator._shared_seed,
        torchdata_loader._FETCHER_STATE: {
            torchdata_loader._DATASET_ITER_STATE: copied(_state_of(fetcher.dataset_iter)),
            torchdata_loader._FETCHER_ENDED: fetcher.ended,
        },
        torchdata_loader._DATASET_STATE: dataset_state,
        torchdata_loader._ITERATOR_FINISHED: iterator._finished,
    }


_LEAVES = frozenset({int, float, bool, str, bytes, type(None)})


def _copies_its_state(dataset: Any) -> bool:
    """A ``datasets`` stream, whose ``state_dict()`` returns a copy of its state (datasets' ``_fast_copy``)."""
    return type(dataset).__module__.startswith("datasets.") and hasattr(dataset, "_ex_iterable")


def copied(state: Any) -> Any:
    """A loader's state as it is now: nested dicts, lists and tuples copied (a dataset's ``state_dict()`` may return
    the dict it keeps updating while the loader reads ahead), tensors cloned, other leaves as they are."""
    kind = type(state)
    if kind in _LEAVES:
        return state
    if kind is dict:
        return {key: value if type(value) in _LEAVES else copied(value) for key, value in state.items()}
    if kind is list or kind is tuple:
        return kind(value if type(value) in _LEAVES else copied(value) for value in state)
    if isinstance(state, (dict, list)):
        return copy.deepcopy(state)
    if torch.is_tensor(state):
        return state.clone()
    return state


def release_workers(loader: Any) -> None:
    """The worker processes of ``loader``'s live iterator (and of the loaders it wraps: ``base``) shut down now, at
    the end of training. torchdata's loader keeps its iterator (for ``state_dict``), and persistent workers are kept
    by torch's: left to the trainer's reference cycles, the workers lived on until a garbage collection, which then
    waited out each one's 5-second join timeout (transformers' own loop drops its iterator when training ends)."""
    seen: set[int] = set()
    while loader is not None and id(loader) not in seen:
        seen.add(id(loader))
        iterator = getattr(loader, "_iterator", None)
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()
            loader._iterator = None
        loader = getattr(loader, "base", None)


def _forget_state(loader: StatefulDataLoader) -> None:
    """torchdata's loader without the state its ``load_state_dict`` kept for its next iterator, and a ``datasets``
    stream without the one it was given (kept for its next iteration, in its ``_starting_state_dict``)."""
    loader.next_iter_state = None
    loader._iterator = None
    if getattr(loader.dataset, "_starting_state_dict", None) is not None:
        loader.dataset._starting_state_dict = None


def private_stream(dataset: Any) -> Any:
    """A ``datasets`` stream for an evaluation of the training stream object: the dataset object and its pipeline's
    nodes copied (datasets keeps the state of the iteration that started last on them, and a position it was given
    for its next iteration: evaluating the object itself moved the training's position, and a resumed run's position
    made it evaluate from there); what the nodes read and call (tables, files, functions) is shared, not copied. The
    training iterates the object itself, as transformers does (a callback's ``train_dataset.state_dict()`` is the
    training's). Any other dataset is returned as it is."""
    if not (type(dataset).__module__.startswith("datasets.") and hasattr(dataset, "_ex_iterable")):
        return dataset
    twin = copy.copy(dataset)
    twin.__dict__ = dict(vars(dataset))  # datasets' __getstate__ hands its own __dict__ to the copy
    twin._ex_iterable = _node_copy(dataset._ex_iterable, type(dataset._ex_iterable).__mro__[-2])
    twin._state_dict = None
    if hasattr(twin, "_starting_state_dict"):
        twin._starting_state_dict = None
    return twin


def _node_copy(node: Any, base: type) -> Any:
    """A pipeline node (a ``datasets`` examples iterable: ``base``) and the nodes under it, each a copy of its own
    without a state; their other attributes shared."""
    twin = copy.copy(node)
    twin.__dict__ = dict(vars(node))
    for name, value in vars(node).items():
        if isinstance(value, base):
            setattr(twin, name, _node_copy(value, base))
        elif isinstance(value, list) and value and all(isinstance(each, base) for each in value):
            setattr(twin, name, [_node_copy(each, base) for each in value])
    if hasattr(twin, "_state_dict"):
        twin._state_dict = None
    return twin


def _settings(loader: DataLoader, generator: bool = True) -> dict[str, Any]:
    """The worker settings of ``loader`` (what a prepared loader keeps)."""
    names = _WORKER_SETTINGS if generator else tuple(n for n in _WORKER_SETTINGS if n != "generator")
    settings = {name: getattr(loader, name) for name in names}
    if loader.num_workers > 0:
        settings.update({name: getattr(loader, name) for name in _WORKER_PROCESS_SETTINGS if hasattr(loader, name)})
    return settings


def _seedable(sampler: Any, sharding: LoaderSharding) -> Any:
    """accelerate's swap: a plain ``RandomSampler`` becomes an :class:`EpochSeededRandomSampler` seeded with
    ``data_seed``, else with torch's initial seed (``set_seed(args.seed)``'s)."""
    if not sharding.use_seedable_sampler or type(sampler) is not RandomSampler:
        return sampler
    seed = sharding.data_seed if sharding.data_seed is not None else torch.random.initial_seed()
    return EpochSeededRandomSampler(sampler.data_source, seed, sampler.replacement, sampler._num_samples)


def _shared_generator(sampler: Any) -> torch.Generator | None:
    """Without the seedable sampler, accelerate gives a generator-less random sampler one seeded from torch's global
    RNG (when the loader is prepared); process 0 shares its state at each pass."""
    if not hasattr(sampler, "generator"):
        return None
    if sampler.generator is None:
        sampler.generator = torch.Generator()
        sampler.generator.manual_seed(int(torch.empty((), dtype=torch.int64).random_().item()))
    return sampler.generator


def prepare_loader(
    loader: DataLoader, num_processes: int, process_index: int, sharding: LoaderSharding, state: Any = None
) -> Any:
    """``loader`` (built for all the data, as transformers builds it) as process ``process_index`` of
    ``num_processes`` iterates it: accelerate's ``prepare_data_loader`` with ``sharding``. A loader this function
    prepared is prepared again from the loader it came from."""
    if isinstance(loader, _Prepared):
        loader = loader.origin
    dataset = loader.dataset
    iterable = isinstance(dataset, IterableDataset)
    dispatch = sharding.dispatch_batches if sharding.dispatch_batches is not None else iterable
    prepared_from = (loader, sharding, num_processes, process_index, state)
    if sharding.split_batches and num_processes > 1:
        size = loader.batch_size if loader.batch_size is not None else getattr(loader.batch_sampler, "batch_size", None)
        if size is None or size % num_processes != 0:
            raise split_batches_error(size, num_processes)
    if not iterable:  # accelerate's swap applies to the sampler the batches are drawn from
        sampler = _seedable(getattr(loader.batch_sampler, "sampler", None), sharding)
        batch_sampler = _with_sampler(loader.batch_sampler, sampler)
    if dispatch:
        base_settings = _settings(loader, generator=False)
        if iterable:  # torchdata's: its state_dict() is the stream's position
            base = StatefulDataLoader(dataset, batch_size=loader.batch_size, drop_last=loader.drop_last,
                                      **base_settings)  # fmt: skip
        else:
            base = DataLoader(dataset, batch_sampler=batch_sampler, **base_settings)
        return DispatchedLoader(base, prepared_from, loader.drop_last)
    if iterable:
        return _iterable_shard(loader, prepared_from)
    shared = None
    if num_processes > 1:
        if not sharding.use_seedable_sampler:
            shared = _shared_generator(batch_sampler.sampler)
        batch_sampler = ShardedBatchSampler(
            None, None, False, num_processes, process_index,
            split_batches=sharding.split_batches, even_batches=sharding.even_batches, batch_sampler=batch_sampler,
        )  # fmt: skip
    settings = _settings(loader)
    if type(batch_sampler) is BatchSampler:  # one process: batched as given (the loader keeps its batch_size)
        batching = {"batch_size": batch_sampler.batch_size, "sampler": batch_sampler.sampler,
                    "drop_last": batch_sampler.drop_last}  # fmt: skip
    else:
        batching = {"batch_sampler": batch_sampler}
    return ShardedLoader(dataset, prepared_from=prepared_from, generator_to_share=shared, **batching, **settings)


def _with_sampler(batch_sampler: Any, sampler: Any) -> Any:
    """``batch_sampler`` drawing from ``sampler`` (a new ``BatchSampler``; another kind gets its ``sampler`` set)."""
    if batch_sampler is None or getattr(batch_sampler, "sampler", sampler) is sampler:
        return batch_sampler
    if type(batch_sampler) is BatchSampler:
        return BatchSampler(sampler, batch_sampler.batch_size, batch_sampler.drop_last)
    batch_sampler.sampler = sampler
    return batch_sampler


def _iterable_shard(loader: DataLoader, prepared_from: tuple) -> StreamShard:
    """An iterable dataset read by every process: a ``datasets`` stream with enough shards is split by shard (as
    accelerate does), any other through :class:`IterableShard`."""
    _, sharding, processes, rank, _ = prepared_from
    dataset, size, shared = loader.dataset, loader.batch_size, None
    if processes > 1:
        generator = getattr(dataset, "generator", None)
        shared = generator if isinstance(generator, torch.Generator) else None
        shards = getattr(dataset, "n_shards", 0)
        if hasattr(dataset, "shard") and not sharding.split_batches and shards >= processes:
            dataset = dataset.shard(num_shards=processes, index=rank)
        else:
            dataset = IterableShard(dataset, size, loader.drop_last, processes, rank, sharding.split_batches)
        size = size // processes if sharding.split_batches else size
    return StreamShard(
        dataset, prepared_from=prepared_from, generator_to_share=shared, batch_size=size, drop_last=loader.drop_last,
        **_settings(loader),
    )  # fmt: skip


def shard_loader(loader: Any, world_size: int, rank: int) -> Any:
    """``loader`` for process ``rank`` of ``world_size``: a loader :func:`prepare_loader` made (or one of
    :class:`ShardedBatchSampler`) for another world is dealt again for this one, with the same settings; a plain loader
    with torch's ``BatchSampler`` built before Lightning's own launch started the processes is dealt with the default
    settings; anything else (one already dealt for this world, a batch sampler of the user's own, a plain loader built
    under an external launcher: a ``get_eval_dataloader`` override's, used as it is, as transformers uses it) is
    returned as it is."""
    if isinstance(loader, _Prepared):
        if (loader.num_processes, loader.process_index) == (world_size, rank):
            return loader
        return prepare_loader(loader, world_size, rank, loader.sharding, loader.state)
    batches = getattr(loader, "batch_sampler", None)
    if isinstance(batches, ShardedBatchSampler):
        if (batches.num_replicas, batches.rank) == (world_size, rank):
            return loader
        whole = DataLoader(loader.dataset, batch_sampler=batches.batch_sampler, **_settings(loader))
        sharding = LoaderSharding(split_batches=batches.split_batches, even_batches=batches.even_batches)
        return prepare_loader(whole, world_size, rank, sharding)
    if world_size <= 1 or not isinstance(loader, DataLoader) or type(batches) is not BatchSampler:
        return loader
    if cluster.environment() != "lightning":
        return loader  # built in a launched process: a loader of the user's own, which transformers does not deal
    return prepare_loader(loader, world_size, rank, LoaderSharding())
