"""The model and optimizer parts of a checkpoint written by a sharded run, in transformers' (accelerate's) forms.

A run whose parameters are sharded across processes (FSDP2's ``fully_shard``: DTensor parameters) writes its model and
optimizer states as transformers' ``Trainer`` writes them for the same ``fsdp_config["state_dict_type"]``:

- ``FULL_STATE_DICT`` (the default): the model as ``model.safetensors`` (``save_model``'s files, gathered) and
  ``pytorch_model_fsdp.bin``, the optimizer as ``optimizer.bin`` (whole, parameters by name);
- ``SHARDED_STATE_DICT``: the model as ``pytorch_model_fsdp_0/``, the optimizer as ``optimizer_0/``
  (``torch.distributed.checkpoint`` folders, one file per process); no ``save_model`` files, as transformers.

Writing (:class:`GatheredState`, :class:`ShardedState`) is collective: every process calls it, the gathered files are
written by the main process, the distributed-checkpoint folders by every process (its own shard) and the main one (the
``.metadata``). :class:`ProcessZeroState` is the one-process (and DDP) form: ``optimizer.pt`` by the main process.

Reading goes by what the folder holds, not by how the run that reads it is sharded, so each form resumes on any
number of processes, sharded or not: a distributed checkpoint is read into whole tensors (the model before training
starts, as every process holds it then) or into the run's own shards (the optimizer, once the run built it), and
``torch.distributed.checkpoint`` reshards on the way. Nothing in a checkpoint may run code: the ``.metadata`` pickle is
read with an unpickler that admits only ``torch.distributed.checkpoint``'s metadata classes (torch's own reader
unpickles anything), and the non-tensor entries (an optimizer's hyperparameters) with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hflight.checkpoints.files import UnsafeCheckpointFile
from hflight.checkpoints.optim_state import OPTIMIZER_NAME, check_training_states

logger = logging.getLogger(__name__)

#: accelerate's names (``FSDP_MODEL_NAME``, ``OPTIMIZER_NAME``, index 0: the Trainer's one model and optimizer)
FSDP_MODEL_FILE = "pytorch_model_fsdp.bin"
FSDP_MODEL_DIR = "pytorch_model_fsdp_0"
FSDP_OPTIMIZER_FILE = "optimizer.bin"
FSDP_OPTIMIZER_DIR = "optimizer_0"
#: the metadata file of a ``torch.distributed.checkpoint`` folder (written last, by the coordinating process)
DCP_METADATA = ".metadata"
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
        UnsafeCheckpointFile: the file refers to anything but the metadata classes.
        ValueError: it cannot be read.
    """
    path = folder / DCP_METADATA
    try:
        with open(path, "rb") as handle:
            return _MetadataUnpickler(handle).load()
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointFile(
            f"{path} cannot be loaded safely: {exc}. hflight never unpickles arbitrary objects from a checkpoint."
        ) from None
    except Exception as exc:
        raise ValueError(f"{path} is not a readable torch.distributed.checkpoint metadata file: {exc}") from exc


