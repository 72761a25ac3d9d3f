"""A stream, trained, interrupted and resumed: hflight continues it from the checkpoint's data position, offline, on
CPU, in about half a minute.

    python examples/streaming.py

The training data is a ``datasets`` stream (``IterableDataset.from_generator`` over 16 shards of synthetic sequences,
each labelled by its first token modulo 3), so the run is bounded by ``max_steps``. A first run stops after step 30
(a callback standing for a preempted job); the second resumes from its last checkpoint (``checkpoint-20``) and
trains to step 60. The stream counts the examples it produces: the resumed run produces those of its 40 steps, what
its loaders read ahead, and the rest of the current shard up to the position (datasets re-runs a generator from the
start of its current shard: more shards, less produced again); transformers reads and drops the 160 examples trained
before the checkpoint. A spy on ``compute_loss`` checks that each resumed step trains the examples the uninterrupted
run trained. README.md shows its core lines, and the test suite checks that they are this file's and runs it.
"""

import datasets
import numpy as np
from transformers import BertConfig, BertForSequenceClassification, TrainerCallback

from hflight import Trainer, TrainingArguments

PRODUCED = [0]


def examples(shards):
    """Each shard's sequences of 16 tokens (their first two tokens: the example's number), labelled by their first
    token modulo 3."""
    for shard in shards:
        for index in range(shard * 40, (shard + 1) * 40):
            ids = np.random.default_rng(index).integers(5, 200, size=16)
            ids[:2] = index // 195 + 5, index % 195 + 5
            PRODUCED[0] += 1
            yield {"input_ids": ids.tolist(), "attention_mask": [1] * 16, "labels": int(ids[0] % 3)}


class StopAfter(TrainerCallback):
    """Ends training after ``step`` (a preempted job)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        control.should_training_stop = state.global_step == self.step


class Spy(Trainer):
    """Keeps the example numbers each optimizer step trained."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if model.training:
            rows = inputs["input_ids"][:, :2].tolist()
            self.trained.setdefault(self.state.global_step + 1, []).extend((a - 5) * 195 + b - 5 for a, b in rows)
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)


def model() -> BertForSequenceClassification:
    config = BertConfig(vocab_size=200, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, num_labels=3)  # fmt: skip
    return BertForSequenceClassification(config)


def run(output_dir: str, resume=None, callbacks=()) -> dict[int, list[int]]:
    """One run of 60 steps on a fresh stream; the examples each step trained."""
    stream = datasets.IterableDataset.from_generator(examples, gen_kwargs={"shards": list(range(16))})
    args = TrainingArguments(output_dir=output_dir, max_steps=60, save_steps=20, per_device_train_batch_size=8,
                             learning_rate=2e-3, logging_steps=10, report_to="none", use_cpu=True)  # fmt: skip
    trainer = Spy(model(), args, train_dataset=stream, callbacks=list(callbacks))
    trainer.trained, PRODUCED[0] = {}, 0
    trainer.train(resume_from_checkpoint=resume)
    return trainer.trained


def main() -> None:
    uninterrupted = run("outputs/streaming-uninterrupted")
    # main(): a run stopped after step 30 (checkpoint-20 its last), then resumed
    run("outputs/streaming", callbacks=[StopAfter(30)])  # stopped after step 30: checkpoint-20 is the last
    resumed = run("outputs/streaming", resume=True)  # resume_from_checkpoint=True: the last checkpoint
    same = resumed == {step: ids for step, ids in uninterrupted.items() if step > 20}
    print(f"resumed at step 20: the stream produced {PRODUCED[0]} examples for the 40 remaining steps' 320; "
          f"every resumed step trained the uninterrupted run's examples: {same}")  # fmt: skip


if __name__ == "__main__":
    main()
