"""The local disk as a checkpoint storage: a checkpoint is stored once its folder is published under its
``checkpoint-N`` name (``hflight.checkpoints.job``), removed by leaving that name first, and rotated as transformers
rotates.

May import: ``hflight.checkpoints`` (its own modules).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Collection
from pathlib import Path
from typing import Any

from transformers.trainer_utils import sort_checkpoints

from hflight.checkpoints.manifest import checkpoint_folders
from hflight.checkpoints.names import CHECKPOINT_RE, DELETING_SUFFIX, PREFIX, TMP_PREFIX


def remove_checkpoint(folder: str | os.PathLike) -> None:
    """Delete a checkpoint folder so that no reader sees it half-deleted: it leaves its ``checkpoint-N`` name
    (renamed to ``.tmp-checkpoint-N.deleting``) before anything in it is deleted."""
    folder = Path(folder)
    aside = folder.with_name(f"{TMP_PREFIX}{folder.name}{DELETING_SUFFIX}")
    shutil.rmtree(aside, ignore_errors=True)  # left by a deletion that was interrupted
    try:
        os.replace(folder, aside)
    except FileNotFoundError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def rotation(names: list[str], save_total_limit: int | None, best: str | None) -> list[str]:
    """transformers' rotation over checkpoint names (oldest first): those to remove so that at most
    ``save_total_limit`` remain, never the newest (to resume from) nor ``best`` (the best model's)."""
    if save_total_limit is None or save_total_limit <= 0 or len(names) <= save_total_limit:
        return []
    protected = {names[-1]} | ({best} if best is not None else set())
    remaining, doomed = len(names), []
    for name in names:
        if remaining <= max(save_total_limit, len(protected)):
            break
        if name not in protected:
            doomed.append(name)
            remaining -= 1
    return doomed


def rotate_checkpoints(
    output_dir: str, save_total_limit: int | None, best_model_checkpoint: str | None, keep: Collection[str] = ()
) -> None:
    """transformers' rotation (keep at most ``save_total_limit`` checkpoints, never the newest nor the best),
    removing each folder with :func:`remove_checkpoint`; ``keep``: names never removed (local copies not stored
    elsewhere yet)."""
    if save_total_limit is None or save_total_limit <= 0:
        return
    checkpoints = sort_checkpoints(output_dir, PREFIX, use_mtime=False)
    by_name = {os.path.basename(path): path for path in checkpoints}
    best = None
    if best_model_checkpoint is not None:
        best = next((n for n, p in by_name.items() if os.path.realpath(p) == os.path.realpath(best_model_checkpoint)),
                    os.path.basename(best_model_checkpoint))  # fmt: skip
    for name in rotation(list(by_name), save_total_limit, best):
        if name not in keep:
            remove_checkpoint(by_name[name])


class LocalStorage:
    """Checkpoints on the local disk only (the default: ``output_dir`` is a local folder)."""

    remote = False

    def __init__(self, output_dir: str) -> None:
        self.output_dir = output_dir

    def where(self, folder: str) -> str:
        return folder

    def probe(self) -> None:
        return None

    def publish(self, folder: str) -> bool:
        return True  # published under its name already

    def complete(self, run_dir: str) -> list[str]:
        return [path.name for path in checkpoint_folders(run_dir) if CHECKPOINT_RE.match(path.name)]

    def fetch(self, folder: str) -> str:
        return folder

    def remove(self, folder: str) -> None:
        remove_checkpoint(folder)

    def put_files(self, folder: str, paths: list[str]) -> None:
        return None

    def rotate(self, run_dir: str, save_total_limit: int | None, best: str | None) -> None:
        rotate_checkpoints(run_dir, save_total_limit, best)

    def round(self) -> str | None:
        return None  # the processes share the folder: nothing to upload together

    def store(self, folder: str, run_dir: str, limit: int | None, best: str | None, background: bool = False,
              peers: Any = None, round: str | None = None) -> None:  # fmt: skip
        self.rotate(run_dir, limit, best)

    def release(self, peers: Any, round: str | None, cause: str) -> None:
        return None

    def store_part(self, folder: str, peers: Any, round: str | None) -> None:
        return None

    def wait(self, timeout_s: float | None = None) -> None:
        return None

    def settle(self) -> list[str]:
        return []
