"""Resuming from a ``checkpoint-N`` folder: everything is checked before the model is touched, nothing is unpickled
beyond plain tensors and the RNG states' numpy arrays.

Order of :func:`resolve_resume`: the folder is complete and undamaged (its manifest's sizes and checksums, see
``hflight.checkpoints.manifest``), its ``trainer_state.json`` is valid (types, required keys, finite numbers, a best
checkpoint inside ``output_dir`` or the resumed run's folder), its weights fit the model (keys and shapes), its RNG,
optimizer, scheduler and scaler files load safely and fit what they will be loaded into
(``hflight.checkpoints.optim_state``: the optimizer and scheduler the run will build), stateful callbacks can be
rebuilt from their saved arguments; only then are weights copied in. Once Lightning has built the optimizer, the loop
positions the run (:func:`resumed_state`) (and warns about every argument that changes the data position or the step
arithmetic), ``parts.restore_optimizer`` and
``parts.load_rng_state`` restore the rest. Every error names the file (and the key) at fault. Files are read only
through ``hflight.checkpoints.writers.files.regular_file`` (no path outside the folder, no named pipe or device), RNG
files only by the names the run that wrote the checkpoint used.

Security: checkpoints are shared and downloaded, so no file in one may run code. ``optimizer.pt``, ``scheduler.pt``,
``scaler.pt`` and ``.bin`` weights load with ``torch.load(weights_only=True)``; ``rng_state*.pth`` does too, with
exactly the numpy objects a ``numpy.random.get_state()`` tuple needs allowlisted (as transformers does).
``training_args.bin`` is written for transformers' sake and never read.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import compare_trainer_and_checkpoint_args

from hflight._util import is_remote
from hflight.checkpoints import data_position
from hflight.checkpoints.folders import RUN_ARGUMENTS, run_arguments
from hflight.checkpoints.forms import found_form, resume_refusal
from hflight.checkpoints.manifest import checkpoint_folders, get_last_checkpoint, verify_checkpoint
from hflight.checkpoints.names import (
    CHECKPOINT_RE,
    MANIFEST_NAME,
    OPTIMIZER_NAME,
    SCHEDULER_NAME,
    TRAINER_STATE_NAME,
)
from hflight.checkpoints.parts import read_trainer_state, read_training_states, rebuilt_callbacks
from hflight.checkpoints.storage import ObjectStorage, storage_for
from hflight.checkpoints.weights import checked_weights, load_model_weights
from hflight.checkpoints.writers.files import IncompleteCheckpointError, UnsafeCheckpointFile, inside, regular_file
from hflight.surface import RunView, TrainerSurface, weight_hooks

logger = logging.getLogger(__name__)

#: where a checkpoint named by a URL outside the run's own remote_output_dir is downloaded, inside output_dir
FETCHED = ".hflight-fetched"


@dataclass
class ResumePoint:
    """A verified checkpoint folder: its trainer state, its manifest (None for transformers' folders), whether it
    holds the model only (``save_only_model``: no optimizer, scheduler or RNG state), and the optimizer, scheduler
    and scaler states read from it (applied once Lightning has built those objects)."""

    folder: str
    state: TrainerState
    manifest: dict[str, Any] | None
    model_only: bool
    training_states: dict[str, Any] = field(default_factory=dict)
    #: With ``restore_callback_states_from_checkpoint``: (callback in use, callback rebuilt from its saved state).
    rebuilt_callbacks: list[tuple[Any, Any]] = field(default_factory=list)
    #: Chosen by ``resume_from_checkpoint="auto"``: the run continues as if it had not stopped (the loss logged before
    #: the checkpoint counts in the next logged loss and in ``train_loss``, from the manifest's ``loss`` record).
    continued: bool = False
    #: Where the training data was (``hflight.checkpoints.data_position``; None: the folder records no position).
    data_position: dict[str, Any] | None = None


# ---- trainer_state.json ---------------------------------------------------------------------------------------------


# ---- choosing and checking the folder -----------------------------------------------------------------------------
#: ``train(resume_from_checkpoint=AUTO)``: the last valid checkpoint of ``output_dir`` if there is one, else a fresh
#: start (hflight's; transformers' ``True`` raises when there is none).
AUTO = "auto"


def requested(resume_from_checkpoint: str | bool | None, args: Any) -> str | bool | None:
    """What ``train(resume_from_checkpoint=...)`` asks for: the argument only (``False``: no resume, as None). As in
    transformers, ``args.resume_from_checkpoint`` is for scripts (the CLI passes it); the Trainer never reads it."""
    if resume_from_checkpoint is False:
        return None
    return resume_from_checkpoint


def resolve_resume(facade: TrainerSurface, resume: str | bool | None) -> ResumePoint | None:
    """The checkpoint to resume from (``True``: the last complete one in ``output_dir``; ``"auto"``: the last one that
    passes every check of its files, or None for a fresh start), checked, with its weights loaded into
    ``facade.model``. Nothing is copied into the model unless every check passed."""
    if resume is None:
        return None
    storage = storage_for(facade.args)
    if is_remote(resume):  # a stored checkpoint named by its URL: downloaded, then checked as a local one
        resume = fetch_url(facade.args, resume)
    elif resume == AUTO and not os.path.isdir(AUTO):
        return _resolve_auto(facade)
    if resume is True:
        found = _stored_last(facade.args) if storage.remote else get_last_checkpoint(facade.args.output_dir)
        if found is None:
            where = storage.where(facade.args.output_dir)
            raise ValueError(f"No valid checkpoint found in output directory ({where})")
        resume = found
    folder = Path(resume)
    if not folder.is_dir():
        raise ValueError(f"Can't find a valid checkpoint at {resume}")  # transformers' words: scripts match on them
    return _resume_from(facade, folder, verify_checkpoint(folder, full=True))


def _stored_last(args: Any) -> str | None:
    """The newest checkpoint of a run whose output_dir is an object store's staging folder (:func:`_remote_candidates`),
    made ready to load (downloaded, or a local copy the store lacks, adopted for its upload)."""
    candidates = _remote_candidates(args)
    return _take(args, *candidates[0], candidates) if candidates else None


def _remote_candidates(args: Any) -> list[tuple[Path, bool]]:
    """The checkpoints a run on an object store can resume from, newest first, each with whether it is stored: the
    store's complete ones (their manifest stored), and the complete local ones of the staging folder that the store
    lacks (a run that could not upload them: they are as good as transformers' local checkpoints)."""
    storage, output_dir = storage_for(args), args.output_dir
    stored = set(storage.complete(output_dir))
    local = {path.name for path in checkpoint_folders(output_dir) if (path / MANIFEST_NAME).is_file()}
    names = sorted(stored | local, key=lambda name: _step(Path(name)), reverse=True)
    return [(Path(output_dir, name), name in stored) for name in names]


def _take(args: Any, folder: Path, stored: bool, candidates: list[tuple[Path, bool]]) -> str:
    """``folder`` ready to load: downloaded when stored (a local copy that passes every check is kept), else the local
    copy, checked (before anything is adopted: a damaged copy is never uploaded). The complete local checkpoints up to
    it that the store lacks are adopted by the storage (uploaded with the run's next checkpoint, kept locally until
    then)."""
    storage = storage_for(args)
    if stored:
        storage.fetch(str(folder))
    else:
        verify_checkpoint(folder, full=True)
        logger.warning(f"{folder} is not in {storage.where(str(folder))}; resuming from the local copy, which is "
                       "uploaded with the run's next checkpoint.")  # fmt: skip
    step = _step(folder)
    for other, other_stored in reversed(candidates):  # oldest first, as they are uploaded
        if not other_stored and _step(other) <= step:
            try:
                verify_checkpoint(other)
            except (IncompleteCheckpointError, UnsafeCheckpointFile) as exc:
                logger.warning(f"{other} is not in {storage.where(str(other))} and is not uploaded: {exc}")
                continue
            storage.adopt(str(other))
    return str(folder)


def _step(folder: Path) -> int:
    return int(CHECKPOINT_RE.match(folder.name).group(1))


def fetch_url(args: Any, url: str) -> str:
    """A checkpoint named by its URL (``s3://bucket/run/checkpoint-40``), downloaded: into the run's staging folder
    when it is one of the run's own (under ``remote_output_dir``), else into ``output_dir/.hflight-fetched/``."""
    url = url.rstrip("/")
    storage = storage_for(args)
    if storage.remote and url.startswith(f"{args.remote_output_dir}/"):
        relative = url[len(args.remote_output_dir) + 1 :]
        return storage.fetch(os.path.join(args.output_dir, *relative.split("/")))
    parent, _, name = url.rpartition("/")
    protocol, _, path = parent.partition("://")
    staging = os.path.join(args.output_dir, FETCHED, protocol, *[p for p in path.split("/") if p not in ("", "..")])
    options = getattr(args, "storage_options", None) or {}
    return ObjectStorage(parent, staging, options).fetch(os.path.join(staging, name))


def _resolve_auto(facade: TrainerSurface) -> ResumePoint | None:
    """``resume_from_checkpoint="auto"``: the newest ``checkpoint-N`` of ``output_dir`` whose files are complete and
    undamaged (sizes and checksums; the broken ones are skipped, each with a warning naming what is wrong), or None,
    said out loud, when there is none. Other faults of the chosen folder (weights that do not fit the model, say)
    raise as for an explicit path: an older checkpoint would not fit either."""
    output_dir = facade.args.output_dir
    storage = storage_for(facade.args)
    if storage.remote:
        found = _remote_candidates(facade.args)
        candidates, stored = [folder for folder, _ in found], dict(found)
        output_dir = storage.where(output_dir)
    else:
        candidates, stored = checkpoint_folders(output_dir), {}
    for folder in candidates:
        try:
            if storage.remote:
                _take(facade.args, folder, stored[folder], found)
            manifest = verify_checkpoint(folder, full=True)
        except (IncompleteCheckpointError, UnsafeCheckpointFile) as exc:
            logger.warning(f"resume_from_checkpoint='auto': skipping {folder.name}: {exc}")
            continue
        logger.warning(
            f"resume_from_checkpoint='auto': resuming from {folder}, the last valid checkpoint of {output_dir}."
        )
        point = _resume_from(facade, folder, manifest)
        point.continued = True
        return point
    broken = f" ({len(candidates)} checkpoint folder(s) there, none complete and undamaged)" if candidates else ""
    logger.warning(f"resume_from_checkpoint='auto': no valid checkpoint in {output_dir}{broken}; starting fresh.")
    return None


def _resume_from(facade: TrainerSurface, folder: Path, manifest: dict[str, Any] | None) -> ResumePoint:
    """The rest of the checks of ``folder`` (its files verified already: ``manifest``), then its weights loaded."""
    state = read_trainer_state(
        regular_file(folder, TRAINER_STATE_NAME) or folder / TRAINER_STATE_NAME, type(facade.state)
    )
    where = folder / TRAINER_STATE_NAME
    best = state.best_model_checkpoint
    if best is not None and storage_for(facade.args).remote and not inside(best, facade.args.output_dir):
        name = os.path.basename(os.path.normpath(best))  # recorded by a machine whose staging folder was elsewhere
        if CHECKPOINT_RE.match(name):
            state.best_model_checkpoint = os.path.join(os.path.dirname(os.path.normpath(folder)), name)
    _fetch_best(facade.args, state.best_model_checkpoint)
    state.best_model_checkpoint = check_best_checkpoint(
        state.best_model_checkpoint, facade.args.output_dir, where, folder
    )
    model_only = _is_model_only(folder, manifest)
    written = None if model_only else found_form(folder)
    refusal = resume_refusal(facade.args, facade.model, written, folder) if written is not None else None
    if refusal is not None:  # an optimizer this run cannot convert: refused before anything is loaded
        raise ValueError(refusal)
    engine_reads = written is not None and written.engine is not None
    if not engine_reads:  # DeepSpeed's engine restores the weights with the optimizer, once it is built
        checked_weights(facade.model, folder)  # refused here, before anything changes, if they do not fit
    training_states = {} if model_only else read_training_states(facade, folder, manifest, state)
    position = None if model_only or facade.args.ignore_data_skip else data_position.read(folder)
    rebuilt = rebuilt_callbacks(facade, state, where)
    callbacks = facade.callback_handler.callbacks
    for callback in weight_hooks(callbacks, "check_checkpoint_state"):
        callback.check_checkpoint_state(str(folder), facade.model)
    if not engine_reads:
        facade._load_from_checkpoint(str(folder))  # transformers' override point; hflight's loads the checked weights
    for callback in weight_hooks(callbacks, "load_checkpoint_state"):
        callback.load_checkpoint_state(str(folder), facade.model)
    if model_only:
        logger.warning(
            f"Checkpoint {folder} holds the model weights and trainer state but no optimizer, scheduler or RNG state "
            "(saved with save_only_model=True). Resuming as transformers.Trainer does: from global step "
            f"{state.global_step} with a fresh optimizer and learning-rate schedule; reproducibility is not "
            "guaranteed."
        )
    return ResumePoint(str(folder), state, manifest, model_only, training_states, rebuilt, data_position=position)


def _fetch_best(args: Any, best: str | None) -> None:
    """On a machine that never had it, the resumed run's best checkpoint, downloaded from the store (the resumed run
    protects it from rotation and loads it at the end, as on the machine that wrote it)."""
    storage = storage_for(args)
    if not storage.remote or best is None or os.path.isdir(best) or not inside(best, args.output_dir):
        return
    if os.path.basename(os.path.normpath(best)) in storage.complete(os.path.dirname(os.path.normpath(best))):
        storage.fetch(best)


def check_best_checkpoint(
    best: str | None, output_dir: str, source: Path | str, resumed: str | os.PathLike | None = None
) -> str | None:
    """The best checkpoint to use (its weights are loaded at the end of training); ``source``: where the path was
    read, for messages; ``resumed``: the checkpoint folder the run continues from, if any.

    As transformers carries it over, a best checkpoint recorded by the resumed run stays where it is: a path inside
    ``output_dir``, or a ``checkpoint-N`` folder of the resumed checkpoint's own run folder (a sweep's retry, a copied
    run, ``resume_from_checkpoint=<a folder elsewhere>``: the run continues in its new ``output_dir`` and loads that
    best model at the end unless it finds a better one). A recorded path outside both whose folder name is a
    checkpoint of that run folder (``output_dir`` without ``resumed``) is taken from there, with a warning: the run
    folder was copied or moved. Any other path that does not exist is returned as it is (the resumed run warns and
    ignores it, as transformers does); any other existing one is an error: a crafted ``trainer_state.json`` does not
    make hflight load weights from elsewhere.
    """
    if best is None or inside(best, output_dir):
        return best
    run = os.path.dirname(os.path.normpath(resumed)) if resumed is not None else output_dir
    name = os.path.basename(os.path.normpath(best))
    if CHECKPOINT_RE.match(name) and os.path.realpath(os.path.dirname(os.path.normpath(best))) == os.path.realpath(run):
        return best  # a checkpoint of the resumed run's own folder
    here = os.path.join(run, name)
    if CHECKPOINT_RE.match(name) and os.path.isdir(here):
        logger.warning(
            f"{source}: best_model_checkpoint {best!r} lies outside output_dir and outside the run folder of the "
            f"checkpoint (the run folder was copied or moved?); using {here} instead."
        )
        return here
    if not os.path.isdir(best):
        return best
    beside = f" and outside {run}, the run folder of the checkpoint resumed" if resumed is not None else ""
    raise ValueError(
        f"{source}: best_model_checkpoint {best!r} lies outside output_dir ({output_dir}){beside}; hflight loads a "
        "best model only from a checkpoint of the run's own output_dir or of the run it continues. Resume with "
        "output_dir set to the folder that holds it, or set best_model_checkpoint to null in the file."
    )


def _is_model_only(folder: Path, manifest: dict[str, Any] | None) -> bool:
    if manifest is not None:
        return bool(manifest.get("save_only_model"))
    # A transformers.Trainer folder: optimizer and scheduler come as a pair, or not at all (save_only_model).
    present = {OPTIMIZER_NAME: found_form(folder) is not None, SCHEDULER_NAME: regular_file(folder, SCHEDULER_NAME)
               is not None}  # fmt: skip
    if len(set(present.values())) > 1:
        have = next(n for n, p in present.items() if p)
        lack = next(n for n, p in present.items() if not p)
        raise IncompleteCheckpointError(
            f"Checkpoint {folder} has {have} but no {lack}: it is incomplete (interrupted while saving?)."
        )
    return not any(present.values())


# ---- positioning the run -------------------------------------------------------------------------------------------
def resumed_state(
    facade: TrainerSurface, point: ResumePoint, world_size: int, plan: Any, num_nodes: int | None = None
) -> TrainerState:
    """The checkpoint's ``TrainerState`` for the run being started (``facade.state``: its fresh state): the
    checkpoint's progress with this run's cadence and batch size, a vanished best checkpoint dropped, the callbacks'
    saved states restored into the facade's callbacks; warns when the run's arguments differ from the checkpoint's."""
    fresh, state = facade.state, point.state
    compare_trainer_and_checkpoint_args(facade.args, state)  # transformers' warning, in its words
    _warn_changed_arguments(facade, point, run_arguments(facade.args, world_size, plan, num_nodes))
    # HF keeps the checkpoint's logging/eval/save steps; the arguments of the run being started win here.
    for name in ("logging_steps", "eval_steps", "save_steps", "train_batch_size"):
        setattr(state, name, getattr(fresh, name))
    if state.best_model_checkpoint is not None and not os.path.isdir(state.best_model_checkpoint):
        logger.warning(
            f"The best checkpoint {state.best_model_checkpoint} recorded in {point.folder} does not exist anymore. "
            "Ignoring it for this run."
        )
        state.best_model_checkpoint = None
    return state


def _warn_changed_arguments(facade: TrainerSurface, point: ResumePoint, now: dict[str, Any]) -> None:
    if point.manifest is not None:
        before = point.manifest.get("run") or {}
    elif point.state.train_batch_size is not None:  # transformers records only the batch size (per process here)
        before = {"per_device_train_batch_size": point.state.train_batch_size}
    else:
        before = {}
    changed = [
        f"\t{name}: {now[name]!r} (now) != {before[name]!r} (checkpoint)"
        for name in RUN_ARGUMENTS
        if name in before and before[name] != now[name]
    ]
    cadence = [
        f"\t{name}: {getattr(facade.state, name)!r} (now) != {getattr(point.state, name)!r} (checkpoint)"
        for name in ("logging_steps", "eval_steps", "save_steps")
        if getattr(point.state, name) != getattr(facade.state, name)
    ]
    if changed:
        logger.warning(
            f"Resuming from {point.folder} with arguments that change the data position or the step arithmetic:\n"
            + "\n".join(changed)
            + f"\nThe run continues at global step {point.state.global_step} with the new values, so the examples it "
            "sees next, its epoch count and its results differ from the run that wrote the checkpoint."
        )
    if cadence:
        logger.warning(
            f"Resuming from {point.folder}: this run's logging/evaluation/saving cadence is used, not the "
            "checkpoint's:\n" + "\n".join(cadence)
        )


# ---- stateful callbacks (ExportableState) ---------------------------------------------------------------------------


# ---- optimizer, scheduler, scaler ----------------------------------------------------------------------------------


# ---- RNG states -----------------------------------------------------------------------------------------------------


# ---- best model -----------------------------------------------------------------------------------------------------
def load_best_model(facade: TrainerSurface, run: RunView | None = None) -> None:
    """``load_best_model_at_end``: the best checkpoint's weights (single file or shards), checked first: inside
    ``output_dir`` or a checkpoint of the run folder ``run`` resumed from (see :func:`check_best_checkpoint`), the
    model files' sizes and checksums as saved, keys and shapes as the model's."""
    resumed = run.resume.folder if run is not None and run.resume is not None else None
    state = facade.state
    best = check_best_checkpoint(state.best_model_checkpoint, facade.args.output_dir, "TrainerState", resumed)
    storage = storage_for(facade.args)
    if storage.remote and best is not None and not os.path.isdir(best) and inside(best, facade.args.output_dir):
        storage.fetch(best)  # resumed on a machine that never had it: downloaded from the store
    verify_checkpoint(best, full=True, model_files_only=True)
    form = found_form(best) if run is not None else None
    if form is not None and form.engine is not None:  # the engine reads its own, as transformers'
        run.backend.hf_checkpoint_state().restore(Path(best), module_only=True)
        return
    load_model_weights(facade.model, best, resuming=False)
