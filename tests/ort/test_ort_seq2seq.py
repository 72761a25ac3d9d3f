"""optimum's ORTSeq2SeqTrainer / ORTSeq2SeqTrainingArguments on hflight.ort (issue 23): training as ORTTrainer
(eager PyTorch here: no onnxruntime-training in this environment), generation-based evaluation in PyTorch with
transformers' Seq2SeqTrainer numbers, ONNX Runtime evaluation without generation (logits, and the labelled loss),
and generation through ONNX Runtime (encoder/decoder sessions) with transformers' tokens, checked against eager."""

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

from hflight.ort import ORTSeq2SeqTrainer, ORTSeq2SeqTrainingArguments, ORTStrategy, ORTTrainer
from hflight.ort.checks import ORTMismatchError
from hflight.ort.session import LOSSES
from hflight.ort.strategy import evaluation_sessions, generators

_spec = importlib.util.spec_from_file_location("seq2seq_data", Path(__file__).parents[1] / "seq2seq_data.py")
seq2seq_data = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("seq2seq_data", seq2seq_data)
_spec.loader.exec_module(seq2seq_data)

COMMON = dict(per_device_train_batch_size=4, per_device_eval_batch_size=4, num_train_epochs=2, learning_rate=1e-3,
              logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, seed=3,
              eval_strategy="epoch")  # fmt: skip
TIMINGS = ("_runtime", "_samples_per_second", "_steps_per_second", "_model_preparation_time")


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # generation: see the fixture


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


def test_without_generation_prediction_runs_through_onnx_runtime(tmp_path, data):
    """Logits of unlabelled inputs from an ONNX Runtime session, as transformers' Seq2SeqTrainer computes them in
    PyTorch."""
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


# ---- generation through ONNX Runtime ----------------------------------------------------------------------------
def _generating(tmp_path, data, collator_model=True, **args):
    """An untrained tiny BART (wide weights: varied outputs) in an ORTSeq2SeqTrainer that generates, with a token
    count metric; ``collator_model=False``: the collator gives no decoder_input_ids (the model makes them)."""
    model = seq2seq_data.bart_model(len(data["tokenizer"]), dropout=0.0)
    collator = DataCollatorForSeq2Seq(data["tokenizer"], model=model if collator_model else None)
    arguments = ORTSeq2SeqTrainingArguments(str(tmp_path / "gen"), per_device_eval_batch_size=4, report_to="none",
                                            accelerator="cpu", disable_tqdm=True,
                                            **{"predict_with_generate": True, **args})  # fmt: skip
    tokenizer = data["tokenizer"]

    def compute_metrics(prediction):  # generated tokens, or the logits' arg-max without generation
        tokens = prediction.predictions
        tokens = tokens[0].argmax(-1) if isinstance(tokens, tuple) else tokens
        return {"tokens": int((tokens != tokenizer.pad_token_id).sum())}

    return ORTSeq2SeqTrainer(model=model, args=arguments, tokenizer=tokenizer, data_collator=collator,
                             compute_metrics=compute_metrics)  # fmt: skip


@pytest.mark.parametrize("num_beams", [1, 2])
def test_generation_through_onnx_runtime_gives_eager_and_transformers_tokens(tmp_path, data, num_beams):
    trainer = _generating(tmp_path, data, ort_inference=True, generation_max_length=9, generation_num_beams=num_beams)
    ours = trainer.predict(data["eval"])
    (generator,) = generators(trainer.model)
    calls = generator.session_calls  # per batch: the encoder, the decoder on the first token, then with past
    assert calls["encoder"] == 3 and calls["decoder"] == 3 and calls["decoder_past"] >= 3 * 6
    assert generator.check_count >= 1 and generator.export_count == 1
    eager = trainer.predict(data["eval"], inference_with_ort=False)
    assert generator.generate_count == 3  # the eager predict did not use the sessions
    np.testing.assert_array_equal(ours.predictions, eager.predictions)
    assert _numbers([ours.metrics])[0] == pytest.approx(_numbers([eager.metrics])[0], rel=1e-5)
    reference = seq2seq_data.bart_model(len(data["tokenizer"]), dropout=0.0)
    plain = transformers.Seq2SeqTrainingArguments(str(tmp_path / "hf"), per_device_eval_batch_size=4, report_to="none",
                                                  predict_with_generate=True, generation_max_length=9,
                                                  generation_num_beams=num_beams)  # fmt: skip
    theirs = transformers.Seq2SeqTrainer(model=reference, args=plain, processing_class=data["tokenizer"],
                                         data_collator=DataCollatorForSeq2Seq(data["tokenizer"], model=reference),
                                         compute_metrics=trainer.compute_metrics).predict(data["eval"])  # fmt: skip
    np.testing.assert_array_equal(ours.predictions, theirs.predictions)
    assert ours.metrics["test_loss"] == pytest.approx(theirs.metrics["test_loss"], rel=1e-5)
    assert ours.metrics["test_tokens"] == theirs.metrics["test_tokens"]


