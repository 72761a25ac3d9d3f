"""Test support: what a run asks of the file system, recorded, and replayed against a power loss.

:class:`Recorder` records, from every thread (and, through :meth:`Recorder.dump`, every process of a job), each
``fsync``/``fdatasync`` with what it reached (a file: its inode, size and modification time then; a folder: its
entries then, name -> inode), each rename (``os.rename``, ``os.replace``, and ``Path.rename``/``Path.replace``, which
call them: torch's distributed-checkpoint writer renames its ``.metadata`` so), each deletion (``os.unlink``,
``os.remove``, ``os.rmdir``, ``Path.unlink``; ``shutil.rmtree`` as one event), and the moments the public calls
return, each with the monotonic clock (one clock for every process of the machine: the records of several processes
merge in order).

:func:`violations` replays them under the rules SQLite, LevelDB and etcd assume, and nothing looser:

- a file's bytes are durable once an fsync (or fdatasync) of it saw them as they are (its size and modification
  time then are its size and time now): an fsync before the file's last change does not count;
- a folder's entry (a new file, a rename into it) is durable once an fsync of the folder listed it, pointing at the
  same inode: an fsync of the folder from before the entry was made does not count.

A checkpoint folder renamed into place must hold only durable files and entries; the rename must be made durable at
once (the next event of the process that renamed it: an fsync of the run folder listing it); an older checkpoint is
retired, and a public call returns, only once every such rename is durable; when a public call returns, every file
of the checkpoints and every file directly in the run folder is durable with its entry, and so is the run folder's
own entry in its parent. A published checkpoint is never changed in place (no file of it deleted).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import threading
import time
from pathlib import Path
from typing import Any

CHECKPOINT = re.compile(r"^checkpoint-\d+$")
#: the ``os`` functions the recorder wraps: (name, kind of event)
_WRAPPED = (("fsync", "fsync"), ("fdatasync", "fsync"), ("rename", "rename"), ("replace", "rename"),
            ("unlink", "unlink"), ("remove", "unlink"), ("rmdir", "unlink"))  # fmt: skip


def _stamp(info: os.stat_result) -> list[int]:
    return [info.st_size, info.st_mtime_ns]


def _entries(folder: str) -> dict[str, int]:
    """A folder's entries (name -> inode), as listed now."""
    return {entry.name: entry.inode() for entry in os.scandir(folder)}


def _tree(folder: str) -> dict[str, Any]:
    """Every folder under ``folder`` (itself included): its inode and entries (name -> [inode, size, mtime] of a
    file, [inode] of a folder)."""
    found = {}
    for root, dirs, files in os.walk(folder):
        entries = {}
        for name in (*files, *dirs):
            info = os.lstat(os.path.join(root, name))
            entries[name] = [info.st_ino] + ([] if stat.S_ISDIR(info.st_mode) else _stamp(info))
        found[os.path.abspath(root)] = {"ino": os.stat(root).st_ino, "entries": entries}
    return found


def _inodes(path: Any) -> list[int]:
    """The inodes a deletion of ``path`` frees (every file and folder under it): the file system may give them to the
    next files made, which the replay must not take for the ones it saw fsynced."""
    try:
        found = [os.lstat(path).st_ino]
    except FileNotFoundError:
        return []
    if os.path.isdir(path) and not os.path.islink(path):
        for root, dirs, files in os.walk(path):
            found += [os.lstat(os.path.join(root, name)).st_ino for name in (*dirs, *files)]
    return found


