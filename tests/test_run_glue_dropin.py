"""The drop-in promise for text classification (issue 23): a script written the way transformers' run_glue.py is
(tests/scripts/run_glue: your own sentence-pair files, string labels mapped through ``label2id``, the trainer's
default DataCollatorWithPadding, accuracy) runs once as written and once with ``from transformers import Trainer``
changed to hflight's, on a tiny BERT classifier with dropout and the default random sampling, evaluating every epoch:
the same accuracy and losses, logged numbers (loss, grad_norm, learning_rate), predicted labels and files
(``config.json`` with its labels, the model card)."""

from __future__ import annotations

from pathlib import Path

import pytest

from . import dropin

ORIGINAL_IMPORT, CHANGED_IMPORT = dropin.ORIGINAL_IMPORT, dropin.CHANGED_IMPORT

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("run_glue")
    inputs = dropin.glue_inputs(root / "inputs")
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
