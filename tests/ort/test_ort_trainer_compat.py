"""optimum's ORTTrainer users (issue 16): the names and behaviours of optimum 1.x's ORT training API that code
written for it relies on, on hflight.ort."""

from __future__ import annotations

import copy
import inspect
import sys
import types

import pytest
import torch

from hflight.ort.strategy import evaluation_sessions

COMMON = dict(
    per_device_train_batch_size=8, per_device_eval_batch_size=8, num_train_epochs=1, learning_rate=1e-3,
    logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, accelerator="cpu",
    train_sampling_strategy="sequential", seed=3,
)  # fmt: skip


def test_optimums_module_paths():
    """``from optimum.onnxruntime.training_args import ORTTrainingArguments`` and ``from optimum.onnxruntime.trainer
    import ORTTrainer`` keep their module paths under hflight.ort."""
    import hflight.ort
    from hflight.ort.trainer import ModuleWithLoss, ORTTrainer
    from hflight.ort.training_args import ORTOptimizerNames, ORTTrainingArguments

    assert hflight.ort.ORTTrainer is ORTTrainer and hflight.ort.ModuleWithLoss is ModuleWithLoss
    assert hflight.ort.ORTTrainingArguments is ORTTrainingArguments
    assert hflight.ort.ORTOptimizerNames is ORTOptimizerNames and ORTOptimizerNames.ADAMW_ORT_FUSED == "adamw_ort_fused"


def test_ort_optimizer_names_and_the_ort_optimizer_factory(factory, tmp_path, monkeypatch):
    """``optim="adamw_ort_fused"`` parses to ORTOptimizerNames (as optimum's __post_init__ does) and the optimizer
    comes from ``ORTTrainer.get_ort_optimizer_cls_and_kwargs``: onnxruntime-training's FusedAdam, here a stand-in
    module (onnxruntime-training is not installed in this environment)."""
    from hflight.ort import ORTOptimizerNames, ORTTrainer, ORTTrainingArguments

    class FusedAdam(torch.optim.Adam):
        pass

    fake = types.ModuleType("onnxruntime.training.optim")
    fake.FusedAdam = FusedAdam
    monkeypatch.setitem(sys.modules, "onnxruntime.training.optim", fake)
    args = ORTTrainingArguments(str(tmp_path / "out"), **COMMON, optim="adamw_ort_fused", adam_epsilon=1e-7)
    assert args.optim is ORTOptimizerNames.ADAMW_ORT_FUSED
    cls, kwargs = ORTTrainer.get_ort_optimizer_cls_and_kwargs(args)
    assert cls is FusedAdam and kwargs == {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-7}
    trainer = ORTTrainer(factory.qa_model(), args, train_dataset=factory.qa_dataset(8))
    assert type(trainer.create_optimizer()) is FusedAdam
    other = ORTTrainingArguments(str(tmp_path / "out"), **COMMON, optim="adamw_torch")
    with pytest.raises(ValueError, match="ORTTrainer cannot instantiate unsupported optimizer: adamw_torch"):
        ORTTrainer.get_ort_optimizer_cls_and_kwargs(other)
    assert ORTTrainer.get_optimizer_cls_and_kwargs(other)[0] is torch.optim.AdamW  # transformers' names as before


def test_save_onnx_needs_an_onnx_prefix():
    from hflight.ort import ORTTrainingArguments

    with pytest.raises(ValueError, match="^onnx_prefix must be provided if save_onnx is True$"):
        ORTTrainingArguments("out", save_onnx=True)
    assert ORTTrainingArguments("out", save_onnx=True, onnx_prefix="qa_").onnx_prefix == "qa_"


