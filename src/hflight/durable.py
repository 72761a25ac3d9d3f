"""Putting written bytes on disk: the one place where hflight asks the operating system to make files, folders and
renames survive a power loss, not only a killed process.

A file's bytes are durable once the file was fsynced; a directory entry (a new file, a rename) once its directory was
fsynced (the rules SQLite, LevelDB and etcd rely on). Every writer that publishes by rename goes through here:

- :func:`publish_folder` (a checkpoint): every file of the temporary folder fsynced, then each of its folders
  (deepest first, the folder itself last), then the rename into place, then the parent folder fsynced, and the
  parent's own entry in its parent when the caller has not made it durable yet (a new run folder; a folder deleted
  and made again at the same path is a new folder). A folder the new one replaces is deleted only once the new one is
  durable; the caller retires older checkpoints only after this returns.
- :func:`replace_file` (generated data, a tokenizer, the run record): the temporary file fsynced, renamed into
  place, the parent folder fsynced.
- :func:`sync_files` (files written in place: ``save_model``, results, ``trainer_state.json``, a sweep's summary):
  each file fsynced, then their folders.

A failed fsync (EIO, ENOSPC) raises: the write did not happen, and the caller keeps what it had. A filesystem that
cannot fsync a directory (some network filesystems answer EINVAL) is named once in a warning and the save goes on:
its renames are then only as durable as that filesystem makes them.

May import: nothing from hflight.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Collection, Iterable
from pathlib import Path

logger = logging.getLogger(__name__)

#: Errors of a directory fsync that mean "not supported here", not "failed".
_UNSUPPORTED = (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.EISDIR, errno.EACCES)
_warned_filesystems: set[int] = set()


def fsync_file(path: str | os.PathLike) -> None:
    """Put ``path``'s bytes on disk (raises the ``OSError`` of a failed fsync, with the file named)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        raise OSError(exc.errno, f"fsync failed: {exc.strerror}", os.fspath(path)) from exc
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Put ``path``'s list of entries on disk. A filesystem that cannot fsync a folder is warned about once."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as exc:
        if exc.errno in _UNSUPPORTED:
            _unsupported(path, exc)
            return
        raise
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _UNSUPPORTED:
            raise OSError(exc.errno, f"fsync of the folder failed: {exc.strerror}", os.fspath(path)) from exc
        _unsupported(path, exc)
    finally:
        os.close(fd)


def _unsupported(path: str | os.PathLike, exc: OSError) -> None:
    try:
        device = os.stat(path).st_dev
    except OSError:
        device = -1
    if device in _warned_filesystems:
        return
    _warned_filesystems.add(device)
    logger.warning(
        f"The filesystem holding {path} cannot fsync a folder ({exc.strerror}): files are still fsynced, but a "
        "rename (a checkpoint's publication) is only as durable as this filesystem makes it. Shown once per "
        "filesystem."
    )


def sync_tree(folder: str | os.PathLike, already: Collection[tuple[str, tuple[int, int]]] = ()) -> None:
    """fsync every file under ``folder``, then every folder, deepest first, ``folder`` itself last. ``already``:
    files fsynced before (absolute path, (size, mtime_ns) then): skipped while they are unchanged."""
    folders = []
    for root, dirs, files in os.walk(folder):
        for name in sorted(files):
            path = os.path.join(root, name)
            if os.path.islink(path):
                continue
            info = os.stat(path)
            if (os.path.abspath(path), (info.st_size, info.st_mtime_ns)) not in already:
                fsync_file(path)
        folders.append(root)
        dirs.sort()
    for each in reversed(folders):
        fsync_dir(each)


def publish_folder(
    tmp_dir: str | os.PathLike,
    final_dir: str | os.PathLike,
    aside: str | os.PathLike,
    already: Collection[tuple[str, tuple[int, int]]] = (),
    entries_made_durable: set[tuple[int, int]] | None = None,
) -> None:
    """Make the complete ``tmp_dir`` durable and rename it to ``final_dir``; an existing ``final_dir`` is first
    renamed to ``aside`` and deleted once the new folder and the rename are durable. ``already``: its files fsynced
    while it was written (:func:`sync_tree`). ``entries_made_durable``: the caller's record of the folders (device,
    inode) whose own entry in their parent it made durable (a run's: the parent's entry is fsynced at its first
    publication into a folder, and again for a folder made anew); None: every time."""
    sync_tree(tmp_dir, already)
    replaced = False
    if os.path.exists(final_dir):
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(final_dir, aside)
        replaced = True
    os.replace(tmp_dir, final_dir)
    parent = os.path.dirname(os.path.abspath(final_dir))
    fsync_dir(parent)
    info = os.stat(parent)
    folder = (info.st_dev, info.st_ino)
    if entries_made_durable is None or folder not in entries_made_durable:  # the run folder's own entry
        fsync_dir(os.path.dirname(parent))
        if entries_made_durable is not None:
            entries_made_durable.add(folder)
    if replaced:
        shutil.rmtree(aside, ignore_errors=True)


def replace_file(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Make the complete file ``tmp`` durable, rename it to ``final`` and make the rename durable."""
    fsync_file(tmp)
    os.replace(tmp, final)
    fsync_dir(os.path.dirname(os.path.abspath(final)))


def sync_files(paths: Iterable[str | os.PathLike]) -> None:
    """Make new files written in place durable: each file, then (once each) the folders that hold them."""
    folders: dict[str, None] = {}
    for path in paths:
        if os.path.isfile(path) and not os.path.islink(path):
            fsync_file(path)
            folders[os.path.dirname(os.path.abspath(path))] = None
    for folder in folders:
        fsync_dir(folder)


def stamps(folder: str | os.PathLike) -> dict[str, tuple[int, int]] | None:
    """Size and modification time of each file directly in ``folder`` (None when there is no such folder)."""
    if not os.path.isdir(folder):
        return None
    found: dict[str, tuple[int, int]] = {}
    for entry in os.scandir(folder):
        if entry.is_file(follow_symlinks=False):
            info = entry.stat(follow_symlinks=False)
            found[os.path.join(os.fspath(folder), entry.name)] = (info.st_size, info.st_mtime_ns)
    return found


def sync_new_files(folder: str | os.PathLike, before: dict[str, tuple[int, int]] | None) -> None:
    """Make durable what was written directly into ``folder`` since ``before`` (:func:`stamps`): each new or changed
    file; ``folder``'s entries when a file is new; the folder's own entry in its parent when the folder is new."""
    now = stamps(folder)
    if now is None:
        return
    old = before or {}
    changed = [path for path, stamp in now.items() if old.get(path) != stamp]
    for path in changed:
        fsync_file(path)
    if any(path not in old for path in changed):
        fsync_dir(folder)
    if before is None:
        fsync_dir(Path(folder).resolve().parent)
