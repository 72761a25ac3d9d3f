"""transformers' DDP, FSDP and DeepSpeed arguments as Lightning strategies.

transformers hands ``ddp_*``, ``fsdp``/``fsdp_config`` and ``deepspeed`` to accelerate; hflight gives the same settings
to Lightning's ``DDPStrategy``, ``FSDPStrategy`` and ``DeepSpeedStrategy``, where Lightning has the same setting:

- ``ddp_find_unused_parameters``, ``ddp_bucket_cap_mb``, ``ddp_broadcast_buffers``, ``ddp_static_graph``: the
  ``DistributedDataParallel`` keyword arguments ``DDPStrategy`` passes on;
- ``ddp_backend``, ``ddp_timeout``: ``process_group_backend``, ``timeout`` (DDP, FSDP and DeepSpeed);
- ``fsdp`` + ``fsdp_config`` (as transformers normalises them): checked here (keys, version, device, number of
  processes), then planned and built by ``hflight.sharding`` (``hflight.sharding.plans``: FSDP2's sharding plan, or
  FSDP1's ``FSDPStrategy`` settings) through the registry's builders (``hflight.arguments.registry.SHARDING``);
- ``deepspeed`` (a dict or a JSON file): its config resolved here (``hflight.arguments.deepspeed``), the strategy
  built by ``hflight.sharding``.

The DDP settings apply to a DDP strategy named by ``strategy`` ("ddp", "ddp_spawn", ...) and to ``strategy="auto"``
in a multi-process launch (torchrun, SLURM), where Lightning would pick DDP itself; in a single process, as in
transformers, they change nothing. ``fsdp``/``deepspeed`` choose the strategy, so they need ``strategy="auto"``.
"""

from __future__ import annotations

import datetime
from typing import Any

from torch import nn

from hflight._util import model_tp_size
from hflight.arguments.deepspeed import DeepSpeedConfigResolver
from hflight.arguments.registry import SHARDING, ProcessGroupSettings

#: Lightning's default process-group timeout (and transformers' ``ddp_timeout`` default), in seconds.
DEFAULT_TIMEOUT = 1800

#: transformers' DDP argument -> ``DistributedDataParallel`` keyword (Lightning's ``DDPStrategy`` passes them on).
DDP_MODULE_KWARGS = {
    "ddp_find_unused_parameters": "find_unused_parameters",
    "ddp_bucket_cap_mb": "bucket_cap_mb",
    "ddp_broadcast_buffers": "broadcast_buffers",
    "ddp_static_graph": "static_graph",
}


def process_group_settings(args: Any) -> ProcessGroupSettings:
    """``process_group_backend``/``timeout`` for a DDP or FSDP strategy, where ``args`` differs from the default."""
    settings = ProcessGroupSettings()
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


def fsdp_strategy(args: Any, model: nn.Module) -> Any:
    """The strategy for ``fsdp``/``fsdp_config``, checked before any process group starts, built by the sharding
    package (``SHARDING.fsdp``): FSDP2 (``version`` 2, transformers' default) is hflight's ``FSDP2Strategy``
    (Lightning's ``ModelParallelStrategy``, CUDA or CPU); FSDP1 is Lightning's ``FSDPStrategy``, on CUDA only
    (:func:`check_fsdp_device`).

    As transformers, FSDP needs a launched run: several processes, or one under a launcher (``torchrun
    --nproc_per_node=1``: FSDP on one rank, as accelerate runs it there; transformers refuses ``fsdp`` in a process no
    launcher started)."""
    from hflight.arguments import cluster

    check_fsdp_config(args)
    world = planned_world_size(args)
    if world <= 1 and cluster.launched_world_size() is None:  # transformers' Trainer raises the same
        raise ValueError(
            f"Using fsdp only works in distributed training: fsdp={args.fsdp!r} with {world} process and no launcher. "
            "Launch the script with torchrun (--nproc_per_node=N; 1 shards over one process, as transformers does), "
            "or set devices=N, or leave fsdp unset."
        )
    if args.fsdp_plugin_args["fsdp_version"] != 2:
        if args.parallelism_config is not None:
            raise ValueError(
                "parallelism_config shards with FSDP2: set fsdp_config['version']=2 (transformers' default)."
            )
        check_fsdp_device(args)
    return _builder(SHARDING.fsdp, "fsdp")(args, model, world, process_group_settings(args))


