"""The model part of a checkpoint: which of its files are weights, how they are written, checked and loaded.

Names (``WEIGHT_FILES``, shards, ``CONFIG_FILES``, ``TRAINING_ARGS_NAME``: ``hflight.checkpoints.names``) as
transformers writes and finds them, and each checkpoint form's own (``hflight.checkpoints.forms``);
:func:`save_model_files` writes them (``save_pretrained`` or a plain safetensors file, the processing
class, ``training_args.bin``). Loading (:func:`checked_weights`, :func:`load_model_weights`) checks everything before
anything is copied.

Key names and shapes are compared with the model first (read from the safetensors headers, so no tensor is
loaded for the check); only when every file, key and shape matches are the weights copied in. A rejected
checkpoint therefore leaves the model exactly as it was, and the error names the file. Single files
(``model.safetensors``, ``pytorch_model.bin``) and shards with their index (``model.safetensors.index.json``,
``pytorch_model.bin.index.json``) are supported, in transformers' order of preference; ``.bin`` files are read with
``weights_only=True``. Every file is reached through ``hflight.checkpoints.writers.files.regular_file``: a shard index
naming a path outside the folder, a symbolic link leading out of it or a file that is not a regular one is refused
before it is opened. The tensors then go in through the model's own ``load_state_dict`` (``strict=False``, one shard at
a time, as
transformers loads them), so a model that overrides it is not bypassed.

Keys the file leaves out because the model ties them to another parameter (``save_pretrained`` writes a tied
decoder weight once, as the embedding) are not missing: a key counts as present when any parameter sharing its
storage is in the file.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import pickle
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from transformers.utils import logging as hf_logging

from hflight.checkpoints.adapters import (
    adapter_files,
    checked_adapters,
    checked_sharded_adapter,
    is_adapter_file,
    is_peft_model,
)
from hflight.checkpoints.forms import own_weight_files, part_of_form
from hflight.checkpoints.names import (
    ADAPTER_WEIGHT_FILES,
    CONFIG_FILES,
    CONFIG_NAME,
    FSDP_MODEL_DIR,
    FSDP_MODEL_FILE,
    SAFE_WEIGHTS_NAME,
    SHARD_RE,
    TRAINING_ARGS_NAME,
    WEIGHT_FILES,
)
from hflight.checkpoints.sharded import (
    is_dcp_folder,
    is_sharded,
    read_full_model,
    set_full_model_state,
    tensor_shapes,
)
from hflight.checkpoints.writers.files import (
    IncompleteCheckpointError,
    UnsafeCheckpointFile,
    refused_pickle,
    regular_file,
    relative_name,
)

__all__ = [
    "CONFIG_FILES", "TRAINING_ARGS_NAME", "WEIGHT_FILES", "checked_weights", "deepspeed_left_alone",
    "is_sharded_run_form", "is_weight_file", "load_model_weights", "refused_pickle", "save_model_files",
    "saves_off_rank_zero", "weights_in_use",
]  # fmt: skip


def is_sharded_run_form(name: str) -> bool:
    """A checkpoint form's own file of the weights (FSDP's gathered ``pytorch_model_fsdp.bin``, its distributed
    checkpoint, DeepSpeed's partitions), beside or instead of the ``save_pretrained`` files."""
    return part_of_form(name) == "model"


def is_weight_file(name: str) -> bool:
    """A file of the model's weights: transformers' files and shards, a PEFT model's adapters, or a checkpoint form's
    own."""
    base = PurePosixPath(name).name
    return (
        name in WEIGHT_FILES
        or bool(SHARD_RE.match(base))
        or (is_adapter_file(name) and base in ADAPTER_WEIGHT_FILES)
        or is_sharded_run_form(name)
    )


def read_weight_map(index_file: Path) -> dict[str, str]:
    """The ``weight_map`` of a ``*.index.json`` (parameter name -> shard file), every shard name checked to lie
    inside the index's folder."""
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("'weight_map' must map parameter names to shard file names")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise IncompleteCheckpointError(f"Checkpoint index {index_file} is unreadable: {exc!r}") from exc
    for shard in set(weight_map.values()):
        relative_name(shard, str(index_file))
    return weight_map


