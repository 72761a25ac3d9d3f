"""MRCTrainer: answers and SQuAD metrics during and after training, dynamic padding, best model on F1."""

from __future__ import annotations

import functools
import json
import os

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertForQuestionAnswering

from hflight import TrainingArguments
from hflight.qa.data import load_squad_json
from hflight.qa.preprocess import prepare_train_features, prepare_validation_features
from hflight.qa.synthetic import write_squad_files
from hflight.qa.tokenizer import squad_texts, train_wordpiece_tokenizer
from hflight.qa.trainer import LengthSortedSampler, MRCTrainer, QuestionAnsweringTrainer


@pytest.fixture(scope="module")
def mrc_data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mrc")
    train_file, val_file = write_squad_files(folder, num_train_articles=12, num_validation_articles=3)
    tokenizer = train_wordpiece_tokenizer(squad_texts(train_file, val_file), folder / "tok", vocab_size=1200)
    train_ex, val_ex = load_squad_json(train_file), load_squad_json(val_file)
    kwargs = dict(tokenizer=tokenizer, max_seq_length=96, doc_stride=32)
    train = train_ex.map(
        functools.partial(prepare_train_features, **kwargs), batched=True, remove_columns=train_ex.column_names
    )

    def windows(pad):
        return val_ex.map(
            functools.partial(prepare_validation_features, pad_to_max_length=pad, **kwargs),
            batched=True,
            remove_columns=val_ex.column_names,
        )

    return dict(tokenizer=tokenizer, train=train, val_examples=val_ex, padded=windows(True), dynamic=windows(False))


def _model(tokenizer, seed=0):
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=96,
    )
    return BertForQuestionAnswering(config)


def _args(tmp_path, **kwargs):
    base = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=16,
        per_device_eval_batch_size=16,
        num_train_epochs=2,
        learning_rate=2e-3,
        report_to="none",
        disable_tqdm=True,
        logging_steps=5,
        save_strategy="no",
    )
    base.update(kwargs)
    return TrainingArguments(**base)


def test_alias():
    assert QuestionAnsweringTrainer is MRCTrainer


def test_qa_metrics_during_training_and_best_model_on_f1(tmp_path, mrc_data):
    args = _args(
        tmp_path, eval_strategy="epoch", save_strategy="epoch", load_best_model_at_end=True, metric_for_best_model="f1"
    )
    trainer = MRCTrainer(
        _model(mrc_data["tokenizer"]),
        args,
        train_dataset=mrc_data["train"],
        eval_dataset=mrc_data["dynamic"],
        eval_examples=mrc_data["val_examples"],
        processing_class=mrc_data["tokenizer"],
    )
    trainer.train()
    evals = [e for e in trainer.state.log_history if "eval_f1" in e]
    assert len(evals) == 2 and all("eval_exact_match" in e for e in evals)
    assert trainer.state.best_metric == max(e["eval_f1"] for e in evals)
    assert trainer.args.greater_is_better
    best_dir = trainer.state.best_model_checkpoint
    assert best_dir and os.path.isdir(best_dir)
    predictions = json.loads((tmp_path / "eval_predictions.json").read_text())
    assert set(predictions) == set(mrc_data["val_examples"]["id"])
    assert (tmp_path / "eval_nbest_predictions.json").is_file()


def test_dynamic_padding_gives_the_same_answers_as_max_length_padding(tmp_path, mrc_data):
    trainer = MRCTrainer(
        _model(mrc_data["tokenizer"]),
        _args(tmp_path, num_train_epochs=1),
        train_dataset=mrc_data["train"],
        processing_class=mrc_data["tokenizer"],
    )
    trainer.train()
    padded = trainer.predict(mrc_data["padded"], mrc_data["val_examples"])
    dynamic = trainer.predict(mrc_data["dynamic"], mrc_data["val_examples"])
    assert padded.predictions == dynamic.predictions
    assert padded.metrics["test_f1"] == dynamic.metrics["test_f1"]
    assert {"test_exact_match", "test_f1", "test_runtime"} <= set(dynamic.metrics)
    assert dynamic.label_ids[0]["id"] == mrc_data["val_examples"][0]["id"]


