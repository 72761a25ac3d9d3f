"""What FSDP does with a model, from transformers' ``fsdp_config`` as accelerate applies it: one reading of the wrap
policy, and the typed plans the FSDP1 and FSDP2 strategies are built from.

transformers normalises ``fsdp``/``fsdp_config`` into ``args.fsdp_plugin_args`` (accelerate's plugin settings); the
arguments check the keys (``hflight.arguments.strategies.check_fsdp_config``) and the number of processes, then reach
this package through the registry (``hflight.arguments.registry.SHARDING``, filled by
``hflight.sharding.registration``):

- :func:`wrap_policy`: the submodules that become FSDP units of their own (transformer layers by class, the listed
  ones else the model's ``_no_split_modules``; or submodules above ``min_num_params``), for both versions;
- :class:`FSDP2Plan` (:func:`fsdp2_plan`): how ``hflight.sharding.fsdp.FSDP2Strategy`` shards the model;
- :class:`FSDP1Plan` (:func:`fsdp1_plan`): the settings of Lightning's ``FSDPStrategy`` (CUDA only).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hflight.arguments.registry import ProcessGroupSettings
from hflight.arguments.strategies import planned_nodes

#: transformers' ``fsdp_config["state_dict_type"]`` -> Lightning's (FSDP1).
STATE_DICT_TYPES = {"FULL_STATE_DICT": "full", "SHARDED_STATE_DICT": "sharded"}
#: ``state_dict_type`` values FSDP2 writes (``LOCAL_STATE_DICT`` is FSDP1's alone)
FSDP2_STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")
#: accelerate's default ``min_num_params`` of ``SIZE_BASED_WRAP`` (``FSDP_MIN_NUM_PARAMS``, else 0: no unit but the
#: whole model; transformers names the policy only with a positive ``min_num_params``)
DEFAULT_MIN_NUM_PARAMS = 0


@dataclass(frozen=True)
class WrapPolicy:
    """The submodules that become FSDP units of their own: instances of ``classes`` (seen through an
    activation-checkpointing wrapper), or, with ``min_num_params``, the submodules holding more parameters than that.
    Called with a module (FSDP2): whether it is a unit."""

    classes: frozenset[type[nn.Module]] = frozenset()
    min_num_params: int | None = None

    def __call__(self, module: nn.Module) -> bool:
        if self.min_num_params is not None:
            return sum(p.numel() for p in module.parameters()) > self.min_num_params
        return isinstance(getattr(module, "_checkpoint_wrapped_module", module), tuple(self.classes))

    def lightning_policy(self) -> set[type[nn.Module]] | functools.partial[bool]:
        """The policy as Lightning's ``FSDPStrategy(auto_wrap_policy=...)`` takes it (FSDP1): the set of classes, or
        torch's size-based policy with the threshold."""
        if self.min_num_params is not None:
            from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

            return functools.partial(size_based_auto_wrap_policy, min_num_params=self.min_num_params)
        return set(self.classes)


def module_classes(model: nn.Module, names: Iterable[str], field_name: str) -> set[type[nn.Module]]:
    """The classes of ``model``'s submodules called ``names`` (a sharded submodule's class is FSDP2's subclass of its
    own, ``FSDP<name>``: its own class counts); a name no submodule has is an error naming it."""
    wanted = set(names)
    found = {cls for m in model.modules() for cls in type(m).__mro__ if cls.__name__ in wanted}
    missing = wanted - {cls.__name__ for cls in found}
    if missing:
        raise ValueError(
            f"fsdp_config[{field_name!r}] names {sorted(missing)}, which {type(model).__name__} has no submodule of."
        )
    return found


def wrap_policy(plugin: dict[str, Any], model: nn.Module) -> WrapPolicy | None:
    """accelerate's auto-wrap policy of transformers' normalised settings (``args.fsdp_plugin_args``): transformer
    layers by class (``transformer_layer_cls_to_wrap``, else the model's ``_no_split_modules``), by size
    (``SIZE_BASED_WRAP`` with ``min_num_params``), or None: no unit but the whole model."""
    policy = plugin.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP")
    if policy == "SIZE_BASED_WRAP":
        min_num_params = plugin.get("min_num_params", DEFAULT_MIN_NUM_PARAMS)
        return WrapPolicy(min_num_params=min_num_params) if min_num_params > 0 else None  # accelerate drops 0
    if policy == "TRANSFORMER_BASED_WRAP":
        names = plugin.get("transformer_cls_names_to_wrap")
        names = names.split(",") if names else getattr(model, "_no_split_modules", None) or []
        classes = module_classes(model, names, "transformer_layer_cls_to_wrap")
        return WrapPolicy(classes=frozenset(classes)) if classes else None
    return None


