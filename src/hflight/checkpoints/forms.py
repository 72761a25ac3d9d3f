"""The forms a checkpoint's model and optimizer states take, each one object, and the list of them (:data:`FORMS`).

A form knows, in one class: which run writes it (:meth:`~CheckpointForm.written_by`, from transformers' arguments),
how to find itself in a folder (:meth:`~CheckpointForm.found_in`) and name its files (its weight files for a load,
which part of the manifest each file is), how every process writes it (:meth:`~CheckpointForm.write`, through a
``save`` the background writer can defer), whether it can be written in the background at all
(:attr:`~CheckpointForm.background`), how its optimizer is checked against the one the run will build and restored
into a run of any sharding (:meth:`~CheckpointForm.read_optimizer`, :meth:`~CheckpointForm.load_optimizer`), and
which checkpoints a run writing it can continue (:meth:`~CheckpointForm.refusal`). Callers (the writer, the
manifest, the resume, ``save_async``'s check) loop over :data:`FORMS`; none names a form's files. The names themselves
are ``hflight.checkpoints.names``'s.

- :class:`ProcessZeroState`, one process or DDP (whose processes hold the same states): ``optimizer.pt`` by the main
  process, the parameters by position (what transformers writes outside FSDP and DeepSpeed);
- :class:`GatheredState`, FSDP2's ``FULL_STATE_DICT``: ``pytorch_model_fsdp.bin`` and ``optimizer.bin`` (parameters
  by name), gathered onto the main process, beside ``save_model``'s files;
- :class:`ShardedState`, FSDP2's ``SHARDED_STATE_DICT``: ``pytorch_model_fsdp_0/`` and ``optimizer_0/``
  (``torch.distributed.checkpoint``, one file per process), no ``save_model`` files, as transformers;
- :class:`DeepSpeedState`: DeepSpeed's own ``global_step<N>/`` (each process's partitions), written and read by its
  engine.

FSDP1 (``fsdp_config["version"]`` 1, Lightning's ``FSDPStrategy``, CUDA only) has no form of its own: its arguments
plan the FSDP forms above (their ``state_dict_type``), and its strategy, not one of hflight's backends, writes
through the one-process form.

Adding a form: its file names in ``hflight.checkpoints.names``, a subclass of :class:`CheckpointForm` here, listed in
:data:`FORMS`; a strategy's ``hf_checkpoint_state`` hook (``hflight.run.backend``) returns it for its runs.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn

from hflight._util import model_tp_size
from hflight.checkpoints.adapters import is_peft_model, sharded_adapter_state
from hflight.checkpoints.names import (
    DEEPSPEED_LATEST,
    DEEPSPEED_OPTIMIZER_FILES,
    DEEPSPEED_SCRIPT,
    DEEPSPEED_TAG_PREFIX,
    FSDP_MODEL_DIR,
    FSDP_MODEL_FILE,
    FSDP_OPTIMIZER_DIR,
    FSDP_OPTIMIZER_FILE,
    OPTIMIZER_NAME,
    SAFE_WEIGHTS_NAME,
    deepspeed_files_naming_parameters,
)
from hflight.checkpoints.optim_state import (
    check_distributed_optimizer,
    check_named_optimizer_state,
    check_training_states,
)
from hflight.checkpoints.sharded import (
    MODEL_KEY,
    OPTIMIZER_KEY,
    by_name,
    collective,
    dcp_files,
    dcp_writable,
    full_model_state,
    is_dcp_folder,
    is_sharded,
    load_dcp,
    load_dcp_optimizer,
    named_optimizer_state,
    saved_group_template,
    set_named_optimizer_state,
    tensor_shapes,
)
from hflight.checkpoints.writers.files import load_tensors_file, regular_file

logger = logging.getLogger(__name__)


class CheckpointForm:
    """One form of a checkpoint's model and optimizer states. The class answers for the files (what a folder holds,
    whoever wrote it); an instance is a run's way of writing them (``rank0_only``: gathered states go to global rank
    0 alone; False: to every process, for ``save_on_each_node``, where the main process of every node writes)."""

    #: the form in messages
    label: ClassVar[str] = ""
    #: its optimizer's file or folder (the file a failed write of the form is attributed to)
    optimizer_name: ClassVar[str] = ""
    #: its own model files or folders, beside ``save_model``'s
    model_names: ClassVar[tuple[str, ...]] = ()
    #: whether a checkpoint holds ``save_model``'s files too (weights, config, processing class, training arguments)
    with_model_files = True
    #: whether ``save_async`` can write it in the background (:meth:`write` writes through its ``save`` argument);
    #: if not, the setting that makes a run write it and why, for ``save_async``'s refusal
    background: ClassVar[bool] = True
    chosen_by: ClassVar[str] = ""
    not_in_background: ClassVar[str] = ""
    #: the engine that alone reads its optimizer (DeepSpeed's partitions); None: hflight reads it into a run of any
    #: sharding without such an engine, converting it; with an engine, what to do with a checkpoint of this form in a
    #: run without it, and with another form's checkpoint in a run with it
    engine: ClassVar[str | None] = None
    advice_to_other_runs: ClassVar[str] = ""
    advice_to_other_checkpoints: ClassVar[str] = ""

    def __init__(self, rank0_only: bool = True) -> None:
        self.rank0_only = rank0_only

    # ---- which run writes it, and where it is ---------------------------------------------------------------------
    @classmethod
    def written_by(cls, args: Any) -> bool:
        """Whether a run of ``args`` (transformers' arguments) writes this form (one form of :data:`FORMS` does)."""
        raise NotImplementedError

    @classmethod
    def found_in(cls, folder: str | os.PathLike) -> bool:
        """Whether ``folder`` holds this form's optimizer."""
        return regular_file(folder, cls.optimizer_name) is not None

    @classmethod
    def weight_files(cls, folder: str | os.PathLike) -> list[str]:
        """This form's own weights in ``folder`` (as a manifest names them), read when ``save_model``'s are absent."""
        return [name for name in cls.model_names if regular_file(folder, name) is not None]

    @classmethod
    def part_of(cls, name: str) -> str | None:
        """The part of a checkpoint (``"model"``, ``"optimizer"``) file ``name`` (as a manifest names it) is of this
        form's; None: not one of its files."""
        top = name.split("/", 1)[0]
        if name == cls.optimizer_name or (top == cls.optimizer_name and "/" in name):
            return "optimizer"
        if name in cls.model_names or (top in cls.model_names and "/" in name):
            return "model"
        return None

    # ---- restoring --------------------------------------------------------------------------------------------------
    @classmethod
    def refusal(cls, written: type[CheckpointForm], folder: Path, layout: str | None = None) -> str | None:
        """Why a run writing this form cannot continue the optimizer of ``folder``, a checkpoint of the form
        ``written``; None when it can (converting it to its own sharding where needed). An optimizer that only an
        engine reads (DeepSpeed's partitions) goes to a run of that engine, and such a run reads nothing else.
        ``layout``: the run's layout where the form alone does not say it (tensor parallelism)."""
        if written.engine == cls.engine:
            return None
        advice = written.advice_to_other_runs if written.engine else cls.advice_to_other_checkpoints
        run = f"this run ({layout})" if layout else "this run"
        return f"Checkpoint {folder} holds {written.label}; {run} writes {cls.label}. {advice}"

    @classmethod
    def read_optimizer(cls, folder: Path, optimizer: torch.optim.Optimizer, names: dict[int, str]) -> Any:
        """The optimizer state of ``folder`` checked against ``optimizer`` (the one the run will build; ``names``:
        its parameters' names by ``id``), before anything is loaded: what :meth:`load_optimizer` takes."""
        raise NotImplementedError

    @classmethod
    def load_optimizer(
        cls, folder: Path, saved: Any, model: nn.Module, optimizer: torch.optim.Optimizer, run_form: CheckpointForm
    ) -> None:
        """``saved`` (what :meth:`read_optimizer` read) into the run's ``optimizer``, as a run of ``run_form`` reads
        it (converted to its sharding where needed)."""
        raise NotImplementedError

    @classmethod
    def saved_groups(cls, folder: Path, saved: Any) -> list[dict[str, Any]] | None:
        """The saved parameter groups (``params``: the names each lists, and its settings; ``saved``: what
        :meth:`read_optimizer` read), for a form whose parameters are named; None where they are numbered (the run's
        grouping must then be the saved one)."""
        return None

    def restore(self, folder: Path, module_only: bool = False) -> None:
        """A checkpoint the run's engine reads itself (DeepSpeed's); forms hflight reads (weights files, optimizer
        files or distributed-checkpoint folders) never come here."""
        raise ValueError(type(self).refusal(DeepSpeedState, folder))

    # ---- writing ----------------------------------------------------------------------------------------------------
    def full_model_state(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """The whole state dict ``save_model`` writes (collective; None: the model's own ``state_dict()``)."""
        return full_model_state(model, self.rank0_only)

    def write(
        self, folder: str, model: nn.Module, optimizer: torch.optim.Optimizer, is_main: bool, save: Any = torch.save
    ) -> list[str]:
        """Write the form's model and optimizer files into ``folder`` (every process calls it); returns the names this
        process wrote, largest first. ``save(obj, path)``: ``torch.save``, or a deferred write (``save_async``)."""
        raise NotImplementedError


class ProcessZeroState(CheckpointForm):
    """One process's (or DDP's) optimizer: ``optimizer.pt``, written by the main process, its parameters by
    position."""

    label = f"a one-process/DDP checkpoint ({OPTIMIZER_NAME}: the optimizer's states by parameter position)"
    optimizer_name = OPTIMIZER_NAME

    @classmethod
    def written_by(cls, args: Any) -> bool:
        return not args.fsdp and not args.deepspeed

    @classmethod
    def read_optimizer(cls, folder: Path, optimizer: torch.optim.Optimizer, names: dict[int, str]) -> Any:
        saved = load_tensors_file(Path(folder) / cls.optimizer_name)
        check_training_states(folder, {cls.optimizer_name: saved}, {cls.optimizer_name: optimizer}, names)
        return saved

    @classmethod
    def load_optimizer(
        cls, folder: Path, saved: Any, model: nn.Module, optimizer: torch.optim.Optimizer, run_form: CheckpointForm
    ) -> None:
        """As it is into an unsharded model (one process, DDP), checked against the optimizer Lightning built; into a
        sharded one (FSDP2: DTensor parameters) with its positions turned into the parameters' names, each whole
        tensor cut to the process's shard (``set_optimizer_state_dict(full_state_dict=True)``)."""
        check_training_states(folder, {cls.optimizer_name: saved}, {cls.optimizer_name: optimizer}, {})
        if is_sharded(model):
            set_named_optimizer_state(model, optimizer, by_name(saved, model, optimizer), full=True)
        else:
            optimizer.load_state_dict(saved)

    def write(
        self, folder: str, model: nn.Module, optimizer: torch.optim.Optimizer, is_main: bool, save: Any = torch.save
    ) -> list[str]:
        if not is_main:
            return []
        save(optimizer.state_dict(), os.path.join(folder, self.optimizer_name))
        return [self.optimizer_name]


class GatheredState(CheckpointForm):
    """``FULL_STATE_DICT``: the whole model (``pytorch_model_fsdp.bin``) and optimizer (``optimizer.bin``, parameters by
    name) gathered onto the main process and written by it, beside ``save_model``'s ``model.safetensors``."""

    label = (
        f"an FSDP2 FULL_STATE_DICT checkpoint ({FSDP_OPTIMIZER_FILE}: the optimizer's whole states by parameter name; "
        f"{FSDP_MODEL_FILE})"
    )
    optimizer_name = FSDP_OPTIMIZER_FILE
    model_names = (FSDP_MODEL_FILE,)

    @classmethod
    def written_by(cls, args: Any) -> bool:
        return bool(args.fsdp) and not ShardedState.written_by(args)

    @classmethod
    def read_optimizer(cls, folder: Path, optimizer: torch.optim.Optimizer, names: dict[int, str]) -> Any:
        path = Path(folder) / cls.optimizer_name
        saved = load_tensors_file(path)
        check_named_optimizer_state(path, saved, optimizer, names)
        return saved

    @classmethod
    def saved_groups(cls, folder: Path, saved: Any) -> list[dict[str, Any]] | None:
        return list(saved["param_groups"])

    @classmethod
    def load_optimizer(
        cls, folder: Path, saved: Any, model: nn.Module, optimizer: torch.optim.Optimizer, run_form: CheckpointForm
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


class DcpOptimizer(NamedTuple):
    """What :meth:`ShardedState.read_optimizer` read of an ``optimizer_0/`` folder: where it is (its shards are read
    into the run's own by :meth:`ShardedState.load_optimizer`) and its parameter groups (names and settings)."""

    path: Path
    groups: list[dict[str, Any]]


class ShardedState(CheckpointForm):
    """``SHARDED_STATE_DICT``: each process writes its own shards of the model (``pytorch_model_fsdp_0/``) and the
    optimizer (``optimizer_0/``) with ``torch.distributed.checkpoint``; no whole copy is made anywhere."""

    label = (
        f"a SHARDED_STATE_DICT checkpoint (FSDP2's or a tensor-parallel run's: {FSDP_OPTIMIZER_DIR}/ and "
        f"{FSDP_MODEL_DIR}/, torch.distributed.checkpoint shards)"
    )
    optimizer_name = FSDP_OPTIMIZER_DIR
    model_names = (FSDP_MODEL_DIR,)
    with_model_files = False  # as transformers: the shards are the model; save_model() still gathers a whole copy
    background = False
    chosen_by = "fsdp_config['state_dict_type']='SHARDED_STATE_DICT'"
    not_in_background = "every process writes its own shards with torch.distributed.checkpoint, a collective"

    @classmethod
    def written_by(cls, args: Any) -> bool:
        state_dict_type = str((args.fsdp_plugin_args or {}).get("state_dict_type", "")).upper()
        return bool(args.fsdp) and state_dict_type == "SHARDED_STATE_DICT"

    @classmethod
    def found_in(cls, folder: str | os.PathLike) -> bool:
        return is_dcp_folder(Path(folder) / cls.optimizer_name)

    @classmethod
    def weight_files(cls, folder: str | os.PathLike) -> list[str]:
        sharded = Path(folder) / FSDP_MODEL_DIR
        return dcp_files(sharded) if is_dcp_folder(sharded) else []

    @classmethod
    def read_optimizer(cls, folder: Path, optimizer: torch.optim.Optimizer, names: dict[int, str]) -> Any:
        """Checked from the folder's metadata and its groups' settings (``param_groups.<i>.<setting>`` entries: plain
        values, read by this process alone, once) and left to be read into the run's own shards: the folder's path
        and those groups."""
        path = Path(folder) / cls.optimizer_name
        listed: dict[str, Any] = {OPTIMIZER_KEY: {"param_groups": saved_group_template(path)}}
        load_dcp(path, listed, collective=False)
        groups = list(listed[OPTIMIZER_KEY]["param_groups"])
        check_distributed_optimizer(path, tensor_shapes(path, OPTIMIZER_KEY), groups, optimizer, names)
        return DcpOptimizer(path, groups)

    @classmethod
    def saved_groups(cls, folder: Path, saved: Any) -> list[dict[str, Any]] | None:
        return list(saved.groups)

    @classmethod
    def load_optimizer(
        cls, folder: Path, saved: Any, model: nn.Module, optimizer: torch.optim.Optimizer, run_form: CheckpointForm
    ) -> None:
        """The folder's shards resharded onto the run's processes (whole tensors for an unsharded run)."""
        load_dcp_optimizer(saved.path, model, optimizer)

    def write(
        self, folder: str, model: nn.Module, optimizer: torch.optim.Optimizer, is_main: bool, save: Any = torch.save
    ) -> list[str]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        states = {
            FSDP_OPTIMIZER_DIR: {OPTIMIZER_KEY: named_optimizer_state(model, optimizer, full=False)},
            # a PEFT model's active adapter, by PEFT's names, as transformers writes it (accelerate's adapter_only)
            FSDP_MODEL_DIR: {
                MODEL_KEY: sharded_adapter_state(model) if is_peft_model(model) else get_model_state_dict(model)
            },
        }
        for name, state in states.items():
            writer = dcp.FileSystemWriter(os.path.join(folder, name))
            dcp.save(dcp_writable(state), storage_writer=writer, no_dist=not collective())
        return list(states)


#: the prefix of the engine's module's keys: under Lightning the engine holds hflight's LightningModule, whose
#: ``model`` is the transformers model
ENGINE_PREFIX = "model."


class NotGathered(Exception):
    """The run's weights are not gathered for ``save_model`` (DeepSpeed ZeRO-3 without
    ``stage3_gather_16bit_weights_on_model_save``): its checkpoint form is written in their place."""


class DeepSpeedState(CheckpointForm):
    """DeepSpeed: ``engine.save_checkpoint`` (``global_step<N>/`` with every process's partition of the weights and
    optimizer states, ``latest``, ``zero_to_fp32.py``), as transformers' Trainer writes it; the model files beside it
    when the weights can be gathered (ZeRO 0-2 always; ZeRO-3 only with
    ``zero_optimization.stage3_gather_16bit_weights_on_model_save``, as in transformers, which otherwise writes the
    config, processing class and arguments without weights and points to ``zero_to_fp32.py``)."""

    label = (
        f"DeepSpeed's own checkpoint ({DEEPSPEED_TAG_PREFIX}<N>/: each process's ZeRO partitions of the weights and "
        "optimizer states)"
    )
    optimizer_name = DEEPSPEED_TAG_PREFIX
    background = False
    chosen_by = "deepspeed"
    not_in_background = "DeepSpeed writes its partitions itself, on every process"
    engine = "deepspeed"
    advice_to_other_runs = (
        "Only DeepSpeed's engine reads its optimizer partitions: resume it with the deepspeed config it was written "
        "with, on the number of processes that wrote it (the partitions do not reshard on load; DeepSpeed's "
        "ds_to_universal conversion makes a checkpoint that DeepSpeed alone reads), or start this run from its weights "
        f"with a fresh optimizer ({DEEPSPEED_SCRIPT} in the folder rebuilds them; {SAFE_WEIGHTS_NAME} where they were "
        "gathered), without resume_from_checkpoint."
    )
    advice_to_other_checkpoints = (
        "DeepSpeed's engine restores only its own checkpoints, and hflight does not turn other optimizer states into "
        "ZeRO partitions: resume it without deepspeed (hflight reads it on any number of processes, with FSDP2 or "
        "without), or start the DeepSpeed run from its weights with a fresh optimizer (the model loaded from them), "
        "without resume_from_checkpoint."
    )

    def __init__(self, engine: Any, config: dict[str, Any]) -> None:
        super().__init__()
        self.engine = engine
        zero = config.get("zero_optimization") or {}
        self.stage3 = zero.get("stage") == 3
        # ZeRO-3 gathers the weights for save_model only with this; without it save_model writes all but the weights
        # (config, processing class, arguments), into checkpoints too, as transformers' does
        self.gathered = not self.stage3 or bool(zero.get("stage3_gather_16bit_weights_on_model_save"))

    @classmethod
    def written_by(cls, args: Any) -> bool:
        return bool(args.deepspeed)

    @classmethod
    def found_in(cls, folder: str | os.PathLike) -> bool:
        return deepspeed_tag(Path(folder)) is not None

    @classmethod
    def weight_files(cls, folder: str | os.PathLike) -> list[str]:
        """Its partitions (ZeRO-3 without gathered weights: the model's only copy)."""
        tag = deepspeed_tag(Path(folder))
        return sorted(f"{tag}/{p.name}" for p in (Path(folder) / tag).iterdir() if p.is_file()) if tag else []

    @classmethod
    def part_of(cls, name: str) -> str | None:
        """Every file of a tag folder holds the weights' partitions (the model part; the optimizer's are beside)."""
        return "model" if name.startswith(DEEPSPEED_TAG_PREFIX) and "/" in name else None

    @classmethod
    def read_optimizer(cls, folder: Path, optimizer: torch.optim.Optimizer, names: dict[int, str]) -> Any:
        """Read by the run's engine once it is built (:meth:`restore`): the folder is kept."""
        return Path(folder)

    @classmethod
    def load_optimizer(
        cls, folder: Path, saved: Any, model: nn.Module, optimizer: torch.optim.Optimizer, run_form: CheckpointForm
    ) -> None:
        """Read by the run's engine (a DeepSpeed run's form), with the weights: every process its partitions."""
        run_form.restore(Path(saved))

    def full_model_state(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        if not self.stage3:  # whole on every process; cloned as accelerate's get_state_dict does under DeepSpeed (so
            # save_pretrained writes tied weights twice, as transformers' checkpoints hold them)
            return {k: v.detach().clone().cpu() for k, v in model.state_dict().items()}
        if not self.gathered:
            raise NotGathered(
                "stage3_gather_16bit_weights_on_model_save=false. Saving the full checkpoint instead, use "
                f"{DEEPSPEED_SCRIPT} to recover weights"  # transformers' words
            )
        state = self.engine._zero3_consolidated_16bit_state_dict() or {}  # whole on global rank 0 (collective)
        return {k[len(ENGINE_PREFIX) :]: v for k, v in state.items() if k.startswith(ENGINE_PREFIX)}

    def write(
        self, folder: str, model: nn.Module, optimizer: torch.optim.Optimizer, is_main: bool, save: Any = torch.save
    ) -> list[str]:
        self.engine.save_checkpoint(folder)  # every process: its partitions; the tag global_step<N>
        tag = Path(folder) / f"{DEEPSPEED_TAG_PREFIX}{self.engine.global_steps}"
        for name in deepspeed_files_naming_parameters(self.engine.global_rank):
            if (tag / name).is_file():
                _names_as_transformers(tag / name)
        return [tag.name]

    def restore(self, folder: Path, module_only: bool = False) -> None:
        """A DeepSpeed checkpoint into the engine (every process its partitions): the weights and, unless
        ``module_only``, the optimizer's states; the schedule is the Trainer's (``scheduler.pt``). Its number of
        processes must be the run's (DeepSpeed's partitions do not reshard on load)."""
        import torch.distributed as dist

        tag = deepspeed_tag(folder)
        written = len(list((folder / tag).glob(DEEPSPEED_OPTIMIZER_FILES))) if tag else 0
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
    model): every name gains the prefix, those of a model whose own names start with it too (a Llama's
    ``model.embed_tokens.weight`` is the module's ``model.model.embed_tokens.weight``). A module state saved with the
    engine module's own names (hflight's checkpoints before :func:`_names_as_transformers`) is told apart by the whole
    key set, never by a key's start, and loads as it is."""
    own = dst.state_dict().keys()
    named = {ENGINE_PREFIX + k: v for k, v in src.items()}
    if not named.keys() <= own and src.keys() <= own:
        named = src
    dst.load_state_dict(named)


def deepspeed_tag(folder: Path) -> str | None:
    """The DeepSpeed checkpoint a folder holds (the tag ``latest`` names, its folder there), or None."""
    latest = folder / DEEPSPEED_LATEST
    if not latest.is_file() or latest.is_symlink():
        return None
    tag = latest.read_text(encoding="utf-8").strip()
    return tag if tag.startswith(DEEPSPEED_TAG_PREFIX) and (folder / tag).is_dir() else None


# ---- the list of forms ---------------------------------------------------------------------------------------------
#: every form, in the order a folder is searched for them (a run's arguments choose exactly one)
FORMS: tuple[type[CheckpointForm], ...] = (ProcessZeroState, GatheredState, ShardedState, DeepSpeedState)


def found_form(folder: str | os.PathLike) -> type[CheckpointForm] | None:
    """The form of the optimizer ``folder`` holds (None: none, as with ``save_only_model``)."""
    return next((form for form in FORMS if form.found_in(folder)), None)


def planned_form(args: Any) -> type[CheckpointForm]:
    """The form a run of ``args`` (transformers' arguments) writes, known before its strategy is built: what it can
    resume is asked of it (:meth:`CheckpointForm.refusal`) before anything is loaded."""
    return next(form for form in FORMS if form.written_by(args))


def resume_refusal(args: Any, model: nn.Module | None, written: type[CheckpointForm], folder: Path) -> str | None:
    """Why a run of ``args`` training ``model`` cannot continue the optimizer of ``folder`` (a checkpoint of the form
    ``written``), naming both layouts; None when it can. A model transformers loaded tensor-parallel (``_tp_size`` >
    1) writes :class:`ShardedState` whatever the arguments say (its strategy's form): its refusals name that layout."""
    tp = model_tp_size(model)
    if tp > 1:
        layout = f"tensor-parallel, tp_size={tp}: the model's DTensors, each process writing its shards"
        return ShardedState.refusal(written, folder, layout)
    return planned_form(args).refusal(written, folder)


def own_weight_files(folder: str | os.PathLike) -> list[str]:
    """The weights of the first form that keeps its own in ``folder`` (empty: none)."""
    return next((files for form in FORMS if (files := form.weight_files(folder))), [])


def part_of_form(name: str) -> str | None:
    """The part (``"model"``, ``"optimizer"``) a form's file ``name`` belongs to; None: no form's file."""
    return next((part for form in FORMS if (part := form.part_of(name)) is not None), None)


def background_refusal(form: CheckpointForm | type[CheckpointForm], nodes_writing: int) -> str | None:
    """Why ``save_async`` cannot write the checkpoints of a run writing ``form`` with ``nodes_writing`` nodes each
    publishing its own copy (``save_on_each_node``); None when it can. The one answer to that question: the
    arguments ask it through their registry (``hflight.arguments.registry.CHECKPOINTS``), the writer again for the
    strategy the run really has."""
    if not form.background:
        setting, why = form.chosen_by, form.not_in_background
    elif nodes_writing > 1:
        setting = "save_on_each_node with num_nodes > 1"
        why = "the nodes' writers must publish each checkpoint together"
    else:
        return None
    return (
        f"save_async=True cannot be combined with {setting}: {why}. Set save_async=False (checkpoints are then written "
        "before training goes on, as in transformers)."
    )


def save_async_refusal(args: Any) -> str | None:
    """:func:`background_refusal` for a run of ``args`` (``TrainingArguments(save_async=True)``), before it starts."""
    if not args.save_async:
        return None
    return background_refusal(planned_form(args), args.num_nodes if args.save_on_each_node else 1)
