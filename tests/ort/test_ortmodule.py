"""ORTModule training through the ORT strategy. Runs only where onnxruntime-training imports (CI builds that
environment with .ci/ortmodule-env: torch 2.6.0 + onnxruntime-training-cpu 1.19.2 + torch-ort); skipped elsewhere."""

from __future__ import annotations

import os

os.environ.setdefault("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")  # a silent fallback to PyTorch must not pass

import copy  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from hflight import Trainer, TrainingArguments  # noqa: E402
from hflight.ort import ORTStrategy  # noqa: E402
from hflight.ort.runtime import ortmodule_class  # noqa: E402

pytestmark = [
    pytest.mark.ortmodule,
    pytest.mark.skipif(ortmodule_class() is None, reason="onnxruntime-training (ORTModule) is not installed here"),
]

COMMON = dict(
    per_device_train_batch_size=4,
    per_device_eval_batch_size=8,
    max_steps=10,
    learning_rate=1e-3,
    warmup_steps=0.1,
    weight_decay=0.01,
    max_grad_norm=1.0,
    optim="adamw_torch",
    train_sampling_strategy="sequential",
    logging_steps=1,
    eval_strategy="steps",
    eval_steps=5,
    save_strategy="steps",
    save_steps=10,
    report_to="none",
    disable_tqdm=True,
    accelerator="cpu",
    seed=0,
)


def _fit(model, strategy, tmp_path, name, factory):
    args = TrainingArguments(str(tmp_path / name), **COMMON, strategy=strategy)
    trainer = Trainer(model, args, train_dataset=factory.qa_dataset(40), eval_dataset=factory.qa_dataset(16, seed=1))
    trainer.train()
    return trainer


def test_ortmodule_fit_equals_eager_with_a_midrun_evaluation(factory, tmp_path):
    from transformers import BertForQuestionAnswering

    model = factory.qa_model(seed=0)
    eager = _fit(copy.deepcopy(model), "auto", tmp_path, "eager", factory)
    strategy = ORTStrategy(training=True, inference=False)  # the mid-run evaluation is eager: the train-mode pitfall
    ort = _fit(model, strategy, tmp_path, "ort", factory)
    assert strategy._training_model is not None  # the fit really ran through ORTModule

    logs = [[e for e in t.state.log_history if "loss" in e] for t in (eager, ort)]
    assert len(logs[1]) == len(logs[0]) == 10
    for a, b in zip(*logs):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    evals = [[e["eval_loss"] for e in t.state.log_history if "eval_loss" in e] for t in (eager, ort)]
    assert len(evals[1]) == 2 and evals[1] == pytest.approx(evals[0], abs=1e-5)
    # (final weights are not compared: Adam turns last-bit gradient differences of near-zero gradients into
    # lr-sized steps of either sign, so parameters drift apart by ~1e-3 while every loss agrees within 1e-5)

    folder = tmp_path / "ort" / "checkpoint-10"
    reloaded = BertForQuestionAnswering.from_pretrained(folder)  # plain keys: no ORTModule prefixes
    assert set(reloaded.state_dict()) == set(model.state_dict())
    torch.testing.assert_close(reloaded.qa_outputs.weight, model.qa_outputs.weight)


def test_sdpa_with_attention_dropout_trains_with_eager_attention(factory, tmp_path):
    model = factory.qa_model(seed=1, dropout=0.1)
    model.set_attn_implementation("sdpa")
    args = TrainingArguments(str(tmp_path / "out"), **{**COMMON, "max_steps": 3, "eval_strategy": "no"})
    trainer = Trainer(model, args, train_dataset=factory.qa_dataset(16))
    trainer.args.strategy = ORTStrategy(training=True, inference=False)
    trainer.train()
    assert model.config._attn_implementation == "eager"
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in trainer.state.log_history if "loss" in e)


def test_module_with_loss_runs_the_loss_inside_ortmodule(factory, tmp_path):
    """optimum's use_module_with_loss: ORTModule wraps ModuleWithLoss (the loss is part of the exported graph);
    the losses are eager's."""
    from hflight.ort import ModuleWithLoss, ORTTrainer, ORTTrainingArguments

    model = factory.qa_model(seed=0)
    eager = _fit(copy.deepcopy(model), "auto", tmp_path, "eager", factory)
    settings = {**COMMON, "eval_strategy": "no"}
    args = ORTTrainingArguments(str(tmp_path / "ort"), **settings, use_module_with_loss=True, ort_training="true",
                                ort_inference=False)  # fmt: skip
    trainer = ORTTrainer(model, args, train_dataset=factory.qa_dataset(40))
    trainer.train()
    assert isinstance(trainer.ort_strategy._training_model.wrapped, ModuleWithLoss)
    losses = [[e["loss"] for e in t.state.log_history if "loss" in e] for t in (eager, trainer)]
    assert len(losses[1]) == 10 and losses[1] == pytest.approx(losses[0], abs=1e-5)