def tensor_parallel_strategy(strategy: Any, args: Any, model: nn.Module) -> Any:
    """A model transformers loaded tensor-parallel (``from_pretrained(tp_plan=...)``: DTensor weights on its own
    mesh) trains on hflight's tensor-parallel strategy (``hflight.sharding.tensor_parallel``): no DDP wrap, data
    parallel over the processes its tensor-parallel groups leave. Another strategy, ``fsdp`` or ``deepspeed`` would
    wrap or shard the model a second time: refused naming it. ``parallelism_config`` describes the layout the model
    was loaded with (:func:`check_tensor_parallel_config`)."""
    tp = model_tp_size(model)
    others = [name for name, value in (("strategy", strategy if strategy != "auto" else None), ("fsdp", args.fsdp),
                                       ("deepspeed", args.deepspeed)) if value]  # fmt: skip
    if others:
        raise ValueError(
            f"The model was loaded tensor-parallel (tp_size={tp}: from_pretrained(..., tp_plan=...)), which trains on "
            f"its own device mesh; {', '.join(others)} would wrap or shard it again: leave "
            f"{' and '.join(others)} unset."
        )
    if args.save_async:  # (the checkpoint writer would refuse it at the first checkpoint, after training began)
        raise ValueError(
            f"save_async=True cannot be combined with a model loaded tensor-parallel (tp_size={tp}): every process "
            "writes each checkpoint together (its DTensor shards with torch.distributed.checkpoint; with "
            "save_only_model, transformers' save_pretrained gathers them), a collective. Set save_async=False "
            "(checkpoints are then written before training goes on, as in transformers)."
        )
    world = planned_world_size(args)
    check_tensor_parallel_config(args.parallelism_config, model, world)
    return _builder(SHARDING.tensor_parallel, "tensor parallelism")(model, world, process_group_settings(args))


def check_tensor_parallel_config(config: Any, model: nn.Module | None, world: int) -> None:
    """``parallelism_config`` (accelerate's ``ParallelismConfig``) with ``tp_size``: the layout of a model
    transformers loaded tensor-parallel. In transformers 5 the layout is made at load time: ``from_pretrained(...,
    distributed_config=DistributedConfig(tp_size=T, fsdp_size=S))`` builds the (fsdp x tp) mesh over the whole launch,
    shards every layer's weights over ``tp`` and the model with FSDP2 over ``fsdp`` (``device_mesh`` beside a
    ``tp_plan`` is not used: the plan spans the launch). transformers' Trainer then gives accelerate the model's sizes
    in place of the config's; hflight refuses a config that says otherwise, naming both numbers, before any process
    group starts: ``tp_size`` against the model's, the sizes' product against the run's processes (accelerate's rule),
    ``dp_shard_size`` and ``dp_replicate_size`` against the model's ``fsdp_size`` and ``dp_replicate_size``."""
    if config is None:
        return
    tp = model_tp_size(model)
    size = {name: getattr(config, f"{name}_size", None) or 1 for name in ("tp", "dp_shard", "dp_replicate")}
    if size["tp"] == 1 and tp == 1:
        return
    if size["tp"] != tp:
        loaded = f"loaded with tp_size={tp}" if tp > 1 else "not loaded tensor-parallel (tp_size=1)"
        raise ValueError(
            f"parallelism_config: tp_size={size['tp']}, but the model was {loaded}. transformers shards the weights "
            "when it loads them: load the model under this launch with from_pretrained(..., distributed_config="
            f"DistributedConfig(tp_size={size['tp']}, fsdp_size={size['dp_shard']})) and set the same sizes here."
        )
    product = size["dp_replicate"] * size["dp_shard"] * size["tp"]
    if product != world:
        raise ValueError(
            f"parallelism_config: dp_replicate_size x dp_shard_size x tp_size = {size['dp_replicate']} x "
            f"{size['dp_shard']} x {size['tp']} = {product}, but the run has {world} processes (accelerate's rule: "
            "their product is the number of processes)."
        )
    layout = getattr(getattr(model, "config", None), "distributed_config", None)
    for name, loaded_name in (("dp_shard", "fsdp"), ("dp_replicate", "dp_replicate")):
        loaded = getattr(layout, f"{loaded_name}_size", None)
        if loaded is not None and size[name] != loaded:
            raise ValueError(
                f"parallelism_config: {name}_size={size[name]}, but the model was loaded with {loaded_name}_size="
                f"{loaded} (DistributedConfig): set the sizes the model was loaded with."
            )


def _builder(builder: Any, name: str) -> Any:
    if builder is None:  # hflight.sharding.registration fills it when the arguments are imported
        raise RuntimeError(f"No strategy builder is registered for {name}: hflight.sharding was not registered.")
    return builder


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


def deepspeed_strategy(args: Any) -> Any:
    """hflight's DeepSpeed strategy (``hflight.sharding``: Lightning's ``DeepSpeedStrategy`` on CUDA or the CPU) on
    the DeepSpeed config ``args.deepspeed`` (a dict, a JSON file path, JSON text), its ``"auto"`` values filled in
    from the arguments as transformers fills them; the values that need the model and the run's length are filled in
    when the run is planned (the strategy's ``hf_run_planned`` hook, before the engine is built). A config naming
    DeepSpeed's own ``optimizer``/``scheduler`` is refused (the Trainer's optimizer and schedule run in the engine
    instead)."""
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
    return _builder(SHARDING.deepspeed, "deepspeed")(resolver, process_group_settings(args))


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
    if model_tp_size(model) > 1:
        return tensor_parallel_strategy(strategy, args, model)
    if args.parallelism_config is not None:
        check_tensor_parallel_config(args.parallelism_config, model, planned_world_size(args))
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
