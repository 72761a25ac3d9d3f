"""What a run made in its folder (generated data, a trained tokenizer), reused when the same recipe asks again.

A run of the mrc recipe writes its synthetic data (``data/``) and trains its tokenizer (``tokenizer/``) into its run
folder. A restarted run (``resume=auto``, torchrun's ``--max-restarts``, a requeued SLURM job) must train on exactly
what its checkpoints were trained on, so each maker records what made its files (``.hflight-made.json``: the
arguments, and for a tokenizer a digest of the texts it learnt from) and, asked again with the same recipe, reuses
the files as they are instead of making them again (which would also race with the other processes of the job
reading them). Asked with another recipe, it makes them anew, or, when the run resumes from a checkpoint, refuses,
naming what differs: a checkpoint trained on other data or another vocabulary does not fit the new files.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from hflight import durable

logger = logging.getLogger(__name__)

__all__ = ["RECORD_NAME", "reusable", "save_in_place", "write_record"]

#: The record a maker leaves beside its files.
RECORD_NAME = ".hflight-made.json"


def _read(folder: Path) -> dict[str, Any] | None:
    try:
        record = json.loads((folder / RECORD_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def reusable(
    folder: str | os.PathLike, recipe: Mapping[str, Any], files: Iterable[str], what: str, resuming: bool
) -> bool:
    """Whether ``folder`` holds ``files`` made from ``recipe`` (a JSON-able mapping): reuse them. False: make them
    (then :func:`write_record`).

    Raises:
        ValueError: ``resuming``, and the folder holds ``what`` made from another recipe (the message names each
            differing key, with both values).
    """
    folder = Path(folder)
    names = list(files)
    if not all((folder / name).is_file() for name in names):
        return False
    made = _read(folder)
    wanted = json.loads(json.dumps(dict(recipe)))  # the form the record holds (tuples as lists, ...)
    if made is None:
        if resuming:  # files from before records existed: the checkpoint was trained on them
            logger.warning(f"Reusing {what} in {folder} (no record of how it was made): the run resumes on it.")
            return True
        return False
    if made.get("recipe") == wanted:
        logger.info(f"Reusing {what} in {folder}: made by the same recipe.")
        return True
    before = made.get("recipe") or {}
    changes = [f"{key}: {before.get(key)!r} there, {wanted.get(key)!r} now" for key in sorted({*before, *wanted})
               if before.get(key) != wanted.get(key)]  # fmt: skip
    if resuming:
        raise ValueError(
            f"{folder} holds {what} made with other settings ({'; '.join(changes)}), and this run resumes from a "
            "checkpoint trained on it: it must keep them. Resume with the settings of the run (or start a new run "
            "in another folder)."
        )
    logger.warning(f"Replacing {what} in {folder}, made with other settings ({'; '.join(changes)}).")
    return False


def write_record(folder: str | os.PathLike, recipe: Mapping[str, Any]) -> None:
    """Record ``recipe`` as what made the files of ``folder`` (written whole: processes of one job race here)."""
    text = json.dumps({"recipe": dict(recipe)}, indent=1, sort_keys=True) + "\n"
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{RECORD_NAME}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        durable.replace_file(tmp, Path(folder) / RECORD_NAME)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_in_place(folder: str | os.PathLike, save: Callable[[str], Any]) -> None:
    """The files ``save(staging)`` writes, put into ``folder`` each whole and durable: saved in a private folder
    inside it, then each renamed into place (processes launched together, torchrun's, make the same files in the same
    folder, and none may load another's half-written file)."""
    with tempfile.TemporaryDirectory(dir=folder, prefix=".staging-") as staging:
        save(staging)
        for name in sorted(os.listdir(staging)):
            durable.replace_file(os.path.join(staging, name), Path(folder) / name)
