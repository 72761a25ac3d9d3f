"""``checkpoint-N`` folders: HF-loadable model files plus everything needed to continue exactly, written so that a
checkpoint is complete or does not exist, and removed so that no reader ever sees one half-deleted.

Writing (:func:`save_checkpoint`): every file goes into ``.tmp-checkpoint-N``; ``checkpoint_manifest.json`` (each
file with its size and checksum, and the arguments that fix the data position; see ``hflight.checkpoints.manifest``) is
written last; then the folder is renamed to ``checkpoint-N``. Re-saving an existing ``checkpoint-N`` moves the old
folder aside (``.tmp-checkpoint-N.replaced``), renames the new one in and only then deletes the old one. Removing a
checkpoint (rotation, the end of training) renames it aside (``.tmp-checkpoint-N.deleting``) before deleting
anything in it. A process killed at any point therefore leaves ``checkpoint-N`` either complete (old or new) or
absent, never partial; leftover ``.tmp-checkpoint-*`` folders are removed when the next training starts
(:func:`remove_stale_folders`). A write that fails (full disk, permissions, I/O) raises one
:class:`CheckpointWriteError` naming the folder, the file and the cause, and leaves the earlier checkpoints as they
were.

Reading is ``hflight.checkpoints.manifest``'s (:func:`verify_checkpoint`, :func:`get_last_checkpoint`, re-exported
here).

Folder contents: the parts in ``hflight.checkpoints.parts`` (transformers' names, so folders written by either
trainer resume in both), and ``checkpoint_manifest.json`` (hflight's own).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import SaveStrategy, sort_checkpoints
from transformers.utils import logging as hf_logging

from hflight._util import exception_chain
from hflight.checkpoints.files import IncompleteCheckpointError
from hflight.checkpoints.manifest import (
    CHECKPOINT_RE,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    MANIFEST_VERSION,
    PREFIX,
    TMP_PREFIX,
    Checksums,
    get_last_checkpoint,
    read_manifest,
    verify_checkpoint,
    write_manifest,
)
from hflight.checkpoints.parts import TRAINER_STATE_NAME, write_trainer_state, write_training_states
from hflight.checkpoints.sharded import NotGathered
from hflight.checkpoints.weights import WEIGHT_FILES
from hflight.surface import RunView, TrainerSurface

logger = logging.getLogger(__name__)
_hf_logger = hf_logging.get_logger("transformers.trainer")  # transformers' own console line, as its Trainer writes it

__all__ = [
    "CHECKPOINT_RE", "MANIFEST_FORMAT", "MANIFEST_NAME", "MANIFEST_VERSION", "PREFIX", "TMP_PREFIX",
    "TRAINER_STATE_NAME", "WEIGHT_FILES", "CheckpointWriteError", "IncompleteCheckpointError", "get_last_checkpoint",
    "read_manifest", "remove_checkpoint", "save_checkpoint", "verify_checkpoint", "write_manifest",
]  # fmt: skip

REPLACED_SUFFIX = ".replaced"
DELETING_SUFFIX = ".deleting"
# The arguments that decide which examples a resumed run sees next and how global steps map onto batches.
RUN_ARGUMENTS = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "world_size",
    "num_nodes",
    "seed",
    "data_seed",
    "train_sampling_strategy",
    "dataloader_drop_last",
    "num_examples",
)


# ---- removing ------------------------------------------------------------------------------------------------------
def _saving_checkpoint(folder: str) -> None:
    _hf_logger.info(f"Saving model checkpoint to {folder}")


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


def remove_stale_folders(output_dir: str | os.PathLike, keep: str | None = None) -> list[str]:
    """Delete the ``.tmp-checkpoint-*`` folders an interrupted save or deletion left in ``output_dir`` (except
    ``keep``)."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    removed = []
    keep_path = Path(keep).resolve() if keep else None
    for path in sorted(folder.glob(f"{TMP_PREFIX}{PREFIX}-*")):
        if path.is_dir() and path.resolve() != keep_path:
            shutil.rmtree(path, ignore_errors=True)
            logger.warning(f"Removed {path}: left behind by a checkpoint save or deletion that was interrupted.")
            removed.append(str(path))
    return removed


def clean_output_dir(args: Any, resume_folder: str | None) -> None:
    """On the processes that write checkpoints (``args.should_save``), when training starts: delete the
    ``.tmp-checkpoint-*`` folders interrupted saves left (not ``resume_folder``, the checkpoint being resumed)."""
    if args.should_save:
        remove_stale_folders(args.output_dir, keep=resume_folder)


