"""``Trainer.hyperparameter_search(backend="optuna")`` in two processes, transformers' Trainer or hflight's:

    torchrun --standalone --nproc_per_node=2 tests/jobs/hpsearch_job.py OUT hf|hl
    srun --ntasks-per-node=2 python tests/jobs/hpsearch_job.py OUT hl

A tiny BERT QA model, 3 trials of 2 steps (a learning rate and a per-device batch size drawn by a random sampler
seeded with the process's rank), an evaluation after each step (each reports the objective to the study). Every rank
writes ``OUT/<hf|hl>-rank<r>.json``: per trial, the hyperparameters it trained with (read from ``args`` and the
optimizer at the first step, the batch size from the state), its evaluation losses, and what
``hyperparameter_search`` returned on that rank. hflight's job then runs 2 trials with a pruner that stops every
trial but the first after its first report (hflight's alone: transformers' other ranks cannot follow a pruned trial);
rank 1's process gets a pruner that would stop every trial at its first report, so that a rank deciding for itself
shows (only rank 0's pruner decides).

Then hflight's job fails trial 0 on one rank only (a ``RuntimeError`` from a callback at the end of step 1, the other
rank then in the step's collectives, or from the model's forward in step 2, the other rank then in the gradients'
all-reduce): on rank 0 and on rank 1, with ``catch=(RuntimeError,)`` (2 trials) and without (the search stops on both
ranks; the script catches what ``hyperparameter_search`` raises and goes on, on the same process group). Per search,
each rank records what it trained, what it returned or raised, the trial states of rank 0's study and the warnings
and errors hflight and optuna logged. Last, after writing its report, hflight's job runs a search without ``catch``
whose trial fails on rank 1 and lets the error end the script: the job exits non-zero.
"""

import json
import logging
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


class PruneEveryTrial(optuna.pruners.BasePruner):
    def prune(self, study, trial):
        return True


class Fail(transformers.TrainerCallback):
    """Trial 0 of a search fails on one rank: at the end of its step 1 (a callback), or in the model's forward of its
    step 2 (``model_init`` adds the hook). :meth:`arm` says where and on which rank, for the next search."""

    def __init__(self):
        self.rank, self.where, self.trials, self.forwards = None, None, 0, 0

    def arm(self, rank, where):
        self.rank, self.where, self.trials = rank, where, 0

    def model_init(self):
        model = Factory.qa_model()
        model.register_forward_pre_hook(self.forward)
        return model

    def here(self, where):
        return self.where == where and self.trials == 1 and torch.distributed.get_rank() == self.rank

    def on_train_begin(self, args, state, control, **kwargs):
        self.trials, self.forwards = self.trials + 1, 0

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1 and self.here("step_end"):
            raise RuntimeError(f"trial 0 fails on rank {self.rank} at the end of step 1")

    def forward(self, module, inputs):
        self.forwards += module.training
        if module.training and self.forwards == 2 and self.here("forward"):
            raise RuntimeError(f"trial 0 fails on rank {self.rank} in the forward of step 2")


class Logged(logging.Handler):
    """The warnings and errors of hflight and optuna, as logged on this rank (with the traceback's last line)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []
        for name in ("hflight", "optuna"):
            logging.getLogger(name).addHandler(self)

    def emit(self, record):
        error = record.exc_info[1] if record.exc_info else None
        self.messages.append(record.getMessage() + (f" | {type(error).__name__}: {error}" if error else ""))


def search(trainer, record, pruner, n_trials, **kwargs):
    """One search; what this rank trained and what it got back."""

    def space(trial):
        learning_rate = trial.suggest_float("learning_rate", 1e-4, 1e-2, log=True)
        batch = trial.suggest_categorical("per_device_train_batch_size", [1, 2])
        return {"learning_rate": learning_rate, "per_device_train_batch_size": batch}

    record.trials = []
    # seeded with the rank: each process's sampler would draw other values (as unseeded ones do); rank 0's are used
    sampler = optuna.samplers.RandomSampler(seed=int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))))
    best = trainer.hyperparameter_search(hp_space=space, n_trials=n_trials, direction="minimize", backend="optuna",
                                         sampler=sampler, pruner=pruner, **kwargs)  # fmt: skip
    returned = None if best is None else {"run_id": best.run_id, "objective": best.objective,
                                          "hyperparameters": best.hyperparameters}  # fmt: skip
    return {"trials": record.trials, "returned": returned, "type": type(best).__name__}


def failing(trainer, record, logged, fail, rank, where, catch):
    """A search whose trial 0 fails on ``rank`` (``where``), with ``catch`` or without: what this rank trained, what
    it returned or raised, the states of rank 0's study's trials, what hflight and optuna logged meanwhile."""
    fail.arm(rank, where)
    logged.messages, storage = [], optuna.storages.InMemoryStorage()
    name = f"fail-{rank}-{where}-{bool(catch)}"
    report = {"case": [rank, where, bool(catch)], "error": None}
    try:
        report["search"] = search(trainer, record, optuna.pruners.NopPruner(), 2 if catch else 1, storage=storage,
                                  study_name=name, **({"catch": catch} if catch else {}))  # fmt: skip
    except Exception as error:  # noqa: BLE001 - what the search raised on this rank, recorded
        report["error"] = {"type": type(error).__name__, "message": str(error)}
        report["search"] = {"trials": record.trials}
    if torch.distributed.get_rank() == 0:
        report["states"] = [t.state.name for t in optuna.load_study(study_name=name, storage=storage).trials]
    report["logged"] = list(logged.messages)
    return report


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
    rank = torch.distributed.get_rank()
    if impl == "hf":  # transformers' side ends without the interpreter's teardown (tests/gloo_exit.py says why)
        (out / f"{impl}-rank{rank}.json").write_text(json.dumps(report), encoding="utf-8")
        gloo_exit.exit_without_teardown()
    # transformers' other ranks cannot follow a pruned trial: hflight's alone; rank 0's pruner decides for every rank
    report["pruned"] = search(trainer, record, PruneAfterFirstTrial() if rank == 0 else PruneEveryTrial(), 2)
    fail, logged = Fail(), Logged()
    failing_trainer = library.Trainer(model_init=fail.model_init, args=args, train_dataset=Factory.qa_dataset(16),
                                      eval_dataset=Factory.qa_dataset(8, seed=1), callbacks=[record, fail])  # fmt: skip
    cases = [(0, "forward", (RuntimeError,)), (1, "step_end", (RuntimeError,)), (0, "step_end", ()), (1, "forward", ())]
    report["failures"] = [failing(failing_trainer, record, logged, fail, *case) for case in cases]
    (out / f"{impl}-rank{rank}.json").write_text(json.dumps(report), encoding="utf-8")
    fail.arm(1, "step_end")  # the error a script does not catch ends it, on every rank: the job exits non-zero
    search(failing_trainer, record, optuna.pruners.NopPruner(), 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
