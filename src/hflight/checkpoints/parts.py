"""The parts of a ``checkpoint-N`` folder, each in one place: its file names, how it is written, checked and loaded.

- **model**: ``model.safetensors`` (or shards and their index; the ``.bin`` forms are read too), ``config.json``,
  ``generation_config.json``, the processing class's files. Written by ``weights.save_model_files`` (through the
  facade's ``_save``); checked and loaded by ``weights.checked_weights``/``weights.load_model_weights`` (through the
  facade's ``_load_from_checkpoint``).
- **training arguments**: ``training_args.bin``, written by ``weights.save_model_files``; never loaded (transformers'
  tools read it).
- **optimizer, scheduler, scaler**: ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt``. Written by
  :func:`write_training_states`; read and checked against the objects the run will build by
  :func:`read_training_states` (``optim_state`` holds their names and checks), loaded by :func:`restore_optimizer`.
- **RNG**: ``rng_state.pth`` (``rng_state_{rank}.pth`` with several processes). Written by
  :func:`write_training_states`; checked by :func:`load_rng_file`, loaded by :func:`load_rng_state`.
- **trainer state**: ``trainer_state.json``. Written by :func:`write_trainer_state`; read by
  :func:`read_trainer_state` (every key's type checked).
- **callback states**: inside ``trainer_state.json`` (``stateful_callbacks``). Written by :func:`write_trainer_state`;
  checked by :func:`rebuilt_callbacks`, restored by :func:`restore_callback_states`.
- **weight-protocol callbacks** (``EMACallback``: ``ema_state.pt``): each callback writes and loads its own files
  (``save_checkpoint_state``/``load_checkpoint_state``, ``hflight.callbacks.hooks``).
- **manifest**: ``checkpoint_manifest.json``, written last by ``manifest.write_manifest``, checked by
  ``manifest.verify_checkpoint``.

:data:`PARTS` is the table of the named files: the hub push and the manifest ask it (:func:`part_of`) instead of
naming files again. The names are ``hflight.checkpoints.names``'s; the optimizer's (and a sharded run's model) files
are those of the checkpoint forms (``hflight.checkpoints.forms``), each part asking them.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import pickle
import random
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers.trainer_callback import ExportableState, TrainerState

from hflight.checkpoints import data_position
from hflight.checkpoints.adapters import is_adapter_file
from hflight.checkpoints.forms import found_form, part_of_form
from hflight.checkpoints.names import (
    CONFIG_FILES,
    DATA_POSITION_NAME,
    RNG_RE,
    SCALER_NAME,
    SCHEDULER_NAME,
    TRAINER_STATE_NAME,
    TRAINING_ARGS_NAME,
    rng_file_name,
)
from hflight.checkpoints.optim_state import (
    OPTIMIZER_NAME,
    IncompatibleTrainingState,
    check_training_states,
    group_map,
    planned_optimizer,
    planned_scheduler,
    regrouped_scheduler,
)
from hflight.checkpoints.weights import is_weight_file
from hflight.checkpoints.writers.files import (
    UnsafeCheckpointFile,
    load_failure,
    load_tensors_file,
    refused_pickle,
    regular_file,
)
from hflight.surface import RunView, TrainerSurface

logger = logging.getLogger(__name__)

#: the key of a resume's training states under which the optimizer's is kept: (its form, what the form read)
OPTIMIZER_PART = "optimizer"


@dataclass(frozen=True)
class Part:
    """One part of a checkpoint: its name and which files are its own."""

    name: str
    owns: Callable[[str], bool]  # file name -> whether it belongs to this part


PARTS: tuple[Part, ...] = (
    Part("model", lambda name: is_weight_file(name) or name in CONFIG_FILES or is_adapter_file(name)),
    Part("training arguments", lambda name: name == TRAINING_ARGS_NAME),
    Part("optimizer", lambda name: part_of_form(name) == "optimizer"),  # each form's file or folder
    Part("scheduler", lambda name: name == SCHEDULER_NAME),
    Part("scaler", lambda name: name == SCALER_NAME),
    Part("rng", lambda name: bool(RNG_RE.match(name))),
    Part("data position", lambda name: name == DATA_POSITION_NAME),
    Part("trainer state", lambda name: name == TRAINER_STATE_NAME),
)


def part_of(name: str) -> str | None:
    """The name of the part file ``name`` belongs to (None: a file no part of :data:`PARTS` claims, such as the
    processing class's files or a weight-protocol callback's)."""
    return next((part.name for part in PARTS if part.owns(name)), None)


#: The key of an hflight RNG file that holds the generator states of the moment the epoch in progress drew its data
#: order (transformers reads the other keys only): a resume in the middle of that epoch draws the same order again,
#: also from a sampler that takes torch's global generator (transformers' length-grouped sampler).
EPOCH_START_KEY = "hflight_epoch_start"


def rng_states(distributed: bool = False) -> dict[str, Any]:
    """This process's Python, numpy, torch (and CUDA) generator states, as an RNG file holds them. The CUDA state in
    transformers' form (``_save_rng_state``): one process's run holds the current device's state (a tensor), which
    transformers' ``_load_rng_state`` sets back with ``set_rng_state``; a process of a ``distributed`` run (several
    processes) the list of every visible device's (``get_rng_state_all``), which transformers sets with
    ``set_rng_state_all``."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.random
        states["cuda"] = cuda.get_rng_state_all() if distributed else cuda.get_rng_state()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    """The states of :func:`rng_states` set back: a CUDA state tensor with ``set_rng_state``, a list (a distributed
    run's, or a one-process run's written by earlier hflight versions) with ``set_rng_state_all``."""
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.random.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        cuda = states["cuda"]
        if isinstance(cuda, (list, tuple)):
            torch.cuda.random.set_rng_state_all(cuda)
        else:
            torch.cuda.random.set_rng_state(cuda)


