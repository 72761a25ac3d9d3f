"""A training job on a ``datasets`` stream, for the data position under torchrun (issue 63).

    torchrun --nproc_per_node=2 tests/jobs/stream_job.py OUT --how dispatched
    torchrun --nproc_per_node=2 tests/jobs/stream_job.py OUT --how per_process --resume RUN/checkpoint-30

Trains a tiny BERT QA model (dropout on) for 40 steps of 4 examples per process on a stream of 400 QA windows
(4 shards), a checkpoint every 10 steps. ``--how dispatched``: the stream as it is, process 0 reading and dispatching
each global batch (dispatch_batches, the default for an iterable dataset); ``--how per_process``: each process's
part of it by ``datasets.distributed.split_dataset_by_node``, read by that process alone (``dispatch_batches=False``).
Every example the stream produces is counted in the process that produced it. Each rank writes
``OUT/rank<R>.json`` (examples produced, logged losses, the first step it began, the input_ids it trained on);
rank 0 ``OUT/final.pt``. tests/test_data_position_ddp.py imports :func:`trainer` to resume on one process.
"""

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from datasets.distributed import split_dataset_by_node
from tiny_qa import qa_windows, tiny_bert_qa
from transformers import TrainerCallback

from hflight import Trainer, TrainingArguments

PRODUCED = 0


def counted(example):
    global PRODUCED
    PRODUCED += 1
    return example


class FirstStep(TrainerCallback):
    def __init__(self):
        self.step = None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.step is None:
            self.step = state.global_step + 1


class Recording(Trainer):
    """Keeps the input_ids of every batch it trains on, in order (``trained``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trained = []

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.trained.extend(inputs["input_ids"].tolist())
        return super().training_step(model, inputs, num_items_in_batch)


def windows():
    """The stream's 400 examples, in the order it gives them."""
    return qa_windows(400, seed=3, length=16, max_start=10)


def trainer(out, how, rank, world, **overrides):
    """The job's trainer for process ``rank`` of ``world``."""
    stream = windows().to_iterable_dataset(num_shards=4)
    if how == "per_process":
        stream = split_dataset_by_node(stream, rank=rank, world_size=world)
    stream = stream.map(counted).with_format("torch")
    values = dict(
        output_dir=out, per_device_train_batch_size=4, max_steps=40, learning_rate=1e-3, warmup_steps=2,
        logging_steps=1, save_steps=10, seed=7, report_to="none", disable_tqdm=True, use_cpu=True,
        accelerator_config={"dispatch_batches": how == "dispatched"},
    )  # fmt: skip
    values.update(overrides)
    model = tiny_bert_qa(seed=0, hidden=32, layers=1, dropout=0.1, max_positions=16)
    return Recording(model, TrainingArguments(**values), train_dataset=stream, callbacks=[FirstStep()])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--how", choices=["dispatched", "per_process"], required=True)
    parser.add_argument("--resume", default=None)
    options = parser.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    job = trainer(options.out, options.how, rank, world)
    job.train(resume_from_checkpoint=options.resume)
    losses = [entry["loss"] for entry in job.state.log_history if "loss" in entry]
    first = next(c for c in job.callback_handler.callbacks if isinstance(c, FirstStep)).step
    result = {"produced": PRODUCED, "losses": losses, "first_step": first, "world": world, "trained": job.trained}
    Path(options.out, f"rank{rank}.json").write_text(json.dumps(result))
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in job.model.state_dict().items()}, Path(options.out, "final.pt"))


if __name__ == "__main__":
    main()
