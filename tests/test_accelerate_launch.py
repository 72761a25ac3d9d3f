"""accelerate's launcher and its config files honoured (issue 40, item 1): what ``accelerate launch`` exports, read
as transformers' ``TrainingArguments`` and accelerate's plugins read it (``hflight.arguments.launcher_env``), and
DeepSpeed's own launcher recognised like torchrun (``hflight.arguments.cluster``).

The unit tests take the environment from accelerate's own launcher code (``accelerate.utils.launch``'s
``prepare_*_env`` on a parsed ``accelerate launch`` command line, nothing started) and check each variable's effect
on hflight's arguments, against accelerate's own plugins where they read the same variables, and the DeepSpeed config
hflight's engine gets against the one transformers' Trainer trains with (transformers' own calls, in this process).

The launches run transformers' ``run_clm.py`` (``tests/scripts/run_clm``) under ``accelerate launch`` once as written
and once with the trainer import changed to hflight's, with one of the four config files transformers' own
test suite ships for this (``tests/trainer/distributed/accelerate_configs/{ddp,fsdp2,deepspeed_zero2,deepspeed_zero3}
.yaml`` in huggingface/transformers; :data:`CONFIGS` has their keys and values, :data:`LAUNCHED` names it and says
where each claim of the others' runs is proved). On this CPU-only machine transformers' processes
under ``accelerate launch`` each train alone unless the script gets ``--use_cpu`` (accelerate starts its CPU data
parallelism for ``use_cpu`` alone), and accelerate drops FSDP on the CPU (it trains DDP): transformers' side therefore
runs with ``--use_cpu``, and its FSDP2 run through the test stand-in ``tests/fsdp_standin`` (accelerate's own FSDP2
code, the state a GPU run gets). hflight's side runs as a user writes it, without ``--use_cpu``. DeepSpeed's own
launcher (``deepspeed --num_gpus 2 run_clm.py --deepspeed ds_config.json``, which passes ``--local_rank``) runs
hflight's side of tests/test_deepspeed.py's ZeRO-2 comparison.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

import hflight
from hflight.arguments import cluster, launcher_env
from hflight.arguments.launcher_env import LauncherEnvironmentError

from . import dropin

ACCELERATE = str(Path(sys.executable).with_name("accelerate"))
FSDP_STANDIN = Path(__file__).resolve().parent / "fsdp_standin"

#: accelerate config files with the keys and values of transformers' own test suite's
#: (huggingface/transformers, tests/trainer/distributed/accelerate_configs/<name>.yaml); ``{zero2}``/``{zero3}``: the
#: DeepSpeed config files below
CONFIGS = {
    "ddp": "distributed_type: MULTI_GPU\nnum_machines: 1\nnum_processes: 2\n",
    "fsdp2": "distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\nnum_processes: 2\n",
    "deepspeed_zero2": "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: {zero2}\n"
    "num_processes: 2\n",
    "deepspeed_zero3": "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: {zero3}\n"
    "num_processes: 2\n",
}
#: the config file launched end to end here: ZeRO-3 (the launch recognised, both processes spanned, a DeepSpeed
#: strategy from the launcher's variables and config file). fsdp2's and deepspeed_zero2's variables are checked
#: against accelerate's plugins below (test_fsdp_variables_..., test_a_launched_deepspeed_config_...); their runs
#: against transformers' are tests/test_sharded_dropin.py's (FSDP2) and tests/test_deepspeed.py's (ZeRO-2), under
#: torchrun and DeepSpeed's launcher: the same strategies, another launcher. ddp's (MULTI_GPU) is not run, each of
#: its claims proved elsewhere: accelerate starts its processes with torchrun's own code, as for deepspeed_zero3
#: (launch recognised, both processes spanned: the zero3 launch); the variables it exports leave hflight's arguments
#: those of plain torchrun (test_the_ddp_config_file_leaves_the_arguments_those_of_plain_torchrun; its precision
#: "no" and dynamo defaults reach the zero3 launch too); DDP over two torchrun processes with transformers'
#: numbers, files, weights and every rank's RNG state is tests/test_torchrun_dropin.py's (run_glue); run_clm over two
#: processes with gradient accumulation and ``average_tokens_across_devices`` (one label count and loss scaling for
#: every strategy, hflight.trainer.steps) is tests/test_sharded_dropin.py's and the zero3 launch's, and DDP's
#: accumulation against transformers' tests/test_accelerator_config.py's (the dispatch run)
LAUNCHED = ["deepspeed_zero3"]
#: the DeepSpeed configs those files name (transformers' tests/trainer/distributed/scripts/ds_config_zero{2,3}.json):
#: precision, batch sizes, accumulation and clipping "auto", ZeRO-3's buckets "auto". Their ``optimizer`` (AdamW) and
#: ``scheduler`` (WarmupLR) sections, DeepSpeed's own, are left out here: hflight runs the Trainer's optimizer in the
#: engine and refuses them (:data:`DEEPSPEED_OWN_OPTIMIZER`, test_a_deepspeed_config_of_its_own_optimizer_is_refused)
_DS_AUTO = {"fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"}, "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "train_batch_size": "auto",
            "train_micro_batch_size_per_gpu": "auto"}  # fmt: skip
DEEPSPEED_CONFIGS = {
    "zero2": {**_DS_AUTO, "zero_optimization": {"stage": 2}},
    "zero3": {**_DS_AUTO, "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                                "stage3_prefetch_bucket_size": "auto",
                                                "stage3_param_persistence_threshold": "auto"}},
}  # fmt: skip
DEEPSPEED_OWN_OPTIMIZER = {
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
}  # fmt: skip
#: prefixes of the variables accelerate's launcher and plugins read
PREFIXES = ("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_", "MEGATRON_LM_")
#: what the launcher exports for readers other than accelerate: torch and torchrun (ranks, threads, devices), the
#: OpenMP runtime, Python
OTHER_READERS = ("OMP_NUM_THREADS", "KMP_AFFINITY", "KMP_BLOCKTIME", "MASTER_ADDR", "MASTER_PORT", "PYTHONPATH",
                 "CUDA_VISIBLE_DEVICES")  # fmt: skip


def write_configs(folder: Path) -> dict[str, Path]:
    """The accelerate config files of :data:`CONFIGS` and the DeepSpeed ones they name, in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for name, config in DEEPSPEED_CONFIGS.items():
        paths[name] = folder / f"ds_config_{name}.json"
        paths[name].write_text(json.dumps(config, indent=2), encoding="utf-8")
    for name, text in CONFIGS.items():
        paths[name] = folder / f"{name}.yaml"
        paths[name].write_text(text.format(zero2=paths["zero2"], zero3=paths["zero3"]), encoding="utf-8")
    return paths


def launched_env(argv: list[str]) -> dict[str, str]:
    """The variables ``accelerate launch <argv> script.py`` exports to the script (those that differ from this
    process's environment), computed by accelerate's own launcher code without starting anything."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import launch

    args = launch_command_parser().parse_args([*argv, "script.py"])
    args, defaults, precision_from_config = _validate_launch_command(args)
    if args.use_deepspeed:  # as accelerate's launch_command
        fields = [*(defaults.deepspeed_config if defaults else {}), *(["mixed_precision"] * precision_from_config)]
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        env = launch.prepare_deepspeed_cmd_env(args)[1]
    elif args.use_fsdp or args.multi_gpu or args.use_megatron_lm:
        env = launch.prepare_multi_gpu_env(args)
    else:
        env = launch.prepare_simple_launcher_cmd_env(args)[1]
    return {name: value for name, value in env.items() if os.environ.get(name) != value}


@pytest.fixture(autouse=True)
def _environment_restored():
    """Each test starts without accelerate's variables and leaves none behind (transformers' own ``__post_init__``
    writes ``FSDP_CPU_RAM_EFFICIENT_LOADING``), nor DeepSpeed's global config (a ZeRO-3 config would make later
    ``from_pretrained`` calls partition under ``deepspeed.zero.Init``), nor torch's distributed debug level."""
    import torch.distributed as dist
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    saved, level = dict(os.environ), dist.get_debug_level()
    for name in [name for name in os.environ if name.startswith(PREFIXES)]:
        del os.environ[name]
    yield
    os.environ.clear()
    os.environ.update(saved)
    unset_hf_deepspeed_config()
    dist.set_debug_level(level)


def arguments(tmp_path: Path, env: dict[str, str], **fields) -> hflight.TrainingArguments:
    """hflight's arguments built under ``env`` (the variables stay set for the test)."""
    os.environ.update(env)
    return hflight.TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", **fields)


# ---------------------------------------------------------------------- every variable the launcher exports


ALL_OPTIONS = [
    ["--cpu", "--debug", "--enable_cpu_affinity", "--num_processes", "2", "--mixed_precision", "bf16",
     "--dynamo_backend", "inductor", "--dynamo_mode", "max-autotune", "--dynamo_use_fullgraph", "--dynamo_use_dynamic",
     "--dynamo_use_regional_compilation", "--gpu_ids", "0"],
    ["--use_fsdp", "--num_processes", "2", "--main_process_port", "0", "--fsdp_version", "2",
     "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", "--fsdp_transformer_layer_cls_to_wrap", "GPT2Block",
     "--fsdp_backward_prefetch", "BACKWARD_PRE", "--fsdp_state_dict_type", "FULL_STATE_DICT",
     "--fsdp_activation_checkpointing", "true", "--use_parallelism_config", "--parallelism_config_dp_shard_size", "2"],
    ["--use_deepspeed", "--num_processes", "2", "--main_process_port", "0", "--zero_stage", "3",
     "--gradient_accumulation_steps", "2", "--gradient_clipping", "1.0", "--offload_optimizer_device", "cpu",
     "--offload_param_device", "cpu", "--zero3_init_flag", "true", "--zero3_save_16bit_model", "true",
     "--deepspeed_moe_layer_cls_names", "GPT2Block", "--enable_cpu_affinity"],
    ["--use_megatron_lm", "--num_processes", "2", "--main_process_port", "0"],
]  # fmt: skip


def test_every_variable_accelerate_launch_exports_has_a_reader_in_hflight():
    """Every variable ``accelerate launch`` exports with each of its options on (CPU and simple launcher, FSDP with a
    parallelism config, DeepSpeed from flags, Megatron-LM) is read by ``launcher_env`` (mapped or refused, named in
    it) or is for another reader (torch, torchrun, OpenMP, Python); the tests below check what each one does."""
    source = Path(launcher_env.__file__).read_text(encoding="utf-8")
    exported = {name for argv in ALL_OPTIONS for name in launched_env(argv)}
    assert {"ACCELERATE_USE_FSDP", "ACCELERATE_DEEPSPEED_ZERO_STAGE", "MEGATRON_LM_TP_DEGREE"} <= exported
    unread = sorted(
        name for name in exported
        if name not in OTHER_READERS and not name.startswith("MEGATRON_LM_")  # refused with ACCELERATE_USE_MEGATRON_LM
        and not (name.startswith("PARALLELISM_CONFIG_") and "ParallelismConfig()" in source)  # accelerate's class reads
        and f'"{name}"' not in source
    )  # fmt: skip
    assert not unread


def test_mixed_precision_bf16_is_the_bf16_field_and_lightning_bf16_mixed(tmp_path):
    """``accelerate launch --mixed_precision bf16``: transformers' ``mixed_precision`` from the launcher, Lightning's
    ``bf16-mixed`` (accelerate autocasts bf16 on the CPU too); ``no`` changes nothing. Once the arguments say bf16,
    training under it is transformers' bit for bit:
    tests/test_fields_parity.py::test_bf16_on_cpu_is_transformers_bit_for_bit (a one-process ``accelerate launch
    --mixed_precision bf16`` of run_clm.py against transformers' proved the same again and is no longer run)."""
    from hflight.arguments.lightning_kwargs import precision_for

    env = launched_env(["--num_processes", "1", "--mixed_precision", "bf16"])
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    args = arguments(tmp_path, env)
    assert (args.bf16, args.fp16, args.mixed_precision, precision_for(args)) == (True, False, "bf16", "bf16-mixed")
    os.environ["ACCELERATE_MIXED_PRECISION"] = "no"
    assert precision_for(hflight.TrainingArguments(output_dir=str(tmp_path))) == "32-true"


def test_mixed_precision_fp16_on_the_cpu_runs_fp32_as_accelerate_and_the_arguments_win(tmp_path):
    from hflight.arguments.lightning_kwargs import precision_for

    args = arguments(tmp_path, {"ACCELERATE_MIXED_PRECISION": "fp16"}, use_cpu=True)
    assert args.fp16 and precision_for(args) == "32-true"  # accelerate: no fp16 autocast or scaler on the CPU
    explicit = arguments(tmp_path, {"ACCELERATE_MIXED_PRECISION": "fp16"}, bf16=True)  # transformers: bf16 wins
    assert (explicit.bf16, explicit.fp16, explicit.mixed_precision) == (True, False, "bf16")


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"ACCELERATE_MIXED_PRECISION": "fp8"}, "ACCELERATE_MIXED_PRECISION='fp8'"),
        ({"ACCELERATE_MIXED_PRECISION": "fp12"}, "ACCELERATE_MIXED_PRECISION='fp12'"),
        ({"ACCELERATE_FP8_BACKEND": "TE"}, "ACCELERATE_FP8_BACKEND"),
        ({"ACCELERATE_USE_MEGATRON_LM": "true"}, "ACCELERATE_USE_MEGATRON_LM"),
        ({"ACCELERATE_USE_SAGEMAKER": "true", "ACCELERATE_SAGEMAKER_DISTRIBUTED_TYPE": "DATA_PARALLEL"},
         "ACCELERATE_SAGEMAKER_DISTRIBUTED_TYPE"),
        ({"ACCELERATE_DOWNCAST_BF16": "1"}, "ACCELERATE_DOWNCAST_BF16"),
        ({"ACCELERATE_USE_CPU": "maybe"}, "ACCELERATE_USE_CPU='maybe'"),
        ({"ACCELERATE_TORCH_DEVICE": "cuda:1"}, "ACCELERATE_TORCH_DEVICE='cuda:1'"),
        ({"ACCELERATE_DYNAMO_BACKEND": "FASTEST"}, "ACCELERATE_DYNAMO_BACKEND='FASTEST'"),
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1"}, "FSDP_VERSION=1"),
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_ACTIVATION_CHECKPOINTING": "true",
          "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD": "true"}, "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD"),
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_IGNORED_MODULES": "lm_head"},
         "FSDP_IGNORED_MODULES"),
        ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "BY_MOOD"},
         "FSDP_AUTO_WRAP_POLICY='BY_MOOD'"),
        ({"ACCELERATE_USE_FSDP": "true", "ACCELERATE_USE_DEEPSPEED": "true"}, "ACCELERATE_USE_DEEPSPEED"),
        ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES": "GPT2Block"},
         "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES"),
        ({"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "/no/such/ds.json"},
         "ACCELERATE_DEEPSPEED_CONFIG_FILE=/no/such/ds.json"),
        ({"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_CP_SIZE": "2"},
         "PARALLELISM_CONFIG_CP_SIZE=2: context parallelism needs torch's ring attention"),
        ({"LOCAL_RANK": "0"}, "--local_rank=1 contradicts the launcher's LOCAL_RANK=0"),
    ],
)  # fmt: skip
def test_what_hflight_cannot_honour_is_refused_naming_the_variable(tmp_path, env, named):
    fields = {"local_rank": 1} if "LOCAL_RANK" in env else {}
    with pytest.raises(LauncherEnvironmentError, match=named.replace("(", r"\(").replace("[", r"\[")):
        arguments(tmp_path, env, **fields)


def test_a_launched_strategy_and_a_strategy_argument_are_refused_together(tmp_path):
    with pytest.raises(LauncherEnvironmentError, match=r"ACCELERATE_USE_FSDP=true .* strategy='ddp'"):
        arguments(tmp_path, {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}, strategy="ddp")


def test_use_cpu_is_the_cpu_accelerator(tmp_path):
    env = launched_env(["--cpu", "--num_processes", "1"])
    assert env["ACCELERATE_USE_CPU"] == "True"
    assert arguments(tmp_path, env).accelerator == "cpu"
    assert arguments(tmp_path, {"ACCELERATE_TORCH_DEVICE": "cpu"}).accelerator == "cpu"  # the device it runs on
    with pytest.raises(LauncherEnvironmentError, match="ACCELERATE_USE_CPU=true .* accelerator='gpu'"):
        arguments(tmp_path, env, accelerator="gpu")


def test_dynamo_variables_compile_the_model_as_accelerates_dynamo_plugin(tmp_path, monkeypatch):
    """``--dynamo_backend inductor --dynamo_mode reduce-overhead --dynamo_use_fullgraph``: the model compiled with
    the keyword arguments accelerate's ``TorchDynamoPlugin`` (built by transformers' Trainer) gives ``torch.compile``;
    ``--dynamo_use_regional_compilation``: accelerate's ``compile_regions``; an explicit ``torch_compile`` keeps its
    backend (transformers passes it to the plugin)."""
    import accelerate.utils
    from accelerate.utils import TorchDynamoPlugin

    argv = ["--num_processes", "1", "--dynamo_backend", "inductor", "--dynamo_mode", "reduce-overhead",
            "--dynamo_use_fullgraph"]  # fmt: skip
    args = arguments(tmp_path, launched_env(argv))
    compile_fields = (args.torch_compile, args.torch_compile_backend, args.torch_compile_mode)
    assert compile_fields == (True, "inductor", "reduce-overhead")
    compiled: list[tuple[str, dict]] = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: compiled.append(("torch.compile", kw)) or model)
    monkeypatch.setattr(accelerate.utils, "compile_regions", lambda m, **kw: compiled.append(("regions", kw)) or m)
    launcher_env.compile_model(torch.nn.Linear(2, 2), args)
    plugin = TorchDynamoPlugin(backend=args.torch_compile_backend, mode=args.torch_compile_mode)
    assert compiled == [("torch.compile", {k: v for k, v in plugin.to_kwargs().items() if k != "options"})]
    assert compiled[0][1] == {"backend": "inductor", "mode": "reduce-overhead", "fullgraph": True, "dynamic": False}
    os.environ["ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION"] = "True"
    launcher_env.compile_model(torch.nn.Linear(2, 2), args)
    assert compiled[-1][0] == "regions"
    os.environ["ACCELERATE_DYNAMO_BACKEND"] = "EAGER"
    assert arguments(tmp_path, {}, torch_compile=True).torch_compile_backend == "inductor"


def _plugin_view(plugin) -> dict:
    """What accelerate's ``FullyShardedDataParallelPlugin`` holds, in transformers' ``fsdp_plugin_args`` terms."""
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    policy = {None: "NO_WRAP", transformer_auto_wrap_policy: "TRANSFORMER_BASED_WRAP",
              size_based_auto_wrap_policy: "SIZE_BASED_WRAP"}[plugin.auto_wrap_policy]  # fmt: skip
    if policy == "SIZE_BASED_WRAP" and not plugin.min_num_params:  # accelerate wraps nothing for 0 parameters
        policy = "NO_WRAP"
    names = plugin.transformer_cls_names_to_wrap if policy == "TRANSFORMER_BASED_WRAP" else None
    return {"version": plugin.fsdp_version, "reshard_after_forward": plugin.reshard_after_forward,
            "cpu_offload": isinstance(plugin.cpu_offload, CPUOffloadPolicy), "auto_wrap_policy": policy,
            "min_num_params": plugin.min_num_params if policy == "SIZE_BASED_WRAP" else None,
            "names": ",".join(names) if names else None, "state_dict_type": plugin.state_dict_type.name,
            "activation_checkpointing": plugin.activation_checkpointing,
            "cpu_ram_efficient_loading": plugin.cpu_ram_efficient_loading}  # fmt: skip


def _args_view(plugin_args: dict) -> dict:
    return {"version": plugin_args["fsdp_version"], "reshard_after_forward": plugin_args["reshard_after_forward"],
            "cpu_offload": plugin_args.get("cpu_offload", False), "auto_wrap_policy": plugin_args["auto_wrap_policy"],
            "min_num_params": plugin_args.get("min_num_params"),
            "names": plugin_args.get("transformer_cls_names_to_wrap"),
            "state_dict_type": plugin_args["state_dict_type"],
            "activation_checkpointing": plugin_args.get("activation_checkpointing", False),
            "cpu_ram_efficient_loading": plugin_args["cpu_ram_efficient_loading"]}  # fmt: skip


FSDP_LAUNCHES = {
    "fsdp2.yaml": ["--config_file", "{fsdp2}"],
    "wrap layers, offload, full state, checkpointing": [
        "--use_fsdp", "--fsdp_version", "2", "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP",
        "--fsdp_transformer_layer_cls_to_wrap", "GPT2Block,GPT2MLP", "--fsdp_offload_params", "true",
        "--fsdp_state_dict_type", "FULL_STATE_DICT", "--fsdp_activation_checkpointing", "true",
        "--fsdp_reshard_after_forward", "false", "--fsdp_cpu_ram_efficient_loading", "false"],
    "wrap by size": ["--use_fsdp", "--fsdp_version", "2", "--fsdp_auto_wrap_policy", "SIZE_BASED_WRAP",
                     "--fsdp_min_num_params", "1000"],
    "wrap by size, 0 parameters": ["--use_fsdp", "--fsdp_version", "2", "--fsdp_auto_wrap_policy", "SIZE_BASED_WRAP",
                                   "--fsdp_min_num_params", "0"],
}  # fmt: skip


@pytest.mark.parametrize("launch", list(FSDP_LAUNCHES))
def test_fsdp_variables_are_the_fsdp_settings_accelerates_plugin_reads(tmp_path, launch):
    """``ACCELERATE_USE_FSDP`` + ``FSDP_*``: ``fsdp`` and the settings accelerate's ``FullyShardedDataParallelPlugin``
    reads from the same variables (its defaults, not transformers': no wrapping, SHARDED_STATE_DICT under FSDP2),
    which hflight's FSDP2 takes as transformers' normalised ``fsdp_plugin_args``."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    configs = write_configs(tmp_path / "configs")
    argv = [part.format(**configs) for part in FSDP_LAUNCHES[launch]]
    env = launched_env([*argv, "--num_processes", "2", "--main_process_port", "0"])
    args = arguments(tmp_path, env)
    assert args.fsdp is True
    assert _args_view(args.fsdp_plugin_args) == _plugin_view(FullyShardedDataParallelPlugin())


def test_fsdp_in_the_arguments_takes_from_the_variables_what_transformers_leaves_to_the_plugin(tmp_path):
    """``--fsdp`` with a config naming no offload: accelerate's plugin reads ``FSDP_OFFLOAD_PARAMS`` (transformers
    passes ``cpu_offload`` only when true), so does hflight; what the config names stays."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy

    env = {"FSDP_OFFLOAD_PARAMS": "true", "FSDP_TRANSFORMER_CLS_TO_WRAP": "GPT2Block", "FSDP_STATE_DICT_TYPE": "X"}
    args = arguments(tmp_path, env, fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["GPT2MLP"]})
    plain = {key: value for key, value in args.fsdp_plugin_args.items() if key != "cpu_offload"}
    plugin = FullyShardedDataParallelPlugin(**plain)  # transformers' kwargs; the plugin reads the rest
    assert isinstance(plugin.cpu_offload, CPUOffloadPolicy) and args.fsdp_plugin_args["cpu_offload"] is True
    assert args.fsdp_plugin_args["transformer_cls_names_to_wrap"] == "GPT2MLP"


@pytest.mark.parametrize("offload", ["true", "false"])
def test_fsdp_config_as_a_json_string_is_read_as_transformers_reads_it(tmp_path, offload):
    """``--fsdp_config '{...}'`` on the command line (transformers parses a JSON string in any dict field): the
    launcher's variables fill it as they fill a dict, and a string with nothing to fill reaches transformers intact."""
    config = '{"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"], "state_dict_type": "FULL_STATE_DICT"}'
    args = arguments(tmp_path, {"FSDP_OFFLOAD_PARAMS": offload}, fsdp=True, fsdp_config=config)
    assert args.fsdp_config["transformer_layer_cls_to_wrap"] == ["GPT2Block"]
    assert args.fsdp_plugin_args["state_dict_type"] == "FULL_STATE_DICT"
    assert bool(args.fsdp_config.get("cpu_offload")) is (offload == "true")


#: FSDP1's variables (``fsdp_version: 1``), each with a value and the setting it gives accelerate's plugin and
#: Lightning's ``FSDPStrategy`` (the sharding strategy's name also by accelerate's 1-based number)
FSDP1_VARIABLES = [
    ("FSDP_SHARDING_STRATEGY", "SHARD_GRAD_OP", "sharding_strategy", "SHARD_GRAD_OP"),
    ("FSDP_SHARDING_STRATEGY", "3", "sharding_strategy", "NO_SHARD"),
    ("FSDP_BACKWARD_PREFETCH", "BACKWARD_POST", "backward_prefetch", "BACKWARD_POST"),
    ("FSDP_BACKWARD_PREFETCH", "NO_PREFETCH", "backward_prefetch", None),
    ("FSDP_FORWARD_PREFETCH", "true", "forward_prefetch", True),
    ("FSDP_FORWARD_PREFETCH", "false", "forward_prefetch", False),
    ("FSDP_USE_ORIG_PARAMS", "true", "use_orig_params", True),
    ("FSDP_USE_ORIG_PARAMS", "false", "use_orig_params", False),
    ("FSDP_SYNC_MODULE_STATES", "true", "sync_module_states", True),
    ("FSDP_SYNC_MODULE_STATES", "false", "sync_module_states", False),
]


@pytest.mark.parametrize(("name", "value", "setting", "expected"), FSDP1_VARIABLES)
def test_each_fsdp1_variable_is_the_setting_accelerates_plugin_reads(tmp_path, monkeypatch, factory, name, value,
                                                                     setting, expected):  # fmt: skip
    """``ACCELERATE_USE_FSDP`` with ``FSDP_VERSION=1`` on a CUDA machine (stand-ins: FSDP1 needs CUDA, and accelerate's
    plugin asks for a device under ``sync_module_states``): each FSDP1 variable reaches Lightning's ``FSDPStrategy``
    (hflight's FSDP1 plan of transformers' ``fsdp_plugin_args``) as accelerate's ``FullyShardedDataParallelPlugin``
    reads it from the same variables, every other FSDP1 setting at the plugin's default (not transformers')."""
    import accelerate.utils.dataclasses
    from accelerate.utils import FullyShardedDataParallelPlugin

    from hflight.arguments import training_args
    from hflight.sharding.plans import fsdp1_plan

    monkeypatch.setattr(training_args, "resolved_device_type", lambda args: "cuda")
    monkeypatch.setattr(accelerate.utils.dataclasses, "is_cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    args = arguments(tmp_path, {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "1", name: value})
    plan = fsdp1_plan(args, factory.cls_model(), {})
    ours = _fsdp1_view(plan.sharding_strategy, plan.options.get("backward_prefetch"), plan.options.__getitem__)
    plugin = FullyShardedDataParallelPlugin()
    theirs = _fsdp1_view(plugin.sharding_strategy.name, plugin.backward_prefetch, lambda key: getattr(plugin, key))
    assert ours == theirs and ours[setting] == expected


def _fsdp1_view(sharding_strategy: str, backward_prefetch, option) -> dict:
    """FSDP1's settings by name (``option``: one of the flags by its name)."""
    flags = {key: option(key) for key in ("forward_prefetch", "use_orig_params", "sync_module_states")}
    return {"sharding_strategy": sharding_strategy,
            "backward_prefetch": backward_prefetch.name if backward_prefetch else None, **flags}  # fmt: skip


#: accelerate's template config for DeepSpeed (accelerate's examples/config_yaml_templates/deepspeed.yaml): the
#: DeepSpeed settings as fields of the accelerate config, no DeepSpeed file; ``{deepspeed}``: those fields, or a file
DEEPSPEED_FIELDS_CONFIG = (
    "distributed_type: DEEPSPEED\ndeepspeed_config:\n{deepspeed}mixed_precision: {precision}\nnum_machines: 1\n"
    "num_processes: 2\n"
)
DEEPSPEED_FIELDS = (
    "  gradient_accumulation_steps: 1\n  gradient_clipping: 1.0\n  offload_optimizer_device: none\n"
    "  offload_param_device: none\n  zero3_init_flag: false\n  zero_stage: 2\n"
)
#: accelerate launch command lines with DeepSpeed (``{deepspeed_zero2}``, ...: :func:`write_configs`' files;
#: ``{fields_bf16}``, ``{fields_no}``: :data:`DEEPSPEED_FIELDS_CONFIG` with that precision)
DEEPSPEED_LAUNCHES = {
    "deepspeed_zero2.yaml": ["--config_file", "{deepspeed_zero2}"],
    "deepspeed_zero3.yaml": ["--config_file", "{deepspeed_zero3}"],
    "deepspeed_zero2.yaml --mixed_precision bf16": ["--config_file", "{deepspeed_zero2}", "--mixed_precision", "bf16"],
    "deepspeed_zero3.yaml --mixed_precision fp16": ["--config_file", "{deepspeed_zero3}", "--mixed_precision", "fp16"],
    "accelerate's template config": ["--config_file", "{fields_no}"],
    "accelerate's template config, bf16": ["--config_file", "{fields_bf16}"],
    "flags: ZeRO-3, offload, 16-bit save, bf16": [
        "--use_deepspeed", "--zero_stage", "3", "--offload_optimizer_device", "cpu", "--offload_param_device", "cpu",
        "--zero3_save_16bit_model", "true", "--zero3_init_flag", "false", "--gradient_clipping", "1.0",
        "--mixed_precision", "bf16"],
}  # fmt: skip


def deepspeed_launch(tmp_path: Path, argv: list[str]) -> dict[str, str]:
    """What ``accelerate launch <argv>`` exports with :func:`write_configs`' files (and ``{fields_*}``) filled in."""
    configs = write_configs(tmp_path / "configs")
    for precision in ("bf16", "no"):
        configs[f"fields_{precision}"] = tmp_path / "configs" / f"deepspeed_fields_{precision}.yaml"
        text = DEEPSPEED_FIELDS_CONFIG.format(deepspeed=DEEPSPEED_FIELDS, precision=repr(precision))
        configs[f"fields_{precision}"].write_text(text, encoding="utf-8")
    return launched_env([*(part.format(**configs) for part in argv), "--main_process_port", "0"])


def transformers_deepspeed_config(tmp_path: Path, model, num_training_steps: int, **fields) -> dict:
    """The DeepSpeed config transformers' Trainer trains with under the launcher's variables (in ``os.environ``),
    by transformers' own calls: its ``TrainingArguments`` build accelerate's ``DeepSpeedPlugin`` from the variables
    and set the launcher's precision in it, accelerate's state sets it again (``AcceleratorState``), the Trainer fills
    the ``"auto"`` values from the arguments (``propagate_args_to_deepspeed``) and, in ``train()``, from the model and
    the run's length (``deepspeed_init``: ``trainer_config_finalize``, then ``zero_allow_untested_optimizer`` for the
    Trainer's optimizer). Raises transformers' mismatch error where its ``train()`` stops."""
    from types import SimpleNamespace

    import transformers
    from transformers.integrations.deepspeed import propagate_args_to_deepspeed

    args = transformers.TrainingArguments(output_dir=str(tmp_path / "theirs"), report_to="none", use_cpu=True, **fields)
    plugin = args.deepspeed_plugin
    plugin.set_mixed_precision(args.mixed_precision)
    propagate_args_to_deepspeed(SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin)), args)
    plugin.hf_ds_config.trainer_config_finalize(args, model, num_training_steps)
    return {**plugin.deepspeed_config, "zero_allow_untested_optimizer": True}


def hflight_deepspeed_config(args: hflight.TrainingArguments, model, num_training_steps: int) -> dict:
    """The DeepSpeed config hflight's engine gets: its strategy's, built from the arguments and finished when the run
    is planned (the model and the run's length known)."""
    from hflight.arguments.strategies import deepspeed_strategy

    strategy = deepspeed_strategy(args)
    strategy.hf_run_planned(args, model, num_training_steps)
    return strategy.config


