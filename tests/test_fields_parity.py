"""TrainingArguments fields that changed nothing in hflight, or changed something else than in transformers (issue 24):
each run with transformers' real Trainer and with hflight's on the same model, data and arguments, and compared."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch
import transformers

import hflight

PAIR = (
    ("hf", transformers.Trainer, transformers.TrainingArguments),
    ("hl", hflight.Trainer, hflight.TrainingArguments),
)


def _padded(factory, n=24, length=16, seed=0):
    """A classification set whose rows end in padding (attention mask 0) of varied lengths."""
    data = factory.cls_dataset(n, length, seed=seed)
    rng = np.random.default_rng(seed + 1)
    keep = rng.integers(4, length + 1, size=n)
    mask = [[1] * k + [0] * (length - k) for k in keep]
    ids = [row[:k] + [0] * (length - k) for row, k in zip(data["input_ids"], keep)]
    return (
        data.remove_columns(["input_ids", "attention_mask"])
        .add_column("input_ids", ids)
        .add_column("attention_mask", mask)
    )


def _train_both(tmp_path, factory, train=None, evaluation=None, **fields):
    trainers = {}
    for name, trainer_cls, args_cls in PAIR:
        args = args_cls(output_dir=str(tmp_path / name), **factory.pair_args(**fields))
        trainer = trainer_cls(
            factory.cls_model(), args, train_dataset=train or factory.cls_dataset(16), eval_dataset=evaluation
        )
        trainer.train()
        trainers[name] = trainer
    return trainers["hf"], trainers["hl"]


# ---- include_num_input_tokens_seen -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["all", "non_padding"])
def test_include_num_input_tokens_seen_logs_as_transformers(tmp_path, factory, mode):
    hf, hl = _train_both(tmp_path, factory, train=_padded(factory, 16), include_num_input_tokens_seen=mode)
    assert hl.state.num_input_tokens_seen == hf.state.num_input_tokens_seen > 0
    if mode == "non_padding":
        assert hf.state.num_input_tokens_seen < 16 * 16  # the padding was not counted
    assert len(hl.state.log_history) == len(hf.state.log_history)
    for theirs, ours in zip(hf.state.log_history, hl.state.log_history):
        assert sorted(ours) == sorted(theirs)  # num_input_tokens_seen, train_runtime, train_tokens_per_second
        assert ours["num_input_tokens_seen"] == theirs["num_input_tokens_seen"]
    assert "train_tokens_per_second" in hl.state.log_history[0]