def _reader(folder: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

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


def load_dcp(folder: Path, state: dict[str, Any], collective: bool) -> None:
    """Fill ``state`` (the states' shapes and the run's own sharding: whole tensors or DTensor shards) from a
    distributed-checkpoint folder, in place; ``collective``: every process of the run calls it (else this process
    reads alone)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with (
        warnings.catch_warnings()
    ):  # reading alone is meant: torch's "assuming the intent is to load in a single process"
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process.*")
        dcp.load(state, storage_reader=_reader(folder), planner=_planner(), no_dist=not collective)


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
    return sum(1 for p in folder.glob("__*_*.distcp"))


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
    load_dcp(folder, template, collective=collective())
    set_named_optimizer_state(model, optimizer, template[OPTIMIZER_KEY], full=False)


def load_dcp_model(folder: Path, model: nn.Module) -> None:
    """A ``pytorch_model_fsdp_0/`` folder into a sharded model, each process reading its own shards (collective)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    template = {MODEL_KEY: get_model_state_dict(model)}
    load_dcp(folder, template, collective=collective())
    set_model_state_dict(model, template[MODEL_KEY])


# ---- writing ---------------------------------------------------------------------------------------------------------
class ProcessZeroState:
    """One process's (or DDP's, whose processes hold the same states) optimizer: ``optimizer.pt``, written by the
    main process, its parameters by position (what transformers writes outside FSDP and DeepSpeed).

    ``rank0_only``: gathered states go to global rank 0 alone (False: to every process, for ``save_on_each_node``,
    where the main process of every node writes).

    Each form also knows how a run of any kind reads it (:meth:`load_optimizer`: converted to the run's sharding through
    torch's distributed state-dict API) and which checkpoints its own runs can continue (:meth:`refusal`)."""

    #: the form's optimizer file or folder (and its model files beside ``save_model``'s)
    optimizer_name = OPTIMIZER_NAME
    model_names: tuple[str, ...] = ()
    #: whether a checkpoint holds ``save_model``'s files (weights, config, processing class, ``training_args.bin``)
    with_model_files = True
    #: whether :meth:`write` writes through its ``save`` argument (so that ``save_async`` can write in the background)
    deferrable = True
    #: the form in messages
    label = "a one-process/DDP checkpoint (optimizer.pt: the optimizer's states by parameter position)"
    #: the name ``hflight.checkpoints.parts.optimizer_form`` finds the form's optimizer under
    found_as = OPTIMIZER_NAME
    #: the engine that alone reads the form's optimizer (DeepSpeed's partitions); None: hflight reads it into a run of
    #: any sharding without such an engine, converting it
    engine: str | None = None
    #: with an ``engine``: what to do with a checkpoint of this form in a run without it, and with another form's
    #: checkpoint in a run with it
    advice_to_other_runs = advice_to_other_checkpoints = ""

    def __init__(self, rank0_only: bool = True) -> None:
        self.rank0_only = rank0_only

    @classmethod
    def written_by(cls, args: Any) -> bool:
        """Whether a run of ``args`` (transformers' arguments) writes this form (:data:`FORMS` is asked in order)."""
        return True

    @classmethod
    def refusal(cls, written: type[ProcessZeroState], folder: Path) -> str | None:
        """Why a run writing this form cannot continue the optimizer of ``folder``, a checkpoint of the form
        ``written``; None when it can (converting it to its own sharding where needed). An optimizer that only an
        engine reads (DeepSpeed's partitions) goes to a run of that engine, and such a run reads nothing else."""
        if written.engine == cls.engine:
            return None
        advice = written.advice_to_other_runs if written.engine else cls.advice_to_other_checkpoints
        return f"Checkpoint {folder} holds {written.label}; this run writes {cls.label}. {advice}"

    @classmethod
    def load_optimizer(
        cls, folder: Path, saved: Any, model: nn.Module, optimizer: torch.optim.Optimizer, run_form: ProcessZeroState
    ) -> None:
        """``saved`` (this form's optimizer as the resume read it: ``optimizer.pt``'s content) into the run's
        ``optimizer``, checked against it first: as it is into an unsharded model (one process, DDP); into a sharded one
        (FSDP2: DTensor parameters) with its positions turned into the parameters' names, each whole tensor cut to the
        process's shard (``set_optimizer_state_dict(full_state_dict=True)``)."""
        check_training_states(folder, {cls.optimizer_name: saved}, {cls.optimizer_name: optimizer}, {})
        if is_sharded(model):
            set_named_optimizer_state(model, optimizer, by_name(saved, model, optimizer), full=True)
        else:
            optimizer.load_state_dict(saved)

    def full_model_state(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """The whole state dict ``save_model`` writes (collective; None: the model's own ``state_dict()``)."""
        return full_model_state(model, self.rank0_only)

    def restore(self, folder: Path, module_only: bool = False) -> None:
        """A checkpoint the run's engine reads itself (DeepSpeed's); forms hflight reads (weights files, optimizer
        files or distributed-checkpoint folders) never come here."""
        raise ValueError(type(self).refusal(DeepSpeedState, folder))

    def write(
        self, folder: str, model: nn.Module, optimizer: torch.optim.Optimizer, is_main: bool, save: Any = torch.save
    ) -> list[str]:
        """Write the form's model and optimizer files into ``folder`` (every process calls it); returns the names this
        process wrote, largest first. ``save(obj, path)``: ``torch.save``, or a deferred write (``save_async``)."""
        if not is_main:
            return []
        save(optimizer.state_dict(), os.path.join(folder, self.optimizer_name))
        return [self.optimizer_name]


class GatheredState(ProcessZeroState):
    """``FULL_STATE_DICT``: the whole model (``pytorch_model_fsdp.bin``) and optimizer (``optimizer.bin``, parameters by
    name) gathered onto the main process and written by it, beside ``save_model``'s ``model.safetensors``."""

    optimizer_name = found_as = FSDP_OPTIMIZER_FILE
    model_names = (FSDP_MODEL_FILE,)
    label = (
        "an FSDP2 FULL_STATE_DICT checkpoint (optimizer.bin: the optimizer's whole states by parameter name; "
        "pytorch_model_fsdp.bin)"
    )

    @classmethod
    def written_by(cls, args: Any) -> bool:
        return bool(args.fsdp)

    @classmethod
    def load_optimizer(
        cls, folder: Path, saved: Any, model: nn.Module, optimizer: torch.optim.Optimizer, run_form: ProcessZeroState
    ) -> None:
        """Whole states by name, cut to the run's shards (or taken whole by an unsharded run)."""
        set_named_optimizer_state(model, optimizer, saved, full=True)

    def write(
        self, folder: str, model: nn.Module, optimizer: torch.optim.Optimizer, is_main: bool, save: Any = torch.save
    ) -> list[str]:
        optimizer_state = named_optimizer_state(model, optimizer, full=True, rank0_only=self.rank0_only)
        model_state = self.full_model_state(model)
        if not is_main:
            return []
        save(optimizer_state, os.path.join(folder, FSDP_OPTIMIZER_FILE))
        save(model.state_dict() if model_state is None else model_state, os.path.join(folder, FSDP_MODEL_FILE))
        return [FSDP_OPTIMIZER_FILE, FSDP_MODEL_FILE]


class ShardedState(ProcessZeroState):
    """``SHARDED_STATE_DICT``: each process writes its own shards of the model (``pytorch_model_fsdp_0/``) and the
    optimizer (``optimizer_0/``) with ``torch.distributed.checkpoint``; no whole copy is made anywhere."""

    optimizer_name = found_as = FSDP_OPTIMIZER_DIR
    model_names = (FSDP_MODEL_DIR,)
    label = (
        "an FSDP2 SHARDED_STATE_DICT checkpoint (optimizer_0/ and pytorch_model_fsdp_0/: torch.distributed.checkpoint "
        "shards)"
    )
    with_model_files = False  # as transformers: the shards are the model; save_model() still gathers a whole copy
    deferrable = False  # every process writes through torch.distributed.checkpoint, a collective

    @classmethod
    def written_by(cls, args: Any) -> bool:
        state_dict_type = str((args.fsdp_plugin_args or {}).get("state_dict_type", "")).upper()
        return bool(args.fsdp) and state_dict_type == "SHARDED_STATE_DICT"

    @classmethod
    def load_optimizer(
        cls, folder: Path, saved: Any, model: nn.Module, optimizer: torch.optim.Optimizer, run_form: ProcessZeroState
    ) -> None:
        """The folder's shards resharded onto the run's processes (whole tensors for an unsharded run)."""
        load_dcp_optimizer(Path(saved), model, optimizer)

    def write(
        self, folder: str, model: nn.Module, optimizer: torch.optim.Optimizer, is_main: bool, save: Any = torch.save
    ) -> list[str]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        states = {
            FSDP_OPTIMIZER_DIR: {OPTIMIZER_KEY: named_optimizer_state(model, optimizer, full=False)},
            FSDP_MODEL_DIR: {MODEL_KEY: get_model_state_dict(model)},
        }
        for name, state in states.items():
            writer = dcp.FileSystemWriter(os.path.join(folder, name))
            dcp.save(state, storage_writer=writer, no_dist=not collective())
        return list(states)


#: DeepSpeed's checkpoint files (``engine.save_checkpoint``): the tag folder, the file naming the latest tag, the script
#: that rebuilds whole fp32 weights from the partitions
DEEPSPEED_LATEST = "latest"
DEEPSPEED_SCRIPT = "zero_to_fp32.py"
DEEPSPEED_TAG_PREFIX = "global_step"
#: the prefix of the engine's module's keys: under Lightning the engine holds hflight's LightningModule, whose
#: ``model`` is the transformers model
ENGINE_PREFIX = "model."


class NotGathered(Exception):
    """The run's weights are not gathered for ``save_model`` (DeepSpeed ZeRO-3 without
    ``stage3_gather_16bit_weights_on_model_save``): its checkpoint form is written in their place."""


class DeepSpeedState(ProcessZeroState):
    """DeepSpeed: ``engine.save_checkpoint`` (``global_step<N>/`` with every process's partition of the weights and
    optimizer states, ``latest``, ``zero_to_fp32.py``), as transformers' Trainer writes it; the model files beside it
    when the weights can be gathered (ZeRO 0-2 always; ZeRO-3 only with
    ``zero_optimization.stage3_gather_16bit_weights_on_model_save``, as in transformers, which otherwise writes none
    and points to ``zero_to_fp32.py``)."""

    optimizer_name = DEEPSPEED_TAG_PREFIX
    found_as = engine = "deepspeed"
    label = (
        "DeepSpeed's own checkpoint (global_step<N>/: each process's ZeRO partitions of the weights and optimizer "
        "states)"
    )
    advice_to_other_runs = (
        "Only DeepSpeed's engine reads its optimizer partitions: resume it with the deepspeed config it was written "
        "with, on the number of processes that wrote it (the partitions do not reshard on load; DeepSpeed's "
        "ds_to_universal conversion makes a checkpoint that DeepSpeed alone reads), or start this run from its weights "
        "with a fresh optimizer (zero_to_fp32.py in the folder rebuilds them; model.safetensors where they were "
        "gathered), without resume_from_checkpoint."
    )
    advice_to_other_checkpoints = (
        "DeepSpeed's engine restores only its own checkpoints, and hflight does not turn other optimizer states into "
        "ZeRO partitions: resume it without deepspeed (hflight reads it on any number of processes, with FSDP2 or "
        "without), or start the DeepSpeed run from its weights with a fresh optimizer (the model loaded from them), "
        "without resume_from_checkpoint."
    )

    @classmethod
    def written_by(cls, args: Any) -> bool:
        return bool(args.deepspeed)

    @classmethod
    def load_optimizer(
        cls, folder: Path, saved: Any, model: nn.Module, optimizer: torch.optim.Optimizer, run_form: ProcessZeroState
    ) -> None:
        """Read by the run's engine (a DeepSpeed run's form), with the weights: every process its partitions."""
        run_form.restore(Path(saved))

    def __init__(self, engine: Any, config: dict[str, Any]) -> None:
        super().__init__()
        self.engine = engine
        zero = config.get("zero_optimization") or {}
        self.stage3 = zero.get("stage") == 3
        self.with_model_files = not self.stage3 or bool(zero.get("stage3_gather_16bit_weights_on_model_save"))

    def full_model_state(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        if not self.stage3:  # whole on every process; cloned as accelerate's get_state_dict does under DeepSpeed (so
            # save_pretrained writes tied weights twice, as transformers' checkpoints hold them)
            return {k: v.detach().clone().cpu() for k, v in model.state_dict().items()}
        if not self.with_model_files:
            raise NotGathered(
                "stage3_gather_16bit_weights_on_model_save=false. Saving the full checkpoint instead, use "
                f"{DEEPSPEED_SCRIPT} to recover weights"  # transformers' words
            )
        state = self.engine._zero3_consolidated_16bit_state_dict() or {}  # whole on global rank 0 (collective)
        return {k[len(ENGINE_PREFIX) :]: v for k, v in state.items() if k.startswith(ENGINE_PREFIX)}

    deferrable = False  # the engine writes its partitions itself (a collective)

    def write(
        self, folder: str, model: nn.Module, optimizer: torch.optim.Optimizer, is_main: bool, save: Any = torch.save
    ) -> list[str]:
        self.engine.save_checkpoint(folder)  # every process: its partitions; the tag global_step<N>
        tag = f"{DEEPSPEED_TAG_PREFIX}{self.engine.global_steps}"
        for states in self._own_model_states(Path(folder) / tag):
            _names_as_transformers(states)
        return [tag]

    def _own_model_states(self, folder: Path) -> list[Path]:
        """The files this process wrote that name parameters: its model states (ZeRO 0-2: global rank 0's one; ZeRO-3:
        one per process) and its optimizer partition."""
        rank = self.engine.global_rank
        names = [f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt", f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
                 f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", *(["mp_rank_00_model_states.pt"] if rank == 0
                                                                           else [])]  # fmt: skip
        return [folder / name for name in names if (folder / name).is_file()]

    def restore(self, folder: Path, module_only: bool = False) -> None:
        """A DeepSpeed checkpoint into the engine (every process its partitions): the weights and, unless
        ``module_only``, the optimizer's states; the schedule is the Trainer's (``scheduler.pt``). Its number of
        processes must be the run's (DeepSpeed's partitions do not reshard on load)."""
        import torch.distributed as dist

        tag = deepspeed_tag(folder)
        written = len(list((folder / tag).glob("*_optim_states.pt"))) if tag else 0
        now = dist.get_world_size() if dist.is_initialized() else 1
        if not module_only and written not in (now, 1):  # ZeRO-0 writes one optimizer file whatever the processes
            raise ValueError(
                f"{folder / str(tag)}: DeepSpeed's optimizer partitions of {written} processes cannot be read by {now} "
                "(they do not reshard on load; DeepSpeed's universal checkpoint conversion, ds_to_universal, does). "
                f"Resume on {written} processes."
            )
        self.engine.load_checkpoint(
            str(folder), tag=tag, load_module_strict=True, load_optimizer_states=not module_only,
            load_lr_scheduler_states=False, load_module_only=module_only, custom_load_fn=_load_as_engine_module,
        )  # fmt: skip


def _names_as_transformers(path: Path) -> None:
    """A model-states file DeepSpeed just wrote, its parameter and buffer names as transformers' Trainer writes them
    (its engine holds the model itself; under Lightning it holds hflight's module, whose ``model`` is the model), so
    that either trainer resumes the other's checkpoint and ``zero_to_fp32.py`` gives the model's own names."""

    def strip(name: str) -> str:
        return name[len(ENGINE_PREFIX) :] if isinstance(name, str) and name.startswith(ENGINE_PREFIX) else name

    states = torch.load(path, map_location="cpu", weights_only=False)  # written by this process a moment ago
    if "module" in states:
        states["module"] = {strip(k): v for k, v in (states.get("module") or {}).items()}
    optimizer = states.get("optimizer_state_dict")
    if isinstance(optimizer, dict) and isinstance(optimizer.get("param_slice_mappings"), list):
        optimizer["param_slice_mappings"] = [type(group)((strip(k), v) for k, v in group.items())
                                             for group in optimizer["param_slice_mappings"]]  # fmt: skip
    for key in ("param_shapes", "frozen_param_shapes"):
        value = states.get(key)
        if isinstance(value, list):
            states[key] = [type(group)((strip(k), v) for k, v in group.items()) for group in value]
        elif isinstance(value, dict):
            states[key] = type(value)((strip(k), v) for k, v in value.items())
    if isinstance(states.get("shared_params"), dict):
        states["shared_params"] = {strip(k): strip(v) for k, v in states["shared_params"].items()}
    if isinstance(states.get("buffer_names"), list):
        states["buffer_names"] = [strip(name) for name in states["buffer_names"]]
    torch.save(states, path)


def _load_as_engine_module(src: dict[str, torch.Tensor], dst: nn.Module) -> None:
    """DeepSpeed's ``custom_load_fn``: a model-states ``module`` with the model's own names (transformers', and
    hflight's since :func:`_names_as_transformers`) into the engine's module (hflight's, whose ``model`` is the
    model)."""
    dst.load_state_dict({k if k.startswith(ENGINE_PREFIX) else ENGINE_PREFIX + k: v for k, v in src.items()})


def deepspeed_tag(folder: Path) -> str | None:
    """The DeepSpeed checkpoint a folder holds (the tag ``latest`` names, its folder there), or None."""
    latest = folder / DEEPSPEED_LATEST
    if not latest.is_file() or latest.is_symlink():
        return None
    tag = latest.read_text(encoding="utf-8").strip()
    return tag if tag.startswith(DEEPSPEED_TAG_PREFIX) and (folder / tag).is_dir() else None


# ---- the forms, as a resume finds them ------------------------------------------------------------------------------
#: every form, in the order a run's arguments are matched against them (:func:`planned_form`)
FORMS: tuple[type[ProcessZeroState], ...] = (DeepSpeedState, ShardedState, GatheredState, ProcessZeroState)


def written_form(found: str | None) -> type[ProcessZeroState] | None:
    """The form of a checkpoint's optimizer, from the name ``hflight.checkpoints.parts.optimizer_form`` found it under
    (None: the checkpoint holds no optimizer)."""
    return next((form for form in FORMS if form.found_as == found), None)


def planned_form(args: Any) -> type[ProcessZeroState]:
    """The form a run of ``args`` (transformers' arguments) writes, known before its strategy is built: what it can
    resume is asked of it (:meth:`ProcessZeroState.refusal`) before anything is loaded."""
    return next(form for form in FORMS if form.written_by(args))


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
