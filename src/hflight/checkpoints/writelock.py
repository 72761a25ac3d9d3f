"""One writer per output folder: the process that writes a run's checkpoints holds a lock on its ``output_dir``.

Two trainings writing into one folder overwrite each other's checkpoints, and the second one's start-up deletes the
first one's ``.tmp-checkpoint-*`` folder while it is being written. :func:`output_dir_lock` is held by the process
that writes checkpoints (``args.should_save``: the main process; with ``save_on_each_node``, the main process of each
node, into its own disk) for the length of ``Trainer.train`` (the facade takes it before anything in the folder is
read or written):

- the lock is an ``flock`` on ``output_dir/.hflight-writer.lock``, which records the holder's process id, host,
  start time, and the job and rank it belongs to (``hflight.arguments.cluster.job_identity``: SLURM's job, torchrun's
  run, Lightning's launch); a second writer fails at once with :class:`OutputDirInUse`, naming the folder and that
  process, and telling a rank of the same job (two writers of one job: ``save_on_each_node`` on nodes that share the
  folder, or ranks a launcher did not tell apart) from a competing run;
- the operating system releases an ``flock`` when its process dies (killed included), so a lock file left by a dead
  process is taken over, with a warning naming it; the file is removed when training ends;
- one process may take it again (``train()`` twice, a hyperparameter search's trials): nested holds count;
- a folder created to hold the lock is removed again if nothing else was written into it.

POSIX only (``fcntl``); where it is missing, training goes on unlocked with a warning. On network filesystems
``flock`` is only as good as the filesystem's lock support.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

LOCK_NAME = ".hflight-writer.lock"
# Real path of a lock file -> [file descriptor, nesting depth, whether taking the lock created the folder].
_HELD: dict[str, list[int]] = {}


class OutputDirInUse(OSError):
    """Another process is training into the same ``output_dir``."""


def _holder(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    try:
        text = os.read(fd, 4096).decode("utf-8", "replace")
        holder = json.loads(text) if text.strip() else {}
    except ValueError:
        holder = {"pid": "?", "note": text[:80]}
    return holder if isinstance(holder, dict) else {}


def _describe(holder: dict) -> str:
    started = holder.get("started")
    when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, float) else ""
    job = f" ({holder['job']}, rank {holder.get('rank', '?')})" if holder.get("job") else ""
    return f"process {holder.get('pid', '?')} on host {holder.get('host', '?')}{job}{when}"


def _in_use(path: Path, holder: dict, me: dict) -> OutputDirInUse:
    if me.get("job") and holder.get("job") == me["job"] and holder.get("rank") == me.get("rank"):
        return OutputDirInUse(
            f"Output folder {path.parent} is written by an earlier run of this same job and rank ({me['job']}, rank "
            f"{me.get('rank', '?')}: {_describe(holder)} holds {path}), still running: a restarted or requeued job "
            "started before the run it replaces had ended. Wait for that process to end (or end it); its checkpoint "
            "is then where this run continues from."
        )
    if me.get("job") and holder.get("job") == me["job"]:
        return OutputDirInUse(
            f"Output folder {path.parent} is written by rank {holder.get('rank', '?')} of this same job ({me['job']}: "
            f"{_describe(holder)} holds {path}); rank {me.get('rank', '?')} would write its checkpoints there too. "
            "With save_on_each_node=True every node's main process writes: use it only when each node has its own "
            "disk (as transformers advises), not on a folder the nodes share."
        )
    return OutputDirInUse(
        f"Output folder {path.parent} is in use by another training run: {_describe(holder)} holds {path}. "
        "Two runs writing checkpoints into one output_dir would overwrite each other's. Wait for it to "
        "finish, or choose another output_dir."
    )


def _lock(path: Path, fcntl, me: dict) -> int:
    """An open, exclusively ``flock``-ed descriptor of ``path`` (retried when the holder removed the file while this
    process waited on the old one)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise _in_use(path, holder, me) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def _acquire(folder: Path, job: str | None, rank: int) -> str:
    import fcntl

    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    key = os.path.realpath(path)
    if key in _HELD:
        _HELD[key][1] += 1
        return key
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "job": job, "rank": rank}
    fd = _lock(path, fcntl, me)
    stale = _holder(fd)
    if stale:
        logger.warning(
            f"Took over {path}, left by {_describe(stale)}, which no longer holds it (it ended without releasing "
            "it: killed?)."
        )
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, (json.dumps(me) + "\n").encode())
    _HELD[key] = [fd, 1, created]
    return key


def _release(key: str) -> None:
    held = _HELD[key]
    held[1] -= 1
    if held[1] > 0:
        return
    del _HELD[key]
    with contextlib.suppress(FileNotFoundError):
        os.unlink(key)  # while still locked: a process waiting on this file finds it gone and retries
    os.close(held[0])  # releases the flock
    if held[2]:  # a run that wrote nothing (save_strategy="no") leaves no folder behind, as before the lock
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(key))


@contextlib.contextmanager
def output_dir_lock(
    output_dir: str | os.PathLike, enabled: bool = True, job: str | None = None, rank: int = 0
) -> Iterator[None]:
    """Hold the writer lock of ``output_dir`` for the duration (``enabled=False``: a process that writes no
    checkpoints, such as a non-main rank, takes none); ``job``/``rank``: the job this process belongs to and its
    global rank, recorded in the lock (None for a single process).

    Raises:
        OutputDirInUse: another live process holds it (the message names the folder and the process).
    """
    if not enabled:
        yield
        return
    try:
        key = _acquire(Path(output_dir), job, rank)
    except ImportError:  # no fcntl: not a POSIX system
        logger.warning(f"Cannot lock {output_dir} on this platform: make sure no other run writes into it.")
        yield
        return
    try:
        yield
    finally:
        _release(key)
