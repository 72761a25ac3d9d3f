"""``trainer.accelerator`` where code written for transformers reaches past the loop (issue 55, items 4 and 7).

``unwrap_model``/``get_state_dict`` take off only the wrappers accelerate takes off (a user's model with a submodule
named ``module`` stays whole: its state dict loads back, and label smoothing shifts the labels as transformers
decides from the model's own class); ``state.deepspeed_plugin``/``state.fsdp_plugin`` answer accelerate's plugins,
which TRL reads to prepare a reference model (``prepare_deepspeed``, ``prepare_fsdp``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn

import hflight

from . import launch
from .support import Factory
from .tiny_lm import gpt2, token_rows

JOB = Path(__file__).parent / "jobs" / "dpo_ref_job.py"
STANDIN = Path(__file__).parent / "fsdp_standin"


class Holder(nn.Module):
    """A user's model that keeps a causal LM in a submodule named ``module`` (no wrapper: its own class)."""

    def __init__(self) -> None:
        super().__init__()
        self.module = gpt2()
        self.scale = nn.Parameter(torch.ones(()))

    @property
    def config(self):
        return self.module.config

    def forward(self, **inputs):
        outputs = self.module(**inputs)
        outputs["logits"] = outputs["logits"] * self.scale
        return outputs


def _losses(trainer) -> list[float]:
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_a_model_with_a_submodule_named_module_is_not_taken_apart(tmp_path):
    """``unwrap_model`` answers the model itself, ``get_state_dict`` its own keys (loaded back, strict), and the loss
    with ``label_smoothing_factor`` is transformers': its ``Holder`` is no causal LM class, so the labels are not
    shifted (hflight once unwrapped ``.module`` and shifted them)."""
    settings = Factory.pair_args(max_steps=3, label_smoothing_factor=0.1, use_cpu=True, remove_unused_columns=False)
    rows = token_rows(12, seed=1)
    losses = {}
    for library in (transformers, hflight):
        args = library.TrainingArguments(str(tmp_path / library.__name__), **settings)
        trainer = library.Trainer(Holder(), args, train_dataset=rows)
        model = trainer.model
        assert trainer.accelerator.unwrap_model(model) is model
        assert trainer.accelerator.unwrap_model(model, keep_torch_compile=False) is model
        state = trainer.accelerator.get_state_dict(model)
        assert "scale" in state and "module.transformer.wte.weight" in state
        Holder().load_state_dict(state, strict=True)
        losses[library.__name__] = _losses(trainer)
    assert len(losses["hflight"]) == 3 and losses["hflight"] == pytest.approx(losses["transformers"], abs=1e-6)


def test_only_accelerates_wrappers_are_taken_off(tmp_path):
    """``DataParallel`` (as DDP, FSDP1, DeepSpeed's engine) and hflight's LightningModule come off, a compiled model
    keeps its compiled wrapper unless ``keep_torch_compile=False``: accelerate's ``extract_model_from_parallel``."""
    from accelerate.utils import extract_model_from_parallel

    from hflight.run.module import HFModule

    trainer = hflight.Trainer(Holder(), hflight.TrainingArguments(str(tmp_path), use_cpu=True))
    model, accelerator = trainer.model, trainer.accelerator
    wrapped = nn.DataParallel(nn.DataParallel(model))
    assert accelerator.unwrap_model(wrapped) is model is extract_model_from_parallel(wrapped)
    run_module = HFModule.__new__(HFModule)
    nn.Module.__init__(run_module)
    run_module.model = model
    assert accelerator.unwrap_model(nn.DataParallel(run_module)) is model
    compiled = torch.compile(nn.DataParallel(model))
    for keep in (True, False):
        theirs = extract_model_from_parallel(compiled, keep_torch_compile=keep)
        assert accelerator.unwrap_model(compiled, keep_torch_compile=keep) is theirs
        assert theirs is (compiled if keep else model)


FSDP2 = dict(fsdp="full_shard auto_wrap", fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]})
ZERO2 = dict(deepspeed={"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
                        "train_batch_size": "auto", "gradient_accumulation_steps": "auto"})  # fmt: skip


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_the_state_answers_accelerates_plugins_as_transformers_builds_them(tmp_path, precision):
    """What TRL's ``prepare_fsdp``/``prepare_deepspeed`` read: transformers' ``FullyShardedDataParallelPlugin`` of
    ``fsdp_plugin_args`` and its arguments' ``DeepSpeedPlugin``, each given the mixed precision as accelerate's state
    gives it (hflight once raised an ``AttributeError`` there, reported as "has no 'fsdp_plugin'")."""
    from accelerate.utils import DeepSpeedPlugin, FullyShardedDataParallelPlugin

    from hflight.trainer.accelerator import RunAccelerator

    common = dict(use_cpu=True, report_to="none", bf16=precision == "bf16")
    for settings, name in ((FSDP2, "fsdp_plugin"), (ZERO2, "deepspeed_plugin")):
        theirs = transformers.TrainingArguments(str(tmp_path), **common, **settings)
        state = RunAccelerator(lambda: None, hflight.TrainingArguments(str(tmp_path), **common, **settings)).state
        other = "deepspeed_plugin" if name == "fsdp_plugin" else "fsdp_plugin"
        assert getattr(state, other) is None
        ours = getattr(state, name)
        assert getattr(state, name) is ours  # one plugin: TRL's prepare_fsdp configures the one it reads
        if name == "fsdp_plugin":
            expected = FullyShardedDataParallelPlugin(**theirs.fsdp_plugin_args)
            if precision != "no":
                expected.set_mixed_precision(precision)
            assert isinstance(ours, FullyShardedDataParallelPlugin) and repr(ours) == repr(expected)
            assert ours.fsdp_version == 2
        else:
            expected = theirs.deepspeed_plugin
            expected.set_mixed_precision(precision)
            assert isinstance(ours, DeepSpeedPlugin) and ours.deepspeed_config == expected.deepspeed_config
            assert ours.zero_stage == 2


def test_a_property_that_fails_raises_its_own_error_not_has_no(tmp_path, monkeypatch):
    """An ``AttributeError`` inside a property of ``trainer.accelerator`` or its ``state`` is that error, not
    ``__getattr__``'s "has no <property>" (which contradicted itself: the state named ``fsdp_plugin`` among what it
    answers)."""
    from hflight.trainer.accelerator import RunAccelerator

    def broken(self):
        raise AttributeError("the run's strategy has no frobnicator")

    accelerator = RunAccelerator(lambda: None, hflight.TrainingArguments(str(tmp_path), use_cpu=True, **FSDP2))
    monkeypatch.setattr(RunAccelerator, "distributed_type", property(broken))
    for read in (lambda: accelerator.state.fsdp_plugin, lambda: accelerator.deepspeed_plugin):
        with pytest.raises(AttributeError, match="has no frobnicator") as raised:
            read()
        assert "has no 'fsdp_plugin'" not in str(raised.value) and "has no 'deepspeed_plugin'" not in str(raised.value)


@pytest.fixture(scope="module")
def dpo_runs(tmp_path_factory) -> Path:
    """One job on 2 processes: DPO with a reference model under ZeRO-2 and FSDP2, with hflight.trl and with TRL on
    transformers (FSDP2 on the CPU through ``tests/fsdp_standin``, as tests/test_sharded_dropin.py runs it)."""
    pytest.importorskip("trl")
    pytest.importorskip("deepspeed")
    root = tmp_path_factory.mktemp("dpo_ref")
    runs = ["trl:fsdp2", "hflight:fsdp2", "trl:zero2", "hflight:zero2"]
    launch.Job([*launch.torchrun(2), JOB, root, *runs], root, launch.environment(STANDIN)).ok()
    return root


@pytest.mark.subprocess
@launch.needs_torchrun
@pytest.mark.parametrize("mode, reference", [("zero2", "DeepSpeedEngine"), ("fsdp2", "FSDPGPT2LMHeadModel")])
def test_dpo_with_a_reference_model_under_zero_and_fsdp2_is_trl_s_run(dpo_runs, mode, reference):
    """TRL's ``prepare_deepspeed``/``prepare_fsdp`` prepare the reference model from the state's plugin as on
    transformers (a DeepSpeed engine, ZeRO off; an FSDP2 module), and every value logged, step by step, is TRL on
    transformers' (hflight's trainer could not be built: the plugins raised)."""
    ours, theirs = (json.loads((dpo_runs / f"{library}_{mode}.json").read_text()) for library in ("hflight", "trl"))
    assert ours["reference"] == theirs["reference"] == reference
    assert len([entry for entry in ours["logs"] if "loss" in entry]) == 3 and ours["logs"] == theirs["logs"]
