"""Resuming from a ``checkpoint-N`` folder: everything is checked before the model is touched, nothing is unpickled
beyond plain tensors and the RNG states' numpy arrays.

Order of :func:`resolve_resume`: the folder is complete and undamaged (its manifest's sizes and checksums, see
``hflight.manifest``), its ``trainer_state.json`` is valid (types, required keys, finite numbers, a best checkpoint
inside ``output_dir``), its weights fit the model (keys and shapes), its RNG, optimizer, scheduler and scaler files
load safely and fit what they will be loaded into (``hflight.optim_state``: the optimizer and scheduler the run will
build), stateful callbacks can be rebuilt from their saved arguments; only then are weights copied in. Once
Lightning has built the optimizer, :func:`restore_state` positions the run (and warns about every argument that
changes the data position or the step arithmetic), :func:`restore_optimizer` and :func:`load_rng_state` restore the
rest. Every error names the file (and the key) at fault. Files are read only through
``hflight.manifest.regular_file`` (no path outside the folder, no named pipe or device), RNG files only by the names
the run that wrote the checkpoint used.

Security: checkpoints are shared and downloaded, so no file in one may run code. ``optimizer.pt``, ``scheduler.pt``,
``scaler.pt`` and ``.bin`` weights load with ``torch.load(weights_only=True)``; ``rng_state*.pth`` does too, with
exactly the numpy objects a ``numpy.random.get_state()`` tuple needs allowlisted (as transformers does).
``training_args.bin`` is written for transformers' sake and never read.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pickle
import random
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers.trainer_callback import ExportableState, TrainerState

from hflight.callbacks.hooks import weight_hooks
from hflight.checkpoints.folders import (
    OPTIMIZER_NAME,
    RUN_ARGUMENTS,
    SCALER_NAME,
    SCHEDULER_NAME,
    TRAINER_STATE_NAME,
    IncompleteCheckpointError,
    get_last_checkpoint,
    rng_file_name,
    run_arguments,
    verify_checkpoint,
)
from hflight.checkpoints.manifest import CHECKPOINT_RE, inside, regular_file
from hflight.checkpoints.optim_state import check_training_states, planned_optimizer, planned_scheduler
from hflight.checkpoints.weights import UnsafeCheckpointFile, checked_weights, load_model_weights, refused_pickle
from hflight.surface import RunView, TrainerSurface

logger = logging.getLogger(__name__)


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


# ---- trainer_state.json ---------------------------------------------------------------------------------------------
_NUMBER = (int, float)
# Field -> accepted JSON types (None: null allowed). Every transformers version since 4.0 writes the required ones.
_STATE_FIELDS: dict[str, tuple[Any, ...]] = {
    "epoch": (*_NUMBER, None),
    "global_step": (int,),
    "max_steps": (int,),
    "logging_steps": _NUMBER,
    "eval_steps": _NUMBER,
    "save_steps": _NUMBER,
    "train_batch_size": (int, None),
    "num_train_epochs": _NUMBER,
    "num_input_tokens_seen": _NUMBER,
    "total_flos": _NUMBER,
    "log_history": (list,),
    "best_metric": (*_NUMBER, None),
    "best_global_step": (int, None),
    "best_model_checkpoint": (str, None),
    "is_local_process_zero": (bool,),
    "is_world_process_zero": (bool,),
    "is_hyper_param_search": (bool,),
    "trial_name": (str, None),
    "trial_params": (dict, None),
    "stateful_callbacks": (dict, None),
}
_REQUIRED_STATE = ("global_step", "epoch", "max_steps", "log_history")
_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true/false", str: "a string", list: "a list",
               dict: "an object", None: "null"}  # fmt: skip


def _type_ok(value: Any, accepted: tuple[Any, ...]) -> bool:
    if value is None:
        return None in accepted
    if isinstance(value, bool):  # JSON true/false are not numbers here
        return bool in accepted
    return any(t is not None and isinstance(value, t) for t in accepted)


def read_trainer_state(path: str | os.PathLike, state_class: type[TrainerState] = TrainerState) -> TrainerState:
    """A ``state_class`` (``TrainerState`` or a subclass with fields of its own, such as ``IPUTrainerState``) from
    ``path`` after checking JSON syntax, required keys and the type of every known key.

    Raises:
        ValueError: naming the file and the key (unknown keys are dropped with a warning instead).
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object (a TrainerState), not {type(data).__name__}.")
    missing = [key for key in _REQUIRED_STATE if key not in data]
    if missing:
        raise ValueError(f"{path} lacks the key(s) {', '.join(repr(k) for k in missing)} of a TrainerState.")
    for key, value in data.items():
        accepted = _STATE_FIELDS.get(key)
        if accepted is not None and not _type_ok(value, accepted):
            wanted = " or ".join(_TYPE_NAMES.get(t, "a number") for t in dict.fromkeys(accepted))
            raise ValueError(f"{path}: key {key!r} must be {wanted}, got {json.dumps(value)[:80]}.")
    if data["global_step"] < 0 or data["max_steps"] < 0:
        raise ValueError(f"{path}: 'global_step' and 'max_steps' must not be negative.")
    _check_finite(path, data)
    bad = next((i for i, entry in enumerate(data["log_history"]) if not isinstance(entry, dict)), None)
    if bad is not None:
        raise ValueError(f"{path}: 'log_history' entry {bad} must be an object.")
    for name, entry in (data.get("stateful_callbacks") or {}).items():
        entries = entry if isinstance(entry, list) else [entry]
        if not all(
            isinstance(e, dict) and isinstance(e.get("attributes", {}), dict) and isinstance(e.get("args", {}), dict)
            for e in entries
        ):
            raise ValueError(
                f"{path}: 'stateful_callbacks'[{name!r}] must be an object with 'args' and 'attributes' objects."
            )
    own = {f.name for f in fields(state_class)} - {f.name for f in fields(TrainerState)}  # a subclass's fields
    known = set(_STATE_FIELDS) | own
    unknown = [key for key in data if key not in known]
    if unknown:
        logger.warning(f"{path}: ignoring key(s) this TrainerState does not know: {', '.join(unknown)}.")
    return state_class(**{k: v for k, v in data.items() if k in known})


