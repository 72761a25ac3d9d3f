"""``TrainingArguments``: transformers' ``TrainingArguments`` (5.23) with Lightning's four hardware fields.

The class subclasses ``transformers.TrainingArguments``, so every field (name, type, default, help), property and
method of transformers' is hflight's by construction, and transformers' own ``__post_init__`` normalises, derives and
validates. hflight adds, in this order around it:

1. type checks that name the field (command-line strings and OmegaConf containers are converted first), then the
   variables of accelerate's launcher (``accelerate launch``) as the fields they stand for
   (``hflight.arguments.launcher_env``);
2. the choices hflight can run (``optim``, ``train_sampling_strategy``, Lightning's ``accelerator``/``strategy``);
3. transformers' ``__post_init__``, with the device answered by Lightning's side (no accelerate ``PartialState`` is
   created: Lightning launches and connects the processes);
4. the fields that have no Lightning equivalent, set to a non-default value: a ``ValueError`` that names each one and
   says what to use instead (:data:`UNSUPPORTED`).

Hydra composes ``args`` against :func:`config_schema`, a dataclass of the same fields with types OmegaConf
understands; :meth:`TrainingArguments.from_config` builds the arguments from the composed node.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
import logging
import numbers
import os
import signal
import types
import typing
from collections.abc import Callable
from enum import Enum
from functools import cached_property
from typing import Any, Optional, Union

import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from transformers import TrainingArguments as HFTrainingArguments
from transformers.debug_utils import DebugOption
from transformers.trainer_utils import HubStrategy, IntervalStrategy, SaveStrategy, SchedulerType
from transformers.training_args import OptimizerNames, ParallelMode, trainer_log_levels

from hflight._util import is_remote
from hflight.arguments import cluster, launcher_env, process_group
from hflight.arguments.deepspeed import load_deepspeed_config
from hflight.arguments.registry import CHECKPOINTS, register_backends

logger = logging.getLogger(__name__)

__all__ = [
    "CHECKPOINT_FIELDS",
    "CLUSTER_FIELDS",
    "EVALUATION_FIELDS",
    "HFLIGHT_FIELDS",
    "LIGHTNING_FIELDS",
    "SUPPORTED_ACCELERATORS",
    "SUPPORTED_OPTIMIZERS",
    "SUPPORTED_TRAIN_SAMPLING_STRATEGIES",
    "UNSUPPORTED",
    "TrainingArguments",
    "coerce_training_args",
    "config_schema",
    "configured_accelerate_state",
    "gradient_accumulation_plugin_kwargs",
    "register_parser_types",
    "supported_accelerators",
    "supported_optimizers",
    "supported_strategies",
]

#: ``optim`` values hflight builds: every transformers ``OptimizerNames`` value, by transformers' own
#: ``get_optimizer_cls_and_kwargs`` (see ``hflight.arguments.optimizers``; backends may register more).
SUPPORTED_OPTIMIZERS: tuple[str, ...] = tuple(member.value for member in OptimizerNames)
#: ``train_sampling_strategy`` values hflight implements (transformers also has "batch_rebalance").
SUPPORTED_TRAIN_SAMPLING_STRATEGIES: tuple[str, ...] = ("random", "sequential", "group_by_length")
#: ``accelerator`` names accepted by hflight (Lightning's names).
SUPPORTED_ACCELERATORS: tuple[str, ...] = ("auto", "cpu", "gpu", "cuda", "mps", "tpu")
#: Fields that come from ``lightning.Trainer`` and have no transformers counterpart.
LIGHTNING_FIELDS: tuple[str, ...] = ("accelerator", "devices", "strategy", "num_nodes")
#: Fields for runs a cluster scheduler launches (Lightning's ``SLURMEnvironment(requeue_signal=...)``).
CLUSTER_FIELDS: tuple[str, ...] = ("requeue_signal",)
#: Checkpoint fields transformers lacks (``save_async``: background checkpoint writes; ``remote_output_dir`` and
#: ``storage_options``: checkpoints on object storage; docs/checkpoints.md).
CHECKPOINT_FIELDS: tuple[str, ...] = ("save_async", "remote_output_dir", "storage_options")
#: Evaluation fields transformers lacks (``int8_eval``: evaluation on an int8 copy of the model, docs/benchmarks.md).
EVALUATION_FIELDS: tuple[str, ...] = ("int8_eval",)
#: Every field hflight adds to transformers', in order.
HFLIGHT_FIELDS: tuple[str, ...] = (*LIGHTNING_FIELDS, *CLUSTER_FIELDS, *CHECKPOINT_FIELDS, *EVALUATION_FIELDS)
#: Dict fields that only take a dict or a JSON object string (transformers also reads a file path for its
#: accelerate/FSDP/DeepSpeed configs; for these a path means nothing).
_JSON_ONLY_DICT_FIELDS = (
    "lr_scheduler_kwargs",
    "activation_checkpointing_kwargs",
    "gradient_checkpointing_kwargs",
    "storage_options",
)
_TRUE_STRINGS = ("true", "yes", "y", "t", "1")
_FALSE_STRINGS = ("false", "no", "n", "f", "0")


def supported_strategies() -> tuple[str, ...]:
    """Valid ``strategy`` names: "auto" and Lightning's registered strategies (hflight's backends, such as "ipu" and
    "ort", register there when ``hflight`` is imported)."""
    from lightning.pytorch.strategies import StrategyRegistry

    return ("auto", *StrategyRegistry.available_strategies())


def supported_accelerators() -> tuple[str, ...]:
    """Valid ``accelerator`` names: Lightning's built-in ones and every registered accelerator (e.g. "ipu")."""
    from lightning.pytorch.accelerators import AcceleratorRegistry

    return tuple(dict.fromkeys((*SUPPORTED_ACCELERATORS, *sorted(AcceleratorRegistry.available_accelerators()))))


def supported_optimizers() -> tuple[str, ...]:
    """Valid ``optim`` names: transformers' ``OptimizerNames`` and the optimizers backends registered (ONNX Runtime's
    "adamw_ort_fused")."""
    from hflight.arguments.optimizers import OPTIMIZERS

    return tuple(dict.fromkeys((*SUPPORTED_OPTIMIZERS, *OPTIMIZERS)))