def shard_names(index_file: Path) -> list[str]:
    """The shard files a ``*.index.json`` names (sorted), each checked to lie inside its folder."""
    return sorted(set(read_weight_map(index_file).values()))


def weights_in_use(folder: str | os.PathLike) -> list[str]:
    """The weight files a load reads, transformers' way: the first of ``WEIGHT_FILES`` present (an index with the
    shards it names), else a PEFT model's adapters (``hflight.checkpoints.adapters``), else a checkpoint form's own
    (``hflight.checkpoints.forms``: ``pytorch_model_fsdp.bin``, the files of ``pytorch_model_fsdp_0/``, DeepSpeed's
    partitions); empty when the folder has none."""
    for name in WEIGHT_FILES:
        path = regular_file(folder, name)
        if path is not None:
            return [name, *shard_names(path)] if name.endswith(".index.json") else [name]
    return adapter_files(folder) or own_weight_files(folder)


_hf_logger = hf_logging.get_logger("transformers.trainer")  # transformers' own line, as its Trainer writes it


def saved_processor(processing_class: Any, data_collator: Any) -> Any:
    """What ``Trainer._save`` saves beside the model: the processing class, else the data collator's tokenizer
    (transformers' fallback, with its log line), else nothing."""
    if processing_class is not None:
        return processing_class
    tokenizer = getattr(data_collator, "tokenizer", None)
    if data_collator is not None and tokenizer is not None:
        _hf_logger.info("Saving Trainer.data_collator.tokenizer by default as Trainer.processing_class is `None`")
    return tokenizer


def save_model_files(
    model: torch.nn.Module, processing_class: Any, output_dir: str, args: Any, state_dict: dict | None = None
) -> None:
    """The body of ``Trainer._save``: ``save_pretrained`` (safetensors) for transformers models, a bare safetensors
    state dict otherwise (``state_dict``: the weights to write instead of the model's own), the processing class and
    ``training_args.bin``. Changes nothing outside the folder (accelerate's unwrapping is the caller's
    :func:`deepspeed_left_alone`), nor the model unless this process is not global rank 0 (:func:`saves_off_rank_zero`:
    only the training loop's thread writes so).

    The processes that do not write (``args.should_save`` False) call it for a model transformers sharded at load time
    alone (:func:`~hflight._util.sharded_at_load`): its ``save_pretrained`` gathers the shards, a collective, and only
    the writer writes, as in transformers' ``_save``."""
    writes = args.should_save
    if writes:
        os.makedirs(output_dir, exist_ok=True)
    if hasattr(model, "save_pretrained"):
        with _writing_on_this_process(model):
            model.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True, is_main_process=writes)
    elif writes:
        from hflight.checkpoints.writers.safetensors_file import save_file

        state = {k: v.contiguous() for k, v in (state_dict or model.state_dict()).items()}
        save_file(state, os.path.join(output_dir, SAFE_WEIGHTS_NAME), metadata={"format": "pt"})
    if not writes:
        return
    if processing_class is not None and hasattr(processing_class, "save_pretrained"):
        processing_class.save_pretrained(output_dir)
    torch.save(args.to_transformers(), os.path.join(output_dir, TRAINING_ARGS_NAME))


class _Unwrapping:
    """accelerate's unwrapping (``extract_model_from_parallel``, which ``save_pretrained`` calls) imports DeepSpeed
    whenever it is installed, to ask whether the model is a ``DeepSpeedEngine`` (0.9 s here, in every process that
    saves a model). While :meth:`held`, it asks DeepSpeed only once DeepSpeed is imported (no engine exists before):
    the same answers, without the import. Re-entrant and thread-safe (held by several callers at once, in any
    order); accelerate's own function is back when the last one lets go."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._original: Callable[[], bool] | None = None

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self.take()
        try:
            yield
        finally:
            self.release()

    def take(self) -> None:
        import accelerate.utils.other as unwrapping

        with self._lock:
            if self._holders == 0:
                original = self._original = unwrapping.is_deepspeed_available
                unwrapping.is_deepspeed_available = lambda: "deepspeed" in sys.modules and original()
            self._holders += 1

    def release(self) -> None:
        import accelerate.utils.other as unwrapping

        with self._lock:
            self._holders -= 1
            if self._holders == 0:
                unwrapping.is_deepspeed_available = self._original


_UNWRAPPING = _Unwrapping()


def deepspeed_left_alone() -> contextlib.AbstractContextManager[None]:
    """For as long as the block runs, saving a model does not import DeepSpeed (see :class:`_Unwrapping`); taken on the
    training loop's thread: by ``save_model``, and by the background writer for the length of its job."""
    return _UNWRAPPING.held()