def _check_finite(path: Path, data: dict[str, Any]) -> None:
    """The state's numbers must be finite (``epoch: NaN``, ``best_metric: Infinity`` are errors). transformers'
    starting point for ``best_metric`` (-inf or +inf until an evaluation improves on it, so with no
    ``best_global_step``) means "no best yet" and is read as null."""
    best = data.get("best_metric")
    if isinstance(best, float) and math.isinf(best) and data.get("best_global_step") is None:
        data["best_metric"] = None
    for key, value in data.items():
        if key in _STATE_FIELDS and isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{path}: key {key!r} must be a finite number, got {json.dumps(value)}.")


# ---- choosing and checking the folder -----------------------------------------------------------------------------
def requested(resume_from_checkpoint: str | bool | None, args: Any) -> str | bool | None:
    """What ``train(resume_from_checkpoint=...)`` asks for: the argument, else ``args.resume_from_checkpoint``
    (``False`` means no resume, as None)."""
    if resume_from_checkpoint is False:
        resume_from_checkpoint = None
    if resume_from_checkpoint is None and args.resume_from_checkpoint:
        return args.resume_from_checkpoint
    return resume_from_checkpoint


def resolve_resume(facade: TrainerSurface, resume: str | bool | None) -> ResumePoint | None:
    """The checkpoint to resume from (``True``: the last complete one in ``output_dir``), checked, with its weights
    loaded into ``facade.model``. Nothing is copied into the model unless every check passed."""
    if resume is None:
        return None
    if resume is True:
        found = get_last_checkpoint(facade.args.output_dir)
        if found is None:
            raise ValueError(f"No valid checkpoint found in output directory ({facade.args.output_dir})")
        resume = found
    folder = Path(resume)
    if not folder.is_dir():
        raise ValueError(f"Can't find a valid checkpoint at {resume}")  # transformers' words: scripts match on them
    manifest = verify_checkpoint(folder, full=True)
    state = read_trainer_state(
        regular_file(folder, TRAINER_STATE_NAME) or folder / TRAINER_STATE_NAME, type(facade.state)
    )
    where = folder / TRAINER_STATE_NAME
    state.best_model_checkpoint = check_best_checkpoint(state.best_model_checkpoint, facade.args.output_dir, where)
    model_only = _is_model_only(folder, manifest)
    checked_weights(facade.model, folder)  # refused here, before anything changes, if they do not fit
    training_states = {} if model_only else _read_training_states(facade, folder, manifest, state)
    rebuilt = _rebuilt_callbacks(facade, state, where)
    callbacks = facade.callback_handler.callbacks
    for callback in weight_hooks(callbacks, "check_checkpoint_state"):
        callback.check_checkpoint_state(str(folder), facade.model)
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
    return ResumePoint(str(folder), state, manifest, model_only, training_states, rebuilt)


