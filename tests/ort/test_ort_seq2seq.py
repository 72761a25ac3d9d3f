"""optimum's ORTSeq2SeqTrainer / ORTSeq2SeqTrainingArguments on hflight.ort (issue 23): training as ORTTrainer
(eager PyTorch here: no onnxruntime-training in this environment), generation-based evaluation in PyTorch with
transformers' Seq2SeqTrainer numbers, ONNX Runtime evaluation without generation, and the ORT-generation option
refused by name."""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from transformers import DataCollatorForSeq2Seq

from hflight.ort import ORTSeq2SeqTrainer, ORTSeq2SeqTrainingArguments, ORTTrainer
from hflight.ort.strategy import evaluation_sessions

_spec = importlib.util.spec_from_file_location("seq2seq_data", Path(__file__).parents[1] / "seq2seq_data.py")
seq2seq_data = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("seq2seq_data", seq2seq_data)
_spec.loader.exec_module(seq2seq_data)

COMMON = dict(per_device_train_batch_size=4, per_device_eval_batch_size=4, num_train_epochs=2, learning_rate=1e-3,
              logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, seed=3,
              eval_strategy="epoch")  # fmt: skip
TIMINGS = ("_runtime", "_samples_per_second", "_steps_per_second", "_model_preparation_time")


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # generation: many tiny steps, far faster on one thread of a shared CPU
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    import datasets

    tokenizer = seq2seq_data.tokenizer(tmp_path_factory.mktemp("ort_seq2seq_tokenizer"))

    def dataset(n, seed):
        records = seq2seq_data.summarization_records(n, seed=seed)
        sources = tokenizer([r["text"] for r in records], max_length=32, truncation=True)
        targets = tokenizer(text_target=[r["summary"] for r in records], max_length=12, truncation=True)
        return datasets.Dataset.from_dict({"input_ids": sources["input_ids"],
                                           "attention_mask": sources["attention_mask"],
                                           "labels": targets["input_ids"]})  # fmt: skip

    return {"tokenizer": tokenizer, "train": dataset(16, 1), "eval": dataset(10, 2)}


def _trained(name, tmp_path, data, **args):
    """One trainer (transformers' or hflight.ort's) on the tiny BART, trained right after it is built."""
    model = seq2seq_data.bart_model(len(data["tokenizer"]), dropout=0.1)
    collator = DataCollatorForSeq2Seq(data["tokenizer"], model=model)
    tokenizer = data["tokenizer"]

    def compute_metrics(prediction):
        return {"tokens": int((prediction.predictions != tokenizer.pad_token_id).sum())}

    common = dict(train_dataset=data["train"], eval_dataset=data["eval"], data_collator=collator,
                  compute_metrics=compute_metrics)  # fmt: skip
    if name == "hf":
        arguments = transformers.Seq2SeqTrainingArguments(str(tmp_path / name), **COMMON, **args)
        trainer = transformers.Seq2SeqTrainer(model=model, args=arguments, processing_class=tokenizer, **common)
    else:
        arguments = ORTSeq2SeqTrainingArguments(str(tmp_path / name), accelerator="cpu", **COMMON, **args)
        trainer = ORTSeq2SeqTrainer(model=model, args=arguments, tokenizer=tokenizer, **common)
    trainer.train()
    return trainer


def _numbers(entries):
    return [{k: v for k, v in e.items() if not k.endswith(TIMINGS)} for e in entries]


def test_signature_and_module_paths_are_optimums():
    from hflight.ort.trainer_seq2seq import ORTSeq2SeqTrainer as at_optimums_path
    from hflight.ort.training_args_seq2seq import ORTSeq2SeqTrainingArguments as arguments_at_optimums_path

    assert at_optimums_path is ORTSeq2SeqTrainer and arguments_at_optimums_path is ORTSeq2SeqTrainingArguments
    assert list(inspect.signature(ORTSeq2SeqTrainer.__init__).parameters) == list(
        inspect.signature(ORTTrainer.__init__).parameters
    )
    assert "gen_kwargs" in inspect.signature(ORTSeq2SeqTrainer.evaluate).parameters


def test_training_and_generation_as_transformers_seq2seq_trainer(tmp_path, data):
    trainers = {name: _trained(name, tmp_path, data, predict_with_generate=True, generation_max_length=6)
                for name in ("hf", "ort")}  # fmt: skip
    assert trainers["ort"].args.ort_inference is False  # generation runs in PyTorch
    history = {name: _numbers(t.state.log_history) for name, t in trainers.items()}
    assert len(history["ort"]) == len(history["hf"]) and sum("eval_tokens" in e for e in history["ort"]) == 2
    for theirs, ours in zip(history["hf"], history["ort"]):
        assert set(ours) == set(theirs)
        for key in theirs:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-6), (theirs.get("step"), key)
    outputs = {name: t.predict(data["eval"], num_beams=2, max_length=7) for name, t in trainers.items()}
    np.testing.assert_array_equal(outputs["ort"].predictions, outputs["hf"].predictions)
    assert _numbers([outputs["ort"].metrics]) == _numbers([outputs["hf"].metrics])


def test_generation_through_onnx_runtime_is_refused_by_name(tmp_path, data):
    with pytest.raises(ValueError, match="ort_inference=True with predict_with_generate=True"):
        ORTSeq2SeqTrainingArguments(str(tmp_path), predict_with_generate=True, ort_inference=True)
    model = seq2seq_data.bart_model(len(data["tokenizer"]), dropout=0.0)
    args = ORTSeq2SeqTrainingArguments(str(tmp_path), predict_with_generate=True, report_to="none")
    trainer = ORTSeq2SeqTrainer(model=model, args=args, tokenizer=data["tokenizer"],
                                data_collator=DataCollatorForSeq2Seq(data["tokenizer"], model=model))  # fmt: skip
    with pytest.raises(NotImplementedError, match="generation through ONNX Runtime is not available"):
        trainer.evaluate(data["eval"], inference_with_ort=True)
    with pytest.raises(NotImplementedError, match="generation through ONNX Runtime is not available"):
        trainer.predict(data["eval"], inference_with_ort=True)


def test_without_generation_prediction_runs_through_onnx_runtime(tmp_path, data):
    """Logits of unlabelled inputs from an ONNX Runtime session, as transformers' Seq2SeqTrainer computes them in
    PyTorch (hflight's ORT evaluation has no ForConditionalGeneration loss: labelled evaluation raises, naming it)."""
    inputs = data["eval"].remove_columns("labels")
    model = seq2seq_data.bart_model(len(data["tokenizer"]), dropout=0.0)
    collator = DataCollatorForSeq2Seq(data["tokenizer"], model=model)
    args = ORTSeq2SeqTrainingArguments(str(tmp_path / "ort"), per_device_eval_batch_size=4, report_to="none")
    assert args.ort_inference is True
    ours = ORTSeq2SeqTrainer(model=model, args=args, data_collator=collator).predict(inputs)
    assert evaluation_sessions(model)  # an ONNX Runtime session answered
    reference = seq2seq_data.bart_model(len(data["tokenizer"]), dropout=0.0)
    plain = transformers.Seq2SeqTrainingArguments(str(tmp_path / "hf"), per_device_eval_batch_size=4, report_to="none")
    theirs = transformers.Seq2SeqTrainer(model=reference, args=plain, data_collator=collator).predict(inputs)
    ours_logits, theirs_logits = (p[0] if isinstance(p, tuple) else p for p in (ours.predictions, theirs.predictions))
    assert ours_logits.shape == theirs_logits.shape
    np.testing.assert_allclose(ours_logits, theirs_logits, rtol=1e-4, atol=1e-4)