class Recorder:
    """Records the file-system calls of this process (any thread) and the public calls' returns."""

    def __init__(self, out: str | os.PathLike) -> None:
        self.out = os.path.realpath(out)
        self.events: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.quiet = threading.local()  # inside shutil.rmtree: its own deletions are one event
        self.real: dict[str, Any] = {}

    def add(self, kind: str, **fields: Any) -> None:
        with self.lock:
            self.events.append({"kind": kind, "t": time.monotonic_ns(), "pid": os.getpid(), **fields})

    # ---- installing ------------------------------------------------------------------------------------------------
    def install(self, monkeypatch: Any = None) -> None:
        """Wrap the ``os`` and ``shutil`` functions (through ``monkeypatch`` in a test, else until :meth:`remove`)."""
        wrappers = {name: getattr(self, f"_{kind}")(getattr(os, name)) for name, kind in _WRAPPED}
        self.real = {name: getattr(os, name) for name in wrappers} | {"rmtree": shutil.rmtree}
        for name, wrapper in wrappers.items():
            (monkeypatch.setattr if monkeypatch else setattr)(os, name, wrapper)
        (monkeypatch.setattr if monkeypatch else setattr)(shutil, "rmtree", self._rmtree(shutil.rmtree))

    def remove(self) -> None:
        for name, real in self.real.items():
            setattr(shutil if name == "rmtree" else os, name, real)

    def _fsync(self, real: Any) -> Any:
        def fsync(fd: int) -> None:
            info = os.fstat(fd)
            path = os.readlink(f"/proc/self/fd/{fd}")
            if stat.S_ISDIR(info.st_mode):
                fields = {"what": "dir", "entries": _entries(path)}  # listed before: the fsync covers these
            else:
                fields = {"what": "file", "stamp": _stamp(info)}
            real(fd)
            self.add("fsync", path=path, ino=info.st_ino, **fields)

        return fsync

    def _rename(self, real: Any) -> Any:
        def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
            real(src, dst, *args, **kwargs)
            if kwargs.get("src_dir_fd") is None and kwargs.get("dst_dir_fd") is None:
                moved = os.path.realpath(dst)
                info = os.lstat(moved)
                tree = _tree(moved) if stat.S_ISDIR(info.st_mode) else None
                self.add("rename", src=os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(src))),
                         os.path.basename(src)), dst=moved, ino=info.st_ino, tree=tree,
                         parent_ino=os.stat(os.path.dirname(moved)).st_ino)  # fmt: skip

        return rename

    def _unlink(self, real: Any) -> Any:
        def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
            recorded = not getattr(self.quiet, "on", False) and kwargs.get("dir_fd") is None
            removed = _inodes(path) if recorded else []
            real(path, *args, **kwargs)
            if recorded:
                self.add("unlink", path=os.path.realpath(path), removed=removed)

        return unlink

    def _rmtree(self, real: Any) -> Any:
        def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
            self.add("rmtree", path=os.path.realpath(path), removed=_inodes(path))
            self.quiet.on = True
            try:
                return real(path, *args, **kwargs)
            finally:
                self.quiet.on = False

        return rmtree

    # ---- the public calls ------------------------------------------------------------------------------------------
    def returned(self, name: str) -> None:
        """A public call returned: what it wrote must be on disk now, with its entries."""
        folders = [self.out, *(str(p) for p in sorted(Path(self.out).glob("checkpoint-*")) if p.is_dir())]
        listed = {}
        for folder in folders:
            listed[folder] = {"ino": os.stat(folder).st_ino, "files": {}}
            for entry in os.scandir(folder):
                if entry.is_file(follow_symlinks=False):
                    info = entry.stat(follow_symlinks=False)
                    listed[folder]["files"][entry.name] = [info.st_ino, *_stamp(info)]
        parent = os.path.dirname(self.out)
        self.add("returned", name=name, folders=listed, parent=parent, parent_ino=os.stat(parent).st_ino)

    def dump(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.events))


def merged(*paths: str | os.PathLike) -> list[dict[str, Any]]:
    """The events several processes dumped, in the order they happened."""
    events = [event for path in paths for event in json.loads(Path(path).read_text())]
    return sorted(events, key=lambda event: event["t"])


# ---- the replay ----------------------------------------------------------------------------------------------------
class _Disk:
    """What survives a power loss, as the replay has seen it so far."""

    def __init__(self) -> None:
        self.content: dict[int, set[tuple[int, int]]] = {}  # inode -> the (size, mtime) an fsync saw
        self.listed: dict[int, dict[str, int]] = {}  # folder inode -> its entries at its last fsync

    def durable(self, ino: int, stamp: list[int]) -> bool:
        return tuple(stamp) in self.content.get(ino, set())

    def entry(self, folder_ino: int, name: str, ino: int) -> bool:
        return self.listed.get(folder_ino, {}).get(name) == ino

    def forget(self, inodes: list[int]) -> None:
        """Deleted: what an fsync saw of these inodes says nothing of the files that reuse them."""
        gone = set(inodes)
        for ino in gone:
            self.content.pop(ino, None)
            self.listed.pop(ino, None)
        for folder, entries in self.listed.items():
            self.listed[folder] = {name: ino for name, ino in entries.items() if ino not in gone}


