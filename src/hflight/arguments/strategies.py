"""transformers' DDP, FSDP and DeepSpeed arguments as Lightning strategies.

transformers hands ``ddp_*``, ``fsdp``/``fsdp_config`` and ``deepspeed`` to accelerate; hflight gives the same settings
to Lightning's ``DDPStrategy``, ``FSDPStrategy`` and ``DeepSpeedStrategy``, where Lightning has the same setting:

- ``ddp_find_unused_parameters``, ``ddp_bucket_cap_mb``, ``ddp_broadcast_buffers``, ``ddp_static_graph``: the
  ``DistributedDataParallel`` keyword arguments ``DDPStrategy`` passes on;
- ``ddp_backend``, ``ddp_timeout``: ``process_group_backend``, ``timeout`` (DDP, FSDP and DeepSpeed);
- ``fsdp`` + ``fsdp_config`` (as transformers normalises them): ``FSDPStrategy``'s ``sharding_strategy``,
  ``cpu_offload``, ``auto_wrap_policy``, ``activation_checkpointing_policy``, ``state_dict_type``, prefetching,
  ``use_orig_params``, ``sync_module_states`` and ``limit_all_gathers``;
- ``deepspeed`` (a dict or a JSON file): ``DeepSpeedStrategy(config=...)``.

The DDP settings apply to a DDP strategy named by ``strategy`` ("ddp", "ddp_spawn", ...) and to ``strategy="auto"``
in a multi-process launch (torchrun, SLURM), where Lightning would pick DDP itself; in a single process, as in
transformers, they change nothing. ``fsdp``/``deepspeed`` choose the strategy, so they need ``strategy="auto"``.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hflight.arguments.deepspeed import DeepSpeedConfigResolver

#: Lightning's default process-group timeout (and transformers' ``ddp_timeout`` default), in seconds.
DEFAULT_TIMEOUT = 1800

#: transformers' DDP argument -> ``DistributedDataParallel`` keyword (Lightning's ``DDPStrategy`` passes them on).
DDP_MODULE_KWARGS = {
    "ddp_find_unused_parameters": "find_unused_parameters",
    "ddp_bucket_cap_mb": "bucket_cap_mb",
    "ddp_broadcast_buffers": "broadcast_buffers",
    "ddp_static_graph": "static_graph",
}

#: transformers' ``fsdp_config["state_dict_type"]`` -> Lightning's.
STATE_DICT_TYPES = {"FULL_STATE_DICT": "full", "SHARDED_STATE_DICT": "sharded"}


def process_group_settings(args: Any) -> dict[str, Any]:
    """``process_group_backend``/``timeout`` for a DDP or FSDP strategy, where ``args`` differs from the default."""
    settings: dict[str, Any] = {}
    if args.ddp_backend is not None:
        settings["process_group_backend"] = args.ddp_backend
    if args.ddp_timeout != DEFAULT_TIMEOUT:
        settings["timeout"] = datetime.timedelta(seconds=args.ddp_timeout)
    return settings


def ddp_settings(args: Any) -> dict[str, Any]:
    """Keyword arguments for ``DDPStrategy`` from the ``ddp_*`` arguments set (empty when none is)."""
    settings = {
        kwarg: getattr(args, name) for name, kwarg in DDP_MODULE_KWARGS.items() if getattr(args, name) is not None
    }
    return {**settings, **process_group_settings(args)}


def ddp_strategy(name: str, args: Any) -> Any:
    """The registered DDP strategy ``name`` ("ddp", "ddp_spawn", ...) with the ``ddp_*`` settings, or ``name``
    itself when none is set (or when ``name`` is no DDP strategy)."""
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry

    settings = ddp_settings(args)
    entry = StrategyRegistry[name] if name in StrategyRegistry else None  # the registration, not an instance
    if not settings or entry is None or not issubclass(entry["strategy"], DDPStrategy):
        return name
    return entry["strategy"](**{**entry["init_params"], **settings})


def lightning_launches_several(args: Any) -> bool:
    """Whether ``strategy="auto"`` makes Lightning launch several processes itself (several nodes, or several devices
    of the accelerator it picks), where it chooses DDP: the ``ddp_*`` settings then apply as under torchrun."""
    return args.num_nodes > 1 or _devices_per_node(args) > 1


def _devices_per_node(args: Any) -> int:
    """The devices (one process each) Lightning would take on this node for ``args.devices``."""
    from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator, MPSAccelerator

    from hflight.arguments.training_args import resolved_device_type

    devices = args.devices
    if isinstance(devices, str) and devices.lstrip("-").isdigit():
        devices = int(devices)
    kind = "cpu" if args.use_cpu else resolved_device_type(args)
    accelerator = {"cuda": CUDAAccelerator, "mps": MPSAccelerator}.get(kind, CPUAccelerator)
    try:
        return len(accelerator.get_parallel_devices(accelerator.parse_devices(devices)))
    except Exception:  # noqa: BLE001 - Lightning reports a bad device request itself when it builds the run
        return 1


def planned_nodes(args: Any) -> int:
    """The nodes the run will span: the external launcher's, else ``num_nodes``."""
    from hflight.arguments import cluster

    layout = cluster.launched_layout()
    return layout.num_nodes if layout is not None else max(1, args.num_nodes)


