"""What a ``checkpoint-N`` folder holds, and how it is read: only through the regular files it should hold.

The manifest (``checkpoint_manifest.json``, written last by ``hflight.checkpoints.folders``) lists every file of the
folder with its size and an xxh3-128 checksum, and the arguments that fix the data position. Reading checks:

- **Paths stay inside the folder.** A name in the manifest or in a shard index that is absolute or contains ``..``
  is refused; a file that is a symbolic link leading outside the folder, a named pipe, a device or a socket is
  refused (:class:`UnsafeCheckpointFile`) before anything opens it.
- **Complete** (:func:`verify_checkpoint`): every listed file is there with its recorded size; when the folder is
  about to be loaded (``full=True``: resume, best-model loading) its checksum matches too, so flipped bytes are
  found and the file is named.
- **Re-saved weights are told from damaged ones.** The weights in use are found as transformers finds them
  (``model.safetensors``, else ``model.safetensors.index.json`` and its shards, else the ``.bin`` forms). When a
  file of those is not in the manifest at all, the weights were written again after the save (for example
  ``save_pretrained(max_shard_size=...)``, which re-shards under new names): the manifest's model files
  (weights, ``config.json``, ``generation_config.json``) are then not compared, the new files are checked for
  structure (complete safetensors headers; every shard the index names is there), and the caller is told what
  changed. A file the manifest *does* list by name must match its size and checksum: a damaged or truncated file
  keeps its name, so it is refused. (A re-save under the very same names cannot be told from damage: delete the
  manifest to accept it.)
- A folder without a manifest (written by ``transformers.Trainer``) counts when it holds ``trainer_state.json``
  (which transformers writes last) and model weights; no folder without weights is ever offered.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import mmap
import os
import re
import threading
from pathlib import Path
from typing import Any

from hflight import durable
from hflight.checkpoints.names import (
    ADAPTER_WEIGHT_FILES,
    CHECKPOINT_RE,
    MANIFEST_NAME,
    PREFIX,
    TMP_PREFIX,
    TRAINER_STATE_NAME,
)
from hflight.checkpoints.parts import part_of
from hflight.checkpoints.weights import WEIGHT_FILES, is_weight_file, weights_in_use
from hflight.checkpoints.writers.files import (
    IncompleteCheckpointError,
    UnsafeCheckpointFile,
    regular_file,
    relative_name,
)

logger = logging.getLogger(__name__)

__all__ = [
    "CHECKPOINT_RE", "CHECKSUM", "MANIFEST_FORMAT", "MANIFEST_NAME", "MANIFEST_VERSION", "PREFIX", "TMP_PREFIX",
    "Checksums", "IncompleteCheckpointError", "UnsafeCheckpointFile", "checkpoint_folders", "file_digest",
    "get_last_checkpoint", "read_manifest", "verify_checkpoint", "write_manifest",
]  # fmt: skip

MANIFEST_FORMAT = "hflight-checkpoint"
MANIFEST_VERSION = 2  # 1: sizes only; 2: sizes and checksums
CHECKSUM = "xxh3_128"
_CHUNK = 8 << 20
_MAX_LISTED = 6


def new_digest() -> Any:
    """A streaming checksum of the manifest's kind (``update``, ``hexdigest``), for a writer that hashes the bytes it
    writes (:meth:`Checksums.add_hashed`)."""
    import xxhash

    return xxhash.xxh3_128()


def file_digest(path: str | os.PathLike) -> str:
    """The xxh3-128 checksum of a file (hex). The file is mapped, not copied, so the hash reads the page cache
    directly (~10-18 GB/s here: small next to writing the file)."""
    import xxhash

    digest = xxhash.xxh3_128()
    with open(path, "rb") as handle:
        if os.fstat(handle.fileno()).st_size == 0:
            return digest.hexdigest()
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as view:
            for start in range(0, len(view), _CHUNK):
                digest.update(view[start : start + _CHUNK])
    return digest.hexdigest()


class Checksums:
    """The checksums of a folder being written and the fsyncs of its files, by one background thread as soon as each
    file is complete: putting one file on disk and hashing it overlap writing the next (:meth:`add_new` after writing,
    :meth:`digest` when the manifest is written, :meth:`synced` when the folder is published). Each file is fsynced,
    then hashed; a checksum the thread has not started when the manifest asks for it (the thread is waiting for the
    disk) is computed by the thread that asks, so hashing never waits behind an fsync. A file changed after it was
    submitted is hashed again. :meth:`synced` says which files are durable as they are now, so that the publication
    (``hflight.durable.publish_folder``) fsyncs only the others.

    Opened and closed by the thread that finishes the folder's write (``hflight.checkpoints.job``)."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hflight-checksum")
        self._pending: dict[Path, tuple[tuple[int, int], concurrent.futures.Future]] = {}
        self._syncs: list[tuple[str, tuple[int, int], concurrent.futures.Future]] = []
        self._lock = threading.Lock()  # the job's writers may add files from several threads

    def __enter__(self) -> Checksums:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop the background thread (the checksums and fsyncs not asked for yet are dropped)."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    @staticmethod
    def _stamp(path: Path) -> tuple[int, int]:
        info = path.stat()
        return info.st_size, info.st_mtime_ns

    def add_new(self, folder: str | os.PathLike) -> None:
        """Start fsyncing, then hashing, every file of ``folder`` not submitted yet."""
        with self._lock:
            for path in sorted(Path(folder).rglob("*")):
                if path.is_file() and path.name != MANIFEST_NAME and path not in self._pending:
                    self._add(path, None)

    @staticmethod
    def new_digest() -> Any:
        """A streaming checksum for a writer that hashes the bytes it writes (:func:`new_digest`)."""
        return new_digest()

    def add_hashed(self, path: str | os.PathLike, digest: str) -> None:
        """Start fsyncing ``path``, whose checksum its writer computed from the bytes it wrote (``new_digest``)."""
        with self._lock:
            self._add(Path(path), digest)

    def _add(self, path: Path, digest: str | None) -> None:
        """``path``'s fsync submitted, then its checksum: ``digest``, else hashed by the thread (under the lock)."""
        stamp = self._stamp(path)
        self._syncs.append((os.path.abspath(path), stamp, self._pool.submit(durable.fsync_file, path)))
        if digest is None:
            hashed = self._pool.submit(file_digest, path)
        else:
            hashed = concurrent.futures.Future()
            hashed.set_result(digest)
        self._pending[path] = (stamp, hashed)

    def synced(self) -> set[tuple[str, tuple[int, int]]]:
        """The files fsynced in the background, with the size and time they had then (waits for those in progress;
        a failed fsync is raised, naming its file)."""
        return {(path, stamp) for path, stamp, future in self._syncs if future.result() is None}

    def digest(self, path: Path) -> str:
        """``path``'s checksum: the thread's, or, when it has not started it (or the file changed since), this
        thread's."""
        stamp, future = self._pending.get(path, (None, None))
        if future is not None and stamp == self._stamp(path) and not future.cancel():
            return future.result()  # hashed, or being hashed
        return file_digest(path)