def saves_off_rank_zero() -> bool:
    """Whether this process, writing a model, is not global rank 0 (``save_on_each_node``'s other nodes):
    transformers 5.23's ``save_pretrained`` writes on global rank 0 only once ``torch.distributed`` is initialised
    (``should_save_on_this_rank``), so the model is told otherwise for the call (:func:`_writing_on_this_process`)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_rank() != 0


@contextlib.contextmanager
def _writing_on_this_process(model: torch.nn.Module) -> Iterator[None]:
    """The caller writes the model on this process (``args.should_save``). Off global rank 0 (which left the
    checkpoints of ``save_on_each_node``'s other nodes without their weights: not a checkpoint, so not resumed from)
    the model answers ``should_save_on_this_rank`` with ``is_main_process`` alone for the length of the call."""
    decides = getattr(model, "should_save_on_this_rank", None)
    if decides is None or "should_save_on_this_rank" in vars(model) or not saves_off_rank_zero():
        yield
        return
    model.should_save_on_this_rank = lambda is_main_process: is_main_process
    try:
        yield
    finally:
        del model.should_save_on_this_rank


_MAX_LISTED = 8


def _safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return {key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()}


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _read_bin(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise refused_pickle(path, exc, "tensors") from None
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise ValueError("it does not hold a state dict of tensors")
    return state


class _Source:
    """One weights file of a checkpoint: its key shapes (cheap) and its tensors (on demand)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tensors: dict[str, torch.Tensor] | None = None
        try:
            if path.suffix == ".safetensors":
                self.shapes = _safetensors_shapes(path)
            else:
                self._tensors = _read_bin(path)
                self.shapes = {k: tuple(v.shape) for k, v in self._tensors.items()}
        except UnsafeCheckpointFile:
            raise
        except Exception as exc:  # a truncated or foreign file: say which one
            raise ValueError(f"Checkpoint weights file {path} is corrupt or unreadable: {exc}") from exc

    def tensors(self) -> dict[str, torch.Tensor]:
        if self._tensors is not None:
            return self._tensors
        try:
            return _read_safetensors(self.path)
        except Exception as exc:
            raise ValueError(f"Checkpoint weights file {self.path} is corrupt or unreadable: {exc}") from exc


class _DistributedSource(_Source):
    """A ``pytorch_model_fsdp_0/`` folder (``torch.distributed.checkpoint``): key shapes from its metadata, the whole
    tensors read from every shard on demand (by this process alone)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tensors = None
        try:
            self.shapes = {key: shape for key, (shape, _) in tensor_shapes(path, "model").items()}
        except UnsafeCheckpointFile:
            raise
        except Exception as exc:
            raise ValueError(f"Checkpoint weights folder {path} is corrupt or unreadable: {exc}") from exc

    def tensors(self) -> dict[str, torch.Tensor]:
        try:
            return read_full_model(self.path)
        except UnsafeCheckpointFile:
            raise
        except Exception as exc:
            raise ValueError(f"Checkpoint weights folder {self.path} is corrupt or unreadable: {exc}") from exc


def _weights_file(folder: Path) -> Path:
    """The weights a load reads (transformers' order of preference, then a sharded run's forms); transformers' error
    text when there are none."""
    in_use = weights_in_use(folder)
    if not in_use:
        raise ValueError(
            f"Can't find a valid checkpoint at {folder}: no model weights file (looked for {', '.join(WEIGHT_FILES)}, "
            f"{FSDP_MODEL_FILE}, {FSDP_MODEL_DIR}/)."
        )
    first = in_use[0]
    return folder / (first.split("/", 1)[0] if "/" in first else first)


def _sources(weights: Path) -> list[_Source]:
    if weights.name.endswith(".index.json"):
        return _shard_sources(weights)
    return [_DistributedSource(weights) if is_dcp_folder(weights) else _Source(weights)]


def _shard_sources(index_file: Path) -> list[_Source]:
    weight_map = read_weight_map(index_file)  # shard names checked to lie inside the folder before any is opened
    shards = sorted(set(weight_map.values()))
    paths = {shard: regular_file(index_file.parent, shard, str(index_file)) for shard in shards}
    missing = [shard for shard, path in paths.items() if path is None]
    if missing:
        raise ValueError(f"Checkpoint index {index_file} names shard files that are not there: {missing}.")
    sources = [_Source(path) for path in paths.values()]
    for shard, source in zip(shards, sources):
        listed = {k for k, name in weight_map.items() if name == shard}
        if listed != set(source.shapes):
            raise ValueError(
                f"Shard {source.path} does not hold the keys {index_file.name} assigns to it "
                f"(differing: {sorted(listed ^ set(source.shapes))[:_MAX_LISTED]})."
            )
    return sources


def _tied_groups(model: torch.nn.Module) -> dict[str, set[str]]:
    """For each state-dict key, the keys that share its storage (itself included)."""
    state = model.state_dict(keep_vars=True)
    by_storage: dict[tuple[int, int], set[str]] = {}
    for key, tensor in state.items():
        if tensor.device.type == "meta" or tensor.numel() == 0 or type(tensor).__name__ == "DTensor" or isinstance(
            getattr(tensor, "data", None), torch.Tensor) and type(tensor.data).__name__ == "DTensor":  # fmt: skip
            by_storage.setdefault((id(tensor), 0), set()).add(key)  # a shard: tied parameters are one object
            continue
        by_storage.setdefault((tensor.untyped_storage().data_ptr(), tensor.storage_offset()), set()).add(key)
    return {key: group for group in by_storage.values() for key in group}


def check_weights(model: torch.nn.Module, sources: list[_Source], described: Path) -> None:
    """Raise a ValueError naming ``described`` unless the files' keys and shapes fit ``model`` exactly."""
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    found: dict[str, tuple[int, ...]] = {}
    for source in sources:
        found.update(source.shapes)
    groups = _tied_groups(model)
    missing = [k for k in expected if k not in found and not (groups.get(k, {k}) & found.keys())]
    unexpected = [k for k in found if k not in expected]
    resized = [k for k in expected if k in found and found[k] != expected[k]]
    mismatched = [f"{k}: {list(found[k])} in the file, {list(expected[k])} in the model" for k in resized]
    if resized and not (missing or unexpected) and _model_takes_shapes(model, sources, set(resized)):
        return  # the model's own loading adapts these tensors (it resizes a buffer, as transformers lets it)
    if missing or unexpected or mismatched:
        parts = [
            f"{label} {items[:_MAX_LISTED]}{' ...' if len(items) > _MAX_LISTED else ''}"
            for label, items in (("missing keys", missing), ("unexpected keys", unexpected), ("shapes", mismatched))
            if items
        ]
        raise ValueError(
            f"Checkpoint {described} does not match {type(model).__name__}: {'; '.join(parts)}. Was it written for "
            "another architecture or configuration? The model was left unchanged."
        )


def _model_takes_shapes(model: torch.nn.Module, sources: list[_Source], keys: set[str]) -> bool:
    """Whether the model's own ``load_state_dict`` takes the file's tensors of ``keys`` although their shapes differ
    from the model's (a model that resizes a buffer when it loads, as transformers' loading allows): tried on a copy
    of the model whose other tensors are on the meta device (no memory, the model untouched); any error: no."""
    memo: dict[int, Any] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        if key not in keys and id(tensor) not in memo:
            meta = torch.empty_like(tensor, device="meta")
            is_param = isinstance(tensor, torch.nn.Parameter)
            memo[id(tensor)] = torch.nn.Parameter(meta, requires_grad=tensor.requires_grad) if is_param else meta
    try:
        trial = copy.deepcopy(model, memo)
        tensors = {k: v for source in sources if keys & set(source.shapes) for k, v in source.tensors().items()}
        tensors = {k: v for k, v in tensors.items() if k in keys}
        with torch.no_grad():
            trial.load_state_dict(tensors, strict=False)
        after = trial.state_dict()
    except Exception:  # noqa: BLE001 - any failure of the trial means the model does not take them
        return False
    return all(k in after and tuple(after[k].shape) == tuple(tensors[k].shape) for k in keys)


def _check_architecture(model: torch.nn.Module, folder: Path) -> None:
    config_file = regular_file(folder, CONFIG_NAME)
    config = getattr(model, "config", None)
    if config is None or config_file is None:
        return
    try:
        saved = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"Checkpoint config {config_file} is not valid JSON: {exc}") from exc
    saved_arch = saved.get("architectures") if isinstance(saved, dict) else None
    expected = getattr(config, "architectures", None) or [type(model).__name__]
    # a model sharded by FSDP2 is of FSDP2's subclass of its class (FSDP<name>): its own class counts
    classes = {cls.__name__ for cls in type(model).__mro__}
    if saved_arch and not classes & set(saved_arch) and saved_arch != expected:
        raise ValueError(
            f"Checkpoint {folder} was written for {saved_arch}, not for {type(model).__name__}: "
            "resume with the same model class the checkpoint was trained with."
        )


