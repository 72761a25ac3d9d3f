"""Reading only what a checkpoint folder should hold: names inside the folder, regular files, and the errors.

Every reader of a checkpoint (the manifest, each part, the hub push) opens a file only through :func:`regular_file`,
which refuses a path leading outside the folder (``..``, an absolute path, a symbolic link elsewhere) and anything
that is not a regular file (a named pipe, a device, a socket, a folder) before anything opens it; a file of tensors is
loaded with ``torch.load(weights_only=True)`` (:func:`load_tensors_file`), never unpickling anything else.
"""

from __future__ import annotations

import os
import pickle
import re
import stat
from pathlib import Path, PurePosixPath
from typing import Any

_NOT_REGULAR = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class IncompleteCheckpointError(ValueError):
    """A checkpoint folder lacks files (or has truncated or damaged ones): interrupted while saving, or damaged
    since."""


class UnsafeCheckpointFile(ValueError):
    """A checkpoint file that is not read: pickled objects beyond tensors and plain values, a path leading outside
    the folder, or something other than a regular file."""


def relative_name(name: Any, where: str) -> str:
    """``name`` if it names a file inside a folder (relative, no ``..``); otherwise UnsafeCheckpointFile naming
    ``where`` (the file that lists the name)."""
    if not isinstance(name, str) or not name.strip() or "\x00" in name or "\\" in name:
        raise UnsafeCheckpointFile(f"{where} lists {name!r}, which is not a file name inside the checkpoint folder.")
    pure = PurePosixPath(name)
    if pure.is_absolute() or ".." in pure.parts or re.match(r"^[A-Za-z]:", name):
        raise UnsafeCheckpointFile(
            f"{where} lists {name!r}: a path outside the checkpoint folder. A checkpoint only refers to its own files."
        )
    return name


def regular_file(folder: str | os.PathLike, name: str, where: str | None = None) -> Path | None:
    """The path of file ``name`` of checkpoint ``folder``, None when there is none (a broken link counts as none).

    Raises:
        UnsafeCheckpointFile: ``name`` leads outside the folder (``..``, an absolute path, a symbolic link to a file
            elsewhere) or is not a regular file (a named pipe, a device, a socket, a folder); nothing was opened.
    """
    folder = Path(folder)
    relative_name(name, where or str(folder))
    path = folder / name
    if not os.path.lexists(path):
        return None
    root, real = os.path.realpath(folder), os.path.realpath(path)
    if os.path.commonpath([root, real]) != root:
        raise UnsafeCheckpointFile(
            f"{path} leads outside the checkpoint folder (to {real}): a checkpoint is read only from its own files."
        )
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        return None
    kind = next((what for test, what in _NOT_REGULAR if test(mode)), None)
    if kind is not None:
        raise UnsafeCheckpointFile(f"{path} is {kind}, not a regular file: it is not read.")
    return path


def inside(path: str | os.PathLike, folder: str | os.PathLike) -> bool:
    """Whether ``path`` lies inside ``folder`` (links and ``..`` resolved)."""
    root, real = os.path.realpath(folder), os.path.realpath(path)
    return real != root and os.path.commonpath([root, real]) == root


def refused_pickle(path: Path, exc: pickle.UnpicklingError, holds: str) -> UnsafeCheckpointFile:
    """The error for a file ``torch.load(weights_only=True)`` refused: it names the file and the object, and does
    not repeat torch's advice to load it with ``weights_only=False``."""
    unsafe = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
    what = f" (it refers to {unsafe.group(1)})" if unsafe else ""
    return UnsafeCheckpointFile(
        f"{path} cannot be loaded safely: it holds objects other than {holds}{what}. hflight never unpickles "
        "arbitrary objects from a checkpoint."
    )


def load_failure(path: Path, exc: BaseException) -> str:
    """Why ``path`` could not be loaded, in a few words."""
    if path.is_file() and path.stat().st_size == 0:
        return "the file is empty (0 bytes)"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else f"{type(exc).__name__} (truncated or not written by torch.save)"


def load_tensors_file(path: Path) -> Any:
    """A file of tensors and plain values (an optimizer's, a scheduler's state), loaded without running code."""
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise refused_pickle(path, exc, "tensors and plain values") from None
    except Exception as exc:
        raise ValueError(f"Cannot restore {path}: {load_failure(path, exc)}") from exc
