"""The drop-in promise for text classification (issue 23): a script written the way transformers' run_glue.py is
(tests/scripts/run_glue: your own sentence-pair files, string labels mapped through ``label2id``, the trainer's
default DataCollatorWithPadding, accuracy) runs once as written and once with ``from transformers import Trainer``
changed to hflight's, on a tiny BERT classifier with dropout and the default random sampling, evaluating every epoch:
the same accuracy and losses, logged numbers (loss, grad_norm, learning_rate), predicted labels and files
(``config.json`` with its labels, the model card)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from . import dropin, seq2seq_data

ORIGINAL_IMPORT = "from transformers import Trainer\n"
CHANGED_IMPORT = "from hflight import Trainer\n"

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]


def _records(n: int, seed: int) -> list[dict]:
    """Sentence pairs of 3-8 random words, labelled "same" when they start with the same word, else "different"."""
    rng = random.Random(seed)
    words = seq2seq_data.WORDS
    records = []
    for _ in range(n):
        first = [rng.choice(words) for _ in range(rng.randint(3, 8))]
        second = [rng.choice(words) for _ in range(rng.randint(3, 8))]
        if rng.random() < 0.5:
            second[0] = first[0]
        label = "same" if first[0] == second[0] else "different"
        records.append({"sentence1": " ".join(first), "sentence2": " ".join(second), "label": label})
    return records


def _inputs(root: Path) -> dict[str, Path]:
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    root.mkdir(parents=True)
    paths = {name: seq2seq_data.write_jsonl(root / f"{name}.json", _records(n, seed))
             for name, n, seed in (("train", 40, 1), ("validation", 16, 2), ("test", 16, 3))}  # fmt: skip
    tokenizer = seq2seq_data.tokenizer(root / "tokenizer")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, num_labels=2)  # fmt: skip
    paths["model"] = root / "model"
    BertForSequenceClassification(config).save_pretrained(paths["model"])
    tokenizer.save_pretrained(paths["model"])
    return paths


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("run_glue")
    inputs = _inputs(root / "inputs")
    args = [
        "--model_name_or_path", str(inputs["model"]), "--train_file", str(inputs["train"]),
        "--validation_file", str(inputs["validation"]), "--test_file", str(inputs["test"]),
        "--do_train", "--do_eval", "--do_predict", "--max_seq_length", "24", "--pad_to_max_length", "false",
        "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "8",
        "--learning_rate", "2e-3", "--num_train_epochs", "2", "--logging_steps", "1",
        "--eval_strategy", "epoch", "--save_steps", "5", "--save_total_limit", "1",
    ]  # fmt: skip
    return dropin.both(root, "run_glue", ORIGINAL_IMPORT, CHANGED_IMPORT, args)


def test_the_same_accuracy_losses_and_predictions(runs):
    dropin.assert_same_results(runs, ("eval_results.json", "train_results.json", "all_results.json"))
    assert "eval_accuracy" in dropin.read_json(runs["hflight"] / "eval_results.json")
    predictions = (runs["hflight"] / "predict_results.txt").read_text(encoding="utf-8")
    assert predictions == (runs["transformers"] / "predict_results.txt").read_text(encoding="utf-8")
    assert len(predictions.splitlines()) == 17


def test_the_same_logged_numbers(runs):
    dropin.assert_same_log_history(runs, min_losses=10)


def test_the_same_files(runs):
    dropin.assert_same_files(runs)


def test_weights_optimizer_and_trainer_state_are_transformers_bit_for_bit(runs):
    assert dropin.assert_same_training_state(runs) >= 4
    assert '"same"' in (runs["hflight"] / "config.json").read_text()
