"""One checkpoint's write, as one job: it writes the files, checksums and fsyncs each as it is complete, writes the
manifest, publishes the folder durably and retires the older checkpoints. The synchronous writer finishes it on the
training loop's thread; with ``save_async``, one background thread does (``hflight.checkpoints.asynchronous``).

Every decision is taken on the training loop's thread and passed in when the job is made: the folder, which files are
written now and which later from a copy (``save``, :meth:`CheckpointJob.later`), the manifest's fields, the rotation
that follows. The loop's thread writes its files through :meth:`CheckpointJob.write` (every process: its part); the
thread that finishes the job (:meth:`CheckpointJob.finish`) writes the rest, and it alone opens and closes the
folder's :class:`~hflight.checkpoints.manifest.Checksums`. Nothing module-wide is changed by it.

A failed write is a value: each step of the job names its file; :func:`write_error` makes of the exception one
:class:`CheckpointWriteError` naming the checkpoint, the file and the cause (None: it is not a write failure, and is
raised as it is). :meth:`CheckpointJob.finish` returns it; the writer raises it on the training loop's thread.

May import: ``hflight.checkpoints`` (its own modules), ``hflight.durable``, ``hflight._util``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import functools
import logging
import os
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hflight import durable
from hflight._util import exception_chain
from hflight.checkpoints.manifest import Checksums, new_digest, write_manifest
from hflight.checkpoints.names import DELETING_SUFFIX, MANIFEST_NAME, REPLACED_SUFFIX, TMP_PREFIX
from hflight.checkpoints.writers import safetensors_file, torch_file
from hflight.checkpoints.writers.writer_process import WriterProcessDied

logger = logging.getLogger(__name__)

Step = Callable[[], Any]


# ---- write errors --------------------------------------------------------------------------------------------------
class CheckpointWriteError(OSError):
    """Writing a checkpoint (or the model) failed: the message names the folder, the file and the cause."""


# What an error's text says when it carries no errno (safetensors' Rust errors, torch's C++ writer).
_CAUSE_TEXTS = (
    ("No space left on device", "no space left on device"),
    ("StorageFull", "no space left on device"),
    ("Disk quota exceeded", "disk quota exceeded"),
    ("Permission denied", "permission denied"),
    ("Read-only file system", "read-only file system"),
    ("Input/output error", "input/output error"),
)
# torch's zip writer reports a failed write as "[enforce fail at inline_container.cc:...] unexpected pos ..." or
# "basic_ios::clear: iostream error", without the operating system's reason.
_WRITE_FAILURE = re.compile(r"inline_container|iostream|PytorchStreamWriter|file write failed|I/O error|IoError")
_NEARLY_FULL = 1 << 20


def _existing_dir(path: str) -> str:
    while path and not os.path.isdir(path):
        path = os.path.dirname(path)
    return path or "."


def write_failure_cause(exc: BaseException, folder: str) -> str | None:
    """Why writing into ``folder`` failed ("no space left on device", "permission denied", ...), or None when
    ``exc`` is not a write failure (a bug elsewhere is not disguised as one)."""
    chain = list(exception_chain(exc))
    code = next((e.errno for e in chain if isinstance(e, OSError) and e.errno), None)
    if code is not None:
        return os.strerror(code).lower()
    text = " ".join(str(e) for e in chain)
    cause = next((cause for marker, cause in _CAUSE_TEXTS if marker in text), None)
    if cause is not None:
        return cause
    if not any(isinstance(e, OSError) for e in chain) and not _WRITE_FAILURE.search(text):
        return None
    where = _existing_dir(folder)
    if shutil.disk_usage(where).free < _NEARLY_FULL:
        return os.strerror(errno.ENOSPC).lower()
    if not os.access(where, os.W_OK):
        return os.strerror(errno.EACCES).lower()
    first_line = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return f"I/O error ({type(exc).__name__}: {first_line})"


def failed_file(exc: BaseException, folder: str, file: str | None) -> str:
    """The file a failed write of ``folder`` was writing: the one the error names, else the step's ``file``, else
    (a step writing several, such as ``save_pretrained``) the one changed last."""
    named = next((e.filename for e in exception_chain(exc) if isinstance(e, OSError) and e.filename), None)
    if named:
        return os.path.relpath(os.fspath(named), folder) if os.path.isabs(os.fspath(named)) else named
    if file is not None:
        return file
    written = [p for p in Path(folder).rglob("*") if p.is_file()] if os.path.isdir(folder) else []
    if not written:
        return "its first file"
    return max(written, key=lambda p: p.stat().st_mtime_ns).relative_to(folder).as_posix()


def write_error(exc: BaseException, folder: str, what: str, file: str | None, discard: bool) -> OSError | None:
    """``exc``, raised while writing ``file`` (None: not known) into ``folder`` for ``what`` (the checkpoint or model
    being saved), as one :class:`CheckpointWriteError`; None when it is not a write failure. ``discard``: the
    unfinished ``folder`` is deleted (a checkpoint's temporary folder)."""
    cause = write_failure_cause(exc, folder)
    if cause is None:
        return None
    file = failed_file(exc, folder, file)
    after = ""
    if discard:
        shutil.rmtree(folder, ignore_errors=True)
        where = os.path.dirname(folder) or "."
        after = f" The unfinished folder was removed; the checkpoints already in {where} are unchanged."
    return CheckpointWriteError(f"Could not save {what}: writing {file} failed: {cause}.{after}")


# ---- the job -------------------------------------------------------------------------------------------------------
class CheckpointJob:
    """The write of one checkpoint into its temporary ``folder``, published as ``final_dir``.

    ``snapshot(name, state)``: the background writer's copy of a state (``save_async``: the tensor files are written
    later from it); None: every file is written now. ``main``: this process publishes the folder (the others write
    their part now and finish nothing). ``entries_made_durable``: the run's record of the run folders whose entry in
    their parent it made durable (``hflight.durable.publish_folder``). ``last``: training ends after this checkpoint
    and the loop waits for the job, so nothing changes the state before it is written: a state is copied only where
    the loop itself changes it back before the job runs (``snapshot(..., transient=True)``), and :meth:`finish` writes
    the files left for later side by side, one thread each (the loop's cores are free). ``on_save_follows``: the
    training loop dispatches ``on_save`` once the job is submitted (a checkpoint of a running ``fit``): in the
    background the publication waits for it (:attr:`callbacks_over`) and keeps what was written into ``final_dir``
    until then (by its callbacks, by a ``_save_checkpoint`` override: :meth:`open_final_dir`)."""

    def __init__(
        self,
        folder: str,
        final_dir: str,
        snapshot: Callable[..., Any] | None,
        main: bool,
        entries_made_durable: set[tuple[int, int]],
        last: bool = False,
        on_save_follows: bool = False,
        process: Any = None,
    ) -> None:
        self.folder, self.final_dir, self.main, self.last = folder, final_dir, main, last
        self._process = process  # the writer process of the large files (checkpoints.writers.writer_process), if any
        self.what = f"checkpoint {final_dir}"
        self._snapshot = snapshot
        self._entries_made_durable = entries_made_durable
        self._later: list[tuple[str | None, Step]] = []
        self._finishing: Checksums | None = None  # the checksums of the thread finishing the job
        self._manifest: tuple[Any, ...] = ()
        self._rotate: Step = _nothing
        self._failed: Callable[[BaseException], Any] = _ignore
        # synchronous: the loop's thread finishes the job, so it hashes each file as soon as it is written
        self._checksums = Checksums() if main and snapshot is None else None
        # In the background (the last checkpoint apart, published before the loop goes on), the loop's on_save comes
        # before the publication: what its callbacks write into final_dir (made by them, or the folder this one
        # replaces) goes into this checkpoint, as in transformers, whose on_save comes after the folder is complete.
        self.callbacks_over = threading.Event()
        waits = main and self.background and not last and on_save_follows
        self._found = _entries(final_dir) if waits else None
        self._placeholder = False  # final_dir was made by open_final_dir, and is not yet the published folder
        safetensors_file.install()  # the model's safetensors files of its steps hashed as they are written

    @property
    def background(self) -> bool:
        """Whether the tensor files are written later, from a snapshot, by the thread that finishes the job."""
        return self._snapshot is not None

    # ---- on the training loop's thread -------------------------------------------------------------------------------
    def write(self, file: str | None, step: Step) -> Any:
        """Run ``step``, which writes ``file`` (None: several, found afterwards if one fails) into the folder, now; a
        write failure is raised as one :class:`CheckpointWriteError` (the unfinished folder removed by the main
        process)."""
        try:
            with safetensors_file.hashed_into(_Hashing(self._checksums)):
                result = step()
        except Exception as exc:
            error = write_error(exc, self.folder, self.what, file, discard=self.main)
            if error is None:
                raise
            raise error from exc
        if self._checksums is not None:
            self._checksums.add_new(self.folder)
        return result

    def save(self, obj: Any, path: str, until: Any = None) -> None:
        """``torch.save(obj, path)``'s file, now, or later from a snapshot of ``obj`` taken now; either way written by
        :func:`hflight.checkpoints.writers.torch_file.save` (the same records; front to back, past the page cache where
        the file system allows it, so that its fsync is cheap; hashed as it is written, so that it is not read back;
        the interpreter lock released while the bytes are copied, so that a training loop runs beside it). ``until``:
        ``obj`` changes only at the next step of this optimizer (:meth:`snapshot`)."""
        if self._snapshot is None:
            self._save_hashed(obj, path, self._checksums)
            return
        name = os.path.basename(path)
        copy = self.snapshot(name, obj, until=until)
        self._later.append((name, lambda: self._save_later(copy, path)))

    def _save_later(self, obj: Any, path: str) -> None:
        """``obj`` written by the writer process where there is one and it takes it, else as a synchronous save's."""
        digest = _in_writer_process(lambda: self._process.save_torch(obj, path)) if self._process else None
        if digest is not None:
            if digest and self._finishing is not None:
                self._finishing.add_hashed(path, digest)
            return
        self._save_hashed(obj, path, self._finishing)

    @staticmethod
    def _save_hashed(obj: Any, path: str, checksums: Checksums | None) -> None:
        """``obj`` written by :func:`~hflight.checkpoints.writers.torch_file.save` and hashed as it is written, for
        ``checksums`` (None: this process keeps none); where it could not be (``torch.save`` wrote it), the checksums'
        thread hashes the file, as every other."""
        hasher = new_digest() if checksums is not None else None
        if torch_file.save(obj, path, hasher) and checksums is not None:
            checksums.add_hashed(path, hasher.hexdigest())

    def snapshot(self, name: str, state: Any, transient: bool = False, until: Any = None) -> Any:
        """``state`` as the job writes it later: a copy taken now (``save_async``), or itself (synchronous; the run's
        last checkpoint, which nothing changes before it is written). ``transient``: the loop changes ``state``
        before the job runs even so (the weights evaluation uses, swapped in for the save and out after it): copied
        for the last checkpoint too. ``until``: nothing changes ``state`` before the next step of this optimizer, so
        its copy may be made beside that step's forward and backward (``CheckpointWriter.snapshot``)."""
        if self._snapshot is None or (self.last and not transient):
            return state
        return self._snapshot(name, state, until=until)

    def later(self, file: str | None, step: Step) -> None:
        """Run ``step`` (writing ``file``) when the job is finished; now when it is finished on this thread."""
        if self._snapshot is None:
            self.write(file, step)
        else:
            self._later.append((file, step))

    def publish_with(self, manifest: tuple[Any, ...], rotate: Step,
                     failed: Callable[[BaseException], Any] | None = None) -> None:  # fmt: skip
        """The manifest's fields (global step, ``save_only_model``, the run's arguments, the loop's bookkeeping), the
        storing and rotation that follow the publication, and what to do instead when the write fails (``failed``,
        given the failure: the job's other processes stop waiting for an upload that will not come)."""
        self._manifest, self._rotate = manifest, rotate
        self._failed = failed or _ignore

    def open_final_dir(self) -> None:
        """Once the loop's part is written, before the background write (a job whose publication waits for
        ``on_save``): ``final_dir`` exists when the checkpoint's save returns, as after a synchronous save, for a
        ``_save_checkpoint`` override that writes into it after ``super()`` (TRL's ``GRPOTrainer`` does; ``on_save``
        callbacks find it too). Made here, empty, when it is not there (a folder of that name being replaced is there
        already): it holds no manifest and no weights, so hflight never offers it for resuming; what is written into it
        is moved into the folder published under its name (:meth:`_take_callbacks_files`), and it is removed if the
        write fails (a killed write leaves it beside ``.tmp-checkpoint-N``, and the next run's start removes both)."""
        if self._found is None or os.path.lexists(self.final_dir):
            return
        self.write(None, lambda: os.mkdir(self.final_dir))
        self._placeholder = True

    def abandon(self) -> None:
        """The checkpoint will not be finished (its write raised on the loop's thread)."""
        if self._checksums is not None:
            self._checksums.close()

    # ---- on the thread that finishes it ------------------------------------------------------------------------------
    def finish(self) -> BaseException | None:
        """The rest of the write: the files left for later, each checksummed and fsynced as it is complete, the
        manifest, the durable publication, then the rotation. Returns what failed (a :class:`CheckpointWriteError`
        for a write failure, the unfinished folder removed), None when the checkpoint is published."""
        try:
            failure = self._finish()
            if failure is None:
                self._retire_older()
            else:
                self._remove_placeholder()
                self._failed(failure)
            return failure
        finally:  # the steps hold the snapshot and this job: dropped, its memory goes now, not at a collection
            self._later, self._rotate, self._manifest, self._failed = [], _nothing, (), _ignore

    def _finish(self) -> BaseException | None:
        checksums = self._checksums or Checksums()  # in the background: opened (and closed) by this thread
        self._finishing = checksums
        try:
            try:
                checksums.add_new(self.folder)
                later = [(file, functools.partial(self.write_later, file, step)) for file, step in self._later]
                last = [(MANIFEST_NAME, lambda: self._write_manifest(checksums)),
                        (None, lambda: self._publish(checksums))]  # fmt: skip
                if self.last and len(later) > 1:
                    if (failure := self._run_side_by_side(later, checksums)) is not None:
                        return failure
                    later = []
                for file, step in [*later, *last]:
                    if (failure := self._run(file, step, checksums)) is not None:
                        return failure
            finally:
                self._finishing = None
                checksums.close()
        except BaseException as exc:  # noqa: BLE001 - returned: raised on the training loop's thread
            return exc
        return None

    def _remove_placeholder(self) -> None:
        """The write failed: the ``final_dir`` :meth:`open_final_dir` made goes too, with what was written into it
        (once the loop's ``on_save`` is over: nothing writes into it any more), so that no partial ``checkpoint-N``
        is left; moved aside first, as a checkpoint is removed."""
        if not self._placeholder:
            return
        self.callbacks_over.wait()
        final = Path(self.final_dir)
        aside = final.with_name(f"{TMP_PREFIX}{final.name}{DELETING_SUFFIX}")
        with contextlib.suppress(OSError):
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(final, aside)
            shutil.rmtree(aside, ignore_errors=True)
        self._placeholder = False

    def _retire_older(self) -> None:
        """The rotation of older checkpoints, once this one is published: a failure there (a folder that cannot be
        moved aside) is logged and leaves that folder, as transformers' rotation ignores it; the checkpoint written
        is whole and the run goes on."""
        try:
            self._rotate()
        except Exception as exc:
            logger.warning(f"{self.final_dir} is saved, but removing older checkpoints after it failed "
                           f"({type(exc).__name__}: {exc}); they are left as they are.")  # fmt: skip

    def _run(self, file: str | None, step: Step, checksums: Checksums) -> BaseException | None:
        failure = self._attempt(step, checksums)
        return None if failure is None else self._as_write_error(failure, file)

    def _attempt(self, step: Step, checksums: Checksums | None) -> Exception | None:
        """Run ``step``, then hand the files it made to ``checksums`` (None: later, once the steps beside it are
        over, so that no file is taken while it is half written)."""
        try:
            with safetensors_file.hashed_into(_Hashing(self._finishing, self._process)):
                step()
            if checksums is not None:
                checksums.add_new(self.folder)
        except Exception as exc:
            return exc
        return None

    def _as_write_error(self, exc: Exception, file: str | None) -> BaseException:
        """``exc`` as a :class:`CheckpointWriteError` (a write failure), else as it is; either way the unfinished
        folder is removed (it will never be published)."""
        error = write_error(exc, self.folder, self.what, file, discard=True)
        if error is None:
            shutil.rmtree(self.folder, ignore_errors=True)
        return error or exc

    def _run_side_by_side(self, steps: list[tuple[str | None, Step]], checksums: Checksums) -> BaseException | None:
        """``steps`` at once, the first on this thread, each other on one of its own; the first that failed (in
        order), once all are over, so that the unfinished folder is removed only when nothing writes into it any
        more."""
        with concurrent.futures.ThreadPoolExecutor(len(steps) - 1, thread_name_prefix="hflight-write") as pool:
            others = [pool.submit(self._attempt, step, None) for _, step in steps[1:]]
            first = self._attempt(steps[0][1], None)
            failures = list(zip([file for file, _ in steps], [first, *(other.result() for other in others)]))
        file, failure = next(((file, failure) for file, failure in failures if failure is not None), (None, None))
        if failure is None:
            failure = self._attempt(lambda: None, checksums)
        return None if failure is None else self._as_write_error(failure, file)

    def _write_manifest(self, checksums: Checksums) -> None:
        global_step, save_only_model, run_arguments, progress = self._manifest
        write_manifest(self.folder, global_step, save_only_model, run_arguments, checksums, progress)

    def write_later(self, file: str | None, step: Step) -> None:
        """One of the files left for later, written by :meth:`finish` (a test slows the background write down here)."""
        step()

    def _publish(self, checksums: Checksums) -> None:
        """The complete folder made durable and renamed into place (``hflight.durable.publish_folder``: the only way a
        checkpoint is put into place); a ``final_dir`` already there is deleted only afterwards. The files the
        checksums' thread fsynced as they were complete are not fsynced again."""
        final = Path(self.final_dir)
        replaced = final.with_name(f"{TMP_PREFIX}{final.name}{REPLACED_SUFFIX}")
        if self._found is not None:
            self.callbacks_over.wait()
            self._take_callbacks_files()
        if self._placeholder:  # emptied: the published folder takes its name without a folder to move aside
            with contextlib.suppress(OSError):
                os.rmdir(self.final_dir)
            self._placeholder = False
        durable.publish_folder(self.folder, final, replaced, checksums.synced(), self._entries_made_durable)

    def _take_callbacks_files(self) -> None:
        """The entries written into ``final_dir`` while this checkpoint was written (by a ``_save_checkpoint``
        override after ``super()``, by the loop's ``on_save`` callbacks: new or changed since the job was made) moved
        into the folder about to be published (over a file of the same name, as a file written after a synchronous
        save replaces it)."""
        taken = [name for name, found in _entries(self.final_dir).items() if self._found.get(name) != found]
        for name in taken:
            target = os.path.join(self.folder, name)
            if os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target)
            elif os.path.lexists(target):
                os.remove(target)
            os.replace(os.path.join(self.final_dir, name), target)
        if taken:
            logger.info(f"{', '.join(taken)}, written into {self.final_dir} after its save (by _save_checkpoint or "
                        "on_save) while it was written in the background, kept in it.")  # fmt: skip