def _check_rng_states(states: Any) -> None:
    if not isinstance(states, dict):
        raise TypeError(f"a dict of generator states, not {type(states).__name__}")
    random.Random().setstate(states["python"])
    np.random.RandomState().set_state(states["numpy"])
    torch.Generator().set_state(states["cpu"])


def write_training_states(facade: TrainerSurface, run: RunView, job: Any, is_main: bool, until: Any = None) -> None:
    """The optimizer in the run's form (``optimizer.pt``; a sharded run's forms write model files too: every process
    takes part, see ``hflight.checkpoints.forms``), scheduler and scaler (main process), and this process's RNG
    states, each a step of ``job`` (``hflight.checkpoints.job.CheckpointJob``: a failure names its file); the form's
    tensor files through the job's ``save`` (now, or from a snapshot in the background with ``save_async``;
    ``until``: the optimizer's state changes only at its next step, so its copy may be made beside that step)."""
    form, folder = run.backend.hf_checkpoint_state(), job.folder
    save = job.save if until is None else functools.partial(job.save, until=until)
    job.write(form.optimizer_name, lambda: form.write(folder, facade.model, facade.optimizer, is_main, save=save))
    files = {}
    if is_main:
        files[SCHEDULER_NAME] = facade.lr_scheduler.state_dict
        scaler = getattr(run.lightning_trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            files[SCALER_NAME] = scaler.state_dict
    epoch_start = run.epoch_start_rng  # the streams as the epoch's data order was drawn from them (hflight's key)
    files[rng_file_name(run.world.size, run.world.rank)] = lambda: {
        **rng_states(distributed=run.world.size > 1),
        **({EPOCH_START_KEY: epoch_start} if epoch_start is not None else {}),
    }
    for name, state in files.items():
        job.write(name, lambda name=name, state=state: torch.save(state(), os.path.join(folder, name)))
    _write_data_position(facade, run, job, is_main)


def _write_data_position(facade: TrainerSurface, run: RunView, job: Any, is_main: bool) -> None:
    """``data_position.pt`` (``hflight.checkpoints.data_position``): every process's position and its dataset's
    description gathered (a collective: every process calls this), written by the main process; none where the
    training loader reports no position (a loader of a backend's own, nothing trained yet in this call)."""
    position = run.data_position
    if position is None:
        return
    dataset, loader, entry, why = position
    gathered = run.world.gather_objects([(entry, dataset)])
    entries = [each for each, _ in gathered]
    if is_main and all(each is not None for each in entries):
        step = facade.state.global_step
        datasets = {description["fingerprint"]: description for _, description in gathered}
        job.write(DATA_POSITION_NAME, lambda: _said(data_position.write(job.folder, step, dataset, loader, entries,
                                                                        datasets, why)))  # fmt: skip


_SAID: set[str] = set()


def _said(why: str | None) -> None:
    """A data position written without its stream states: why, once per reason in a process."""
    if why is not None and why not in _SAID:
        _SAID.add(why)
        logger.warning(f"The training data's position was saved without its stream state: {why}. A run resumed "
                       "from it reads and drops the trained batches, as transformers does.")  # fmt: skip


def write_trainer_state(facade: TrainerSurface, folder: str) -> None:
    """``trainer_state.json`` into ``folder``, with the current state of every stateful callback (several instances of
    one class as a list, in order, as transformers reads them back)."""
    state = facade.state
    stateful: dict[str, list[dict[str, Any]]] = {}
    for callback in facade.callback_handler.callbacks + [facade.control]:
        if isinstance(callback, ExportableState):
            stateful.setdefault(type(callback).__name__, []).append(callback.state())
    # States of callbacks this run does not have stay as they were (transformers keeps them too).
    state.stateful_callbacks = {
        **(state.stateful_callbacks or {}),
        **{name: states[0] if len(states) == 1 else states for name, states in stateful.items()},
    }
    best = state.best_metric
    if best is not None and not math.isfinite(best):
        # transformers' starting point (±inf until an evaluation gives a better value) is written as null: a file
        # holds finite numbers only, and the next evaluation starts from the same point again.
        state.best_metric = None
    try:
        state.save_to_json(os.path.join(folder, TRAINER_STATE_NAME))
    finally:
        state.best_metric = best


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


def rng_files(folder: Path, manifest: dict[str, Any] | None) -> list[Path]:
    """The RNG files of the checkpoint, by the names the run that wrote it used: for an hflight folder those its
    manifest lists for its number of processes; for a transformers folder ``rng_state.pth``/``rng_state_{rank}.pth``
    (each must be a regular file)."""
    if manifest is not None:
        world = (manifest.get("run") or {}).get("world_size") or 1
        world = world if type(world) is int else 1
        expected = [name for name in manifest["files"] if _written_for(name, world)]
    else:
        expected = sorted(n for n in os.listdir(folder) if RNG_RE.match(n))
    return [path for name in expected if (path := regular_file(folder, name)) is not None]


def _written_for(name: str, world: int) -> bool:
    """Whether ``name`` is an RNG file a run of ``world`` processes writes."""
    match = RNG_RE.match(name)
    if match is None:
        return False
    rank = match.group(1)
    return rank is None if world <= 1 else rank is not None and int(rank) < world


def read_training_states(
    facade: TrainerSurface, folder: Path, manifest: dict[str, Any] | None, state: TrainerState
) -> dict[str, Any]:
    """RNG, optimizer, scheduler and scaler files, loaded safely and checked against the optimizer and scheduler the
    run will build (before anything is copied anywhere); the optimizer as its form reads it, under
    :data:`OPTIMIZER_PART`."""
    for rng_file in rng_files(folder, manifest):
        load_rng_file(rng_file)  # a crafted file is rejected here, before anything changes
    names = (SCHEDULER_NAME, SCALER_NAME)
    states = {name: load_tensors_file(path) for name in names if (path := regular_file(folder, name)) is not None}
    optimizer = planned_optimizer(facade)
    parameters = parameter_names(facade.model)
    targets = {OPTIMIZER_NAME: optimizer}
    if SCHEDULER_NAME in states:
        targets[SCHEDULER_NAME] = planned_scheduler(facade, optimizer, state.max_steps)
    form = found_form(folder)
    if form is not None:
        saved = form.read_optimizer(Path(folder), optimizer, parameters)
        states[OPTIMIZER_PART] = (form, saved)
        groups = form.saved_groups(Path(folder), saved)
        if groups is not None and SCHEDULER_NAME in states:  # grouped as another layout groups them: the run's order
            mapping = group_map(Path(folder) / form.optimizer_name, groups, optimizer, parameters)
            states[SCHEDULER_NAME] = regrouped_scheduler(states[SCHEDULER_NAME], mapping, len(groups))
    check_training_states(folder, {n: s for n, s in states.items() if n != OPTIMIZER_PART}, targets, parameters)
    return states


def parameter_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


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


def rebuilt_callbacks(facade: TrainerSurface, state: TrainerState, source: Path) -> list[tuple[Any, Any]]:
    """With ``restore_callback_states_from_checkpoint=True``, transformers' way: each stateful callback rebuilt from
    its saved ``args`` and ``attributes`` (built here, before anything is loaded, so bad ``args`` change nothing);
    a warning names the saved states that match no callback."""
    if not facade.args.restore_callback_states_from_checkpoint:
        return []
    pairs, not_found = _saved_states(state, facade.callback_handler.callbacks + [facade.control])
    if not_found:  # through transformers' logger, where its users and tests listen for it
        _trainer_logger().warning(
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


def _trainer_logger() -> Any:
    from transformers.utils import logging as hf_logging

    return hf_logging.get_logger("transformers.trainer")


def restore_callback_states(facade: TrainerSurface, point: Any, state: TrainerState) -> None:
    """The callbacks rebuilt from the checkpoint replace those in use as transformers replaces them: each old one
    removed (``remove_callback`` of its type), the rebuilt ones added at the end of the list, ``TrainerControl``
    becoming ``facade.control``. ``point`` is the resume point that rebuilt them before anything was loaded; None (a
    state set by hand, as transformers' tests do, then ``_load_callback_state()``) rebuilds them from ``state`` now.
    Otherwise nothing is restored, as in transformers, unless the facade opts in with ``restore_callback_attributes``
    (hflight's): then the saved attributes are set on the callbacks in use, so that, e.g., an
    ``EarlyStoppingCallback``'s patience counter survives a resume."""
    if facade.args.restore_callback_states_from_checkpoint:
        pairs = (
            point.rebuilt_callbacks if point is not None else rebuilt_callbacks(facade, state, Path("trainer.state"))
        )
        added = []
        for old, new in pairs:
            if old is facade.control:
                facade.control = new
                continue
            facade.callback_handler.remove_callback(type(new))
            added.append(new)
        for new in added:
            facade.callback_handler.add_callback(new)
        if pairs:
            _trainer_logger().info("Continuing training from checkpoint, restoring any callbacks that were passed in")
        return
    if not facade.restore_callback_attributes:  # transformers' default: nothing restored
        return
    pairs, _ = _saved_states(state, facade.callback_handler.callbacks + [facade.control])
    for callback, entry in pairs:
        if isinstance(callback, ExportableState):
            for key, value in entry.get("attributes", {}).items():
                setattr(callback, key, value)


def restore_optimizer(facade: TrainerSurface, run: RunView) -> None:
    """Optimizer, scheduler and scaler states, once Lightning built them (HF file names): checked against the real
    objects (they were checked against the planned ones before the weights were loaded), then loaded; the optimizer
    as its form reads it into a run of this kind (``hflight.checkpoints.forms``: by position, by name, resharded from
    the distributed checkpoint, converted to the run's shards, or by the run's engine)."""
    point = run.resume
    if point is None or point.model_only:
        return
    states, point.training_states = point.training_states, {}  # applied once; memory back after
    targets = {SCHEDULER_NAME: facade.lr_scheduler}
    scaler = getattr(run.lightning_trainer.precision_plugin, "scaler", None)
    if scaler is not None and SCALER_NAME in states:
        targets[SCALER_NAME] = scaler
    check_training_states(point.folder, {n: s for n, s in states.items() if n in targets}, targets, {})
    folder = Path(point.folder)
    loads = [(name, lambda name=name: targets[name].load_state_dict(states[name])) for name in targets
             if name in states]  # fmt: skip
    if OPTIMIZER_PART in states:
        form, saved = states[OPTIMIZER_PART]
        run_form = run.backend.hf_checkpoint_state()
        optimizer = lambda: form.load_optimizer(folder, saved, facade.model, facade.optimizer, run_form)  # noqa: E731
        loads.insert(0, (form.optimizer_name, optimizer))
    for name, load in loads:
        try:
            load()
        except (IncompatibleTrainingState, UnsafeCheckpointFile):
            raise
        except Exception as exc:
            path = folder / name
            raise ValueError(
                f"Cannot restore {path}: {load_failure(path, exc)}. Was it saved for another model or optimizer?"
            ) from exc


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
        raise ValueError(f"Cannot restore {path}: {load_failure(path, exc)}") from exc
    try:
        _check_rng_states(states)
        if EPOCH_START_KEY in states:
            _check_rng_states(states[EPOCH_START_KEY])
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"{path} does not hold valid RNG states: {type(exc).__name__}: {exc}") from exc
    return states


def load_rng_state(point: Any, world: Any, epoch_start: bool = False) -> None:
    """Python, numpy and torch RNG streams as they were when ``point`` was written, for this process of ``world``;
    ``epoch_start``: as they were when the epoch in progress drew its data order (nothing when the file does not
    record it: a transformers checkpoint)."""
    if point.model_only:
        return
    name = rng_file_name(world.size, world.rank)
    path = regular_file(point.folder, name)
    if path is None:
        if epoch_start:  # the call for the checkpoint's own streams says so
            return
        logger.warning(
            f"Didn't find {name} in {point.folder} (the checkpoint was written by a different number of "
            "processes?): the random number generators are not restored, reproducibility is not guaranteed."
        )
        return
    states = load_rng_file(path)
    if epoch_start:
        if EPOCH_START_KEY in states:
            _set_rng_states(states[EPOCH_START_KEY])
        return
    _set_rng_states(states)