# ---- the manifest ---------------------------------------------------------------------------------------------------
def write_manifest(
    folder: str,
    global_step: int,
    save_only_model: bool,
    run: dict[str, Any],
    checksums: Checksums | None = None,
    loop: dict[str, Any] | None = None,
) -> None:
    """List every file of ``folder`` with its size and checksum (``checksums``: those computed while the folder was
    written); written last, so its presence means the rest is there. ``loop``: the training loop's bookkeeping at the
    checkpoint (``hflight.run.loop.TrainingLoop.progress``: running losses, a pending epoch end), so that a run
    continued from it (``resume_from_checkpoint="auto"``) logs what the uninterrupted run logs."""
    root = Path(folder)
    digest = checksums.digest if checksums is not None else file_digest
    files = {
        p.relative_to(root).as_posix(): {"size": p.stat().st_size, CHECKSUM: digest(p)}
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME
    }
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "global_step": global_step,
        "save_only_model": save_only_model,
        "run": run,
        "files": files,
    }
    if loop is not None:
        manifest["loop"] = loop
    (root / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _entry(value: Any, version: Any) -> dict[str, Any] | None:
    """A manifest's file entry as ``{"size", CHECKSUM}``; None if malformed. Version 1 recorded the size alone;
    from version 2 on every entry must carry its checksum (an entry without one would be accepted unchecked)."""
    if type(value) is int and version == 1:
        return {"size": value}
    if isinstance(value, dict) and type(value.get("size")) is int:
        digest = value.get(CHECKSUM)
        if digest is None and version == 1:
            return value
        if isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{32}", digest):
            return value
    return None


def read_manifest(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The folder's manifest (file entries as ``{"size", "xxh3_128"}``), or None when it has none; a manifest that
    cannot be read, or that lists a path outside the folder, raises naming the file."""
    path = regular_file(folder, MANIFEST_NAME)
    if path is None:
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise IncompleteCheckpointError(f"Checkpoint manifest {path} is unreadable: {exc}") from exc
    files = manifest.get("files") if isinstance(manifest, dict) else None
    version = manifest.get("version") if isinstance(manifest, dict) else None
    if isinstance(files, dict) and (type(version) is not int or not 1 <= version <= MANIFEST_VERSION):
        raise IncompleteCheckpointError(
            f"Checkpoint manifest {path} has version {version!r}; this hflight reads versions 1 to "
            f"{MANIFEST_VERSION} (a newer hflight wrote it?)."
        )
    entries = {k: _entry(v, version) for k, v in files.items()} if isinstance(files, dict) else {}
    if not isinstance(files, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise IncompleteCheckpointError(
            f"Checkpoint manifest {path} is not an hflight manifest (expected format {MANIFEST_FORMAT!r} and a "
            "'files' mapping of file name to its size and checksum)."
        )
    bad = [name for name, entry in entries.items() if entry is None]
    if bad:
        raise IncompleteCheckpointError(
            f"Checkpoint manifest {path} (version {version}) has no valid size and {CHECKSUM} checksum for "
            f"{_listed(sorted(bad))}: the entry cannot be checked, so the checkpoint is not trusted."
        )
    for name in entries:
        relative_name(name, str(path))
    return {**manifest, "files": entries}


# ---- what counts as a checkpoint ----------------------------------------------------------------------------------
def _file_problem(folder: Path, name: str, entry: dict[str, Any], full: bool) -> str | None:
    """What is wrong with listed file ``name`` (None: nothing); ``full`` also compares the checksum."""
    path = regular_file(folder, name)
    if path is None:
        return f"no {name}"
    size = path.stat().st_size
    if size != entry["size"]:
        return f"{name} is corrupt or truncated ({size} bytes, {entry['size']} when saved)"
    saved = entry.get(CHECKSUM)
    if full and saved is not None and (now := file_digest(path)) != saved:
        return (
            f"{name} is damaged: its content differs from the checksum recorded when it was saved ({CHECKSUM} {now}, "
            f"{saved} when saved)"
        )
    return None


def _structure_problems(folder: Path, names: list[str]) -> list[str]:
    """Re-saved weight files: each safetensors file has a complete header covering the file; every shard is there."""
    from safetensors import safe_open

    problems = []
    for name in names:
        path = regular_file(folder, name)
        if path is None:
            problems.append(f"no {name} (named by the re-saved weights' index)")
        elif name.endswith(".safetensors"):
            try:
                with safe_open(str(path), framework="pt"):
                    pass
            except Exception as exc:  # safetensors' own error for a truncated or foreign file
                problems.append(f"{name} is corrupt or truncated ({exc})")
    return problems


def _listed(names: list[str]) -> str:
    more = len(names) - _MAX_LISTED
    return ", ".join(names[:_MAX_LISTED]) + (f" and {more} more" if more > 0 else "")


def resave_report(folder: Path, manifest: dict[str, Any], in_use: list[str]) -> str:
    """What changed in the model files of ``folder`` since the manifest was written (for the warning)."""
    listed = manifest["files"]
    new = [n for n in in_use if n not in listed]
    gone = [n for n in listed if is_weight_file(n) and regular_file(folder, n) is None]
    changed = []
    for name in [n for n in listed if part_of(n) == "model" and n not in gone]:
        path = regular_file(folder, name)
        if path is not None and _file_problem(folder, name, listed[name], full=True) is not None:
            changed.append(name)
    parts = [f"{label}: {_listed(items)}" for label, items in
             (("new", new), ("rewritten", changed), ("no longer there", gone)) if items]  # fmt: skip
    return (
        f"Checkpoint {folder}: its model weights were saved again after the checkpoint was written ({'; '.join(parts)})"
        f". Resuming from the weights as they are now ({in_use[0]}, checked against the model); the optimizer, "
        "scheduler and trainer state are those saved with the original weights."
    )


def verify_checkpoint(folder: str | os.PathLike, full: bool = False, model_files_only: bool = False) -> dict | None:
    """Check that ``folder`` is a complete checkpoint; return its manifest (None for a folder without one).

    Args:
        folder: the ``checkpoint-N`` folder.
        full: also compare every checked file's checksum, and warn when the weights were re-saved (for a folder
            about to be loaded); without it, sizes only (cheap: what ``get_last_checkpoint`` uses).
        model_files_only: check only the weights and their config (what best-model loading reads).

    Raises:
        IncompleteCheckpointError: naming every missing, truncated or damaged file, or a folder without model weights
            or (without a manifest) without ``trainer_state.json``.
        UnsafeCheckpointFile: a listed file leads outside the folder or is not a regular file.
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    in_use = weights_in_use(folder)
    if not in_use:
        listed = [n for n in (manifest or {}).get("files", {}) if is_weight_file(n)]
        looked = f"{', '.join(listed)}, which its manifest lists" if listed else ", ".join(
            [*WEIGHT_FILES, *ADAPTER_WEIGHT_FILES])  # fmt: skip
        raise IncompleteCheckpointError(
            f"Checkpoint {folder} has no model weights (looked for {looked}): it is incomplete (interrupted while "
            "saving or deleting?) or not a Trainer checkpoint."
        )
    if manifest is None:
        if regular_file(folder, TRAINER_STATE_NAME) is None:
            raise IncompleteCheckpointError(
                f"Checkpoint {folder} has no {TRAINER_STATE_NAME}: it is incomplete (interrupted while saving?) or "
                "not a Trainer checkpoint."
            )
        return None
    listed = manifest["files"]
    resaved = any(name not in listed for name in in_use)
    model = {n for n in listed if part_of(n) == "model"}
    names = [n for n in listed if not (resaved and n in model) and (n in model or not model_files_only)]
    problems = [p for n in names if (p := _file_problem(folder, n, listed[n], full)) is not None]
    if resaved:
        problems += _structure_problems(folder, in_use)
    if problems:
        raise IncompleteCheckpointError(
            f"Checkpoint {folder} is incomplete or damaged: {'; '.join(problems)} (checked against its "
            f"{MANIFEST_NAME}; if files were changed on purpose, delete the manifest to resume from the folder as it "
            "is)."
        )
    if full:
        _warn_about_changes(folder, manifest, in_use, resaved)
    return manifest


def _warn_about_changes(folder: Path, manifest: dict[str, Any], in_use: list[str], resaved: bool) -> None:
    """For a folder about to be loaded: re-saved weights, or weight files written beside the saved ones."""
    if resaved:
        logger.warning(resave_report(folder, manifest, in_use))
        return
    extra = sorted(n for n in os.listdir(folder) if is_weight_file(n) and n not in manifest["files"])
    if extra:
        logger.warning(
            f"Checkpoint {folder} holds weight files its {MANIFEST_NAME} does not list ({_listed(extra)}; written "
            f"after the checkpoint?). They are ignored: the weights are read from {in_use[0]}, as saved."
        )


def checkpoint_folders(folder: str | os.PathLike) -> list[Path]:
    """The ``checkpoint-N`` folders of ``folder``, newest (largest N) first, complete or not."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = ((int(m.group(1)), p) for p in folder.iterdir() if (m := CHECKPOINT_RE.match(p.name)) and p.is_dir())
    return [path for _, path in sorted(found, reverse=True)]


def get_last_checkpoint(folder: str | os.PathLike) -> str | None:
    """The complete ``checkpoint-N`` folder with the largest N in ``folder``, or None.

    Incomplete folders (see :func:`verify_checkpoint`; sizes are compared, checksums when the folder is loaded) are
    skipped with a warning that says what they lack.
    """
    for path in checkpoint_folders(folder):
        try:
            verify_checkpoint(path)
        except (IncompleteCheckpointError, UnsafeCheckpointFile) as exc:
            logger.warning(f"Skipping {path.name}: {exc}")
            continue
        return str(path)
    return None