def test_module_with_loss_trains_identically(factory, tmp_path):
    """``use_module_with_loss=True`` runs each training step through ModuleWithLoss (the module ORTModule would
    export, loss included); in eager PyTorch the losses and weights are those of the plain model, bit for bit."""
    from hflight.ort import ModuleWithLoss, ORTTrainer, ORTTrainingArguments

    model = factory.qa_model(seed=5)
    results = {}
    for flag in (False, True):
        args = ORTTrainingArguments(str(tmp_path / str(flag)), **COMMON, use_module_with_loss=flag,
                                    ort_training="false", ort_inference=True)  # fmt: skip
        trainer = ORTTrainer(copy.deepcopy(model), args, train_dataset=factory.qa_dataset(24))
        calls = []
        if flag:
            module = trainer.create_model_with_loss()
            assert isinstance(module, ModuleWithLoss) and module.config is trainer.model.config
            trainer.model_with_loss = module
            module.register_forward_pre_hook(lambda mod, inputs, seen=calls: seen.append(sorted(inputs[0])))
        trainer.train()
        results[flag] = ([e["loss"] for e in trainer.state.log_history if "loss" in e], trainer.model.state_dict())
        if flag:
            assert trainer.model_with_loss is module and len(calls) == 3  # 24 samples / 8: every step went through it
            assert calls[0] == ["attention_mask", "end_positions", "input_ids", "start_positions"]
    (plain_losses, plain_weights), (wrapped_losses, wrapped_weights) = results[False], results[True]
    assert wrapped_losses == plain_losses
    assert all(torch.equal(plain_weights[k], v) for k, v in wrapped_weights.items())


def test_module_with_loss_computes_the_trainers_loss(factory, tmp_path):
    from hflight.ort import ORTTrainer, ORTTrainingArguments

    trainer = ORTTrainer(factory.qa_model(), ORTTrainingArguments(str(tmp_path / "o"), **COMMON))
    module = trainer.create_model_with_loss()
    batch = {k: torch.as_tensor(v) for k, v in factory.qa_dataset(4)[:4].items()}
    expected = trainer.compute_loss(trainer.model, batch)
    assert torch.equal(module(batch, False, None), expected)
    loss, outputs = module(batch, True, None)
    assert torch.equal(loss, expected) and outputs.start_logits.shape == (4, batch["input_ids"].shape[1])


def test_inference_with_ort_per_call(factory, tmp_path):
    """optimum <= 1.13's ``evaluate/predict(..., inference_with_ort=)``: True through ONNX Runtime, False in eager
    PyTorch, whatever the arguments say; None follows ``ort_inference``."""
    from hflight.ort import ORTTrainer, ORTTrainingArguments

    for method in (ORTTrainer.evaluate, ORTTrainer.predict):
        parameter = list(inspect.signature(method).parameters.values())[-1]
        assert (parameter.name, parameter.default) == ("inference_with_ort", None)
    model, evaluation = factory.qa_model(), factory.qa_dataset(8, seed=1)
    args = ORTTrainingArguments(str(tmp_path / "o"), **COMMON, ort_inference=False)
    trainer = ORTTrainer(model, args, eval_dataset=evaluation)
    eager = trainer.evaluate()
    assert evaluation_sessions(model) == []  # ort_inference=False: eager
    through_ort = trainer.evaluate(inference_with_ort=True)
    (session,) = evaluation_sessions(model)
    assert session.export_count == 1 and through_ort["eval_loss"] == pytest.approx(eager["eval_loss"], abs=1e-5)
    assert trainer.ort_strategy.inference is False  # the call's choice does not outlive the call
    trainer.predict(evaluation, inference_with_ort=False)
    predicted = trainer.predict(evaluation, inference_with_ort=True)
    assert session.export_count == 1 and predicted.predictions[0].shape == (8, 24)


def test_without_onnxruntime_eager_evaluation_still_works(factory, tmp_path, monkeypatch):
    """With ``ort_inference=False`` nothing needs onnxruntime: constructing, training and evaluating work without it
    (they used to raise "ONNX Runtime evaluation needs onnxruntime"); asking for ORT then says what to install."""
    from hflight.ort import ORTTrainer, ORTTrainingArguments

    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    args = ORTTrainingArguments(str(tmp_path / "o"), **COMMON, ort_inference=False)
    trainer = ORTTrainer(factory.qa_model(), args, train_dataset=factory.qa_dataset(8),
                         eval_dataset=factory.qa_dataset(8, seed=1))  # fmt: skip
    trainer.train()
    assert trainer.evaluate()["eval_loss"] > 0
    with pytest.raises(ModuleNotFoundError, match=r"ONNX Runtime evaluation needs onnxruntime"):
        trainer.evaluate(inference_with_ort=True)
