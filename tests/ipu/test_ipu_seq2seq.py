"""IPUSeq2SeqTrainer / IPUSeq2SeqTrainingArguments (optimum-graphcore's API) and hflight.ipu.utils.check_min_version,
against the poptorch test double (issue 23): the loss from the inference executable, generation as transformers'
Seq2SeqTrainer generates, training with generation-based evaluation every epoch."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from transformers import default_data_collator

from hflight.ipu import IPUConfig, IPUSeq2SeqTrainer, IPUSeq2SeqTrainingArguments, IPUTrainer
from hflight.ipu.utils import API_VERSION, check_min_version

_spec = importlib.util.spec_from_file_location("seq2seq_data", Path(__file__).parents[1] / "seq2seq_data.py")
seq2seq_data = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("seq2seq_data", seq2seq_data)
_spec.loader.exec_module(seq2seq_data)

SEQ2SEQ_FIELDS = {"sortish_sampler", "predict_with_generate", "generation_max_length", "generation_num_beams",
                  "generation_config"}  # fmt: skip


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # generation: many tiny steps, far faster on one thread of a shared CPU
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    import datasets

    tokenizer = seq2seq_data.tokenizer(tmp_path_factory.mktemp("ipu_seq2seq_tokenizer"))

    def dataset(n, seed):  # padded to fixed lengths: an IPU executable runs the shapes it was compiled for
        records = seq2seq_data.summarization_records(n, seed=seed)
        sources = tokenizer([r["text"] for r in records], max_length=16, padding="max_length", truncation=True)
        targets = tokenizer(text_target=[r["summary"] for r in records], max_length=8, padding="max_length",
                            truncation=True)  # fmt: skip
        labels = [[t if t != tokenizer.pad_token_id else -100 for t in row] for row in targets["input_ids"]]
        return datasets.Dataset.from_dict({"input_ids": sources["input_ids"],
                                           "attention_mask": sources["attention_mask"], "labels": labels})  # fmt: skip

    return {"tokenizer": tokenizer, "train": dataset(16, 1), "eval": dataset(10, 2)}


def _ipu_trainer(tmp_path, data, ipu_config=None, **kwargs):
    model = seq2seq_data.bart_model(len(data["tokenizer"]), dropout=0.0)
    base = dict(per_device_train_batch_size=2, per_device_eval_batch_size=2, num_train_epochs=1, learning_rate=1e-3,
                logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, fp32=True,
                predict_with_generate=True)  # fmt: skip
    args = IPUSeq2SeqTrainingArguments(str(tmp_path / "ipu"), **{**base, **kwargs})
    return IPUSeq2SeqTrainer(
        model, ipu_config or IPUConfig(), args, data_collator=default_data_collator,
        train_dataset=data["train"], eval_dataset=data["eval"], tokenizer=data["tokenizer"],
    )  # fmt: skip


def _transformers_predict(tmp_path, data, **gen_kwargs):
    model = seq2seq_data.bart_model(len(data["tokenizer"]), dropout=0.0)
    args = transformers.Seq2SeqTrainingArguments(str(tmp_path / "hf"), per_device_eval_batch_size=2,
                                                  report_to="none", predict_with_generate=True)  # fmt: skip
    trainer = transformers.Seq2SeqTrainer(
        model=model, args=args, processing_class=data["tokenizer"], data_collator=default_data_collator
    )
    return trainer.predict(data["eval"], **gen_kwargs)


def test_signature_and_fields_are_optimum_graphcores():
    ours = list(inspect.signature(IPUSeq2SeqTrainer.__init__).parameters)
    assert ours == list(inspect.signature(IPUTrainer.__init__).parameters)
    for name in ("evaluate", "predict"):
        parameters = inspect.signature(getattr(IPUSeq2SeqTrainer, name)).parameters
        assert list(parameters)[-1] == "gen_kwargs" and parameters["gen_kwargs"].kind is inspect.Parameter.VAR_KEYWORD
    fields = {f.name for f in dataclasses.fields(IPUSeq2SeqTrainingArguments)}
    assert SEQ2SEQ_FIELDS <= fields and {f.name for f in dataclasses.fields(IPUTrainer.__init__.__globals__[
        "IPUTrainingArguments"])} <= fields  # fmt: skip
    args = IPUSeq2SeqTrainingArguments("o", predict_with_generate=True, generation_num_beams=2)
    assert args.ipu_precision == "16-true" and args.gradient_accumulation_steps == 1
    assert type(args.to_transformers()) is transformers.Seq2SeqTrainingArguments


def test_check_min_version_as_optimum_graphcore():
    check_min_version("0.7.0")
    check_min_version("0.7.0.dev0")
    check_min_version(API_VERSION)
    with pytest.raises(ImportError, match="requires a source install from HuggingFace Optimum-Graphcore"):
        check_min_version("0.8.0.dev0")
    with pytest.raises(ImportError, match=r"requires a minimum version of 1\.0\.0, but the version found is 0\.7\.1"):
        check_min_version("1.0.0")


def test_predict_generates_as_transformers_with_the_loss_from_the_executable(poptorch_double, executors, tmp_path,
                                                                             data):  # fmt: skip
    trainer = _ipu_trainer(tmp_path, data)
    ours = trainer.predict(data["eval"], max_length=8, num_beams=2)
    theirs = _transformers_predict(tmp_path, data, max_length=8, num_beams=2)
    np.testing.assert_array_equal(ours.predictions, theirs.predictions)
    np.testing.assert_array_equal(ours.label_ids, theirs.label_ids)
    assert ours.metrics["test_loss"] == pytest.approx(theirs.metrics["test_loss"], rel=1e-6)
    assert any(not e.training for e in executors)  # the loss came through an inference executable


def test_training_with_generation_every_epoch(poptorch_double, tmp_path, data):
    seen = []

    def compute_metrics(prediction):
        generated = prediction.predictions != data["tokenizer"].pad_token_id
        seen.append((*prediction.predictions.shape, int(generated.sum(axis=1).max())))
        return {"gen_tokens": int(generated.sum())}

    trainer = _ipu_trainer(tmp_path, data, IPUConfig(device_iterations=2), eval_strategy="epoch",
                           num_train_epochs=2, generation_max_length=6)  # fmt: skip
    trainer.compute_metrics = compute_metrics
    trainer.train()
    evaluations = [e for e in trainer.state.log_history if "eval_gen_tokens" in e]
    # every eval row; at most generation_max_length tokens, padded to the model's generation max_length (20), as
    # transformers pads them
    assert len(evaluations) == 2 and [shape[:2] for shape in seen] == [(10, 20), (10, 20)]
    assert all(shape[2] <= 6 for shape in seen)
    assert all(np.isfinite(e["eval_loss"]) for e in evaluations)
