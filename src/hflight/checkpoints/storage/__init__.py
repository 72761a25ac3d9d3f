"""Where finished checkpoints live: the seam between a checkpoint's content (the rest of ``hflight.checkpoints``) and
its storage.

Every checkpoint is written on the local disk first (``hflight.checkpoints.writers``: complete or invisible, with its
manifest), into ``args.output_dir``. The run's storage then takes the finished folder over:

- :meth:`~Storage.publish` a finished ``checkpoint-N`` folder;
- :meth:`~Storage.complete` lists the complete checkpoints of a run folder, newest first;
- :meth:`~Storage.fetch` makes a local folder hold a stored checkpoint (for a resume);
- :meth:`~Storage.remove` removes one (rotation), so that no reader takes it for complete;
- :meth:`~Storage.put_files` keeps the files a run writes beside its checkpoints (``save_model``, results files).

:class:`LocalStorage` is the local disk alone: the checkpoint is stored once its folder is published, and the other
calls are the local folders'. :class:`~hflight.checkpoints.storage.objects.ObjectStorage` keeps a copy in an object
store (any fsspec URL: ``s3://``, ``gs://``, ``az://``, ``memory://``), where a checkpoint counts once its manifest
object is written, last; ``args.output_dir`` is then the local staging folder and ``args.remote_output_dir`` the URL
(``TrainingArguments(output_dir="s3://bucket/run")`` sets both: ``hflight.arguments.training_args``).

:func:`storage_for` gives the run's storage from its arguments: one per (URL, staging folder, options) in a process,
so that what is not uploaded yet is remembered from one checkpoint to the next.

May import: ``hflight.checkpoints`` (its own modules), ``hflight.durable``.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Protocol

from hflight._util import is_remote
from hflight.checkpoints.storage.local import LocalStorage
from hflight.checkpoints.storage.objects import ObjectStorage, StorageError

__all__ = ["LocalStorage", "ObjectStorage", "Storage", "StorageError", "is_remote", "storage_for"]


class Storage(Protocol):
    """What the checkpoint code asks of the place its checkpoints live. Paths are local folders under the run's
    ``output_dir``; a remote storage maps them onto its URL."""

    remote: bool

    def where(self, folder: str) -> str:
        """The place ``folder`` (a local path under ``output_dir``) stands for, as the user names it."""

    def probe(self) -> None:
        """Raise a clear error now if the storage cannot take checkpoints (before anything is trained)."""

    def publish(self, folder: str) -> bool:
        """Store the finished (local, complete) checkpoint ``folder``; False: it is kept locally only, for now."""

    def complete(self, run_dir: str) -> list[str]:
        """The names of the complete checkpoints stored for ``run_dir``, newest (largest step) first."""

    def fetch(self, folder: str) -> str:
        """Make the local ``folder`` hold the stored checkpoint of that name; returns it."""

    def remove(self, folder: str) -> None:
        """Remove the stored checkpoint ``folder`` (never seen half-removed as complete)."""

    def put_files(self, folder: str, paths: list[str]) -> None:
        """Store files written directly into ``folder`` (the run's own files beside its checkpoints)."""

    def rotate(self, run_dir: str, save_total_limit: int | None, best: str | None) -> None:
        """transformers' rotation, of the stored checkpoints and of the local copies the storage no longer needs."""

    def round(self) -> str | None:
        """A new checkpoint's round of the job's processes (every process, on the training loop's thread, when the
        checkpoint's save begins); None where the processes have nothing to upload together."""

    def store(self, folder: str, run_dir: str, limit: int | None, best: str | None, background: bool = False,
              peers: Any = None, round: str | None = None) -> None:  # fmt: skip
        """Once checkpoint ``folder`` is published on the local disk (on the thread that finished it): publish it,
        then rotate ``run_dir``'s checkpoints; ``background`` (``save_async``, not the run's last checkpoint): on a
        thread of the storage's own, after the previous one's (the next checkpoint's local write does not wait for
        this upload). ``peers`` (``hflight.checkpoints.storage.peers.Peers``) and ``round``: process 0 of a job whose
        other processes upload their own files of ``folder`` (:meth:`store_part`)."""

    def release(self, peers: Any, round: str | None, cause: str) -> None:
        """Process 0's checkpoint of ``round`` failed before it could be stored: the other processes stop waiting."""

    def store_part(self, folder: str, peers: Any, round: str | None) -> None:
        """A process other than 0: its own files of checkpoint ``folder`` (its shards, its RNG state), uploaded on a
        thread once process 0 says so (:meth:`wait` joins it)."""

    def wait(self, timeout_s: float | None = None) -> None:
        """The background upload in flight, if any, finished (``timeout_s``: at most that long)."""

    def settle(self) -> list[str]:
        """At the end of training: try again what is not stored yet; returns the local folders and files still not
        stored (said in one warning)."""


_lock = threading.Lock()
_storages: dict[tuple[Any, ...], Storage] = {}


def storage_for(args: Any) -> Storage:
    """The storage of the run whose arguments are ``args`` (``remote_output_dir``, ``output_dir``,
    ``storage_options``)."""
    url = getattr(args, "remote_output_dir", None)
    staging = str(args.output_dir)
    if not url:
        return LocalStorage(staging)
    options = getattr(args, "storage_options", None) or {}
    key = (url, staging, json.dumps(options, sort_keys=True, default=repr))
    with _lock:
        storage = _storages.get(key)
        if storage is None:
            storage = _storages[key] = ObjectStorage(url, staging, options)
        return storage
