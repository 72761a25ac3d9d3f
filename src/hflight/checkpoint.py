"""``checkpoint-N`` folders: HF-loadable model files plus everything needed to continue exactly, written so that a
checkpoint is complete or does not exist.

Writing (:func:`save_checkpoint`): every file goes into ``.tmp-checkpoint-N``; ``checkpoint_manifest.json`` (each
file with its size, and the arguments that fix the data position) is written last; then the folder is renamed to
``checkpoint-N``. Re-saving an existing ``checkpoint-N`` moves the old folder aside (``.tmp-checkpoint-N.replaced``),
renames the new one in and only then deletes the old one. A process killed at any point therefore leaves
``checkpoint-N`` either complete (old or new) or absent, never partial; leftover ``.tmp-checkpoint-*`` folders are
removed when the next training starts (:func:`remove_stale_folders`).

Reading (:func:`verify_checkpoint`): a folder with a manifest counts only when every file it lists is there with
its recorded size. A folder without one (written by ``transformers.Trainer``, which writes ``trainer_state.json``
last, or by an older hflight) counts when it has ``trainer_state.json``.

Folder contents, the names transformers uses, so folders written by either trainer resume in both:

- ``model.safetensors`` (or shards and ``model.safetensors.index.json``) + ``config.json`` (``save_pretrained``),
  the processing class files, ``training_args.bin`` (written for transformers; hflight never loads it)
- ``trainer_state.json`` (``transformers.TrainerState.load_from_json`` reads it)
- ``optimizer.pt``, ``scheduler.pt``, ``scaler.pt`` (mixed precision), ``rng_state.pth`` (``rng_state_{rank}.pth``
  with several processes); none of them with ``save_only_model``
- ``checkpoint_manifest.json`` (hflight's own)
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers.trainer_callback import ExportableState, TrainerState
from transformers.trainer_utils import SaveStrategy, rotate_checkpoints

from hflight import console
from hflight.surface import RunView, TrainerSurface

logger = logging.getLogger(__name__)

PREFIX = "checkpoint"
TRAINER_STATE_NAME = "trainer_state.json"
MANIFEST_NAME = "checkpoint_manifest.json"
MANIFEST_FORMAT = "hflight-checkpoint"
MANIFEST_VERSION = 1
TMP_PREFIX = ".tmp-"
REPLACED_SUFFIX = ".replaced"
OPTIMIZER_NAME, SCHEDULER_NAME, SCALER_NAME = "optimizer.pt", "scheduler.pt", "scaler.pt"
_CHECKPOINT_RE = re.compile(rf"^{PREFIX}-(\d+)$")
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# The arguments that decide which examples a resumed run sees next and how global steps map onto batches.
RUN_ARGUMENTS = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "world_size",
    "seed",
    "data_seed",
    "train_sampling_strategy",
    "dataloader_drop_last",
    "num_examples",
)


class IncompleteCheckpointError(ValueError):
    """A checkpoint folder lacks files (or has truncated ones): interrupted while saving, or damaged since."""


# ---- what counts as a checkpoint ----------------------------------------------------------------------------------
def read_manifest(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The folder's manifest, or None when it has none; a manifest that cannot be read raises, naming the file."""
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise IncompleteCheckpointError(f"Checkpoint manifest {path} is unreadable: {exc}") from exc
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != MANIFEST_FORMAT
        or not isinstance(files, dict)
        or not all(isinstance(k, str) and type(v) is int for k, v in files.items())
    ):
        raise IncompleteCheckpointError(
            f"Checkpoint manifest {path} is not an hflight manifest (expected format {MANIFEST_FORMAT!r} and a "
            "'files' mapping of file name to size)."
        )
    version = manifest.get("version")
    if type(version) is not int or version > MANIFEST_VERSION:
        raise IncompleteCheckpointError(
            f"Checkpoint manifest {path} has version {version!r}; this hflight reads versions 1 to "
            f"{MANIFEST_VERSION} (a newer hflight wrote it?)."
        )
    return manifest


