"""``Trainer.hyperparameter_search(backend="optuna")`` in two processes, transformers' Trainer or hflight's:

    torchrun --standalone --nproc_per_node=2 tests/jobs/hpsearch_job.py OUT hf|hl
    srun --ntasks-per-node=2 python tests/jobs/hpsearch_job.py OUT hl

A tiny BERT QA model, 3 trials of 2 steps (a learning rate and a per-device batch size drawn by a random sampler
seeded with the process's rank), an evaluation after each step (each reports the objective to the study). Every rank
writes ``OUT/<hf|hl>-rank<r>.json``: per trial, the hyperparameters it trained with (read from ``args`` and the
optimizer at the first step, the batch size from the state), its evaluation losses, and what
``hyperparameter_search`` returned on that rank. hflight's job then runs 2 trials with a pruner that stops every
trial but the first after its first report (hflight's alone: transformers' other ranks cannot follow a pruned trial).
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gloo_exit  # noqa: E402
import optuna  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from support import Factory  # noqa: E402

import hflight  # noqa: E402


class Record(transformers.TrainerCallback):
    """What each trial trained with, as this rank saw it."""

    def __init__(self):
        self.trials = []

    def on_train_begin(self, args, state, control, **kwargs):
        batch = args.per_device_train_batch_size
        self.trials.append({"params": state.trial_params, "learning_rate": args.learning_rate,
                            "per_device_train_batch_size": batch, "eval_losses": []})  # fmt: skip

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        if state.global_step == 0:
            self.trials[-1]["optimizer_lr"] = optimizer.param_groups[0]["initial_lr"]
            self.trials[-1]["train_batch_size"] = state.train_batch_size

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.trials[-1]["eval_losses"].append(metrics["eval_loss"])


class PruneAfterFirstTrial(optuna.pruners.BasePruner):
    def prune(self, study, trial):
        return trial.number > 0


def search(trainer, record, pruner, n_trials):
    """One search; what this rank trained and what it got back."""

    def space(trial):
        learning_rate = trial.suggest_float("learning_rate", 1e-4, 1e-2, log=True)
        batch = trial.suggest_categorical("per_device_train_batch_size", [1, 2])
        return {"learning_rate": learning_rate, "per_device_train_batch_size": batch}

    record.trials = []
    # seeded with the rank: each process's sampler would draw other values (as unseeded ones do); rank 0's are used
    sampler = optuna.samplers.RandomSampler(seed=int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))))
    best = trainer.hyperparameter_search(hp_space=space, n_trials=n_trials, direction="minimize", backend="optuna",
                                         sampler=sampler, pruner=pruner)  # fmt: skip
    returned = None if best is None else {"run_id": best.run_id, "objective": best.objective,
                                          "hyperparameters": best.hyperparameters}  # fmt: skip
    return {"trials": record.trials, "returned": returned, "type": type(best).__name__}


def main() -> int:
    out, impl = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    library = hflight if impl == "hl" else transformers
    where = {} if impl == "hl" else {"use_cpu": True, "ddp_backend": "gloo"}
    args = library.TrainingArguments(
        output_dir=str(out / impl), per_device_train_batch_size=2, max_steps=2, eval_strategy="steps",
        eval_steps=1, save_strategy="no", logging_steps=1, report_to="none", disable_tqdm=True, seed=0, **where,
    )  # fmt: skip
    record = Record()
    trainer = library.Trainer(model_init=lambda: Factory.qa_model(), args=args, train_dataset=Factory.qa_dataset(16),
                              eval_dataset=Factory.qa_dataset(8, seed=1), callbacks=[record])  # fmt: skip
    report = {"world": args.world_size, "search": search(trainer, record, optuna.pruners.NopPruner(), 3)}
    if impl == "hl":  # transformers' other ranks cannot follow a pruned trial: hflight's alone
        report["pruned"] = search(trainer, record, PruneAfterFirstTrial(), 2)
    rank = torch.distributed.get_rank()
    (out / f"{impl}-rank{rank}.json").write_text(json.dumps(report), encoding="utf-8")
    if impl == "hf":  # transformers' side ends without the interpreter's teardown (tests/gloo_exit.py says why)
        gloo_exit.exit_without_teardown()
    torch.distributed.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
