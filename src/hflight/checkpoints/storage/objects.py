"""Checkpoints on object storage: any fsspec URL (``s3://``, ``gs://``, ``az://``, ``memory://``) as a run's
``remote_output_dir``, with a local staging folder (``output_dir``) where everything is written first.

An object store has no rename and no directories: a partly uploaded ``checkpoint-8/`` already "exists". So a stored
checkpoint counts only once its manifest object (``checkpoint_manifest.json``) is there, and the manifest is uploaded
last, after every other file of the folder is uploaded and confirmed (listed with its size); removal (rotation, a
stale copy replaced) deletes the manifest first. Listings are never taken from a cache (fsspec filesystems cache them
per instance; another process's upload would stay unseen).

- **Publish** (:meth:`ObjectStorage.publish`, on the thread that finishes the checkpoint: the training loop's, or
  ``save_async``'s writer thread): the folder's files in one batch (s3fs: several at once, large ones in parts), each
  call retried with backoff (:data:`ATTEMPTS`); a failure after that is warned once per checkpoint, the local copy is
  kept, and the upload is tried again at the next checkpoint and at the end of training (:meth:`settle`).
- **Fetch** (a resume, on a machine whose disk may be empty): the stored manifest first; a local copy with the same
  manifest that passes its checks is used as it is; otherwise the listed files are downloaded (several at once) into
  ``.tmp-checkpoint-N.fetching`` beside the folder, the manifest last, and the folder renamed into place. The resume
  then checks every file against the manifest (sizes and checksums) as for any local checkpoint, and refuses what a
  local checkpoint would be refused for. A key that would land outside the folder (``..``, an absolute name) is
  refused before anything is written.
- **Several processes** (``hflight.checkpoints.storage.peers``): process 0 removes the stale copy, says "go", uploads
  the files no other process wrote, waits for every other process's word that its own files (its shards, its RNG
  state) are uploaded, confirms the whole folder by a listing and only then uploads the manifest. A process that fails
  or does not answer leaves the checkpoint not stored: process 0 uploads the whole folder itself at the next
  checkpoint and at the end (the staging folder is shared by the processes whose files a checkpoint holds, as
  transformers' ``output_dir`` is).
- **Probe** (:meth:`ObjectStorage.probe`, when training starts): a small object written, listed and removed, so that a
  missing filesystem package, an unreachable endpoint, wrong credentials or a missing bucket is an error naming the
  URL and its cause before the first step.

May import: ``hflight.checkpoints`` (its own modules), ``hflight.durable``.
"""

from __future__ import annotations

import logging
import os
import posixpath
import random
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from fsspec.exceptions import FSTimeoutError