@pytest.mark.parametrize("launch", list(DEEPSPEED_LAUNCHES))
def test_a_launched_deepspeed_config_is_the_one_transformers_trains_with(tmp_path, factory, launch):
    """``ACCELERATE_USE_DEEPSPEED`` with a DeepSpeed config file or the settings that make one, and the launcher's
    precision or none: the DeepSpeed config hflight's engine gets is the one transformers' Trainer trains with for the
    same variables, key for key (precision sections, ZeRO stage, offload, buckets, batch sizes, accumulation,
    clipping). With a launcher's precision, transformers' own ``train()`` stops (its ``bf16``/``fp16`` argument
    stays False against the config accelerate's plugin enabled): its config is then taken with ``--bf16``/``--fp16``
    as well, the run it does train; hflight trains that run from the launcher's precision alone."""
    model = factory.cls_model()
    env = deepspeed_launch(tmp_path, DEEPSPEED_LAUNCHES[launch])
    precision = env["ACCELERATE_MIXED_PRECISION"]
    os.environ.update(env)
    fields = {} if precision == "no" else {precision: True}
    if fields:
        with pytest.raises(ValueError, match=f"ds {precision}.enabled=True vs hf {precision}"):
            transformers_deepspeed_config(tmp_path, model, 40)
    expected = transformers_deepspeed_config(tmp_path, model, 40, **fields)
    args = arguments(tmp_path, env)
    assert hflight_deepspeed_config(args, model, 40) == expected
    assert (expected["bf16"]["enabled"], expected["fp16"]["enabled"]) == (precision == "bf16", precision == "fp16")
    assert (args.bf16, args.fp16) == (precision == "bf16", precision == "fp16")


def test_a_deepspeed_file_beside_the_settings_it_holds_is_refused_as_accelerate_refuses_it(tmp_path):
    """An accelerate config naming a DeepSpeed file and a setting the file holds (``mixed_precision: bf16``):
    accelerate's plugin refuses it ("... will be ignored") when transformers' arguments build it, and so when
    hflight's do; the same file with ``--mixed_precision`` on the command line is not refused (the test above)."""
    import transformers

    zero2 = write_configs(tmp_path / "configs")["zero2"]
    config = tmp_path / "zero2_bf16.yaml"
    config.write_text(DEEPSPEED_FIELDS_CONFIG.format(deepspeed=f"  deepspeed_config_file: {zero2}\n", precision="bf16"))
    env = launched_env(["--config_file", str(config), "--main_process_port", "0"])
    assert env["ACCELERATE_CONFIG_DS_FIELDS"] == "deepspeed_config_file,mixed_precision"
    os.environ.update(env)
    with pytest.raises(ValueError, match="will be ignored"):
        transformers.TrainingArguments(output_dir=str(tmp_path / "theirs"), report_to="none")
    with pytest.raises(LauncherEnvironmentError, match="ACCELERATE_DEEPSPEED_CONFIG_FILE=.* will be ignored"):
        arguments(tmp_path, env)


def test_the_launchers_precision_that_transformers_would_lose_under_deepspeed_is_refused(tmp_path):
    """Where transformers trains fp32 whatever the launcher says, hflight refuses, naming the fix: a ``deepspeed``
    config given to the script (transformers fills its precision from ``--bf16`` alone, and accelerate runs no
    autocast under DeepSpeed), and a launched DeepSpeed file that turns bf16 off (accelerate's plugin keeps it off)."""
    import transformers

    zero2 = write_configs(tmp_path / "configs")["zero2"]
    os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16"
    theirs = transformers.TrainingArguments(output_dir=str(tmp_path / "theirs"), report_to="none", deepspeed=str(zero2))
    theirs.deepspeed_plugin.set_mixed_precision(theirs.mixed_precision)  # accelerate's state
    assert theirs.deepspeed_plugin.deepspeed_config["bf16"] == {"enabled": False}
    with pytest.raises(LauncherEnvironmentError, match="ACCELERATE_MIXED_PRECISION='bf16' .* Pass --bf16"):
        arguments(tmp_path, {}, deepspeed=str(zero2))
    off = tmp_path / "bf16_off.json"
    off.write_text(json.dumps({**DEEPSPEED_CONFIGS["zero2"], "bf16": {"enabled": False}}), encoding="utf-8")
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(off)}
    os.environ.update(env)
    assert transformers_deepspeed_config(tmp_path, None, 40)["bf16"] == {"enabled": False}  # trains fp32
    with pytest.raises(LauncherEnvironmentError, match=f"{off}.*bf16.enabled=False.*ACCELERATE_MIXED_PRECISION"):
        arguments(tmp_path, env)


def test_deepspeed_flags_are_the_stage_offload_accumulation_and_clipping(tmp_path):
    """``--use_deepspeed --zero_stage 3 --offload_optimizer_device cpu --gradient_accumulation_steps 4
    --gradient_clipping 0.5 --zero3_save_16bit_model true``: the config accelerate's plugin builds from them; an
    accumulation or clipping that differs from the arguments is transformers' mismatch error, before training."""
    from hflight.arguments.deepspeed import DeepSpeedConfigResolver

    argv = ["--use_deepspeed", "--num_processes", "2", "--main_process_port", "0", "--zero_stage", "3",
            "--offload_optimizer_device", "cpu", "--gradient_accumulation_steps", "4", "--gradient_clipping", "0.5",
            "--zero3_save_16bit_model", "true"]  # fmt: skip
    args = arguments(tmp_path, launched_env(argv), bf16=True)
    zero = args.deepspeed["zero_optimization"]
    assert (zero["stage"], zero["offload_optimizer"]["device"], zero["stage3_gather_16bit_weights_on_model_save"]) == (
        3, "cpu", True)  # fmt: skip
    assert (args.deepspeed["gradient_accumulation_steps"], args.deepspeed["gradient_clipping"]) == (4, 0.5)
    assert args.deepspeed["bf16"] == {"enabled": True}
    resolver = DeepSpeedConfigResolver(args.deepspeed)
    resolver.process(args)
    assert resolver.mismatches == ["- ds gradient_accumulation_steps=4 vs hf gradient_accumulation_steps=1",
                                   "- ds gradient_clipping=0.5 vs hf max_grad_norm=1.0"]  # fmt: skip