def check_best_checkpoint(best: str | None, output_dir: str, source: Path | str) -> str | None:
    """The best checkpoint to use, inside ``output_dir`` (its weights are loaded at the end of training); ``source``:
    where the path was read, for messages.

    A recorded path outside ``output_dir`` whose folder name exists inside it (the run folder was copied or moved)
    is taken from ``output_dir``, with a warning; one that does not exist is returned as it is (the resumed run
    warns and ignores it, as transformers does); any other path outside ``output_dir`` is an error.
    """
    if best is None or inside(best, output_dir) or not os.path.isdir(best):
        return best
    here = os.path.join(output_dir, os.path.basename(os.path.normpath(best)))
    if CHECKPOINT_RE.match(os.path.basename(here)) and os.path.isdir(here):
        logger.warning(
            f"{source}: best_model_checkpoint {best!r} lies outside output_dir (the run folder was copied or moved?); "
            f"using {here} instead."
        )
        return here
    raise ValueError(
        f"{source}: best_model_checkpoint {best!r} lies outside output_dir ({output_dir}); hflight loads a best model "
        "only from a checkpoint of the run's own output_dir. Resume with output_dir set to the folder that holds it, "
        "or set best_model_checkpoint to null in the file."
    )


_RNG_RE = re.compile(r"^rng_state(?:_(\d+))?\.pth$")


def _rng_files(folder: Path, manifest: dict[str, Any] | None) -> list[Path]:
    """The RNG files of the checkpoint, by the names the run that wrote it used: for an hflight folder those its
    manifest lists for its number of processes; for a transformers folder ``rng_state.pth``/``rng_state_{rank}.pth``
    (each must be a regular file)."""
    if manifest is not None:
        world = (manifest.get("run") or {}).get("world_size") or 1
        world = world if type(world) is int else 1
        expected = [name for name in manifest["files"] if _written_for(name, world)]
    else:
        expected = sorted(n for n in os.listdir(folder) if _RNG_RE.match(n))
    return [path for name in expected if (path := regular_file(folder, name)) is not None]


def _written_for(name: str, world: int) -> bool:
    """Whether ``name`` is an RNG file a run of ``world`` processes writes."""
    match = _RNG_RE.match(name)
    if match is None:
        return False
    rank = match.group(1)
    return rank is None if world <= 1 else rank is not None and int(rank) < world


def _read_training_states(
    facade: TrainerSurface, folder: Path, manifest: dict[str, Any] | None, state: TrainerState
) -> dict[str, Any]:
    """RNG, optimizer, scheduler and scaler files, loaded safely and checked against the optimizer and scheduler the
    run will build (before anything is copied anywhere)."""
    for rng_file in _rng_files(folder, manifest):
        load_rng_file(rng_file)  # a crafted file is rejected here, before anything changes
    names = (OPTIMIZER_NAME, SCHEDULER_NAME, SCALER_NAME)
    states = {name: _load_tensors_file(path) for name in names if (path := regular_file(folder, name)) is not None}
    optimizer = planned_optimizer(facade)
    targets = {OPTIMIZER_NAME: optimizer}
    if SCHEDULER_NAME in states:
        targets[SCHEDULER_NAME] = planned_scheduler(facade, optimizer, state.max_steps)
    check_training_states(folder, states, targets, parameter_names(facade.model))
    return states


def parameter_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def _is_model_only(folder: Path, manifest: dict[str, Any] | None) -> bool:
    if manifest is not None:
        return bool(manifest.get("save_only_model"))
    # A transformers.Trainer folder: optimizer and scheduler come as a pair, or not at all (save_only_model).
    present = {name: regular_file(folder, name) is not None for name in (OPTIMIZER_NAME, SCHEDULER_NAME)}
    if len(set(present.values())) > 1:
        have = next(n for n, p in present.items() if p)
        lack = next(n for n, p in present.items() if not p)
        raise IncompleteCheckpointError(
            f"Checkpoint {folder} has {have} but no {lack}: it is incomplete (interrupted while saving?)."
        )
    return not any(present.values())


