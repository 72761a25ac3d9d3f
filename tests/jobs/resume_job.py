"""A small training job for the resume tests, run in its own process.

    python tests/jobs/resume_job.py OUT [--stop-at N] [--resume PATH|last] [--step-sleep S] [--wait-for FILE]

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

import torch
from tiny_qa import qa_windows, tiny_bert_qa
from transformers import EarlyStoppingCallback, TrainerCallback

from hflight import Trainer, TrainingArguments


def dataset(n, seed):
    return qa_windows(n, seed, length=24, max_start=20)


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


class WaitFor(TrainerCallback):
    """After the first optimizer step of this process (its "step N" printed), waits until ``path`` exists: the test
    does what it must do while the job holds its output folder, then lets it go on, at a known step."""

    def __init__(self, path):
        self.path = path

    def on_step_end(self, args, state, control, **kwargs):
        if self.path is not None:
            deadline = time.monotonic() + 300
            while not os.path.exists(self.path) and time.monotonic() < deadline:
                time.sleep(0.02)
            self.path = None


def slow_background_writes(seconds):
    """Test code: every file save_async writes in the background takes ``seconds`` longer (a slow disk)."""
    from hflight.checkpoints import job

    real = job.CheckpointJob.write_later

    def write_later(self, file, step):
        print(f"writing {os.path.basename(self.folder)}/{file}", flush=True)
        time.sleep(seconds)
        real(self, file, step)

    job.CheckpointJob.write_later = write_later


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
    parser.add_argument("--restore-callback-attributes", action="store_true", help="hflight's opt-in")
    parser.add_argument("--save-async", action="store_true")
    parser.add_argument("--wait-for", help="after the first step, wait until this file exists (WaitFor)")
    parser.add_argument("--slow-write", type=float, default=0.0, help="test hook: seconds added to each background "
                        "file write, each announced on stdout (`writing NAME`)")  # fmt: skip
    opts = parser.parse_args()
    if opts.slow_write:
        slow_background_writes(opts.slow_write)

    model = tiny_bert_qa(opts.model_seed, hidden=32, layers=2, dropout=0.1, max_positions=64)
    callbacks = []
    extra = {}
    if opts.stop_at:
        callbacks.append(StopAt(opts.stop_at))
    if opts.step_sleep:
        callbacks.append(Sleep(opts.step_sleep))
    if opts.wait_for:
        callbacks.append(WaitFor(opts.wait_for))
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
        save_async=opts.save_async,
        **extra,
    )
    trainer = Trainer(
        model,
        args,
        train_dataset=dataset(40, 0),
        eval_dataset=dataset(12, 1),
        callbacks=callbacks,
    )
    trainer.restore_callback_attributes = opts.restore_callback_attributes
    resume = True if opts.resume == "last" else opts.resume
    trainer.train(resume_from_checkpoint=resume)
    out = Path(opts.out)
    torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, out / "final.pt")
    (out / "log_history.json").write_text(json.dumps(trainer.state.log_history))
    print("done", trainer.state.global_step, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