def planned_world_size(args: Any) -> int:
    """The processes the run will span: those an external launcher started (torchrun, srun), else the devices and
    nodes Lightning will launch."""
    from hflight.arguments import cluster

    launched = cluster.launched_world_size()
    return launched if launched is not None else _devices_per_node(args) * args.num_nodes


def _module_classes(model: nn.Module, names: Iterable[str], field: str) -> set[type[nn.Module]]:
    """The classes of ``model``'s submodules called ``names`` (a sharded submodule's class is FSDP2's subclass of its
    own, ``FSDP<name>``: its own class counts); a name no submodule has is an error naming it."""
    wanted = set(names)
    found = {cls for m in model.modules() for cls in type(m).__mro__ if cls.__name__ in wanted}
    missing = wanted - {cls.__name__ for cls in found}
    if missing:
        raise ValueError(
            f"fsdp_config[{field!r}] names {sorted(missing)}, which {type(model).__name__} has no submodule of."
        )
    return found


def _wrap_policy(plugin: dict[str, Any], model: nn.Module) -> Any:
    """Lightning's ``auto_wrap_policy`` for transformers' policy name: transformer layers by class (the listed ones,
    else the model's ``_no_split_modules``), by size, or none."""
    policy = plugin.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP")
    if policy == "SIZE_BASED_WRAP":
        from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

        return functools.partial(size_based_auto_wrap_policy, min_num_params=plugin.get("min_num_params", int(1e8)))
    if policy == "TRANSFORMER_BASED_WRAP":
        names = plugin.get("transformer_cls_names_to_wrap")
        names = names.split(",") if names else getattr(model, "_no_split_modules", None) or []
        return _module_classes(model, names, "transformer_layer_cls_to_wrap") or None
    return None


def fsdp_settings(args: Any, model: nn.Module) -> dict[str, Any]:
    """Keyword arguments for Lightning's ``FSDPStrategy`` from transformers' normalised FSDP settings
    (``args.fsdp_plugin_args``, which transformers' ``__post_init__`` derives from ``fsdp``/``fsdp_config``)."""
    plugin = dict(args.fsdp_plugin_args or {})
    reshard = plugin.get("reshard_after_forward", True)
    if isinstance(reshard, bool):  # FSDP2's switch: full sharding, or gradients and optimizer state only
        sharding = "FULL_SHARD" if reshard else "SHARD_GRAD_OP"
    else:
        sharding = str(reshard).upper()
    wrap = _wrap_policy(plugin, model)
    settings: dict[str, Any] = {
        "sharding_strategy": sharding,
        "cpu_offload": bool(plugin.get("cpu_offload", False)),
        "auto_wrap_policy": wrap,
        "state_dict_type": STATE_DICT_TYPES.get(plugin.get("state_dict_type", "FULL_STATE_DICT"), "full"),
        **process_group_settings(args),
    }
    if plugin.get("activation_checkpointing"):
        settings["activation_checkpointing_policy"] = wrap if isinstance(wrap, set) else {type(model)}
    for name in ("forward_prefetch", "use_orig_params", "sync_module_states", "limit_all_gathers"):
        if name in plugin:
            settings[name] = plugin[name]
    if plugin.get("backward_prefetch", "NO_PREFETCH") != "NO_PREFETCH":
        from torch.distributed.fsdp import BackwardPrefetch

        settings["backward_prefetch"] = BackwardPrefetch[plugin["backward_prefetch"]]
    return settings