def test_windows_are_sorted_by_length_and_order_is_restored(tmp_path, mrc_data):
    trainer = MRCTrainer(
        _model(mrc_data["tokenizer"]),
        _args(tmp_path),
        processing_class=mrc_data["tokenizer"],
        eval_dataset=mrc_data["dynamic"],
        eval_examples=mrc_data["val_examples"],
    )
    loader = trainer.get_eval_dataloader()
    assert isinstance(loader.sampler, LengthSortedSampler)
    lengths = [len(x) for x in mrc_data["dynamic"]["input_ids"]]
    assert [lengths[i] for i in loader.sampler.order] == sorted(lengths, reverse=True)
    batch = next(iter(loader))
    assert "offset_mapping" not in batch and "example_id" not in batch
    assert batch["input_ids"].shape[1] == max(lengths)  # first batch: the longest windows
    output = trainer._logits_for(mrc_data["dynamic"], loader, "Evaluation", None, "eval")
    model = trainer.model.eval()
    with torch.no_grad():
        row = mrc_data["dynamic"][5]
        ids = torch.tensor([row["input_ids"]])
        direct = (
            model(
                input_ids=ids,
                attention_mask=torch.tensor([row["attention_mask"]]),
                token_type_ids=torch.tensor([row["token_type_ids"]]),
            )
            .start_logits[0]
            .numpy()
        )
    np.testing.assert_allclose(output.predictions[0][5][: len(direct)], direct, atol=1e-5)


def test_padded_windows_are_sorted_by_real_tokens_and_cut_per_batch(tmp_path, mrc_data):
    """Windows padded to max_seq_length cost what dynamic ones do: sorted by attention-mask length, and each batch
    cut after its longest window's last real token; the answers are those of the dynamic windows."""
    from hflight.qa.trainer import trim_right_padding, window_lengths

    padded, dynamic = mrc_data["padded"], mrc_data["dynamic"]
    real = [len(x) for x in dynamic["input_ids"]]
    assert window_lengths(padded).tolist() == real == window_lengths(dynamic).tolist()
    trainer = MRCTrainer(_model(mrc_data["tokenizer"]), _args(tmp_path), processing_class=mrc_data["tokenizer"])
    loader = trainer.get_test_dataloader(padded)
    assert [real[i] for i in loader.sampler.order] == sorted(real, reverse=True)
    batch = list(loader)[-1]  # the shortest windows
    longest = max(real[i] for i in loader.sampler.order[-len(batch["input_ids"]) :])
    assert batch["input_ids"].shape[1] == 96  # the collator keeps the padding ...
    cut = trim_right_padding(batch)
    assert cut["input_ids"].shape[1] == longest < 96  # ... the prediction step drops it
    assert cut["token_type_ids"].shape == cut["attention_mask"].shape == cut["input_ids"].shape
    assert torch.equal(cut["input_ids"], batch["input_ids"][:, :longest])
    left = {"input_ids": torch.ones(2, 4), "attention_mask": torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])}
    assert trim_right_padding(left) is left  # left padding: real tokens come last, nothing is cut


def test_missing_examples_is_a_clear_error(tmp_path, mrc_data):
    trainer = MRCTrainer(
        _model(mrc_data["tokenizer"]),
        _args(tmp_path),
        processing_class=mrc_data["tokenizer"],
        eval_dataset=mrc_data["dynamic"],
    )
    with pytest.raises(ValueError, match="needs the examples behind the windows"):
        trainer.evaluate()


