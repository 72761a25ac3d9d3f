"""A small training job for the resume tests, run in its own process.

    python tests/jobs/resume_job.py OUT [--stop-at N] [--resume PATH|last] [--step-sleep S]

Trains a tiny BERT QA model (dropout on, random sampling, gradient accumulation 2, 12 optimizer steps, a
checkpoint every ``--save-steps``) and writes ``OUT/final.pt`` (parameters) and ``OUT/log_history.json``.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import datasets
import numpy as np
import torch
from transformers import BertConfig, BertForQuestionAnswering, EarlyStoppingCallback, TrainerCallback

from hflight import Trainer, TrainingArguments


def dataset(n, seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, 100, size=(n, 24))
    start = rng.integers(1, 20, size=n)
    return datasets.Dataset.from_dict(
        {
            "input_ids": ids.tolist(),
            "attention_mask": np.ones_like(ids).tolist(),
            "start_positions": start.tolist(),
            "end_positions": (start + 2).tolist(),
        }
    )


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


class Sleep(TrainerCallback):
    def __init__(self, seconds):
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):
        print(f"step {state.global_step}", flush=True)
        time.sleep(self.seconds)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--stop-at", type=int)
    parser.add_argument("--resume")
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--save-steps", type=int, default=6)
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--model-seed", type=int, default=0)
    parser.add_argument("--early-stopping", type=int, help="patience; evaluates every step on eval_loss")
    opts = parser.parse_args()

    torch.manual_seed(opts.model_seed)
    config = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    callbacks = []
    extra = {}
    if opts.stop_at:
        callbacks.append(StopAt(opts.stop_at))
    if opts.step_sleep:
        callbacks.append(Sleep(opts.step_sleep))
    if opts.early_stopping:
        callbacks.append(EarlyStoppingCallback(early_stopping_patience=opts.early_stopping))
        extra = dict(
            eval_strategy="steps",
            eval_steps=1,
            save_strategy="steps",
            load_best_model_at_end=True,
            metric_for_best_model="eval_loss",
            learning_rate=5e-2,
        )
    args = TrainingArguments(
        output_dir=opts.out,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=opts.max_steps,
        learning_rate=extra.pop("learning_rate", 1e-3),
        warmup_steps=2,
        weight_decay=0.01,
        logging_steps=1,
        save_steps=opts.save_steps,
        train_sampling_strategy="random",
        seed=7,
        report_to="none",
        disable_tqdm=True,
        **extra,
    )
    trainer = Trainer(
        BertForQuestionAnswering(config),
        args,
        train_dataset=dataset(40, 0),
        eval_dataset=dataset(12, 1),
        callbacks=callbacks,
    )
    resume = True if opts.resume == "last" else opts.resume
    trainer.train(resume_from_checkpoint=resume)
    out = Path(opts.out)
    torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, out / "final.pt")
    (out / "log_history.json").write_text(json.dumps(trainer.state.log_history))
    print("done", trainer.state.global_step, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
