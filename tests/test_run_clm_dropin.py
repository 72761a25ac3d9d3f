"""The drop-in promise for causal language modelling (issue 23): a script written the way transformers' run_clm.py
is (tests/scripts/run_clm: text files grouped into blocks, ``default_data_collator``, ``preprocess_logits_for_metrics``
and a shifted accuracy, perplexity) runs once as written and once with ``from transformers import Trainer`` changed
to hflight's, on a tiny GPT-2 with dropout, the default random sampling and gradient accumulation, evaluating every
epoch: the same losses, gradient norms, learning rates, accuracy, perplexity and files."""

from __future__ import annotations

from pathlib import Path

import pytest

from . import dropin

ORIGINAL_IMPORT, CHANGED_IMPORT = dropin.ORIGINAL_IMPORT, dropin.CHANGED_IMPORT

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("run_clm")
    inputs = dropin.clm_inputs(root / "inputs")
    args = [
        "--model_name_or_path", str(inputs["model"]), "--train_file", str(inputs["train"]),
        "--validation_file", str(inputs["validation"]), "--block_size", "16", "--do_train", "--do_eval",
        "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8", "--gradient_accumulation_steps", "2",
        "--learning_rate", "2e-3", "--num_train_epochs", "2", "--logging_steps", "1",
        "--eval_strategy", "epoch", "--save_steps", "5", "--save_total_limit", "1",
    ]  # fmt: skip
    return dropin.both(root, "run_clm", ORIGINAL_IMPORT, CHANGED_IMPORT, args)


def test_the_same_metrics(runs):
    dropin.assert_same_results(runs, ("eval_results.json", "train_results.json", "all_results.json"))
    assert {"eval_accuracy", "perplexity"} <= set(dropin.read_json(runs["hflight"] / "eval_results.json"))


def test_the_same_logged_numbers(runs):
    dropin.assert_same_log_history(runs, min_losses=8)


def test_the_same_files(runs):
    dropin.assert_same_files(runs)


def test_weights_optimizer_and_trainer_state_are_transformers_bit_for_bit(runs):
    assert dropin.assert_same_training_state(runs) >= 4