def _ignore(failure: BaseException) -> None:
    return None


def _nothing() -> None:
    """No rotation."""


def _in_writer_process(write: Callable[[], str | None]) -> str | None:
    """``write()``'s checksum; None where the writer process did not write the file: it declined, or it died while it
    wrote it (said in the log: the writer thread writes the file over, and the next file starts a new process)."""
    try:
        return write()
    except WriterProcessDied as exc:
        logger.warning(f"{exc}: the background writer thread writes it again.")
        return None


class _Hashing:
    """Where a step's safetensors files go (``hflight.checkpoints.writers.safetensors_file.hashed_into``): their
    checksums to
    ``checksums``; written by ``process`` (the writer process) where there is one and it takes them."""

    def __init__(self, checksums: Checksums | None, process: Any = None) -> None:
        self.checksums, self.process = checksums, process

    def __bool__(self) -> bool:
        return self.checksums is not None

    def new_digest(self) -> Any:
        return new_digest()

    def add_hashed(self, path: str | os.PathLike, digest: str) -> None:
        self.checksums.add_hashed(path, digest)

    def written_elsewhere(self, tensors: Any, path: str | os.PathLike, metadata: Any) -> bool:
        """Whether the writer process wrote the file (and its checksum is given)."""
        if self.process is None:
            return False
        digest = _in_writer_process(lambda: self.process.save_safetensors(tensors, path, metadata))
        if digest is None:
            return False
        self.add_hashed(path, digest)
        return True


def _entries(folder: str) -> dict[str, tuple[Any, ...]]:
    """What is in ``folder``, by name: for each entry, every file under it with its inode, size and times (an entry
    written or changed gets another value)."""
    if not os.path.isdir(folder):
        return {}
    found = {}
    for entry in os.scandir(folder):
        paths = [entry.path]
        if entry.is_dir(follow_symlinks=False):
            paths += sorted(
                os.path.join(root, name) for root, dirs, files in os.walk(entry.path) for name in dirs + files
            )
        found[entry.name] = tuple((path, *_stat(path)) for path in paths)
    return found


def _stat(path: str) -> tuple[int, int, int, int]:
    info = os.lstat(path)
    return info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns
