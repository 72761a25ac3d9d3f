"""hflight.qa.QuestionAnsweringSeq2SeqTrainer against the trainer of transformers' run_seq2seq_qa.py
(tests/scripts/run_seq2seq_qa/trainer_seq2seq_qa.py, on transformers.Seq2SeqTrainer) (issue 23): generative QA on
synthetic SQuAD data, trained with evaluation every epoch, then evaluate and predict with generation settings;
the same SQuAD scores, losses, logged numbers and answers."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import transformers
from transformers import DataCollatorForSeq2Seq, EvalPrediction

import hflight
from hflight.qa import QuestionAnsweringSeq2SeqTrainer, load_squad_json, squad_metrics
from hflight.qa.synthetic import generate_squad
from hflight.qa.tokenizer import train_wordpiece_tokenizer

from . import seq2seq_data

SCRIPT = Path(__file__).resolve().parent / "scripts" / "run_seq2seq_qa" / "trainer_seq2seq_qa.py"
TIMINGS = ("_runtime", "_samples_per_second", "_steps_per_second", "_model_preparation_time")


def _transformers_trainer_class():
    spec = importlib.util.spec_from_file_location("trainer_seq2seq_qa", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.QuestionAnsweringSeq2SeqTrainer


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # generation: see the fixture


@pytest.fixture(scope="module")
def qa(tmp_path_factory):
    """Examples, tokenized features (``question: ... context: ...`` -> the answer text) and the tokenizer."""
    root = tmp_path_factory.mktemp("seq2seq_qa")
    train, validation = generate_squad(num_train_articles=3, num_validation_articles=2, paragraphs_per_article=2,
                                       seed=3)  # fmt: skip
    examples = {}
    for name, squad in (("train", train), ("validation", validation)):
        (root / f"{name}.json").write_text(json.dumps(squad), encoding="utf-8")
        examples[name] = load_squad_json(root / f"{name}.json")
    texts = [f"question: {e['question']} context: {e['context']}" for e in examples["train"]]
    tokenizer = train_wordpiece_tokenizer(texts, root / "tokenizer", vocab_size=400, min_frequency=1)

    def features(split, keep_ids):
        def tokenize(batch):
            sources = [f"question: {q} context: {c}" for q, c in zip(batch["question"], batch["context"])]
            inputs = tokenizer(sources, max_length=64, truncation=True)
            answers = [a["text"][0] if a["text"] else "" for a in batch["answers"]]
            inputs["labels"] = tokenizer(text_target=answers, max_length=12, truncation=True)["input_ids"]
            if keep_ids:
                inputs["example_id"] = batch["id"]
            return inputs

        data = examples[split]
        return data.map(tokenize, batched=True, remove_columns=data.column_names)

    return {"examples": examples, "train": features("train", False), "eval": features("validation", True),
            "tokenizer": tokenizer}  # fmt: skip


def _post_process(tokenizer):
    """run_seq2seq_qa.py's post-processing: decoded answers by example id, and the references."""

    def post_processing_function(examples, features, outputs, stage="eval"):
        preds = outputs.predictions[0] if isinstance(outputs.predictions, tuple) else outputs.predictions
        preds = np.where(preds != -100, preds, tokenizer.pad_token_id)
        decoded = tokenizer.batch_decode(preds, skip_special_tokens=True)
        feature_of = {feature_id: i for i, feature_id in enumerate(features["example_id"])}
        predictions = [{"id": e["id"], "prediction_text": decoded[feature_of[e["id"]]]} for e in examples]
        references = [{"id": e["id"], "answers": e["answers"]} for e in examples]
        return EvalPrediction(predictions=predictions, label_ids=references)

    return post_processing_function


def _compute_metrics(prediction):
    return squad_metrics(prediction.predictions, prediction.label_ids)


def _pair(tmp_path, qa, train=False, **args):
    """Both trainers on the same tiny BART; with ``train``, each trains right after it is built (the seed both set
    at construction then governs its own dropout)."""
    tokenizer = qa["tokenizer"]
    classes = {"hf": (_transformers_trainer_class(), transformers.Seq2SeqTrainingArguments),
               "hl": (QuestionAnsweringSeq2SeqTrainer, hflight.Seq2SeqTrainingArguments)}  # fmt: skip
    trainers = {}
    for name, (trainer_cls, args_cls) in classes.items():
        model = seq2seq_data.bart_model(len(tokenizer), dropout=0.1)
        arguments = args_cls(
            str(tmp_path / name), per_device_train_batch_size=8, per_device_eval_batch_size=6, learning_rate=3e-3,
            num_train_epochs=2, logging_steps=1, eval_strategy="epoch", save_strategy="no", predict_with_generate=True,
            report_to="none", disable_tqdm=True, seed=0, **args,
        )  # fmt: skip
        trainers[name] = trainer_cls(
            model=model, args=arguments, train_dataset=qa["train"], eval_dataset=qa["eval"],
            eval_examples=qa["examples"]["validation"], processing_class=tokenizer,
            data_collator=DataCollatorForSeq2Seq(tokenizer, model=model), compute_metrics=_compute_metrics,
            post_process_function=_post_process(tokenizer),
        )  # fmt: skip
        if train:
            trainers[name].train()
    return trainers


def _numbers(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.endswith(TIMINGS)}


def test_train_evaluate_predict_as_run_seq2seq_qa(tmp_path, qa):
    trainers = _pair(tmp_path, qa, train=True, generation_max_length=8, generation_num_beams=2)
    history = {name: [_numbers(e) for e in t.state.log_history] for name, t in trainers.items()}
    assert len(history["hl"]) == len(history["hf"])
    for theirs, ours in zip(history["hf"], history["hl"]):
        assert set(ours) == set(theirs)
        for key in theirs:
            assert ours[key] == pytest.approx(theirs[key], rel=0, abs=0), (theirs.get("step"), key)
    evaluations = [e for e in history["hl"] if "eval_f1" in e]
    assert len(evaluations) == 2 and "eval_loss" in evaluations[0]

    metrics = {name: t.evaluate(num_beams=1, max_new_tokens=5) for name, t in trainers.items()}
    assert _numbers(metrics["hl"]) == _numbers(metrics["hf"])
    examples = qa["examples"]["validation"]
    outputs = {name: t.predict(qa["eval"], examples, max_length=6) for name, t in trainers.items()}
    assert outputs["hl"].predictions == outputs["hf"].predictions
    assert _numbers(outputs["hl"].metrics) == _numbers(outputs["hf"].metrics)
    assert {"test_exact_match", "test_f1", "test_loss"} <= set(outputs["hl"].metrics)
    texts = {p["prediction_text"] for p in outputs["hl"].predictions}
    assert len(texts) > 1  # varied answers


def test_without_post_processing_predict_returns_the_loop_output(tmp_path, qa):
    trainers = _pair(tmp_path, qa)
    for trainer in trainers.values():
        trainer.post_process_function = None
    outputs = {name: t.predict(qa["eval"], None, max_length=5) for name, t in trainers.items()}
    assert type(outputs["hl"]).__name__ == type(outputs["hf"]).__name__ == "EvalLoopOutput"
    np.testing.assert_array_equal(outputs["hl"].predictions, outputs["hf"].predictions)
    assert _numbers(outputs["hl"].metrics) == _numbers(outputs["hf"].metrics)