def test_evaluate_through_onnx_runtime_gives_eager_metrics(tmp_path, data):
    trainer = _generating(tmp_path, data, collator_model=False, generation_max_length=8)
    assert trainer.args.ort_inference is False  # with predict_with_generate the default generates in PyTorch
    eager = trainer.evaluate(data["eval"])
    assert not generators(trainer.model)
    ours = trainer.evaluate(data["eval"], inference_with_ort=True, num_beams=2)
    assert generators(trainer.model)[0].generate_count == 3
    eager_beams = trainer.evaluate(data["eval"], inference_with_ort=False, num_beams=2)
    assert ours["eval_loss"] == pytest.approx(eager["eval_loss"], rel=1e-5)
    assert _numbers([ours])[0] == pytest.approx(_numbers([eager_beams])[0], rel=1e-5)
    assert evaluation_sessions(trainer.model)[0].check_count >= 1  # the ORT loss was compared with the model's
    with torch.no_grad():  # as training would: the next evaluation through ONNX Runtime exports again
        trainer.model.lm_head.weight.mul_(1.5)
    changed = trainer.evaluate(data["eval"], inference_with_ort=True)
    assert generators(trainer.model)[0].export_count == 2
    assert changed["eval_loss"] == pytest.approx(
        trainer.evaluate(data["eval"], inference_with_ort=False)["eval_loss"], rel=1e-5
    )


def test_a_corrupted_decoder_session_raises_a_mismatch(tmp_path, data):
    trainer = _generating(tmp_path, data, ort_inference=True, generation_max_length=8)
    trainer.predict(data["eval"].select(range(4)))  # exports the encoder and the decoder
    (generator,) = generators(trainer.model)
    decoder = generator.sessions["decoder_past"]

    class Corrupted:  # the decoder with past key values, its logits making one token the most likely
        def run(self, names, feed):
            logits, *states = decoder.run(names, feed)
            logits[:, -1, 7] = logits.max() + 10.0
            return [logits, *states]

    generator.sessions["decoder_past"] = Corrupted()
    trainer.ort_strategy.check_outputs = "all"  # every batch compared, whatever its input shape
    with pytest.raises(ORTMismatchError, match=r"batch \d+ .*row 0, first difference at position 2: ONNX Runtime 7"):
        trainer.predict(data["eval"].select(range(4, 8)))  # a new input shape: compared with eager generation


def test_labelled_encoder_decoder_loss_through_onnx_runtime_is_the_models(tmp_path, data, monkeypatch):
    """Without generation: eval_loss from the session's logits equals eager evaluation's and transformers'; with the
    collator's decoder inputs and without them (made from the labels, as the model's forward does)."""
    for collator_model in (True, False):
        trainer = _generating(tmp_path, data, collator_model=collator_model, predict_with_generate=False)
        assert trainer.args.ort_inference is True
        ours = trainer.evaluate(data["eval"])
        eager = trainer.evaluate(data["eval"], inference_with_ort=False)
        assert ours["eval_loss"] == pytest.approx(eager["eval_loss"], rel=1e-5)
        assert ours["eval_tokens"] == eager["eval_tokens"]
        assert evaluation_sessions(trainer.model)[0].check_count >= 1
    reference = seq2seq_data.bart_model(len(data["tokenizer"]), dropout=0.0)
    plain = transformers.Seq2SeqTrainingArguments(str(tmp_path / "hf"), per_device_eval_batch_size=4, report_to="none")
    theirs = transformers.Seq2SeqTrainer(model=reference, args=plain, data_collator=trainer.data_collator)
    assert ours["eval_loss"] == pytest.approx(theirs.evaluate(data["eval"])["eval_loss"], rel=1e-5)
    # a wrong loss (the causal LM's, shifted by one) is caught by the comparison with the model's own
    monkeypatch.setitem(LOSSES, "ForConditionalGeneration", LOSSES["ForCausalLM"])
    fresh = _generating(tmp_path, data, predict_with_generate=False)
    with pytest.raises(ORTMismatchError, match="the largest difference in loss"):
        fresh.evaluate(data["eval"])


