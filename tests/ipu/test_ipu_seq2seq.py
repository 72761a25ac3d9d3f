"""IPUSeq2SeqTrainer / IPUSeq2SeqTrainingArguments (optimum-graphcore's API) and hflight.ipu.utils.check_min_version,
against the poptorch test double (issue 23): the loss from the inference executable, generation as transformers'
Seq2SeqTrainer generates, training with generation-based evaluation every epoch."""

from __future__ import annotations

import copy
import dataclasses
import functools
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


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # generation: see the fixture


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


def _transformers_trainer(tmp_path, data, model=None, batch_size=2, **kwargs):
    model = model if model is not None else seq2seq_data.bart_model(len(data["tokenizer"]), dropout=0.0)
    args = transformers.Seq2SeqTrainingArguments(str(tmp_path / "hf"), per_device_eval_batch_size=batch_size,
                                                  report_to="none", predict_with_generate=True)  # fmt: skip
    return transformers.Seq2SeqTrainer(model=model, args=args, processing_class=data["tokenizer"],
                                       data_collator=default_data_collator, **kwargs)  # fmt: skip


def _transformers_predict(tmp_path, data, **gen_kwargs):
    return _transformers_trainer(tmp_path, data).predict(data["eval"], **gen_kwargs)


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


# ---- generation on the inference executables (optimum-graphcore's IPUGenerationMixin, without KV cache) -------------
def _role_executors(executors, role):
    """The executors of the generation's encoder ("_EncoderStep") or decoder step ("_DecoderStep") modules."""
    return [e for e in executors if type(e.model).__name__ == role]


def _spy_forward(monkeypatch, cls, ran):
    """Record the module every ``cls.forward`` call runs on (the double runs device copies of the host model)."""
    original = cls.forward

    @functools.wraps(original)
    def spy(self, *args, **kwargs):
        ran.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, "forward", spy)


def _decoder_steps(data, batch_size=2, **gen_kwargs):
    """How many decoder forward passes transformers' own generate makes over the eval set (with its KV cache)."""
    model = seq2seq_data.bart_model(len(data["tokenizer"]), dropout=0.0).eval()
    calls = []
    model.model.decoder.register_forward_hook(lambda *_: calls.append(1))
    rows = data["eval"]
    with torch.no_grad():
        for start in range(0, len(rows), batch_size):
            batch = rows[start : start + batch_size]
            model.generate(input_ids=torch.tensor(batch["input_ids"]),
                           attention_mask=torch.tensor(batch["attention_mask"]), **gen_kwargs)  # fmt: skip
    return len(calls)


def test_generation_runs_on_the_inference_executables_not_the_host_model(poptorch_double, executors, tmp_path, data,
                                                                         monkeypatch):  # fmt: skip
    theirs = _transformers_predict(tmp_path, data, max_new_tokens=5)
    steps = _decoder_steps(data, max_new_tokens=5)
    trainer = _ipu_trainer(tmp_path, data)
    ran = []
    _spy_forward(monkeypatch, transformers.BartForConditionalGeneration, ran)
    _spy_forward(monkeypatch, transformers.models.bart.modeling_bart.BartEncoder, ran)
    ours = trainer.predict(data["eval"], max_new_tokens=5)
    np.testing.assert_array_equal(ours.predictions, theirs.predictions)
    assert ran and not any(module is trainer.model or module is trainer.model.model.encoder for module in ran)
    (encoder,), (decoder,) = _role_executors(executors, "_EncoderStep"), _role_executors(executors, "_DecoderStep")
    assert encoder.compile_count == 1 and len(encoder.calls) == 5  # once per batch
    assert decoder.compile_count == 1 and len(decoder.calls) == steps  # once per generated token, one executable
    # the decoder input padded to the generation's max_length (max_new_tokens + the start token): one static shape
    expected = {"t": (1,), "decoder_input_ids": (2, 6), "encoder_hidden_states": (2, 16, 32), "attention_mask": (2, 16)}
    assert all(call.input_shapes == expected for call in decoder.calls)


def test_beam_search_evaluation_and_metrics_match_transformers(poptorch_double, executors, tmp_path, data):
    def compute_metrics(prediction):
        predictions, labels = prediction.predictions, prediction.label_ids
        labels = np.where(labels == -100, data["tokenizer"].pad_token_id, labels)
        width = min(predictions.shape[1], labels.shape[1])
        return {"token_match": float((predictions[:, :width] == labels[:, :width]).mean()),
                "gen_tokens": int((predictions != data["tokenizer"].pad_token_id).sum())}  # fmt: skip

    trainer = _ipu_trainer(tmp_path, data)
    trainer.compute_metrics = compute_metrics
    ours = trainer.evaluate(max_length=8, num_beams=2)
    theirs = _transformers_trainer(tmp_path, data, eval_dataset=data["eval"], compute_metrics=compute_metrics)
    theirs = theirs.evaluate(max_length=8, num_beams=2)
    for key in ("eval_token_match", "eval_gen_tokens"):
        assert ours[key] == theirs[key]
    assert ours["eval_loss"] == pytest.approx(theirs["eval_loss"], rel=1e-6)
    (decoder,) = _role_executors(executors, "_DecoderStep")
    assert decoder.compile_count == 1 and decoder.calls[0].input_shapes["decoder_input_ids"] == (4, 8)  # 2 x 2 beams