def fsdp_strategy(args: Any, model: nn.Module) -> Any:
    """The strategy for ``fsdp``/``fsdp_config``, checked before any process group starts: FSDP2 (``version`` 2,
    transformers' default) is hflight's ``FSDP2Strategy`` (``hflight.sharding``: Lightning's ``ModelParallelStrategy``,
    CUDA or CPU); FSDP1 is Lightning's ``FSDPStrategy``, on CUDA only (:func:`check_fsdp_device`)."""
    from hflight.arguments.registry import SHARDING_STRATEGIES

    check_fsdp_config(args)
    world = planned_world_size(args)
    if world <= 1:  # transformers' Trainer raises the same
        raise ValueError(
            f"Using fsdp only works in distributed training: fsdp={args.fsdp!r} with {world} process. Launch several "
            "(torchrun --nproc_per_node=N, or devices=N), or leave fsdp unset."
        )
    if args.fsdp_plugin_args["fsdp_version"] == 2:
        return SHARDING_STRATEGIES["fsdp2"](fsdp2_plan(args, model, world), process_group_settings(args))
    if args.parallelism_config is not None:
        raise ValueError("parallelism_config shards with FSDP2: set fsdp_config['version']=2 (transformers' default).")
    from lightning.pytorch.strategies import FSDPStrategy

    check_fsdp_device(args)
    return FSDPStrategy(**fsdp_settings(args, model))


def check_fsdp_device(args: Any) -> None:
    """Lightning's ``FSDPStrategy`` (FSDP1) runs on CUDA only: it refuses any other accelerator with "The strategy
    `fsdp` requires a GPU accelerator, but received `accelerator='cpu'`" (lightning 2.6, from deep inside
    ``lightning.Trainer``), and torch's ``FullyShardedDataParallel`` under it refuses the CPU too ("FSDP needs a
    non-CPU accelerator device, but no accelerator device is detected", torch 2.13, with Lightning's check bypassed).
    Here, as a ValueError naming transformers' argument, before a process is launched."""
    from hflight.arguments.training_args import resolved_device_type

    device = "cpu" if args.use_cpu else resolved_device_type(args)
    if device != "cuda":
        raise ValueError(
            f"fsdp_config['version']=1 (FSDP1) needs CUDA GPUs: hflight runs it as Lightning's FSDPStrategy, which "
            "refuses any other accelerator (so does torch's FullyShardedDataParallel under it), and this run's is "
            f"{device!r} (accelerator={args.accelerator!r}). FSDP2 (fsdp_config['version']=2, transformers' default) "
            "runs on the CPU too."
        )


#: the ``fsdp_config`` keys transformers 5.23 reads (after it strips an ``fsdp_`` prefix), its own defaults included
FSDP_CONFIG_KEYS = frozenset({
    "version", "min_num_params", "transformer_layer_cls_to_wrap", "auto_wrap_policy", "cpu_offload",
    "cpu_ram_efficient_loading", "state_dict_type", "activation_checkpointing", "reshard_after_forward",
    "forward_prefetch", "backward_prefetch", "use_orig_params", "sync_module_states", "limit_all_gathers",
    "xla", "xla_fsdp_v2", "xla_fsdp_grad_ckpt", "xla_fsdp_settings",
})  # fmt: skip
#: ``state_dict_type`` values FSDP2 writes (``LOCAL_STATE_DICT`` is FSDP1's alone)
FSDP2_STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")
#: the keys of FSDP1 alone: FSDP2 has no such setting
FSDP1_ONLY_KEYS = ("forward_prefetch", "backward_prefetch", "use_orig_params", "sync_module_states",
                   "limit_all_gathers")  # fmt: skip


def check_fsdp_config(args: Any) -> None:
    """``fsdp_config`` as transformers normalised it: every key one transformers reads (an unknown key would be
    ignored there: refused here, naming it), a known ``version``, no XLA (TPUs), FSDP1-only keys not under FSDP2."""
    config = args.fsdp_config or {}
    unknown = sorted(set(config) - FSDP_CONFIG_KEYS)
    if unknown:
        raise ValueError(
            f"fsdp_config has keys transformers does not know: {', '.join(unknown)} (known: "
            f"{', '.join(sorted(FSDP_CONFIG_KEYS))})."
        )
    if config.get("xla"):
        raise ValueError("fsdp_config['xla']=True is FSDP on TPUs through torch_xla, which hflight does not run.")
    version = args.fsdp_plugin_args.get("fsdp_version")
    if version not in (1, 2):
        raise ValueError(f"fsdp_config['version'] must be 1 or 2, got {config.get('version')!r}.")
    if version == 2:
        fsdp1 = [key for key in FSDP1_ONLY_KEYS if key in config]
        if fsdp1:
            raise ValueError(
                f"fsdp_config sets {', '.join(fsdp1)}, which only FSDP1 has (fsdp_config['version']=1); FSDP2 has no "
                "such setting."
            )