def rotate_checkpoints(output_dir: str, save_total_limit: int | None, best_model_checkpoint: str | None) -> None:
    """transformers' rotation (keep at most ``save_total_limit`` checkpoints, never the newest nor the best),
    removing each folder with :func:`remove_checkpoint`."""
    if save_total_limit is None or save_total_limit <= 0:
        return
    checkpoints = sort_checkpoints(output_dir, PREFIX, use_mtime=False)
    if len(checkpoints) <= save_total_limit:
        return
    protected = {os.path.realpath(checkpoints[-1])}  # the newest, to resume from
    if best_model_checkpoint is not None:
        protected.add(os.path.realpath(best_model_checkpoint))
    remaining = len(checkpoints)
    for folder in checkpoints:
        if remaining <= max(save_total_limit, len(protected)):
            break
        if os.path.realpath(folder) not in protected:
            remove_checkpoint(folder)
            remaining -= 1


# ---- write errors --------------------------------------------------------------------------------------------------
class CheckpointWriteError(OSError):
    """Writing a checkpoint (or the model) failed: the message names the folder, the file and the cause."""


# What an error's text says when it carries no errno (safetensors' Rust errors, torch's C++ writer).
_CAUSE_TEXTS = (
    ("No space left on device", "no space left on device"),
    ("StorageFull", "no space left on device"),
    ("Disk quota exceeded", "disk quota exceeded"),
    ("Permission denied", "permission denied"),
    ("Read-only file system", "read-only file system"),
    ("Input/output error", "input/output error"),
)
# torch's zip writer reports a failed write as "[enforce fail at inline_container.cc:...] unexpected pos ..." or
# "basic_ios::clear: iostream error", without the operating system's reason.
_WRITE_FAILURE = re.compile(r"inline_container|iostream|PytorchStreamWriter|file write failed|I/O error|IoError")
_NEARLY_FULL = 1 << 20


def _existing_dir(path: str) -> str:
    while path and not os.path.isdir(path):
        path = os.path.dirname(path)
    return path or "."


def write_failure_cause(exc: BaseException, folder: str) -> str | None:
    """Why writing into ``folder`` failed ("no space left on device", "permission denied", ...), or None when
    ``exc`` is not a write failure (a bug elsewhere is not disguised as one)."""
    chain = list(exception_chain(exc))
    code = next((e.errno for e in chain if isinstance(e, OSError) and e.errno), None)
    if code is not None:
        return os.strerror(code).lower()
    text = " ".join(str(e) for e in chain)
    cause = next((cause for marker, cause in _CAUSE_TEXTS if marker in text), None)
    if cause is not None:
        return cause
    if not any(isinstance(e, OSError) for e in chain) and not _WRITE_FAILURE.search(text):
        return None
    where = _existing_dir(folder)
    if shutil.disk_usage(where).free < _NEARLY_FULL:
        return os.strerror(errno.ENOSPC).lower()
    if not os.access(where, os.W_OK):
        return os.strerror(errno.EACCES).lower()
    first_line = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return f"I/O error ({type(exc).__name__}: {first_line})"