@dataclasses.dataclass
class TrainingArguments(HFTrainingArguments):
    """transformers' ``TrainingArguments`` plus Lightning's ``accelerator``, ``devices``, ``strategy`` and
    ``num_nodes`` (names and defaults of ``lightning.Trainer``).

    Every transformers field, property and method is here with transformers' meaning. What Lightning decides instead
    of accelerate: ``device``, ``n_gpu``, ``parallel_mode``, ``world_size``, ``process_index`` and
    ``local_process_index`` answer from the environment Lightning (or torchrun, SLURM) sets up; ``use_cpu=True`` means
    ``accelerator="cpu"``; ``ddp_*``, ``fsdp``/``fsdp_config`` and ``deepspeed`` become the settings of Lightning's
    DDP, FSDP and DeepSpeed strategies (``hflight.arguments.lightning_kwargs``). Fields without a Lightning equivalent
    are listed in :data:`UNSUPPORTED`: left at their defaults they change nothing, set otherwise they raise.

    Lightning extras: ``accelerator`` (one of ``SUPPORTED_ACCELERATORS``, a registered one such as "ipu", or a Lightning
    ``Accelerator``), ``devices`` ("auto", a count, "0,1" or a list of indices; "2" becomes ``2``), ``strategy`` (see
    ``supported_strategies()``, or a Lightning ``Strategy``) and ``num_nodes``.

    Wrong types raise ``TypeError`` (also a ``ValueError``, as transformers raises) and unknown choices
    ``ValueError``, each naming the field.
    """

    accelerator: str = dataclasses.field(
        default="auto",
        metadata={"help": f"Lightning accelerator: {', '.join(SUPPORTED_ACCELERATORS)} or a registered one (ipu)."},
    )
    devices: str = dataclasses.field(
        default="auto", metadata={"help": "Lightning devices: 'auto', a count (e.g. 2), or indices such as '0,1'."}
    )
    strategy: str = dataclasses.field(
        default="auto", metadata={"help": "Lightning strategy, e.g. 'auto', 'ddp', 'fsdp', 'deepspeed', 'ipu', 'ort'."}
    )
    num_nodes: int = dataclasses.field(
        default=1, metadata={"help": "Number of nodes (machines) for distributed training."}
    )
    requeue_signal: Optional[str] = dataclasses.field(  # noqa: UP045 - HfArgumentParser reads the annotation
        default="SIGUSR1",
        metadata={
            "help": "Under SLURM: the signal that asks for a requeue (#SBATCH --signal=USR1@90). Training stops at the "
            "next step with a checkpoint, then `scontrol requeue` runs on global rank 0. None: no requeue handling."
        },
    )

    save_async: bool = dataclasses.field(
        default=False,
        metadata={
            "help": "Write checkpoints in the background: the training loop copies the state into host memory at the "
            "step boundary and goes on; the checkpoint is published once every byte is on disk (docs/checkpoints.md). "
            "False (default): written before training goes on, as transformers."
        },
    )
    remote_output_dir: Optional[str] = dataclasses.field(  # noqa: UP045 - HfArgumentParser reads the annotation
        default=None,
        metadata={
            "help": "An fsspec URL (s3://bucket/run, gs://..., az://..., memory://...) where checkpoints, the model "
            "and the results files are stored, each written into output_dir (the local staging folder) first and "
            "uploaded from there; a checkpoint counts once its manifest object is stored. output_dir='s3://...' "
            "sets this and puts output_dir under HFLIGHT_STAGING_DIR (default ~/.cache/hflight/staging)."
        },
    )
    storage_options: Optional[Union[dict, str]] = dataclasses.field(  # noqa: UP007, UP045 - HfArgumentParser
        default=None,
        metadata={
            "help": "Options of the filesystem of remote_output_dir and of a resume_from_checkpoint URL (fsspec's "
            "storage_options, as datasets takes them), "
            'e.g. {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}; a dict or a JSON object string. '
            "Credentials are otherwise read where the filesystem reads them (the environment, ~/.aws, ...)."
        },
    )
    int8_eval: bool = dataclasses.field(
        default=False,
        metadata={
            "help": "evaluate()/predict() outside train() on a copy of the model whose linear layers are quantized "
            "to int8 (torch's dynamic quantization; CPU, one process; the model itself is unchanged). Needs int8 "
            "dot-product instructions (AVX512-VNNI, AVX-VNNI or AMX-INT8), else it warns and evaluates in float32."
        },
    )

    def __post_init__(self) -> None:
        _coerce_field_types(self)
        launcher_env.apply(self, lambda: resolved_device_type(self))  # accelerate launch's variables
        _normalise_hflight_values(self)
        _split_remote_output_dir(self)
        for name, (enum_cls, choices) in _CHOICES.items():
            setattr(self, name, _check_choice(name, getattr(self, name), enum_cls, choices()))
        _check_lower_bounds(self)
        _check_requeue_signal(self)
        if self.deepspeed:  # the file and the position named, before transformers' own reading of it
            _check_deepspeed_installed()
            load_deepspeed_config(self.deepspeed)
        # An optimizer a backend registered (e.g. ONNX Runtime's "adamw_ort_fused") is no transformers
        # OptimizerNames member; transformers' __post_init__ converts `optim` to that enum, so it sees a stand-in.
        backend_optim = None if isinstance(self.optim, OptimizerNames) else self.optim
        if backend_optim is not None:
            self.optim = OptimizerNames.ADAMW_TORCH
        super().__post_init__()
        if backend_optim is not None:
            self.optim = backend_optim
        _reject_unsupported(self)
        _check_accelerator_config(self)
        _check_save_async(self)

    def _validate_args(self) -> None:
        """transformers' checks; its bf16 check asks for a bf16 GPU unless ``use_cpu``, but Lightning also runs
        bf16-mixed on the CPU, so only a run on a CUDA GPU that is present is held to it (asking for a GPU where there
        is none is Lightning's error, when the run starts)."""
        use_cpu = self.use_cpu
        self.use_cpu = use_cpu or not (resolved_device_type(self) == "cuda" and torch.cuda.is_available())
        try:
            super()._validate_args()
        finally:
            self.use_cpu = use_cpu

    # ---- devices and processes: Lightning's side, not accelerate's -------------------------------------------------
    @cached_property
    def _setup_devices(self) -> torch.device:
        """The device of this process as Lightning will use it (no accelerate state is created); with
        ``accelerator_config['use_configured_state']``, the device of the accelerate state the user made."""
        self.distributed_state = configured_accelerate_state(self)
        #: whether distributed_state is one the user made (use_configured_state), which the run's accelerator answers
        #: with; hflight.trl's configs keep one made for TRL's code there too, as transformers' arguments do
        self.accelerate_state_configured = self.distributed_state is not None
        if self.distributed_state is not None:
            device = self.distributed_state.device
            if self.accelerator == "auto":  # Lightning runs where the configured state is
                self.accelerator = {"cpu": "cpu", "cuda": "gpu", "mps": "mps"}.get(device.type, "auto")
        else:
            device = _device_for(self)
        self._n_gpu = 1 if device.type == "cuda" else 0
        if self.deepspeed and cluster.launched_world_size() not in (None, 1):
            _connect_for_deepspeed(self, device)
        return device

    @property
    def parallel_mode(self) -> ParallelMode:
        """``DISTRIBUTED`` when several processes train together, else ``NOT_PARALLEL`` (hflight never runs
        ``torch.nn.DataParallel``)."""
        return ParallelMode.DISTRIBUTED if self.world_size > 1 else ParallelMode.NOT_PARALLEL

    @property
    def world_size(self) -> int:
        """Number of processes: from ``torch.distributed`` once initialised, else from the launcher's variables
        (torchrun's, srun's, ...: ``hflight.arguments.cluster``), else ``WORLD_SIZE`` (default 1)."""
        dist = _initialized_dist()
        if dist is not None:
            return dist.get_world_size()
        launched = cluster.ranks(self.num_nodes)
        if launched is not None:
            return launched.world_size
        return int(os.environ.get("WORLD_SIZE", "1"))

    @property
    def process_index(self) -> int:
        """Global rank: ``torch.distributed``, else the external launcher's (``RANK`` of torchrun, ``SLURM_PROCID``
        of srun, ...), else ``RANK``, else Lightning's node/local ranks."""
        dist = _initialized_dist()
        if dist is not None:
            return dist.get_rank()
        launched = cluster.ranks(self.num_nodes)
        if launched is not None:
            return launched.global_rank
        if "RANK" in os.environ:
            return int(os.environ["RANK"])
        per_node = max(1, self.world_size // max(1, self.num_nodes))
        return int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0"))) * per_node + self.local_process_index

    @property
    def local_process_index(self) -> int:
        """Rank of this process on its node: the external launcher's (``LOCAL_RANK`` of torchrun, ``SLURM_LOCALID``
        of srun, ...), else ``LOCAL_RANK`` (set by Lightning for the processes it starts; default 0)."""
        launched = cluster.ranks(self.num_nodes)
        if launched is not None:
            return launched.local_rank
        return int(os.environ.get("LOCAL_RANK", "0"))

    @contextlib.contextmanager
    def main_process_first(self, local: bool = True, desc: str = "work"):
        """Run the body on the main process first, then on the replicas (a no-op outside ``torch.distributed``).

        Args:
            local: main process of each node (True) or of the whole job (False).
            desc: a description of the work, for debug logs.
        """
        dist = _initialized_dist()
        if dist is None or self.world_size <= 1:
            yield
            return
        is_main = (self.local_process_index if local else self.process_index) == 0
        try:
            if not is_main:
                logger.debug(f"{self.process_index}: waiting for the main process to perform {desc}")
                dist.barrier()
            yield
        finally:
            if is_main:
                dist.barrier()

    # ---- conversions -----------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """transformers' ``to_dict`` (enums as values, tokens hidden); Lightning objects by their class name."""
        d = super().to_dict()
        for name in ("accelerator", "strategy"):
            if name in d and not isinstance(d[name], str):
                d[name] = type(d[name]).__name__
        if d.get("storage_options"):  # credentials often: hidden as transformers hides its tokens
            d["storage_options"] = "<STORAGE_OPTIONS>"
        return d

    def __str__(self) -> str:
        shown = {k: f"<{k.upper()}>" if k.endswith("_token") else v for k, v in self.to_dict().items()}
        return f"{type(self).__name__}(\n" + "".join(f"{k}={v},\n" for k, v in sorted(shown.items())) + ")"

    __repr__ = __str__

    def to_transformers(self) -> HFTrainingArguments:
        """These arguments as a plain ``transformers.TrainingArguments`` (what ``training_args.bin`` holds, so that
        the file loads without hflight): transformers' fields only, values as they are, no ``__post_init__`` rerun
        (it would set up devices)."""
        plain = HFTrainingArguments.__new__(HFTrainingArguments)
        for f in dataclasses.fields(HFTrainingArguments):
            setattr(plain, f.name, getattr(self, f.name))
        for name in ("mixed_precision", "fsdp_plugin_args", "deepspeed_plugin", "hf_deepspeed_config"):
            if name in vars(self):
                setattr(plain, name, vars(self)[name])
        return plain

    @classmethod
    def from_hf(cls, hf_args: HFTrainingArguments) -> TrainingArguments:
        """hflight arguments from a ``transformers.TrainingArguments`` (or a subclass): every field copied, the
        Lightning fields at their defaults (``use_cpu=True`` gives ``accelerator="cpu"``). Fields of a transformers
        subclass (e.g. ``Seq2SeqTrainingArguments.predict_with_generate``) are kept as attributes.

        Raises:
            TypeError: ``hf_args`` is not a transformers ``TrainingArguments``.
            ValueError: a field hflight cannot honour is set (see :data:`UNSUPPORTED`; all such fields are named).
        """
        if not isinstance(hf_args, HFTrainingArguments) or isinstance(hf_args, TrainingArguments):
            raise TypeError(f"from_hf expects a transformers.TrainingArguments, got {type(hf_args).__name__}")
        values, others = field_values(cls, hf_args)
        args = cls(**values)
        for name, value in others.items():
            setattr(args, name, value)
        return args

    @classmethod
    def from_args(cls, args: TrainingArguments | None, owner: str) -> TrainingArguments:
        """``args`` as this class, for a trainer with its own arguments class (``IPUTrainer``, ``ORTTrainer``): None
        gives the defaults, an instance of this class is used as it is, other hflight or transformers
        ``TrainingArguments`` are copied field by field (the new class's own fields get their defaults).

        Raises:
            TypeError: ``args`` is no ``TrainingArguments`` (``owner`` names the trainer).
        """
        if args is None:
            return cls()
        if isinstance(args, cls):
            return args
        if isinstance(args, HFTrainingArguments):
            return cls(**field_values(cls, args)[0])
        raise TypeError(f"{owner}: args must be {cls.__name__} or TrainingArguments, got {type(args).__name__}")

    @classmethod
    def from_config(cls, node: Any) -> TrainingArguments:
        """The arguments from a composed Hydra ``args`` node (or any mapping of field names)."""
        values = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
        return cls(**values)


# ---------------------------------------------------------------------- what hflight adds around __post_init__


# Choice tables: field -> (transformers enum or None, function returning the valid values).
@functools.cache
def _values(enum_cls: type[Enum]) -> tuple[str, ...]:
    return tuple(member.value for member in enum_cls)


_CHOICES: dict[str, tuple[type | None, Callable[[], tuple[str, ...]]]] = {
    "lr_scheduler_type": (SchedulerType, lambda: _values(SchedulerType)),
    "optim": (OptimizerNames, supported_optimizers),
    "logging_strategy": (IntervalStrategy, lambda: _values(IntervalStrategy)),
    "eval_strategy": (IntervalStrategy, lambda: _values(IntervalStrategy)),
    "save_strategy": (SaveStrategy, lambda: _values(SaveStrategy)),
    "hub_strategy": (HubStrategy, lambda: _values(HubStrategy)),
    "train_sampling_strategy": (None, lambda: SUPPORTED_TRAIN_SAMPLING_STRATEGIES),
    "include_num_input_tokens_seen": (None, lambda: ("all", "non_padding", "no")),
    "log_level": (None, lambda: _LOG_LEVELS),
    "log_level_replica": (None, lambda: _LOG_LEVELS),
    "accelerator": (None, supported_accelerators),
    "strategy": (None, supported_strategies),
}

_LOG_LEVELS = tuple(trainer_log_levels)

# Lower bounds: field -> (smallest valid value, wording for the error).
_LOWER_BOUNDS: dict[str, tuple[float, str]] = {
    "per_device_train_batch_size": (1, "a positive integer"),
    "per_device_eval_batch_size": (1, "a positive integer"),
    "gradient_accumulation_steps": (1, "a positive integer"),
    "eval_accumulation_steps": (1, "a positive integer or None"),
    "warmup_steps": (0, ">= 0 (an int, or a float in [0, 1) for a ratio)"),
    "num_nodes": (1, "a positive integer"),
    "dataloader_num_workers": (0, ">= 0"),
}


@functools.cache
def _extra_types() -> dict[str, tuple[type, ...]]:
    """Runtime values a field accepts beyond its annotation: Lightning's device forms, and the normal forms
    transformers' own ``__post_init__`` leaves behind (so arguments built from another instance's values pass)."""
    extra: dict[str, tuple[type, ...]] = {"devices": (int, list, tuple), "debug": (type(None),), "fsdp": (bool, list)}
    with contextlib.suppress(ImportError):
        from transformers.trainer_pt_utils import AcceleratorConfig

        extra["accelerator_config"] = (AcceleratorConfig, type)  # a class: transformers' own NotImplementedError
    return extra


class ArgumentTypeError(TypeError, ValueError):
    """A field given a value of the wrong type. A ``TypeError``, and a ``ValueError`` as transformers' own checks
    raise for the same values (``except ValueError`` written for transformers still catches it)."""


#: Integer fields whose value transformers checks with ``isinstance(value, int)`` itself (raising ``ValueError`` for a
#: float): not converted here, so its check sees the value as given.
_EXACT_INT_FIELDS = frozenset({"torch_empty_cache_steps"})


def _coerce_field_types(args: TrainingArguments) -> None:
    """Every init field converted to its annotation (command-line strings, OmegaConf containers), else a
    ``TypeError`` naming the field, the expected type and the value. Values whose type the annotation names as it
    is (the common case) are taken without conversion."""
    hints = _type_hints(type(args))
    values = vars(args)
    for name, exact in _exact_types(type(args)).items():
        value = values[name]
        if name in _EXACT_INT_FIELDS and isinstance(value, float):
            continue
        if type(value) not in exact:
            setattr(args, name, _check_type(name, value, hints[name]))


@functools.cache
def _exact_types(cls: type) -> dict[str, frozenset[type]]:
    """Init field -> the value types its annotation accepts without conversion (containers excluded: their items
    are checked)."""
    hints = _type_hints(cls)
    return {f.name: frozenset(_plain_members(hints[f.name])) for f in dataclasses.fields(cls) if f.init}


def _plain_members(hint: Any) -> list[type]:
    members = typing.get_args(hint) if _is_union(hint) else (hint,)
    plain = [m for m in members if isinstance(m, type) and typing.get_origin(m) is None and m not in (list, dict)]
    return plain + ([int] if float in plain else [])  # an int is a valid float, as transformers takes it


def _normalise_hflight_values(args: TrainingArguments) -> None:
    """Normal forms transformers leaves alone: booleans as strings, JSON dict strings checked, ``devices``."""
    if isinstance(args.include_num_input_tokens_seen, str) and args.include_num_input_tokens_seen.lower() in (
        "true",
        "false",
    ):
        args.include_num_input_tokens_seen = args.include_num_input_tokens_seen.lower() == "true"
    for name in _JSON_ONLY_DICT_FIELDS:
        value = getattr(args, name)
        if isinstance(value, str):
            setattr(args, name, _parse_json_dict(name, value))
    if isinstance(args.report_to, str) and "," in args.report_to:
        args.report_to = [name.strip() for name in args.report_to.split(",") if name.strip()]
    if args.report_to is None:
        args.report_to = "none"
    args.devices = _normalize_devices(args.devices)
    if isinstance(args.warmup_steps, float) and args.warmup_steps >= 1 and args.warmup_steps.is_integer():
        args.warmup_steps = int(args.warmup_steps)
    if args.use_cpu and args.accelerator == "auto":
        args.accelerator = "cpu"


#: where a remote output_dir's staging folders go by default (HFLIGHT_STAGING_DIR overrides it)
DEFAULT_STAGING_ROOT = os.path.join("~", ".cache", "hflight", "staging")


def staging_folder(url: str) -> str:
    """The local staging folder of ``url`` when ``output_dir`` names the URL itself: ``$HFLIGHT_STAGING_DIR`` (else
    ``~/.cache/hflight/staging``) / protocol / the URL's path (``s3://bucket/run`` -> ``.../s3/bucket/run``)."""
    protocol, _, rest = url.partition("://")
    root = os.path.expanduser(os.environ.get("HFLIGHT_STAGING_DIR") or DEFAULT_STAGING_ROOT)
    parts = [part for part in rest.split("/") if part not in ("", ".", "..")]
    return os.path.join(os.path.abspath(root), protocol, *parts)


def _split_remote_output_dir(args: TrainingArguments) -> None:
    """``output_dir`` given as a URL of an object store: the URL becomes ``remote_output_dir`` and ``output_dir`` its
    local staging folder (:func:`staging_folder`), where every file is written before it is uploaded
    (``hflight.checkpoints.storage``). A ``file://`` URL is the local folder it names."""
    output_dir = args.output_dir
    if isinstance(output_dir, str) and output_dir.startswith("file://"):
        args.output_dir = output_dir = output_dir[len("file://") :]
    for url in (output_dir, args.remote_output_dir):
        if is_remote(url) and any(part in (".", "..") for part in url.split("://", 1)[1].split("/")):
            raise ValueError(f"{url!r}: a URL with '.' or '..' parts names other keys than it seems to; write it out.")
    if is_remote(output_dir):
        if args.remote_output_dir not in (None, output_dir):
            raise ValueError(
                f"output_dir={output_dir!r} and remote_output_dir={args.remote_output_dir!r} name two places: give "
                "the URL once (as output_dir, or as remote_output_dir with output_dir the local staging folder)."
            )
        args.remote_output_dir, args.output_dir = output_dir, staging_folder(output_dir)
    if args.remote_output_dir is not None:
        if not is_remote(args.remote_output_dir):
            raise ValueError(
                f"remote_output_dir={args.remote_output_dir!r} is not the URL of an object store (s3://bucket/path, "
                "gs://..., az://..., memory://...); a local folder is output_dir."
            )
        if is_remote(args.output_dir):
            raise ValueError(f"output_dir={args.output_dir!r}: the staging folder of remote_output_dir is local.")
        if args.save_on_each_node:
            raise ValueError(
                f"save_on_each_node=True with remote_output_dir={args.remote_output_dir!r} is not supported yet: "
                "every node would upload its own copy of each checkpoint into the one URL. Save on the main process "
                "only (save_on_each_node=False)."
            )
        args.remote_output_dir = args.remote_output_dir.rstrip("/")


def _check_lower_bounds(args: TrainingArguments) -> None:
    for name, (lower, description) in _LOWER_BOUNDS.items():
        value = getattr(args, name)
        if value is not None and value < lower:
            raise ValueError(f"{name} must be {description}, got {value!r}")


def _check_save_async(args: TrainingArguments) -> None:
    """``save_async`` with a checkpoint whose writers must publish together or that the strategy writes itself: the
    checkpoint forms say so (``hflight.checkpoints.forms.background_refusal``, through the registry)."""
    if not args.save_async:
        return
    refusal = CHECKPOINTS.save_async_refusal
    if refusal is None:  # registration always fills it; never skip the check
        raise RuntimeError("hflight's checkpoint forms are not registered (hflight.sharding.registration)")
    reason = refusal(args)
    if reason is not None:
        raise ValueError(reason)


def _check_requeue_signal(args: TrainingArguments) -> None:
    """``requeue_signal``: a signal name (normalised to ``SIGUSR1`` form) or None; not the signal
    ``enable_jit_checkpoint`` gives to transformers (SIGTERM)."""
    found = cluster.parse_requeue_signal(args.requeue_signal)
    args.requeue_signal = found.name if found is not None else None
    if found == signal.SIGTERM and args.enable_jit_checkpoint:
        raise ValueError(
            "requeue_signal='SIGTERM' and enable_jit_checkpoint=True both claim SIGTERM; choose another requeue signal "
            "(SIGUSR1, as #SBATCH --signal=USR1@90 sends) or turn enable_jit_checkpoint off"
        )


def _check_choice(name: str, value: Any, enum_cls: type | None, choices: tuple[str, ...]) -> Any:
    """``value`` as a member of ``enum_cls`` (or the plain string); an unknown value raises ``ValueError``."""
    if not isinstance(value, str):  # a Lightning Accelerator/Strategy instance, or a boolean token count
        return value
    lookup = _choice_lookup(enum_cls, choices)
    key = value.value if isinstance(value, Enum) else value
    if key not in lookup:
        raise ValueError(f"Unknown {name} {key!r}; valid choices are: {', '.join(choices)}")
    return lookup[key]


@functools.cache
def _choice_lookup(enum_cls: type | None, choices: tuple[str, ...]) -> dict[str, Any]:
    """Accepted spelling -> value: the choices, and for an enum its members under their values and the names
    OmegaConf writes for enums ("IntervalStrategy.STEPS", "STEPS")."""
    lookup: dict[str, Any] = {c: c for c in choices}
    if enum_cls is not None:
        for member in enum_cls:
            if member.value in lookup:
                for key in (member.value, member.name, f"{enum_cls.__name__}.{member.name}"):
                    lookup[key] = member
    return lookup


# ---- accelerator_config: accelerate's settings, honoured by hflight.run.loaders and trainer.accelerator -------------
#: accelerate's ``GradientAccumulationPlugin`` fields and defaults: the keys ``gradient_accumulation_kwargs`` takes.
GRADIENT_ACCUMULATION_KWARGS: dict[str, Any] = {
    "num_steps": None,
    "adjust_scheduler": True,
    "sync_with_dataloader": True,
    "sync_each_batch": False,
}


def _check_accelerator_config(args: TrainingArguments) -> None:
    """``accelerator_config`` as transformers makes it (an ``AcceleratorConfig``; without accelerate installed
    transformers leaves it as given), and its ``gradient_accumulation_kwargs`` keys checked: transformers hands them
    to accelerate's ``GradientAccumulationPlugin`` when the ``Trainer`` is built, which refuses unknown ones."""
    from transformers.trainer_pt_utils import AcceleratorConfig

    config = args.accelerator_config
    if config is None or isinstance(config, dict):
        config = args.accelerator_config = AcceleratorConfig(**(config or {}))
    elif isinstance(config, str):
        config = args.accelerator_config = AcceleratorConfig.from_json_file(config)
    kwargs = config.gradient_accumulation_kwargs
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise TypeError(f"accelerator_config['gradient_accumulation_kwargs'] must be a dict, got {kwargs!r}")
    unknown = sorted(set(kwargs) - set(GRADIENT_ACCUMULATION_KWARGS))
    if unknown:
        raise TypeError(
            f"accelerator_config['gradient_accumulation_kwargs'] has unknown keys {unknown}: accelerate's "
            f"GradientAccumulationPlugin takes {', '.join(GRADIENT_ACCUMULATION_KWARGS)}"
        )
    steps = kwargs.get("num_steps")
    if "num_steps" in kwargs and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(
            f"accelerator_config['gradient_accumulation_kwargs']['num_steps'] must be a positive integer, got {steps!r}"
        )


def gradient_accumulation_plugin_kwargs(args: Any) -> dict[str, Any]:
    """What transformers' ``Trainer`` does with ``gradient_accumulation_kwargs`` when it is built
    (``create_accelerator_and_postprocess``): ``num_steps`` becomes ``args.gradient_accumulation_steps`` (a
    ``ValueError`` when that is set above 1 too), and accelerate's plugin gets ``num_steps=1`` (transformers
    accumulates itself). Returns the plugin's kwargs as accelerate keeps them: those that differ from its defaults.
    (transformers also writes ``num_steps=1`` into the dict itself, so that a second ``Trainer`` on the same arguments
    raises; hflight leaves the dict as given.)"""
    kwargs = dict(getattr(args.accelerator_config, "gradient_accumulation_kwargs", None) or {})
    if "num_steps" in kwargs:
        if args.gradient_accumulation_steps not in (1, kwargs["num_steps"]):
            raise ValueError(
                "The `AcceleratorConfig`'s `num_steps` is set but `gradient_accumulation_steps` is greater than 1 in "
                "the passed `TrainingArguments`If using the passed `AcceleratorConfig` is desired, do not set the "
                "`TrainingArguments` `gradient_accumulation_steps`."
            )
        args.gradient_accumulation_steps = kwargs["num_steps"]
    kwargs["num_steps"] = 1
    return {key: value for key, value in kwargs.items() if value != GRADIENT_ACCUMULATION_KWARGS[key]}


def configured_accelerate_state(args: TrainingArguments) -> Any:
    """``accelerator_config['use_configured_state']`` (taken out of the config, as transformers does): the accelerate
    state the user made before the arguments, else None. "Made" means an accelerate ``PartialState`` exists in this
    process (``PartialState()``, ``AcceleratorState()`` or ``Accelerator()`` create one); hflight then runs on its
    device, and Lightning's strategy joins the process group it started. transformers' errors: none made
    (``ValueError``), one not made for DeepSpeed while ``deepspeed`` is set (``RuntimeError``)."""
    config = args.accelerator_config
    if not hasattr(config, "pop") or not config.pop("use_configured_state", False):
        return None
    try:
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType
    except ImportError:
        PartialState = None  # noqa: N806 - accelerate's class, absent
    if PartialState is None or PartialState._shared_state == {}:
        raise ValueError(
            "Passing `'use_configured_state':True` to the AcceleratorConfig requires a pre-configured "
            "`AcceleratorState` or `PartialState` to be defined before calling `TrainingArguments`. (hflight: create "
            "accelerate's `PartialState()` or `Accelerator()` first; `pip install accelerate`.)"
        )
    state = PartialState(cpu=args.use_cpu)
    if args.deepspeed and state.distributed_type != DistributedType.DEEPSPEED:
        raise RuntimeError(
            "Tried to use an already configured `Accelerator` or `PartialState` that was not initialized for "
            "DeepSpeed, but also passed in a `deepspeed` configuration to the `TrainingArguments`. Please set "
            "`use_configured_state:False` instead or setup your `Accelerator` or `PartialState` properly."
        )
    return state


#: transformers fields that have no Lightning equivalent: field -> (still at its default?, what to do instead). Set to
#: anything else, they raise ``ValueError`` (all named at once) when the arguments are built.
UNSUPPORTED: dict[str, tuple[Callable[[TrainingArguments], bool], str]] = {
    "parallelism_config": (
        lambda a: a.parallelism_config is None or _without_context_or_sequence(a.parallelism_config),
        "cp_size > 1 needs torch's context parallelism (ring attention over SDPA, which has no sharding rule for "
        "the CPU's attention kernel: torch 2.13 raises NotImplementedError for "
        "aten._scaled_dot_product_flash_attention_for_cpu; it runs on CUDA), and sp_size > 1 needs DeepSpeed's "
        "sequence parallelism (Ulysses/ALST, sp_backend='deepspeed'): hflight runs neither; tp_size and the "
        "data-parallel sizes (dp_shard_size, dp_replicate_size) are taken",
    ),
    "debug": (
        lambda a: DebugOption.TPU_METRICS_DEBUG not in a.debug,
        "tpu_metrics_debug prints torch_xla metrics, which only exist on TPUs; 'underflow_overflow' is supported",
    ),
}


def _without_context_or_sequence(config: Any) -> bool:
    """Whether a ``ParallelismConfig`` leaves context and sequence parallelism off (cp and sp at 1 or unset)."""
    return all((getattr(config, f"{name}_size", None) or 1) == 1 for name in ("cp", "sp"))


def _reject_unsupported(args: TrainingArguments) -> None:
    """A ``ValueError`` naming every :data:`UNSUPPORTED` field set to a non-default value, and conflicting settings."""
    found = [
        f"{name}={getattr(args, name)!r} ({advice})"
        for name, (default, advice) in UNSUPPORTED.items()
        if not default(args)
    ]
    if found:
        raise ValueError(
            f"{type(args).__name__} sets fields that have no equivalent on Lightning: {'; '.join(found)}. Leave them "
            "at their defaults to train with hflight."
        )
    if args.use_cpu and args.accelerator not in ("cpu",):
        raise ValueError(f"use_cpu=True contradicts accelerator={args.accelerator!r}: set one of them.")
    chosen = [name for name in ("fsdp", "deepspeed") if getattr(args, name)]
    if len(chosen) > 1 or (chosen and args.strategy != "auto"):
        raise ValueError(
            f"{' and '.join(chosen)} and strategy={args.strategy!r} each choose the Lightning strategy: set only one."
        )


# ---------------------------------------------------------------------- devices


def resolved_device_type(args: TrainingArguments) -> str:
    """The device type Lightning will pick for ``args.accelerator`` ("auto": CUDA, else MPS, else CPU)."""
    accelerator = args.accelerator
    if not isinstance(accelerator, str):
        name = type(accelerator).__name__.lower()
        accelerator = next((kind for kind in ("cuda", "mps", "cpu") if kind in name), "auto")
    if accelerator == "auto":
        return _auto_device_type()
    return {"gpu": "cuda", "cuda": "cuda", "mps": "mps"}.get(accelerator, "cpu")


@functools.cache
def _auto_device_type() -> str:
    """What Lightning's ``accelerator="auto"`` picks on this machine: CUDA, else MPS, else the CPU."""
    if torch.cuda.is_available():
        return "cuda"
    return "mps" if torch.backends.mps.is_available() else "cpu"


def _device_for(args: TrainingArguments) -> torch.device:
    """This process's device: its local rank's GPU (among ``devices`` when they are indices), else MPS or the CPU
    (also for accelerators whose model lives on the host between calls, such as the IPU)."""
    kind = "cpu" if args.use_cpu else resolved_device_type(args)
    if kind != "cuda":
        return torch.device(kind)
    devices, local_rank = args.devices, args.local_process_index
    if isinstance(devices, str) and "," in devices:
        devices = [int(d) for d in devices.split(",") if d.strip()]
    index = devices[local_rank] if isinstance(devices, list) and local_rank < len(devices) else local_rank
    return torch.device("cuda", index)


def _check_deepspeed_installed() -> None:
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        raise ModuleNotFoundError(
            'TrainingArguments.deepspeed needs DeepSpeed, which is not installed: pip install "hflight[deepspeed]"'
        )


def _connect_for_deepspeed(args: TrainingArguments, device: torch.device) -> None:
    """Under an external launcher with ``deepspeed``: the processes connected now, as transformers' device setup does
    (``deepspeed.init_distributed``), because with ZeRO-3 the model the script builds next is partitioned as it is
    created (transformers' ``from_pretrained`` runs inside ``deepspeed.zero.Init``), which needs them. hflight's one
    connection (``hflight.arguments.process_group``) makes the group; DeepSpeed's communication layer wraps it, and
    Lightning keeps it."""
    import deepspeed

    backend = process_group.default_backend(device, args.ddp_backend)
    timeout = datetime.timedelta(seconds=args.ddp_timeout)
    process_group.connect(backend, timeout)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, timeout=timeout)


