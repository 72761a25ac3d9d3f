"""PEFT adapters as a checkpoint's model files, written and loaded as transformers' Trainer does.

A PEFT model's ``save_pretrained`` (what ``save_model`` calls) writes its adapters, not the frozen base model: the
first adapter (``"default"``) as ``adapter_model.safetensors`` with its ``adapter_config.json`` at the top of the
folder, every other adapter in a subfolder named after it. transformers' Trainer resumes such a checkpoint with
``load_adapter`` (the active adapter trainable; with adapters in subfolders, each loaded under its folder's name and
the active one set again), and so does hflight. At the end (``load_best_model_at_end``) transformers reads only the
top file, into the active adapter: an adapter not named ``"default"`` (PEFT writes it in its subfolder) is not
loaded (a warning), and with several the top file is another adapter's; hflight loads the active adapter, and the
model's others, each from where PEFT wrote it. Both are done after checking every adapter file it will read against
the model before anything changes: the file's keys and shapes are those the model's adapter of that name would save
(PEFT's ``get_peft_model_state_dict``, the names ``save_pretrained`` writes), and an adapter the model lacks must
come with its ``adapter_config.json`` (PEFT adds it from there, as ``load_adapter`` does). A file that does not fit
raises a ``ValueError`` naming it, the model left as it was.

May import: ``hflight.checkpoints.writers.files``, ``hflight.checkpoints.names``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hflight.checkpoints.names import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHT_FILES
from hflight.checkpoints.writers.files import regular_file

logger = logging.getLogger(__name__)

_MAX_LISTED = 5


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a PEFT model (transformers' test: PEFT installed, an instance of its model classes)."""
    from transformers.trainer_utils import _is_peft_model

    return _is_peft_model(model)


def _adapter_file(folder: str | os.PathLike) -> str | None:
    """The adapter weights directly in ``folder`` (safetensors first, as PEFT reads them)."""
    return next((name for name in ADAPTER_WEIGHT_FILES if regular_file(folder, name) is not None), None)


def adapter_subfolders(folder: str | os.PathLike) -> list[str]:
    """The subfolders of ``folder`` holding an adapter (transformers' test: an adapter weights file in it)."""
    if not os.path.isdir(folder):
        return []
    return sorted(e.name for e in os.scandir(folder) if e.is_dir(follow_symlinks=False) and _adapter_file(e.path))


def adapter_files(folder: str | os.PathLike) -> list[str]:
    """The adapter weight files of ``folder`` a load reads (as a manifest names them): the top one, then each
    subfolder's; empty when there are none."""
    top = _adapter_file(folder)
    nested = [f"{name}/{_adapter_file(os.path.join(folder, name))}" for name in adapter_subfolders(folder)]
    return ([top] if top else []) + nested


def is_adapter_file(name: str) -> bool:
    """A file of a checkpoint's adapters (weights or config; ``name`` as a manifest names it: at the top, or one
    subfolder down)."""
    parts = name.split("/")
    return len(parts) <= 2 and parts[-1] in (*ADAPTER_WEIGHT_FILES, ADAPTER_CONFIG_NAME)


def held_adapters(folder: str | os.PathLike) -> dict[str, Path]:
    """The adapters ``folder`` holds, as PEFT's ``save_pretrained`` writes them: name -> the folder of its file
    (``"default"`` at the top, every other adapter in the subfolder named after it)."""
    folder = Path(folder)
    top = {"default": folder} if _adapter_file(folder) else {}
    return {**top, **{name: folder / name for name in adapter_subfolders(folder)}}


def _loads(model: Any, folder: Path, resuming: bool) -> list[tuple[Path, str, bool]]:
    """The loads of ``folder``'s adapters into ``model``: (adapter folder, adapter name, trainable), in order.

    ``resuming``: transformers' ``_load_from_checkpoint``'s (a lone file at the top into the active adapter,
    trainable; else every adapter under its own name, the active one trainable). At the end (``_load_best_model``) a
    lone file at the top goes into the active adapter too; with adapters in subfolders (an adapter not named
    ``"default"``, or several), where transformers reads only the top file into the active adapter (it warns and
    loads nothing when the top has none, and reads another adapter's file into it when it has one), each adapter of
    the model the folder holds is loaded from where PEFT wrote it (a frozen one gets back the weights it has), so that
    the best weights are the model's; empty when the folder has no file for the active adapter.
    """
    active = model.active_adapters[0]
    subfolders = adapter_subfolders(folder)
    if not subfolders:
        return [(folder, active, resuming)]
    held = held_adapters(folder)
    if resuming:
        return [(where, name, name == active) for name, where in held.items()]
    if active not in held:
        return []
    return [(where, name, False) for name, where in held.items() if name in model.peft_config]


