"""``checkpoint-N`` folders: HF-loadable model files plus everything needed to continue exactly.

A checkpoint is written into ``.tmp-checkpoint-N`` and renamed to ``checkpoint-N`` only when complete, so a
process killed mid-save leaves nothing that ``get_last_checkpoint`` or a resume would pick. Folder contents:

- ``model.safetensors`` + ``config.json`` (``save_pretrained``), the processing class files, ``training_args.bin``
- ``trainer_state.json`` (``transformers.TrainerState.load_from_json`` reads it)
- ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt`` (mixed precision), ``rng_state.pth`` (``rng_state_{rank}.pth``
  with several processes): the same names transformers uses, so folders written by either trainer resume in both.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers.trainer_callback import ExportableState, TrainerState
from transformers.trainer_utils import SaveStrategy, rotate_checkpoints

if TYPE_CHECKING:
    from hflight.plan import TrainingPlan
    from hflight.trainer import Trainer

PREFIX = "checkpoint"
TRAINER_STATE_NAME = "trainer_state.json"
_CHECKPOINT_RE = re.compile(rf"^{PREFIX}-(\d+)$")
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def get_last_checkpoint(folder: str | os.PathLike) -> str | None:
    """The complete ``checkpoint-N`` folder with the largest N in ``folder``, or None.

    Only folders holding a ``trainer_state.json`` count, so a half-written folder is never returned.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return None
    found = [
        (int(m.group(1)), p)
        for p in folder.iterdir()
        if (m := _CHECKPOINT_RE.match(p.name)) and p.is_dir() and (p / TRAINER_STATE_NAME).is_file()
    ]
    return str(max(found)[1]) if found else None


# ---- writing ----------------------------------------------------------------------------------------------------
def save_model_files(model: torch.nn.Module, processing_class: Any, output_dir: str, args: Any) -> None:
    """``save_pretrained`` (safetensors) for transformers models, a bare safetensors state dict otherwise."""
    os.makedirs(output_dir, exist_ok=True)
    if hasattr(model, "save_pretrained"):
        model.save_pretrained(output_dir, safe_serialization=True)
    else:
        from safetensors.torch import save_file

        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(state, os.path.join(output_dir, "model.safetensors"), metadata={"format": "pt"})
    if processing_class is not None and hasattr(processing_class, "save_pretrained"):
        processing_class.save_pretrained(output_dir)
    torch.save(args.to_picklable(), os.path.join(output_dir, "training_args.bin"))


def _rng_states() -> dict[str, Any]:
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.random.get_rng_state_all()
    return states


def _rng_file(world_size: int, rank: int) -> str:
    return "rng_state.pth" if world_size <= 1 else f"rng_state_{rank}.pth"


def save_checkpoint(facade: Trainer) -> str:
    """Write ``checkpoint-{global_step}`` atomically, update the best checkpoint, rotate old ones."""
    args, state = facade.args, facade.state
    facade.store_flos()
    run_dir = args.output_dir
    name = f"{PREFIX}-{state.global_step}"
    final_dir = os.path.join(run_dir, name)
    tmp_dir = os.path.join(run_dir, f".tmp-{name}")
    world_size, rank = facade._world()
    is_main = facade.is_world_process_zero()
    backend = facade._backend()
    backend.hf_sync_to_host()
    if is_main:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        with facade._evaluation_weights():
            save_model_files(facade.model, facade.processing_class, tmp_dir, args)
        backend.hf_save_files(tmp_dir)
        for callback in facade._weight_hooks("save_checkpoint_state"):
            callback.save_checkpoint_state(tmp_dir, facade.model)
    facade._barrier()
    os.makedirs(tmp_dir, exist_ok=True)
    if not args.save_only_model:
        if is_main:
            torch.save(facade.optimizer.state_dict(), os.path.join(tmp_dir, "optimizer.pt"))
            torch.save(facade.lr_scheduler.state_dict(), os.path.join(tmp_dir, "scheduler.pt"))
            scaler = getattr(facade._lightning_trainer.precision_plugin, "scaler", None)
            if scaler is not None:
                torch.save(scaler.state_dict(), os.path.join(tmp_dir, "scaler.pt"))
        torch.save(_rng_states(), os.path.join(tmp_dir, _rng_file(world_size, rank)))
    if args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) and state.best_global_step:
        best_dir = os.path.join(run_dir, f"{PREFIX}-{state.best_global_step}")
        if state.best_global_step == state.global_step or os.path.exists(best_dir):
            state.best_model_checkpoint = best_dir
    facade._barrier()
    if is_main:
        for callback in facade.callback_handler.callbacks + [facade.control]:
            if isinstance(callback, ExportableState):
                _store_callback_state(state, callback)
        state.save_to_json(os.path.join(tmp_dir, TRAINER_STATE_NAME))
        if os.path.exists(final_dir):
            shutil.rmtree(final_dir)
        os.replace(tmp_dir, final_dir)
        rotate_checkpoints(run_dir, args.save_total_limit, state.best_model_checkpoint, use_mtime=False)
    facade._barrier()
    return final_dir


