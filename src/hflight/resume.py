"""Resuming from a ``checkpoint-N`` folder: everything is checked before the model is touched, nothing is unpickled
beyond plain tensors and the RNG states' numpy arrays.

Order of :func:`resolve_resume`: the folder is complete (its manifest, see ``hflight.checkpoint``), its
``trainer_state.json`` is valid (types and required keys), its weights fit the model (keys and shapes), its RNG,
optimizer, scheduler and scaler files load safely; only then are weights copied in. Once Lightning has built the
optimizer, :func:`restore_state` positions the run (and warns about every argument that changes the data position
or the step arithmetic), :func:`restore_optimizer` and :func:`load_rng_state` restore the rest. Every error names
the file (and the key) at fault.

Security: checkpoints are shared and downloaded, so no file in one may run code. ``optimizer.pt``, ``scheduler.pt``,
``scaler.pt`` and ``.bin`` weights load with ``torch.load(weights_only=True)``; ``rng_state*.pth`` does too, with
exactly the numpy objects a ``numpy.random.get_state()`` tuple needs allowlisted (as transformers does).
``training_args.bin`` is written for transformers' sake and never read.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers.trainer_callback import ExportableState, TrainerState

from hflight.callbacks.hooks import weight_hooks
from hflight.checkpoint import (
    OPTIMIZER_NAME,
    RUN_ARGUMENTS,
    SCALER_NAME,
    SCHEDULER_NAME,
    TRAINER_STATE_NAME,
    IncompleteCheckpointError,
    get_last_checkpoint,
    remove_stale_folders,
    rng_file_name,
    run_arguments,
    verify_checkpoint,
)
from hflight.surface import RunView, TrainerSurface
from hflight.weights import UnsafeCheckpointFile, checked_weights, load_model_weights, refused_pickle

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
    bad = next((i for i, entry in enumerate(data["log_history"]) if not isinstance(entry, dict)), None)
    if bad is not None:
        raise ValueError(f"{path}: 'log_history' entry {bad} must be an object.")
    for name, entry in (data.get("stateful_callbacks") or {}).items():
        entries = entry if isinstance(entry, list) else [entry]
        if not all(isinstance(e, dict) and isinstance(e.get("attributes", {}), dict) for e in entries):
            raise ValueError(f"{path}: 'stateful_callbacks'[{name!r}] must be an object with an 'attributes' object.")
    own = {f.name for f in fields(state_class)} - {f.name for f in fields(TrainerState)}  # a subclass's fields
    known = set(_STATE_FIELDS) | own
    unknown = [key for key in data if key not in known]
    if unknown:
        logger.warning(f"{path}: ignoring key(s) this TrainerState does not know: {', '.join(unknown)}.")
    return state_class(**{k: v for k, v in data.items() if k in known})


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
        raise ValueError(f"resume_from_checkpoint={str(resume)!r} is not a folder.")
    manifest = verify_checkpoint(folder)
    state = read_trainer_state(folder / TRAINER_STATE_NAME, type(facade.state))
    model_only = _is_model_only(folder, manifest)
    copy_weights = checked_weights(facade.model, folder)
    training_states = {}
    if not model_only:
        for rng_file in sorted(folder.glob("rng_state*.pth")):
            load_rng_file(rng_file)  # a crafted file is rejected here, before anything changes
        names = (OPTIMIZER_NAME, SCHEDULER_NAME, SCALER_NAME)
        training_states = {name: _load_tensors_file(folder / name) for name in names if (folder / name).is_file()}
    callbacks = facade.callback_handler.callbacks
    for callback in weight_hooks(callbacks, "check_checkpoint_state"):
        callback.check_checkpoint_state(str(folder), facade.model)
    copy_weights()
    for callback in weight_hooks(callbacks, "load_checkpoint_state"):
        callback.load_checkpoint_state(str(folder), facade.model)
    if model_only:
        logger.warning(
            f"Checkpoint {folder} holds the model weights and trainer state but no optimizer, scheduler or RNG state "
            "(saved with save_only_model=True). Resuming as transformers.Trainer does: from global step "
            f"{state.global_step} with a fresh optimizer and learning-rate schedule; reproducibility is not "
            "guaranteed."
        )
    return ResumePoint(str(folder), state, manifest, model_only, training_states)


def _is_model_only(folder: Path, manifest: dict[str, Any] | None) -> bool:
    if manifest is not None:
        return bool(manifest.get("save_only_model"))
    # A transformers.Trainer folder: optimizer and scheduler come as a pair, or not at all (save_only_model).
    present = {name: (folder / name).is_file() for name in (OPTIMIZER_NAME, SCHEDULER_NAME)}
    if len(set(present.values())) > 1:
        have = next(n for n, p in present.items() if p)
        lack = next(n for n, p in present.items() if not p)
        raise IncompleteCheckpointError(
            f"Checkpoint {folder} has {have} but no {lack}: it is incomplete (interrupted while saving?)."
        )
    return not any(present.values())


def clean_output_dir(facade: TrainerSurface, run: RunView) -> None:
    """Main process: delete ``.tmp-checkpoint-*`` left by interrupted saves (not the folder being resumed)."""
    if facade.is_world_process_zero():
        point = run.resume
        remove_stale_folders(facade.args.output_dir, keep=point.folder if point is not None else None)


# ---- positioning the run -------------------------------------------------------------------------------------------
def restore_state(facade: TrainerSurface, run: RunView) -> tuple[int, int]:
    """The checkpoint's progress in ``facade.state`` with this run's cadence and batch size; callback states
    restored; returns (epochs already trained, micro-batches to skip in the current epoch)."""
    point: ResumePoint | None = run.resume
    if point is None:
        return 0, 0
    fresh, state = facade.state, point.state
    _warn_changed_arguments(facade, point, run_arguments(facade.args, run.world.size, run.plan))
    # HF keeps the checkpoint's logging/eval/save steps; the arguments of the run being started win here.
    for name in ("logging_steps", "eval_steps", "save_steps", "train_batch_size"):
        setattr(state, name, getattr(fresh, name))
    if state.best_model_checkpoint is not None and not os.path.isdir(state.best_model_checkpoint):
        logger.warning(
            f"The best checkpoint {state.best_model_checkpoint} recorded in {point.folder} does not exist anymore. "
            "Ignoring it for this run."
        )
        state.best_model_checkpoint = None
    facade.state = state
    _restore_callback_states(facade)
    return run.plan.resume_position(state.global_step, facade.args.ignore_data_skip)


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


def _restore_callback_states(facade: TrainerSurface) -> None:
    saved = facade.state.stateful_callbacks or {}
    for callback in facade.callback_handler.callbacks + [facade.control]:
        if not isinstance(callback, ExportableState):
            continue
        entry = saved.get(type(callback).__name__)
        if isinstance(entry, list):
            entry = entry[-1] if entry else None
        if not entry:
            continue
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
    """Optimizer, scheduler and scaler states, once Lightning built them (HF file names)."""
    point: ResumePoint | None = run.resume
    if point is None or point.model_only:
        return
    states, point.training_states = point.training_states, {}  # applied once; memory back after
    targets = {OPTIMIZER_NAME: facade.optimizer, SCHEDULER_NAME: facade.lr_scheduler}
    scaler = getattr(run.lightning_trainer.precision_plugin, "scaler", None)
    if scaler is not None and SCALER_NAME in states:
        targets[SCALER_NAME] = scaler
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


def load_rng_state(run: RunView) -> None:
    """Python, numpy and torch RNG streams as they were when the checkpoint was written."""
    point: ResumePoint | None = run.resume
    if point is None or point.model_only:
        return
    path = Path(point.folder) / rng_file_name(run.world.size, run.world.rank)
    if not path.is_file():
        logger.warning(
            f"Didn't find {path.name} in {point.folder} (the checkpoint was written by a different number of "
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
    """``load_best_model_at_end``: the best checkpoint's weights (single file or shards), checked first."""
    load_model_weights(facade.model, facade.state.best_model_checkpoint)