def _initialized_dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _normalize_devices(value: Any) -> Any:
    """``"2"`` -> 2 and ``"-1"`` -> -1 for Lightning; "auto", "0,1", ints and lists stay as they are."""
    if isinstance(value, str):
        text = value.strip()
        return int(text) if text.lstrip("-").isdigit() else text
    return list(value) if isinstance(value, tuple) else value


# ---------------------------------------------------------------------- types


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


_INVALID = object()
_NONE = type(None)


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (Union, types.UnionType)


def _describe(hint: Any) -> str:
    """A readable name for a type hint: ``float``, ``int or None``, ``list[str]``."""
    if _is_union(hint):
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return " or ".join(repr(a) for a in typing.get_args(hint))
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_describe(a) for a in typing.get_args(hint))}]"
    return "None" if hint is _NONE else getattr(hint, "__name__", str(hint))


def _check_type(name: str, value: Any, hint: Any) -> Any:
    """``value`` checked against ``hint`` (numeric and boolean strings converted), else a ``TypeError``."""
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=True)
    extra = _extra_types().get(name, ())
    if name in ("accelerator", "strategy") and not isinstance(value, str):
        extra = _lightning_object_types(name)
    if extra and isinstance(value, extra) and (bool in extra or not isinstance(value, bool)):
        return list(value) if isinstance(value, tuple) else value
    converted = _convert(value, hint)
    if converted is _INVALID:
        expected = " or ".join([_describe(hint), *(t.__name__ for t in extra)])
        raise ArgumentTypeError(f"TrainingArguments.{name} expects {expected}, got {value!r} ({type(value).__name__})")
    return converted