def _store_callback_state(state: TrainerState, callback: ExportableState) -> None:
    name = type(callback).__name__
    existing = state.stateful_callbacks.get(name)
    if isinstance(existing, list):
        existing.append(callback.state())
    else:
        state.stateful_callbacks[name] = callback.state()


# ---- best model -------------------------------------------------------------------------------------------------
def metric_key(key: str, metrics: dict[str, float]) -> str:
    """``key`` if ``metrics`` has it, else a KeyError listing the metrics there are."""
    if key not in metrics:
        raise KeyError(
            f"The `metric_for_best_model` training argument is set to '{key}', which is not found in the evaluation "
            f"metrics. The available evaluation metrics are: {list(metrics.keys())}. Consider changing the "
            "`metric_for_best_model` via the TrainingArguments."
        )
    return key


def update_best_metric(facade: Trainer, metrics: dict[str, float]) -> bool:
    """HF's ``_determine_best_metric``: track the best value and its step; True if this evaluation is the best."""
    args, state = facade.args, facade.state
    if args.metric_for_best_model is None:
        return False
    key = args.metric_for_best_model
    key = metric_key(key if key.startswith("eval_") else f"eval_{key}", metrics)
    value = metrics[key]
    better = np.greater if args.greater_is_better else np.less
    if state.best_metric is None:
        state.best_metric = float("-inf") if args.greater_is_better else float("inf")
    if better(value, state.best_metric):
        state.best_metric = value
        if args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST):
            state.best_global_step = state.global_step
        return True
    return False


def load_model_weights(model: torch.nn.Module, folder: str) -> None:
    """Load a checkpoint's weights into ``model`` in place; errors name the file and the mismatching keys."""
    path = Path(folder)
    files = [path / f for f in WEIGHT_FILES if (path / f).is_file()]
    if not files:
        raise ValueError(f"Can't find a model weights file in {folder} (looked for {', '.join(WEIGHT_FILES)}).")
    weights = files[0]
    if weights.name.endswith(".index.json"):
        from transformers.modeling_utils import load_sharded_checkpoint

        load_sharded_checkpoint(model, folder, strict=True)
        return
    try:
        if weights.suffix == ".safetensors":
            from safetensors.torch import load_file

            state_dict = load_file(str(weights))
        else:
            state_dict = torch.load(weights, map_location="cpu", weights_only=True)
    except Exception as exc:  # corrupt or truncated file
        raise ValueError(f"Checkpoint weights file {weights} is corrupt or unreadable: {exc}") from exc
    _check_architecture(model, path)
    result = model.load_state_dict(state_dict, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"Checkpoint {weights} does not match {type(model).__name__}: missing keys {missing[:10]}, "
            f"unexpected keys {result.unexpected_keys[:10]}. Was it written for another architecture?"
        )


