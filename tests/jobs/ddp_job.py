"""A training job for the multi-process test: ``lightning``'s DDP on CPU (gloo), or one process.

    python tests/jobs/ddp_job.py OUT --devices 2 --batch-size 4     # two processes, 4 examples each per batch
    python tests/jobs/ddp_job.py OUT --devices 1 --batch-size 8     # the same global batch in one process

Lightning's DDP launcher starts the other rank by running this script again. Trains a tiny BERT QA model
(dropout 0, plain SGD so that float rounding cannot flip an Adam step's sign) with gradient accumulation 2 on 40
examples (an epoch's last accumulation cycle is short), evaluates every epoch, saves a checkpoint every 2 steps,
then evaluates on 12 examples and predicts on 11 (not a multiple of the 2 x 3 global evaluation batch, so the
last batch is padded with repeats that must be dropped). The same evaluate() and predict() also run as the very first
calls, before train(): under DDP they are the calls that launch the processes. With one process, transformers'
Trainer evaluates and predicts the untrained model too, for reference. Rank 0 writes ``OUT/result.json`` and
``OUT/final.pt``. With ``--then-save-async`` the same run follows in the same processes (no second launch) with
save_async, into ``OUT/save_async``; its trainer writes a file of its own into ``checkpoint-N`` after
``super()._save_checkpoint``, as TRL's GRPOTrainer does (``own_state.json``). With ``--then-fail-a-write`` a last
training follows whose background write of checkpoint-4 fails on rank 0 (a full disk's stand-in): each rank writes
what stopped it to ``OUT/save_async/failed_write_<rank>.json``.
"""

import argparse
import atexit
import errno
import json
import os
import sys
import threading
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from tiny_qa import qa_windows, tiny_bert_qa
from transformers import TrainerCallback

from hflight import Trainer, TrainingArguments


def dataset(n, seed):
    return qa_windows(n, seed, length=16, max_start=10)


def exact_match(prediction):
    start_logits, end_logits = prediction.predictions
    start_labels, end_labels = prediction.label_ids
    hits = (start_logits.argmax(-1) == start_labels) & (end_logits.argmax(-1) == end_labels)
    return {"exact": float(hits.mean()), "count": float(len(hits))}


class Events(TrainerCallback):
    def __init__(self):
        self.seen = []

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append(("step_end", state.global_step))

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.seen.append(("evaluate", state.global_step))

    def on_save(self, args, state, control, **kwargs):
        self.seen.append(("save", state.global_step))


class SavesItsOwnState(Trainer):
    """TRL's GRPOTrainer's form (use_adaptive_entropy): its state into checkpoint-N after super(), on the process
    that saves."""

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            output_dir = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
            with open(os.path.join(output_dir, "own_state.json"), "w") as f:
                json.dump({"step": self.state.global_step}, f)


def outputs_of(metrics, prediction):
    return {
        "eval": {k: v for k, v in metrics.items() if k in ("eval_loss", "eval_exact", "eval_count")},
        "predictions": [p.tolist() for p in prediction.predictions],
        "label_ids": [p.tolist() for p in prediction.label_ids],
        "test_count": prediction.metrics["test_count"],
    }


def transformers_first(out):
    """transformers' Trainer on the untrained model: evaluate() and predict() as hflight's first calls do them."""
    import transformers

    model = tiny_bert_qa(0, hidden=16, layers=1, dropout=0.0, max_positions=32)
    args = transformers.TrainingArguments(output_dir=str(out), per_device_eval_batch_size=3, report_to="none",
                                          use_cpu=True, disable_tqdm=True)  # fmt: skip
    trainer = transformers.Trainer(model, args, eval_dataset=dataset(12, 1), compute_metrics=exact_match)
    return outputs_of(trainer.evaluate(), trainer.predict(dataset(11, 2)))


def report_gloo_threads_at_exit(out):
    """At exit, after hflight's end of the process group (registered later, so run earlier): how many gloo worker
    threads this process still has (none, when the group was destroyed and joined before the interpreter's
    teardown)."""
    from hflight.arguments.process_group import gloo_worker_threads

    def report():
        rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
        Path(out, f"gloo_threads_at_exit_{rank}.txt").write_text(str(gloo_worker_threads()))

    atexit.register(report)


