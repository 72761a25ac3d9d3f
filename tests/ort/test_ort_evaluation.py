"""ONNX Runtime evaluation (``strategy="ort"``): equal to eager PyTorch, re-exported only when weights change."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import sys

import numpy as np
import pytest

from hflight import Trainer, TrainingArguments
from hflight.callbacks.ema import EMACallback
from hflight.ort import ORTStrategy, ORTTrainer, ORTTrainingArguments
from hflight.ort.strategy import evaluation_sessions

pytest.importorskip("onnxruntime", reason="ONNX Runtime evaluation needs: pip install 'hflight[ort]'")

COMMON = dict(
    per_device_train_batch_size=8,
    per_device_eval_batch_size=8,
    num_train_epochs=1,
    learning_rate=1e-3,
    logging_steps=1,
    report_to="none",
    save_strategy="no",
    disable_tqdm=True,
    accelerator="cpu",
)
# optimum 1.x's ORTTrainer.__init__, in order
OPTIMUM_PARAMETERS = [
    "model", "args", "data_collator", "train_dataset", "eval_dataset", "tokenizer", "model_init", "compute_metrics",
    "callbacks", "optimizers", "preprocess_logits_for_metrics",
]  # fmt: skip


def trainer_for(model, tmp_path, name, strategy="auto", **kwargs):
    callbacks = kwargs.pop("callbacks", None)
    args = TrainingArguments(str(tmp_path / name), **{**COMMON, **kwargs}, strategy=strategy)
    return lambda train=None, evaluation=None: Trainer(
        model, args, train_dataset=train, eval_dataset=evaluation, callbacks=callbacks
    )


def assert_same_predictions(eager, ort, atol=1e-4):
    eager = eager if isinstance(eager, tuple) else (eager,)
    ort = ort if isinstance(ort, tuple) else (ort,)
    assert len(eager) == len(ort)
    for a, b in zip(eager, ort):
        assert a.shape == b.shape
        np.testing.assert_allclose(b, a, atol=atol, rtol=0)


@pytest.mark.parametrize("kind", ["qa", "classifier"])
def test_ort_evaluation_equals_eager(factory, tmp_path, kind):
    model = factory.qa_model() if kind == "qa" else factory.cls_model()
    evaluation = factory.qa_dataset(20, seed=1) if kind == "qa" else factory.cls_dataset(20, seed=1)
    eager = trainer_for(copy.deepcopy(model), tmp_path, "eager")(evaluation=evaluation)
    ort = trainer_for(model, tmp_path, "ort", strategy="ort")(evaluation=evaluation)
    eager_metrics, ort_metrics = eager.evaluate(), ort.evaluate()
    assert ort_metrics["eval_loss"] == pytest.approx(eager_metrics["eval_loss"], abs=1e-5)
    assert_same_predictions(eager.predict(evaluation).predictions, ort.predict(evaluation).predictions)
    (session,) = evaluation_sessions(model)
    assert session.export_count == 1  # evaluate and predict shared one export: the weights did not change
    assert session.input_names == ["input_ids", "attention_mask"] and "loss" not in session.output_names


def test_dynamo_exporter(factory, tmp_path):
    model = factory.cls_model()
    evaluation = factory.cls_dataset(12, seed=2)
    eager = trainer_for(copy.deepcopy(model), tmp_path, "eager")(evaluation=evaluation)
    args = TrainingArguments(str(tmp_path / "ort"), **COMMON, strategy=ORTStrategy(exporter="dynamo"))
    ort = Trainer(model, args, eval_dataset=evaluation)
    assert_same_predictions(eager.predict(evaluation).predictions, ort.predict(evaluation).predictions)
    assert ort.evaluate()["eval_loss"] == pytest.approx(eager.evaluate()["eval_loss"], abs=1e-5)


def test_session_rebuilt_only_when_training_changed_the_weights(factory, tmp_path):
    model = factory.qa_model()
    trainer = trainer_for(model, tmp_path, "ort", strategy="ort", eval_strategy="epoch", num_train_epochs=2)(
        train=factory.qa_dataset(16), evaluation=factory.qa_dataset(8, seed=1)
    )
    trainer.evaluate()
    (session,) = evaluation_sessions(model)
    assert session.export_count == 1
    trainer.evaluate()
    assert session.export_count == 1  # same weights: the session is reused
    trainer.train()  # two epoch-end evaluations, each after the weights changed
    assert session.export_count == 3
    after = trainer.evaluate()
    assert session.export_count == 3
    eager = trainer_for(copy.deepcopy(model), tmp_path, "eager")(evaluation=factory.qa_dataset(8, seed=1))
    assert after["eval_loss"] == pytest.approx(eager.evaluate()["eval_loss"], abs=1e-5)  # the new weights


def test_ema_weights_are_the_exported_ones(factory, tmp_path):
    train, evaluation = factory.qa_dataset(24), factory.qa_dataset(8, seed=1)
    results = {}
    # eager training in both runs (ORTModule, where installed, would train with last-bit differences)
    for name, strategy in (("auto", "auto"), ("ort", ORTStrategy(training=False))):
        model = factory.qa_model(seed=3)
        trainer = trainer_for(model, tmp_path, name, strategy=strategy, callbacks=[EMACallback(decay=0.5)])(
            train=train, evaluation=evaluation
        )
        trainer.train()
        results[name] = trainer.predict(evaluation).predictions
    assert_same_predictions(results["auto"], results["ort"])
    raw = factory.qa_model(seed=3)  # sanity: averaged weights differ from what training alone would give
    assert not np.allclose(results["ort"][0], trainer_for(raw, tmp_path, "raw")().predict(evaluation).predictions[0])


def test_quantized_evaluation_reports_its_metrics(factory, tmp_path):
    model = factory.cls_model(num_labels=3)
    train, evaluation = factory.cls_dataset(96), factory.cls_dataset(48, seed=1)

    def accuracy(prediction):
        return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}

    args = TrainingArguments(str(tmp_path / "fp32"), **{**COMMON, "num_train_epochs": 4, "learning_rate": 3e-3})
    trainer = Trainer(model, args, train_dataset=train, eval_dataset=evaluation, compute_metrics=accuracy)
    trainer.train()
    eager = trainer.evaluate()
    int8 = Trainer(
        model,
        TrainingArguments(str(tmp_path / "int8"), **COMMON, strategy=ORTStrategy(quantize="dynamic")),
        eval_dataset=evaluation,
        compute_metrics=accuracy,
    ).evaluate()
    assert {"eval_loss", "eval_accuracy"} <= set(int8)
    assert int8["eval_loss"] != eager["eval_loss"]  # int8 weights: close, not equal
    assert abs(int8["eval_loss"] - eager["eval_loss"]) < 0.1
    assert abs(int8["eval_accuracy"] - eager["eval_accuracy"]) <= 0.1
    (session,) = [s for s in evaluation_sessions(model) if s.quantize == "dynamic"]
    assert session.session._model_path.endswith(".int8.onnx")


def test_ort_trainer_api(factory, tmp_path):
    assert list(inspect.signature(ORTTrainer.__init__).parameters)[1:] == OPTIMUM_PARAMETERS
    fields = {f.name for f in dataclasses.fields(ORTTrainingArguments)}
    assert {"use_module_with_loss", "save_onnx", "onnx_prefix", "onnx_log_level"} <= fields
    model = factory.qa_model()
    args = ORTTrainingArguments(
        str(tmp_path / "out"), **COMMON, save_onnx=True, onnx_prefix="qa_", ort_training="false"
    )
    trainer = ORTTrainer(model, args, train_dataset=factory.qa_dataset(16), eval_dataset=factory.qa_dataset(8, seed=1))
    trainer.train()
    import onnx

    graph = onnx.load(str(tmp_path / "out" / "qa_model.onnx")).graph
    assert [i.name for i in graph.input] == ["input_ids", "attention_mask"]
    assert [o.name for o in graph.output] == ["start_logits", "end_logits"]
    assert trainer.evaluate()["eval_loss"] > 0
    with pytest.raises(ValueError, match="ort_exporter must be one of"):
        ORTTrainingArguments("o", ort_exporter="script")


def test_ort_trainer_converts_plain_training_arguments(factory, tmp_path):
    plain = TrainingArguments(str(tmp_path / "out"), **COMMON)
    trainer = ORTTrainer(factory.qa_model(), plain)
    assert type(trainer.args) is ORTTrainingArguments and trainer.args.learning_rate == COMMON["learning_rate"]
    assert trainer.args.ort_inference is True and trainer.args.ort_quantize is None  # the ORT fields' defaults
    with pytest.raises(TypeError, match="ORTTrainer: args must be ORTTrainingArguments or TrainingArguments"):
        ORTTrainer(factory.qa_model(), object())


def test_adamw_ort_fused_needs_onnxruntime_training(factory, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime.training", None)
    monkeypatch.setitem(sys.modules, "onnxruntime.training.optim", None)
    args = TrainingArguments(str(tmp_path / "out"), **COMMON, optim="adamw_ort_fused")
    trainer = Trainer(factory.qa_model(), args, train_dataset=factory.qa_dataset(8))
    with pytest.raises(ModuleNotFoundError, match="FusedAdam.*onnxruntime-training"):
        trainer.train()


def test_without_onnxruntime_the_error_says_what_to_install(factory, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    trainer = trainer_for(factory.qa_model(), tmp_path, "ort", strategy="ort")(evaluation=factory.qa_dataset(4))
    with pytest.raises(ModuleNotFoundError, match=r"pip install \"hflight\[ort\]\""):
        trainer.evaluate()