class WriteTracker:
    """The file being written into ``folder`` (None: whichever ``save_pretrained`` was writing, found afterwards)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.file: str | None = None

    def failed_file(self, exc: BaseException) -> str:
        named = next((e.filename for e in exception_chain(exc) if isinstance(e, OSError) and e.filename), None)
        if named:
            return os.path.relpath(os.fspath(named), self.folder) if os.path.isabs(os.fspath(named)) else named
        if self.file is not None:
            return self.file
        written = [p for p in Path(self.folder).rglob("*") if p.is_file()] if os.path.isdir(self.folder) else []
        if not written:
            return "its first file"
        return max(written, key=lambda p: p.stat().st_mtime_ns).relative_to(self.folder).as_posix()


_WRITING: list[WriteTracker] = []  # the writes in progress in this process, outermost first


@contextlib.contextmanager
def writing(folder: str, what: str, discard: bool) -> Iterator[WriteTracker]:
    """Turn a failed write into ``folder`` into one :class:`CheckpointWriteError` naming ``what`` (the checkpoint or
    model being saved), the file and the cause; ``discard``: delete the unfinished ``folder`` first. Inside another
    ``writing`` (``save_model`` called by a checkpoint's write) the outer one reports the failure."""
    if _WRITING:
        yield _WRITING[-1]
        return
    tracker = WriteTracker(folder)
    _WRITING.append(tracker)
    try:
        yield tracker
    except Exception as exc:
        cause = write_failure_cause(exc, folder)
        if cause is None:
            raise
        file = tracker.failed_file(exc)
        if discard:
            shutil.rmtree(folder, ignore_errors=True)
        after = (
            f" The unfinished folder was removed; the checkpoints already in {os.path.dirname(folder) or '.'} are "
            "unchanged."
            if discard
            else ""
        )
        raise CheckpointWriteError(f"Could not save {what}: writing {file} failed: {cause}.{after}") from exc
    finally:
        _WRITING.pop()


# ---- writing -------------------------------------------------------------------------------------------------------


def save_model(facade: TrainerSurface, output_dir: str, backend: Any) -> None:
    """``Trainer.save_model`` (every process calls it, as in transformers): the host weights made current
    (``backend``: the strategy's hooks; a checkpoint's write, which calls this, made them current before it began),
    a sharded model's whole state dict gathered (collective), then, on the main process, the model files and the
    backend's own files (a failed write raises :class:`CheckpointWriteError`)."""
    if not _WRITING:
        backend.hf_sync_to_host()
    form = backend.hf_checkpoint_state()
    try:
        state_dict = form.full_model_state(facade.model)
    except NotGathered as not_gathered:  # transformers' way: the run's own checkpoint form, and no weights file
        _hf_logger.warning(str(not_gathered))
        _save_without_weights(facade, form, output_dir)
        return
    if facade.args.should_save:
        _saving_checkpoint(output_dir)
        with writing(output_dir, f"the model in {output_dir}", discard=False):
            if state_dict is None:
                facade._save(output_dir)
            else:
                facade._save(output_dir, state_dict=state_dict)
            backend.hf_save_files(output_dir)


def _save_without_weights(facade: TrainerSurface, form: Any, output_dir: str) -> None:
    """``save_model`` of a run whose weights are not gathered: the config, processing class and arguments, and the
    run's checkpoint form (every process writes its partition) with its script to rebuild the weights."""
    if facade.args.should_save:
        with writing(output_dir, f"the model in {output_dir}", discard=False):
            facade._save(output_dir, state_dict={})
            for name in WEIGHT_FILES:  # the empty weights file save_pretrained wrote
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(output_dir, name))
    form.write(output_dir, facade.model, facade.optimizer, facade.args.should_save)


def run_arguments(args: Any, world_size: int, plan: Any, num_nodes: int | None = None) -> dict[str, Any]:
    """The values of :data:`RUN_ARGUMENTS` for the running ``train()`` (recorded in the manifest); ``plan`` is the
    run's ``TrainingPlan`` (None before the fit planned it); ``num_nodes``: the nodes the run spans (the arguments'
    when not given)."""
    values = {name: getattr(args, name, None) for name in RUN_ARGUMENTS}
    strategy = args.train_sampling_strategy
    values["train_sampling_strategy"] = str(getattr(strategy, "value", strategy))
    values["world_size"] = world_size
    values["num_nodes"] = num_nodes if num_nodes is not None else getattr(args, "num_nodes", 1)
    values["num_examples"] = plan.num_examples if plan is not None else None
    return values


