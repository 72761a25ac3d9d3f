"""Who finishes a checkpoint's write (its :class:`~hflight.checkpoints.job.CheckpointJob`): the training loop itself
(the default, as transformers), or, with ``TrainingArguments(save_async=True)``, a background thread, so that the loop
is blocked only while the state is copied.

With ``save_async``, at the step boundary the loop copies the model's and the optimizer's tensors into host memory
(:meth:`CheckpointWriter.snapshot`), writes the small files (scheduler, RNG, ``trainer_state.json``, config, tokenizer)
as before, and hands the job to a background thread: the tensor files from the snapshot, their checksums and fsyncs,
the manifest, the durable publication (``hflight.durable.publish_folder``) and the rotation of older checkpoints. The
next step cannot change what is written: the snapshot is a copy. The publication waits for the loop's ``on_save`` and
keeps what was written into ``checkpoint-N`` until then: by a callback, or by a ``_save_checkpoint`` override after
``super()``, for which the folder is made when the save returns (``CheckpointJob.open_final_dir``). The job's
decisions were all taken on the loop's thread; the writer thread changes nothing module-wide (accelerate's unwrapping
is left alone for it, by the loop's thread, for as long as the job runs:
``hflight.checkpoints.weights.deepspeed_left_alone``).

The copies go into one staging area of host memory, allocated once and reused by every checkpoint: each tensor at its
place in the area's layout (64-byte aligned; tensors that share storage once), with a storage of its own over its
bytes (``torch.save`` writes a tensor's whole storage, and ``save_pretrained`` takes tensors whose storages start at the
same address for tied weights). A checkpoint whose tensors do not all fit (the first one; a state that grew) copies
the rest into a buffer of its own, and the area is then allocated, once, for that checkpoint's whole layout. With
tensors on a GPU the area is pinned and the copies are queued on a side stream of the writer's, after the work the
training stream has queued; the training stream waits for them on the device (an event), not the host, so the next
step cannot change a tensor before it is copied and the loop goes on at once; the writer thread waits for the event
before it reads the copies. Tensors in host memory are copied there and then.

Where it can run (Linux), for a state of :data:`PROCESS_MIN_BYTES` or more, the staging area is shared memory and
the largest files, ``optimizer.pt`` and the model's safetensors files, are written by a child process
(:mod:`hflight.checkpoints.writers.writer_process`), so that their serialization, hashing and writing take nothing of
the training process's interpreter lock; the background thread sends it each file's structure and waits for its
checksum, and writes the rest itself. Buffers the staging area replaces are released once the write reading them is
over.

At most one write is in flight: a checkpoint that comes while the previous one is still written waits for it. The
first such wait of a run is a warning with the numbers (how long that write took, its bytes, how soon the next
checkpoint came: a larger ``save_steps`` or a faster disk stops the stalls); later ones are logged at info level.
:meth:`CheckpointWriter.wait` is called where the folder must exist: at the end of ``fit`` (also when it raised),
before a stop by signal reports its checkpoint, before a checkpoint is pushed; the thread is not a daemon, so an
interpreter that exits waits for it too. A write that fails stops the run at the next step boundary with the error
(:class:`~hflight.checkpoints.job.CheckpointWriteError`), on every process: while a write is in flight, the processes
learn at each step boundary, together, whether it is done and how (the main process alone writes; the others would
otherwise go on into the next collective and wait there for it). Its unfinished folder is removed, the checkpoints
written before it are untouched. A process killed during the write leaves the unpublished ``.tmp-checkpoint-N``
(removed when the next run starts) and the last published checkpoint.

May import: ``hflight.checkpoints`` (its own modules).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import dataclasses
import logging
import mmap
import os
import threading
import time
from typing import Any

import numpy as np
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from hflight.checkpoints.job import CheckpointJob, CheckpointWriteError
from hflight.checkpoints.weights import deepspeed_left_alone
from hflight.checkpoints.writers import resources, writer_process

logger = logging.getLogger(__name__)

#: after this many seconds of waiting for the previous write, the wait is logged while it goes on
LONG_WAIT_S = 10.0
#: each copy starts on a cache line of the staging area (a smaller tensor: on a multiple of its size, within one line)
ALIGNMENT = 64
#: the writer process takes a state's files from this many bytes of tensors on: starting it costs a second or two of
#: CPU (its imports), where the writer thread's Python for a smaller state takes milliseconds of the interpreter
PROCESS_MIN_BYTES = 64 << 20
#: ... and where the run has this many checkpoints to come that copy the state (its last is written from the state
#: itself), or does not say: its start, a second or two of CPU, is paid once, and what it saves, the writer thread's
#: Python beside the training loop, at each checkpoint it writes. On a 2-core CPU (MiniLM, one training thread,
#: benchmarks/checkpoint_run.py) a run of 4 checkpoints paid more for the start than the child saved it; a loop that
#: launches GPU kernels gains most from it (benchmarks/checkpoint_gil.py)
PROCESS_MIN_CHECKPOINTS = 7
#: a snapshot of this many bytes in host memory or more is copied by two threads side by side (:func:`_copy_on_host`)
PARALLEL_COPY_BYTES = 32 << 20
#: ... in pieces of at most this many bytes
COPY_PIECE_BYTES = 8 << 20


@dataclasses.dataclass
class _Slot:
    """Where one storage of the state is copied: ``nbytes`` at ``offset`` of the staging area's layout, held by
    ``storage`` (an untyped storage over them) at ``at`` of ``buffer``: the area, or the overflow buffer of the
    snapshot that laid it out while the area was too small."""

    offset: int
    nbytes: int
    buffer: Any  # host memory as a numpy array (what the copies' storages are made over)
    at: int
    storage: Any


@dataclasses.dataclass
class _Write:
    """The background write of checkpoint ``what``: when it was handed over, the bytes of its snapshot, the events the
    writer thread waits for before it reads the copies, and when it ended."""

    what: str
    started: float
    nbytes: int
    copied: list[Any]
    ended: float | None = None


class CheckpointWriter:
    """The run's checkpoint writer: synchronous (``asynchronous=False``: :meth:`submit` finishes the job now) or one
    background thread. ``world``: the run's processes (``hflight.run.distributed.World``; None: one), which learn
    together how a background write ended."""

    def __init__(self, asynchronous: bool, world: Any = None) -> None:
        self.asynchronous = asynchronous
        self.world = world
        # where it can run: the staging area in shared memory, the large files written by a child process
        self._process = writer_process.WriterProcess() if asynchronous and writer_process.available() else None
        self._retired: list[Any] = []  # buffers the write in flight may still read: released once it is over
        self._overflows: list[Any] = []  # the overflow buffers of the snapshot being taken
        self._thread: threading.Thread | None = None
        self._callbacks_over: threading.Event | None = None  # the job in flight's: its on_save is over
        self._in_flight: str | None = None  # every process: the checkpoint written in the background, until all know
        self._outcome: BaseException | None = None
        self._lease = contextlib.ExitStack()
        # the staging area: the slots of the tensors by key, the area, the bytes laid out, the overflow buffers' bytes
        self._slots: dict[tuple[Any, ...], _Slot] = {}
        self._area: Any = None
        self._allocating: _Allocation | None = None  # the area being allocated, until the next snapshot takes it
        self._to_come: int | None = None  # the checkpoints the run saves after the one being written, if it says
        self._end = 0
        self._overflow_bytes = 0
        self._used: set[tuple[Any, ...]] = set()  # the keys snapshotted since the last snapshot_done
        self._pinned = False  # a tensor came from a GPU: the area is pinned
        self._area_pinned = False  # the area was allocated pinned (asked: a failed pinning is not asked again)
        self._streams: dict[torch.device, Any] = {}  # the side stream of each GPU
        self._copied: list[Any] = []  # the events of the copies queued since the last submit
        self._later: list[tuple[np.ndarray, np.ndarray]] = []  # host copies left to the next step (snapshot(until=))
        self._copying: concurrent.futures.Future | None = None  # those copies, being made beside the step
        self._copying_in = 0  # ... by the helper thread of this process
        self._step_hook: Any = None  # torch's optimizer-step pre-hook that waits for them
        self._write: _Write | None = None  # the write in flight, or the last one
        self._waited: float | None = None  # when the last wait() began to wait for a write still in flight
        self._wait_said = False
        #: the run folders whose own entry in their parent this run's publications made durable
        self.entries_made_durable: set[tuple[int, int]] = set()

    def job(
        self,
        folder: str,
        final_dir: str,
        main: bool,
        last: bool = False,
        on_save_follows: bool = False,
        to_come: int | None = None,
    ) -> CheckpointJob:
        """A checkpoint's job, written into ``folder`` and published as ``final_dir`` (``main``: by this process).
        ``last``: training ends after this checkpoint, so the loop has nothing to do but wait for it (``submit(...,
        last=True)``): with ``save_async`` the state is then not copied (nothing changes it before the write is
        over) and the files are written side by side on the cores the loop leaves free. ``on_save_follows``: a
        checkpoint of the running fit, whose ``on_save`` the loop dispatches next (:meth:`callbacks_done`).
        ``to_come``: how many checkpoints after this one copy the state (None: not known; the run's last is written
        from the state itself), which decides whether the staging area is made at all and whether the writer process
        is worth starting (:data:`PROCESS_MIN_CHECKPOINTS`). A wait for the previous write just before
        (``save_checkpoint``'s :meth:`wait`) was this checkpoint's: said now."""
        self._to_come = to_come
        self._later = []  # an abandoned checkpoint's copies left for later: not made
        self._say_last_wait()
        if not self.asynchronous:
            return CheckpointJob(folder, final_dir, None, main, self.entries_made_durable)
        return CheckpointJob(folder, final_dir, self.snapshot, main, self.entries_made_durable, last=last,
                             on_save_follows=on_save_follows, process=self._process)  # fmt: skip

    # ---- the snapshot ----------------------------------------------------------------------------------------------
    def prepare(self, tensors: Any, to_come: int | None) -> None:
        """Before the run's first checkpoint (the loop calls it once the state exists, after its first optimizer step):
        the staging area made for ``tensors`` (the model's and optimizer's, each storage once, 64-byte aligned) by a
        thread of its own, its pages present, so that the first checkpoint copies into it as the later ones do
        rather than into fresh memory, faulting its pages in on the loop's thread. ``to_come``: the checkpoints that
        will copy the state (none: no area). A state that turns out larger overflows as before."""
        if not self.asynchronous or self._area is not None or self._allocating is not None or to_come == 0:
            return
        storages, pinned = {}, False
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor) and _stageable(tensor):
                storage = tensor.untyped_storage()
                storages[storage._cdata] = storage.nbytes()
                pinned = pinned or _on_gpu(tensor)
        end = sum(storages.values()) + ALIGNMENT * len(storages)  # whatever order the snapshots lay them out in
        if not storages:
            return
        self._to_come = to_come
        shared = self._process_worth_it(end)
        self._area_pinned = self._pinned = pinned
        self._allocating = allocation = _Allocation(lambda: self._area_memory(end, pinned, shared), end)
        threading.Thread(target=allocation.prepare, name="hflight-staging-area", daemon=True).start()

    @property
    def snapshot_bytes(self) -> int:
        """The host memory the snapshots hold: the staging area, and the overflow buffers of a checkpoint whose
        tensors did not all fit in it, until the area is allocated for them (:meth:`snapshot_done`)."""
        return self._capacity + self._overflow_bytes

    @property
    def _capacity(self) -> int:
        if self._allocating is not None:
            return self._allocating.nbytes
        return 0 if self._area is None else len(self._area)

    def snapshot(self, name: str, state: Any, until: Any = None) -> Any:
        """``state`` (a state dict, nested) with every tensor copied into this writer's staging area, at the slot of
        its key under ``name`` (tensors that share storage still do); unchanged when the writer is synchronous.
        ``until``: nothing changes ``state``'s tensors before the next ``step()`` of a torch optimizer (an optimizer's
        own state, in a run where nothing else touches it: ``hflight.checkpoints.folders``), so its copies from host
        memory are made beside the next step's forward and backward, by a helper thread, and that step waits for them
        before it changes anything (:meth:`snapshot_done`); the copy that is returned is complete once they are."""
        if not self.asynchronous:
            return state
        self._say_wait(self._join())  # the staging area belongs to the write in flight until it is done
        self._release_retired()
        self._take_area()
        self._drop_step_hook()
        # deepcopy with every tensor already mapped to its copy: the copy has the original's structure exactly
        # (shared objects stay shared, so torch.save writes the same bytes)
        memo: dict[int, Any] = {}
        # an optimizer's per-parameter state (its "state" entries: the moments) changes only in its step; its
        # param_groups (a learning rate held as a tensor, which a scheduler stepping on a metric fills in place after
        # an evaluation) are copied now
        now, beside_the_step = [], []
        for pair, keys in self._stage(name, state, memo):
            deferred = until is not None and all(key[1:2] == ("state",) for key in keys)
            (beside_the_step if deferred else now).append(pair)
        self._copy(now)
        self._copy(beside_the_step, later=True)
        return copy.deepcopy(state, memo)

    def _stage(self, name: str, state: Any, memo: dict[int, Any]) -> list[tuple[tuple[Any, Any], list[Any]]]:
        """Every tensor of ``state`` mapped in ``memo`` to its copy: the same view (offset, shape, strides, dtype) of
        its storage's copy in the staging area (those past its end: in one overflow buffer), with the tensor's
        ``requires_grad``, ``Parameter`` type and Python attributes, as ``torch.save`` writes it. Tensors over one
        storage (tied weights, views) share its copy, as they share the storage: ``torch.save`` writes each storage
        once, ``save_pretrained`` finds tied weights by their storage. Returns the copies to make, (copy, source),
        each storage once, with the keys of the tensors over it."""
        storages: dict[int, tuple[_Slot, Any]] = {}  # by the source storage's _cdata, as torch.save tells them apart
        keys: dict[int, list[Any]] = {}
        views: list[tuple[torch.Tensor, _Slot]] = []
        own: list[torch.Tensor] = []
        for key, tensor in _tensors(state, (name,)):
            if id(tensor) in memo:
                continue
            if not _stageable(tensor):  # a sparse, quantized or subclassed tensor: a copy of its own, now
                memo[id(tensor)] = _own_copy(tensor)
                own.append(tensor)
                continue
            storage = tensor.untyped_storage()
            if storage._cdata not in storages:
                storages[storage._cdata] = (self._slot(key, storage.nbytes()), storage)
            keys.setdefault(storage._cdata, []).append(key)
            views.append((tensor, storages[storage._cdata][0]))
            memo[id(tensor)] = None  # made below, once every storage has its copy
        self._overflow([slot for slot, _ in storages.values() if slot.storage is None])
        for tensor, slot in views:
            memo[id(tensor)] = _view(slot.storage, tensor)
        for tensor in [each for each, _ in views] + own:  # attributes last: one may hold another tensor of the state
            state = torch._utils._get_obj_state(tensor)  # what torch.save keeps of it: __dict__, and __slots__
            if state if not isinstance(state, tuple) else any(state):
                torch._utils._set_obj_state(memo[id(tensor)], copy.deepcopy(state, memo))
        return [((slot.storage, storage), keys[cdata]) for cdata, (slot, storage) in storages.items() if slot.nbytes]

    def _slot(self, key: tuple[Any, ...], nbytes: int) -> _Slot:
        """The slot of ``key`` (a storage of ``nbytes`` first met at it): the last checkpoint's (the same bytes), or a
        new one at the end of the layout, with its storage when the area holds it (else None: :meth:`_overflow` makes
        it)."""
        self._used.add(key)
        slot = self._slots.get(key)
        if slot is not None and slot.nbytes == nbytes and slot.storage is not None:
            return slot
        offset = _aligned(self._end, nbytes)
        self._end = offset + nbytes
        inside = nbytes == 0 or self._end <= self._capacity
        slot = _Slot(offset, nbytes, self._area, offset, _storage_over(self._area, offset, nbytes) if inside else None)
        self._slots[key] = slot
        return slot

    def _overflow(self, pending: list[_Slot]) -> None:
        """The storages of the slots laid out past the staging area's end, in one buffer (their part of the layout),
        kept until the area is allocated for them (:meth:`snapshot_done`)."""
        if not pending:
            return
        start = pending[0].offset
        buffer = _host_memory(self._end - start, pinned=False)  # the process's own: the thread writes its files
        self._overflows.append(buffer)
        self._overflow_bytes += len(buffer)
        for slot in pending:
            slot.buffer, slot.at = buffer, slot.offset - start
            slot.storage = _storage_over(buffer, slot.at, slot.nbytes)

    def _copy(self, copies: list[tuple[Any, Any]], later: bool = False) -> None:
        """Each (copy, source) of storages, their bytes: from host memory now (``later``: at :meth:`snapshot_done`,
        beside the next step); from a GPU queued on the side stream of its device; from another device by torch,
        now."""
        on_gpu: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        on_host: list[tuple[np.ndarray, np.ndarray]] = []
        for target_storage, source_storage in copies:
            target, source = _bytes(target_storage), _bytes(source_storage)
            if _on_gpu(source):
                on_gpu.setdefault(source.device, []).append((target, source))
            elif source.device.type == "cpu":
                on_host.append((target.numpy(), source.numpy()))
            else:  # another accelerator's memory (MPS, XPU, ...): torch's copy, there and then, as before
                target.copy_(source)
        if later:
            self._later += on_host
        else:
            _copy_on_host(on_host)
        for device, pairs in on_gpu.items():
            self._pinned = True
            self._copied.append(self._copy_on_side_stream(device, pairs))

    def _copy_on_side_stream(self, device: torch.device, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """``pairs`` copied on this writer's side stream of ``device``, after the work the training stream has queued
        (the tensors as the step leaves them); the training stream waits for the copies on the device, so the next
        step cannot change a tensor before it is copied, and the host goes on. Returns the copies' event, which the
        writer thread waits for before it reads them (a device-wide synchronize would stall the loop until then)."""
        side = self._streams.get(device)
        if side is None:
            side = self._streams[device] = torch.cuda.Stream(device=device)
        training = torch.cuda.current_stream(device)
        side.wait_stream(training)
        with torch.cuda.stream(side):
            for target, source in pairs:
                target.copy_(source, non_blocking=True)
                source.record_stream(side)  # a source freed meanwhile keeps its memory until the copy is made
        copied = torch.cuda.Event()
        copied.record(side)
        training.wait_event(copied)
        return copied

    def snapshot_done(self) -> None:
        """After a checkpoint's snapshots, on the loop's thread: nothing to wait for (the training stream waits for
        the copies from a GPU on the device). Where the checkpoint's tensors did not all fit in the staging area, the
        area is allocated now, once, for its layout (the tensors of this checkpoint, packed), as it is where tensors
        come from a GPU for the first time into an area that is not pinned: the next checkpoint of the same state
        copies into it without allocating; the copies just made stay where they are until written."""
        if not self.asynchronous:
            return
        self._copy_beside_next_step()
        if self._overflow_bytes or self._pinned > self._area_pinned:
            self._reallocate_area()
        self._used.clear()

    def _copy_beside_next_step(self) -> None:
        """The copies of the snapshots taken ``until`` the next optimizer step, started on the helper thread: the loop
        goes on into the next step's forward and backward meanwhile, and every torch optimizer's ``step()`` waits for
        them first (a pre-hook of torch's, for any optimizer of the process: layer-wise ones step during the
        backward); the writer thread waits for them before it reads the copies."""
        pairs, self._later = self._later, []
        copying = _copy_on_helper(pairs) if pairs else None
        if copying is None:
            return
        self._copying, self._copying_in = copying, os.getpid()
        if self._step_hook is None:
            self._step_hook = register_optimizer_step_pre_hook(self._before_a_step)
        self._copied.append(_Copying(copying))

    def _before_a_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Before any torch optimizer's ``step()``: the copies made beside the step are over (their failure is the
        write's, raised by it). Not in a forked process, which inherits the hook but not the helper thread (its copy
        of the copies would never end) and whose steps change nothing of this process's."""
        copying = self._copying
        if copying is not None and os.getpid() == self._copying_in:
            concurrent.futures.wait([copying])

    def _drop_step_hook(self, wait: bool = False) -> None:
        """The step hook removed once the copies it waits for are over (``wait``: waited for first), on the loop's
        thread, never inside a step, whose loop over the hooks a removal would break."""
        if self._step_hook is None:
            return
        if wait and self._copying is not None:
            concurrent.futures.wait([self._copying])
        if self._copying is None or self._copying.done():
            self._step_hook.remove()
            self._step_hook, self._copying = None, None

    def _reallocate_area(self) -> None:
        """The staging area laid out anew for the slots used since the last checkpoint, packed in their order (the
        slots of keys no longer snapshotted are dropped), to be allocated by the writer thread once this checkpoint
        is written, its pages made present (and pinned) there rather than at the next checkpoint's copies on the
        loop's thread, and not beside the write (on a machine of two cores, three busy threads slowed the loop); the
        slots' storages are made over it when the next snapshot takes it (:meth:`_take_area`)."""
        kept = [(key, slot) for key, slot in self._slots.items() if key in self._used and slot.storage is not None]
        kept.sort(key=lambda each: each[1].offset)
        offsets, end = [], 0
        for _, slot in kept:
            offsets.append(_aligned(end, slot.nbytes))
            end = offsets[-1] + slot.nbytes
        # the copies just made into the old area and the overflow buffers are this checkpoint's: released once written
        self._retired += [each for each in (self._area, *self._overflows) if each is not None]
        self._overflows = []
        self._slots = {key: _Slot(at, slot.nbytes, None, at, None) for (key, slot), at in zip(kept, offsets)}
        pinned = self._area_pinned = self._pinned
        self._area, self._end, self._overflow_bytes = None, end, 0
        if self._to_come == 0:  # no checkpoint to come copies the state: no area (one that does makes its buffer)
            return
        shared = self._process_worth_it(end)
        self._allocating = _Allocation(lambda: self._area_memory(end, pinned, shared), end)  # by the writer thread

    def _area_memory(self, nbytes: int, pinned: bool, shared: bool) -> Any:
        """The staging area's memory, its pages present: shared with the writer process (``shared``), or the process's
        own."""
        if shared:
            return self._process.allocate(nbytes, pinned, populate=True)
        return _host_memory(nbytes, pinned, populate=True)

    def _process_worth_it(self, nbytes: int) -> bool:
        """Whether the writer process is worth starting for a state of ``nbytes`` (:data:`PROCESS_MIN_BYTES`) in a run
        with the checkpoints to come of the one being written (:data:`PROCESS_MIN_CHECKPOINTS`)."""
        if self._process is None or nbytes < PROCESS_MIN_BYTES:
            return False
        return self._to_come is None or self._to_come >= PROCESS_MIN_CHECKPOINTS

    def _take_area(self) -> None:
        """The area allocated after the last checkpoint, once it is (the slots' storages made over it)."""
        allocating, self._allocating = self._allocating, None
        if allocating is None:
            return
        self._area = allocating.result()
        for slot in self._slots.values():
            if slot.storage is None:
                slot.buffer, slot.storage = self._area, _storage_over(self._area, slot.at, slot.nbytes)

    def _release_retired(self) -> None:
        """The buffers replaced by a reallocation of the staging area, once no write reads them any more."""
        retired, self._retired = self._retired, []
        if self._process is not None:
            for buffer in retired:
                self._process.release(buffer)

    # ---- the write -------------------------------------------------------------------------------------------------
    def submit(self, job: CheckpointJob | None, what: str, last: bool = False) -> None:
        """Every process, once its part of checkpoint ``what`` (e.g. "checkpoint-8") is written: finish ``job`` (None:
        this process has none to finish), now, or in the background once the previous write is done. ``last``: the
        job was made ``last`` (from the state itself): returns once the checkpoint is published."""
        if not self.asynchronous:
            if job is not None and (failure := job.finish()) is not None:
                raise failure
            return
        self.wait()
        self._say_last_wait()  # a wait for the previous write here was this checkpoint's
        self._in_flight = what
        copied, self._copied = self._copied, []
        if job is not None:
            self._write = _Write(what, time.monotonic(), self.snapshot_bytes, copied)
            self._callbacks_over = job.callbacks_over
            self._lease.enter_context(deepspeed_left_alone())  # for the job's save_pretrained, until it is reaped
            self._thread = threading.Thread(target=self._run, args=([job],), name=f"hflight-write-{what}", daemon=False)
            self._thread.start()
        if last:  # written from the state itself: over before the loop goes on (a wait by design, not reported)
            self.wait(expected=True)

    def _run(self, holder: list[CheckpointJob]) -> None:
        """The writer thread: the copies from a GPU and those made beside the step are made (their events) before
        the job reads them. The job (and the snapshot it holds) is let go of once written (``holder``: the thread's
        only reference to it), before the memory of the next checkpoints is made (:meth:`_after_write`). It runs at
        the loop's priority: the loop waits for it at times (the next checkpoint, the end of a fit, a push, a stop),
        and a thread's lowered priority cannot be raised back (a write at nice +10 beside two busy processes made
        the loop wait 3.61 s instead of 0.55 s)."""
        write, job = self._write, holder.pop()
        try:
            for copied in write.copied if write is not None else ():
                copied.synchronize()
            self._outcome = job.finish()
        except BaseException as exc:  # noqa: BLE001 - a copy that failed on the device: raised on the loop's thread
            self._outcome = exc
        finally:
            if write is not None:
                write.ended = time.monotonic()
        del job
        self._after_write()

    def _after_write(self) -> None:
        """The writer thread, its write over: the buffers it read that the staging area replaces released (so that
        the state is never held twice), then the area laid out at its snapshot allocated, then the writer process
        started once there is shared memory for it (its start, imports that take a second or two of CPU, beside the
        training steps rather than beside the write; until it answers, the thread writes the files). A failed
        allocation is raised where the loop takes the area."""
        self._release_retired()
        allocating = self._allocating
        if allocating is not None:
            with contextlib.suppress(Exception):
                allocating.result()
        if self._process is not None and self._process.allocated:  # the area is shared: the process is worth it
            self._process.start()

    def callbacks_done(self) -> None:
        """The loop's ``on_save`` for the checkpoint submitted last is over (also when it raised): the background
        write may publish the folder, with what the callbacks wrote into it. Any later call of the loop's on this
        writer says so too (a checkpoint saved outside the loop has no ``on_save`` to wait for)."""
        if self._callbacks_over is not None:
            self._callbacks_over.set()

    def _join(self, expected: bool = False) -> float | None:
        """Wait for this process's write in flight. Returns when the wait began, where the write was still being
        written and the wait is not one the loop ``expected`` (the run's last checkpoint): a checkpoint came before
        the previous one was written (:meth:`_say_wait`); None otherwise."""
        self.callbacks_done()
        thread = self._thread
        if thread is None:
            return None
        if expected or not thread.is_alive():
            thread.join()
            return None
        began = time.monotonic()
        thread.join(LONG_WAIT_S)
        if thread.is_alive():
            logger.info(f"Still waiting for the background write of {self._in_flight} ({LONG_WAIT_S:.0f} s so far).")
            thread.join()
        return began

    def _say_last_wait(self) -> None:
        """The last :meth:`wait`'s wait for a write still in flight, said (once) by the checkpoint it was for."""
        began, self._waited = self._waited, None
        self._say_wait(began)

    def _say_wait(self, began: float | None) -> None:
        """A checkpoint waited (since ``began``) for the previous one's write: the first time in a run, a warning with
        the numbers (at this pace the loop stalls at every checkpoint) and what to do; later waits at info level."""
        write = self._write
        if began is None or write is None or write.ended is None:
            return
        took, came = write.ended - write.started, began - write.started
        numbers = (f"the background write of {write.what} ({_size(write.nbytes)}) took {took:.2f} s, and the next "
                   f"checkpoint came {came:.2f} s after it began, so the training loop waited "
                   f"{write.ended - began:.2f} s for it")  # fmt: skip
        if self._wait_said:
            logger.info(f"A checkpoint waited for the one before: {numbers}.")
            return
        self._wait_said = True
        logger.warning(
            f"Checkpoints come faster than the disk writes them: {numbers} (one checkpoint is written at a time). "
            f"The loop stalls like this at every checkpoint closer than {took:.1f} s to the one before: raise "
            f"save_steps, or write output_dir to a faster disk. (Said once; later waits are logged at info level.)"
        )

    def wait(self, expected: bool = False) -> None:
        """Every process at once: wait for the write in flight; raise its error (on every process) if it failed.
        ``expected``: the caller waits for it by design (the run's last checkpoint), so the wait is not reported; any
        other is said by the checkpoint that follows it (:meth:`job`), if one does."""
        self._waited = None
        if self._in_flight is not None:
            self._waited = self._join(expected)
            self._settle(done=True)

    def raise_if_failed(self) -> None:
        """Every process, at a step boundary: raise the error of a background write that failed (once), on every
        process; one small collective per step while a write is in flight, with several processes."""
        if self._in_flight is not None:
            self.callbacks_done()
            self._settle(done=self._thread is None or not self._thread.is_alive())

    def _settle(self, done: bool) -> None:
        """The processes agree whether the write in flight is done (``done``: this process's is) and how it ended; if
        done, the write is over for all of them, and its failure raised by each."""
        mine = self._outcome if done and self._thread is not None else None
        summary = (type(mine).__name__, str(mine)) if mine is not None else None
        several = self.world is not None and self.world.size > 1
        views = self.world.gather_objects([(done, summary)]) if several else [(done, summary)]
        if not all(each_done for each_done, _ in views):
            return
        self._thread, self._outcome, self._in_flight, self._callbacks_over = None, None, None, None
        self._lease.close()
        failed = next((each for _, each in views if each is not None), None)
        if mine is not None:
            raise mine
        if failed is not None:  # another process's write: the same error here
            kind, message = failed
            raise (
                CheckpointWriteError(message)
                if kind == CheckpointWriteError.__name__
                else RuntimeError(
                    f"The background checkpoint write failed on the process that writes checkpoints: {kind}: {message}"
                )
            )

    def close(self, raising: bool) -> None:
        """At the end of ``fit``: wait for the write in flight (and stop the writer process, its shared memory
        released). ``raising``: ``fit`` raised already (on this process; the others may not be here); a failed write
        is then logged, not raised over the error that ended the run."""
        try:
            self._close(raising)
        finally:  # the copies dropped first: the shared memory is unmapped with the last tensor over it
            self._drop_step_hook(wait=True)  # no step comes: the copies beside the step are waited for (a write
            # not submitted, as a checkpoint that failed half-way, did not wait for them)
            self._allocating, self._later = None, []
            self._slots, self._area, self._end, self._overflows, self._retired = {}, None, 0, [], []
            self._overflow_bytes, self._area_pinned, self._write, self._copied = 0, False, None, []
            if self._process is not None:
                self._process.close()
            resources.pools.close()

    def _close(self, raising: bool) -> None:
        if not raising:
            self.wait()
            return
        self._join()
        failure, self._thread, self._outcome, self._in_flight = self._outcome, None, None, None
        self._callbacks_over = None
        self._lease.close()
        if failure is not None:
            logger.error(f"The background checkpoint write also failed: {failure}")