def violations(events: list[dict[str, Any]], out: str | os.PathLike) -> list[str]:
    """What a power loss at some point of ``events`` could lose that must survive (see the module's rules)."""
    out = os.path.realpath(out)
    disk, problems = _Disk(), []
    pending: list[dict[str, Any]] = []  # checkpoint renames not yet listed by an fsync of their folder
    for index, event in enumerate(events):
        kind = event["kind"]
        disk.forget(event.get("removed", []))  # a deletion: its inodes may come back as new files
        if kind == "fsync" and event["what"] == "file":
            disk.content.setdefault(event["ino"], set()).add(tuple(event["stamp"]))
        elif kind == "fsync":
            disk.listed[event["ino"]] = event["entries"]
            pending = [p for p in pending if not disk.entry(p["parent_ino"], p["name"], p["ino"])]
        elif kind == "rename" and CHECKPOINT.match(os.path.basename(event["dst"])) and event["tree"] is not None:
            problems += _published(disk, event)
            parent = os.path.dirname(event["dst"])
            rename = {"dst": event["dst"], "name": os.path.basename(event["dst"]), "ino": event["ino"],
                      "parent_ino": event["parent_ino"]}  # fmt: skip
            pending.append(rename)
            following = next((e for e in events[index + 1 :] if e["pid"] == event["pid"]), None)
            if not (following and following["kind"] == "fsync" and following["path"] == parent
                    and following["entries"].get(rename["name"]) == event["ino"]):  # fmt: skip
                problems.append(f"the rename to {event['dst']} was not made durable at once (fsync of its folder)")
        elif kind == "rename" and CHECKPOINT.match(os.path.basename(event["src"])):
            problems += [f"{event['src']} retired while the rename to {p['dst']} was not durable" for p in pending]
        elif kind == "rmtree" and (CHECKPOINT.match(os.path.basename(event["path"])) or
                                   event["path"].endswith(".replaced")):  # fmt: skip
            problems += [f"{event['path']} deleted while the rename to {p['dst']} was not durable" for p in pending]
        elif kind == "unlink" and any(CHECKPOINT.match(part) for part in Path(event["path"]).parts[:-1]):
            problems.append(f"{event['path']}, a file of a published checkpoint, was deleted in place")
        elif kind == "returned":
            problems += [f"{event['name']} returned while the rename to {p['dst']} was not durable" for p in pending]
            problems += _returned(disk, event, out)
    return problems


def _published(disk: _Disk, event: dict[str, Any]) -> list[str]:
    """A folder renamed into place: each of its files durable as it is, each entry listed by its folder's fsync."""
    problems = []
    for folder, listing in event["tree"].items():
        for name, (ino, *stamp) in listing["entries"].items():
            path = os.path.join(folder, name)
            if stamp and not disk.durable(ino, stamp):
                problems.append(f"{event['dst']} published before {path} was fsynced as it is")
            if not disk.entry(listing["ino"], name, ino):
                problems.append(f"{event['dst']} published before the entry of {path} was durable (fsync of {folder} "
                                "after it was made)")  # fmt: skip
    return problems


def _returned(disk: _Disk, event: dict[str, Any], out: str) -> list[str]:
    """A public call returned: every file of the run folder and of its checkpoints durable, with its entry; the run
    folder's own entry too."""
    name, problems = event["name"], []
    for folder, listing in event["folders"].items():
        for file, (ino, *stamp) in listing["files"].items():
            path = os.path.join(folder, file)
            shown = file if folder == out else path
            if not disk.durable(ino, stamp):
                problems.append(f"{name} returned with {shown} not fsynced since it changed")
            if not disk.entry(listing["ino"], file, ino):
                problems.append(f"{name} returned before the entry of {shown} was durable")
    if not disk.entry(event["parent_ino"], os.path.basename(out), event["folders"][out]["ino"]):
        problems.append(f"{name} returned before the run folder's own entry was durable")
    return problems
