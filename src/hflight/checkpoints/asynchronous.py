"""Who finishes a checkpoint's write: the training loop itself (the default, as transformers), or, with
``TrainingArguments(save_async=True)``, a background thread, so that the loop is blocked only while the state is
copied.

With ``save_async``, at the step boundary the loop copies the model's and the optimizer's tensors into host memory
(:meth:`CheckpointWriter.snapshot`: buffers kept from one checkpoint to the next, so only the first copy allocates),
writes the small files (scheduler, RNG, ``trainer_state.json``, config, tokenizer) as before, and hands the rest to a
background thread: the tensor files from the snapshot, the manifest, the durable publication
(``hflight.durable.publish_folder``) and the rotation of older checkpoints. The next step cannot change what is
written: the snapshot is a copy.

At most one write is in flight: a checkpoint that comes while the previous one is still written waits for it (and
says so when the wait is long). :meth:`CheckpointWriter.wait` is called where the folder must exist: at the end of
``fit`` (also when it raised), before a stop by signal reports its checkpoint, before a checkpoint is pushed; the
thread is not a daemon, so an interpreter that exits waits for it too. A write that fails stops the run at the next
step boundary with the error (:class:`~hflight.checkpoints.folders.CheckpointWriteError`); its unfinished folder is
removed, the checkpoints written before it are untouched. A process killed during the write leaves the unpublished
``.tmp-checkpoint-N`` (removed when the next run starts) and the last published checkpoint.

May import: ``hflight.checkpoints`` (its own modules).
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: after this many seconds of waiting for the previous write, the wait is reported
LONG_WAIT_S = 10.0


class CheckpointWriter:
    """The run's checkpoint writer: synchronous (``asynchronous=False``: :meth:`submit` runs the job now) or one
    background thread."""

    def __init__(self, asynchronous: bool) -> None:
        self.asynchronous = asynchronous
        self._thread: threading.Thread | None = None
        self._what: str | None = None
        self._error: BaseException | None = None
        self._buffers: dict[tuple[str, ...], torch.Tensor] = {}
        self.snapshot_bytes = 0  # host memory the snapshot buffers hold

    # ---- the snapshot ----------------------------------------------------------------------------------------------
    def snapshot(self, name: str, state: Any) -> Any:
        """``state`` (a state dict, nested) with every tensor copied into this writer's host buffers for ``name``
        (tensors that share storage still do); unchanged when the writer is synchronous."""
        if not self.asynchronous:
            return state
        self.wait()  # the buffers belong to the write in flight until it is done
        # deepcopy with every tensor already mapped to its buffer: the copy has the original's structure exactly
        # (shared objects stay shared, so torch.save writes the same bytes)
        memo: dict[int, Any] = {}
        shared: dict[tuple[Any, ...], torch.Tensor] = {}
        for key, tensor in _tensors(state, (name,)):
            if id(tensor) not in memo:
                memo[id(tensor)] = self._copy_tensor(tensor, key, shared)
        return copy.deepcopy(state, memo)

    def _copy_tensor(
        self, tensor: torch.Tensor, key: tuple[str, ...], shared: dict[tuple[Any, ...], torch.Tensor]
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
    def submit(self, what: str, job: Callable[[], None]) -> None:
        """Run ``job`` (the rest of the write of ``what``, e.g. "checkpoint-8"): now, or in the background once the
        previous write is done. A previous write's failure is raised here instead."""
        if not self.asynchronous:
            job()
            return
        self.wait()
        self._what = what
        self._thread = threading.Thread(target=self._run, args=(job,), name=f"hflight-write-{what}", daemon=False)
        self._thread.start()

    def _run(self, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as exc:  # reported on the training loop's thread
            self._error = exc

    def wait(self) -> None:
        """Wait for the write in flight (reporting a long wait); raise its error if it failed."""
        thread = self._thread
        if thread is not None:
            started = time.monotonic()
            thread.join(LONG_WAIT_S)
            if thread.is_alive():
                logger.warning(
                    f"Waiting for the background write of {self._what} to finish (at most one checkpoint is written at "
                    f"a time; {LONG_WAIT_S:.0f} s so far): the disk is slower than the checkpoints come."
                )
                thread.join()
                logger.info(f"{self._what} written after {time.monotonic() - started:.1f} s of waiting.")
            self._thread = None
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        """At a step boundary: raise the error of a background write that failed (once)."""
        if self._thread is not None and self._thread.is_alive():
            return
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self, raising: bool) -> None:
        """At the end of ``fit``: wait for the write in flight. ``raising``: ``fit`` raised already; a failed write is
        then logged, not raised over the error that ended the run."""
        try:
            self.wait()
        except BaseException as exc:
            if not raising:
                raise
            logger.error(f"The background checkpoint write also failed: {exc}")


def _tensors(value: Any, key: tuple[str, ...]) -> Any:
    """Every tensor in a nested state, with its path."""
    if isinstance(value, torch.Tensor):
        yield key, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _tensors(v, (*key, str(k)))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _tensors(v, (*key, str(i)))


class Deferred:
    """The tensor files of one checkpoint: written now (synchronous writer) or listed, from a snapshot, for the
    background write (:meth:`CheckpointWriter.submit`)."""

    def __init__(self, writer: CheckpointWriter) -> None:
        self.writer = writer
        self.jobs: list[tuple[str | None, Callable[[], None]]] = []

    @property
    def asynchronous(self) -> bool:
        return self.writer.asynchronous

    def save(self, obj: Any, path: str) -> None:
        """``torch.save(obj, path)``, now or later from a snapshot of ``obj``."""
        if not self.writer.asynchronous:
            torch.save(obj, path)
            return
        name = os.path.basename(path)
        snapshot = self.writer.snapshot(name, obj)
        self.jobs.append((name, lambda: torch.save(snapshot, path)))

    def later(self, name: str | None, job: Callable[[], None]) -> None:
        """Run ``job`` (writing file ``name``; None: several, found afterwards if one fails) in the background."""
        self.jobs.append((name, job))

    def run(self, tracker: Any) -> None:
        """Write the listed files (``tracker.file``: the one being written)."""
        for name, job in self.jobs:
            tracker.file = name
            job()
        self.jobs.clear()
