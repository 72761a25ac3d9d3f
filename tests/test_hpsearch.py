"""Trainer.hyperparameter_search as transformers runs it (issue 40, item 6): each search runs with
``transformers.Trainer`` and with ``hflight.Trainer`` on the same script and gives the same trials (hyperparameters
trained with, evaluation losses), the same results (``BestRun``, a list of them for several objectives) and the same
folders: optuna in one process and under ``torchrun --nproc_per_node=2`` (rank 0 samples, every rank trains each
trial, rank 0 alone returns the ``BestRun``), Ray Tune on a local Ray instance, and a W&B sweep through a stand-in
for W&B's server and agent (tests/wandb_sweep_standin.py; no W&B server is reachable here). Under torchrun, hflight's
side also prunes on rank 0's decision alone, and fails a trial that fails on one rank on every rank (issue 46).
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import pytest
import transformers
from transformers.hyperparameter_search import default_hp_search_backend

import hflight
from hflight.trainer.hpsearch import backend_named

from . import dropin, launch
from .support import Factory

optuna = pytest.importorskip("optuna")

LIBRARIES = {"transformers": transformers, "hflight": hflight}
JOB = Path(__file__).parent / "jobs" / "hpsearch_job.py"
#: the W&B sweep's config (``hp_space``; transformers' driver fills in the metric): a learning rate, and a model's
#: hyperparameter that ``model_init(config)`` reads (not a ``TrainingArguments`` field: skipped there with a warning)
SWEEP = {"method": "random", "metric": {},
         "parameters": {"learning_rate": {"distribution": "log_uniform_values", "min": 1e-4, "max": 1e-2},
                        "initializer_range": {"values": [0.02, 0.2]}}}  # fmt: skip


class Record(transformers.TrainerCallback):
    """Per trial: its parameters (``state.trial_params``), the hyperparameters it trained with (``args``, the
    optimizer's learning rate, the batch size the run used) and its evaluation losses."""

    def __init__(self):
        self.trials = []

    def on_train_begin(self, args, state, control, **kwargs):
        params = {k: v for k, v in state.trial_params.items() if k != "_wandb"}  # W&B's telemetry of the process
        self.trials.append({"params": params, "lr": args.learning_rate, "eval_losses": []})

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        if state.global_step == 0:
            self.trials[-1].update(optimizer_lr=optimizer.param_groups[0]["initial_lr"], batch=state.train_batch_size)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.trials[-1]["eval_losses"].append(metrics["eval_loss"])


def _trainer(library, output_dir, callbacks=(), model_init=None, **kwargs):
    """A tiny QA model built by ``model_init`` and trained 2 steps (seed 0 on both sides: transformers shuffles with
    torch's initial seed, which ``Factory.qa_model`` sets to 0, hflight with ``args.seed``)."""
    fields = dict(per_device_train_batch_size=4, max_steps=2, report_to="none", disable_tqdm=True, save_strategy="no",
                  logging_steps=1, seed=0, **({"use_cpu": True} if library is transformers else {}))  # fmt: skip
    args = library.TrainingArguments(output_dir=str(output_dir), **{**fields, **kwargs})
    model_init = model_init or (lambda: Factory.qa_model())
    return library.Trainer(model_init=model_init, args=args, train_dataset=Factory.qa_dataset(16),
                           eval_dataset=Factory.qa_dataset(8, seed=1), callbacks=list(callbacks))  # fmt: skip


def _model_of(config):
    """``model_init(trial)`` for a W&B sweep: the model's ``initializer_range`` from the run's config."""
    import torch
    from transformers import BertForQuestionAnswering

    torch.manual_seed(0)
    return BertForQuestionAnswering(Factory.config(initializer_range=config["initializer_range"] if config else 0.02))


def _folders(root: Path) -> set[str]:
    """The files a search left (hflight's checkpoint manifests aside)."""
    return {name for name in dropin.files(root) if not name.endswith(tuple(dropin.HFLIGHT_ONLY))}


def test_signature_matches_transformers():
    ours = inspect.signature(hflight.Trainer.hyperparameter_search).parameters
    theirs = inspect.signature(transformers.Trainer.hyperparameter_search).parameters
    assert list(ours) == list(theirs)
    assert all(ours[n].default == theirs[n].default for n in theirs if n != "kwargs")


def test_an_optuna_search_trains_and_returns_what_transformers_does(one_torch_thread, tmp_path):
    """2 trials of a learning rate and a batch size: each trial trains with its values (set on ``args`` after
    ``model_init``, the batch size too), checkpoints into ``run-{n}``, and the search returns transformers'
    ``BestRun``; afterwards ``args`` hold the last trial's values and the model is let go, as in transformers."""
    seen = {}
    for name, library in LIBRARIES.items():
        record = Record()
        trainer = _trainer(library, tmp_path / name, [record], save_strategy="steps", save_steps=2)

        def space(trial):
            learning_rate = trial.suggest_float("learning_rate", 1e-4, 1e-2, log=True)
            batch = trial.suggest_categorical("per_device_train_batch_size", [2, 4])
            return {"learning_rate": learning_rate, "per_device_train_batch_size": batch}

        best = trainer.hyperparameter_search(hp_space=space, n_trials=2, sampler=optuna.samplers.RandomSampler(seed=0))
        after = (trainer.args.learning_rate, trainer.args.per_device_train_batch_size, trainer.model)
        seen[name] = (record.trials, best, after, _folders(tmp_path / name))
    assert seen["hflight"] == seen["transformers"]
    trials, best, (lr, batch, model), folders = seen["hflight"]
    assert isinstance(best, transformers.trainer_utils.BestRun)
    assert best.hyperparameters in [t["params"] for t in trials]
    assert [t["batch"] for t in trials] == [t["params"]["per_device_train_batch_size"] for t in trials]
    assert [t["optimizer_lr"] for t in trials] == [t["params"]["learning_rate"] for t in trials]
    assert len({t["batch"] for t in trials}) == 2 and (lr, batch, model) == (*trials[-1]["params"].values(), None)
    assert {f.split("/")[0] for f in folders} == {"run-0", "run-1"}
    assert "run-1/checkpoint-2/model.safetensors" in folders


def test_several_objectives_return_transformers_list_of_best_runs(one_torch_thread, tmp_path):
    """An objective that returns a tuple, with a direction per objective: no report to the study at the evaluations
    during training (a multi-objective study takes none; before, ``Trial.report`` raised), the Pareto front as
    transformers' list of ``BestRun``."""
    results = {}
    for name, library in LIBRARIES.items():
        trainer = _trainer(library, tmp_path / name, eval_strategy="steps", eval_steps=1)
        results[name] = trainer.hyperparameter_search(
            hp_space=lambda trial: {"learning_rate": trial.suggest_float("learning_rate", 1e-4, 1e-2, log=True)},
            compute_objective=lambda metrics: (metrics["eval_loss"], metrics["epoch"]),
            n_trials=2, direction=["minimize", "maximize"], sampler=optuna.samplers.RandomSampler(seed=0),
        )  # fmt: skip
    assert results["hflight"] == results["transformers"]
    assert isinstance(results["hflight"], list) and all(len(run.objective) == 2 for run in results["hflight"])


def test_the_objective_is_reported_to_optuna_after_each_evaluation(one_torch_thread, tmp_path):
    trainer = _trainer(hflight, tmp_path, eval_strategy="steps", eval_steps=1)
    holder = {}

    def space(trial):
        holder["trial"] = trial
        return {"learning_rate": trial.suggest_float("learning_rate", 1e-4, 1e-3)}

    trainer.hyperparameter_search(hp_space=space, n_trials=1, compute_objective=lambda m: m["eval_loss"])
    trial = holder["trial"]
    assert sorted(trial.storage.get_trial(trial._trial_id).intermediate_values) == [1, 2]


@pytest.mark.parametrize("installed", [(1, 1, 1), (0, 1, 1), (0, 0, 1), (1, 0, 0), (0, 0, 0)])
def test_the_default_backend_is_the_one_transformers_picks(monkeypatch, installed):
    """Unnamed, the backend is transformers' ``default_hp_search_backend``: the first installed of optuna, ray,
    wandb; none installed, or a named one missing, raises with hflight's install command."""
    import transformers.hyperparameter_search as hps

    for name, present in zip(("is_optuna_available", "is_ray_tune_available", "is_wandb_available"), installed):
        monkeypatch.setattr(hps, name, lambda present=present: bool(present))
    if any(installed):
        assert backend_named(None).name == default_hp_search_backend()
    else:
        with pytest.raises(RuntimeError, match=r"none is installed: pip install 'hflight\[optuna\]'"):
            backend_named(None)
    if not installed[1]:
        with pytest.raises(RuntimeError, match=r"backend='ray'\) needs ray, which is not installed: .*hflight\[ray\]"):
            backend_named("ray")


def test_bad_input_is_refused_before_any_trial(tmp_path, factory, monkeypatch):
    """No ``model_init``; an unknown backend; a name that is no ``TrainingArguments`` field with a ``model_init``
    that takes no trial; Ray Tune with 2 GPUs a trial or memory metrics; several processes Lightning would launch
    itself; Ray or W&B under a launcher's processes: each refused with what to do, before any trial trains."""
    trainer = hflight.Trainer(factory.qa_model(), hflight.TrainingArguments(output_dir=str(tmp_path), report_to="none"))
    with pytest.raises(RuntimeError, match="model_init"):
        trainer.hyperparameter_search(n_trials=1)
    with pytest.raises(ValueError, match="unknown backend 'sigopt'; hflight supports: 'optuna', 'ray', 'wandb'"):
        _trainer(hflight, tmp_path).hyperparameter_search(n_trials=1, backend="sigopt")
    with pytest.raises(ValueError, match=r"\['lr'\], which are not TrainingArguments fields, and model_init takes no"):
        _trainer(hflight, tmp_path).hyperparameter_search(hp_space=lambda t: {"lr": 0.1}, n_trials=1)
    pytest.importorskip("ray.tune")
    with pytest.raises(ValueError, match="give each trial at most 1 GPU"):
        _trainer(hflight, tmp_path).hyperparameter_search(backend="ray", resources_per_trial={"cpu": 1, "gpu": 2})
    with pytest.raises(ValueError, match="set skip_memory_metrics=True"):
        _trainer(hflight, tmp_path, skip_memory_metrics=False).hyperparameter_search(backend="ray")
    with pytest.raises(ValueError, match="over 2 processes that Lightning would launch itself"):
        _trainer(hflight, tmp_path, accelerator="cpu", devices=2, strategy="ddp").hyperparameter_search(n_trials=1)
    monkeypatch.setenv("WORLD_SIZE", "2")  # as if a launcher had started two processes
    for backend in ("ray", "wandb"):
        with pytest.raises(ValueError, match=f"backend='{backend}'\\) under a launcher with 2 processes"):
            _trainer(hflight, tmp_path).hyperparameter_search(backend=backend)


class _Unreachable:
    """A process group's store that went away (its process ended, its host unreachable): every call fails."""

    timeout = None

    def __getattr__(self, name):
        def fail(*args, **kwargs):
            raise RuntimeError(f"store unreachable ({name})")

        return fail


@pytest.mark.parametrize("rank", [0, 1])
def test_ranks_that_cannot_agree_on_a_trial_stop_the_search(monkeypatch, tmp_path, rank):
    """The rule for several processes that cannot agree on a trial's outcome (here their store is unreachable, and
    the trial fails: no process group): the search stops with the error on that rank, even with a ``catch`` that
    names it; rank 0's study records the trial as failed and stops, rank 1 does not take another trial."""
    from hflight.trainer import hpsearch_backends

    def connect(trainer, caught=()):
        processes = hpsearch_backends.Processes(2, rank, caught)
        processes.store, processes.backend = _Unreachable(), "gloo"
        return processes

    monkeypatch.setattr(hpsearch_backends, "connect", connect)
    storage = optuna.storages.InMemoryStorage()
    cannot = r"could not agree on the outcome of (trial 0|the search) \(RuntimeError: store unreachable"
    with pytest.raises(RuntimeError, match=cannot):
        _trainer(hflight, tmp_path).hyperparameter_search(n_trials=3, storage=storage, study_name="s",
                                                          catch=(RuntimeError, ValueError))  # fmt: skip
    if rank == 0:
        assert [t.state.name for t in optuna.load_study(study_name="s", storage=storage).trials] == ["FAIL"]


# ---- Ray Tune, on a local Ray instance ------------------------------------------------------------------------------
def _ray_search(library, root: Path) -> tuple:
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler
    from ray.tune.search.basic_variant import BasicVariantGenerator

    if library is transformers:  # after any transformers training in this process, accelerate's shared gradient
        from accelerate.state import GradientState  # state holds weak references, which Ray cannot send to workers

        GradientState._reset_state()
    trainer = _trainer(library, root / "out", max_steps=4, eval_strategy="steps", eval_steps=2, save_strategy="steps",
                       save_steps=2)  # fmt: skip
    best = trainer.hyperparameter_search(
        hp_space=lambda _: {"learning_rate": tune.loguniform(1e-4, 1e-2)}, backend="ray", n_trials=2,
        resources_per_trial={"cpu": 1}, keep_checkpoints_num=1, storage_path=str(root / "ray"), verbose=0,
        search_alg=BasicVariantGenerator(random_state=0),
        scheduler=ASHAScheduler(metric="objective", mode="min", max_t=8, grace_period=8),
    )  # fmt: skip
    trials = {}
    for trial in best.run_summary.trials:  # every evaluation reported; the checkpoints Ray kept, in its trial folder
        reports = [json.loads(line) for line in Path(trial.path, "result.json").read_text().splitlines()]
        kept = sorted(Path(trial.path).glob("checkpoint_*/checkpoint-*"))
        trials[trial.trial_id.split("_")[-1]] = {
            "config": trial.config, "eval_losses": [r["eval_loss"] for r in reports],
            "objectives": [r["objective"] for r in reports], "steps": [r["training_iteration"] for r in reports],
            "kept": [(p.parent.name, p.name, sorted(f.name for f in p.iterdir())) for p in kept],
            "run_folder": sorted(_folders(root / "out" / f"run-{trial.trial_id}")),
        }  # fmt: skip
    return (best.run_id.split("_")[-1], best.objective, best.hyperparameters), trials


@pytest.mark.slow
def test_ray_tune_reports_each_evaluation_and_keeps_checkpoints_as_transformers(tmp_path):
    """``backend="ray"`` on a local Ray instance (2 CPUs, a trial each): 2 trials of 4 steps, an evaluation and a
    checkpoint every 2; ``resources_per_trial``, ``scheduler``, ``search_alg``, ``keep_checkpoints_num`` reach Ray
    Tune. Each evaluation is reported (its metrics and the objective), Ray keeps the last checkpoint in each trial's
    folder, the trial's own checkpoints go into ``output_dir/run-{trial id}``; all as transformers'."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.tune")
    path = os.pathsep.join([str(dropin.REPO_ROOT), str(dropin.REPO_ROOT / "src")])  # the workers unpickle the trainer
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}})  # fmt: skip
    try:
        results = {name: _ray_search(library, tmp_path / name) for name, library in LIBRARIES.items()}
    finally:
        ray.shutdown()
    for number in results["transformers"][1]:
        assert results["hflight"][1][number] == results["transformers"][1][number], number
    assert results["hflight"][0] == results["transformers"][0]
    best, trials = results["hflight"]
    assert set(trials) == {"00000", "00001"} and best[2] == trials[best[0]]["config"]
    for trial in trials.values():
        assert trial["steps"] == [1, 2] and trial["objectives"] == trial["eval_losses"]
        assert [(parent, name) for parent, name, _ in trial["kept"]] == [("checkpoint_000001", "checkpoint-4")]
        assert trial["kept"][0][2] == ["config.json", "model.safetensors", "optimizer.pt", "scheduler.pt",
                                       "trainer_state.json", "training_args.bin"]  # fmt: skip
        assert {"checkpoint-2/model.safetensors", "checkpoint-4/optimizer.pt"} <= set(trial["run_folder"])


# ---- W&B sweeps, through a stand-in for W&B's server and agent -------------------------------------------------------
def test_a_wandb_sweep_runs_and_returns_as_transformers(one_torch_thread, tmp_path, monkeypatch):
    """``backend="wandb"``: the sweep config (``hp_space``, the metric and goal transformers sets) goes to
    ``wandb.sweep``, the agent's runs train with the values it picked (read from each run's config, as W&B's agent
    hands them over; the model's own one through ``model_init(config)``) in ``run-{W&B run id}``, each run logs its
    training and evaluation (offline run files), and the ``BestRun`` is transformers'."""
    pytest.importorskip("wandb")
    from . import wandb_records
    from .wandb_sweep_standin import Sweeps

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    seen = {}
    for name, library in LIBRARIES.items():
        monkeypatch.setenv("WANDB_DIR", str(tmp_path / name))
        server, record = Sweeps(seed=0).install(monkeypatch), Record()
        trainer = _trainer(library, tmp_path / name / "out", [record], _model_of, eval_strategy="steps",
                           eval_steps=1, save_strategy="steps", save_steps=2)  # fmt: skip
        best = trainer.hyperparameter_search(hp_space=lambda _: dict(SWEEP), backend="wandb", n_trials=2, project="hp")
        (sweep,) = server.sweeps.values()
        logged = {}
        for run_file in sorted((tmp_path / name / "wandb").glob("offline-run-*/run-*.wandb")):
            rows = wandb_records.history(run_file)
            if rows:  # the run WandbCallback starts for each trial, with the sweep's values (W&B locks them)
                run = wandb_records.run(run_file)
                swept = {item.key: json.loads(item.value_json) for item in run.config.update}
                logged[run_file.stem] = (swept["learning_rate"], [r["eval/loss"] for r in rows if "eval/loss" in r])
        seen[name] = (best, sweep, [run["config"] for run in server.runs["sweep000"]], record.trials, logged,
                      _folders(tmp_path / name / "out"))  # fmt: skip
    assert seen["hflight"] == seen["transformers"]
    best, sweep, picked, trials, logged, folders = seen["hflight"]
    assert sweep["config"]["metric"] == {"name": "eval/loss", "goal": "minimize"} and sweep["project"] == "hp"
    assert [t["lr"] for t in trials] == [p["learning_rate"] for p in picked] == [lr for lr, _ in logged.values()]
    assert [t["params"]["initializer_range"] for t in trials] == [p["initializer_range"] for p in picked]
    assert [t["eval_losses"] for t in trials] == [losses for _, losses in logged.values()]
    assert best.run_id == "sweep000r" + str(min((0, 1), key=lambda i: trials[i]["eval_losses"][-1]))
    assert {"run-sweep000r0/checkpoint-2/model.safetensors", "run-sweep000r1/checkpoint-2/model.safetensors"} <= folders


# ---- several processes: torchrun -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def torchrun_searches(tmp_path_factory) -> dict[str, dict]:
    """tests/jobs/hpsearch_job.py under ``torchrun --standalone --nproc_per_node=2``, with transformers' Trainer and
    with hflight's, both at once; each rank's report, and how hflight's job ended (``"ended"``: its last search's
    error ends it, by design)."""
    root = tmp_path_factory.mktemp("hpsearch_torchrun")
    jobs = {impl: launch.Job([*launch.torchrun(2), JOB, root, impl], root, console=root / f"{impl}.console.txt",
                             timeout=300, name=impl)
            for impl in ("hf", "hl")}  # fmt: skip
    try:  # a hung job (ranks waiting on each other): its whole session goes
        jobs["hf"].ok()
    finally:
        ended = jobs["hl"].wait()
    reports = {impl: {rank: root / f"{impl}-rank{rank}.json" for rank in (0, 1)} for impl in ("hf", "hl")}
    assert all(path.exists() for path in reports["hl"].values()), f"hl ended before its report:\n{ended.tail()}"
    return {"ended": ended, **{impl: {rank: json.loads(path.read_text()) for rank, path in paths.items()}
                               for impl, paths in reports.items()}}  # fmt: skip


@pytest.mark.subprocess
@pytest.mark.slow
def test_under_torchrun_every_rank_trains_the_trials_rank_zero_samples(torchrun_searches):
    """Each trial trains with the same hyperparameters on both ranks (the ones rank 0 sampled: ``args``, the
    optimizer's learning rate, the batch size), with transformers' evaluation losses; rank 0 returns transformers'
    ``BestRun``, rank 1 ``None``. (Before, each rank ran a study of its own, its sampler seeded with its rank here:
    other values on rank 1, and a ``BestRun`` on each rank.)"""
    ours, theirs = torchrun_searches["hl"], torchrun_searches["hf"]
    assert ours[0]["world"] == ours[1]["world"] == theirs[0]["world"] == 2
    trials = ours[0]["search"]["trials"]
    assert len(trials) == 3 and ours[1]["search"]["trials"] == trials
    for trial in trials:
        params = trial["params"]
        assert (trial["learning_rate"], trial["optimizer_lr"]) == (params["learning_rate"],) * 2
        assert (
            trial["per_device_train_batch_size"] == trial["train_batch_size"] == params["per_device_train_batch_size"]
        )
    assert len({t["learning_rate"] for t in trials}) == 3 and len({t["train_batch_size"] for t in trials}) == 2
    for rank in (0, 1):
        assert ours[rank]["search"] == theirs[rank]["search"]
    assert ours[0]["search"]["type"] == "BestRun" and ours[1]["search"]["returned"] is None


@pytest.mark.subprocess
@pytest.mark.slow
def test_under_torchrun_a_pruned_trial_stops_on_every_rank(torchrun_searches):
    """Rank 0's pruner stops trial 1 after its first evaluation: both ranks stop it there and end the search together
    (transformers' other ranks would train on, into rank 0's next collectives). Rank 1's process has a pruner that
    would stop trial 0 at its first evaluation: only rank 0's decides (a rank deciding for itself would stop trial 0
    on rank 1 alone)."""
    ours = torchrun_searches["hl"]
    for rank in (0, 1):
        pruned = ours[rank]["pruned"]
        assert [len(t["eval_losses"]) for t in pruned["trials"]] == [2, 1]
        assert pruned["trials"] == ours[0]["pruned"]["trials"]
    assert ours[0]["pruned"]["returned"]["run_id"] == "0" and ours[1]["pruned"]["returned"] is None


def _failures(reports: dict[int, dict], failing: int, where: str, caught: bool) -> tuple[dict, dict]:
    """Rank 0's and rank 1's report of the search of hflight's job whose trial 0 failed on rank ``failing``
    (``where``), with ``catch=(RuntimeError,)`` or without."""
    found = [[r for r in reports[rank]["failures"] if r["case"] == [failing, where, caught]] for rank in (0, 1)]
    assert [len(each) for each in found] == [1, 1]
    return found[0][0], found[1][0]


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize(("failing", "where"), [(0, "forward"), (1, "step_end")])
def test_under_torchrun_a_trial_failing_on_one_rank_fails_on_every_rank_and_catch_goes_on(torchrun_searches, failing,
                                                                                           where):  # fmt: skip
    """``catch=(RuntimeError,)``, trial 0 raising on one rank only (in the forward of step 2: the other rank waits in
    the gradients' all-reduce; at the end of step 1: in the step's collectives): both ranks leave trial 0, rank 0's
    study records it as failed (as optuna does in one process), the search goes on to trial 1 on both ranks, and rank 0
    returns trial 1. The rank that raised logged its error; rank 0's study logged the failure, naming the rank and the
    error. (Before, the rank that caught it went on to the next trial while the other waited in a collective: the job
    hung until its time-out.)"""
    zero, one = _failures(torchrun_searches["hl"], failing, where, caught=True)
    assert zero["error"] is None and one["error"] is None
    assert zero["states"] == ["FAIL", "COMPLETE"]
    assert zero["search"]["returned"]["run_id"] == "1" and one["search"]["returned"] is None
    trials = [report["search"]["trials"] for report in (zero, one)]
    assert [t["params"] for t in trials[0]] == [t["params"] for t in trials[1]] and len(trials[0]) == 2
    assert trials[0][1] == trials[1][1] and len(trials[0][1]["eval_losses"]) == 2
    error = f"RuntimeError: trial 0 fails on rank {failing}"
    assert any(error in message for message in (zero, one)[failing]["logged"]), (zero, one)[failing]["logged"]
    failed = [m for m in zero["logged"] if m.startswith("Trial 0 failed with parameters")]
    assert len(failed) == 1 and error in failed[0] and (failing == 0 or "failed on rank 1" in failed[0]), failed


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize(("failing", "where"), [(0, "step_end"), (1, "forward")])
def test_under_torchrun_a_trial_failing_on_one_rank_without_catch_stops_the_search_on_every_rank(
    torchrun_searches, failing, where
):
    """No ``catch``, trial 0 raising on one rank only: the search stops on both ranks, the rank that failed with its
    error, the other with ``TrialFailedOnAnotherRank`` naming that rank and error; rank 0's study records the trial as
    failed; the processes stay connected (the job's next search runs on them). A script that does not catch the error
    ends on every rank: hflight's job ends so (its last search), with a non-zero exit status and before its time-out.
    (Before, the other rank waited in a collective until the failed rank's process exited, then raised gloo's
    "Connection closed by peer"; in this job, which goes on after the error, it hung.)"""
    zero, one = _failures(torchrun_searches["hl"], failing, where, caught=False)
    failed, other = (zero, one)[failing], (zero, one)[1 - failing]
    assert failed["error"]["type"] == "RuntimeError" and failed["error"]["message"].startswith(
        f"trial 0 fails on rank {failing}"
    )
    assert other["error"]["type"] == "TrialFailedOnAnotherRank"
    assert other["error"]["message"] == f"Trial 0 failed on rank {failing}: RuntimeError: {failed['error']['message']}"
    assert zero["states"] == ["FAIL"]
    assert len(zero["search"]["trials"]) == len(one["search"]["trials"]) == 1
    assert any(f"RuntimeError: trial 0 fails on rank {failing}" in message for message in failed["logged"])
    ended = torchrun_searches["ended"]
    assert ended.returncode != 0 and "RuntimeError: trial 0 fails on rank 1 at the end of step 1" in ended.output
