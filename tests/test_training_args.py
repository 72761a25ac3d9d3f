"""Tests of hflight.training_args: HF parity, parsers, validation, conversion and HF callbacks on our args."""

# ruff: noqa: UP006, UP035

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
import typing
import warnings
from enum import Enum
from pathlib import Path
from typing import Any

import lightning
import pytest
import torch
import transformers
from omegaconf import OmegaConf, ValidationError
from omegaconf.errors import ConfigKeyError
from transformers import HfArgumentParser
from transformers.trainer_callback import (
    DefaultFlowCallback,
    EarlyStoppingCallback,
    PrinterCallback,
    ProgressCallback,
    TrainerControl,
    TrainerState,
)
from transformers.trainer_utils import IntervalStrategy, SaveStrategy, SchedulerType
from transformers.training_args import OptimizerNames

from hflight.arguments.training_args import (
    HFLIGHT_FIELDS,
    LIGHTNING_FIELDS,
    SUPPORTED_ACCELERATORS,
    SUPPORTED_OPTIMIZERS,
    SUPPORTED_TRAIN_SAMPLING_STRATEGIES,
    UNSUPPORTED,
    TrainingArguments,
    coerce_training_args,
    config_schema,
    register_parser_types,
    supported_accelerators,
    supported_optimizers,
    supported_strategies,
)

OUR_FIELDS = [f.name for f in dataclasses.fields(TrainingArguments)]
SHARED_FIELDS = [name for name in OUR_FIELDS if name not in HFLIGHT_FIELDS]


def plain(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, list):
        return [plain(v) for v in value]
    return value


@pytest.fixture(scope="module")
def hf_default() -> transformers.TrainingArguments:
    return transformers.TrainingArguments(output_dir="out")