@dataclass(frozen=True)
class FSDP2Plan:
    """How FSDP2 shards a model, from transformers' ``fsdp_config`` as accelerate applies it: the submodules that
    become units of their own (``wrap``: transformer layers by class, or by size; then the whole model), whether
    parameters are freed after the forward (``reshard_after_forward``), offloaded to the CPU, recomputed
    (``activation_checkpointing``), loaded on global rank 0 and broadcast (``cpu_ram_efficient_loading``), the
    checkpoint form (``state_dict_type``), the dtype of the gathered parameters under bf16 (``param_dtype``), and
    whether gathered states go to every checkpoint writer (``save_on_each_node``) or to global rank 0 only."""

    wrap: Callable[[nn.Module], bool] | None
    reshard_after_forward: bool
    cpu_offload: bool
    activation_checkpointing: bool
    cpu_ram_efficient_loading: bool
    state_dict_type: str
    param_dtype: torch.dtype | None
    gather_to_every_writer: bool
    #: ``parallelism_config``'s (dp_replicate_size, dp_shard_size) when it replicates shards (HSDP), else None: every
    #: process shards one copy
    hybrid: tuple[int, int] | None = None


def fsdp2_plan(args: Any, model: nn.Module, world_size: int) -> FSDP2Plan:
    """The :class:`FSDP2Plan` of ``args.fsdp_plugin_args`` for ``model`` (a class to wrap that no submodule has, an
    unknown ``state_dict_type``, sharded states on nodes without a shared disk: a ValueError naming the key)."""
    plugin = dict(args.fsdp_plugin_args or {})
    state_dict_type = str(plugin.get("state_dict_type", "FULL_STATE_DICT")).upper()
    if state_dict_type not in FSDP2_STATE_DICT_TYPES:
        raise ValueError(
            f"fsdp_config['state_dict_type']={plugin.get('state_dict_type')!r}: FSDP2 writes "
            f"{' or '.join(FSDP2_STATE_DICT_TYPES)}."
        )
    nodes = planned_nodes(args)
    if args.save_on_each_node and state_dict_type == "SHARDED_STATE_DICT" and nodes > 1:
        raise ValueError(
            "fsdp_config['state_dict_type']='SHARDED_STATE_DICT' with save_on_each_node=True: every process writes "
            "its shard into one folder, which nodes without a shared disk do not have. Use FULL_STATE_DICT (gathered "
            f"on each node's writer), or a shared filesystem without save_on_each_node ({nodes} node(s) planned)."
        )
    return FSDP2Plan(
        hybrid=data_parallel_sizes(args, world_size),
        wrap=_fsdp2_wrap(plugin, model),
        reshard_after_forward=bool(plugin.get("reshard_after_forward", True)),
        cpu_offload=bool(plugin.get("cpu_offload", False)),
        activation_checkpointing=bool(plugin.get("activation_checkpointing", False)),
        cpu_ram_efficient_loading=bool(plugin.get("cpu_ram_efficient_loading", False)),
        state_dict_type=state_dict_type,
        param_dtype=torch.bfloat16 if args.bf16 else None,
        gather_to_every_writer=bool(args.save_on_each_node),
    )


def data_parallel_sizes(args: Any, world_size: int) -> tuple[int, int] | None:
    """transformers 5's ``parallelism_config`` under FSDP2 (accelerate's ``ParallelismConfig``): ``dp_shard_size``
    processes shard one copy of the model, ``dp_replicate_size`` copies of them (HSDP), together the whole world;
    (replicate, shard) when there are several copies, None for one (or no config). Its other dimensions are refused by
    the arguments (:data:`~hflight.arguments.training_args.UNSUPPORTED`)."""
    config = args.parallelism_config
    if config is None:
        return None
    replicate, shard = (getattr(config, f"dp_{n}_size", None) or 1 for n in ("replicate", "shard"))
    if replicate * shard != world_size:
        raise ValueError(
            f"parallelism_config: dp_replicate_size x dp_shard_size = {replicate} x {shard} = {replicate * shard}, but "
            f"the run has {world_size} processes (accelerate's rule: their product is the number of processes)."
        )
    if shard == 1:
        raise ValueError(
            "parallelism_config: fsdp is set but dp_shard_size is 1, so FSDP has no dimension to shard across "
            f"(dp_replicate_size={replicate} alone is plain data parallelism: leave fsdp unset for it)."
        )
    return (replicate, shard) if replicate > 1 else None