def _tensors(value: Any, key: tuple[Any, ...]) -> Any:
    """Every tensor in a nested state, with its path (the keys themselves: a dict's ``1`` and ``"1"`` are two
    tensors, and two buffers)."""
    if isinstance(value, torch.Tensor):
        yield key, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _tensors(v, (*key, k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _tensors(v, (*key, i))


def _stageable(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is copied into the staging area: a plain dense tensor or parameter, its bytes its elements
    (no lazy conjugate or negative bit)."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.layout != torch.strided:
        return False
    return not (tensor.is_quantized or tensor.is_conj() or tensor.is_neg() or tensor.device.type == "meta")


def _own_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy in host memory of a tensor the staging area does not take (sparse, quantized, a subclass: its type
    kept), with its ``requires_grad``, as ``torch.save`` writes the tensor (its attributes: :meth:`_stage`)."""
    copied = tensor.detach().to("cpu", copy=True)
    kind = type(tensor)
    if type(copied) is not kind:  # detach() gives a plain tensor for parameters and subclasses without torch_function
        if isinstance(tensor, torch.nn.Parameter):  # the subclass's own __new__ may want more: Parameter's makes it
            copied = torch.nn.Parameter.__new__(kind, copied, tensor.requires_grad)
        else:
            copied = copied.as_subclass(kind)
    if tensor.requires_grad and not copied.requires_grad:
        copied.requires_grad_(True)
    return copied


def _on_gpu(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cuda"


def _aligned(offset: int, nbytes: int) -> int:
    """``offset`` rounded up to :data:`ALIGNMENT`, or, for a tensor of fewer bytes, to the power of two above its size
    (a multiple of its element's, within one cache line): tiny tensors (scalars, biases of a few elements) packed."""
    step = min(ALIGNMENT, 1 << max(nbytes - 1, 0).bit_length())
    return -(-offset // step) * step


def _host_memory(nbytes: int, pinned: bool, populate: bool = False) -> Any:
    """``nbytes`` of host memory, as the numpy array the copies' storages are made over (the array keeps it); pinned
    for copies from a GPU (a copy into pageable memory blocks the host until it is made), where pinning succeeds;
    ``populate``: its pages made present now (by the calling thread, the interpreter lock released), not at the
    first copies into them. Private memory (a forked process gets its own copy)."""
    if pinned:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
        except RuntimeError as exc:
            logger.warning(
                f"Could not pin {_size(nbytes)} of host memory for the checkpoints' copies ({exc}): they are made "
                "into pageable memory, which holds the training loop until each copy is made."
            )
    array = np.frombuffer(mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE), dtype=np.uint8, count=nbytes)
    if populate:
        resources.populate(array)
    return array


class _Allocation:
    """The staging area's memory of ``nbytes``, allocated by whichever thread asks first (:meth:`result`): the writer
    thread once its write is over, beside the training steps, or the loop's thread at the next snapshot."""

    def __init__(self, allocate: Any, nbytes: int) -> None:
        self.nbytes, self._allocate = nbytes, allocate
        self._memory: Any = None
        self._lock = threading.Lock()

    def result(self) -> Any:
        with self._lock:
            if self._memory is None:
                self._memory = self._allocate()
            return self._memory

    def prepare(self) -> None:
        """:meth:`result`, on a thread of its own (a failure is raised where the area is taken)."""
        with contextlib.suppress(Exception):
            self.result()


def _copy_on_host(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """Each (target, source) of bytes in host memory copied, by numpy (a plain memory copy, the interpreter lock
    released; faster than torch's byte copy on one thread). From :data:`PARALLEL_COPY_BYTES` on, where the process may
    run on two cores, the second half of the bytes is copied at the same time by a helper thread of the process (the
    copy holds up the training loop: one thread copied 270 MB in 0.045 s, two in 0.027 s on a 2-core CPU)."""
    if not pairs:
        return
    total = sum(len(target) for target, _ in pairs)
    if total < PARALLEL_COPY_BYTES or len(_cores()) < 2:
        _copy_pieces(pairs)
        return
    pieces = [(target[at : at + COPY_PIECE_BYTES], source[at : at + COPY_PIECE_BYTES])
              for target, source in pairs for at in range(0, len(target), COPY_PIECE_BYTES)]  # fmt: skip
    mine, taken = 0, 0
    while mine < len(pieces) and taken < total / 2:
        taken += len(pieces[mine][0])
        mine += 1
    theirs = _copy_on_helper(pieces[mine:])
    try:
        _copy_pieces(pieces[:mine])
    finally:
        if theirs is not None:
            theirs.result()  # never left copying into the area after the loop went on (its error raised here)


def _copy_on_helper(pieces: list[tuple[np.ndarray, np.ndarray]]) -> concurrent.futures.Future | None:
    """``pieces`` copied by the process's helper thread for copies (made at its first use, by the training loop's
    thread): the copy's future; None where the helper was released meanwhile (a writer of another run closed), and the
    pieces were copied here."""
    helper = resources.pools.get(
        "asynchronous.copy", lambda: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hflight-copy"),
        lambda executor: executor.shutdown(wait=False),
    )  # fmt: skip
    try:
        return helper.submit(_copy_pieces, pieces)
    except RuntimeError:
        _copy_pieces(pieces)
        return None


class _Copying:
    """Host copies being made by the helper thread, as the writer thread waits for them (as for a GPU's event)."""

    def __init__(self, future: concurrent.futures.Future) -> None:
        self.future = future

    def synchronize(self) -> None:
        self.future.result()


def _copy_pieces(pieces: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for target, source in pieces:
        np.copyto(target, source)


def _cores() -> set[int]:
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def _storage_over(buffer: Any, at: int, nbytes: int) -> Any:
    """An untyped storage over ``buffer``'s ``nbytes`` from ``at`` (one of its own when empty)."""
    if nbytes == 0:
        return torch.UntypedStorage(0)
    return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=at).untyped_storage()


def _bytes(storage: Any) -> torch.Tensor:
    """A storage's bytes as a tensor over it, on its device."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


def _view(storage: Any, like: torch.Tensor) -> torch.Tensor:
    """``like``'s view (dtype, offset, shape, strides) over ``storage``, a ``Parameter`` where it is one, with its
    ``requires_grad``."""
    return writer_process.view_over(storage, like.dtype, like.shape, like.stride(), like.storage_offset(),
                                    like.requires_grad, type(like) is torch.nn.Parameter)  # fmt: skip


def _size(nbytes: int) -> str:
    if nbytes >= 1 << 30:
        return f"{nbytes / (1 << 30):.2f} GiB"
    return f"{nbytes / (1 << 20):.1f} MiB" if nbytes >= 1 << 20 else f"{nbytes} bytes"