@pytest.fixture(autouse=True)
def _single_process_env(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK"):
        monkeypatch.delenv(var, raising=False)


# ---------------------------------------------------------------- parity with transformers

HF_FIELDS = {f.name: f for f in dataclasses.fields(transformers.TrainingArguments)}


def test_a_subclass_of_transformers_with_lightnings_four_fields_the_requeue_signal_save_async_and_int8_eval():
    """Every transformers field is ours with the same type, default and help (by construction: a subclass); the
    only fields added are Lightning's four, SLURM's requeue signal (Lightning's SLURMEnvironment argument),
    ``save_async`` (background checkpoint writes, off by default) and ``int8_eval`` (evaluation on an int8 copy of
    the model, off by default)."""
    ours = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    added = [*LIGHTNING_FIELDS, "requeue_signal", "save_async", "remote_output_dir", "storage_options", "int8_eval"]
    assert issubclass(TrainingArguments, transformers.TrainingArguments)
    assert [name for name in ours if name not in HF_FIELDS] == added
    assert list(HFLIGHT_FIELDS) == added
    assert list(ours)[: len(HF_FIELDS)] == list(HF_FIELDS)
    hf_hints, our_hints = (
        typing.get_type_hints(transformers.TrainingArguments),
        typing.get_type_hints(TrainingArguments),
    )
    for name, theirs in HF_FIELDS.items():
        assert our_hints[name] == hf_hints[name], name
        assert ours[name].default == theirs.default and ours[name].default_factory == theirs.default_factory, name
        assert ours[name].metadata == theirs.metadata, name


GUIDE = Path(__file__).resolve().parents[1] / "docs" / "coming-from-transformers.md"


def listed_differences() -> dict[str, str]:
    """docs/coming-from-transformers.md: the table of TrainingArguments differences, ``name -> reason`` (a row may
    name several)."""
    text = GUIDE.read_text(encoding="utf-8")
    section = text.split("## Differences from transformers.TrainingArguments", 1)[1].split("\n#", 1)[0]
    listed = {}
    for names, reason in re.findall(r"^\| ((?:`[\w.]+`(?:, )?)+) \| (.+?) \|\s*$", section, flags=re.M):
        for name in re.findall(r"`([\w.]+)`", names):
            listed[name] = reason
    return listed


def test_every_difference_from_transformers_is_listed_in_the_readme():
    """What hflight's class defines itself (fields, properties, methods) is transformers' own or a README row; the
    fields that raise (UNSUPPORTED) and the narrower choices are rows too."""
    listed = listed_differences()
    assert all(len(reason.split()) >= 4 for reason in listed.values())
    dataclass_machinery = {
        "__init__", "__eq__", "__match_args__", "__dataclass_fields__", "__dataclass_params__", "__doc__",
        "__module__", "__annotations__", "__dict__", "__weakref__", "__hash__", "__repr__", "__post_init__",
        "__firstlineno__", "__static_attributes__", "__qualname__",
        "__slotnames__",  # copyreg's cache, set on the class by the first pickle or deepcopy of an instance
    }  # fmt: skip
    conversions = {"to_transformers", "from_hf", "from_args", "from_config"}  # hflight's additions, documented there
    internal = {"_setup_devices": "device", "_validate_args": "bf16"}  # private overrides, listed by what they change
    own = set(vars(TrainingArguments)) - dataclass_machinery - conversions
    unlisted = sorted(name for name in own if internal.get(name, name) not in listed)
    assert unlisted == [], f"differences missing from docs/coming-from-transformers.md's table: {unlisted}"
    assert set(UNSUPPORTED) <= set(listed)
    assert {"optim", "train_sampling_strategy", *LIGHTNING_FIELDS} <= set(listed)
    inherited = (
        "device", "n_gpu", "train_batch_size", "eval_batch_size", "should_log", "should_save", "place_model_on_device",
        "get_process_log_level", "get_warmup_steps", "to_json_string", "to_sanitized_dict", "set_training",
        "set_evaluate", "set_push_to_hub", "ddp_timeout_delta",
    )  # fmt: skip
    for name in inherited:
        assert inspect.getattr_static(TrainingArguments, name) is inspect.getattr_static(
            transformers.TrainingArguments, name
        ), name


@pytest.mark.parametrize("name", list(HF_FIELDS))
def test_default_equals_transformers(name, hf_default):
    ours = TrainingArguments(output_dir="out")
    assert plain(getattr(ours, name)) == plain(getattr(hf_default, name)) or name == "accelerator_config"
    assert type(plain(getattr(ours, name))) is type(plain(getattr(hf_default, name)))
    assert ours.to_dict()[name] == hf_default.to_dict()[name]


def test_devices_and_processes_as_transformers_on_one_cpu(hf_default):
    ours = TrainingArguments(output_dir="out")
    assert ours.device == hf_default.device == torch.device("cpu")
    assert (ours.n_gpu, ours.parallel_mode, ours.world_size, ours.process_index) == (
        hf_default.n_gpu, hf_default.parallel_mode, hf_default.world_size, hf_default.process_index
    )  # fmt: skip
    assert (ours.train_batch_size, ours.should_log, ours.should_save) == (8, True, True)
    assert TrainingArguments(use_cpu=True).accelerator == "cpu"
    with pytest.raises(ValueError, match="use_cpu=True contradicts accelerator='gpu'"):
        TrainingArguments(use_cpu=True, accelerator="gpu")


@pytest.mark.parametrize("name", LIGHTNING_FIELDS)
def test_lightning_defaults_equal_lightning_trainer(name):
    expected = inspect.signature(lightning.Trainer.__init__).parameters[name].default
    assert getattr(TrainingArguments(), name) == expected


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"debug": "tpu_metrics_debug"}, "debug"),
    ],
)
def test_fields_without_a_lightning_equivalent_raise_naming_them(kwargs, name):
    with pytest.raises(ValueError) as info:
        TrainingArguments(**kwargs)
    assert f"{name}=" in str(info.value) and "have no equivalent on Lightning" in str(info.value)
    TrainingArguments(**{name: getattr(transformers.TrainingArguments(output_dir="o"), name)})  # defaults pass


def test_post_init_converts_to_hf_enums():
    args = TrainingArguments(eval_strategy="epoch", save_strategy="best", lr_scheduler_type="cosine", optim="sgd")
    assert args.eval_strategy is IntervalStrategy.EPOCH
    assert args.logging_strategy is IntervalStrategy.STEPS
    assert args.save_strategy is SaveStrategy.BEST
    assert args.lr_scheduler_type is SchedulerType.COSINE
    assert args.optim is OptimizerNames.SGD
    assert args.do_eval is True
    # Enum members and the names OmegaConf writes are accepted too.
    assert TrainingArguments(eval_strategy=IntervalStrategy.STEPS).eval_strategy is IntervalStrategy.STEPS
    assert TrainingArguments(save_strategy="SaveStrategy.EPOCH").save_strategy is SaveStrategy.EPOCH