def test_generation_through_onnx_runtime_refuses_what_it_cannot_do(tmp_path, data):
    trainer = _generating(tmp_path, data, ort_inference=True, generation_max_length=8)
    with pytest.raises(ValueError, match=r"cannot honour \['output_attentions'\]"):
        trainer.predict(data["eval"], output_attentions=True)
    generator = ORTStrategy().generator(trainer.model)
    with pytest.raises(ValueError, match=r"takes input_ids, attention_mask \(and labels, unused\); .*'head_mask'"):
        generator.generate(input_ids=torch.tensor([[5, 6, 7]]), head_mask=torch.ones(1, 2), max_length=4)
    with pytest.raises(ValueError, match=r"decoder graph does not take: \['decoder_attention_mask'\]"):
        generator.generate(input_ids=torch.tensor([[5, 6, 7]]), max_length=4, cache_implementation="static")
    with pytest.raises(ValueError, match=r"exporter='dynamo' \(ort_exporter\) is not available"):
        ORTStrategy(exporter="dynamo").generator(trainer.model)
    with pytest.raises(ValueError, match=r"quantize='dynamic' \(ort_quantize\) is not available"):
        ORTStrategy(quantize="dynamic").generator(trainer.model)
    encoder_only = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32))  # fmt: skip
    with pytest.raises(ValueError, match="BertForMaskedLM is not an encoder-decoder model"):
        ORTStrategy().generator(encoder_only)


def test_t5_and_marian_generate_and_evaluate_through_onnx_runtime_as_eager():
    """Two other encoder-decoders (T5: relative position buckets, its own shift; Marian: loss_type None): tokens
    generated through the sessions equal eager ones, greedy and beams, with and without past key values; the ORT loss
    is the model's own."""
    from hflight.ort.generation import ORTSeq2SeqGenerator
    from hflight.ort.session import ORTEvaluationModel

    torch.manual_seed(0)
    t5 = transformers.T5Config(
        vocab_size=80,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
        initializer_factor=3.0,
    )
    marian = transformers.MarianConfig(vocab_size=80, d_model=32, encoder_layers=1, decoder_layers=1,
                                       encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                       decoder_ffn_dim=64, pad_token_id=79, decoder_start_token_id=79, eos_token_id=0,
                                       max_position_embeddings=64, init_std=0.3)  # fmt: skip
    models = (transformers.T5ForConditionalGeneration(t5).eval(), transformers.MarianMTModel(marian).eval())
    ids = torch.randint(2, 70, (4, 10))
    mask = torch.ones_like(ids)
    mask[2, 6:] = 0
    labels = torch.randint(2, 70, (4, 5))
    labels[1, 3:] = -100
    for model in models:
        generator = ORTSeq2SeqGenerator(model, check_outputs=False)
        for gen_kwargs in ({"max_length": 9}, {"max_length": 9, "num_beams": 2}, {"max_length": 9, "use_cache": False}):
            ours = generator.generate(input_ids=ids, attention_mask=mask, **gen_kwargs)
            torch.testing.assert_close(ours, model.generate(input_ids=ids, attention_mask=mask, **gen_kwargs))
        assert generator.session_calls["decoder_past"] >= 2 * 7  # with past key values (use_cache, the default)
        assert generator.session_calls["decoder"] >= 2 + 8  # without: every step on the whole prefix
        session = ORTEvaluationModel(model, ["labels"])
        loss = session(input_ids=ids, attention_mask=mask, labels=labels).loss
        assert session.check_count == 1  # the traced batch, the loss included
        torch.testing.assert_close(loss, model(input_ids=ids, attention_mask=mask, labels=labels).loss)