from hflight.checkpoints.manifest import verify_checkpoint
from hflight.checkpoints.names import CHECKPOINT_RE, MANIFEST_NAME, TMP_PREFIX
from hflight.checkpoints.storage.local import remove_checkpoint, rotate_checkpoints, rotation
from hflight.checkpoints.storage.peers import Peers, owner
from hflight.checkpoints.writers.files import IncompleteCheckpointError, UnsafeCheckpointFile

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: each call to the store is tried this many times, waiting :data:`BACKOFF_S` x 2^attempt (with jitter) between (on
#: top of the filesystem's own retries: s3fs's and botocore's)
ATTEMPTS = 3
BACKOFF_S = 0.5
#: a call to an asynchronous filesystem (s3fs, gcsfs, adlfs) that has not answered after this many seconds, plus one
#: for each :data:`SLOWEST_BYTES_PER_S` it moves, has failed (fsspec's ``timeout``): a store that accepts requests and
#: never answers stops the upload (not retried: waiting again would only hold the run longer), which is kept locally
#: and tried again at the next checkpoint
CALL_TIMEOUT_S = 60.0
SLOWEST_BYTES_PER_S = 2 << 20
#: how long another process of the job waits for process 0's word that a checkpoint can be uploaded (process 0 says it
#: once the checkpoint is written and the upload before it is over; a process 0 that died says nothing)
READY_WAIT_S = 1800.0
FETCHING_SUFFIX = ".fetching"
#: a checkpoint's object, its key inside the run's prefix (another run's objects under the same prefix, a bucket's root
#: or a sweep's folder, are not: they lie in folders of their own)
_RUN_OBJECT = re.compile(r"^checkpoint-\d+/.+$")
#: the checkpoint rounds counted per URL in this process (:meth:`ObjectStorage.round`)
_ROUNDS: dict[str, int] = {}
_ROUNDS_LOCK = threading.Lock()


class StorageError(OSError):
    """The object store cannot be used (no filesystem package, endpoint, credentials, bucket), named with the URL."""


def _cause(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return f"{type(exc).__name__}: {text}"


class ObjectStorage:
    """A run's checkpoints in an object store at ``url``; ``staging``: the local ``output_dir`` they are written in
    first; ``options``: the filesystem's options (``storage_options``, as fsspec and ``datasets`` take them)."""

    remote = True

    def __init__(self, url: str, staging: str, options: dict[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        self.staging = os.path.abspath(staging)
        self.options = dict(options or {})
        self._fs: Any = None
        self._root = ""
        self._probed = False
        self._lock = threading.RLock()
        #: local checkpoint folders (and files) not stored yet -> the cause of the last failure
        self._pending: dict[str, str] = {}
        #: the background upload in flight (``save_async``), if any; another process's uploads of its own files
        self._uploading: threading.Thread | None = None
        self._parts: list[threading.Thread] = []

    # ---- the filesystem -----------------------------------------------------------------------------------------
    @property
    def fs(self) -> Any:
        if self._fs is None:
            import fsspec

            protocol = self.url.split("://", 1)[0]
            try:
                self._fs, self._root = fsspec.core.url_to_fs(self.url, **self.options)
            except ImportError as exc:
                raise StorageError(
                    f"output_dir {self.url}: the filesystem for {protocol}:// is not installed ({exc}). Install it "
                    "(s3fs for s3://, gcsfs for gs://, adlfs for az://) or choose a local output_dir."
                ) from exc
            except (ValueError, TypeError) as exc:
                raise StorageError(f"output_dir {self.url}: {_cause(exc)} (check storage_options).") from exc
            self._root = self._root.rstrip("/")
        return self._fs

    def _key(self, local: str) -> str:
        """The object key of ``local`` (a path under the staging folder)."""
        self.fs  # noqa: B018 - the root is known once the filesystem is made
        relative = os.path.relpath(os.path.abspath(local), self.staging)
        if relative == os.curdir:
            return self._root
        if relative.startswith(os.pardir):
            raise ValueError(f"{local} is not inside the staging folder {self.staging} of {self.url}")
        return posixpath.join(self._root, *Path(relative).parts)

    def where(self, folder: str) -> str:
        relative = os.path.relpath(os.path.abspath(folder), self.staging)
        if relative == os.curdir or relative.startswith(os.pardir):
            return self.url if relative == os.curdir else folder
        return posixpath.join(self.url, *Path(relative).parts)

    def _retried(self, what: str, call: Callable[[], T]) -> T:
        for attempt in range(ATTEMPTS):
            try:
                return call()
            except (FileNotFoundError, PermissionError, StorageError, FSTimeoutError):
                raise  # a missing bucket or key, refused credentials, no answer at all: no retry makes them work
            except Exception as exc:  # a server error, a dropped connection, a timeout
                if attempt == ATTEMPTS - 1:
                    raise
                wait = BACKOFF_S * 2**attempt * (0.5 + random.random())
                logger.info(f"{what} failed ({_cause(exc)}); trying again in {wait:.1f} s.")
                time.sleep(wait)
        raise AssertionError("unreachable")

    def _deadline(self, nbytes: int = 0) -> dict[str, float]:
        """fsspec's ``timeout`` for a call moving ``nbytes`` (asynchronous filesystems only take it)."""
        from fsspec.asyn import AsyncFileSystem

        if not isinstance(self.fs, AsyncFileSystem):
            return {}
        return {"timeout": CALL_TIMEOUT_S + nbytes / SLOWEST_BYTES_PER_S}

    def _fresh(self, key: str) -> None:
        self.fs.invalidate_cache(key)

    # ---- before training ----------------------------------------------------------------------------------------
    def probe(self) -> None:
        if self._probed:
            return
        try:
            fs = self.fs
            key = posixpath.join(self._root, f".hflight-probe-{uuid.uuid4().hex}")
            fs.pipe_file(key, b"hflight checks it can write checkpoints here\n")
            self._fresh(self._root)
            if not fs.exists(key):
                raise StorageError("an object written there cannot be found again")
            fs.rm(key)  # (s3fs's rm_file never awaits its removal)
            self._abort_orphaned_uploads()
        except StorageError as exc:
            if str(exc).startswith(f"output_dir {self.url}"):
                raise
            raise StorageError(f"Cannot store checkpoints in {self.url}: {exc}. Nothing was trained.") from exc
        except Exception as exc:
            raise StorageError(
                f"Cannot store checkpoints in {self.url}: {_cause(exc)}. Nothing was trained. Check the URL (bucket "
                "and path), the credentials (the environment, ~/.aws, or storage_options) and the endpoint."
            ) from exc
        self._probed = True

    def _abort_orphaned_uploads(self) -> None:
        """S3's multipart uploads of the run's checkpoints (:data:`_RUN_OBJECT`: ``checkpoint-N/`` under its URL, never
        another run's or another tool's objects under the same prefix) that a killed process left unfinished (no
        object, but their parts are kept, and billed, until aborted): aborted when the run starts, before it uploads
        anything. Other filesystems have none to abort (a GCS resumable upload expires by itself)."""
        fs = self.fs
        call, split = getattr(fs, "call_s3", None), getattr(fs, "split_path", None)
        if call is None or split is None:
            return
        bucket, prefix, _ = split(self._root)
        prefix = f"{prefix.rstrip('/')}/" if prefix else ""
        markers: dict[str, str] = {}
        aborted = 0
        while True:
            listed = call("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **markers)
            for upload in listed.get("Uploads", []):
                if _RUN_OBJECT.match(upload["Key"][len(prefix) :]) and upload["Key"].startswith(prefix):
                    call("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                    aborted += 1
            if not listed.get("IsTruncated"):
                break
            markers = {"KeyMarker": listed["NextKeyMarker"], "UploadIdMarker": listed["NextUploadIdMarker"]}
        if aborted:
            logger.warning(f"Aborted {aborted} unfinished multipart upload(s) under {self.url} (left by a process "
                           "killed while it uploaded; never part of a stored checkpoint).")  # fmt: skip

    # ---- storing ---------------------------------------------------------------------------------------------------
    def publish(self, folder: str, together: _Together | None = None) -> bool:
        """Upload ``folder``, then, once the store answers again, what an earlier upload left behind (oldest first,
        until one fails: a store that is gone costs one failed upload a checkpoint, not one for each left behind);
        False when ``folder`` could not be stored. ``together``: with the job's other processes, each uploading its
        own files of ``folder``."""
        folder = os.path.abspath(folder)
        with self._lock:
            if not self._store(folder, together):
                return False
            self._retry_pending()
            return True

    def _retry_pending(self) -> None:
        for earlier in list(self._pending):
            if not self._store(earlier):
                return

    def _store(self, local: str, together: _Together | None = None) -> bool:
        try:
            if os.path.isdir(local):
                if not os.path.isfile(os.path.join(local, MANIFEST_NAME)):
                    self._pending.pop(local, None)  # rotated away (or never finished) meanwhile
                    return True
                self._upload_checkpoint(local, together)
            elif os.path.isfile(local):
                self._upload_files([local])
            else:
                self._pending.pop(local, None)
                return True
        except Exception as exc:  # noqa: BLE001 - kept locally, said once, tried again later
            if local not in self._pending:
                logger.warning(
                    f"{local} is saved locally, but storing it in {self.where(local)} failed ({_cause(exc)}). The "
                    "local copy is kept; the upload is tried again at the next checkpoint and at the end of training."
                )
            self._pending[local] = _cause(exc)
            return False
        if self._pending.pop(local, None) is not None:
            logger.warning(f"{local} is now stored in {self.where(local)}.")
        return True

    def _upload_checkpoint(self, folder: str, together: _Together | None = None) -> None:
        key = self._key(folder)
        body = {name: path for name, path in _checkpoint_files(folder).items() if name != MANIFEST_NAME}
        sizes = {name: path.stat().st_size for name, path in body.items()}
        others = {name: owner(name, together.peers.size) for name in sizes} if together else {}
        others = {name: rank for name, rank in others.items() if rank}
        try:
            self._remove_key(key)  # a copy left by an earlier run (partial or not) must not mix with this one
        except BaseException as exc:
            if together:
                together.skip(_cause(exc))
            raise
        if together:
            together.go()
        mine = {name: str(path) for name, path in body.items() if name not in others}
        if mine:
            self._put_files(folder, key, mine)
        if together:
            for rank in sorted(set(others.values())):
                theirs = sum(sizes[name] for name, of in others.items() if of == rank)
                wait = ATTEMPTS * (CALL_TIMEOUT_S + theirs / SLOWEST_BYTES_PER_S) + 2 * BACKOFF_S * 2**ATTEMPTS
                answer = together.answer(rank, wait)
                if answer != "ok":
                    raise OSError(f"process {rank} did not store its files of {folder}: "
                                  f"{answer or f'no answer within {wait:.0f} s'}")  # fmt: skip
        self._confirm(key, sizes)
        manifest = os.path.join(folder, MANIFEST_NAME)
        self._upload_files([manifest])
        self._confirm(key, {MANIFEST_NAME: os.path.getsize(manifest)})

    def _put_files(self, folder: str, key: str, paths: dict[str, str]) -> None:
        """The files ``paths`` (name in the checkpoint -> local path) of checkpoint ``folder`` under ``key``, in one
        batch."""
        fs = self.fs
        local_paths, keys = list(paths.values()), [posixpath.join(key, name) for name in paths]
        limit = self._deadline(sum(os.path.getsize(path) for path in local_paths))
        self._retried(f"Uploading {folder}", lambda: fs.put(local_paths, keys, **limit))

    def _confirm(self, key: str, sizes: dict[str, int]) -> None:
        """Every uploaded file is in the store with its size (a listing, never a cached one)."""
        self._fresh(key)
        found = self._retried(f"Listing {key}", lambda: self.fs.find(key, detail=True, **self._deadline()))
        stored = {posixpath.relpath(path, key): info.get("size") for path, info in found.items()}
        wrong = [name for name, size in sizes.items() if stored.get(name) != size]
        if wrong:
            raise OSError(f"{len(wrong)} uploaded file(s) not found with their size in the store: {wrong[:3]}")

    def _upload_files(self, paths: list[str]) -> None:
        fs = self.fs
        keys = [self._key(path) for path in paths]
        limit = self._deadline(sum(os.path.getsize(path) for path in paths))
        self._retried(f"Uploading {', '.join(paths)}", lambda: fs.put(list(paths), keys, **limit))

    def put_files(self, folder: str, paths: list[str]) -> None:
        inside = os.path.join(self.staging, "")
        paths = [path for path in map(os.path.abspath, paths) if path.startswith(inside)]  # the run's own files
        with self._lock:
            if paths:
                self._upload_or_keep(paths)

    def _upload_or_keep(self, paths: list[str]) -> None:
        """The run's own files in one batch; when it fails, each is kept for :meth:`settle` (warned once)."""
        try:
            self._upload_files(paths)
        except Exception as exc:  # noqa: BLE001 - kept locally, said once, tried again at the end
            logger.warning(f"Storing {', '.join(paths)} in {self.url} failed ({_cause(exc)}); tried again at the end.")
            for path in paths:
                self._pending[path] = _cause(exc)
            return
        for path in paths:
            self._pending.pop(path, None)

    # ---- listing, fetching, removing --------------------------------------------------------------------------------
    def complete(self, run_dir: str) -> list[str]:
        return [name for name, complete in self._stored(run_dir) if complete]

    def _stored(self, run_dir: str) -> list[tuple[str, bool]]:
        """The ``checkpoint-N`` folders stored for ``run_dir``, newest first, each with whether its manifest is
        there (a listing of the run's objects, never a cached one)."""
        fs, key = self.fs, self._key(run_dir)
        self._fresh(key)
        pattern = f"{key}/checkpoint-*/*"
        try:
            found = self._retried(f"Listing {self.where(run_dir)}", lambda: fs.glob(pattern, **self._deadline()))
        except FileNotFoundError:
            return []
        folders: dict[str, bool] = {}
        for path in found:
            parent = posixpath.dirname(path)
            name = posixpath.basename(parent)
            if CHECKPOINT_RE.match(name) and posixpath.dirname(parent).rstrip("/") == key:
                folders[name] = folders.get(name, False) or posixpath.basename(path) == MANIFEST_NAME
        steps = sorted(((int(CHECKPOINT_RE.match(name).group(1)), name) for name in folders), reverse=True)
        return [(name, folders[name]) for _, name in steps]

    def fetch(self, folder: str) -> str:
        """The stored checkpoint ``folder`` into the local ``folder`` (kept as it is when the local copy has the same
        manifest and passes its checks). The processes of a job on one machine share the staging folder: one downloads
        while the others wait for it (a lock file beside the folder), then find the copy in place."""
        os.makedirs(os.path.dirname(os.path.abspath(folder)), exist_ok=True)
        lock = os.path.join(os.path.dirname(os.path.abspath(folder)), f"{TMP_PREFIX}{Path(folder).name}.fetch.lock")
        with open(lock, "a+b") as held:
            try:
                import fcntl

                fcntl.flock(held, fcntl.LOCK_EX)
            except ImportError:  # not POSIX: one process a machine
                pass
            return self._fetch(folder)

    def _fetch(self, folder: str) -> str:
        fs, key = self.fs, self._key(folder)
        manifest_key = posixpath.join(key, MANIFEST_NAME)
        self._fresh(key)
        try:
            manifest = self._retried(f"Reading {manifest_key}", lambda: fs.cat_file(manifest_key, **self._deadline()))
        except FileNotFoundError:
            raise IncompleteCheckpointError(
                f"{self.where(folder)} is not a complete checkpoint: it has no {MANIFEST_NAME} (an upload that was "
                "interrupted, or not a checkpoint)."
            ) from None
        local_manifest = Path(folder, MANIFEST_NAME)
        if local_manifest.is_file() and local_manifest.read_bytes() == manifest:
            try:
                verify_checkpoint(folder, full=True)  # checksums too: a damaged local copy is replaced
                return folder
            except (IncompleteCheckpointError, UnsafeCheckpointFile):
                pass
        listed = self._retried(f"Listing {self.where(folder)}", lambda: fs.find(key, detail=True, **self._deadline()))
        found, total = list(listed), sum(int(info.get("size") or 0) for info in listed.values())
        names = [self._relative_name(folder, key, path) for path in found]
        names = [name for name in names if name != MANIFEST_NAME]
        tmp = Path(folder).with_name(f"{TMP_PREFIX}{Path(folder).name}{FETCHING_SUFFIX}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if names:
            local_paths = [str(tmp.joinpath(*name.split("/"))) for name in names]
            for path in local_paths:
                os.makedirs(os.path.dirname(path), exist_ok=True)
            keys = [posixpath.join(key, name) for name in names]
            limit = self._deadline(total)
            self._retried(f"Downloading {self.where(folder)}", lambda: fs.get(keys, local_paths, **limit))
        (tmp / MANIFEST_NAME).write_bytes(manifest)
        # not fsynced: the local copy is a cache of the stored checkpoint, checked against its manifest's checksums
        # before it is loaded (and downloaded again when it fails them), so a power loss costs a download, not a run
        remove_checkpoint(folder)
        os.replace(tmp, folder)
        logger.info(f"Downloaded {self.where(folder)} into {folder}.")
        return folder

    def _relative_name(self, folder: str, key: str, path: str) -> str:
        """The name of stored object ``path`` inside checkpoint ``key``; refused when it would land outside the local
        ``folder`` (``..``, an absolute part), before anything is written."""
        name = posixpath.relpath(path, key)
        parts = name.split("/")
        if name.startswith("/") or any(part in ("", ".", "..") for part in parts) or "\\" in name:
            raise UnsafeCheckpointFile(
                f"{self.where(folder)}: the stored object {path!r} would be written outside the checkpoint folder; "
                "the checkpoint is refused."
            )
        return name

    def remove(self, folder: str) -> None:
        self._remove_key(self._key(folder))

    def _remove_key(self, key: str) -> None:
        """Remove a stored checkpoint: its manifest first (from then on it is not complete), then the rest (one
        listing when there is nothing to remove)."""
        fs = self.fs
        self._fresh(key)
        try:
            found = self._retried(f"Listing {key}", lambda: fs.find(key, **self._deadline()))
        except FileNotFoundError:
            return
        manifest = posixpath.join(key, MANIFEST_NAME)
        for batch in ([manifest] if manifest in found else [], [path for path in found if path != manifest]):
            if batch:
                try:
                    self._retried(f"Removing {key}", lambda batch=batch: fs.rm(batch, **self._deadline()))
                except FileNotFoundError:
                    pass
        self._fresh(key)

    def rotate(self, run_dir: str, save_total_limit: int | None, best: str | None) -> None:
        """transformers' rotation in the store, then of the local copies: a local checkpoint not stored yet is kept."""
        best_name = os.path.basename(best) if best else None
        found = self._stored(run_dir)
        stored = [name for name, complete in reversed(found) if complete]  # oldest first
        for name in rotation(stored, save_total_limit, best_name):
            self.remove(os.path.join(run_dir, name))
        if stored:  # what a process killed mid-upload or mid-removal left: no manifest, older than the newest stored
            newest = int(CHECKPOINT_RE.match(stored[-1]).group(1))
            for name, complete in found:
                if not complete and int(CHECKPOINT_RE.match(name).group(1)) < newest:
                    logger.info(f"Removing {self.where(os.path.join(run_dir, name))}: an incomplete stored copy.")
                    self.remove(os.path.join(run_dir, name))
        rotate_checkpoints(run_dir, save_total_limit, best, keep=self._pending_names(run_dir))

    def round(self) -> str:
        """A new checkpoint's round of the job's processes (``hflight.checkpoints.storage.peers``): taken by every
        process on the training loop's thread when the checkpoint's save begins, numbered per URL in the process (a
        second storage of the same URL, another staging folder or other options, never reuses a round's keys)."""
        with _ROUNDS_LOCK:
            _ROUNDS[self.url] = number = _ROUNDS.get(self.url, 0) + 1
        return f"hflight-upload/{self.url}/{number}"

    def store(self, folder: str, run_dir: str, limit: int | None, best: str | None, background: bool = False,
              peers: Peers | None = None, round: str | None = None) -> None:  # fmt: skip
        """Upload ``folder``, then rotate (in the store, then the local copies): the rotation never runs before the
        new checkpoint is stored, so the store always holds the newest checkpoints it can. ``background``: on the
        upload thread, once the previous upload is over (at most one in flight). ``peers`` and ``round``: process 0
        of several, each uploading its own files of ``folder`` (:meth:`store_part`)."""
        together = _Together(peers, round) if peers is not None and round is not None else None
        self.wait()
        if not background:
            self._store_and_rotate(folder, run_dir, limit, best, together)
            return
        self._uploading = threading.Thread(target=self._store_and_rotate,
                                           args=(folder, run_dir, limit, best, together),
                                           name="hflight-checkpoint-upload")  # fmt: skip
        self._uploading.start()

    def release(self, peers: Peers | None, round: str | None, cause: str) -> None:
        """Process 0 will not upload the checkpoint of ``round`` (its write failed): the other processes do not wait
        for it."""
        if peers is not None and round is not None:
            _Together(peers, round).skip(cause)

    def store_part(self, folder: str, peers: Peers, round: str) -> None:
        """On a process other than 0, on a thread of its own (:meth:`wait` joins it): once process 0 says checkpoint
        ``folder`` is ready, upload this process's own files of it (``hflight.checkpoints.storage.peers.owner``) and
        tell process 0 how it went."""
        # not a daemon: a process that ends (a failed run) finishes the upload its process 0 waits for
        part = threading.Thread(target=self._store_part, args=(folder, peers, round),
                                name="hflight-checkpoint-upload-part")  # fmt: skip
        self._parts = [thread for thread in self._parts if thread.is_alive()] + [part]
        part.start()

    def _store_part(self, folder: str, peers: Peers, round: str) -> None:
        together = _Together(peers, round)
        ready = peers.hear(together.ready_key, READY_WAIT_S)
        if ready != "go":  # process 0 uploads the whole folder itself later (or the job is over)
            logger.info(f"{folder}: process 0 did not ask for this process's files ({ready or 'no answer'}).")
            return
        files = _checkpoint_files(os.path.abspath(folder))
        mine = {name: str(path) for name, path in files.items() if owner(name, peers.size) == peers.rank}
        try:
            if mine:
                self._put_files(folder, self._key(folder), mine)
        except Exception as exc:  # noqa: BLE001 - process 0 says it (and uploads the whole folder later)
            peers.tell(together.answer_key(peers.rank), f"failed: {_cause(exc)}")
        else:
            peers.tell(together.answer_key(peers.rank), "ok")
        # held until process 0 is done with the checkpoint: a process whose run failed meanwhile does not exit (and
        # have its launcher end process 0) before the manifest is up
        peers.hear(together.end_key, READY_WAIT_S)

    def _store_and_rotate(self, folder: str, run_dir: str, limit: int | None, best: str | None,
                          together: _Together | None = None) -> None:  # fmt: skip
        try:
            stored = self.publish(folder, together)
        finally:
            if together:
                together.skip("not uploaded")  # (nothing when it said "go" already)
                together.end()
        if not stored:  # said once; the stored checkpoints stay as they are, the local copies too
            rotate_checkpoints(run_dir, limit, best, keep=self._pending_names(run_dir))
            return
        try:
            self.rotate(run_dir, limit, best)
        except Exception as exc:  # noqa: BLE001 - the checkpoint is stored; the run goes on
            logger.warning(f"{folder} is stored, but removing older checkpoints after it failed ({_cause(exc)}).")

    def _pending_names(self, run_dir: str) -> set[str]:
        return {os.path.basename(path) for path in self._pending if os.path.dirname(path) == os.path.abspath(run_dir)}

    def adopt(self, folder: str) -> None:
        """A complete local checkpoint that is not stored (an earlier run could not upload it): uploaded with the
        next checkpoint, kept locally until then."""
        with self._lock:
            self._pending.setdefault(os.path.abspath(folder), "not stored by the run that wrote it")

    def wait(self, timeout_s: float | None = None) -> None:
        """The upload in flight (``save_async``), finished; on a process other than 0, its own files' uploads too.
        ``timeout_s``: at most that long in all (a failed run's last wait: what is still running then is left)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        threads = [self._uploading, *self._parts]
        if timeout_s is not None and any(thread is not None and thread.is_alive() for thread in threads):
            logger.warning(f"Finishing the checkpoint upload in flight to {self.url} first (at most "
                           f"{timeout_s:.0f} s), then the error is raised.")  # fmt: skip
        for thread in threads:
            if thread is not None and thread is not threading.current_thread():
                thread.join(None if deadline is None else max(deadline - time.monotonic(), 0))
        if all(thread is None or not thread.is_alive() for thread in threads):
            self._uploading, self._parts = None, []

    def settle(self) -> list[str]:
        self.wait()
        with self._lock:
            self._retry_pending()
            missing = list(self._pending)
        if missing:
            logger.warning(
                f"Not stored in {self.url}: {', '.join(missing)} (last cause: {self._pending[missing[-1]]}). They are "
                "kept in the local staging folder (output_dir)."
            )
        return missing


def _checkpoint_files(folder: str) -> dict[str, Path]:
    """The regular files of checkpoint ``folder``, by their name inside it (``optimizer_0/__1_0.distcp``), sorted."""
    files = sorted(p for p in Path(folder).rglob("*") if p.is_file() and not p.is_symlink())
    return {path.relative_to(folder).as_posix(): path for path in files}


class _Together:
    """Process 0's side of a checkpoint's round with the job's other processes (``hflight.checkpoints.storage.peers``):
    its one word that they may upload (``go``) or should not (``skip``), their answers, and its word that it is done
    with the checkpoint (``end``)."""

    def __init__(self, peers: Peers, round: str) -> None:
        self.peers, self.round = peers, round
        self.ready_key, self.end_key = f"{round}/ready", f"{round}/end"
        self._said = False

    def answer_key(self, rank: int) -> str:
        return f"{self.round}/{rank}"

    def go(self) -> None:
        self._say("go")

    def skip(self, cause: str) -> None:
        self._say(f"skip: {cause}")

    def end(self) -> None:
        """Process 0 is done with the checkpoint (stored or not): the other processes' uploads of it end."""
        self._tell(self.end_key, "end")

    def _say(self, word: str) -> None:
        if not self._said:
            self._said = True
            self._tell(self.ready_key, word)

    def _tell(self, key: str, word: str) -> None:
        try:
            self.peers.tell(key, word)
        except Exception as exc:  # noqa: BLE001 - the job's store is gone (it is ending): nobody waits
            logger.info(f"Could not tell the other processes {word!r} ({_cause(exc)}).")

    def answer(self, rank: int, timeout_s: float) -> str | None:
        return self.peers.hear(self.answer_key(rank), timeout_s)
