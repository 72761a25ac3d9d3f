"""accelerate's launcher and config files, read where transformers' ``TrainingArguments`` reads them.

``accelerate launch --config_file cfg.yaml train.py`` reaches the script through environment variables, not arguments:
the launcher exports ``ACCELERATE_MIXED_PRECISION``, ``ACCELERATE_USE_CPU``, ``ACCELERATE_DYNAMO_*``,
``ACCELERATE_USE_FSDP`` with ``FSDP_*``, ``ACCELERATE_USE_DEEPSPEED`` with ``ACCELERATE_DEEPSPEED_*``, ... and starts
the processes with torchrun (``accelerate.utils.launch``), and transformers' ``TrainingArguments`` and accelerate's
``Accelerator`` with its plugins (``FullyShardedDataParallelPlugin``, ``DeepSpeedPlugin``, ``TorchDynamoPlugin``,
``ParallelismConfig``) read the variables. hflight has no ``Accelerator``: :func:`apply`, called at the start of
``TrainingArguments.__post_init__``, turns each variable into the field that makes the same choice on Lightning, before
transformers' own ``__post_init__`` normalises the fields:

- ``ACCELERATE_MIXED_PRECISION`` -> ``bf16``/``fp16`` (Lightning's ``bf16-mixed``; ``fp16`` on the CPU runs fp32, as
  accelerate's); under the launcher's DeepSpeed, the DeepSpeed config's ``bf16``/``fp16`` section enabled as
  accelerate's plugin enables it for transformers (below);
- ``ACCELERATE_USE_CPU`` -> ``accelerator="cpu"``; ``ACCELERATE_TORCH_DEVICE`` naming another device is refused (a
  Ray Train worker's, ``cuda:N``, is Lightning's device when N is the worker's local rank);
- ``ACCELERATE_DYNAMO_*`` -> ``torch_compile_backend``/``torch_compile_mode`` and :func:`compile_model`'s
  ``fullgraph``/``dynamic``/regional compilation (accelerate's ``compile_regions``);
- ``ACCELERATE_USE_FSDP`` + ``FSDP_*`` -> ``fsdp=True`` and the ``fsdp_config`` accelerate's plugin reads from them
  (its defaults, which are not transformers': no wrapping, ``SHARDED_STATE_DICT`` under FSDP2);
- ``ACCELERATE_USE_DEEPSPEED`` + ``ACCELERATE_DEEPSPEED_*`` (a config file, or ZeRO stage, offload, accumulation and
  clipping) -> ``deepspeed``: the config accelerate's own ``DeepSpeedPlugin`` builds from them, with the launcher's
  precision set in it as transformers' ``TrainingArguments`` set it (``set_mixed_precision``);
- ``ACCELERATE_USE_PARALLELISM_CONFIG`` + ``PARALLELISM_CONFIG_*`` -> ``parallelism_config`` (accelerate's class);
- ``ACCELERATE_DEBUG_MODE`` -> torch's distributed debug level ``DETAIL`` (each collective's shapes checked across
  processes); ``ACCELERATE_CPU_AFFINITY`` -> accelerate's ``set_numa_affinity`` for this process.

Who wins is transformers' rule for each: ``fp16``/``bf16``, ``torch_compile*``, ``fsdp``/``fsdp_config``,
``deepspeed`` and ``parallelism_config`` set in the arguments win over the environment, which fills only what
accelerate's plugins would fill. The processes themselves are torchrun's (``hflight.arguments.cluster``). A variable
hflight cannot honour (fp8, Megatron-LM, SageMaker data parallelism, XLA's bf16 downcast, FSDP's activation offload and
ignored modules, DeepSpeed's MoE leaf modules) raises :class:`LauncherEnvironmentError` naming it and what to do, and
so does a launcher's precision beside a DeepSpeed config whose precision transformers fills from ``--bf16``/``--fp16``
alone (the script's ``--deepspeed``, or a file that turns it off): transformers trains fp32 there, whatever the
launcher says.

May import: ``hflight.arguments`` (and accelerate, transformers' own dependency).
"""

from __future__ import annotations

import copy
import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from hflight.arguments import ray_train

logger = logging.getLogger(__name__)

__all__ = ["LauncherEnvironmentError", "apply", "compile_model", "fsdp_config_from_env"]