def verify_checkpoint(folder: str | os.PathLike) -> dict[str, Any] | None:
    """Check that ``folder`` is a complete checkpoint; return its manifest (None for a folder without one).

    Raises:
        IncompleteCheckpointError: naming every missing or truncated file (or the missing ``trainer_state.json``
            of a folder without a manifest).
    """
    folder = Path(folder)
    manifest = read_manifest(folder)
    if manifest is None:
        if not (folder / TRAINER_STATE_NAME).is_file():
            raise IncompleteCheckpointError(
                f"Checkpoint {folder} has no {TRAINER_STATE_NAME}: it is incomplete (interrupted while saving?) or "
                "not a Trainer checkpoint."
            )
        return None
    problems = []
    for name, size in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            problems.append(f"no {name}")
        elif path.stat().st_size != size:
            problems.append(f"{name} is corrupt or truncated ({path.stat().st_size} bytes, {size} when saved)")
    if problems:
        raise IncompleteCheckpointError(
            f"Checkpoint {folder} is incomplete: {'; '.join(problems)} (files listed in its {MANIFEST_NAME}; if "
            "they were changed on purpose, delete the manifest to resume from the folder as it is)."
        )
    return manifest


def get_last_checkpoint(folder: str | os.PathLike) -> str | None:
    """The complete ``checkpoint-N`` folder with the largest N in ``folder``, or None.

    Incomplete folders (see :func:`verify_checkpoint`) are skipped with a warning that says what they lack.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return None
    candidates = sorted(
        ((int(m.group(1)), p) for p in folder.iterdir() if (m := _CHECKPOINT_RE.match(p.name)) and p.is_dir()),
        reverse=True,
    )
    for _, path in candidates:
        try:
            verify_checkpoint(path)
        except IncompleteCheckpointError as exc:
            logger.warning(f"Skipping {path.name}: {exc}")
            continue
        return str(path)
    return None


def remove_stale_folders(output_dir: str | os.PathLike, keep: str | None = None) -> list[str]:
    """Delete the ``.tmp-checkpoint-*`` folders an interrupted save left in ``output_dir`` (except ``keep``)."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    removed = []
    keep_path = Path(keep).resolve() if keep else None
    for path in sorted(folder.glob(f"{TMP_PREFIX}{PREFIX}-*")):
        if path.is_dir() and path.resolve() != keep_path:
            shutil.rmtree(path, ignore_errors=True)
            logger.warning(f"Removed {path}: left behind by a checkpoint save that was interrupted.")
            removed.append(str(path))
    return removed


# ---- writing --------------------------------------------------------------------------------------------------------
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
    torch.save(args.to_transformers(), os.path.join(output_dir, "training_args.bin"))


def save_model(facade: TrainerSurface, output_dir: str, backend: Any) -> None:
    """``Trainer.save_model``: the host weights made current (``backend``: the strategy's hooks), then, on the main
    process, the model files and the backend's own files."""
    backend.hf_sync_to_host()
    if facade.is_world_process_zero():
        console.saving_checkpoint(output_dir)
        save_model_files(facade.model, facade.processing_class, output_dir, facade.args)
        backend.hf_save_files(output_dir)


def _rng_states() -> dict[str, Any]:
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.random.get_rng_state_all()
    return states


def rng_file_name(world_size: int, rank: int) -> str:
    return "rng_state.pth" if world_size <= 1 else f"rng_state_{rank}.pth"


def run_arguments(args: Any, world_size: int, plan: Any) -> dict[str, Any]:
    """The values of :data:`RUN_ARGUMENTS` for the running ``train()`` (recorded in the manifest); ``plan`` is the
    run's ``TrainingPlan`` (None before the fit planned it)."""
    values = {name: getattr(args, name, None) for name in RUN_ARGUMENTS}
    strategy = args.train_sampling_strategy
    values["train_sampling_strategy"] = str(getattr(strategy, "value", strategy))
    values["world_size"] = world_size
    values["num_examples"] = plan.num_examples if plan is not None else None
    return values