def _convert(value: Any, hint: Any) -> Any:
    """``value`` as ``hint`` (a union tries its members in order, exact matches first), or ``_INVALID``."""
    if _is_union(hint):
        members = typing.get_args(hint)
        if value is None:
            return None if _NONE in members else _INVALID
        exact = [m for m in members if isinstance(m, type) and m is not _NONE and type(value) is m]
        for member in [*exact, *(m for m in members if m is not _NONE and m not in exact)]:
            converted = _convert(value, member)
            if converted is not _INVALID:
                return converted
        return _INVALID
    origin, hint_args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin is typing.Literal:
        return value if value in hint_args else _INVALID
    if origin is list or hint is list:
        return _convert_list(value, hint_args[0] if hint_args else Any)
    if origin is dict or hint is dict:
        return dict(value) if isinstance(value, dict) else _INVALID
    if hint in _SCALAR_CONVERTERS:
        return _SCALAR_CONVERTERS[hint](value)
    if isinstance(hint, type) and issubclass(hint, Enum):
        return _to_enum(value, hint)
    if isinstance(hint, type):
        return value if isinstance(value, hint) else _INVALID
    return value


def _convert_list(value: Any, item_hint: Any) -> Any:
    if not isinstance(value, (list, tuple)):
        return _INVALID
    items = [_convert(v, item_hint) for v in value]
    return _INVALID if any(i is _INVALID for i in items) else items