def test_derived_values_as_transformers():
    args = TrainingArguments(eval_strategy="steps", logging_steps=50)
    assert args.eval_steps == 50
    best = TrainingArguments(load_best_model_at_end=True, eval_strategy="epoch", save_strategy="epoch")
    assert best.metric_for_best_model == "loss" and best.greater_is_better is False
    acc = TrainingArguments(metric_for_best_model="accuracy")
    assert acc.greater_is_better is True
    plateau = TrainingArguments(lr_scheduler_type="reduce_lr_on_plateau", eval_strategy="epoch")
    assert plateau.metric_for_best_model == "loss"
    assert TrainingArguments(save_steps=1000.0).save_steps == 1000 and isinstance(
        TrainingArguments(save_steps=1000.0).save_steps, int
    )
    assert TrainingArguments(logging_steps=0.1).logging_steps == 0.1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"eval_strategy": "steps", "eval_steps": 100, "save_strategy": "steps", "save_steps": 300},
        {"eval_strategy": "steps", "eval_steps": 0.1, "save_strategy": "steps", "save_steps": 0.3},
        {"eval_strategy": "epoch", "save_strategy": "best"},
    ],
)
def test_load_best_model_at_end_valid_combinations_match_hf(kwargs):
    ours = TrainingArguments(load_best_model_at_end=True, **kwargs)
    hf = transformers.TrainingArguments(output_dir="out", load_best_model_at_end=True, **kwargs)
    for name in ("eval_steps", "save_steps", "metric_for_best_model", "greater_is_better"):
        assert getattr(ours, name) == getattr(hf, name)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"eval_strategy": "epoch", "save_strategy": "steps"}, "save and eval strategy to match"),
        ({"eval_strategy": "steps", "eval_steps": 100, "save_strategy": "steps", "save_steps": 250}, "round multiple"),
        ({"eval_strategy": "steps", "eval_steps": 0.1, "save_strategy": "steps", "save_steps": 500}, "mixing ratio"),
        ({"eval_strategy": "steps", "eval_steps": 0.2, "save_strategy": "steps", "save_steps": 0.3}, "not a multiple"),
    ],
)
def test_load_best_model_at_end_errors_like_hf(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainingArguments(load_best_model_at_end=True, **kwargs)
    with pytest.raises(ValueError):
        transformers.TrainingArguments(output_dir="out", load_best_model_at_end=True, **kwargs)


def test_gradient_checkpointing_is_a_deprecated_alias():
    with pytest.warns(FutureWarning, match="activation_checkpointing"):
        args = TrainingArguments(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    assert args.activation_checkpointing is True and args.gradient_checkpointing is True
    assert args.activation_checkpointing_kwargs == {"use_reentrant": False}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert TrainingArguments(activation_checkpointing=True).gradient_checkpointing is True


def test_normalisations():
    assert TrainingArguments(report_to="none").report_to == []
    assert TrainingArguments(report_to=None).report_to == []
    assert TrainingArguments(report_to="wandb, tensorboard").report_to == ["wandb", "tensorboard"]
    assert TrainingArguments(report_to=["tensorboard"]).report_to == ["tensorboard"]
    from transformers.integrations import get_available_reporting_integrations

    assert TrainingArguments(report_to="all").report_to == get_available_reporting_integrations()
    assert TrainingArguments(devices="2").devices == 2
    assert TrainingArguments(devices=4).devices == 4
    assert TrainingArguments(devices="-1").devices == -1
    assert TrainingArguments(devices="0,1").devices == "0,1"
    assert TrainingArguments(devices=[0, 1]).devices == [0, 1]
    assert TrainingArguments(include_num_input_tokens_seen=True).include_num_input_tokens_seen == "all"
    assert TrainingArguments(include_num_input_tokens_seen=False).include_num_input_tokens_seen == "no"
    assert TrainingArguments(lr_scheduler_kwargs='{"min_lr": "1e-6"}').lr_scheduler_kwargs == {"min_lr": "1e-6"}
    assert TrainingArguments(lr_scheduler_kwargs='{"num_cycles": "2"}').lr_scheduler_kwargs == {"num_cycles": 2}
    assert TrainingArguments(warmup_steps=10.0).warmup_steps == 10
    assert TrainingArguments(output_dir="~/x").output_dir.endswith("/x")
    assert TrainingArguments(output_dir=Path("~/x")).output_dir == os.path.expanduser("~/x")  # a str, as transformers'
    assert TrainingArguments(resume_from_checkpoint=Path("run/ckpt")).resume_from_checkpoint == "run/ckpt"
    assert TrainingArguments(fp16=0, ddp_find_unused_parameters=1).ddp_find_unused_parameters is True  # as flags
    assert TrainingArguments().output_dir == "trainer_output"
    assert TrainingArguments(learning_rate="1e-3", per_device_train_batch_size="4", fp16="false").learning_rate == 1e-3


def test_lightning_objects_accepted_for_accelerator_and_strategy():
    from lightning.pytorch.accelerators import CPUAccelerator
    from lightning.pytorch.strategies import SingleDeviceStrategy

    args = TrainingArguments(accelerator=CPUAccelerator(), strategy=SingleDeviceStrategy(device="cpu"))
    assert isinstance(args.strategy, SingleDeviceStrategy)
    d = args.to_dict()
    assert d["accelerator"] == "CPUAccelerator" and d["strategy"] == "SingleDeviceStrategy"
    json.dumps(d)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs, field, choice",
    [
        ({"lr_scheduler_type": "cosine_annealing"}, "lr_scheduler_type", "cosine_with_restarts"),
        ({"optim": "adamw_bnb_4bit"}, "optim", "adafactor"),
        ({"optim": "lion"}, "optim", "rmsprop"),
        ({"train_sampling_strategy": "shuffle"}, "train_sampling_strategy", "group_by_length"),
        ({"eval_strategy": "sometimes"}, "eval_strategy", "epoch"),
        ({"save_strategy": "always"}, "save_strategy", "best"),
        ({"logging_strategy": "best"}, "logging_strategy", "steps"),
        ({"strategy": "ddp_magic"}, "strategy", "ddp_spawn"),
        ({"accelerator": "quantum"}, "accelerator", "mps"),
        ({"log_level": "loud"}, "log_level", "passive"),
        ({"include_num_input_tokens_seen": "some"}, "include_num_input_tokens_seen", "non_padding"),
    ],
)
def test_unknown_choice_names_field_and_lists_choices(kwargs, field, choice):
    with pytest.raises(ValueError) as info:
        TrainingArguments(**kwargs)
    message = str(info.value)
    assert field in message and choice in message and repr(kwargs[field]) in message


def test_choice_tables():
    assert SUPPORTED_OPTIMIZERS == tuple(o.value for o in OptimizerNames)  # transformers' whole menu
    assert SUPPORTED_TRAIN_SAMPLING_STRATEGIES == ("random", "sequential", "group_by_length")
    assert {"auto", "ddp", "fsdp"} <= set(supported_strategies())
    # hflight's backends join Lightning's registries when hflight is imported
    assert {"ipu", "ort"} <= set(supported_strategies()) and "ipu" in supported_accelerators()
    assert "adamw_ort_fused" in supported_optimizers()
    for name in ("ddp", "fsdp", "deepspeed_stage_2", "ipu", "ort"):
        assert TrainingArguments(strategy=name).strategy == name
    for name in (*SUPPORTED_ACCELERATORS, "ipu"):
        assert TrainingArguments(accelerator=name).accelerator == name
    with pytest.raises(ValueError, match="Unknown accelerator 'ipx'.*ipu"):
        TrainingArguments(accelerator="ipx")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"fp16": True, "bf16": True}, "fp16 and bf16"),
        ({"per_device_train_batch_size": 0}, "per_device_train_batch_size"),
        ({"per_device_eval_batch_size": -2}, "per_device_eval_batch_size"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
        ({"eval_accumulation_steps": 0}, "eval_accumulation_steps"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"num_nodes": 0}, "num_nodes"),
        ({"logging_steps": 0}, "logging_steps"),
        ({"logging_steps": 10.5}, "logging_steps must be an integer"),
        ({"eval_strategy": "steps", "eval_steps": 2.5}, "eval_steps must be an integer"),
        ({"eval_strategy": "steps", "logging_strategy": "epoch", "logging_steps": 0}, "eval_steps or --logging_steps"),
        ({"lr_scheduler_type": "reduce_lr_on_plateau"}, "requires an eval strategy"),
        ({"dataloader_prefetch_factor": 2}, "dataloader_prefetch_factor"),
        # transformers' own isinstance(int) check: a float is not converted to an int before it
        ({"torch_empty_cache_steps": 1.0}, "torch_empty_cache_steps"),
        ({"torch_empty_cache_steps": "none"}, "torch_empty_cache_steps"),
    ],
)
def test_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainingArguments(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field, expected",
    [
        ({"learning_rate": "fast"}, "learning_rate", "float"),
        ({"num_train_epochs": None}, "num_train_epochs", "float"),
        ({"per_device_train_batch_size": 2.5}, "per_device_train_batch_size", "int"),
        ({"per_device_train_batch_size": True}, "per_device_train_batch_size", "int"),
        ({"fp16": "maybe"}, "fp16", "bool"),
        ({"greater_is_better": 2}, "greater_is_better", "bool or None"),
        ({"seed": [1]}, "seed", "int"),
        ({"data_seed": "x"}, "data_seed", "int or None"),
        ({"label_names": "labels"}, "label_names", "list[str] or None"),
        ({"include_for_metrics": ["inputs", 3]}, "include_for_metrics", "list[str]"),
        ({"lr_scheduler_kwargs": [1]}, "lr_scheduler_kwargs", "dict or str or None"),
        ({"lr_scheduler_kwargs": "not json"}, "lr_scheduler_kwargs", "JSON"),
        ({"output_dir": 5}, "output_dir", "str or None"),
        ({"push_to_hub": "sometimes"}, "push_to_hub", "bool"),
        ({"ddp_timeout": "long"}, "ddp_timeout", "int"),
        ({"devices": 1.5}, "devices", "str or int"),
        ({"strategy": 3}, "strategy", "Strategy"),
    ],
)
def test_type_errors_name_field_type_and_value(kwargs, field, expected):
    with pytest.raises(TypeError) as info:
        TrainingArguments(**kwargs)
    assert isinstance(info.value, ValueError)  # as transformers' checks raise for such values
    message = str(info.value)
    assert field in message and expected in message and repr(kwargs[field]) in message


