"""The drop-in promise for translation scripts (issue 23): a script written the way transformers' run_translation.py
is (tests/scripts/run_translation: ``source_lang``/``target_lang`` over a ``translation`` column, ``forced_bos_token``,
corpus BLEU computed locally) runs once as written and once with its one line
``from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments`` changed to import them from hflight, on a tiny
BART with dropout and the default random sampling, generating with beam search every epoch: the same BLEU,
``gen_len`` and losses, the same generated translations, logged numbers and files (``generation_config.json`` with
its forced first token included)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from . import dropin, seq2seq_data

ORIGINAL_IMPORT = "from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments\n"
CHANGED_IMPORT = "from hflight import Seq2SeqTrainer, Seq2SeqTrainingArguments\n"

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]


def _records(n: int, seed: int) -> list[dict]:
    """``{"translation": {"en", "de"}}``: 3-9 random words, "translated" word by word to the next word of the list."""
    rng = random.Random(seed)
    words = seq2seq_data.WORDS
    records = []
    for _ in range(n):
        source = [rng.choice(words) for _ in range(rng.randint(3, 9))]
        target = [words[(words.index(w) + 1) % len(words)] for w in source]
        records.append({"translation": {"en": " ".join(source), "de": " ".join(target)}})
    return records


def _inputs(root: Path) -> dict[str, Path]:
    root.mkdir(parents=True)
    paths = {name: seq2seq_data.write_jsonl(root / f"{name}.json", _records(n, seed))
             for name, n, seed in (("train", 32, 1), ("validation", 12, 2), ("test", 12, 3))}  # fmt: skip
    tokenizer = seq2seq_data.tokenizer(root / "tokenizer")
    paths["model"] = root / "model"
    seq2seq_data.bart_model(len(tokenizer)).save_pretrained(paths["model"])
    tokenizer.save_pretrained(paths["model"])
    return paths


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("run_translation")
    inputs = _inputs(root / "inputs")
    args = [
        "--model_name_or_path", str(inputs["model"]), "--train_file", str(inputs["train"]),
        "--validation_file", str(inputs["validation"]), "--test_file", str(inputs["test"]),
        "--source_lang", "en", "--target_lang", "de", "--forced_bos_token", "[CLS]",
        "--do_train", "--do_eval", "--do_predict", "--predict_with_generate",
        "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "6",
        "--learning_rate", "1e-3", "--num_train_epochs", "2", "--logging_steps", "1",
        "--save_steps", "4", "--save_total_limit", "1", "--eval_strategy", "epoch",
        "--num_beams", "2", "--val_max_target_length", "12",
    ]  # fmt: skip
    return dropin.both(root, "run_translation", ORIGINAL_IMPORT, CHANGED_IMPORT, args)


def test_the_same_bleu_losses_and_translations(runs):
    names = ("eval_results.json", "predict_results.json", "train_results.json", "all_results.json")
    dropin.assert_same_results(runs, names, rel=0)
    assert {"eval_bleu", "eval_gen_len", "eval_loss"} <= set(dropin.read_json(runs["hflight"] / "eval_results.json"))
    predictions = (runs["hflight"] / "generated_predictions.txt").read_text(encoding="utf-8")
    assert predictions == (runs["transformers"] / "generated_predictions.txt").read_text(encoding="utf-8")
    assert len(set(predictions.splitlines())) > 5


def test_the_same_logged_numbers(runs):
    dropin.assert_same_log_history(runs, min_losses=8)


def test_the_same_files(runs):
    dropin.assert_same_files(runs, ("config.json", "generation_config.json", "README.md"))


def test_weights_optimizer_and_trainer_state_are_transformers_bit_for_bit(runs):
    assert dropin.assert_same_training_state(runs) >= 4
    assert '"forced_bos_token_id": 2' in (runs["hflight"] / "generation_config.json").read_text()