@pytest.mark.parametrize("device", ["cpu", "none"])
def test_offload_param_device_is_the_parameter_offload_transformers_trains_with(tmp_path, factory, device):
    """``ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE`` (``--offload_param_device``) with ZeRO-3: the parameters' offload
    device in the config hflight's engine gets, transformers' for the same variables (the whole config compared)."""
    model = factory.cls_model()
    env = launched_env(["--use_deepspeed", "--num_processes", "2", "--main_process_port", "0", "--zero_stage", "3",
                        "--offload_param_device", device])  # fmt: skip
    assert env["ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"] == device
    os.environ.update(env)
    expected = transformers_deepspeed_config(tmp_path, model, 40)
    ours = hflight_deepspeed_config(arguments(tmp_path, env), model, 40)
    assert ours == expected and ours["zero_optimization"]["offload_param"]["device"] == device


@pytest.mark.parametrize("value", ["true", "false"])
def test_zero3_init_flag_is_read_as_accelerate_and_zero3_loading_follows_the_config_as_transformers(tmp_path, value):
    """``ACCELERATE_DEEPSPEED_ZERO3_INIT`` (``--zero3_init_flag``): accelerate's plugin reads it (a value it cannot
    read is refused, naming the variable) for accelerate's own ``zero3_init_context_manager`` and
    ``GatheredParameters``; transformers' ``from_pretrained`` partitions the model under ``deepspeed.zero.Init``
    whenever the arguments' DeepSpeed config is ZeRO-3, whatever the flag says, and does so after hflight's arguments
    as after transformers'."""
    import transformers
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled, unset_hf_deepspeed_config

    env = launched_env(["--use_deepspeed", "--num_processes", "2", "--main_process_port", "0", "--zero_stage", "3",
                        "--zero3_init_flag", value])  # fmt: skip
    assert env["ACCELERATE_DEEPSPEED_ZERO3_INIT"] == value
    os.environ.update(env)
    theirs = transformers.TrainingArguments(output_dir=str(tmp_path / "theirs"), report_to="none")
    assert theirs.deepspeed_plugin.zero3_init_flag is (value == "true") and is_deepspeed_zero3_enabled()
    unset_hf_deepspeed_config()
    ours = arguments(tmp_path, env)
    assert ours.deepspeed["zero_optimization"]["stage"] == 3 and is_deepspeed_zero3_enabled()
    os.environ["ACCELERATE_DEEPSPEED_ZERO3_INIT"] = "maybe"
    with pytest.raises(ValueError, match="invalid truth value maybe"):
        transformers.TrainingArguments(output_dir=str(tmp_path / "theirs"), report_to="none")
    with pytest.raises(LauncherEnvironmentError, match="ACCELERATE_DEEPSPEED_ZERO3_INIT=maybe.*invalid truth value"):
        arguments(tmp_path, {})


def test_a_deepspeed_config_of_its_own_optimizer_is_refused(tmp_path):
    """transformers' own ``ds_config_zero2.json`` names DeepSpeed's AdamW and WarmupLR: refused naming the file."""
    config = tmp_path / "ds_config_zero2.json"
    config.write_text(json.dumps({**DEEPSPEED_CONFIGS["zero2"], **DEEPSPEED_OWN_OPTIMIZER}), encoding="utf-8")
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(config)}
    with pytest.raises(LauncherEnvironmentError, match=f"ACCELERATE_DEEPSPEED_CONFIG_FILE={config}.*'optimizer'"):
        arguments(tmp_path, env)
    env["ACCELERATE_CONFIG_DS_FIELDS"] = "deepspeed_config_file,gradient_accumulation_steps"  # accelerate's own check
    with pytest.raises(LauncherEnvironmentError, match="following accelerate config variables will be ignored"):
        arguments(tmp_path, env)


def test_parallelism_config_variables_are_accelerates_parallelism_config(tmp_path):
    argv = ["--use_fsdp", "--fsdp_version", "2", "--num_processes", "2", "--main_process_port", "0",
            "--use_parallelism_config", "--parallelism_config_dp_shard_size", "2"]  # fmt: skip
    args = arguments(tmp_path, launched_env(argv))
    assert (args.parallelism_config.dp_shard_size, args.parallelism_config.dp_replicate_size) == (2, 1)


def test_debug_mode_checks_collectives_and_cpu_affinity_is_accelerates(tmp_path, monkeypatch):
    """``--debug``: torch's DETAIL debug level (each collective's shapes compared across processes, as accelerate's
    debug mode compares its operations' shapes); ``--enable_cpu_affinity``: accelerate's ``set_numa_affinity``."""
    import accelerate.utils.environment
    import torch.distributed as dist

    pinned: list[int] = []
    monkeypatch.setattr(accelerate.utils.environment, "set_numa_affinity", pinned.append)
    env = launched_env(["--num_processes", "1", "--debug", "--enable_cpu_affinity"])
    assert (env["ACCELERATE_DEBUG_MODE"], env["ACCELERATE_CPU_AFFINITY"]) == ("true", "1")
    arguments(tmp_path, env)
    assert dist.get_debug_level() == dist.DebugLevel.DETAIL and pinned == [0]


def test_the_deepspeed_launcher_is_a_launcher_like_torchrun(monkeypatch, tmp_path):
    """What ``deepspeed.launcher.launch`` sets on node 1 of 2 (two processes each): the ranks, the layout Lightning
    spans, the job, and Lightning's environment with the node's rank from ``CROSS_RANK``."""
    from hflight.arguments.lightning_kwargs import lightning_trainer_kwargs

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    for name, value in {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "CROSS_RANK": "1", "CROSS_SIZE": "2",
                        "LOCAL_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    assert cluster.environment() == "deepspeed"
    assert cluster.ranks() == cluster.Ranks(world_size=4, global_rank=3, local_rank=1, node_rank=1)
    assert cluster.launched_layout() == cluster.Layout(devices=2, num_nodes=2)
    assert cluster.job_identity() == "deepspeed launch at 10.0.0.1:29500"
    args = arguments(tmp_path, {}, local_rank=1)  # deepspeed passes --local_rank=1
    assert (args.world_size, args.process_index, args.local_process_index) == (4, 3, 1)
    (environment,) = lightning_trainer_kwargs(args, [], fitting=False)["plugins"]
    assert (environment.node_rank(), environment.local_rank(), environment.creates_processes_externally) == (1, 1, True)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "accelerate")  # accelerate launch runs DeepSpeed under torchrun
    assert cluster.environment() == "torchelastic"