# ---- FSDP2 ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FSDP2Plan:
    """How FSDP2 shards a model, from transformers' ``fsdp_config`` as accelerate applies it: the submodules that
    become units of their own (``wrap``; then the whole model), whether parameters are freed after the forward
    (``reshard_after_forward``), offloaded to the CPU, recomputed (``activation_checkpointing``), loaded on global rank
    0 and broadcast (``cpu_ram_efficient_loading``), the checkpoint form (``state_dict_type``), the dtype of the
    gathered parameters under bf16 (``param_dtype``), and whether gathered states go to every checkpoint writer
    (``save_on_each_node``) or to global rank 0 only."""

    wrap: WrapPolicy | None
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
        wrap=wrap_policy(plugin, model),
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
    the arguments (``hflight.arguments.training_args.UNSUPPORTED``)."""
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


# ---- FSDP1 ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FSDP1Plan:
    """The settings of Lightning's ``FSDPStrategy`` (FSDP1, CUDA only) for transformers' ``fsdp_config`` version 1:
    ``sharding_strategy`` (``FULL_SHARD``/``SHARD_GRAD_OP``/...), ``cpu_offload``, the wrap policy, Lightning's
    ``state_dict_type`` ("full"/"sharded"), the units recomputed by activation checkpointing, FSDP1's own options
    (prefetching, ``use_orig_params``, ``sync_module_states``, ``limit_all_gathers``) where the config sets them, and
    the process group's settings."""

    sharding_strategy: str
    cpu_offload: bool
    wrap: WrapPolicy | None
    state_dict_type: str
    activation_checkpointing: set[type[nn.Module]] | None
    options: dict[str, Any] = field(default_factory=dict)
    process_group: ProcessGroupSettings = field(default_factory=lambda: ProcessGroupSettings())

    def strategy_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for Lightning's ``FSDPStrategy``."""
        kwargs: dict[str, Any] = {
            "sharding_strategy": self.sharding_strategy,
            "cpu_offload": self.cpu_offload,
            "auto_wrap_policy": self.wrap.lightning_policy() if self.wrap is not None else None,
            "state_dict_type": self.state_dict_type,
            **self.process_group,
            **self.options,
        }
        if self.activation_checkpointing is not None:
            kwargs["activation_checkpointing_policy"] = self.activation_checkpointing
        return kwargs


#: FSDP1's options passed on as they are where the config sets them
FSDP1_OPTIONS = ("forward_prefetch", "use_orig_params", "sync_module_states", "limit_all_gathers")


def fsdp1_plan(args: Any, model: nn.Module, process_group: ProcessGroupSettings) -> FSDP1Plan:
    """The :class:`FSDP1Plan` of transformers' normalised FSDP settings (``args.fsdp_plugin_args``)."""
    plugin = dict(args.fsdp_plugin_args or {})
    reshard = plugin.get("reshard_after_forward", True)
    if isinstance(reshard, bool):  # FSDP2's switch: full sharding, or gradients and optimizer state only
        sharding = "FULL_SHARD" if reshard else "SHARD_GRAD_OP"
    else:
        sharding = str(reshard).upper()
    wrap = wrap_policy(plugin, model)
    options = {name: plugin[name] for name in FSDP1_OPTIONS if name in plugin}
    if plugin.get("backward_prefetch", "NO_PREFETCH") != "NO_PREFETCH":
        from torch.distributed.fsdp import BackwardPrefetch

        options["backward_prefetch"] = BackwardPrefetch[plugin["backward_prefetch"]]
    checkpointed = None
    if plugin.get("activation_checkpointing"):  # the layers, else the whole model
        checkpointed = set(wrap.classes) if wrap is not None and wrap.min_num_params is None else {type(model)}
    return FSDP1Plan(
        sharding_strategy=sharding,
        cpu_offload=bool(plugin.get("cpu_offload", False)),
        wrap=wrap,
        state_dict_type=STATE_DICT_TYPES.get(plugin.get("state_dict_type", "FULL_STATE_DICT"), "full"),
        activation_checkpointing=checkpointed,
        options=options,
        process_group=process_group,
    )


def check_save_settings(args: Any) -> None:
    """transformers' refusals of an FSDP run's saving settings (its ``Trainer.__init__``), before anything is built:
    ``save_only_model`` writes no FSDP state that ``load_best_model_at_end`` could load, and cannot be written as
    ``SHARDED_STATE_DICT`` (hflight would otherwise fail at the end of training on a checkpoint without weights)."""
    if args.save_only_model and args.load_best_model_at_end:
        raise ValueError("FSDP can't be used with `save_only_model` along with `load_best_model_at_end`.")
    if args.save_only_model and "SHARDED_STATE_DICT" in str((args.fsdp_plugin_args or {}).get("state_dict_type")):
        raise ValueError("save_only_model option is not compatible with FSDP state dict type 'SHARDED_STATE_DICT'")