def failed_background_write(out):
    """Test code: a save_async training whose background write of checkpoint-4 finds the disk full on rank 0 (the
    background writer thread writes torch.save's files with hflight.checkpoints.writers.torch_file.save where no writer
    process runs, as here: how every rank learns of the failure does not depend on who wrote the file)."""
    from hflight.checkpoints.writers import torch_file, writer_process

    writer_process.available = lambda: False
    real = torch_file.save

    def full_disk(obj, path, *args, **kwargs):
        if ".tmp-checkpoint-4" in str(path) and threading.current_thread() is not threading.main_thread():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(obj, path, *args, **kwargs)

    torch_file.save = full_disk
    args = TrainingArguments(output_dir=str(Path(out) / "failed_write"), accelerator="cpu", devices=2, strategy="ddp",
                             per_device_train_batch_size=4, max_steps=8, save_steps=2, save_total_limit=1,
                             save_async=True, optim="sgd", report_to="none", disable_tqdm=True)  # fmt: skip
    model = tiny_bert_qa(0, hidden=16, layers=1, dropout=0.0, max_positions=32)
    trainer = SavesItsOwnState(model, args, train_dataset=dataset(40, 0))
    try:
        trainer.train()
        outcome = {"error": None}
    except Exception as exc:  # noqa: BLE001 - the test compares what stopped each rank
        outcome = {"error": type(exc).__name__, "message": str(exc)}
    finally:
        torch_file.save = real
    outcome["global_step"] = trainer.state.global_step
    rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
    Path(out, f"failed_write_{rank}.json").write_text(json.dumps(outcome))


def run(out, devices, batch_size, save_async, ddp_timeout):
    """The run: evaluate() and predict() first, train(), evaluate() and predict(); rank 0 writes its results."""
    model = tiny_bert_qa(0, hidden=16, layers=1, dropout=0.0, max_positions=32)
    args = TrainingArguments(
        output_dir=str(out),
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=3,
        gradient_accumulation_steps=2,
        num_train_epochs=2,
        optim="sgd",
        learning_rate=0.5,
        max_grad_norm=1.0,
        logging_steps=1,
        eval_strategy="epoch",
        save_strategy="steps",
        save_steps=2,
        train_sampling_strategy="sequential",
        report_to="none",
        disable_tqdm=True,
        save_async=save_async,
        **({"ddp_timeout": ddp_timeout} if ddp_timeout else {}),
    )
    events = Events()
    trainer = (SavesItsOwnState if save_async else Trainer)(
        model,
        args,
        train_dataset=dataset(40, 0),
        eval_dataset=dataset(12, 1),
        compute_metrics=exact_match,
        callbacks=[events],
    )
    first_metrics = trainer.evaluate()  # before any training: in the first run, these calls launch the processes
    first_prediction = trainer.predict(dataset(11, 2))
    train_output = trainer.train()
    metrics = trainer.evaluate()
    prediction = trainer.predict(dataset(11, 2))
    if trainer.is_world_process_zero():
        out = Path(out)
        torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()}, out / "final.pt")
        result = {
            "world_size": trainer.lightning_trainer.world_size,
            "log_history": trainer.state.log_history,
            "train_loss": train_output.training_loss,
            "global_step": trainer.state.global_step,
            "eval": metrics,
            "predictions": [p.tolist() for p in prediction.predictions],
            "label_ids": [p.tolist() for p in prediction.label_ids],
            "test_metrics": prediction.metrics,
            "events": events.seen,
            "checkpoints": sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint-")),
            "first": outputs_of(first_metrics, first_prediction),
        }
        if devices == 1:
            result["transformers_first"] = transformers_first(out / "transformers")
        (out / "result.json").write_text(json.dumps(result))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--then-save-async", action="store_true")
    parser.add_argument("--then-fail-a-write", action="store_true")
    opts = parser.parse_args()
    report_gloo_threads_at_exit(opts.out)
    # a rank left behind by the others (a fault of the run) fails in minutes rather than hanging for half an hour
    ddp_timeout = 180 if opts.then_fail_a_write else None
    run(opts.out, opts.devices, opts.batch_size, save_async=False, ddp_timeout=ddp_timeout)
    if opts.then_save_async:
        run(Path(opts.out) / "save_async", opts.devices, opts.batch_size, save_async=True, ddp_timeout=ddp_timeout)
    if opts.then_fail_a_write:
        failed_background_write(Path(opts.out) / "save_async")
    return 0


if __name__ == "__main__":
    sys.exit(main())
