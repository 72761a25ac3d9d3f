"""The states of a sharded run (FSDP2's ``fully_shard``: DTensor parameters), as ``hflight.checkpoints.forms`` writes
and reads them: whole or sharded state dicts through torch's distributed state-dict API, and
``torch.distributed.checkpoint`` folders, read safely.

Reading goes by what the folder holds, not by how the run that reads it is sharded, so each form resumes on any number
of processes, sharded or not: a distributed checkpoint is read into whole tensors (the model before training starts,
as every process holds it then) or into the run's own shards (the optimizer, once the run built it), and
``torch.distributed.checkpoint`` reshards on the way. Nothing in a checkpoint may run code: the ``.metadata`` pickle is
read with an unpickler that admits only ``torch.distributed.checkpoint``'s metadata classes (torch's own reader
unpickles anything), and the non-tensor entries (an optimizer's hyperparameters) with ``torch.load(weights_only=True)``.
Nor may it read anything but its own files: every storage entry's file (``_StorageInfo.relative_path``, which torch's
reader joins to the folder as it is) must be a regular file inside the folder, or the metadata is refused.
"""

from __future__ import annotations

import io
import logging
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from hflight.checkpoints.names import DCP_METADATA, DCP_SHARDS
from hflight.checkpoints.writers.files import UnsafeCheckpointFile, regular_file

logger = logging.getLogger(__name__)

#: the top-level keys under which transformers' folders hold the states
MODEL_KEY, OPTIMIZER_KEY = "model", "optimizer"


def is_dcp_folder(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and (path / DCP_METADATA).is_file()


def dcp_files(folder: Path) -> list[str]:
    """The regular files of a distributed-checkpoint folder, as ``<folder name>/<file>`` (what a manifest lists)."""
    return sorted(f"{folder.name}/{p.name}" for p in folder.iterdir() if p.is_file() and not p.is_symlink())


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are sharded across processes (DTensors: FSDP2, tensor parallelism)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


# ---- reading ---------------------------------------------------------------------------------------------------------
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    """Admits the classes a ``.metadata`` file refers to (and torch's dtypes), nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name}")


def read_metadata(folder: Path) -> Any:
    """The ``torch.distributed.checkpoint`` metadata of ``folder``, unpickled safely.

    Raises:
        UnsafeCheckpointFile: the file refers to anything but the metadata classes, or an entry is stored in a file
            outside ``folder`` (an absolute path, ``..``, a symbolic link elsewhere) or in something other than a
            regular file.
        ValueError: it cannot be read.
    """
    path = folder / DCP_METADATA
    try:
        with open(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointFile(
            f"{path} cannot be loaded safely: {exc}. hflight never unpickles arbitrary objects from a checkpoint."
        ) from None
    except Exception as exc:
        raise ValueError(f"{path} is not a readable torch.distributed.checkpoint metadata file: {exc}") from exc
    _check_storage(metadata, folder, path)
    return metadata


def _check_storage(metadata: Any, folder: Path, path: Path) -> None:
    """Every storage entry of ``metadata`` (read from ``path``) is stored in a regular file inside ``folder``: torch's
    reader opens ``folder / relative_path`` as it is."""
    storage = getattr(metadata, "storage_data", None)
    if storage is None:
        return
    if not isinstance(storage, dict):
        raise ValueError(f"{path}: storage_data must map entries to their files, got {type(storage).__name__}.")
    checked: set[Any] = set()
    for index, info in storage.items():
        relative = getattr(info, "relative_path", None)
        if isinstance(relative, str) and relative in checked:
            continue
        entry = getattr(index, "fqn", index)
        where = f"{path} (the entry {entry!r})"
        try:
            regular_file(folder, relative, where)  # type: ignore[arg-type]
        except UnsafeCheckpointFile as exc:
            message = str(exc)
            raise UnsafeCheckpointFile(message if message.startswith(where) else f"{where}: {message}") from None
        checked.add(relative)


def _reader(folder: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    read_metadata(folder)  # a refusal raised as it is, before torch's load (which wraps every error of its reader)

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_metadata(folder)
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(folder))


def _planner() -> Any:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class SafePlanner(DefaultLoadPlanner):
        """torch's planner, with the non-tensor entries loaded as plain values only (torch's own unpickles anything)."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                loaded = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as exc:
                raise UnsafeCheckpointFile(
                    f"{read_item.dest_index.fqn} of a distributed checkpoint holds objects other than plain values: "
                    f"{exc}"
                ) from None
            super().load_bytes(read_item, _saved(loaded))

    return SafePlanner()


