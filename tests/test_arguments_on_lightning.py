"""transformers' training arguments that hflight makes work on Lightning (issue 16, point 1), each compared with
transformers.Trainer on the same model and data where both can run here (CPU): auto_find_batch_size, neftune,
debug=underflow_overflow, torch_empty_cache_steps, use_cache, bf16_full_eval, torch_compile, dataloader settings,
log_level_replica/save_on_each_node, eval_use_gather_object, and the ddp_*/fsdp/deepspeed arguments as Lightning
strategies."""

from __future__ import annotations

import datetime

import pytest
import torch
import transformers
from transformers.debug_utils import DebugUnderflowOverflow

import hflight
from hflight.arguments import lightning_kwargs
from hflight.arguments import strategies as strategy_settings
from hflight.run.distributed import join_parts
from hflight.trainer import memory

PAIRS = (
    ("hf", transformers.Trainer, transformers.TrainingArguments),
    ("hl", hflight.Trainer, hflight.TrainingArguments),
)


def _losses(trainer) -> list[float]:
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def _train_both(tmp_path, factory, model_fn, dataset_fn, **args):
    trainers = {}
    for name, trainer_cls, args_cls in PAIRS:
        trainer = trainer_cls(
            model=model_fn(),
            args=args_cls(output_dir=str(tmp_path / name), **factory.pair_args(**args)),
            train_dataset=dataset_fn(),
        )
        trainer.train()
        trainers[name] = trainer
    return trainers


# ---- auto_find_batch_size ------------------------------------------------------------------------------------------
class _SmallMemoryModel(transformers.BertForSequenceClassification):
    """Runs out of memory (as CUDA reports it) on batches of more than ``limit`` samples."""

    limit = 11

    def forward(self, input_ids=None, attention_mask=None, labels=None):
        if input_ids is not None and input_ids.shape[0] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (stand-in for a small GPU)")
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def test_auto_find_batch_size_shrinks_the_batch_as_transformers(tmp_path, factory):
    def model():
        torch.manual_seed(0)
        return _SmallMemoryModel(factory.config(num_labels=3))

    trainers = _train_both(
        tmp_path,
        factory,
        model,
        lambda: factory.cls_dataset(40),
        auto_find_batch_size=True,
        per_device_train_batch_size=16,
    )
    hf, hl = trainers["hf"], trainers["hl"]
    assert hf.state.train_batch_size == hl.state.train_batch_size == 10  # 16 -> 14 -> 12 -> 10 (90% each time)
    assert _losses(hl) == pytest.approx(_losses(hf), rel=1e-5)
    assert hl.state.global_step == hf.state.global_step


def test_auto_find_batch_size_off_reports_the_error(tmp_path, factory):
    torch.manual_seed(0)
    args = hflight.TrainingArguments(str(tmp_path), **factory.pair_args(per_device_train_batch_size=16))
    trainer = hflight.Trainer(
        _SmallMemoryModel(factory.config(num_labels=3)), args, train_dataset=factory.cls_dataset(40)
    )
    with pytest.raises(torch.OutOfMemoryError):
        trainer.train()


def test_find_executable_batch_size_gives_up_at_zero_and_passes_other_errors():
    sizes = []

    def always_out_of_memory(batch_size):
        sizes.append(batch_size)
        raise RuntimeError("CUDA out of memory. Tried to allocate 1 GiB")

    with pytest.raises(RuntimeError, match="No executable batch size found, reached zero"):
        memory.find_executable_batch_size(always_out_of_memory, 4, enabled=True)
    assert sizes == [4, 3, 2, 1]
    with pytest.raises(ValueError, match="unrelated"):
        memory.find_executable_batch_size(lambda b: (_ for _ in ()).throw(ValueError("unrelated")), 8, enabled=True)
    assert memory.is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried 1 TB"))
    assert not memory.is_out_of_memory(RuntimeError("shape mismatch"))


