"""The drop-in promise for multiple choice (issue 23): a script written the way transformers' run_swag.py is
(tests/scripts/run_swag: SWAG-style columns flattened into four context/ending pairs, DataCollatorForMultipleChoice,
accuracy) runs once as written and once with ``from transformers import Trainer`` changed to hflight's, on a tiny
BERT multiple-choice model with dropout and the default random sampling, evaluating every epoch: the same accuracy,
losses, logged numbers (loss, grad_norm, learning_rate) and files (the model card with its dataset tag)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from . import dropin, seq2seq_data

ORIGINAL_IMPORT = "from transformers import Trainer\n"
CHANGED_IMPORT = "from hflight import Trainer\n"

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]


def _records(n: int, seed: int) -> list[dict]:
    """A context of random words, a header word, and four endings of which the right one repeats the context's last
    word."""
    rng = random.Random(seed)
    words = seq2seq_data.WORDS
    records = []
    for _ in range(n):
        context = [rng.choice(words) for _ in range(rng.randint(3, 7))]
        label = rng.randrange(4)
        endings = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 4))) for _ in range(4)]
        endings[label] = context[-1] + " " + endings[label]
        record = {"sent1": " ".join(context), "sent2": rng.choice(words), "label": label}
        record.update({f"ending{i}": ending for i, ending in enumerate(endings)})
        records.append(record)
    return records


def _inputs(root: Path) -> dict[str, Path]:
    import torch
    from transformers import BertConfig, BertForMultipleChoice

    root.mkdir(parents=True)
    paths = {name: seq2seq_data.write_jsonl(root / f"{name}.json", _records(n, seed))
             for name, n, seed in (("train", 32, 1), ("validation", 12, 2))}  # fmt: skip
    tokenizer = seq2seq_data.tokenizer(root / "tokenizer")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    paths["model"] = root / "model"
    BertForMultipleChoice(config).save_pretrained(paths["model"])
    tokenizer.save_pretrained(paths["model"])
    return paths


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("run_swag")
    inputs = _inputs(root / "inputs")
    args = [
        "--model_name_or_path", str(inputs["model"]), "--train_file", str(inputs["train"]),
        "--validation_file", str(inputs["validation"]), "--do_train", "--do_eval", "--max_seq_length", "24",
        "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8",
        "--learning_rate", "5e-3", "--num_train_epochs", "2", "--logging_steps", "1",
        "--eval_strategy", "epoch", "--save_steps", "6", "--save_total_limit", "1",
    ]  # fmt: skip
    return dropin.both(root, "run_swag", ORIGINAL_IMPORT, CHANGED_IMPORT, args)


def test_the_same_accuracy_and_losses(runs):
    dropin.assert_same_results(runs, ("eval_results.json", "train_results.json", "all_results.json"))
    assert "eval_accuracy" in dropin.read_json(runs["hflight"] / "eval_results.json")


def test_the_same_logged_numbers(runs):
    dropin.assert_same_log_history(runs, min_losses=16)


def test_the_same_files(runs):
    dropin.assert_same_files(runs)


def test_weights_optimizer_and_trainer_state_are_transformers_bit_for_bit(runs):
    assert dropin.assert_same_training_state(runs) >= 4
    assert "swag" in (runs["hflight"] / "README.md").read_text()