def checked_weights(model: torch.nn.Module, folder: str | Path, resuming: bool = True) -> Callable[[], None]:
    """Check the weights in ``folder`` against ``model`` without touching it; return a function that copies them in.
    A PEFT model's adapters load as transformers loads them (``hflight.checkpoints.adapters``: ``resuming``, every
    adapter, else the best model's active one).

    Raises:
        ValueError: no weights file, an unreadable file, a config for another architecture, or keys/shapes that
            do not fit (the message names the file).
    """
    folder = Path(folder)
    weights = _weights_file(folder)
    if weights.name in ADAPTER_WEIGHT_FILES or weights.is_dir() and adapter_files(weights):
        if not is_peft_model(model):
            raise ValueError(
                f"Checkpoint {folder} holds PEFT adapters ({weights.name}), not a whole model, and "
                f"{type(model).__name__} is not a PEFT model: give the Trainer the model with its adapters "
                "(peft.get_peft_model(base, config), or PeftModel.from_pretrained(base, folder)), as when it was "
                "trained."
            )
        return checked_adapters(model, folder, resuming)
    _check_architecture(model, folder)
    sources = _sources(weights)
    if is_peft_model(model) and isinstance(sources[0], _DistributedSource):
        if not set(sources[0].shapes) <= model.state_dict().keys():  # (hflight wrote the whole model before)
            return _sharded_adapter(model, sources[0], weights)
    check_weights(model, sources, weights)

    def copy_in() -> None:
        for tensors in _each(sources):
            if is_sharded(model):  # whole tensors into a model sharded across processes: each keeps its shard
                set_full_model_state(model, tensors)
                continue
            with torch.no_grad():  # the model's own load_state_dict, as transformers calls it
                model.load_state_dict(tensors, strict=False)

    return copy_in


def _sharded_adapter(model: torch.nn.Module, source: _DistributedSource, weights: Path) -> Callable[[], None]:
    """A sharded checkpoint of a PEFT model as transformers writes it (the active adapter by PEFT's names:
    ``hflight.checkpoints.adapters.sharded_adapter_state``), checked; returns what copies it into the model's active
    adapter (the whole tensors, each process keeping its shards), as accelerate's ``load_fsdp_model`` with
    ``adapter_only=True`` does."""
    keys = checked_sharded_adapter(model, source.shapes, weights)

    def copy_in() -> None:
        tensors = {keys[name]: tensor for name, tensor in source.tensors().items()}
        if is_sharded(model):
            set_full_model_state(model, tensors)
            return
        with torch.no_grad():
            model.load_state_dict(tensors, strict=False)

    return copy_in


def _each(sources: list[_Source]) -> Iterator[dict[str, torch.Tensor]]:
    for source in sources:  # one shard in memory at a time
        yield source.tensors()


def load_model_weights(model: torch.nn.Module, folder: str | Path, resuming: bool = True) -> None:
    """Check, then load, a checkpoint's weights into ``model`` in place (see :func:`checked_weights`)."""
    checked_weights(model, folder, resuming)()