# ---- neftune, debug, empty cache -----------------------------------------------------------------------------------
def test_neftune_noise_trains_as_transformers_and_is_removed_after(tmp_path, factory):
    trainers = _train_both(
        tmp_path, factory, factory.cls_model, lambda: factory.cls_dataset(16), neftune_noise_alpha=5.0
    )
    hf, hl = trainers["hf"], trainers["hl"]
    assert _losses(hl) == pytest.approx(_losses(hf), rel=1e-6)
    plain = _train_both(tmp_path / "plain", factory, factory.cls_model, lambda: factory.cls_dataset(16))["hl"]
    assert _losses(hl)[1:] != pytest.approx(_losses(plain)[1:], rel=1e-6)  # the noise changed training
    embeddings = hl.model.get_input_embeddings()
    assert not embeddings._forward_hooks  # removed when train() returned, as transformers removes it
    assert hl.neftune_noise_alpha == 5.0


def test_debug_underflow_overflow_reports_the_first_inf_as_transformers(tmp_path, factory):
    errors = {}
    for name, trainer_cls, args_cls in PAIRS:
        model = factory.cls_model()
        with torch.no_grad():
            model.bert.encoder.layer[1].output.dense.weight[0, 0] = float("inf")
        args = args_cls(str(tmp_path / name), **factory.pair_args(debug="underflow_overflow"))
        trainer = trainer_cls(model, args, train_dataset=factory.cls_dataset(8))
        with pytest.raises(ValueError) as info:
            trainer.train()
        errors[name] = str(info.value)
        assert any(
            isinstance(getattr(h, "__self__", None), DebugUnderflowOverflow) for h in model._forward_hooks.values()
        )
    assert "inf/nan detected" in errors["hl"] and errors["hl"] == errors["hf"]


def test_torch_empty_cache_steps_empties_when_transformers_does(tmp_path, factory, monkeypatch):
    calls = {"hf": [], "hl": []}
    current = {}
    monkeypatch.setattr(
        transformers.trainer, "clear_device_cache", lambda *a, **k: calls["hf"].append(current["t"].state.global_step)
    )
    monkeypatch.setattr(memory, "empty_device_cache", lambda: calls["hl"].append(current["t"].state.global_step))
    for name, trainer_cls, args_cls in PAIRS:
        args = args_cls(
            str(tmp_path / name), **factory.pair_args(torch_empty_cache_steps=2, gradient_accumulation_steps=2)
        )
        current["t"] = trainer_cls(factory.cls_model(), args, train_dataset=factory.cls_dataset(24))
        current["t"].train()
    assert calls["hl"] == calls["hf"] and calls["hl"]  # per micro-batch, on the steps divisible by 2


def test_use_cache_is_written_to_the_model_config(tmp_path, factory):
    for value in (False, True):
        hf_model, hl_model = factory.cls_model(), factory.cls_model()
        transformers.Trainer(hf_model, transformers.TrainingArguments(str(tmp_path), use_cache=value, report_to="none"))
        hflight.Trainer(hl_model, hflight.TrainingArguments(str(tmp_path), use_cache=value, report_to="none"))
        assert hl_model.config.use_cache is hf_model.config.use_cache is value


def test_bf16_full_eval_evaluates_in_bfloat16_as_transformers(tmp_path, factory):
    results = {}
    for name, trainer_cls, args_cls in PAIRS:
        model = factory.cls_model()
        args = args_cls(str(tmp_path / name), **factory.pair_args(bf16_full_eval=True, use_cpu=True))
        results[name] = trainer_cls(model, args, eval_dataset=factory.cls_dataset(16)).evaluate()["eval_loss"]
        assert next(model.parameters()).dtype == torch.bfloat16  # as transformers, the model stays cast
    assert results["hl"] == pytest.approx(results["hf"], rel=1e-3)


_COMPILE_JOB = """
import json, sys
import torch, torch._dynamo
sys.path.insert(0, sys.argv[2])
from support import Factory
import hflight

result = {}
for compile in (False, True):
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    extra = dict(torch_compile=True, torch_compile_backend="eager") if compile else {}
    args = hflight.TrainingArguments(f"{sys.argv[1]}/{compile}", **Factory.pair_args(**extra))
    trainer = hflight.Trainer(Factory.cls_model(), args, train_dataset=Factory.cls_dataset(16))
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    result[str(compile)] = dict(frames=torch._dynamo.utils.counters["frames"]["ok"], losses=losses)
print(json.dumps(result))
"""