def test_padding_positions_never_reach_post_processing():
    import datasets

    from hflight.qa.trainer import PAD_LOGIT, mask_padding_logits

    features = datasets.Dataset.from_dict({"attention_mask": [[1, 1, 1, 0], [1, 1]]})
    start = np.array([[1.0, 2.0, 3.0, 9.0], [4.0, 5.0, 7.0, 8.0]], dtype=np.float32)
    masked_start, masked_end = mask_padding_logits((start, start.copy()), features)
    assert masked_start[0].tolist() == [1.0, 2.0, 3.0, PAD_LOGIT]
    assert masked_start[1].tolist() == [4.0, 5.0, PAD_LOGIT, PAD_LOGIT]
    assert start[0, 3] == 9.0  # the inputs are not modified


class TokenScorer(torch.nn.Module):
    """A QA 'model' whose logits depend on each token and its index among the real (unmasked) tokens only, so
    padding, wherever it goes, cannot change a real token's score: any change in the answers can only come
    from misaligned logits. (The index term breaks ties between repeated tokens.)"""

    def __init__(self, vocab_size: int):
        super().__init__()
        torch.manual_seed(0)
        self.start, self.end = torch.nn.Embedding(vocab_size, 1), torch.nn.Embedding(vocab_size, 1)

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        from transformers.modeling_outputs import QuestionAnsweringModelOutput

        index = attention_mask.cumsum(-1) * 1e-3
        return QuestionAnsweringModelOutput(
            start_logits=self.start(input_ids).squeeze(-1) + index, end_logits=self.end(input_ids).squeeze(-1) - index
        )


@pytest.fixture(scope="module")
def left_padding(mrc_data, tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("left_tok")
    mrc_data["tokenizer"].save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    examples = mrc_data["val_examples"]

    def windows(pad):
        return examples.map(
            functools.partial(
                prepare_validation_features,
                tokenizer=tokenizer,
                max_seq_length=96,
                doc_stride=32,
                pad_to_max_length=pad,
            ),
            batched=True,
            remove_columns=examples.column_names,
        )

    return tokenizer, examples, windows(False), windows(True)


def test_left_padding_tokenizer_answers_do_not_depend_on_batching(tmp_path, left_padding):
    tokenizer, examples, dynamic, padded = left_padding
    lengths = {len(ids) for ids in dynamic["input_ids"]}
    assert len(lengths) > 1  # the collator really pads (on the left) inside batches

    def answers(features, batch_size):
        trainer = MRCTrainer(
            TokenScorer(len(tokenizer)),
            _args(tmp_path, per_device_eval_batch_size=batch_size),
            processing_class=tokenizer,
        )
        return trainer.predict(features, examples).predictions

    alone = answers(dynamic, 1)  # one window per batch: no collator padding at all
    assert answers(dynamic, 16) == alone  # realigned: the attention mask's zeros are the collator's
    assert answers(padded, 16) == alone  # windows padded to 96 on the left already: the fixed-length case
    assert any(p["prediction_text"] for p in alone)


def test_left_padding_shift_and_the_ambiguous_case():
    import datasets

    from hflight.qa.trainer import PAD_LOGIT, left_padding_alignment, shift_out_left_padding

    logits = torch.tensor([[0.0, 0.0, 1.0, 2.0], [3.0, 4.0, 5.0, 6.0]])
    shifted = shift_out_left_padding(logits, torch.tensor([2, 0]))
    assert shifted.tolist() == [[1.0, 2.0, PAD_LOGIT, PAD_LOGIT], [3.0, 4.0, 5.0, 6.0]]

    class Left:
        padding_side = "left"

    unpadded = datasets.Dataset.from_dict({"input_ids": [[1, 2], [3]], "attention_mask": [[1, 1], [1]]})
    fixed = datasets.Dataset.from_dict({"input_ids": [[0, 2], [3, 4]], "attention_mask": [[0, 1], [1, 1]]})
    mixed = datasets.Dataset.from_dict({"input_ids": [[0, 2], [3]], "attention_mask": [[0, 1], [1]]})
    assert left_padding_alignment(unpadded, Left()) == "mask" and left_padding_alignment(fixed, Left()) == 2
    assert left_padding_alignment(mixed, None) is None  # right padding (the default): nothing to undo
    with pytest.raises(ValueError, match="pad_to_max_length=True"):
        left_padding_alignment(mixed, Left())