def test_the_ddp_config_file_leaves_the_arguments_those_of_plain_torchrun(tmp_path):
    """``accelerate launch --config_file ddp.yaml`` (MULTI_GPU, 2 processes): accelerate starts the processes with
    torchrun's code and exports, besides torchrun's variables, mixed precision ``no``, dynamo's defaults and
    ``OMP_NUM_THREADS``: hflight's arguments (every field, the precision) are those of the same script under plain
    torchrun, so the run is DDP across the launched processes as there (tests/test_torchrun_dropin.py)."""
    from hflight.arguments.lightning_kwargs import precision_for

    env = launched_env(["--config_file", str(write_configs(tmp_path / "configs")["ddp"]), "--main_process_port", "0"])
    assert (env["ACCELERATE_MIXED_PRECISION"], env["ACCELERATE_DYNAMO_BACKEND"]) == ("no", "NO")
    plain = hflight.TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none").to_dict()
    launched = arguments(tmp_path, env)
    assert launched.to_dict() == plain and precision_for(launched) == "32-true"


# ---------------------------------------------------------------------- the launches: transformers' and hflight's


ARGS = [
    "--block_size", "16", "--do_train", "--do_eval", "--per_device_train_batch_size", "2",
    "--per_device_eval_batch_size", "4", "--gradient_accumulation_steps", "2", "--learning_rate", "2e-3",
    "--num_train_epochs", "1", "--logging_steps", "1", "--save_steps", "5",
]  # fmt: skip


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict[str, dict[str, Path | AssertionError]]:
    """Every launch at once, one thread per process: name -> {"transformers": output folder, "hflight": ...}, or the
    failure of a job that did not finish (each test then fails on its own jobs: :func:`outputs`)."""
    root = tmp_path_factory.mktemp("accelerate_launch")
    inputs, configs = dropin.clm_inputs(root / "inputs"), write_configs(root / "configs")
    args = ["--model_name_or_path", str(inputs["model"]), "--train_file", str(inputs["train"]),
            "--validation_file", str(inputs["validation"]), *ARGS]  # fmt: skip
    env = {"HF_HOME": str(root / "hf_home")}  # no accelerate config of the user's: only the command's
    launchers = {}
    for name in LAUNCHED:
        launchers[name] = [ACCELERATE, "launch", "--config_file", str(configs[name]), "--main_process_port", "0"]
    jobs = {}
    for name, launcher in launchers.items():
        for library in ("transformers", "hflight"):
            # transformers on this CPU: --use_cpu for its processes to train together, the stand-in for FSDP
            extra = ["--use_cpu"] if library == "transformers" else []
            path = [FSDP_STANDIN] if library == "transformers" and name == "fsdp2" else []
            jobs[name, library] = dropin.Job(root / name / library, "run_clm", dropin.ORIGINAL_IMPORT,
                                             None if library == "transformers" else dropin.CHANGED_IMPORT,
                                             [*args, *extra], launcher=launcher, path=path, env=env)  # fmt: skip
    outs: dict[str, dict[str, Path | AssertionError]] = {}
    for (name, library), job in jobs.items():
        try:
            folder: Path | AssertionError = job.out()
        except AssertionError as failure:  # every job waited for, none left running
            folder = failure
        outs.setdefault(name, {})[library] = folder
    return outs


def outputs(launches: dict, name: str) -> dict[str, Path]:
    """The output folders of launch ``name``, failing with the job's own error where it did not finish."""
    folders = {library: launches[name][library] for library in ("transformers", "hflight")}
    for folder in folders.values():
        if isinstance(folder, AssertionError):
            raise folder
    return folders


def _spans_two(out: Path) -> Path:
    (checkpoint,) = out.glob("checkpoint-*")
    manifest = json.loads((checkpoint / "checkpoint_manifest.json").read_text(encoding="utf-8"))
    assert manifest["run"]["world_size"] == 2
    assert sorted(p.name for p in checkpoint.glob("rng_state*")) == ["rng_state_0.pth", "rng_state_1.pth"]
    return checkpoint


#: config -> the files its strategy writes into a checkpoint (DDP: whole; FSDP2: accelerate's default for
#: ``fsdp_version: 2``, sharded; ZeRO-2: the model whole, the optimizer partitioned; ZeRO-3: both partitioned)
FORMS = {
    "ddp": ("model.safetensors", "optimizer.pt"),
    "fsdp2": ("pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata"),
    "deepspeed_zero2": ("global_step*/mp_rank_00_model_states.pt",
                        "global_step*/zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    "deepspeed_zero3": ("global_step*/zero_pp_rank_1_mp_rank_00_model_states.pt",
                        "global_step*/zero_pp_rank_1_mp_rank_00_optim_states.pt"),
}  # fmt: skip


def _zero3_total_flos(both: dict[str, Path]) -> None:
    """The one difference of the ZeRO-3 runs, outside the launcher: transformers counts ``total_flos`` from the
    parameters the model holds at each step (under ZeRO-3 only those below ``stage3_param_persistence_threshold``
    stay gathered), hflight from the parameters it counted when the Trainer was built (none: ``from_pretrained``
    partitioned them all under ``deepspeed.zero.Init``), so it logs 0. Checked to be that, then set to transformers'
    value in hflight's files so that everything else is compared bit for bit."""
    for name in ("trainer_state.json", *(f"{p.name}/trainer_state.json" for p in both["hflight"].glob("checkpoint-*"))):
        theirs, ours = (json.loads((both[k] / name).read_text(encoding="utf-8")) for k in ("transformers", "hflight"))
        assert ours["total_flos"] == 0 < theirs["total_flos"]
        ours["total_flos"] = theirs["total_flos"]
        for mine, reference in zip(ours["log_history"], theirs["log_history"], strict=True):
            if "total_flos" in mine:
                assert mine["total_flos"] == 0 < reference["total_flos"]
                mine["total_flos"] = reference["total_flos"]
        (both["hflight"] / name).write_text(json.dumps(ours, indent=2), encoding="utf-8")


@pytest.mark.slow
@pytest.mark.subprocess
@pytest.mark.parametrize("config", LAUNCHED)
def test_each_config_file_runs_its_strategy_across_the_launched_processes_with_transformers_numbers(launches, config):
    """``accelerate launch --config_file <config>.yaml run_clm.py``: hflight trains with the strategy the file names,
    over both processes accelerate started (its checkpoint's form and world), and logs transformers' numbers (losses,
    gradient norms, learning rates, metrics) and writes its weights, optimizer states, shards or partitions, bit for
    bit."""
    both = outputs(launches, config)
    if config == "deepspeed_zero3":
        _zero3_total_flos(both)
    checkpoint = _spans_two(both["hflight"])
    assert all(list(checkpoint.glob(pattern)) for pattern in FORMS[config]), sorted(dropin.files(checkpoint))
    dropin.assert_same_results(both, ("eval_results.json", "train_results.json", "all_results.json"))
    dropin.assert_same_log_history(both, min_losses=3)
    assert dropin.assert_same_training_state(both) >= 4