@pytest.mark.subprocess
def test_torch_compile_trains_through_the_compiled_model(tmp_path):
    """In a process where only hflight trains (transformers' own compile cannot count), dynamo compiles frames with
    torch_compile=True and none without, and the compiled run's losses are the plain run's."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    job = subprocess.run(
        [sys.executable, "-c", _COMPILE_JOB, str(tmp_path), str(Path(__file__).parent)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert job.returncode == 0, job.stderr[-3000:]
    result = json.loads(job.stdout.strip().splitlines()[-1])
    assert result["False"]["frames"] == 0
    assert result["True"]["frames"] > 0  # dynamo traced hflight's training forward
    assert result["True"]["losses"] == pytest.approx(result["False"]["losses"], rel=1e-5)
    assert len(result["True"]["losses"]) == 4


# ---- data loading, processes --------------------------------------------------------------------------------------
def test_dataloader_multiprocessing_context_and_order_reach_the_loader(tmp_path, factory):
    args = hflight.TrainingArguments(
        str(tmp_path), dataloader_num_workers=2, dataloader_multiprocessing_context="spawn",
        dataloader_in_order=False, report_to="none",
    )  # fmt: skip
    loader = hflight.Trainer(factory.cls_model(), args, train_dataset=factory.cls_dataset(8)).get_train_dataloader()
    assert loader.multiprocessing_context.get_start_method() == "spawn" and loader.in_order is False


@pytest.mark.parametrize("persistent, workers", [(True, 2), (True, 0), (False, 2)])
def test_dataloader_persistent_workers_as_transformers(tmp_path, factory, persistent, workers):
    """Workers kept between epochs, in the training and the evaluation loader; asked for without workers, torch's
    DataLoader refuses it for both trainers (hflight used to drop it silently)."""
    seen = {}
    for name, trainer_cls, args_cls in PAIRS:
        args = args_cls(
            str(tmp_path / name), dataloader_num_workers=workers, dataloader_persistent_workers=persistent,
            report_to="none", use_cpu=True,
        )  # fmt: skip
        trainer = trainer_cls(factory.cls_model(), args, train_dataset=factory.cls_dataset(8))
        try:
            loaders = trainer.get_train_dataloader(), trainer.get_eval_dataloader(factory.cls_dataset(4))
            seen[name] = [(loader.num_workers, loader.persistent_workers) for loader in loaders]
        except ValueError as exc:
            seen[name] = str(exc)
    expected = "persistent_workers option needs num_workers > 0" if workers == 0 else [(workers, persistent)] * 2
    assert seen["hl"] == seen["hf"] == expected


def test_process_roles_follow_log_on_each_node_and_save_on_each_node(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")  # the main process of the second node
    args = hflight.TrainingArguments("o")
    assert (args.process_index, args.local_process_index, args.world_size) == (2, 0, 4)
    assert args.should_log and not args.should_save
    assert hflight.TrainingArguments("o", save_on_each_node=True).should_save
    assert not hflight.TrainingArguments("o", log_on_each_node=False).should_log
    assert hflight.TrainingArguments("o").parallel_mode == transformers.training_args.ParallelMode.DISTRIBUTED


@pytest.mark.parametrize("save_on_each_node", [False, True])
def test_the_writers_of_each_node_clean_their_stale_folders(tmp_path, monkeypatch, save_on_each_node):
    """The processes that write checkpoints (args.should_save) are the ones that clean what an interrupted save left;
    with save_on_each_node that includes the main process of the second node."""
    from hflight.checkpoints.folders import clean_output_dir

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    stale = tmp_path / ".tmp-checkpoint-3"
    stale.mkdir()
    args = hflight.TrainingArguments(str(tmp_path), save_on_each_node=save_on_each_node)
    clean_output_dir(args, None)
    assert stale.exists() is not save_on_each_node


def test_log_level_replica_sets_transformers_verbosity_on_replicas(tmp_path, factory, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    before = transformers.logging.get_verbosity()
    try:
        args = hflight.TrainingArguments(str(tmp_path), log_level="info", log_level_replica="error", report_to="none")
        hflight.Trainer(factory.cls_model(), args)
        assert transformers.logging.get_verbosity() == transformers.logging.ERROR
    finally:
        transformers.logging.set_verbosity(before)


def test_join_parts_for_eval_use_gather_object():
    joined = join_parts([(torch.ones(2, 3), ["a"]), (torch.zeros(1, 3), ["b", "c"])])
    assert joined[0].shape == (3, 3) and joined[1] == ["a", "b", "c"]
    assert join_parts([{"x": torch.tensor(1.0)}, {"x": torch.tensor(2.0)}])["x"].tolist() == [1.0, 2.0]


# ---- distributed arguments as Lightning strategies ----------------------------------------------------------------
def test_ddp_arguments_configure_lightning_s_ddp_strategy(monkeypatch):
    from lightning.pytorch.strategies import DDPStrategy

    args = hflight.TrainingArguments(
        "o", strategy="ddp_spawn", ddp_find_unused_parameters=True, ddp_bucket_cap_mb=50, ddp_static_graph=False,
        ddp_broadcast_buffers=False, ddp_backend="gloo", ddp_timeout=60,
    )  # fmt: skip
    strategy = lightning_kwargs.strategy_for(args)
    assert isinstance(strategy, DDPStrategy) and strategy._start_method == "spawn"
    assert strategy._ddp_kwargs == {"find_unused_parameters": True, "bucket_cap_mb": 50, "static_graph": False,
                                    "broadcast_buffers": False}  # fmt: skip
    assert strategy._process_group_backend == "gloo" and strategy._timeout == datetime.timedelta(seconds=60)
    # One process: as in transformers, the DDP arguments change nothing; under torchrun they make the DDP strategy.
    single = hflight.TrainingArguments("o", ddp_find_unused_parameters=True)
    assert lightning_kwargs.strategy_for(single) == "auto"
    # Lightning launching the processes itself (strategy="auto", two CPU devices): it would pick DDP, so the ddp_*
    # settings make that DDP strategy (they were dropped); one device or no ddp_* setting leaves the choice to it.
    launched = hflight.TrainingArguments("o", devices="2", accelerator="cpu", ddp_bucket_cap_mb=5, ddp_timeout=90)
    strategy = lightning_kwargs.strategy_for(launched)
    assert isinstance(strategy, DDPStrategy) and strategy._ddp_kwargs == {"bucket_cap_mb": 5}
    assert strategy._timeout == datetime.timedelta(seconds=90)
    assert lightning_kwargs.strategy_for(hflight.TrainingArguments("o", devices="2", accelerator="cpu")) == "auto"
    assert lightning_kwargs.strategy_for(hflight.TrainingArguments("o", devices="1", ddp_bucket_cap_mb=5)) == "auto"
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert isinstance(lightning_kwargs.strategy_for(single), DDPStrategy)
    assert lightning_kwargs.strategy_for(hflight.TrainingArguments("o", strategy="ddp")) == "ddp"


def test_fsdp1_arguments_configure_lightning_s_fsdp_strategy(factory, monkeypatch):
    """FSDP1 (fsdp_config version 1): the mapping a GPU machine gets (Lightning's FSDPStrategy runs on CUDA only; the
    refusal of the CPU is tested in test_distributed): the device check is told the run is on CUDA, the world has 2
    processes."""
    from lightning.pytorch.strategies import FSDPStrategy
    from transformers.models.bert.modeling_bert import BertLayer

    from hflight.arguments import training_args
    from hflight.sharding.plans import fsdp1_plan

    monkeypatch.setattr(training_args, "resolved_device_type", lambda args: "cuda")
    monkeypatch.setattr(strategy_settings, "planned_world_size", lambda args: 2)

    model = factory.cls_model()
    args = hflight.TrainingArguments(
        "o", fsdp="shard_grad_op offload", fsdp_config={"version": 1, "transformer_layer_cls_to_wrap": ["BertLayer"],
                                                        "activation_checkpointing": True}, ddp_timeout=120,
    )  # fmt: skip
    strategy = lightning_kwargs.strategy_for(args, model)
    assert isinstance(strategy, FSDPStrategy)
    assert strategy.sharding_strategy.name == "SHARD_GRAD_OP" and strategy.cpu_offload.offload_params
    assert strategy.kwargs["auto_wrap_policy"]._module_classes == {BertLayer}
    assert strategy._activation_checkpointing_kwargs  # BertLayer, as fsdp_config["activation_checkpointing"] asks
    assert strategy._timeout == datetime.timedelta(seconds=120)
    size_config = {"version": 1, "min_num_params": 1000, "auto_wrap_policy": "SIZE_BASED_WRAP"}
    size_based = hflight.TrainingArguments("o", fsdp=True, fsdp_config=size_config)
    kwargs = fsdp1_plan(size_based, model, {}).strategy_kwargs()
    assert kwargs["auto_wrap_policy"].keywords == {"min_num_params": 1000}
    with pytest.raises(ValueError, match="NoSuchLayer"):
        lightning_kwargs.strategy_for(
            hflight.TrainingArguments("o", fsdp=True, fsdp_config={"transformer_layer_cls_to_wrap": ["NoSuchLayer"]}),
            model,
        )
    with pytest.raises(ValueError, match="each choose the Lightning strategy"):
        hflight.TrainingArguments("o", fsdp=True, strategy="ddp")


def test_deepspeed_argument_builds_hflight_s_deepspeed_strategy():
    """deepspeed (a dict here; a file in test_deepspeed): hflight's DeepSpeed strategy on the config as transformers
    and accelerate resolve it (batch size filled, the Trainer's optimizer allowed, accelerate's precision sections and
    no step logs), the caller's dict left as given, the process-group settings passed on."""
    from hflight.sharding.deepspeed import HFDeepSpeedStrategy

    config = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"}
    args = hflight.TrainingArguments("o", report_to="none", deepspeed=config, ddp_timeout=90)
    strategy = strategy_settings.deepspeed_strategy(args)
    assert isinstance(strategy, HFDeepSpeedStrategy)
    assert strategy.config == {**config, "train_micro_batch_size_per_gpu": 8, "zero_allow_untested_optimizer": True,
                               "fp16": {"enabled": False}, "bf16": {"enabled": False},
                               "steps_per_print": float("inf")}  # fmt: skip
    assert config["train_micro_batch_size_per_gpu"] == "auto"
    assert strategy._timeout == datetime.timedelta(seconds=90)