def _check_architecture(model: torch.nn.Module, folder: Path) -> None:
    config_file = folder / "config.json"
    config = getattr(model, "config", None)
    if config is None or not config_file.is_file():
        return
    try:
        saved = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"Checkpoint config {config_file} is not valid JSON: {exc}") from exc
    expected = getattr(config, "architectures", None) or [type(model).__name__]
    saved_arch = saved.get("architectures")
    if saved_arch and type(model).__name__ not in saved_arch and saved_arch != expected:
        raise ValueError(
            f"Checkpoint {folder} was written for {saved_arch}, not for {type(model).__name__}: "
            "resume with the same model class the checkpoint was trained with."
        )


def load_best_model(facade: Trainer) -> None:
    best = facade.state.best_model_checkpoint
    load_model_weights(facade.model, best)


def finalize_rotation(facade: Trainer) -> None:
    """With ``save_total_limit=1`` and a best checkpoint, HF keeps only the best one at the end."""
    args, state = facade.args, facade.state
    if not (facade.is_world_process_zero() and state.best_model_checkpoint and args.save_total_limit == 1):
        return
    for folder in Path(args.output_dir).glob(f"{PREFIX}-*"):
        if folder.is_dir() and not os.path.samefile(folder, state.best_model_checkpoint):
            shutil.rmtree(folder, ignore_errors=True)


# ---- resuming -------------------------------------------------------------------------------------------------
def resolve_resume(facade: Trainer, resume: str | bool | None) -> str | None:
    """The checkpoint folder to resume from (``True``: the last one in ``output_dir``), with its weights loaded."""
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
    if not (folder / TRAINER_STATE_NAME).is_file():
        raise ValueError(
            f"Checkpoint {folder} has no {TRAINER_STATE_NAME}: it is incomplete (interrupted while saving?) or not a "
            "Trainer checkpoint."
        )
    load_model_weights(facade.model, str(folder))
    for callback in facade._weight_hooks("load_checkpoint_state"):
        callback.load_checkpoint_state(str(folder), facade.model)
    return str(folder)


def restore_state(facade: Trainer, plan: TrainingPlan) -> tuple[int, int]:
    """Load ``TrainerState`` and callback states from the resume folder; (epochs trained, batches to skip)."""
    folder = getattr(facade, "_resume", None)
    if folder is None:
        return 0, 0
    state_file = os.path.join(folder, TRAINER_STATE_NAME)
    try:
        facade.state = TrainerState.load_from_json(state_file)
    except (json.JSONDecodeError, TypeError) as exc:
        raise ValueError(f"{state_file} is corrupt: {exc}") from exc
    state = facade.state
    if state.best_model_checkpoint is not None and not os.path.isdir(state.best_model_checkpoint):
        state.best_model_checkpoint = None
    _restore_callback_states(facade)
    return plan.resume_position(state.global_step, facade.args.ignore_data_skip)


def _restore_callback_states(facade: Trainer) -> None:
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


def restore_optimizer(facade: Trainer) -> None:
    """Optimizer, scheduler and scaler states, once Lightning built them (HF file names)."""
    folder = getattr(facade, "_resume", None)
    if folder is None:
        return
    for name, target in (("optimizer.pt", facade.optimizer), ("scheduler.pt", facade.lr_scheduler)):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            try:
                target.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
            except Exception as exc:
                raise ValueError(f"Cannot restore {path}: {exc}") from exc
    scaler = getattr(facade._lightning_trainer.precision_plugin, "scaler", None)
    scaler_file = os.path.join(folder, "scaler.pt")
    if scaler is not None and os.path.isfile(scaler_file):
        scaler.load_state_dict(torch.load(scaler_file, map_location="cpu", weights_only=True))


def load_rng_state(facade: Trainer) -> None:
    """Python, numpy and torch RNG streams as they were when the checkpoint was written."""
    folder = getattr(facade, "_resume", None)
    if folder is None:
        return
    world_size, rank = facade._world()
    path = os.path.join(folder, _rng_file(world_size, rank))
    if not os.path.isfile(path):
        return
    states = torch.load(path, map_location="cpu", weights_only=False)
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.random.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        cuda = states["cuda"]
        torch.cuda.random.set_rng_state_all(cuda) if isinstance(
            cuda, (list, tuple)
        ) else torch.cuda.random.set_rng_state(cuda)