def _fsdp2_wrap(plugin: dict[str, Any], model: nn.Module) -> Callable[[nn.Module], bool] | None:
    """accelerate's FSDP2 wrap policy: the transformer layer classes (``transformer_layer_cls_to_wrap``, else the
    model's ``_no_split_modules``; seen through an activation-checkpointing wrapper), or submodules of more than
    ``min_num_params`` parameters; None: the whole model is the one unit."""
    policy = plugin.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP")
    if policy == "SIZE_BASED_WRAP":
        limit = plugin.get("min_num_params", int(1e8))
        return lambda module: sum(p.numel() for p in module.parameters()) > limit
    if policy == "TRANSFORMER_BASED_WRAP":
        names = plugin.get("transformer_cls_names_to_wrap")
        names = names.split(",") if names else getattr(model, "_no_split_modules", None) or []
        classes = tuple(_module_classes(model, names, "transformer_layer_cls_to_wrap"))
        if not classes:
            return None
        return lambda module: isinstance(getattr(module, "_checkpoint_wrapped_module", module), classes)
    return None


def deepspeed_strategy(args: Any) -> Any:
    """hflight's DeepSpeed strategy (``hflight.sharding``: Lightning's ``DeepSpeedStrategy`` on CUDA or the CPU) on
    the DeepSpeed config ``args.deepspeed`` (a dict, a JSON file path, JSON text), its ``"auto"`` values filled in
    from the arguments as transformers fills them; the values that need the model and the run's length are filled in
    when the run is planned (:func:`finalize_deepspeed`, before the engine is built). A config naming DeepSpeed's own
    ``optimizer``/``scheduler`` is refused (the Trainer's optimizer and schedule run in the engine instead)."""
    from hflight.arguments.registry import SHARDING_STRATEGIES

    resolver = DeepSpeedConfigResolver(args.deepspeed)
    own = [key for key in ("optimizer", "scheduler") if key in resolver.config]
    if own:
        raise ValueError(
            f"deepspeed config {resolver.source}: {' and '.join(own)} ({', '.join(repr(k) for k in own)}) choose "
            "DeepSpeed's own optimizer/schedule, which hflight does not run (the engine runs the Trainer's: "
            "args.optim, learning_rate, lr_scheduler_type and warmup, the same math for AdamW and a linear schedule). "
            "Remove them from the config."
        )
    resolver.process(args)
    resolver.plugin_defaults(args)
    resolver.config["zero_allow_untested_optimizer"] = True  # the Trainer's optimizer, as transformers sets it
    return SHARDING_STRATEGIES["deepspeed"](resolver, process_group_settings(args))


def finalize_deepspeed(strategy: Any, args: Any, model: nn.Module, num_training_steps: int) -> None:
    """For a strategy :func:`deepspeed_strategy` built: the config's remaining ``"auto"`` values (ZeRO buckets, the
    scheduler's steps), filled in place before the engine is built."""
    resolver = getattr(strategy, "hf_deepspeed_resolver", None)
    if resolver is not None:
        resolver.finalize(args, model, num_training_steps)


def check_plain_data_parallel(args: Any) -> None:
    """``parallelism_config`` without fsdp: only one copy per process (``dp_replicate_size`` the whole world, what
    DDP does); sharding it asks for ``fsdp``."""
    config = args.parallelism_config
    if config is None:
        return
    if (getattr(config, "dp_shard_size", None) or 1) > 1:
        raise ValueError(
            f"parallelism_config: dp_shard_size={config.dp_shard_size} shards the model, which hflight does with "
            "FSDP2: set fsdp (fsdp_config['version']=2) too."
        )
    replicate, world = getattr(config, "dp_replicate_size", None) or 1, planned_world_size(args)
    if replicate not in (1, world):
        raise ValueError(
            f"parallelism_config: dp_replicate_size={replicate}, but the run has {world} processes (accelerate's "
            "rule: the sizes' product is the number of processes)."
        )


def strategy_from_args(strategy: Any, args: Any, model: nn.Module | None) -> Any:
    """The Lightning strategy for ``strategy`` (a name or an object) under transformers' distributed arguments."""
    if isinstance(strategy, str) and strategy == "auto":
        if args.fsdp and model is not None:
            return fsdp_strategy(args, model)
        check_plain_data_parallel(args)
        if args.deepspeed:
            return deepspeed_strategy(args)
        if ddp_settings(args) and (args.world_size > 1 or lightning_launches_several(args)):
            from lightning.fabric.utilities.imports import _IS_INTERACTIVE

            return ddp_strategy("ddp_fork" if _IS_INTERACTIVE else "ddp", args)  # what Lightning would pick
        return strategy
    return ddp_strategy(strategy, args) if isinstance(strategy, str) else strategy