def save_checkpoint(facade: TrainerSurface, run: RunView, trial: Any = None) -> str:
    """Write ``checkpoint-{global_step}`` atomically into ``facade._get_output_dir(trial)``, update the best
    checkpoint, rotate old ones. The model files are ``facade.save_model``'s, as in transformers.

    Raises:
        CheckpointWriteError: a write failed (full disk, permissions, I/O); the unfinished folder is removed and the
            earlier checkpoints are as they were.
    """
    args, state, world = facade.args, facade.state, run.world
    facade.store_flos()
    run_dir = facade._get_output_dir(trial)
    name = f"{PREFIX}-{state.global_step}"
    final_dir = os.path.join(run_dir, name)
    tmp_dir = os.path.join(run_dir, f"{TMP_PREFIX}{name}")
    is_main = args.should_save  # the main process; with save_on_each_node, the main process of each node
    if is_main:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    run.backend.hf_sync_to_host()
    with (
        writing(tmp_dir, f"checkpoint {final_dir}", discard=is_main) as tracker,
        Checksums() as checksums,
        final_path_in_logs(tmp_dir, final_dir),
    ):
        if is_main:
            os.makedirs(tmp_dir, exist_ok=True)
        world.barrier()  # the folder exists for every process
        if not args.save_only_model:
            # The largest file first: its checksum is computed (in the background) while the model is written.
            write_training_states(facade, run, tracker, is_main)
        if is_main:
            checksums.add_new(tmp_dir)
            tracker.file = None  # save_pretrained's files: found afterwards if one fails
        if run.backend.hf_checkpoint_state().with_model_files:
            _write_model_files(facade, run, tmp_dir, is_main)  # every process: a sharded model is gathered first
        if is_main:
            checksums.add_new(tmp_dir)
        _update_best_checkpoint(args, state, run_dir)
        progress = run.loop.progress() if run.loop is not None else None  # every rank: their running losses
        world.barrier()
        if is_main:
            write_trainer_state(facade, tracker)
            tracker.file = MANIFEST_NAME
            run_args = run_arguments(args, world.size, run.plan, run.lightning_trainer.num_nodes)
            write_manifest(tmp_dir, state.global_step, bool(args.save_only_model), run_args, checksums, progress)
        # Every writer's folder is complete before any is published (save_on_each_node: one writer per node, each on
        # its own disk): a writer whose peer died mid-write fails here instead of publishing a checkpoint the other
        # nodes lack, so the nodes' last checkpoints agree.
        world.barrier()
        if is_main:
            publish(tmp_dir, final_dir)
    if is_main:
        rotate_checkpoints(run_dir, args.save_total_limit, state.best_model_checkpoint)
    world.barrier()
    return final_dir


class _FinalPathInLogs(logging.Filter):
    def __init__(self, tmp_dir: str, final_dir: str) -> None:
        super().__init__()
        self.tmp_dir, self.final_dir = tmp_dir, final_dir

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self.tmp_dir in message:
            record.msg, record.args = message.replace(self.tmp_dir, self.final_dir), ()
        return True


@contextlib.contextmanager
def final_path_in_logs(tmp_dir: str, final_dir: str) -> Iterator[None]:
    """While a checkpoint is written into its temporary folder, the messages of transformers' and hflight's loggers
    ("Model weights saved in ...", "Configuration saved in ...") name the folder the checkpoint will have, as
    transformers' (which writes in place) do."""
    rewrite = _FinalPathInLogs(tmp_dir, final_dir)
    loggers = [
        found
        for name, found in list(logging.root.manager.loggerDict.items())
        if isinstance(found, logging.Logger) and name.split(".")[0] in ("transformers", "hflight")
    ]
    for each in loggers:
        each.addFilter(rewrite)
    try:
        yield
    finally:
        for each in loggers:
            each.removeFilter(rewrite)


def _update_best_checkpoint(args: Any, state: TrainerState, run_dir: str) -> None:
    if args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) and state.best_global_step:
        best_dir = os.path.join(run_dir, f"{PREFIX}-{state.best_global_step}")
        if state.best_global_step == state.global_step or os.path.exists(best_dir):
            state.best_model_checkpoint = best_dir


def _write_model_files(facade: TrainerSurface, run: RunView, folder: str, is_main: bool) -> None:
    """The model (with the weights evaluation uses) and the backend's files, through ``save_model`` (every process:
    it gathers a sharded model, the main process writes), and the weight-protocol callbacks' files (main process;
    the host weights are current)."""
    with run.evaluation_weights():
        facade.save_model(folder, _internal_call=True)  # the backend's files too
    if is_main:
        for callback in run.weight_hooks("save_checkpoint_state"):
            callback.save_checkpoint_state(folder, facade.model)


def publish(tmp_dir: str, final_dir: str) -> None:
    """Rename the complete ``tmp_dir`` to ``final_dir``; an existing ``final_dir`` is deleted only afterwards."""
    replaced = os.path.join(os.path.dirname(final_dir), f"{TMP_PREFIX}{os.path.basename(final_dir)}{REPLACED_SUFFIX}")
    if os.path.exists(final_dir):
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final_dir, replaced)
    os.replace(tmp_dir, final_dir)
    shutil.rmtree(replaced, ignore_errors=True)


# ---- best model -------------------------------------------------------------------------------------------------


def finalize_rotation(args: Any, state: TrainerState, run_dir: str) -> None:
    """With ``save_total_limit=1`` and a best checkpoint, HF keeps only the best one of ``run_dir`` at the end (main
    process)."""
    if not (args.should_save and state.best_model_checkpoint and args.save_total_limit == 1):
        return
    for folder in Path(run_dir).glob(f"{PREFIX}-*"):
        if folder.is_dir() and not os.path.samefile(folder, state.best_model_checkpoint):
            remove_checkpoint(folder)