def _saved(value: Any) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer


def tensor_shapes(folder: Path, prefix: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Key (``prefix.`` removed) -> (shape, dtype) of every tensor a distributed-checkpoint folder holds under
    ``prefix``; the other entries (plain values) are left out."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = read_metadata(folder).state_dict_metadata
    head = f"{prefix}."
    return {
        key[len(head) :]: (tuple(entry.size), entry.properties.dtype)
        for key, entry in entries.items()
        if key.startswith(head) and isinstance(entry, TensorStorageMetadata)
    }


def is_packed(value: Any) -> bool:
    """Whether ``value`` is a DTensor sharded in strides that torch's distributed checkpoint (2.13) cannot write or
    read: a ``_StridedShard`` of a dimension no later mesh dimension shards again, as transformers' ``packed_colwise``
    plan places a fused weight (a mixture of experts' ``gate_up_proj``: each process holds its part of the gate and of
    the up projection). torch takes each process's part for one contiguous block: writing fails ("overlapping
    chunks"), reading would fill the shards with other rows. (FSDP2 over tensor parallelism shards the same dimension
    in strides first, then plainly: that torch writes and reads.)"""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    if not isinstance(value, DTensor):
        return False
    placements = value.placements
    return any(
        isinstance(p, _StridedShard)
        and not any(
            isinstance(q, Shard) and not isinstance(q, _StridedShard) and q.dim == p.dim for q in placements[i + 1 :]
        )
        for i, p in enumerate(placements)
    )


def dcp_writable(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as torch's distributed checkpoint writes it: a packed DTensor (:func:`is_packed`) as its whole
    tensor (collective; the same on every process, which torch's planner then writes once), the rest as it is. The
    whole tensor is what any layout reads back (:func:`load_dcp`)."""
    return tree_map(lambda value: value.detach().full_tensor() if is_packed(value) else value, state)


def _whole_in_place_of_packed(state: Any) -> list[tuple[Any, Any, Any]]:
    """Each packed DTensor (:func:`is_packed`) in the nested dicts and lists of ``state`` replaced by an empty
    whole tensor, in place; returns (container, key, the DTensor) for each."""
    replaced = []
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list) else ()
    for key, value in list(items):
        if is_packed(value):
            state[key] = torch.empty(value.shape, dtype=value.dtype, device=value.to_local().device)
            replaced.append((state, key, value))
        elif isinstance(value, (dict, list)):
            replaced.extend(_whole_in_place_of_packed(value))
    return replaced


def load_dcp(folder: Path, state: dict[str, Any], collective: bool) -> None:
    """Fill ``state`` (the states' shapes and the run's own sharding: whole tensors or DTensor shards) from a
    distributed-checkpoint folder, in place; ``collective``: every process of the run calls it (else this process
    reads alone). A packed DTensor (:func:`is_packed`) is read whole and cut to its shards here."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import distribute_tensor

    packed = _whole_in_place_of_packed(state)
    with (
        warnings.catch_warnings()
    ):  # reading alone is meant: torch's "assuming the intent is to load in a single process"
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp.load(state, storage_reader=_reader(folder), planner=_planner(), no_dist=not collective)
    for container, key, shards in packed:  # each whole tensor read, cut to the shards, the DTensor put back
        whole = distribute_tensor(container[key], shards.device_mesh, shards.placements, src_data_rank=None)
        with torch.no_grad():
            shards.to_local().copy_(whole.to_local())
        container[key] = shards


def read_full_model(folder: Path) -> dict[str, torch.Tensor]:
    """The whole model state dict of a ``pytorch_model_fsdp_0/`` folder, read by this process alone."""
    state = {MODEL_KEY: {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in tensor_shapes(folder, MODEL_KEY)
                         .items()}}  # fmt: skip
    load_dcp(folder, state, collective=False)
    return state[MODEL_KEY]


def collective() -> bool:
    """Whether the processes of a run are connected (collective reads and writes), rather than one process alone."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


# ---- the states, as a run of any kind reads them ---------------------------------------------------------------------
def _options(full: bool, rank0_only: bool = True) -> Any:
    """Whole (``full``) or sharded states; whole ones on the CPU (of global rank 0 alone with ``rank0_only``: torch's
    ``cpu_offload`` keeps them there only)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full, cpu_offload=full and rank0_only)


def full_model_state(model: nn.Module, rank0_only: bool = True) -> dict[str, torch.Tensor] | None:
    """The whole state dict of a sharded model, on the CPU (collective: every process calls it; with ``rank0_only``
    only global rank 0 gets it, the others an empty dict); None for a model that is not sharded (its own
    ``state_dict()`` is whole)."""
    if not is_sharded(model):
        return None
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = {k: v.detach().cpu() for k, v in get_model_state_dict(model, options=_options(True, rank0_only)).items()}
    # parameters the model ties (an output layer sharing the input embedding) come back as separate copies: one
    # tensor again, so that save_pretrained writes it once, as it does for the model's own state dict
    keys: dict[int, list[str]] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        keys.setdefault(id(tensor), []).append(key)
    for tied in (group for group in keys.values() if len(group) > 1 and group[0] in state):
        for key in tied[1:]:
            if key in state:
                state[key] = state[tied[0]]
    return state


def set_full_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Whole tensors into a sharded model (each process keeps its shard); keys the state lacks stay as they are."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))


def named_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, full: bool, rank0_only: bool = True
) -> dict[str, Any]:
    """The optimizer's state with its parameters by name (``state``: name -> states, ``param_groups``: names),
    whole (``full``, on the CPU of global rank 0, or of every process without ``rank0_only``) or as this process's
    shards; collective for a sharded model."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_options(full, rank0_only))


def set_named_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any], full: bool
) -> None:
    """The inverse of :func:`named_optimizer_state` (``full``: whole tensors, cut to this process's shards)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=full))


def writers(folder: Path) -> int:
    """How many processes wrote a distributed-checkpoint folder (one ``__<rank>_0.distcp`` file each)."""
    return sum(1 for p in folder.glob(DCP_SHARDS))


def load_dcp_optimizer(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """An ``optimizer_0/`` folder into the run's optimizer, resharded to the run's processes (collective when the
    run has several); a change in the number of processes is said."""
    import torch.distributed as dist

    now = dist.get_world_size() if collective() else 1
    if writers(folder) != now and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.warning(
            f"{folder}: written by {writers(folder)} process(es), read by {now}: torch.distributed.checkpoint reshards "
            "the optimizer's states (and the model's) onto this run's processes."
        )
    template = {OPTIMIZER_KEY: named_optimizer_state(model, optimizer, full=False)}
    # the groups as saved (another layout may group the parameters otherwise): torch's set_optimizer_state_dict
    # gives each of the run's groups the states and settings of the saved group its parameters were in, by name
    template[OPTIMIZER_KEY]["param_groups"] = saved_group_template(folder)
    load_dcp(folder, template, collective=collective())
    set_named_optimizer_state(model, optimizer, template[OPTIMIZER_KEY], full=False)


_GROUP_SETTING_RE = re.compile(rf"^{OPTIMIZER_KEY}\.param_groups\.(\d+)\.(\w+)$")


def saved_group_template(folder: Path) -> list[dict[str, Any]]:
    """The parameter groups an ``optimizer_0/`` folder holds, as a template :func:`load_dcp` fills: one dict per
    group, its settings (``params`` included) as keys, each None."""
    groups: list[dict[str, Any]] = []
    for key in read_metadata(folder).state_dict_metadata:
        match = _GROUP_SETTING_RE.match(key)
        if match is not None:
            index = int(match.group(1))
            groups.extend({} for _ in range(index + 1 - len(groups)))
            groups[index][match.group(2)] = None
    return groups


def load_dcp_model(folder: Path, model: nn.Module) -> None:
    """A ``pytorch_model_fsdp_0/`` folder into a sharded model, each process reading its own shards (collective)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    template = {MODEL_KEY: get_model_state_dict(model)}
    load_dcp(folder, template, collective=collective())
    set_model_state_dict(model, template[MODEL_KEY])


def by_name(saved: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """An optimizer state by position (``optimizer.state_dict()``: parameters numbered across the groups in order) as
    torch's distributed state-dict API takes it: each position replaced by the name the API gives the run optimizer's
    parameter at that position (its own ``param_groups``, so wrappers such as activation checkpointing's are named as
    it names them)."""
    names = [name for group in named_optimizer_state(model, optimizer, full=False)["param_groups"]
             for name in group["params"]]  # fmt: skip
    positions = [position for group in saved["param_groups"] for position in group["params"]]
    named = dict(zip(positions, names, strict=True))
    return {
        "state": {named[position]: entry for position, entry in saved["state"].items()},
        "param_groups": [{**group, "params": [named[p] for p in group["params"]]} for group in saved["param_groups"]],
    }