def _saved_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118 - not a dict
    return {key: tuple(value.shape) for key, value in torch.load(path, map_location="cpu", weights_only=True).items()}


def _check_adapter(model: Any, folder: Path, name: str) -> None:
    """Raise a ValueError naming the file unless ``folder``'s adapter fits the model's adapter ``name``."""
    from peft import get_peft_model_state_dict

    weights = folder / _adapter_file(folder)
    if name not in model.peft_config:
        if regular_file(folder, ADAPTER_CONFIG_NAME) is None:
            raise ValueError(f"Checkpoint adapter {weights} has no {ADAPTER_CONFIG_NAME} beside it: it cannot be added "
                             f"to the model as adapter {name!r}.")  # fmt: skip
        return  # a new adapter: PEFT builds it from that config, then loads the file into it
    try:
        found = _saved_shapes(weights)
    except Exception as exc:
        raise ValueError(f"Checkpoint adapter {weights} is corrupt or unreadable: {exc}") from exc
    expected = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(model, adapter_name=name).items()}
    _check_shapes(expected, found, weights, name)


def _check_shapes(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], weights: Path,
                  name: str) -> None:  # fmt: skip
    """Raise a ValueError naming ``weights`` unless the keys and shapes ``found`` there are those ``expected`` of
    the model's adapter ``name``."""
    resized = [f"{k}: {list(found[k])} in the file, {list(v)} in the model" for k, v in expected.items()
               if k in found and found[k] != v]  # fmt: skip
    differing = [
        f"{label} {items[:_MAX_LISTED]}"
        for label, items in (
            ("missing keys", sorted(set(expected) - set(found))),
            ("unexpected keys", sorted(set(found) - set(expected))),
            ("shapes", resized),
        )
        if items
    ]
    if differing:
        raise ValueError(
            f"Checkpoint adapter {weights} does not match the model's adapter {name!r}: {'; '.join(differing)}. Was it "
            "written for another base model or adapter configuration? The model was left unchanged."
        )


def checked_adapters(model: Any, folder: str | os.PathLike, resuming: bool) -> Callable[[], None]:
    """Check ``folder``'s adapters against the PEFT ``model`` without touching it; return what loads them (see
    :func:`_loads`): ``resuming`` (``_load_from_checkpoint``) every adapter, the active one trainable, as transformers'
    Trainer does; otherwise (``load_best_model_at_end``) the active adapter, and the model's others, from where PEFT
    wrote them."""
    folder = Path(folder)
    loads = _loads(model, folder, resuming)
    set_again = resuming and bool(adapter_subfolders(folder))  # transformers sets the active adapter again then
    if not loads:
        logger.warning(f"Checkpoint {folder} holds no adapter named {model.active_adapters[0]!r} (the model's active "
                       f"adapter; it holds {sorted(held_adapters(folder))}): the best model's adapters were not "
                       "loaded, the model keeps its last weights.")  # fmt: skip
    for where, name, _ in loads:
        _check_adapter(model, where, name)

    def load() -> None:
        active = model.active_adapters[0]
        for where, name, trainable in loads:
            model.load_adapter(str(where), name, is_trainable=trainable)
        if set_again:
            model.set_adapter(active)

    return load


# ---- the adapters of a sharded checkpoint (FSDP2's SHARDED_STATE_DICT) ---------------------------------------------
def sharded_adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """What transformers writes of a PEFT model into an FSDP2 sharded checkpoint's ``pytorch_model_fsdp_0/``
    (accelerate's ``save_fsdp_model`` with ``adapter_only=True``): the active adapter's tensors by PEFT's names
    (``get_peft_model_state_dict``: without the adapter's name), each process its shards; the frozen base is not
    written."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(model, adapter_name=model.active_adapter)


def adapter_keys(model: Any) -> dict[str, str]:
    """Each name of :func:`sharded_adapter_state` -> the model's own state-dict key for the same tensor."""
    from peft import get_peft_model_state_dict

    state = model.state_dict(keep_vars=True)
    keys: dict[int, str] = {}
    for key, tensor in state.items():
        keys.setdefault(id(tensor), key)
    named = get_peft_model_state_dict(model, state_dict=state, adapter_name=model.active_adapter)
    return {name: keys[id(tensor)] for name, tensor in named.items() if id(tensor) in keys}


def checked_sharded_adapter(model: Any, found: dict[str, tuple[int, ...]], weights: Path) -> dict[str, str]:
    """Check a sharded checkpoint's adapter (its keys and whole shapes ``found``, as :func:`sharded_adapter_state`
    writes them) against the model's active adapter, naming ``weights``; return PEFT's name -> the model's key."""
    keys = adapter_keys(model)
    state = model.state_dict()
    _check_shapes({name: tuple(state[key].shape) for name, key in keys.items()}, found, weights, model.active_adapter)
    return keys