def _to_enum(value: Any, enum_cls: type[Enum]) -> Any:
    try:
        return enum_cls(value)
    except ValueError:
        return _INVALID


def _to_bool(value: Any) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral) and value in (0, 1):  # transformers takes 0/1 (truthiness) for a flag
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE_STRINGS + _FALSE_STRINGS:
        return value.lower() in _TRUE_STRINGS
    return _INVALID


def _to_int(value: Any) -> Any:
    if isinstance(value, str):
        value = _number(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return _INVALID
    return int(value) if float(value).is_integer() else _INVALID


def _to_float(value: Any) -> Any:
    if isinstance(value, str):
        value = _number(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return _INVALID
    return value if isinstance(value, (int, float)) else float(value)


def _to_str(value: Any) -> Any:
    """A string, or a path (``pathlib.Path``, any ``os.PathLike``) as its string: transformers takes paths where it
    documents ``str`` (``output_dir`` through ``os.path.expanduser``, file settings through ``open``)."""
    if isinstance(value, str):
        return value
    return os.fspath(value) if isinstance(value, os.PathLike) else _INVALID


_SCALAR_CONVERTERS: dict[type, Callable[[Any], Any]] = {
    bool: _to_bool,
    int: _to_int,
    float: _to_float,
    str: _to_str,
}


def _number(text: str) -> Any:
    """``"8"`` -> 8, ``"1e-3"`` -> 0.001; anything else unchanged (and then rejected)."""
    for parse in (int, float):
        try:
            return parse(text.strip())
        except ValueError:
            pass
    return text


def _lightning_object_types(name: str) -> tuple[type, ...]:
    """Lightning ``Accelerator``/``Strategy`` instances are accepted in place of their names."""
    if name == "accelerator":
        from lightning.pytorch.accelerators import Accelerator

        return (Accelerator,)
    from lightning.pytorch.strategies import Strategy

    return (Strategy,)


def _parse_json_dict(name: str, text: str) -> dict[str, Any]:
    """A JSON object string as a dict, with string values converted as transformers does."""
    from transformers.training_args import _convert_str_dict

    message = f"TrainingArguments.{name} expects a dict or a JSON object string, got {text!r}"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ArgumentTypeError(message) from err
    if not isinstance(value, dict):
        raise ArgumentTypeError(message)
    return _convert_str_dict(value)


def field_values(cls: type, source: HFTrainingArguments) -> tuple[dict[str, Any], dict[str, Any]]:
    """The init fields of ``source`` split into those ``cls`` has (containers copied, ready for ``cls(**...)``) and
    the others (fields of a ``source`` subclass)."""
    ours = {f.name for f in dataclasses.fields(cls) if f.init}
    theirs = {f.name: getattr(source, f.name) for f in dataclasses.fields(source) if f.init}
    values = {name: _copied(value) for name, value in theirs.items() if name in ours}
    return values, {name: value for name, value in theirs.items() if name not in ours}


def _copied(value: Any) -> Any:
    """Containers copied (so two argument objects never share a list or dict); other values as they are."""
    if isinstance(value, list):
        return list(value)
    if isinstance(value, dict):
        return dict(value)
    return value


# ---------------------------------------------------------------------- entry points for other code


#: a library's subclass of transformers' ``TrainingArguments`` -> its twin with hflight's beneath it (``hflight.trl``'s
#: configs) and the fields its ``__post_init__`` derives, which :func:`coerce_training_args` makes of an instance
_ARGUMENTS_TWINS: dict[type, tuple[type, tuple[str, ...]]] = {}


def register_arguments_twin(theirs: type, ours: type, derived: tuple[str, ...] = ()) -> None:
    """``ours`` (a dataclass of ``theirs`` and :class:`TrainingArguments`) is what an instance of ``theirs`` given to
    hflight becomes, field for field, so that it stays an instance of ``theirs``. ``derived``: fields that ``theirs``'s
    ``__post_init__`` fills from others when left None and refuses beside them (TRL's ``generation_batch_size`` beside
    ``steps_per_generation``): left None for the twin's, which derives them again."""
    _ARGUMENTS_TWINS[theirs] = (ours, derived)


def _arguments_twin(cls: type) -> tuple[type, tuple[str, ...]] | None:
    """The registered twin of ``cls`` (and its derived fields); for a subclass of a registered config (a script's
    own ``trl.SFTConfig`` subclass), a dataclass of ``cls`` over that config's twin, made once, so that the arguments
    stay an instance of ``cls`` (its fields and methods kept). None for any other class."""
    if cls not in _ARGUMENTS_TWINS:
        base = next((each for each in cls.__mro__[1:] if each in _ARGUMENTS_TWINS), None)
        if base is None:
            return None
        ours, derived = _ARGUMENTS_TWINS[base]
        namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}
        register_arguments_twin(cls, dataclasses.dataclass(type(cls.__name__, (cls, ours), namespace)), derived)
    return _ARGUMENTS_TWINS[cls]


def coerce_training_args(args: Any) -> TrainingArguments:
    """hflight ``TrainingArguments`` from ``args``: ours unchanged, a registered library config as its twin
    (:func:`register_arguments_twin`), another transformers one converted, None as default.

    Raises:
        TypeError: ``args`` is neither of these.
        ValueError: a transformers instance sets fields hflight cannot honour (see ``TrainingArguments.from_hf``).
    """
    if isinstance(args, TrainingArguments):
        return args
    if args is None:
        logger.info("No `TrainingArguments` passed, using `output_dir=tmp_trainer`.")
        return TrainingArguments(output_dir="tmp_trainer")
    if _arguments_twin(type(args)) is not None:
        twin, derived = _arguments_twin(type(args))
        return twin(**{**field_values(twin, args)[0], **dict.fromkeys(derived)})
    if isinstance(args, HFTrainingArguments):
        return TrainingArguments.from_hf(args)
    raise TypeError(
        "args must be an hflight.TrainingArguments, a transformers.TrainingArguments or None, "
        f"got {type(args).__name__}"
    )


def register_parser_types(parser: Any) -> Any:
    """Kept for scripts written against hflight 0.1: transformers' ``HfArgumentParser`` now parses every field of
    :class:`TrainingArguments` itself (dict fields take a JSON object string). Returns ``parser``."""
    return parser


def _schema_type(hint: Any) -> Any:
    """An OmegaConf-friendly type for a transformers field type: scalars stay, ``X | None`` becomes
    ``Optional[X]``, enum-or-string becomes ``str``, containers and mixed unions ``Any``."""
    optional = _is_union(hint) and _NONE in typing.get_args(hint)
    members = [m for m in (typing.get_args(hint) if _is_union(hint) else (hint,)) if m is not _NONE]
    if len(members) == 1 and members[0] in _SCALAR_CONVERTERS:
        simple = members[0]
    elif str in members and all(m is str or (isinstance(m, type) and issubclass(m, Enum)) for m in members):
        simple = str
    elif typing.get_origin(hint) is list and typing.get_args(hint) == (str,):
        return list[str]
    else:
        return Any
    return Optional[simple] if optional else simple  # noqa: UP045 - OmegaConf reads typing.Optional


def _schema_default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=f.default_factory)
    default = f.default.value if isinstance(f.default, Enum) else f.default
    return dataclasses.field(default=default)


@functools.cache
def config_schema(cls: type[TrainingArguments] = TrainingArguments) -> type:
    """A dataclass with the fields of ``cls`` (names, defaults) typed for OmegaConf: Hydra's ``schema/args``.

    A misspelt key or a wrongly typed scalar fails while the config is composed; the values are checked again, with
    transformers' rules, when :meth:`TrainingArguments.from_config` builds the arguments.
    """
    hints = _type_hints(cls)
    fields = [(f.name, _schema_type(hints[f.name]), _schema_default(f)) for f in dataclasses.fields(cls) if f.init]
    # Named like the class, so that composition errors read "Key 'learnin_rate' not in 'TrainingArguments'".
    schema = dataclasses.make_dataclass(cls.__name__, fields)
    schema.__module__ = __name__
    schema.__qualname__ = f"config_schema.<{cls.__name__}>"
    return schema


# hflight's accelerators and strategies ("ipu", "ort") must be in Lightning's registries before any arguments name them.
register_backends()
