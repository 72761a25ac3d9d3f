"""Optimizer, scheduler and scaler states checked against what they will be loaded into, before anything is.

torch's ``Optimizer.load_state_dict`` compares only the number of parameter groups and their sizes, and an LR
scheduler's ``load_state_dict`` copies any dict into the scheduler's attributes: a ``scheduler.pt`` of ``{}`` or with
a ``base_lrs`` of the wrong length is accepted and fails at the first scheduler step (``zip() argument 2 is shorter
than argument 1``), naming no file. Here every field is checked first, and an error names the file and the field:

- optimizer: ``state`` and ``param_groups``; as many groups as the optimizer the run builds, each with as many
  parameters and a numeric ``lr``; every per-parameter state belongs to a listed parameter, and the state tensors
  that follow their parameter's shape (Adam's ``exp_avg``/``exp_avg_sq``, SGD's ``momentum_buffer``, ...) have it;
- scheduler: the fields the run's scheduler writes (``last_epoch``, ``base_lrs``, ``_last_lr``, ``_step_count``)
  present, every field of the same kind as the scheduler's own, lists as long (one entry per parameter group); a key
  that would overwrite one of the scheduler's other attributes (``optimizer``) is refused;
- scaler: ``GradScaler``'s numeric fields.

Before the fit builds the optimizer and scheduler, they are checked against the ones the run will build
(:func:`planned_optimizer`, :func:`planned_scheduler`: the facade's own ``create_optimizer``/``create_scheduler``
run on a shallow copy, so a subclass's override counts); once built, against the real ones again.
"""

from __future__ import annotations

import contextlib
import copy
import numbers
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from hflight.checkpoints.names import OPTIMIZER_NAME, SCALER_NAME, SCHEDULER_NAME
from hflight.surface import TrainerSurface

# Per-parameter state entries shaped like their parameter, across torch's optimizers and transformers' Adafactor.
PARAM_SHAPED_STATE = frozenset(
    {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "sum", "square_avg", "grad_avg", "acc_delta",
     "exp_inf", "prev", "step_size", "ax"}
)  # fmt: skip
# Fields every torch LR scheduler has written for years; others may come and go between torch versions.
SCHEDULER_REQUIRED = ("last_epoch", "base_lrs", "_last_lr", "_step_count")
SCALER_FIELDS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_MAX_SHOWN = 80


class IncompatibleTrainingState(ValueError):
    """An ``optimizer.pt``, ``scheduler.pt`` or ``scaler.pt`` that does not fit what it would be loaded into."""


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_SHOWN else text[:_MAX_SHOWN] + "..."


def _is_number(value: Any) -> bool:
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)) or (
        torch.is_tensor(value) and value.numel() == 1 and not value.dtype.is_complex
    )


# ---- what the run will build ---------------------------------------------------------------------------------------
def planned_optimizer(facade: TrainerSurface) -> torch.optim.Optimizer:
    """The optimizer the fit will use: the facade's, or one built the way the fit builds it (``create_optimizer``,
    overrides included) on a shallow copy of the facade, which is then dropped (with the gradient hooks building it
    put on the model's parameters: LOMO's, the layer-wise optimizers' of GaLore/APOLLO)."""
    if facade.optimizer is not None:
        return facade.optimizer
    probe = copy.copy(facade)
    probe.optimizer = None
    with _gradient_hooks_removed_after():
        return probe.create_optimizer()


_HOOK_REGISTRATIONS = ("register_hook", "register_post_accumulate_grad_hook")


