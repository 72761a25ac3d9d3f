"""hflight.Seq2SeqTrainer and Seq2SeqTrainingArguments against transformers' (issue 23): the same arguments, the
same generated predictions, labels and metrics for every way of setting generation (``**gen_kwargs``, the
arguments' ``generation_*`` fields, ``generation_config``), including generated batches of different lengths."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest
import transformers
from transformers import DataCollatorForSeq2Seq, GenerationConfig

import hflight
from hflight.arguments.training_args import HFLIGHT_FIELDS

from . import seq2seq_data

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # generation: see the fixture


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return seq2seq_data.tokenizer(tmp_path_factory.mktemp("seq2seq_tokenizer"))


@pytest.fixture(scope="module")
def eval_dataset(tokenizer):
    import datasets

    records = seq2seq_data.summarization_records(14, seed=5)
    sources = tokenizer([r["text"] for r in records], max_length=32, truncation=True)
    targets = tokenizer(text_target=[r["summary"] for r in records], max_length=12, truncation=True)
    return datasets.Dataset.from_dict(
        {"input_ids": sources["input_ids"], "attention_mask": sources["attention_mask"], "labels": targets["input_ids"]}
    )


def _metrics(tokenizer):
    def compute_metrics(prediction):
        preds = np.where(prediction.predictions != -100, prediction.predictions, tokenizer.pad_token_id)
        labels = np.where(prediction.label_ids != -100, prediction.label_ids, tokenizer.pad_token_id)
        decoded = tokenizer.batch_decode(preds, skip_special_tokens=True)
        references = tokenizer.batch_decode(labels, skip_special_tokens=True)
        return {
            "exact": float(np.mean([p == r for p, r in zip(decoded, references)])),
            "gen_len": float(np.mean([np.count_nonzero(p != tokenizer.pad_token_id) for p in preds])),
            "first_token_sum": int(preds[:, 1].sum()),
        }

    return compute_metrics


def _pair(tmp_path, tokenizer, eval_dataset=None, model_generation=None, batch_size=4, **args):
    """The same untrained tiny BART under transformers' and hflight's Seq2SeqTrainer."""
    trainers = {}
    for name, module in (("hf", transformers), ("hl", hflight)):
        model = seq2seq_data.bart_model(len(tokenizer), dropout=0.0)
        if model_generation is not None:
            model.generation_config = model_generation(model.generation_config)
        arguments = module.Seq2SeqTrainingArguments(
            str(tmp_path / name), per_device_eval_batch_size=batch_size, report_to="none", disable_tqdm=True, **args
        )
        trainers[name] = module.Seq2SeqTrainer(
            model=model,
            args=arguments,
            eval_dataset=eval_dataset,
            processing_class=tokenizer,
            data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
            compute_metrics=_metrics(tokenizer),
        )
    return trainers


def _same_outputs(theirs, ours):
    np.testing.assert_array_equal(ours.predictions, theirs.predictions)
    np.testing.assert_array_equal(ours.label_ids, theirs.label_ids)
    timing = ("_runtime", "_samples_per_second", "_steps_per_second", "_model_preparation_time")
    keep = lambda m: {k: v for k, v in m.items() if not k.endswith(timing)}  # noqa: E731
    assert keep(ours.metrics) == keep(theirs.metrics)
    # transformers also reports {prefix}_model_preparation_time once a model was prepared outside training (a
    # timing of accelerate's prepare; hflight's Trainer has no such step)
    assert set(keep(ours.metrics)) == set(keep(theirs.metrics))


def test_arguments_are_transformers_seq2seq_arguments_with_lightnings_fields():
    ours = dataclasses.fields(hflight.Seq2SeqTrainingArguments)
    theirs = dataclasses.fields(transformers.Seq2SeqTrainingArguments)
    assert [f.name for f in ours[: len(theirs)]] == [f.name for f in theirs]
    assert [f.name for f in ours[len(theirs) :]] == list(HFLIGHT_FIELDS)
    for a, b in zip(ours, theirs):
        assert (a.default, a.metadata.get("help")) == (b.default, b.metadata.get("help")), a.name
    parser = transformers.HfArgumentParser(hflight.Seq2SeqTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(
        ["--output_dir", "o", "--predict_with_generate", "--generation_max_length", "9", "--generation_num_beams", "3"]
    )
    assert isinstance(args, hflight.TrainingArguments)
    assert (args.predict_with_generate, args.generation_max_length, args.generation_num_beams) == (True, 9, 3)
    plain = args.to_transformers()
    assert type(plain) is transformers.Seq2SeqTrainingArguments
    assert plain.to_dict() == transformers.Seq2SeqTrainingArguments(**{
        f.name: getattr(plain, f.name) for f in dataclasses.fields(plain) if f.init
    }).to_dict()  # fmt: skip
    config = GenerationConfig(max_length=7, num_beams=2)
    with_config = hflight.Seq2SeqTrainingArguments("o", generation_config=config)
    assert with_config.to_dict()["generation_config"] == config.to_dict()


def test_the_trainer_methods_have_transformers_parameters():
    for name in ("__init__", "evaluate", "predict", "prediction_step", "load_generation_config"):
        theirs = list(inspect.signature(getattr(transformers.Seq2SeqTrainer, name)).parameters)
        ours = list(inspect.signature(getattr(hflight.Seq2SeqTrainer, name)).parameters)
        assert ours[: len(theirs)] == theirs, name  # hflight's __init__ also takes the older tokenizer= keyword


def test_transformers_arguments_are_accepted(tmp_path, tokenizer):
    model = seq2seq_data.bart_model(len(tokenizer), dropout=0.0)
    args = transformers.Seq2SeqTrainingArguments(str(tmp_path), predict_with_generate=True, generation_num_beams=3)
    trainer = hflight.Seq2SeqTrainer(model=model, args=args, processing_class=tokenizer)
    assert type(trainer.args) is hflight.Seq2SeqTrainingArguments
    assert (trainer.args.predict_with_generate, trainer.args.generation_num_beams) == (True, 3)
    plain = hflight.Seq2SeqTrainer(model=model, args=hflight.TrainingArguments(str(tmp_path)))
    assert type(plain.args) is hflight.Seq2SeqTrainingArguments and plain.args.predict_with_generate is False
    with pytest.raises(TypeError, match="Seq2SeqTrainer: args must be Seq2SeqTrainingArguments"):
        hflight.Seq2SeqTrainer(model=model, args={"output_dir": "x"})


@pytest.mark.parametrize(
    "args, gen_kwargs",
    [
        ({}, {}),  # the model's generation config: max_length 20, greedy
        ({}, {"max_length": 6}),
        ({"generation_max_length": 8, "generation_num_beams": 2}, {}),
        ({"generation_max_length": 8, "generation_num_beams": 2}, {"num_beams": 1, "max_new_tokens": 4}),
        ({}, {"num_beams": None, "max_length": None, "no_repeat_ngram_size": 2}),
    ],
)
def test_predict_and_evaluate_generate_as_transformers(tmp_path, tokenizer, eval_dataset, args, gen_kwargs):
    trainers = _pair(tmp_path, tokenizer, eval_dataset, predict_with_generate=True, **args)
    outputs = {name: t.predict(eval_dataset, **gen_kwargs) for name, t in trainers.items()}
    _same_outputs(outputs["hf"], outputs["hl"])
    assert outputs["hl"].predictions.shape[0] == len(eval_dataset)
    assert "test_loss" in outputs["hl"].metrics and "test_gen_len" in outputs["hl"].metrics
    metrics = {name: t.evaluate(**gen_kwargs) for name, t in trainers.items()}
    for name in ("eval_loss", "eval_exact", "eval_gen_len", "eval_first_token_sum"):
        assert metrics["hl"][name] == metrics["hf"][name], name
    history = {name: t.state.log_history for name, t in trainers.items()}
    shown = lambda e: sorted(k for k in e if not k.endswith("_model_preparation_time"))  # noqa: E731
    assert [shown(e) for e in history["hl"]] == [shown(e) for e in history["hf"]]
    config = {name: t.model.generation_config.to_dict() for name, t in trainers.items()}
    assert config["hl"] == config["hf"]  # generation filled in GenerationConfig's defaults the same way


def test_generated_batches_of_different_lengths_are_padded_with_minus_100(tmp_path, tokenizer, eval_dataset):
    """A frequent token as EOS makes generation stop early in some batches (of 2): the batches differ in length
    and are joined padded with -100, as in transformers (the model's own max_length 2 pads nothing)."""
    probe = seq2seq_data.bart_model(len(tokenizer), dropout=0.0)
    batch = eval_dataset.with_format("torch")[:1]
    tokens = probe.generate(batch["input_ids"], max_new_tokens=12)[0, 1:].tolist()
    eos = max(set(tokens), key=tokens.count)

    def short(config):
        config.max_length = 2
        return config

    trainers = _pair(tmp_path, tokenizer, model_generation=short, batch_size=2, predict_with_generate=True)
    outputs = {name: t.predict(eval_dataset, max_new_tokens=12, eos_token_id=eos) for name, t in trainers.items()}
    _same_outputs(outputs["hf"], outputs["hl"])
    lengths = {int((row != -100).sum()) for row in outputs["hl"].predictions}
    assert len(lengths) > 1 and (outputs["hl"].predictions == -100).any()


def test_generation_config_argument_replaces_the_models(tmp_path, tokenizer, eval_dataset):
    config = GenerationConfig(max_length=5, num_beams=2, decoder_start_token_id=3, eos_token_id=3, pad_token_id=0)
    config.save_pretrained(tmp_path / "generation")
    for source in (config, str(tmp_path / "generation"), str(tmp_path / "generation" / "generation_config.json")):
        trainers = _pair(tmp_path, tokenizer, predict_with_generate=True, generation_config=source)
        assert trainers["hl"].model.generation_config.to_dict() == trainers["hf"].model.generation_config.to_dict()
        assert trainers["hl"].model.generation_config.num_beams == 2
    outputs = {name: t.predict(eval_dataset) for name, t in trainers.items()}
    _same_outputs(outputs["hf"], outputs["hl"])
    assert outputs["hl"].predictions.shape[1] == 5
    invalid = GenerationConfig(do_sample=False, temperature=0.5)
    with pytest.raises(ValueError, match="Fix these issues to train your model"):
        _pair(tmp_path, tokenizer, generation_config=invalid)


def test_without_predict_with_generate_logits_as_transformers(tmp_path, tokenizer, eval_dataset):
    trainers = _pair(tmp_path, tokenizer)
    for trainer in trainers.values():
        trainer.compute_metrics = None
    outputs = {name: t.predict(eval_dataset, num_beams=3) for name, t in trainers.items()}
    np.testing.assert_allclose(outputs["hl"].predictions[0], outputs["hf"].predictions[0], rtol=1e-6, atol=1e-6)
    assert outputs["hl"].metrics["test_loss"] == pytest.approx(outputs["hf"].metrics["test_loss"], rel=1e-6)


def test_eval_loss_counts_every_batch_as_transformers_seq2seq(tmp_path, tokenizer, eval_dataset):
    """transformers' Seq2SeqTrainer gathers with ``accelerator.gather``: each batch's loss counts
    ``eval_batch_size`` times (the short last batch too), unlike Trainer's sample-weighted mean."""
    trainers = _pair(tmp_path, tokenizer, eval_dataset, predict_with_generate=True)
    theirs = trainers["hf"].evaluate(max_length=3)["eval_loss"]
    assert trainers["hl"].evaluate(max_length=3)["eval_loss"] == theirs
    assert trainers["hl"].gather_function == trainers["hl"].accelerator.gather_for_metrics  # reset, as transformers
    plain = hflight.Trainer(model=trainers["hl"].model, args=trainers["hl"].args.to_transformers(),
                            data_collator=trainers["hl"].data_collator)  # fmt: skip
    weighted = plain.evaluate(eval_dataset)["eval_loss"]  # 14 samples in batches of 4: the last one counts half
    assert weighted != theirs and weighted == pytest.approx(theirs, rel=2e-2)
