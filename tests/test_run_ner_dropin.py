"""The drop-in promise for token classification (issue 23): a script written the way transformers' run_ner.py is
(tests/scripts/run_ner: words tokenized with ``is_split_into_words``, labels aligned to sub-tokens, string IOB2 tags,
DataCollatorForTokenClassification, seqeval-style entity scores) runs once as written and once with
``from transformers import Trainer`` changed to hflight's, on a tiny BERT with dropout and the default random
sampling, evaluating every epoch: the same entity precision/recall/F1, token accuracy, losses, logged numbers,
predicted tags and files."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from . import dropin, seq2seq_data

ORIGINAL_IMPORT = "from transformers import Trainer\n"
CHANGED_IMPORT = "from hflight import Trainer\n"
COLOURS = {"red", "green", "blue", "black", "white", "orange", "purple"}

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]


def _records(n: int, seed: int) -> list[dict]:
    """Sentences of 4-10 random words; a run of colour words is a COL entity, "alpha".."golf" a LET entity."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        tokens = [rng.choice(seq2seq_data.WORDS) for _ in range(rng.randint(4, 10))]
        tags, previous = [], None
        for word in tokens:
            kind = "COL" if word in COLOURS else "LET" if word in seq2seq_data.WORDS[:7] else None
            tags.append("O" if kind is None else ("I-" if kind == previous else "B-") + kind)
            previous = kind
        records.append({"tokens": tokens, "ner_tags": tags})
    return records


def _inputs(root: Path) -> dict[str, Path]:
    import torch
    from transformers import BertConfig, BertForTokenClassification

    root.mkdir(parents=True)
    paths = {name: seq2seq_data.write_jsonl(root / f"{name}.json", _records(n, seed))
             for name, n, seed in (("train", 40, 1), ("validation", 16, 2), ("test", 16, 3))}  # fmt: skip
    tokenizer = seq2seq_data.tokenizer(root / "tokenizer")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, num_labels=5)  # fmt: skip
    paths["model"] = root / "model"
    BertForTokenClassification(config).save_pretrained(paths["model"])
    tokenizer.save_pretrained(paths["model"])
    return paths


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("run_ner")
    inputs = _inputs(root / "inputs")
    args = [
        "--model_name_or_path", str(inputs["model"]), "--train_file", str(inputs["train"]),
        "--validation_file", str(inputs["validation"]), "--test_file", str(inputs["test"]),
        "--do_train", "--do_eval", "--do_predict", "--max_seq_length", "32",
        "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "6",
        "--learning_rate", "2e-2", "--num_train_epochs", "3", "--logging_steps", "1",
        "--eval_strategy", "epoch", "--save_steps", "5", "--save_total_limit", "1",
    ]  # fmt: skip
    return dropin.both(root, "run_ner", ORIGINAL_IMPORT, CHANGED_IMPORT, args)


def test_the_same_scores_losses_and_predictions(runs):
    names = ("eval_results.json", "predict_results.json", "train_results.json", "all_results.json")
    dropin.assert_same_results(runs, names)
    assert {"eval_f1", "eval_precision", "eval_recall", "eval_accuracy"} <= set(
        dropin.read_json(runs["hflight"] / "eval_results.json")
    )
    predictions = (runs["hflight"] / "predictions.txt").read_text(encoding="utf-8")
    assert predictions == (runs["transformers"] / "predictions.txt").read_text(encoding="utf-8")
    assert len(predictions.splitlines()) == 16


def test_the_same_logged_numbers(runs):
    dropin.assert_same_log_history(runs, min_losses=15)


def test_the_same_files(runs):
    dropin.assert_same_files(runs)


def test_weights_optimizer_and_trainer_state_are_transformers_bit_for_bit(runs):
    assert dropin.assert_same_training_state(runs) >= 4
    assert '"B-COL"' in (runs["hflight"] / "config.json").read_text()