def save_checkpoint(facade: TrainerSurface, run: RunView) -> str:
    """Write ``checkpoint-{global_step}`` atomically, update the best checkpoint, rotate old ones."""
    args, state, world = facade.args, facade.state, run.world
    facade.store_flos()
    run_dir = args.output_dir
    name = f"{PREFIX}-{state.global_step}"
    final_dir = os.path.join(run_dir, name)
    tmp_dir = os.path.join(run_dir, f"{TMP_PREFIX}{name}")
    is_main = facade.is_world_process_zero()
    if is_main:
        console.saving_checkpoint(final_dir)
        shutil.rmtree(tmp_dir, ignore_errors=True)
    _write_model_files(facade, run, tmp_dir, is_main)
    world.barrier()
    os.makedirs(tmp_dir, exist_ok=True)
    if not args.save_only_model:
        _write_training_state(facade, run, tmp_dir, is_main)
    if args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) and state.best_global_step:
        best_dir = os.path.join(run_dir, f"{PREFIX}-{state.best_global_step}")
        if state.best_global_step == state.global_step or os.path.exists(best_dir):
            state.best_model_checkpoint = best_dir
    world.barrier()
    if is_main:
        for callback in facade.callback_handler.callbacks + [facade.control]:
            if isinstance(callback, ExportableState):
                _store_callback_state(state, callback)
        state.save_to_json(os.path.join(tmp_dir, TRAINER_STATE_NAME))
        run_args = run_arguments(args, world.size, run.plan)
        write_manifest(tmp_dir, state.global_step, bool(args.save_only_model), run_args)
        publish(tmp_dir, final_dir)
        rotate_checkpoints(run_dir, args.save_total_limit, state.best_model_checkpoint, use_mtime=False)
    world.barrier()
    return final_dir


def _write_model_files(facade: TrainerSurface, run: RunView, folder: str, is_main: bool) -> None:
    """The model (with the weights evaluation uses), the backend's files and the weight-protocol callbacks' files."""
    backend = run.backend
    backend.hf_sync_to_host()
    if not is_main:
        return
    with run.evaluation_weights():
        save_model_files(facade.model, facade.processing_class, folder, facade.args)
    backend.hf_save_files(folder)
    for callback in run.weight_hooks("save_checkpoint_state"):
        callback.save_checkpoint_state(folder, facade.model)


def _write_training_state(facade: TrainerSurface, run: RunView, folder: str, is_main: bool) -> None:
    """Optimizer, scheduler and scaler (main process), and this process's RNG states."""
    if is_main:
        torch.save(facade.optimizer.state_dict(), os.path.join(folder, OPTIMIZER_NAME))
        torch.save(facade.lr_scheduler.state_dict(), os.path.join(folder, SCHEDULER_NAME))
        scaler = getattr(run.lightning_trainer.precision_plugin, "scaler", None)
        if scaler is not None:
            torch.save(scaler.state_dict(), os.path.join(folder, SCALER_NAME))
    torch.save(_rng_states(), os.path.join(folder, rng_file_name(run.world.size, run.world.rank)))


def write_manifest(folder: str, global_step: int, save_only_model: bool, run: dict[str, Any]) -> None:
    """List every file of ``folder`` with its size; written last, so its presence means the rest is there."""
    root = Path(folder)
    files = {
        p.relative_to(root).as_posix(): p.stat().st_size
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME
    }
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "global_step": global_step,
        "save_only_model": save_only_model,
        "run": run,
        "files": files,
    }
    (root / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def publish(tmp_dir: str, final_dir: str) -> None:
    """Rename the complete ``tmp_dir`` to ``final_dir``; an existing ``final_dir`` is deleted only afterwards."""
    replaced = os.path.join(os.path.dirname(final_dir), f"{TMP_PREFIX}{os.path.basename(final_dir)}{REPLACED_SUFFIX}")
    if os.path.exists(final_dir):
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final_dir, replaced)
    os.replace(tmp_dir, final_dir)
    shutil.rmtree(replaced, ignore_errors=True)


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


def update_best_metric(args: Any, state: TrainerState, metrics: dict[str, float]) -> bool:
    """HF's ``_determine_best_metric``: track the best value and its step; True if this evaluation is the best."""
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


def finalize_rotation(args: Any, state: TrainerState, is_main: bool) -> None:
    """With ``save_total_limit=1`` and a best checkpoint, HF keeps only the best one at the end (main process)."""
    if not (is_main and state.best_model_checkpoint and args.save_total_limit == 1):
        return
    for folder in Path(args.output_dir).glob(f"{PREFIX}-*"):
        if folder.is_dir() and not os.path.samefile(folder, state.best_model_checkpoint):
            shutil.rmtree(folder, ignore_errors=True)
