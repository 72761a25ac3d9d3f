"""Ray Train's recipe for transformers, as Ray documents it, with the library as the one thing that changes (a support
module of tests/test_ray_train.py: Ray's workers import it by name, so the function travels by reference).

``train_func`` is what each ``TorchTrainer`` worker runs: the training and evaluation data are the worker's shards of
Ray Data datasets (``ray.train.get_dataset_shard(...).iter_torch_batches``), the trainer gets Ray's
``RayTrainReportCallback`` and goes through ``prepare_trainer``, and a run that Ray hands a checkpoint
(``ray.train.get_checkpoint()``: Ray restarted the workers after a failure) resumes from it. ``config["fail_at"]``:
the first attempt's workers fail at the start of that step (after the checkpoints before it were reported), as a lost
node would. Each worker of each attempt writes what it saw into ``records/attempt-A-rank-N.json`` (A: 1, or 2 for
the workers of a restart): its rank and world, the class the trainer became, the checkpoint it resumed from, and the
loss logged at every step.
"""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import torch
import transformers

#: the training arguments of every run: 4 steps of 4 rows per worker, a log each step, an evaluation and a
#: checkpoint every 2 (Ray keeps each checkpoint the callback reports)
ARGS = dict(per_device_train_batch_size=4, per_device_eval_batch_size=4, max_steps=4, logging_steps=1,
            eval_strategy="steps", eval_steps=2, save_steps=2, learning_rate=1e-2, report_to="none",
            disable_tqdm=True, use_cpu=True)  # fmt: skip


class WorkerLost(RuntimeError):
    """The failure ``Fail`` raises."""


class Fail(transformers.TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise WorkerLost(f"the worker fails at step {self.step}")


class Losses(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.steps: list[tuple[int, float]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in logs:
            self.steps.append((state.global_step, logs["loss"]))


def datasets() -> dict:
    """The Ray Data datasets of the run (built on the driver): 32 rows to train on, 8 to evaluate, of a tiny LM."""
    import ray.data

    from tests import tiny_lm

    def rows(n: int, seed: int) -> list[dict]:
        return [{key: value.numpy() for key, value in row.items()} for row in tiny_lm.token_rows(n, seed)]

    return {"train": ray.data.from_items(rows(32, 0)), "eval": ray.data.from_items(rows(8, 1))}


def train_func(config: dict) -> None:
    """Ray's recipe; ``config["library"]``: ``transformers`` or ``hflight`` (the one import that differs)."""
    import ray.train
    from ray.train.huggingface.transformers import RayTrainReportCallback, prepare_trainer

    from tests import tiny_lm

    torch.set_num_threads(1)
    library = importlib.import_module(config["library"])
    train = ray.train.get_dataset_shard("train").iter_torch_batches(batch_size=4)
    evaluation = ray.train.get_dataset_shard("eval").iter_torch_batches(batch_size=4)
    losses = Losses()
    trainer = library.Trainer(
        model=tiny_lm.gpt2(), args=library.TrainingArguments(output_dir=config["output_dir"], **ARGS),
        train_dataset=train, eval_dataset=evaluation, callbacks=[losses],
    )  # fmt: skip
    trainer.add_callback(RayTrainReportCallback())
    trainer = prepare_trainer(trainer)
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None and config.get("fail_at"):
        trainer.add_callback(Fail(config["fail_at"]))
    try:
        if checkpoint:
            with checkpoint.as_directory() as folder:
                trainer.train(resume_from_checkpoint=os.path.join(folder, RayTrainReportCallback.CHECKPOINT_NAME))
        else:
            trainer.train()
    finally:
        rank = ray.train.get_context().get_world_rank()
        record = {"rank": rank, "world_size": trainer.args.world_size,
                  "group_size": torch.distributed.get_world_size(), "trainer_class": type(trainer).__name__,
                  "resumed_from": checkpoint and Path(checkpoint.path).name, "losses": losses.steps}  # fmt: skip
        records = Path(config["output_dir"], "records")
        records.mkdir(parents=True, exist_ok=True)
        (records / f"attempt-{1 if checkpoint is None else 2}-rank-{rank}.json").write_text(json.dumps(record))
