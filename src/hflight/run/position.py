"""Where the training data is, for a checkpoint, and where a resumed run's data starts.

A checkpoint records the training loader's position after the last cycle it trained (``data_position.pt``, see
``hflight.checkpoints.data_position``): each prepared loader (``hflight.run.loaders``) answers ``position()`` after
every batch it yields (a copy: the loader reads on), the accumulation cycles carry the position of their last batch on
its micro-batch (the loader, Lightning and ``get_batch_samples`` read ahead of what trains), and the loop keeps the
position of the cycle whose optimizer step it took (:meth:`DataTracker.trained`).

**The rule.** A resumed run trains exactly the examples the uninterrupted run trains, in the same order, wherever
transformers' own resume does. :func:`start_of` is the one place that decides how a resumed run takes its data up:

- ``position``: a stream continues from the state the checkpoint recorded, only where that is exact for the pipeline
  at hand (nothing already trained is read again);
- ``read``: the trained batches are read and dropped, as transformers does (with a progress bar naming
  ``ignore_data_skip``), with one line saying why the position is not used: the checkpoint has none, or it does not
  fit this run (another dataset, loader kind, batch size, workers, processes, a file of another step), or it is not
  exact for this pipeline (a stream without a state of its own, a shuffle buffer, a state a checkpoint file cannot
  hold);
- ``sampler``: a map-style dataset skips its trained batches by its sampler alone (no sample is read), transformers'
  arithmetic;
- ``start``: ``ignore_data_skip=True``, the epoch's data from its beginning, as in transformers.

Nothing is refused here: transformers resumes every one of these runs (a file that is damaged or not a position is
refused where it is read, ``hflight.checkpoints.data_position.read``, as every checkpoint file).

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
    """Where a run's data starts: in pass ``epoch``, after its first ``batches`` (micro-)batches, taken up as ``how``
    says (``position``: from ``state``, a stream's loader state; ``read``: read and dropped, ``why``; ``sampler``: by
    the sampler alone; ``start``: from the pass's beginning)."""

    epoch: int
    batches: int = 0
    state: Any = None
    how: str = "start"
    #: why the trained batches are read and dropped rather than continued from the checkpoint's position
    why: str = ""
    #: the checkpoint's position file (named by an error its loader's ``load_state_dict`` raises)
    source: str = ""

    @property
    def reading(self) -> bool:
        return self.how == "read" and self.batches > 0

    @property
    def restored(self) -> bool:
        return self.how == "position"


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
    trained (:meth:`trained`), with what the checkpoint file says of this process's dataset and of the loader."""

    def __init__(self, loader: Any, dataset: Any, processes: int) -> None:
        self.tracked = callable(getattr(loader, "position", None))
        iterated = getattr(loader, "positioned", None)
        self.dataset = data_position.describe(dataset, iterated) if self.tracked else None
        self.loader = loader_description(loader, processes)
        self.last: dict[str, Any] | None = None
        #: why this run's stream states are not kept (a state a checkpoint file cannot hold), found at the first step
        self.why: str | None = None
        self._checked = False

    def trained(self, position: dict[str, Any] | None) -> None:
        """The optimizer step of a cycle whose last batch was at ``position`` (the micro-batch's) was taken."""
        if position is None:
            return
        if not self._checked and position.get("state") is not None:
            self._checked = True
            self.why = data_position.unstorable(position["state"])
            if self.why is not None:
                logger.warning(
                    f"The training stream's position cannot be kept in its checkpoints: {self.why}. A resumed run "
                    "reads and drops the trained batches instead, as transformers does."
                )
        self.last = dict(position, state=None) if self.why is not None else position

    def record(self) -> dict[str, Any] | None:
        """This process's entry for the checkpoint (None: its loader reports no position, or nothing trained yet)."""
        if not self.tracked or self.last is None:
            return None
        return {**self.last, "dataset": self.dataset["fingerprint"]}


def start_of(saved: dict[str, Any] | None, loader: Any, arithmetic: tuple[int, int], ignore_data_skip: bool,
             world: tuple[int, int], path: str, global_step: int,
             described: dict[str, Any] | None) -> Start:  # fmt: skip
    """Where a resumed run's data starts, and how it is taken up (the module's rule). ``saved``: the checkpoint's data
    position (None: it has none); ``arithmetic``: (epochs trained, batches to skip) as transformers computes them from
    ``global_step``, the checkpoint's; ``world``: (data-parallel replicas, this process's replica); ``described``:
    this run's training dataset as :func:`hflight.checkpoints.data_position.describe` gives it (its tracker's)."""
    epochs, batches = arithmetic
    how = getattr(loader, "how", None)
    if ignore_data_skip:
        return Start(epochs)
    if how in (None, "sampler"):  # transformers' arithmetic, also for a stream's position in its place
        return Start(epochs, batches, how="sampler")
    if saved is None:
        return Start(epochs, batches, how="read", why="the checkpoint holds no data position")
    if saved.get("global_step") != global_step:
        why = (f"{path} records step {saved.get('global_step')} and the checkpoint is at step {global_step}: it is "
               "not this checkpoint's")  # fmt: skip
        return Start(epochs, batches, how="read", why=why)
    entry = _entry(saved, world, path)
    misfit = _misfit(saved, loader, world)
    problem = misfit or _inexact(saved, loader, described, world, entry)
    if problem is None:
        if entry["end_of_pass"]:
            return Start(entry["epoch"] + 1, how="position", source=path)
        return Start(entry["epoch"], entry["batches"], entry.get("state"), how="position", source=path)
    if misfit is not None or entry is None:  # the saved bookkeeping counts other batches: transformers' arithmetic
        return Start(epochs, batches, how="read", why=problem)
    if entry["end_of_pass"]:
        return Start(entry["epoch"] + 1, how="read", why=problem)
    return Start(entry["epoch"], entry["batches"], how="read", why=problem)


def _entry(saved: dict[str, Any], world: tuple[int, int], path: str) -> dict[str, Any] | None:
    """This process's entry of the saved position: its own (as many processes), or for a stream dispatched from
    process 0 on another number of processes, process 0's with the pass's batches in this run's global batches
    (None: a per-process position saved by another number of processes)."""
    ranks = saved["ranks"]
    if len(ranks) == world[0]:
        return ranks[world[1]]
    if saved["loader"].get("how") != "dispatched":
        return None
    if world[1] == 0:
        logger.info(
            f"{path}: the stream was read by process 0 of {len(ranks)} and dispatched; process 0 of {world[0]} "
            "continues it from the same example (global batches of this run's size from there)."
        )
    return dict(ranks[0], batches=_global_batches(saved["loader"], ranks[0]["batches"], world[0]))


def _misfit(saved: dict[str, Any], loader: Any, world: tuple[int, int]) -> str | None:
    """Why the saved position's batches are not this run's (another kind of loader, batch size, or number of
    processes each reading its own part), or None."""
    was, now = saved["loader"], loader_description(loader, world[0])
    kinds = {"sampler": "a map-style dataset's sampler", "dispatched": "a stream process 0 reads and dispatches "
             "(dispatch_batches)", "per_process": "a stream each process reads its own part of"}  # fmt: skip
    if was.get("how") != now["how"]:
        return (f"the position was saved for {kinds.get(was.get('how'), was.get('how'))} and this run reads "
                f"{kinds.get(now['how'], now['how'])}")  # fmt: skip
    if was.get("batch_size") != now["batch_size"]:
        return (f"the position counts batches of {was.get('batch_size')} examples and this run reads batches of "
                f"{now['batch_size']} (per_device_train_batch_size)")  # fmt: skip
    if now["how"] == "per_process" and len(saved["ranks"]) != world[0]:
        return (f"the position was saved by {len(saved['ranks'])} process(es) each reading its own part of the stream "
                f"and this run has {world[0]}")  # fmt: skip
    return None


def _inexact(saved: dict[str, Any], loader: Any, described: dict[str, Any] | None, world: tuple[int, int],
             entry: dict[str, Any] | None) -> str | None:  # fmt: skip
    """Why continuing from the saved state would not train the uninterrupted run's examples, or None."""
    was, now = saved["loader"], loader_description(loader, world[0])
    reads = now["how"] == "per_process" or world[1] == 0
    description = data_position.saved_description(saved, world[1] if now["how"] == "per_process" else 0)
    if reads and described is not None:
        if "stateful" not in description:
            return (
                "the position was saved by an earlier hflight, whose description of the dataset this one does not read"
            )
        differs = data_position.difference(description, described)
        if differs is not None:
            return f"the position was saved for another training dataset ({differs})"
    if was.get("num_workers") != now["num_workers"]:
        return (f"the position holds the states of {was.get('num_workers')} loader workers (each reading its own part "
                f"of the stream) and this run has dataloader_num_workers={now['num_workers']}")  # fmt: skip
    if saved.get("why"):
        return f"the position is not exact: {saved['why']}"
    if description.get("shuffle_buffer"):
        return ("the stream shuffles through a buffer (IterableDataset.shuffle(buffer_size=...)) whose content no "
                "position holds")  # fmt: skip
    if description.get("stateful") is False:
        return ("the stream has no state of its own (state_dict()/load_state_dict()): its position is only a count of "
                "what was read")  # fmt: skip
    if reads and entry is not None and entry.get("state") is None and not entry["end_of_pass"]:
        return f"the position holds no stream state for process {world[1]}"
    return None


def _global_batches(loader: dict[str, Any], batches: int, processes: int) -> int:
    """The global batches of a pass of ``processes`` that hold the examples ``batches`` global batches of the saved
    run held (a dispatched stream: process 0 read ``batch_size`` examples ``processes`` times per global batch, once
    with ``split_batches``); the count is the epoch's bookkeeping, the stream's state says where its data is."""
    if loader.get("split_batches"):
        return batches
    return batches * loader["processes"] // processes


def describe_start(start: Start, folder: str, step: int) -> str:
    """The one line that says what a resumed run continues from: the checkpoint, the step, and how the data is taken
    up (from its position, read and dropped and why, by the sampler, or started over)."""
    head = f"Continuing training from {folder} at global step {step}: "
    if start.restored:
        where = (
            f"pass {start.epoch}, {start.batches} batches in" if start.batches else f"the start of pass {start.epoch}"
        )
        return head + f"the training data continues from its position ({where}); nothing already trained is read again."
    if start.reading:
        return head + (f"reading and dropping the {start.batches} batches of pass {start.epoch} trained before it, as "
                       f"transformers does: {start.why} (ignore_data_skip=True starts the pass's data over "
                       "instead).")  # fmt: skip
    if start.how == "read":
        return head + f"the data continues with pass {start.epoch} ({start.why})."
    if start.how == "sampler" and start.batches:
        return head + (f"the sampler skips the {start.batches} batches of epoch {start.epoch} trained before it (their "
                       "samples are not read).")  # fmt: skip
    if start.how == "sampler":
        return head + f"epoch {start.epoch} begins."
    return head + f"the data of epoch {start.epoch} starts over (ignore_data_skip=True)."
