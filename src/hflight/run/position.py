"""Where the training data is, for a checkpoint, and where a resumed run's data starts.

A checkpoint records the training loader's position after the last cycle it trained (``data_position.pt``, see
``hflight.checkpoints.data_position``): each prepared loader (``hflight.run.loaders``) answers ``position()`` after
every batch it yields, the accumulation cycles carry the position of their last batch on its micro-batch (the loader,
Lightning and ``get_batch_samples`` read ahead of what trains), and the loop keeps the position of the cycle whose
optimizer step it took (:meth:`DataTracker.trained`).

A resumed run (:func:`start_of`) continues from it:

- a map-style dataset skips the trained batches of its epoch by its sampler alone (the indices are drawn, no sample is
  read): the epoch and the batch count are transformers' arithmetic, also from a checkpoint without a position;
- a stream (an iterable dataset: torchdata's ``StatefulDataLoader`` under the prepared loader) loads the state the
  checkpoint recorded, each process its own (dispatched: process 0's), in the pass the checkpoint was in: nothing
  already trained is read again;
- a stream resumed from a checkpoint without a position (transformers', an older hflight's) reads and drops the
  trained batches, as transformers does, with a progress bar naming ``ignore_data_skip``;
- ``ignore_data_skip=True``: the epoch's data starts from its beginning, as in transformers.

A dispatched stream continues on another number of processes: process 0 alone reads it, and its position is where
that reader is in the stream, whatever the processes it dispatched to. What does not fit (another kind of loader,
another ``dataloader_num_workers`` or batch size for a stream, another number of processes for a stream each process
reads its own part of) is refused before any step, naming both sides and ``ignore_data_skip``.

May import: ``hflight.checkpoints.data_position``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from hflight.checkpoints import data_position

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Start:
    """Where a run's data starts: in pass ``epoch``, after its first ``batches`` (micro-)batches, continued from
    ``state`` (a stream's loader state), or by ``reading`` them (a stream with no recorded position), or by the sampler
    alone (map-style)."""

    epoch: int
    batches: int = 0
    state: Any = None
    reading: bool = False
    #: what the console says of it
    restored: bool = False
    #: the checkpoint's position file (named by an error its loader's ``load_state_dict`` raises)
    source: str = ""


def loader_description(loader: Any, processes: int) -> dict[str, Any]:
    """How the training loader reads its data, as a position is tied to it."""
    return {
        "how": getattr(loader, "how", None),
        "num_workers": int(getattr(loader, "num_workers", 0) or 0),
        "batch_size": getattr(loader, "batch_size", None),
        "processes": processes,
        "split_batches": bool(getattr(getattr(loader, "sharding", None), "split_batches", False)),
    }


class DataTracker:
    """The training loader's position for the next checkpoint: the position after the last cycle this process
    trained (:meth:`trained`), with what the checkpoint file says of the dataset and the loader."""

    def __init__(self, loader: Any, dataset: Any, processes: int) -> None:
        self.tracked = callable(getattr(loader, "position", None))
        self.dataset = data_position.describe(dataset) if self.tracked else None
        self.loader = loader_description(loader, processes)
        self.last: dict[str, Any] | None = None

    def trained(self, position: dict[str, Any] | None) -> None:
        """The optimizer step of a cycle whose last batch was at ``position`` (the micro-batch's) was taken."""
        if position is not None:
            self.last = position

    def record(self) -> dict[str, Any] | None:
        """This process's entry for the checkpoint (None: its loader reports no position, or nothing trained yet)."""
        return self.last if self.tracked else None


def start_of(saved: dict[str, Any] | None, loader: Any, arithmetic: tuple[int, int], ignore_data_skip: bool,
             world: tuple[int, int], path: str) -> Start:  # fmt: skip
    """Where a resumed run's data starts. ``saved``: the checkpoint's data position (None: it has none);
    ``arithmetic``: (epochs trained, batches to skip) as transformers computes them from the global step; ``world``:
    (processes, this process's rank). Raises ``ValueError`` where the position does not fit this run's loader."""
    epochs, batches = arithmetic
    how = getattr(loader, "how", None)
    if ignore_data_skip:
        return Start(epochs)
    if saved is not None and how is not None:
        _check_fits(saved, loader, world, path)
    if how in (None, "sampler") or saved is None:  # the sampler's skip; or a stream without a position: read it
        return Start(epochs, batches, reading=how not in (None, "sampler") and batches > 0)
    if saved["dataset"].get("shuffle_buffer") and world[1] == 0:
        logger.warning(
            f"{path}: the training stream shuffles through a buffer (IterableDataset.shuffle(buffer_size=...)), whose "
            "content a position does not hold: datasets fills it again from the stream's position, so the examples "
            "of the next buffer come in another order than in the uninterrupted run (docs/checkpoints.md, 'The data "
            "position')."
        )
    ranks = saved["ranks"]
    if len(ranks) == world[0]:
        entry = ranks[world[1]]
    else:  # a dispatched stream on another number of processes: process 0's position, the pass's batches anew
        entry = dict(ranks[0], batches=_global_batches(saved["loader"], ranks[0]["batches"], world[0]))
        if world[1] == 0:
            logger.info(
                f"{path}: the stream was read by process 0 of {len(ranks)} and dispatched; process 0 of {world[0]} "
                "continues it from the same example (global batches of this run's size from there)."
            )
    if entry["end_of_pass"]:
        return Start(entry["epoch"] + 1, restored=True, source=path)
    return Start(entry["epoch"], entry["batches"], entry.get("state"), restored=True, source=path)


def _check_fits(saved: dict[str, Any], loader: Any, world: tuple[int, int], path: str) -> None:
    """The saved position continues in this run's loader: the same kind; for a stream, the same workers and batch
    size, and for a stream each process reads its own part of, the same processes (a map-style dataset's sampler
    continues on any: transformers' arithmetic; a dispatched stream's reader is process 0 on any)."""
    was, now = saved["loader"], loader_description(loader, world[0])
    kinds = {"sampler": "a map-style dataset's sampler", "dispatched": "a stream process 0 reads and dispatches "
             "(dispatch_batches)", "per_process": "a stream each process reads its own part of"}  # fmt: skip
    if was.get("how") != now["how"]:
        raise ValueError(
            f"{path}: the data position was saved for {kinds.get(was.get('how'), was.get('how'))}; this run reads "
            f"{kinds.get(now['how'], now['how'])}. A position continues only in the same kind of loader: use the "
            "checkpoint's dataset and accelerator_config['dispatch_batches'], or set ignore_data_skip=True."
        )
    if now["how"] == "sampler":
        return
    if was.get("num_workers") != now["num_workers"]:
        raise ValueError(
            f"{path}: the data position holds the positions of {was.get('num_workers')} loader workers "
            f"(dataloader_num_workers={was.get('num_workers')}, each reading its own part of the stream); this run "
            f"has dataloader_num_workers={now['num_workers']}. Set dataloader_num_workers={was.get('num_workers')} "
            "to continue exactly, or ignore_data_skip=True to start the data over."
        )
    # again with the launched processes: the check when the checkpoint was read counted those planned before
    # Lightning's own launch (hflight.checkpoints.resume), done there so that it comes before the dataset's
    data_position.check_processes(saved, world[0], path)
    if was.get("batch_size") != now["batch_size"]:
        raise ValueError(
            f"{path}: the data position counts batches of {was.get('batch_size')} examples read from the stream; this "
            f"run reads batches of {now['batch_size']} (per_device_train_batch_size). Resume with "
            f"per_device_train_batch_size={was.get('batch_size')}, or set ignore_data_skip=True to start the data over."
        )


def _global_batches(loader: dict[str, Any], batches: int, processes: int) -> int:
    """The global batches of a pass of ``processes`` that hold the examples ``batches`` global batches of the saved
    run held (a dispatched stream: process 0 read ``batch_size`` examples ``processes`` times per global batch, once
    with ``split_batches``); the count is the epoch's bookkeeping, the stream's state says where its data is."""
    if loader.get("split_batches"):
        return batches
    return batches * loader["processes"] // processes


def rejected(start: Start, exc: Exception) -> ValueError:
    """The error of a loader that does not take the checkpoint's position (its dataset's ``load_state_dict`` refused
    it), before any step."""
    return ValueError(
        f"{start.source}: the training loader does not take the data position saved there: its dataset refused it "
        f"({type(exc).__name__}: {exc}). Resume with the dataset and loader settings of the checkpoint, or set "
        "ignore_data_skip=True to start the data over."
    )


def describe_start(start: Start, folder: str) -> str:
    """The console's line for where the data continues."""
    if start.restored:
        return (f"  Continuing the training data where {folder} left it (pass {start.epoch}, {start.batches} batches "
                "in): nothing already trained is read again.")  # fmt: skip
    if start.reading:
        return (f"  Reading and dropping the {start.batches} batches trained before the checkpoint ({folder} holds no "
                "data position; ignore_data_skip=True starts the epoch's data over instead).")  # fmt: skip
    return ""