# ---- positioning the run -------------------------------------------------------------------------------------------
def resumed_state(facade: TrainerSurface, point: ResumePoint, world_size: int, plan: Any) -> TrainerState:
    """The checkpoint's ``TrainerState`` for the run being started (``facade.state``: its fresh state): the
    checkpoint's progress with this run's cadence and batch size, a vanished best checkpoint dropped, the callbacks'
    saved states restored into the facade's callbacks; warns when the run's arguments differ from the checkpoint's."""
    fresh, state = facade.state, point.state
    _warn_changed_arguments(facade, point, run_arguments(facade.args, world_size, plan))
    # HF keeps the checkpoint's logging/eval/save steps; the arguments of the run being started win here.
    for name in ("logging_steps", "eval_steps", "save_steps", "train_batch_size"):
        setattr(state, name, getattr(fresh, name))
    if state.best_model_checkpoint is not None and not os.path.isdir(state.best_model_checkpoint):
        logger.warning(
            f"The best checkpoint {state.best_model_checkpoint} recorded in {point.folder} does not exist anymore. "
            "Ignoring it for this run."
        )
        state.best_model_checkpoint = None
    _restore_callback_states(facade, point, state)
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
def _saved_states(state: TrainerState, callbacks: list[Any]) -> tuple[list[tuple[Any, dict]], list[str]]:
    """Pairs (callback in use, its saved state): the saved states of one class go to the callbacks of that class in
    order (several instances are saved as a list, as transformers does); and the saved classes no callback has.

    transformers appends the current states to that list at every save, after the states the callbacks had when
    training started, and reads back the first entries; the *last* entries are the states at the save, so those are
    the ones used here (hflight writes exactly one entry per instance)."""
    pairs, not_found = [], []
    for name, data in (state.stateful_callbacks or {}).items():
        entries = data if isinstance(data, list) else [data]
        matching = [cb for cb in callbacks if type(cb).__name__ == name]
        if not matching:
            not_found.append(name)
            continue
        pairs += [(callback, entry) for callback, entry in zip(matching, entries[-len(matching) :]) if entry]
    return pairs, not_found


def _rebuilt_callbacks(facade: TrainerSurface, state: TrainerState, source: Path) -> list[tuple[Any, Any]]:
    """With ``restore_callback_states_from_checkpoint=True``, transformers' way: each stateful callback rebuilt from
    its saved ``args`` and ``attributes`` (built here, before anything is loaded, so bad ``args`` change nothing);
    a warning names the saved states that match no callback."""
    if not facade.args.restore_callback_states_from_checkpoint:
        return []
    pairs, not_found = _saved_states(state, facade.callback_handler.callbacks + [facade.control])
    if not_found:
        logger.warning(
            f"Checkpoint included callbacks not included in current configuration. Ignoring. ({', '.join(not_found)})"
        )
    rebuilt = []
    for callback, entry in pairs:
        try:
            new = type(callback)(**entry.get("args", {}))
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"{source}: 'stateful_callbacks' cannot rebuild {type(callback).__name__} from its saved args "
                f"{entry.get('args', {})}: {exc}"
            ) from exc
        for key, value in entry.get("attributes", {}).items():
            setattr(new, key, value)
        rebuilt.append((callback, new))
    return rebuilt


def _restore_callback_states(facade: TrainerSurface, point: ResumePoint, state: TrainerState) -> None:
    """The callbacks rebuilt from the checkpoint take the place of those in use (the same position in the list;
    ``TrainerControl`` becomes ``facade.control``); by default (hflight's), the saved attributes are set on the
    callbacks in use, so that, e.g., an ``EarlyStoppingCallback``'s patience counter survives a resume."""
    if facade.args.restore_callback_states_from_checkpoint:
        callbacks = facade.callback_handler.callbacks
        for old, new in point.rebuilt_callbacks:
            if old is facade.control:
                facade.control = new
            for i in [i for i, cb in enumerate(callbacks) if cb is old]:
                callbacks[i] = new
        if point.rebuilt_callbacks:
            logger.info("Continuing training from checkpoint, restoring any callbacks that were passed in")
        return
    pairs, _ = _saved_states(state, facade.callback_handler.callbacks + [facade.control])
    for callback, entry in pairs:
        if isinstance(callback, ExportableState):
            for key, value in entry.get("attributes", {}).items():
                setattr(callback, key, value)