def test_one_compilation_per_static_shape(poptorch_double, executors, tmp_path, data):
    unlabelled = data["eval"].remove_columns("labels")  # no loss executable: batches of 4, 4 and 2 rows
    theirs = _transformers_trainer(tmp_path, data, batch_size=4).predict(unlabelled, max_length=7)
    ours = _ipu_trainer(tmp_path, data, per_device_eval_batch_size=4).predict(unlabelled, max_length=7)
    np.testing.assert_array_equal(ours.predictions, theirs.predictions)
    encoders, decoders = _role_executors(executors, "_EncoderStep"), _role_executors(executors, "_DecoderStep")
    # one executable per static shape, each compiled once, each called with its shape only
    assert [e.compile_count for e in encoders + decoders] == [1, 1, 1, 1]
    assert [{c.input_shapes["inputs"] for c in e.calls} for e in encoders] == [{(4, 16)}, {(2, 16)}]
    assert [len(e.calls) for e in encoders] == [2, 1]
    assert [{c.input_shapes["decoder_input_ids"] for c in e.calls} for e in decoders] == [{(4, 7)}, {(2, 7)}]


def test_inference_device_iterations_run_one_step_per_micro_batch(poptorch_double, executors, tmp_path, data):
    theirs = _transformers_predict(tmp_path, data, max_length=6, num_beams=2)
    trainer = _ipu_trainer(tmp_path, data, IPUConfig(inference_device_iterations=2), pad_on_batch_axis=True)
    ours = trainer.predict(data["eval"], max_length=6, num_beams=2)  # combined batches of 4, the last one padded
    np.testing.assert_array_equal(ours.predictions, theirs.predictions)
    (decoder,) = _role_executors(executors, "_DecoderStep")
    assert decoder.compile_count == 1
    assert {(c.input_shapes["t"], c.input_shapes["decoder_input_ids"], c.micro_batches) for c in decoder.calls} == {
        ((2,), (8, 6), 2)
    }


def test_evaluation_after_training_generates_with_the_trained_weights(poptorch_double, tmp_path, data):
    generated = []
    trainer = _ipu_trainer(tmp_path, data, eval_strategy="epoch", num_train_epochs=2, generation_max_length=6,
                           learning_rate=3e-3)  # fmt: skip
    trainer.compute_metrics = lambda prediction: generated.append(prediction.predictions) or {}
    trainer.train()
    theirs = _transformers_trainer(tmp_path, data, copy.deepcopy(trainer.model)).predict(data["eval"], max_length=6)
    assert len(generated) == 2 and not np.array_equal(generated[0], generated[1])  # the weights changed in between
    np.testing.assert_array_equal(generated[1], theirs.predictions)


@pytest.mark.parametrize(
    ("overrides", "gen_kwargs", "message"),
    [
        ({"inference_parallelize_kwargs": {"use_cache": True}}, {}, r"use_cache=True"),
        ({"inference_parallelize_kwargs": {"on_device_generation_steps": 4}}, {}, r"on_device_generation_steps=4"),
        ({"inference_parallelize_kwargs": {"use_encoder_output_buffer": True}}, {}, r"use_encoder_output_buffer"),
        ({"inference_parallelize_kwargs": {"max_length": 8}}, {}, r"max_length=8"),
        ({"execute_encoder_on_cpu_for_generation": True}, {}, r"execute_encoder_on_cpu_for_generation"),
        ({}, {"use_cache": True}, r"generate\(use_cache=True\)"),
    ],
)
def test_generation_options_act_or_raise_naming_themselves(poptorch_double, tmp_path, data, overrides, gen_kwargs,
                                                           message):  # fmt: skip
    trainer = _ipu_trainer(tmp_path, data, IPUConfig(**overrides))
    with pytest.raises(NotImplementedError, match=message):
        trainer.predict(data["eval"].select(range(2)), max_length=4, **gen_kwargs)


def test_generation_options_left_at_their_defaults_are_accepted(poptorch_double, tmp_path, data):
    config = IPUConfig(inference_parallelize_kwargs={"use_cache": False, "on_device_generation_steps": 0})
    theirs = _transformers_predict(tmp_path, data, max_length=4)
    ours = _ipu_trainer(tmp_path, data, config).predict(data["eval"], max_length=4)
    np.testing.assert_array_equal(ours.predictions, theirs.predictions)