@contextlib.contextmanager
def _gradient_hooks_removed_after() -> Iterator[None]:
    """Gradient hooks registered on any tensor inside the block are removed when it ends (the probe optimizer's hooks
    would otherwise update the parameters beside the real optimizer's)."""
    handles = []
    originals = {name: getattr(torch.Tensor, name) for name in _HOOK_REGISTRATIONS}

    def recorded(original: Any) -> Any:
        def register(tensor: torch.Tensor, hook: Any) -> Any:
            handles.append(original(tensor, hook))
            return handles[-1]

        return register

    for name, original in originals.items():
        setattr(torch.Tensor, name, recorded(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        for handle in handles:
            handle.remove()


def planned_scheduler(facade: TrainerSurface, optimizer: torch.optim.Optimizer, num_training_steps: int) -> Any:
    """The scheduler the fit will use: the facade's own (passed in ``optimizers=``), or one built by
    ``create_scheduler`` over a stand-in optimizer with ``optimizer``'s groups (building a scheduler sets the
    learning rates of the optimizer it is given)."""
    if facade.lr_scheduler is not None:
        return facade.lr_scheduler
    stand_in = torch.optim.SGD(
        [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": group["lr"]} for group in optimizer.param_groups]
    )
    probe = copy.copy(facade)
    probe.lr_scheduler = None
    return probe.create_scheduler(num_training_steps=max(num_training_steps, 1), optimizer=stand_in)


# ---- optimizer -----------------------------------------------------------------------------------------------------
def _groups(path: Path, saved: Any, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    if not isinstance(saved, Mapping) or "state" not in saved or "param_groups" not in saved:
        found = sorted(map(str, saved)) if isinstance(saved, Mapping) else type(saved).__name__
        raise IncompatibleTrainingState(
            f"{path} does not hold an optimizer state ('state' and 'param_groups'); found {_shown(found)}."
        )
    groups = saved["param_groups"]
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
        raise IncompatibleTrainingState(f"{path}: 'param_groups' must be a list of objects, got {_shown(groups)}.")
    if len(groups) != len(optimizer.param_groups):
        raise IncompatibleTrainingState(
            f"{path}: 'param_groups' has {len(groups)} group(s), the {type(optimizer).__name__} this run builds has "
            f"{len(optimizer.param_groups)}. Was it saved for another optimizer or weight-decay grouping? (Or by "
            "another layout: transformers gives each device mesh its own group where DTensor and plain parameters "
            "mix, as in a tensor-parallel mixture of experts; a state by parameter position cannot be regrouped, one "
            "by name, FSDP2's or a tensor-parallel run's, is.)"
        )
    for i, (group, ours) in enumerate(zip(groups, optimizer.param_groups)):
        params = group.get("params")
        if not isinstance(params, list) or not all(type(p) is int for p in params):
            raise IncompatibleTrainingState(f"{path}: 'param_groups'[{i}]['params'] must be a list of parameter ids.")
        if len(params) != len(ours["params"]):
            raise IncompatibleTrainingState(
                f"{path}: 'param_groups'[{i}] lists {len(params)} parameters, the optimizer's group {i} has "
                f"{len(ours['params'])}. Was it saved for another model?"
            )
        if not _is_number(group.get("lr")):
            raise IncompatibleTrainingState(
                f"{path}: 'param_groups'[{i}]['lr'] must be a number, got {_shown(group.get('lr'))}."
            )
    return groups


def check_optimizer_state(
    path: Path, saved: Any, optimizer: torch.optim.Optimizer, names: Mapping[int, str] | None = None
) -> None:
    """Raise :class:`IncompatibleTrainingState` naming ``path`` and the field unless ``saved`` fits ``optimizer``;
    ``names`` maps ``id(parameter)`` to its name, for the message."""
    groups = _groups(path, saved, optimizer)
    ids = [pid for group in groups for pid in group["params"]]
    params = dict(zip(ids, (p for group in optimizer.param_groups for p in group["params"])))
    state = saved["state"]
    if not isinstance(state, Mapping):
        raise IncompatibleTrainingState(f"{path}: 'state' must be an object, got {type(state).__name__}.")
    for pid, entry in state.items():
        if pid not in params:
            raise IncompatibleTrainingState(
                f"{path}: 'state' has an entry for parameter id {pid!r}, which no parameter group lists."
            )
        if not isinstance(entry, Mapping):
            raise IncompatibleTrainingState(f"{path}: 'state'[{pid}] must be an object, got {type(entry).__name__}.")
        param = params[pid]
        for key, value in entry.items():
            if key in PARAM_SHAPED_STATE and (not torch.is_tensor(value) or value.shape != param.shape):
                got = list(value.shape) if torch.is_tensor(value) else type(value).__name__
                name = (names or {}).get(id(param), f"#{ids.index(pid)}")
                raise IncompatibleTrainingState(
                    f"{path}: 'state'[{pid}][{key!r}] is {got}, parameter {name} has shape {list(param.shape)}. Was "
                    "it saved for another model?"
                )


def group_map(
    path: Path, saved_groups: list[Mapping[str, Any]], optimizer: torch.optim.Optimizer, names: Mapping[int, str]
) -> list[int]:
    """For each parameter group of ``optimizer``, a saved group (by index) its parameters were in, from the saved
    groups (``params``: parameter names; their settings): the identity for the same grouping. The grouping may differ
    with the layout: transformers' ``create_optimizer`` gives each device mesh its own group where DTensor and plain
    parameters mix (a tensor-parallel mixture of experts' replicated router beside its sharded weights), so a
    checkpoint of one layout splits a group a run of another keeps whole. A group taken from several saved groups
    needs them to have the same settings (weight decay, learning rate, ...; their first is named). Raises
    :class:`IncompatibleTrainingState` where a parameter is in no saved group, or a group's parameters come from
    saved groups set differently."""
    saved_of = {str(name): j for j, group in enumerate(saved_groups) for name in group["params"]}
    settings = [{k: v for k, v in group.items() if k != "params"} for group in saved_groups]
    mapping = []
    for i, ours in enumerate(optimizer.param_groups):
        expected = [names.get(id(p), f"#{j}") for j, p in enumerate(ours["params"])]
        missing = sorted(name for name in expected if name not in saved_of)
        if missing:
            raise IncompatibleTrainingState(
                f"{path}: the optimizer's group {i} steps {_shown(missing)}, which no saved parameter group lists. "
                "Was it saved for another model?"
            )
        sources = sorted({saved_of[name] for name in expected})
        differing = [j for j in sources[1:] if settings[j] != settings[sources[0]]]
        if differing:
            raise IncompatibleTrainingState(
                f"{path}: the optimizer's group {i} holds parameters of the saved groups {sources}, which are set "
                f"differently ({_shown(settings[sources[0]])} and {_shown(settings[differing[0]])}): it was saved for "
                "another weight-decay grouping."
            )
        mapping.append(sources[0] if sources else i)
    return mapping


def regrouped_scheduler(saved: Any, mapping: list[int], saved_groups: int) -> Any:
    """A scheduler state's per-group lists (``base_lrs``, ``_last_lr``, ...: those as long as the saved optimizer's
    groups) taken for the run's groups by :func:`group_map`; the state itself for the same grouping."""
    if not isinstance(saved, Mapping) or mapping == list(range(saved_groups)):
        return saved
    return {key: [value[j] for j in mapping] if isinstance(value, (list, tuple)) and len(value) == saved_groups
            else value for key, value in saved.items()}  # fmt: skip


def check_named_optimizer_state(
    path: Path, saved: Any, optimizer: torch.optim.Optimizer, names: Mapping[int, str]
) -> None:
    """The same checks for an optimizer state whose parameters are named (a sharded run's ``optimizer.bin``:
    ``param_groups`` list parameter names, ``state`` is keyed by them, tensors are whole): the optimizer's parameters
    are the saved groups' (grouped the same, or as another layout groups them: :func:`group_map`); ``names`` maps
    ``id(parameter)`` to its name in the model."""
    if not isinstance(saved, Mapping) or "state" not in saved or "param_groups" not in saved:
        found = sorted(map(str, saved)) if isinstance(saved, Mapping) else type(saved).__name__
        raise IncompatibleTrainingState(
            f"{path} does not hold an optimizer state ('state' and 'param_groups'); found {_shown(found)}."
        )
    groups = saved["param_groups"]
    if not isinstance(groups, list) or not all(
        isinstance(group, Mapping) and isinstance(group.get("params"), list) for group in groups
    ):
        raise IncompatibleTrainingState(
            f"{path}: 'param_groups' must be a list of objects listing their parameters, got {_shown(groups)}."
        )
    for i, group in enumerate(groups):
        if not _is_number(group.get("lr")):
            raise IncompatibleTrainingState(
                f"{path}: 'param_groups'[{i}]['lr'] must be a number, got {_shown(group.get('lr'))}."
            )
    group_map(path, groups, optimizer, names)
    ours = {names.get(id(p)) for group in optimizer.param_groups for p in group["params"]}
    extra = sorted({str(name) for group in groups for name in group["params"]} - ours)
    if extra:
        raise IncompatibleTrainingState(
            f"{path}: 'param_groups' list {_shown(extra)}, which the optimizer this run builds does not step. Was it "
            "saved for another model?"
        )
    params = {names.get(id(p)): p for group in optimizer.param_groups for p in group["params"]}
    state = saved["state"]
    if not isinstance(state, Mapping):
        raise IncompatibleTrainingState(f"{path}: 'state' must be an object, got {type(state).__name__}.")
    for name, entry in state.items():
        if name not in params or not isinstance(entry, Mapping):
            raise IncompatibleTrainingState(
                f"{path}: 'state' has an entry for {name!r}, which no parameter group lists (or it is no object)."
            )
        _check_shapes(path, f"'state'[{name!r}]", entry, params[name].shape, name)


def _check_shapes(path: Path, where: str, entry: Mapping[str, Any], shape: Any, name: str) -> None:
    for key, value in entry.items():
        got = tuple(value.shape) if torch.is_tensor(value) else value
        if key in PARAM_SHAPED_STATE and got != tuple(shape):
            shown = list(got) if isinstance(got, tuple) else type(value).__name__
            raise IncompatibleTrainingState(
                f"{path}: {where}[{key!r}] is {shown}, parameter {name} has shape {list(shape)}. Was it saved for "
                "another model?"
            )


def check_distributed_optimizer(
    path: Path, shapes: Mapping[str, tuple[tuple[int, ...], Any]], groups: list[Mapping[str, Any]],
    optimizer: torch.optim.Optimizer, names: Mapping[int, str],
) -> None:  # fmt: skip
    """The same checks for a distributed-checkpoint optimizer folder (``optimizer_0/``), from its metadata and its
    groups' parameter names: ``shapes`` holds its tensors (``state.<parameter>.<key>`` -> whole shape), ``groups``
    the names each parameter group lists (grouped as the run groups them, or as another layout does:
    :func:`group_map`); every parameter the optimizer steps has its states there, shaped as the parameter."""
    group_map(path, groups, optimizer, names)
    params = {names.get(id(p)): p for group in optimizer.param_groups for p in group["params"]}
    saved: dict[str, dict[str, Any]] = {}
    for key, (shape, _) in shapes.items():
        if not key.startswith("state."):
            continue
        name, _, field = key[len("state.") :].rpartition(".")
        if name not in params:
            raise IncompatibleTrainingState(
                f"{path}: it holds optimizer states for {name!r}, which the optimizer this run builds does not step. "
                "Was it saved for another model?"
            )
        saved.setdefault(name, {})[field] = torch.empty(0).new_empty(shape, device="meta")
    for name, entry in saved.items():
        _check_shapes(path, f"'state'[{name!r}]", entry, params[name].shape, name)


# ---- scheduler and scaler ------------------------------------------------------------------------------------------
def _same_kind(value: Any, ours: Any) -> bool:
    if ours is None or isinstance(ours, Mapping):
        return True  # transformers' lambda placeholders, nested states: torch's own load checks them
    if isinstance(ours, bool):
        return isinstance(value, bool)
    if _is_number(ours):
        return _is_number(value)
    if isinstance(ours, (list, tuple)):
        return isinstance(value, (list, tuple))
    return isinstance(value, type(ours))


def check_scheduler_state(path: Path, saved: Any, scheduler: Any) -> None:
    """Raise :class:`IncompatibleTrainingState` naming ``path`` and the field unless ``saved`` fits ``scheduler``."""
    ours = scheduler.state_dict()
    if not isinstance(saved, Mapping):
        raise IncompatibleTrainingState(f"{path} must hold a scheduler state (an object), not {type(saved).__name__}.")
    missing = [key for key in SCHEDULER_REQUIRED if key in ours and key not in saved]
    if missing:
        raise IncompatibleTrainingState(
            f"{path} lacks the field(s) {', '.join(map(repr, missing))} of {type(scheduler).__name__}: it is not a "
            "state this scheduler wrote."
        )
    for key, value in saved.items():
        if key not in ours:
            if hasattr(scheduler, key):
                raise IncompatibleTrainingState(
                    f"{path}: field {key!r} is not part of {type(scheduler).__name__}'s state; loading it would "
                    "replace the scheduler's own attribute."
                )
            continue  # a field of another torch version: harmless
        if not _same_kind(value, ours[key]):
            raise IncompatibleTrainingState(
                f"{path}: field {key!r} must be like {_shown(ours[key])} ({type(ours[key]).__name__}), got "
                f"{_shown(value)}."
            )
        if isinstance(ours[key], (list, tuple)) and len(value) != len(ours[key]):
            raise IncompatibleTrainingState(
                f"{path}: field {key!r} has {len(value)} entries, {type(scheduler).__name__} has {len(ours[key])} (one "
                "per parameter group). Was it saved for another optimizer?"
            )


def check_scaler_state(path: Path, saved: Any) -> None:
    """Raise :class:`IncompatibleTrainingState` unless ``saved`` is a ``GradScaler`` state (empty: a disabled one)."""
    if not isinstance(saved, Mapping):
        raise IncompatibleTrainingState(f"{path} must hold a gradient scaler state, not {type(saved).__name__}.")
    for key in SCALER_FIELDS if saved else ():
        if not _is_number(saved.get(key)):
            raise IncompatibleTrainingState(f"{path}: field {key!r} must be a number, got {_shown(saved.get(key))}.")


_CHECKS = {
    OPTIMIZER_NAME: lambda path, saved, target, names: check_optimizer_state(path, saved, target, names),
    SCHEDULER_NAME: lambda path, saved, target, names: check_scheduler_state(path, saved, target),
    SCALER_NAME: lambda path, saved, target, names: check_scaler_state(path, saved),
}


def check_training_states(
    folder: str | Path, states: Mapping[str, Any], targets: Mapping[str, Any], names: Mapping[int, str]
) -> None:
    """Every state of ``states`` (file name -> loaded content) against its target in ``targets`` (file name ->
    optimizer or scheduler; the scaler needs none); ``names``: ``id(parameter)`` -> name, for messages."""
    for name, saved in states.items():
        _CHECKS[name](Path(folder) / name, saved, targets.get(name), names)