def test_finalize_deepspeed_fills_what_needs_the_model_and_keeps_accumulation(factory):
    """The second half of the resolution, on the strategy's own config dict (Lightning keeps the dict it is given):
    the scheduler's steps and ZeRO-3's buckets; gradient_accumulation_steps stays (the engine accumulates, as
    transformers has it)."""
    import json
    from types import SimpleNamespace

    from hflight.arguments.deepspeed import DeepSpeedConfigResolver
    from hflight.run.backend import backend_of
    from hflight.sharding.deepspeed import HFDeepSpeedStrategy

    model = factory.cls_model()
    for accumulation in (1, 2):
        args = hflight.TrainingArguments("o", report_to="none", gradient_accumulation_steps=accumulation)
        resolver = DeepSpeedConfigResolver(AUTO_EVERYWHERE)
        resolver.process(args)
        strategy = SimpleNamespace(config=resolver.config, hf_deepspeed_resolver=resolver)
        HFDeepSpeedStrategy.hf_run_planned(strategy, args, model, 40)  # the loop's hook, on the strategy's resolver
        assert strategy.config == _transformers_resolution(AUTO_EVERYWHERE, args, model, 40)
        assert (
            "auto" not in json.dumps(strategy.config) and strategy.config["gradient_accumulation_steps"] == accumulation
        )
        assert strategy.config["scheduler"]["params"]["total_num_steps"] == 40
    untouched = SimpleNamespace(config={"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}})
    backend_of(untouched).hf_run_planned(args, model, 40)  # not one deepspeed_strategy built: left alone
    assert untouched.config == {"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}


def _transformers_resolution(config, args, model, num_training_steps):
    """transformers' own HfTrainerDeepSpeedConfig methods, run on accelerate's HfDeepSpeedConfig (their base class;
    transformers' constructor would also check that deepspeed is importable)."""
    from accelerate.utils.deepspeed import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    methods = ("dtype", "is_auto", "fill_match", "fill_only", "trainer_config_process", "trainer_config_finalize")
    reference_cls = type("Reference", (HfDeepSpeedConfig,), {m: vars(HfTrainerDeepSpeedConfig)[m] for m in methods})
    reference = reference_cls(config)
    reference._dtype, reference.mismatches = None, []
    reference.trainer_config_process(args)
    reference.trainer_config_finalize(args, model, num_training_steps)
    return reference.config


AUTO_EVERYWHERE = {
    "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                     "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto", "offload_optimizer": {"device": "cpu"}},
}  # fmt: skip


@pytest.mark.parametrize(
    "config, fields",
    [
        (AUTO_EVERYWHERE, dict(per_device_train_batch_size=3, gradient_accumulation_steps=2, learning_rate=3e-4,
                               adam_beta2=0.95, weight_decay=0.1, warmup_steps=0.1, bf16=True, save_on_each_node=True,
                               max_grad_norm=0.5)),
        ({**AUTO_EVERYWHERE, "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}, dict(fp16=True)),
        ({"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0, "zero_optimization": {"stage": 1}}, {}),
    ],
    ids=["zero3-auto", "zero2-fp16", "explicit"],
)  # fmt: skip
def test_deepspeed_config_resolved_as_transformers(config, fields, tmp_path, factory):
    """Every "auto" of a transformers-style config gets the value transformers' HfTrainerDeepSpeedConfig gives it,
    from the same arguments and model (the config given as a dict and as a JSON file)."""
    import json

    from hflight.arguments.deepspeed import DeepSpeedConfigResolver

    args = hflight.TrainingArguments("o", report_to="none", **fields)
    model = factory.cls_model()
    expected = _transformers_resolution(config, args, model, 40)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    for given in (config, str(path)):
        resolver = DeepSpeedConfigResolver(given)
        resolver.process(args)
        assert resolver.finalize(args, model, 40) == expected
    assert "auto" not in json.dumps(expected)
    assert config["train_micro_batch_size_per_gpu"] in ("auto", 8)  # the caller's dict is not filled in


def test_deepspeed_config_mismatches_raise_as_transformers(factory):
    from hflight.arguments.deepspeed import DeepSpeedConfigResolver

    config = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 2.0, "optimizer": {"params": {"lr": 0.1}}}
    args = hflight.TrainingArguments("o", report_to="none", per_device_train_batch_size=8)
    with pytest.raises(ValueError) as theirs:
        _transformers_resolution(config, args, factory.cls_model(), 10)
    resolver = DeepSpeedConfigResolver(config)
    resolver.process(args)
    with pytest.raises(ValueError) as ours:
        resolver.finalize(args, factory.cls_model(), 10)
    assert str(ours.value) == str(theirs.value)
    assert "- ds train_micro_batch_size_per_gpu=4 vs hf per_device_train_batch_size=8" in str(ours.value)


def test_size_based_wrap_without_min_num_params_wraps_nothing_as_accelerate(factory):
    """accelerate's ``SIZE_BASED_WRAP`` with ``min_num_params`` 0 (its default, ``FSDP_MIN_NUM_PARAMS`` unset) has no
    policy: the whole model is the one unit; a positive count wraps the submodules above it."""
    from hflight.sharding.plans import wrap_policy

    model = factory.qa_model()
    assert wrap_policy({"auto_wrap_policy": "SIZE_BASED_WRAP"}, model) is None
    assert wrap_policy({"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 0}, model) is None
    policy = wrap_policy({"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 1000}, model)
    assert policy is not None and policy.min_num_params == 1000
