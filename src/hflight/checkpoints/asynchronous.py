"""Who finishes a checkpoint's write (its :class:`~hflight.checkpoints.job.CheckpointJob`): the training loop itself
(the default, as transformers), or, with ``TrainingArguments(save_async=True)``, a background thread, so that the loop
is blocked only while the state is copied.

With ``save_async``, at the step boundary the loop copies the model's and the optimizer's tensors into host memory
(:meth:`CheckpointWriter.snapshot`: buffers kept from one checkpoint to the next, so only the first copy allocates),
writes the small files (scheduler, RNG, ``trainer_state.json``, config, tokenizer) as before, and hands the job to a
background thread: the tensor files from the snapshot, their checksums and fsyncs, the manifest, the durable
publication (``hflight.durable.publish_folder``) and the rotation of older checkpoints. The next step cannot change
what is written: the snapshot is a copy. The publication waits for the loop's ``on_save`` and keeps what was written
into ``checkpoint-N`` until then: by a callback, or by a ``_save_checkpoint`` override after ``super()``, for which
the folder is made when the save returns (``CheckpointJob.open_final_dir``). The job's decisions were all taken on
the loop's thread; the writer thread changes nothing module-wide (accelerate's unwrapping is left alone for it, by
the loop's thread, for as long as the job runs: ``hflight.checkpoints.weights.deepspeed_left_alone``).

At most one write is in flight: a checkpoint that comes while the previous one is still written waits for it (and
says so when the wait is long). :meth:`CheckpointWriter.wait` is called where the folder must exist: at the end of
``fit`` (also when it raised), before a stop by signal reports its checkpoint, before a checkpoint is pushed; the
thread is not a daemon, so an interpreter that exits waits for it too. A write that fails stops the run at the next
step boundary with the error (:class:`~hflight.checkpoints.job.CheckpointWriteError`), on every process: while a write
is in flight, the processes learn at each step boundary, together, whether it is done and how (the main process alone
writes; the others would otherwise go on into the next collective and wait there for it). Its unfinished folder is
removed, the checkpoints written before it are untouched. A process killed during the write leaves the unpublished
``.tmp-checkpoint-N`` (removed when the next run starts) and the last published checkpoint.

May import: ``hflight.checkpoints`` (its own modules).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
from typing import Any

import torch

from hflight.checkpoints.job import CheckpointJob, CheckpointWriteError
from hflight.checkpoints.weights import deepspeed_left_alone

logger = logging.getLogger(__name__)

#: after this many seconds of waiting for the previous write, the wait is reported
LONG_WAIT_S = 10.0


class CheckpointWriter:
    """The run's checkpoint writer: synchronous (``asynchronous=False``: :meth:`submit` finishes the job now) or one
    background thread. ``world``: the run's processes (``hflight.run.distributed.World``; None: one), which learn
    together how a background write ended."""

    def __init__(self, asynchronous: bool, world: Any = None) -> None:
        self.asynchronous = asynchronous
        self.world = world
        self._thread: threading.Thread | None = None
        self._callbacks_over: threading.Event | None = None  # the job in flight's: its on_save is over
        self._in_flight: str | None = None  # every process: the checkpoint written in the background, until all know
        self._outcome: BaseException | None = None
        self._lease = contextlib.ExitStack()
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self.snapshot_bytes = 0  # host memory the snapshot buffers hold
        #: the run folders whose own entry in their parent this run's publications made durable
        self.entries_made_durable: set[tuple[int, int]] = set()

    def job(
        self, folder: str, final_dir: str, main: bool, last: bool = False, on_save_follows: bool = False
    ) -> CheckpointJob:
        """A checkpoint's job, written into ``folder`` and published as ``final_dir`` (``main``: by this process).
        ``last``: training ends after this checkpoint, so the loop has nothing to do but wait for it (``submit(...,
        last=True)``): with ``save_async`` the state is then not copied (nothing changes it before the write is
        over) and the files are written side by side on the cores the loop leaves free. ``on_save_follows``: a
        checkpoint of the running fit, whose ``on_save`` the loop dispatches next (:meth:`callbacks_done`)."""
        if not self.asynchronous:
            return CheckpointJob(folder, final_dir, None, main, self.entries_made_durable)
        return CheckpointJob(folder, final_dir, self.snapshot, main, self.entries_made_durable, last=last,
                             on_save_follows=on_save_follows)  # fmt: skip

    # ---- the snapshot ----------------------------------------------------------------------------------------------
    def snapshot(self, name: str, state: Any) -> Any:
        """``state`` (a state dict, nested) with every tensor copied into this writer's host buffers for ``name``
        (tensors that share storage still do); unchanged when the writer is synchronous."""
        if not self.asynchronous:
            return state
        self._join()  # the buffers belong to the write in flight until it is done
        # deepcopy with every tensor already mapped to its buffer: the copy has the original's structure exactly
        # (shared objects stay shared, so torch.save writes the same bytes)
        memo: dict[int, Any] = {}
        shared: dict[tuple[Any, ...], torch.Tensor] = {}
        for key, tensor in _tensors(state, (name,)):
            if id(tensor) not in memo:
                memo[id(tensor)] = self._copy_tensor(tensor, key, shared)
        return copy.deepcopy(state, memo)

    def _copy_tensor(
        self, tensor: torch.Tensor, key: tuple[Any, ...], shared: dict[tuple[Any, ...], torch.Tensor]
    ) -> torch.Tensor:
        tensor = tensor.detach()
        identity = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape,
                    tensor.stride(), tensor.dtype)  # fmt: skip
        if tensor.untyped_storage().data_ptr() != 0 and identity in shared:  # tied weights stay tied
            return shared[identity]
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            if buffer is not None:  # replaced: a tensor of this key changed shape or dtype
                self.snapshot_bytes -= buffer.numel() * buffer.element_size()
            buffer = torch.empty_like(tensor, device="cpu", memory_format=torch.contiguous_format)
            if tensor.device.type == "cuda":
                buffer = buffer.pin_memory()
            self.snapshot_bytes += buffer.numel() * buffer.element_size()
            self._buffers[key] = buffer
        buffer.copy_(tensor, non_blocking=tensor.device.type == "cuda")
        shared[identity] = buffer
        return buffer

    def snapshot_done(self) -> None:
        """After the snapshot's copies: device-to-host copies are complete before the loop goes on."""
        if self.asynchronous and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

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
        self._in_flight = what
        if job is not None:
            self._callbacks_over = job.callbacks_over
            self._lease.enter_context(deepspeed_left_alone())  # for the job's save_pretrained, until it is reaped
            self._thread = threading.Thread(target=self._run, args=(job,), name=f"hflight-write-{what}", daemon=False)
            self._thread.start()
        if last:  # written from the state itself: over before the loop goes on (a wait by design, not reported)
            self.wait(expected=True)

    def _run(self, job: CheckpointJob) -> None:
        self._outcome = job.finish()

    def callbacks_done(self) -> None:
        """The loop's ``on_save`` for the checkpoint submitted last is over (also when it raised): the background
        write may publish the folder, with what the callbacks wrote into it. Any later call of the loop's on this
        writer says so too (a checkpoint saved outside the loop has no ``on_save`` to wait for)."""
        if self._callbacks_over is not None:
            self._callbacks_over.set()

    def _join(self, expected: bool = False) -> None:
        """Wait for this process's write in flight, reporting a long wait (one the loop does not ``expect``: a
        checkpoint's wait for the one before it)."""
        self.callbacks_done()
        thread = self._thread
        if thread is None:
            return
        started = time.monotonic()
        thread.join(None if expected else LONG_WAIT_S)
        if thread.is_alive():
            logger.warning(
                f"Waiting for the background write of {self._in_flight} to finish (at most one checkpoint is written "
                f"at a time; {LONG_WAIT_S:.0f} s so far): the disk is slower than the checkpoints come."
            )
            thread.join()
            logger.info(f"{self._in_flight} written after {time.monotonic() - started:.1f} s of waiting.")

    def wait(self, expected: bool = False) -> None:
        """Every process at once: wait for the write in flight; raise its error (on every process) if it failed.
        ``expected``: the caller waits for it by design (the run's last checkpoint), so a long wait is not reported."""
        if self._in_flight is not None:
            self._join(expected)
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
        """At the end of ``fit``: wait for the write in flight. ``raising``: ``fit`` raised already (on this process;
        the others may not be here); a failed write is then logged, not raised over the error that ended the run."""
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