# ---- optimizer, scheduler, scaler ----------------------------------------------------------------------------------
def _failure(path: Path, exc: BaseException) -> str:
    if path.is_file() and path.stat().st_size == 0:
        return "the file is empty (0 bytes)"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else f"{type(exc).__name__} (truncated or not written by torch.save)"


def _load_tensors_file(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise refused_pickle(path, exc, "tensors and plain values") from None
    except Exception as exc:
        raise ValueError(f"Cannot restore {path}: {_failure(path, exc)}") from exc


def restore_optimizer(facade: TrainerSurface, run: RunView) -> None:
    """Optimizer, scheduler and scaler states, once Lightning built them (HF file names): checked against the real
    objects (they were checked against the planned ones before the weights were loaded), then loaded."""
    point: ResumePoint | None = run.resume
    if point is None or point.model_only:
        return
    states, point.training_states = point.training_states, {}  # applied once; memory back after
    targets = {OPTIMIZER_NAME: facade.optimizer, SCHEDULER_NAME: facade.lr_scheduler}
    scaler = getattr(run.lightning_trainer.precision_plugin, "scaler", None)
    if scaler is not None and SCALER_NAME in states:
        targets[SCALER_NAME] = scaler
    check_training_states(point.folder, {n: s for n, s in states.items() if n in targets}, targets, {})
    for name, target in targets.items():
        path = Path(point.folder) / name
        try:
            target.load_state_dict(states[name])
        except Exception as exc:
            raise ValueError(
                f"Cannot restore {path}: {_failure(path, exc)}. Was it saved for another model or optimizer?"
            ) from exc


# ---- RNG states -----------------------------------------------------------------------------------------------------
def _numpy_allowlist() -> list[Any]:
    """The objects pickling a ``numpy.random.get_state()`` tuple refers to (transformers allowlists the same)."""
    core = np._core if hasattr(np, "_core") else np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_rng_file(path: str | os.PathLike) -> dict[str, Any]:
    """The RNG states in ``path``, loaded without executing anything and checked before use.

    Raises:
        ValueError: naming the file, when it holds anything beyond tensors, plain values and numpy arrays (it is
            never unpickled then), or states that do not fit Python's, numpy's and torch's generators.
    """
    path = Path(path)
    try:
        with torch.serialization.safe_globals(_numpy_allowlist()):
            states = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        error = refused_pickle(path, exc, "RNG states")
        raise UnsafeCheckpointFile(
            f"{error} Delete the file to resume without restoring the random number generators (the run is then not "
            "reproducible)."
        ) from None
    except Exception as exc:
        raise ValueError(f"Cannot restore {path}: {_failure(path, exc)}") from exc
    try:
        if not isinstance(states, dict):
            raise TypeError(f"a dict of generator states, not {type(states).__name__}")
        random.Random().setstate(states["python"])
        np.random.RandomState().set_state(states["numpy"])
        torch.Generator().set_state(states["cpu"])
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{path} does not hold valid RNG states: {type(exc).__name__}: {exc}") from exc
    return states


def load_rng_state(point: ResumePoint, world: Any) -> None:
    """Python, numpy and torch RNG streams as they were when ``point`` was written, for this process of ``world``."""
    if point.model_only:
        return
    name = rng_file_name(world.size, world.rank)
    path = regular_file(point.folder, name)
    if path is None:
        logger.warning(
            f"Didn't find {name} in {point.folder} (the checkpoint was written by a different number of "
            "processes?): the random number generators are not restored, reproducibility is not guaranteed."
        )
        return
    states = load_rng_file(path)
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.random.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        cuda = states["cuda"]
        if isinstance(cuda, (list, tuple)):
            torch.cuda.random.set_rng_state_all(cuda)
        else:
            torch.cuda.random.set_rng_state(cuda)


# ---- best model -----------------------------------------------------------------------------------------------------
def load_best_model(facade: TrainerSurface) -> None:
    """``load_best_model_at_end``: the best checkpoint's weights (single file or shards), checked first: inside
    ``output_dir``, the model files' sizes and checksums as saved, keys and shapes as the model's."""
    best = check_best_checkpoint(facade.state.best_model_checkpoint, facade.args.output_dir, "TrainerState")
    verify_checkpoint(best, full=True, model_files_only=True)
    load_model_weights(facade.model, best)