# ---------------------------------------------------------------- parsers


def test_hf_argument_parser_round_trip():
    parser = HfArgumentParser(TrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(
        [
            "--output_dir", "o", "--learning_rate", "1e-3", "--eval_strategy", "steps", "--eval_steps", "20",
            "--warmup_steps", "0.1", "--report_to", "tensorboard", "--devices", "2", "--strategy", "ddp",
            "--no_dataloader_pin_memory", "--activation_checkpointing", "--optim", "sgd",
            "--lr_scheduler_kwargs", '{"min_lr": 1e-6}', "--label_names", "start_positions", "end_positions",
            "--debug", "underflow_overflow", "--ddp_timeout", "60", "--push_to_hub", "--hub_model_id", "me/run",
        ]
    )  # fmt: skip
    assert args.learning_rate == 1e-3 and args.eval_strategy is IntervalStrategy.STEPS and args.eval_steps == 20
    assert args.warmup_steps == 0.1 and args.report_to == ["tensorboard"] and args.devices == 2
    assert args.dataloader_pin_memory is False and args.activation_checkpointing is True
    assert args.optim is OptimizerNames.SGD and args.lr_scheduler_kwargs == {"min_lr": 1e-6}
    assert args.label_names == ["start_positions", "end_positions"]
    assert args.debug == ["underflow_overflow"] and args.ddp_timeout == 60 and args.push_to_hub is True
    # parse_dict of to_dict gives the same arguments back (to_dict hides tokens, as transformers').
    (again,) = HfArgumentParser(TrainingArguments).parse_dict({**args.to_dict(), "hub_token": None})
    assert again == args
    (default,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses([])
    assert default == TrainingArguments()
    (flags,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        ["--include_num_input_tokens_seen", "--fp16", "--disable_tqdm", "true"]
    )
    assert flags.include_num_input_tokens_seen == "all" and flags.fp16 is True and flags.disable_tqdm is True
    assert register_parser_types(parser) is parser  # kept for older scripts; nothing left to register


def test_hf_argument_parser_rejects_unknown_choice():
    with pytest.raises(SystemExit):
        HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(["--train_sampling_strategy", "shuffle"])


def test_hydra_schema_has_every_field_typed_for_omegaconf():
    schema = config_schema()
    assert [f.name for f in dataclasses.fields(schema)] == [
        f.name for f in dataclasses.fields(TrainingArguments) if f.init
    ]
    cfg = OmegaConf.structured(schema)
    assert cfg.learning_rate == 5e-5 and cfg.devices == "auto" and cfg.report_to == "none"
    assert cfg.eval_strategy == "no" and cfg.hub_strategy == "every_save" and cfg.push_to_hub is False
    assert TrainingArguments.from_config(cfg) == TrainingArguments()
    override = OmegaConf.create(
        {"eval_strategy": "steps", "devices": 2, "report_to": ["tensorboard"], "lr_scheduler_kwargs": {"power": 2.0}}
    )
    args = TrainingArguments.from_config(OmegaConf.merge(cfg, override))
    assert args.eval_strategy is IntervalStrategy.STEPS and args.devices == 2
    assert args.report_to == ["tensorboard"] and args.lr_scheduler_kwargs == {"power": 2.0}
    # Values straight from a DictConfig (Hydra's `instantiate` without conversion) are accepted.
    node = OmegaConf.create({"label_names": ["labels"], "lr_scheduler_kwargs": {"power": 2.0}})
    assert TrainingArguments(**node).label_names == ["labels"]
    with pytest.raises(ValidationError, match="learning_rate"):
        OmegaConf.merge(cfg, {"learning_rate": "fast"})
    with pytest.raises(ConfigKeyError, match="learnin_rate"):
        OmegaConf.merge(cfg, {"learnin_rate": 1e-3})


# ---------------------------------------------------------------- conversion from transformers


def test_from_hf_default_converts_cleanly(hf_default):
    args = TrainingArguments.from_hf(hf_default)
    assert args == TrainingArguments(output_dir="out")
    assert coerce_training_args(hf_default) == args


def test_from_hf_carries_every_value():
    with pytest.warns(FutureWarning, match="gradient_checkpointing"):
        hf = transformers.TrainingArguments(
            output_dir="o",
            learning_rate=1e-3,
            eval_strategy="steps",
            eval_steps=7,
            warmup_steps=0.1,
            lr_scheduler_type="cosine",
            optim="adafactor",
            label_names=["labels"],
            train_sampling_strategy="group_by_length",
            gradient_checkpointing=True,
            report_to="tensorboard",
            use_cpu=True,
            debug="underflow_overflow",
            ddp_timeout=60,
            neftune_noise_alpha=5.0,
            push_to_hub=True,
            hub_model_id="me/run",
        )
    args = coerce_training_args(hf)
    assert args.learning_rate == 1e-3 and args.eval_strategy is IntervalStrategy.STEPS and args.eval_steps == 7
    assert args.warmup_steps == 0.1 and args.lr_scheduler_type is SchedulerType.COSINE
    assert args.optim is OptimizerNames.ADAFACTOR and args.label_names == ["labels"]
    assert args.train_sampling_strategy == "group_by_length" and args.activation_checkpointing is True
    assert args.report_to == ["tensorboard"] and args.accelerator == "cpu" and args.do_eval is True
    assert (args.devices, args.strategy, args.num_nodes) == ("auto", "auto", 1)
    assert args.to_dict() == {**hf.to_dict(), **{name: getattr(args, name) for name in HFLIGHT_FIELDS}}
    assert args.to_transformers().to_dict() == hf.to_dict()


def test_from_hf_keeps_a_subclass_s_own_fields():
    hf = transformers.Seq2SeqTrainingArguments(output_dir="o", predict_with_generate=True, generation_max_length=7)
    args = coerce_training_args(hf)
    assert args.predict_with_generate is True and args.generation_max_length == 7


def test_from_hf_rejects_fields_without_a_lightning_equivalent():
    hf = transformers.TrainingArguments(output_dir="o", debug="tpu_metrics_debug")
    with pytest.raises(ValueError) as info:
        coerce_training_args(hf)
    assert "debug=" in str(info.value)
    # the optimizer menu's fields are honoured (tests/test_optimizers.py)
    hf = transformers.TrainingArguments(output_dir="o", optim="galore_adamw", optim_target_modules=["attn"])
    assert coerce_training_args(hf).optim_target_modules == ["attn"]


def test_from_hf_tolerates_values_hf_derives(monkeypatch):
    # torch_compile makes transformers fill in torch_compile_backend; accelerate's config is filled in too.
    hf = transformers.TrainingArguments(output_dir="o", torch_compile=True)
    assert hf.torch_compile_backend is not None
    args = coerce_training_args(hf)
    assert args.torch_compile is True and args.torch_compile_backend == hf.torch_compile_backend


def test_from_hf_unsupported_choice_fails_naming_field():
    hf = transformers.TrainingArguments(output_dir="o", train_sampling_strategy="batch_rebalance")
    with pytest.raises(ValueError, match="train_sampling_strategy"):
        coerce_training_args(hf)


def test_coerce_training_args_other_inputs():
    ours = TrainingArguments(output_dir="mine")
    assert coerce_training_args(ours) is ours
    assert coerce_training_args(None).output_dir == "tmp_trainer"
    with pytest.raises(TypeError, match="dict"):
        coerce_training_args({"output_dir": "x"})
    with pytest.raises(TypeError):
        TrainingArguments.from_hf(ours)


def test_to_transformers_is_a_plain_transformers_instance():
    args = TrainingArguments(output_dir="o", learning_rate=1e-3, strategy="ddp", devices=2, push_to_hub=True)
    plain_args = args.to_transformers()
    assert type(plain_args) is transformers.TrainingArguments
    assert plain_args.to_dict() == {k: v for k, v in args.to_dict().items() if k not in HFLIGHT_FIELDS}
    assert not any(hasattr(plain_args, name) for name in HFLIGHT_FIELDS)


# ---------------------------------------------------------------- transformers' callbacks and state on our args


def _state(args: TrainingArguments, max_steps: int, step: int) -> TrainerState:
    state = TrainerState()
    state.compute_steps(args, max_steps)
    state.max_steps = max_steps
    state.global_step = step
    return state


def test_compute_steps_absolute_and_ratio():
    state = _state(TrainingArguments(logging_steps=0.1, eval_strategy="steps", save_steps=0.25), 1000, 0)
    assert (state.logging_steps, state.eval_steps, state.save_steps) == (100, 100, 250)
    state = _state(TrainingArguments(logging_steps=10, eval_strategy="steps", eval_steps=30), 1000, 0)
    assert (state.logging_steps, state.eval_steps, state.save_steps) == (10, 30, 500)


def test_default_flow_callback_on_step_end():
    args = TrainingArguments(logging_steps=10, eval_strategy="steps", eval_steps=20, save_steps=40)
    flow = DefaultFlowCallback()
    control = flow.on_step_end(args, _state(args, 100, 10), TrainerControl())
    assert control.should_log and not control.should_evaluate and not control.should_save
    control = flow.on_step_end(args, _state(args, 100, 40), TrainerControl())
    assert control.should_log and control.should_evaluate and control.should_save
    control = flow.on_step_end(args, _state(args, 100, 3), TrainerControl())
    assert not (control.should_log or control.should_evaluate or control.should_save)
    first = TrainingArguments(logging_first_step=True)
    assert flow.on_step_end(first, _state(first, 100, 1), TrainerControl()).should_log
    end = flow.on_step_end(args, _state(args, 100, 100), TrainerControl())
    assert end.should_training_stop and end.should_save and end.should_evaluate
    delayed = TrainingArguments(eval_strategy="steps", eval_steps=10, eval_delay=50)
    assert not flow.on_step_end(delayed, _state(delayed, 100, 20), TrainerControl()).should_evaluate


def test_default_flow_callback_on_epoch_end():
    args = TrainingArguments(logging_strategy="epoch", eval_strategy="epoch", save_strategy="epoch")
    state = _state(args, 100, 50)
    state.epoch = 1.0
    control = DefaultFlowCallback().on_epoch_end(args, state, TrainerControl())
    assert control.should_log and control.should_evaluate and control.should_save


def test_early_stopping_callback_on_our_args():
    args = TrainingArguments(
        load_best_model_at_end=True, eval_strategy="epoch", save_strategy="epoch", metric_for_best_model="accuracy"
    )
    callback = EarlyStoppingCallback(early_stopping_patience=1)
    state, control = _state(args, 100, 10), TrainerControl()
    callback.on_train_begin(args, state, control)
    callback.on_evaluate(args, state, control, metrics={"eval_accuracy": 0.5})
    state.best_metric = 0.5
    callback.on_evaluate(args, state, control, metrics={"eval_accuracy": 0.4})
    assert control.should_training_stop


def test_progress_and_printer_callbacks_on_our_args(capsys):
    args = TrainingArguments(disable_tqdm=True)
    state = _state(args, 10, 0)
    state.is_world_process_zero = state.is_local_process_zero = True
    progress = ProgressCallback()
    progress.on_train_begin(args, state, TrainerControl())
    progress.on_step_end(args, state, TrainerControl())
    progress.on_log(args, state, TrainerControl(), logs={"loss": 1.0})
    progress.on_train_end(args, state, TrainerControl())
    PrinterCallback().on_log(args, state, TrainerControl(), logs={"loss": 1.0})
    assert "loss" in capsys.readouterr().out


# ---------------------------------------------------------------- methods and properties


@pytest.mark.parametrize("warmup", [0, 5, 10.0, 0.1, 0.05, 0.999])
@pytest.mark.parametrize("total", [1, 33, 1000])
def test_get_warmup_steps_equals_hf(warmup, total):
    assert TrainingArguments(warmup_steps=warmup).get_warmup_steps(total) == _hf_warmup(warmup, total)


def _hf_warmup(warmup, total):
    # HF's method only reads self.warmup_steps; call it unbound on a stand-in rather than building HF args per case.
    class _Stub:
        warmup_steps = warmup

    return transformers.TrainingArguments.get_warmup_steps(_Stub(), total)


def test_to_dict_and_json_are_serialisable():
    args = TrainingArguments(
        eval_strategy="steps", save_strategy="best", lr_scheduler_kwargs={"power": 2.0}, report_to="tensorboard"
    )
    d = args.to_dict()
    assert d["eval_strategy"] == "steps" and d["save_strategy"] == "best" and d["optim"] == args.optim.value
    assert json.loads(args.to_json_string()) == d
    assert TrainingArguments(**{**d, "hub_token": None}) == args  # to_dict hides tokens, as transformers' does
    sanitized = args.to_sanitized_dict()
    assert sanitized["train_batch_size"] == 8 and sanitized["eval_batch_size"] == 8
    assert all(type(v) in (bool, int, float, str) for v in sanitized.values())
    json.dumps(sanitized)


def test_dataclasses_replace_reruns_post_init():
    args = TrainingArguments(eval_strategy="steps", logging_steps=10)
    changed = dataclasses.replace(args, learning_rate=1e-3)
    assert (
        changed.learning_rate == 1e-3 and changed.eval_strategy is IntervalStrategy.STEPS and changed.eval_steps == 10
    )
    with pytest.raises(ValueError, match="optim"):
        dataclasses.replace(args, optim="nope")


def test_single_process_properties():
    args = TrainingArguments(per_device_train_batch_size=4, per_device_eval_batch_size=16)
    assert (args.train_batch_size, args.eval_batch_size) == (4, 16)
    assert (args.world_size, args.process_index, args.local_process_index) == (1, 0, 0)
    assert args.should_log and args.should_save
    with args.main_process_first(desc="test"):
        pass
    assert isinstance(args.get_process_log_level(), int)


def test_torchrun_env_properties(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    args = TrainingArguments()
    assert (args.world_size, args.process_index, args.local_process_index) == (4, 3, 1)
    assert not args.should_log and not args.should_save


def test_lightning_env_properties(monkeypatch):
    # Lightning's launcher sets WORLD_SIZE, NODE_RANK and LOCAL_RANK but no RANK.
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("NODE_RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    args = TrainingArguments(num_nodes=2, devices=2)
    assert (args.world_size, args.process_index, args.local_process_index) == (4, 2, 0)
    assert args.should_log and not args.should_save