_FP8_PREFIX = "ACCELERATE_FP8_"
#: variables of accelerate's that hflight cannot honour: name -> (does the environment ask for it?, what to do)
_REFUSED: dict[str, tuple[Callable[[Mapping[str, str]], bool], str]] = {
    "ACCELERATE_USE_MEGATRON_LM": (
        lambda env: _flag(env, "ACCELERATE_USE_MEGATRON_LM"),
        "Megatron-LM's tensor and pipeline parallelism is accelerate's, not Lightning's; use FSDP or DeepSpeed "
        "(distributed_type: FSDP or DEEPSPEED in the accelerate config)",
    ),
    "ACCELERATE_SAGEMAKER_DISTRIBUTED_TYPE": (
        lambda env: (
            _flag(env, "ACCELERATE_USE_SAGEMAKER")
            and env.get("ACCELERATE_SAGEMAKER_DISTRIBUTED_TYPE", "NO").upper() != "NO"
        ),
        "SageMaker's data-parallel library (smdistributed) has no Lightning strategy; launch with torchrun instead",
    ),
    "ACCELERATE_DOWNCAST_BF16": (
        lambda env: bool(env.get("ACCELERATE_DOWNCAST_BF16")),
        "it downcasts to bf16 on TPUs through torch_xla, which hflight does not run; unset it (drop downcast_bf16)",
    ),
}
#: what accelerate's ``DeepSpeedPlugin`` reads (``_deepspeed`` builds one): a config file, or the settings that make one
DEEPSPEED_VARIABLES = (
    "ACCELERATE_DEEPSPEED_CONFIG_FILE", "ACCELERATE_CONFIG_DS_FIELDS", "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "ACCELERATE_GRADIENT_CLIPPING",
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH",
    "ACCELERATE_DEEPSPEED_ZERO3_INIT", "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
)  # fmt: skip
#: ``FSDP_*`` settings of accelerate's plugin that hflight's FSDP2 does not have
_FSDP_REFUSED = {
    "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "activations offloaded to the CPU; set it false (keep activation "
    "checkpointing, FSDP_ACTIVATION_CHECKPOINTING, which hflight runs)",
    "FSDP_IGNORED_MODULES": "modules left out of sharding; unset it (every parameter is sharded)",
}


class LauncherEnvironmentError(ValueError):
    """A variable of accelerate's launcher that hflight cannot honour, or that contradicts the arguments."""


def apply(args: Any, device_type: Callable[[], str], environ: Mapping[str, str] | None = None) -> None:
    """Set ``args``' fields from accelerate's launcher variables in ``environ`` (default: ``os.environ``), where the
    arguments leave them to the environment as transformers' do; see the module's docstring. ``device_type()``: the
    device type Lightning will pick for the arguments (``cpu``, ``cuda``, ``mps``).

    Raises:
        LauncherEnvironmentError: a variable hflight cannot honour, a value accelerate would refuse, or a variable
            that contradicts a field set in the arguments (each named, with what to do).
    """
    env = os.environ if environ is None else environ
    _refuse(env)
    _check_local_rank(args, env)
    _device(args, env, device_type)
    _check_one_strategy(args, env, bool(args.deepspeed) or _flag(env, "ACCELERATE_USE_DEEPSPEED"))
    _mixed_precision(args, env)
    _fsdp(args, env, device_type)
    _deepspeed(args, env)
    _dynamo(args, env)
    _parallelism(args, env)
    _process_settings(args, env)


# ---------------------------------------------------------------------- values as accelerate parses them


def _truth(name: str, value: str) -> bool:
    """accelerate's ``str_to_bool`` (y/yes/t/true/on/1, n/no/f/false/off/0), its error naming the variable."""
    from accelerate.utils.environment import str_to_bool

    try:
        return bool(str_to_bool(value))
    except ValueError:
        raise LauncherEnvironmentError(
            f"{name}={value!r} is not a truth value accelerate reads (true/false, yes/no, 1/0, on/off)"
        ) from None


def _flag(env: Mapping[str, str], name: str, default: bool = False) -> bool:
    return _truth(name, env[name]) if name in env else default


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    try:
        return int(env.get(name, default))
    except ValueError:
        raise LauncherEnvironmentError(f"{name}={env[name]!r} is not an integer") from None


def _named(env: Mapping[str, str], name: str, choices: list[str], default: str) -> str:
    """A name from ``choices`` (any case), or its 1-based index as accelerate's plugin takes it."""
    value = env.get(name, default).upper()
    if value.isdigit() and 1 <= int(value) <= len(choices):
        return choices[int(value) - 1]
    if value not in choices:
        raise LauncherEnvironmentError(f"{name}={env[name]!r} is none of {', '.join(choices)}")
    return value


# ---------------------------------------------------------------------- refused, contradictory


def _refuse(env: Mapping[str, str]) -> None:
    found = [f"{name}={env[name]!r}: {advice}" for name, (asks, advice) in _REFUSED.items() if asks(env)]
    fp8 = sorted(name for name in env if name.startswith(_FP8_PREFIX))
    if fp8:
        found.append(f"{', '.join(fp8)}: fp8 training settings; hflight trains in fp32, bf16 or fp16, unset them")
    if found:
        raise LauncherEnvironmentError(
            "accelerate launch set what hflight cannot honour: " + "; ".join(found) + " (docs/coming-from-"
            "transformers.md, 'accelerate launch')."
        )


def _check_local_rank(args: Any, env: Mapping[str, str]) -> None:
    """``--local_rank=N`` (what the ``deepspeed`` launcher and torch's old launcher pass) is the launcher's
    ``LOCAL_RANK``: transformers reads the variable; a value that contradicts it is refused."""
    given = getattr(args, "local_rank", -1)
    if given not in (-1, None) and "LOCAL_RANK" in env and _int(env, "LOCAL_RANK", -1) != given:
        raise LauncherEnvironmentError(
            f"--local_rank={given} contradicts the launcher's LOCAL_RANK={env['LOCAL_RANK']}: the local rank is the "
            "launcher's; drop --local_rank from the command line."
        )


def _check_one_strategy(args: Any, env: Mapping[str, str], deepspeed: bool) -> None:
    fsdp = bool(args.fsdp) or _flag(env, "ACCELERATE_USE_FSDP")
    chosen = [name for name, on in (("ACCELERATE_USE_FSDP", fsdp), ("ACCELERATE_USE_DEEPSPEED", deepspeed)) if on]
    launched = [name for name in chosen if _flag(env, name)]
    if not launched:
        return
    if len(chosen) > 1:
        raise LauncherEnvironmentError(
            "FSDP and DeepSpeed are both asked for (ACCELERATE_USE_FSDP, ACCELERATE_USE_DEEPSPEED, or fsdp/deepspeed "
            "in the arguments): choose one distributed_type in the accelerate config, or drop --fsdp/--deepspeed."
        )
    if args.strategy != "auto":
        raise LauncherEnvironmentError(
            f"{launched[0]}=true (accelerate launch) and strategy={args.strategy!r} each choose the Lightning "
            "strategy: leave strategy='auto', or launch without the accelerate config's distributed_type."
        )


# ---------------------------------------------------------------------- device, precision


def _device(args: Any, env: Mapping[str, str], device_type: Callable[[], str]) -> None:
    """``ACCELERATE_USE_CPU`` (``--cpu``): the CPU even where there are GPUs, as accelerate's ``cpu=True``."""
    if _flag(env, "ACCELERATE_USE_CPU"):
        if isinstance(args.accelerator, str) and args.accelerator not in ("auto", "cpu"):
            raise LauncherEnvironmentError(
                f"ACCELERATE_USE_CPU=true (accelerate launch --cpu) contradicts accelerator={args.accelerator!r}: "
                "drop one of them."
            )
        if args.accelerator == "auto":
            args.accelerator = "cpu"
    wanted = env.get("ACCELERATE_TORCH_DEVICE")
    if wanted:
        picked = "cpu" if args.use_cpu else device_type()
        device = torch.device(wanted)
        ray = ray_train.worker()  # Ray Train names each worker's device: the one Lightning picks for its local rank
        index = None if ray is None or device.type == "cpu" else ray.local_rank
        if device.type != picked or device.index not in (None, index):
            lightning = picked if index is None else f"{picked}:{index}, the device of local rank {index}"
            raise LauncherEnvironmentError(
                f"ACCELERATE_TORCH_DEVICE={wanted!r}: hflight's device is Lightning's (here {lightning}, one per "
                "process); unset it and choose with accelerator=/devices= or CUDA_VISIBLE_DEVICES."
            )


def _env_precision(env: Mapping[str, str]) -> str:
    value = env.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if value == "fp8":
        raise LauncherEnvironmentError(
            "ACCELERATE_MIXED_PRECISION='fp8' (accelerate launch --mixed_precision fp8): fp8 training needs "
            "Transformer Engine, MS-AMP or torchao through accelerate, which hflight does not run; use bf16 or fp16."
        )
    if value not in ("no", "fp16", "bf16"):
        raise LauncherEnvironmentError(
            f"ACCELERATE_MIXED_PRECISION={value!r} is none of accelerate's no, fp16, bf16, fp8"
        )
    return value


def _mixed_precision(args: Any, env: Mapping[str, str]) -> None:
    """transformers' rule: ``fp16``/``bf16`` in the arguments win; else the launcher's precision. Under the launcher's
    DeepSpeed too: transformers' ``TrainingArguments`` have accelerate's plugin enable it in the DeepSpeed config
    (``set_mixed_precision``), and ``bf16``/``fp16`` set here keep the arguments in step with that config (transformers
    leaves them False, and its ``train()`` stops on the mismatch it then finds). A ``deepspeed`` config given to the
    script has its precision filled from ``--bf16``/``--fp16`` alone, and accelerate runs no autocast under DeepSpeed:
    transformers trains fp32 whatever the launcher says; refused, naming the fix."""
    wanted = _env_precision(env)
    given = "fp16" if args.fp16 else "bf16" if args.bf16 else None
    if wanted == "no" or given is not None:
        return
    if args.deepspeed:
        raise LauncherEnvironmentError(
            f"ACCELERATE_MIXED_PRECISION={wanted!r} with the script's DeepSpeed config: transformers fills its "
            f"precision from --{wanted} alone, and accelerate does not autocast under DeepSpeed (transformers trains "
            f"fp32 here). Pass --{wanted} to the script (or set {wanted}=True), or launch without --mixed_precision."
        )
    setattr(args, wanted, True)


# ---------------------------------------------------------------------- FSDP


def fsdp_config_from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """transformers' ``fsdp_config`` for the settings accelerate's ``FullyShardedDataParallelPlugin`` reads from the
    ``FSDP_*`` variables, with the plugin's defaults (``FSDP_VERSION`` 1; no wrapping; ``SHARDED_STATE_DICT`` under
    FSDP2, ``FULL_STATE_DICT`` under FSDP1; a size-based policy of 0 parameters wraps nothing)."""
    from accelerate.utils.constants import FSDP_AUTO_WRAP_POLICY, FSDP_STATE_DICT_TYPE

    version = _int(env, "FSDP_VERSION", 1)
    if version not in (1, 2):
        raise LauncherEnvironmentError(f"FSDP_VERSION={env['FSDP_VERSION']!r} must be 1 or 2 (fsdp_version)")
    default_type = "FULL_STATE_DICT" if version == 1 else "SHARDED_STATE_DICT"
    config: dict[str, Any] = {
        "version": version,
        "auto_wrap_policy": _named(env, "FSDP_AUTO_WRAP_POLICY", FSDP_AUTO_WRAP_POLICY, "NO_WRAP"),
        "cpu_offload": _flag(env, "FSDP_OFFLOAD_PARAMS"),
        "activation_checkpointing": _flag(env, "FSDP_ACTIVATION_CHECKPOINTING"),
        "cpu_ram_efficient_loading": _flag(env, "FSDP_CPU_RAM_EFFICIENT_LOADING"),
        "state_dict_type": _named(env, "FSDP_STATE_DICT_TYPE", FSDP_STATE_DICT_TYPE, default_type),
    }
    if config["auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP" and env.get("FSDP_TRANSFORMER_CLS_TO_WRAP"):
        config["transformer_layer_cls_to_wrap"] = env["FSDP_TRANSFORMER_CLS_TO_WRAP"].split(",")
    if config["auto_wrap_policy"] == "SIZE_BASED_WRAP":
        minimum = _int(env, "FSDP_MIN_NUM_PARAMS", 0)
        if minimum > 0:
            config["min_num_params"] = minimum
        else:
            config["auto_wrap_policy"] = "NO_WRAP"
    if version == 2:
        config["reshard_after_forward"] = _flag(env, "FSDP_RESHARD_AFTER_FORWARD", True)
    else:
        config.update(_fsdp1_from_env(env))
    return config


def _fsdp1_from_env(env: Mapping[str, str]) -> dict[str, Any]:
    from accelerate.utils.constants import FSDP_BACKWARD_PREFETCH, FSDP_SHARDING_STRATEGY

    return {
        "reshard_after_forward": _named(env, "FSDP_SHARDING_STRATEGY", FSDP_SHARDING_STRATEGY, "FULL_SHARD").lower(),
        "backward_prefetch": _named(env, "FSDP_BACKWARD_PREFETCH", FSDP_BACKWARD_PREFETCH, "NO_PREFETCH"),
        "forward_prefetch": _flag(env, "FSDP_FORWARD_PREFETCH"),
        "use_orig_params": _flag(env, "FSDP_USE_ORIG_PARAMS"),
        "sync_module_states": _flag(env, "FSDP_SYNC_MODULE_STATES"),
    }


def _fsdp(args: Any, env: Mapping[str, str], device_type: Callable[[], str]) -> None:
    """``ACCELERATE_USE_FSDP``: ``fsdp`` from the ``FSDP_*`` variables. With ``fsdp`` in the arguments, the variables
    fill what transformers leaves to accelerate's plugin (which reads them whenever FSDP is on)."""
    launched = _flag(env, "ACCELERATE_USE_FSDP")
    if not (launched or args.fsdp):
        return
    refused = [f"{name}={env[name]!r} ({why})" for name, why in _FSDP_REFUSED.items() if _fsdp_asks(env, name)]
    if refused:
        raise LauncherEnvironmentError(f"FSDP settings hflight's FSDP2 does not have: {'; '.join(refused)}.")
    if args.fsdp:
        _fill_fsdp_config(args, env)
        return
    config = fsdp_config_from_env(env)
    if config["version"] == 1:
        _check_fsdp1_device(args, device_type)
    args.fsdp, args.fsdp_config = True, config


def _fsdp_asks(env: Mapping[str, str], name: str) -> bool:
    if name == "FSDP_IGNORED_MODULES":
        return bool(env.get(name))
    return _flag(env, name)


def _check_fsdp1_device(args: Any, device_type: Callable[[], str]) -> None:
    device = "cpu" if args.use_cpu else device_type()
    if device != "cuda":
        raise LauncherEnvironmentError(
            f"FSDP_VERSION=1 (the accelerate config's fsdp_version, 1 when it names none): FSDP1 needs CUDA GPUs "
            f"(Lightning's FSDPStrategy, torch's FullyShardedDataParallel) and this run's device is {device!r}. Set "
            "fsdp_version: 2 in the accelerate config (FSDP2 runs on the CPU too)."
        )


def _fill_fsdp_config(args: Any, env: Mapping[str, str]) -> None:
    """The settings transformers does not pass to accelerate's plugin when ``fsdp_config`` leaves them out, which the
    plugin then reads from the environment: offload, activation checkpointing, the layers or size to wrap."""
    config = _fsdp_config_dict(args.fsdp_config)
    policy = str(config.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP")).upper()
    filled = {}
    if not config.get("cpu_offload") and _flag(env, "FSDP_OFFLOAD_PARAMS"):
        filled["cpu_offload"] = True
    if "activation_checkpointing" not in config and _flag(env, "FSDP_ACTIVATION_CHECKPOINTING"):
        filled["activation_checkpointing"] = True
    if policy == "TRANSFORMER_BASED_WRAP" and not config.get("transformer_layer_cls_to_wrap"):
        if env.get("FSDP_TRANSFORMER_CLS_TO_WRAP"):
            filled["transformer_layer_cls_to_wrap"] = env["FSDP_TRANSFORMER_CLS_TO_WRAP"].split(",")
    if policy == "SIZE_BASED_WRAP" and not config.get("min_num_params") and _int(env, "FSDP_MIN_NUM_PARAMS", 0) > 0:
        filled["min_num_params"] = _int(env, "FSDP_MIN_NUM_PARAMS", 0)
    if filled:
        args.fsdp_config = {**config, **filled}


def _fsdp_config_dict(value: Any) -> dict[str, Any]:
    """``fsdp_config`` as transformers reads it: a dict, a JSON string or a JSON file, ``fsdp_``-prefixed keys
    unprefixed."""
    if value is None:
        return {}
    if isinstance(value, str) and value.startswith("{"):
        value = json.loads(value)
    elif isinstance(value, str):
        with open(value, encoding="utf-8") as handle:
            value = json.load(handle)
    return {(key[5:] if key.startswith("fsdp_") else key): item for key, item in dict(value).items()}


# ---------------------------------------------------------------------- DeepSpeed


def _deepspeed(args: Any, env: Mapping[str, str]) -> None:
    """``ACCELERATE_USE_DEEPSPEED`` without ``deepspeed`` in the arguments: the config accelerate's own
    ``DeepSpeedPlugin`` builds from the launcher's variables (``ACCELERATE_DEEPSPEED_CONFIG_FILE``, else the ZeRO
    stage, offload devices and paths, ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS``, ``ACCELERATE_GRADIENT_CLIPPING``,
    the 16-bit save of ZeRO-3), with the precision set as transformers sets it, becomes ``deepspeed``."""
    if not _flag(env, "ACCELERATE_USE_DEEPSPEED") or args.deepspeed:
        return
    if env.get("ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES"):
        raise LauncherEnvironmentError(
            f"ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES={env['ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES']!r}: ZeRO-3 "
            "leaf modules for mixture-of-experts layers are set by accelerate's prepare, which hflight does not run; "
            "unset it (deepspeed_moe_layer_cls_names)."
        )
    where = ", ".join(f"{name}={env[name]}" for name in DEEPSPEED_VARIABLES if name in env) or "ZeRO-2, no file"
    config = _plugin_config(args, where)
    own = [key for key in ("optimizer", "scheduler") if key in config]
    if own:
        raise LauncherEnvironmentError(
            f"The DeepSpeed config of accelerate launch ({where}) names DeepSpeed's own {' and '.join(own)}, which "
            "hflight does not run (the engine runs the Trainer's: optim, learning_rate, lr_scheduler_type and warmup). "
            f"Remove {', '.join(repr(key) for key in own)} from the file."
        )
    args.deepspeed = config
    _spend_config_fields(env)


def _plugin_config(args: Any, where: str) -> dict[str, Any]:
    """The config of accelerate's ``DeepSpeedPlugin`` built from the variables, its precision set as transformers'
    ``TrainingArguments`` set it (the arguments' ``fp16``/``bf16``, the launcher's included). A file that turns that
    precision off keeps it off (accelerate's plugin fills only ``"auto"``): refused, as transformers would train
    fp32."""
    from accelerate.utils import DeepSpeedPlugin

    precision = "fp16" if args.fp16 else "bf16" if args.bf16 else "no"
    try:
        plugin = DeepSpeedPlugin()
        plugin.set_mixed_precision(precision)
    except (ValueError, OSError) as err:
        raise LauncherEnvironmentError(f"accelerate launch's DeepSpeed settings ({where}): {err}") from err
    config = copy.deepcopy(plugin.deepspeed_config)
    enabled = config[precision].get("enabled") if precision != "no" else True
    if str(enabled).lower() != "true":
        raise LauncherEnvironmentError(
            f"The DeepSpeed config of accelerate launch ({where}) sets {precision}.enabled={enabled!r}, and "
            f"{precision} is asked for (--{precision} or ACCELERATE_MIXED_PRECISION): transformers would train fp32 or "
            f"stop on the mismatch. Set {precision}.enabled to 'auto' in the file, or ask for no {precision}."
        )
    return config


def _spend_config_fields(env: Mapping[str, str]) -> None:
    """``ACCELERATE_CONFIG_DS_FIELDS``: the accelerate config's DeepSpeed fields, which accelerate's plugin checks
    against a DeepSpeed config file only (beside one, they would be ignored). Without a file they are the settings the
    config was just built from, but transformers' ``__post_init__`` hands that config (now ``deepspeed``) to a
    ``DeepSpeedPlugin`` of its own, which would check them as beside a file and raise accelerate's "... will be
    ignored" where transformers, building its plugin from the variables, runs: the fields, spent, leave this process's
    environment."""
    if env is os.environ and env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none") == "none":
        os.environ.pop("ACCELERATE_CONFIG_DS_FIELDS", None)


# ---------------------------------------------------------------------- compilation, parallelism, the process


def _dynamo(args: Any, env: Mapping[str, str]) -> None:
    """``ACCELERATE_DYNAMO_BACKEND``/``_MODE``: transformers hands accelerate's ``TorchDynamoPlugin`` the arguments'
    backend and mode, which read the environment where the arguments leave them unset; a backend from the
    environment compiles the model as ``torch_compile`` does."""
    from accelerate.utils import DynamoBackend

    backend = env.get("ACCELERATE_DYNAMO_BACKEND", "no").upper()
    if backend not in DynamoBackend.__members__:
        raise LauncherEnvironmentError(
            f"ACCELERATE_DYNAMO_BACKEND={env['ACCELERATE_DYNAMO_BACKEND']!r} is none of accelerate's "
            f"{', '.join(DynamoBackend.__members__)}"
        )
    asked = args.torch_compile or args.torch_compile_backend or args.torch_compile_mode
    if backend != "NO" and not asked:
        args.torch_compile_backend = DynamoBackend[backend].value.lower()
    compiles = asked or backend != "NO"
    if compiles and args.torch_compile_mode is None and env.get("ACCELERATE_DYNAMO_MODE"):
        args.torch_compile_mode = env["ACCELERATE_DYNAMO_MODE"]
    for name in ("ACCELERATE_DYNAMO_USE_FULLGRAPH", "ACCELERATE_DYNAMO_USE_DYNAMIC"):
        _flag(env, name)  # checked now, used when the model is compiled


def compile_model(model: torch.nn.Module, args: Any) -> torch.nn.Module:
    """``model`` compiled as accelerate's ``TorchDynamoPlugin`` compiles it for transformers' Trainer: the arguments'
    backend and mode, ``fullgraph`` and ``dynamic`` from ``ACCELERATE_DYNAMO_USE_FULLGRAPH``/``_USE_DYNAMIC`` (the
    launcher always exports both), and the repeated blocks compiled one by one (accelerate's ``compile_regions``) under
    ``ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION``."""
    env = os.environ
    kwargs: dict[str, Any] = {"backend": args.torch_compile_backend, "mode": args.torch_compile_mode}
    kwargs["fullgraph"] = _flag(env, "ACCELERATE_DYNAMO_USE_FULLGRAPH")
    if "ACCELERATE_DYNAMO_USE_DYNAMIC" in env:
        kwargs["dynamic"] = _flag(env, "ACCELERATE_DYNAMO_USE_DYNAMIC")
    if _flag(env, "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"):
        from accelerate.utils import compile_regions

        return compile_regions(model, **kwargs)
    return torch.compile(model, **kwargs)


def _parallelism(args: Any, env: Mapping[str, str]) -> None:
    """``ACCELERATE_USE_PARALLELISM_CONFIG``: accelerate's ``ParallelismConfig``, which reads ``PARALLELISM_CONFIG_*``
    itself, where the arguments have none; its data-parallel sizes run on hflight (with FSDP2), its tensor-parallel
    size with a model loaded tensor-parallel (``hflight.arguments.strategies.check_tensor_parallel_config``)."""
    if not _flag(env, "ACCELERATE_USE_PARALLELISM_CONFIG") or args.parallelism_config is not None:
        return
    from accelerate import ParallelismConfig

    try:
        config = ParallelismConfig()
    except ValueError as err:
        raise LauncherEnvironmentError(f"PARALLELISM_CONFIG_* (accelerate launch): {err}") from err
    others = [f"PARALLELISM_CONFIG_{n.upper()}_SIZE={getattr(config, f'{n}_size')}" for n in ("cp", "sp")]
    others = [text for text in others if not text.endswith("=1")]
    if others:
        raise LauncherEnvironmentError(
            f"{', '.join(others)}: context parallelism needs torch's ring attention over SDPA (CUDA: the CPU's "
            "attention kernel has no sharding rule) and sequence parallelism DeepSpeed's Ulysses/ALST, which hflight "
            "does not run; the data-parallel and tensor-parallel sizes are taken."
        )
    args.parallelism_config = config


def _process_settings(args: Any, env: Mapping[str, str]) -> None:
    """What accelerate's ``PartialState`` does to the process: ``ACCELERATE_DEBUG_MODE`` checks every collective
    across the processes (accelerate: the shapes its operations gather; here torch's ``DETAIL`` debug level, which
    compares each collective's op and shapes across processes, unless ``TORCH_DISTRIBUTED_DEBUG`` says otherwise);
    ``ACCELERATE_CPU_AFFINITY`` pins the process to its GPU's NUMA node (accelerate's own function)."""
    if _flag(env, "ACCELERATE_DEBUG_MODE") and "TORCH_DISTRIBUTED_DEBUG" not in env:
        import torch.distributed as dist

        if dist.is_available():
            dist.set_debug_level(dist.DebugLevel.DETAIL)
    if _flag(env, "ACCELERATE_CPU_AFFINITY"):
        from accelerate.utils.environment import set_numa_affinity

        set_numa_affinity(args.local_process_index)
