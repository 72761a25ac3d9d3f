"""Sweeps that outgrow one process: hflight's Optuna sweeper (hydra/sweeper=optuna on Optuna >= 4), its study in a
database, pruning, continued searches and the joblib and submitit launchers.

The unit tests cover the pieces (the search space as hydra-optuna-sweeper reads it, the storage and study checks,
retries, threads per job, resume of a sweep folder). The end-to-end ones run real ``python -m hflight`` sweeps (the
same entry point as ``hflight-train``) over ``tests/jobs/tiny_task.py`` (hflight's Trainer on a one-layer
regression, about a second per job) with ``--config-dir tests/jobs/sweep_conf +experiment=tiny_sweep``: a sweeper
killed with SIGKILL and continued with ``resume=<sweep folder>``, two sweepers sharing one study, a pruned trial,
joblib with SIGTERM and submitit's local executor.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")
pytest.importorskip("hydra_plugins.hydra_joblib_launcher")

from omegaconf import OmegaConf  # noqa: E402
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution  # noqa: E402
from optuna.trial import TrialState  # noqa: E402

from hflight.checkpoints.manifest import get_last_checkpoint  # noqa: E402
from hflight.cli import resume_arguments  # noqa: E402
from hflight.sweeps import launchers  # noqa: E402
from hflight.sweeps.search_space import distribution_from_dict, grid_choices, split_overrides  # noqa: E402
from hflight.sweeps.study import (  # noqa: E402
    FAILURE,
    SweepError,
    check_study,
    finished,
    mask_url,
    open_storage,
    open_study,
    retry_trial,  # noqa: E402
)

from . import launch  # noqa: E402
from .support import TINY  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
JOBS = REPO / "tests" / "jobs"
SWEEP = ["--config-dir", str(JOBS / "sweep_conf"), "+experiment=tiny_sweep"]
#: eval_loss of tiny_task after its 8 steps at each learning rate (an uninterrupted job; seeds fixed)
UNINTERRUPTED = {0.0: 5.370688438415527, 0.05: 4.257082462310791, 0.2: 1.8034749031066895}


# ---------------------------------------------------------------------------------------------------- search space
def test_the_mrc_search_space_reads_as_hydra_optuna_sweeper_reads_it():
    preset = OmegaConf.load(REPO / "conf" / "hparams_search" / "mrc_optuna.yaml").hydra.sweeper.params
    space, fixed = split_overrides([f"{k}={v}" for k, v in preset.items()])
    assert fixed == {}
    assert space == {
        "args.learning_rate": FloatDistribution(3e-4, 5e-3, log=True),
        "args.per_device_train_batch_size": CategoricalDistribution([16, 32, 64]),
        "args.warmup_steps": FloatDistribution(0.0, 0.2),
        "args.weight_decay": CategoricalDistribution([0.0, 0.01, 0.1]),
    }


def test_every_form_of_the_grammar_and_the_dict_form():
    space, fixed = split_overrides(
        [
            "a=interval(1, 5)",
            "b=tag(log, interval(1, 64))",
            "c=range(1, 5)",
            "d=range(0.0, 1.0, step=0.25)",
            "e=choice(x, 'y z', true)",
            "f=shuffle(range(3))",
            "g=3",
            "+experiment=mrc",
        ]  # fmt: skip
    )
    # Hydra's interval is always a float interval (hydra-optuna-sweeper's int branch never applies either)
    assert space["a"] == FloatDistribution(1.0, 5.0) and space["b"] == FloatDistribution(1.0, 64.0, log=True)
    assert space["c"] == IntDistribution(1, 5)  # both ends, as hydra-optuna-sweeper
    assert space["d"] == FloatDistribution(0.0, 1.0, step=0.25)
    assert space["e"].choices == ("x", "y z", True) and sorted(space["f"].choices) == [0, 1, 2]
    assert fixed == {"g": "3", "+experiment": "mrc"}
    assert distribution_from_dict("lr", {"type": "float", "low": 1e-4, "high": 1e-2, "log": True}) == FloatDistribution(
        1e-4, 1e-2, log=True
    )
    assert distribution_from_dict("n", {"type": "int", "low": 1, "high": 9, "step": 2}) == IntDistribution(1, 9, step=2)
    assert distribution_from_dict("k", {"type": "categorical", "choices": [1, 2]}) == CategoricalDistribution([1, 2])
    with pytest.raises(SweepError, match="search_space.k: unknown keys"):
        distribution_from_dict("k", {"type": "int", "low": 1, "high": 2, "lo": 3})
    assert grid_choices("c", space["c"]) == [1, 2, 3, 4] and grid_choices("e", space["e"]) == list(space["e"].choices)
    with pytest.raises(SweepError, match="GridSampler needs discrete values"):
        grid_choices("x", FloatDistribution(0.0, 1.0))


# ---------------------------------------------------------------------------------------------------- storage, study
def test_a_storage_that_cannot_be_opened_fails_naming_the_url_without_its_password(tmp_path):
    with pytest.raises(SweepError) as err:
        open_storage("postgresql://bob:s3cret@127.0.0.1:1/db")
    assert "cannot open postgresql://bob:***@127.0.0.1:1/db" in str(err.value) and "s3cret" not in str(err.value)
    with pytest.raises(SweepError, match="'nonsense' is not a database URL"):
        open_storage("nonsense")
    with pytest.raises(SweepError, match="cannot open sqlite:////proc/none/optuna.db"):
        open_storage("sqlite:////proc/none/optuna.db")
    assert mask_url("mysql://u:p@h/db") == "mysql://u:***@h/db" and mask_url("sqlite:///a.db") == "sqlite:///a.db"


def test_a_study_reopened_with_another_direction_or_search_space_is_refused(tmp_path):
    storage = open_storage(f"sqlite:///{tmp_path / 'optuna.db'}")
    space = {"lr": FloatDistribution(1e-4, 1e-2, log=True), "bs": CategoricalDistribution([16, 32])}
    study = open_study(storage, "s", ["maximize"], None, None, space)
    assert open_study(storage, "s", ["maximize"], None, None, dict(space)).study_name == "s"  # the same: fine
    with pytest.raises(
        SweepError, match=r"exists with direction \['maximize'\] and this sweep asks for \['minimize'\]"
    ):
        open_study(storage, "s", ["minimize"], None, None, space)
    with pytest.raises(SweepError) as err:
        check_study(study, ["maximize"], {"lr": FloatDistribution(1e-4, 1e-1, log=True), "wd": FloatDistribution(0, 1)})
    message = str(err.value)
    assert "bs: in the study, not in this sweep" in message and "wd: in this sweep, not in the study" in message
    assert "lr: FloatDistribution(" in message and "high=0.01" in message and "high=0.1" in message
    assert open_study(storage, None, ["maximize"], None, None, space).study_name == "s"  # the one study it holds


def test_finished_trials_count_and_an_interrupted_one_runs_again_once(tmp_path):
    study = optuna.create_study(storage=f"sqlite:///{tmp_path / 'optuna.db'}", study_name="s")
    dist = {"x": FloatDistribution(0, 1)}
    for state in (TrialState.COMPLETE, TrialState.PRUNED):
        study.add_trial(optuna.trial.create_trial(state=state, params={"x": 0.5}, distributions=dist, value=1.0))
    failed = study.ask(dist)
    failed.set_user_attr(FAILURE, "raised ValueError: bad data")
    study.tell(failed, state=TrialState.FAIL)
    interrupted = study.ask(dist)
    study.tell(interrupted, state=TrialState.FAIL)
    trials = study.get_trials()
    assert [finished(t) for t in trials] == [True, True, True, False]
    retry_trial(1, study, trials[3])
    copy = study.get_trials()[4]
    assert copy.state == TrialState.WAITING and copy.params == trials[3].params
    assert copy.system_attrs["retry_history"] == [3] and not any(k.startswith("hflight:") for k in copy.user_attrs)
    retry_trial(1, study, copy)  # a retry interrupted again: max_retry=1 reached
    assert len(study.get_trials()) == 5


def test_a_parallel_launcher_shares_the_cores_between_its_jobs(monkeypatch):
    monkeypatch.setattr(launchers, "_cores", lambda: 8)
    joblib = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
    local = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"
    slurm = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"

    def threads(launcher, sweeper=None):
        return launchers.threads_per_job(OmegaConf.create({"launcher": launcher, "sweeper": sweeper or {}}))

    assert threads({"_target_": joblib, "n_jobs": 2}) == 4
    assert threads({"_target_": joblib, "n_jobs": -1}) == 1  # joblib's -1: every core
    assert threads({"_target_": joblib, "n_jobs": -1}, {"n_jobs": 2}) == 4  # the sweeper hands over 2 at a time
    assert threads({"_target_": joblib, "n_jobs": -3}) == 1 and threads({"_target_": joblib, "n_jobs": 16}) == 1
    assert threads({"_target_": local}, {"max_batch_size": 4}) == 2
    assert threads({"_target_": slurm}) is None and threads({"_target_": "hydra._internal.BasicLauncher"}) is None
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    assert launchers.requeue_signal_under_launcher("SIGUSR1") == "SIGUSR2"
    assert launchers.requeue_signal_under_launcher("SIGHUP") == "SIGHUP"


@pytest.fixture(scope="module")
def sweeper_counts() -> dict[bool, list[str]]:
    """Each order (scan first, or hflight.config first) in a process of its own: one interpreter imports what
    hflight.config needs (torch, transformers: most of its start), neither the plugins' scan nor hflight.config,
    then forks a child per order; each child is a process whose scan and hflight.config are still to come. Per order,
    what its child printed: the times ``--info plugins`` would list the sweeper, and whether a config composed after
    both finds the sweeper's class."""
    scan, config = "from hydra.core.plugins import Plugins; Plugins.instance()", "import hflight.config"
    child = "\n".join(
        [
            "from hydra.core.plugins import Plugins\nfrom hydra.plugins.sweeper import Sweeper",
            "found = [c.__name__ for c in Plugins.instance().discover(Sweeper)].count('OptunaSweeper')",
            "from hydra import compose, initialize_config_dir",
            "from hflight.config import VERSION_BASE, find_config_dir",
            "with initialize_config_dir(config_dir=str(find_config_dir()), version_base=VERSION_BASE):",
            "    cfg = compose('train', overrides=['+experiment=mrc', '+hparams_search=mrc_optuna'],",
            "                  return_hydra_config=True)",
            "print(ORDER, found, cfg.hydra.sweeper._target_ in Plugins.instance().class_name_to_class, flush=True)",
        ]
    )
    code = "\n".join(
        [
            "import os, sys",
            "import hflight.arguments.training_args  # torch and transformers; not hflight.config",
            "assert 'hflight.config' not in sys.modules and 'hydra.core.plugins' not in sys.modules",
            f"for ORDER, first, second in (('True', {scan!r}, {config!r}), ('False', {config!r}, {scan!r})):",
            "    if os.fork() == 0:",
            "        exec(first); exec(second)",
            f"        exec({child!r})",
            "        os._exit(0)",
            "    assert os.waitpid(-1, 0)[1] == 0",
        ]
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=_env())
    assert done.returncode == 0, (done.stdout, done.stderr[-3000:])
    return {line.split()[0] == "True": line.split()[1:] for line in done.stdout.splitlines()}


@pytest.mark.parametrize("scan_first", [True, False], ids=["scan-first", "hflight-first"])
def test_hydra_knows_the_sweeper_once_whichever_comes_first(sweeper_counts, scan_first):
    """Hydra scans its plugins once per process; in an editable install its scan cannot list hflight's (setuptools'
    editable finder), and a scan before hflight.config was imported missed it: CI's first failure. hflight.config
    registers the sweeper's configs and class itself, so a config composed after the scan finds the sweeper's class.
    And the scan executes every plugin module anew: a class imported by hflight.config and the one the scan found
    would be two classes of one name, listed twice by ``--info plugins``. (Both orders come from one interpreter's
    start, forked once per order: :func:`sweeper_counts`.)"""
    assert sweeper_counts[scan_first] == ["1", "True"], sweeper_counts


# ---------------------------------------------------------------------------------------------------- resume=
def _sweep_folder(path: Path, sweeper: str, db: bool = True) -> Path:
    path.mkdir(parents=True)
    hydra = {
        "sweeper": {"_target_": sweeper, "storage": None},
        "overrides": {
            "task": ["+experiment=mrc", "+hparams_search=mrc_optuna"],
            "hydra": ["hydra.sweeper.n_trials=3", f"hydra.sweep.dir={path}", "hydra/launcher=joblib"],
        },  # fmt: skip
        "runtime": {"config_sources": [{"provider": "command-line", "schema": "file", "path": "/my/conf"}]},
    }
    (path / "multirun.yaml").write_text(OmegaConf.to_yaml({"hydra": hydra, "args": {}}))
    if db:
        (path / "optuna.db").write_bytes(b"")
    return path


def test_resume_of_a_sweep_folder_is_its_own_command_again(tmp_path):
    from hflight.cli import OPTUNA_SWEEPER

    folder = _sweep_folder(tmp_path / "sweep", OPTUNA_SWEEPER)
    assert resume_arguments([f"resume={folder}", "hydra.sweeper.n_trials=5"]) == [
        "-m", "--config-dir", "/my/conf", "+experiment=mrc", "+hparams_search=mrc_optuna", "hydra/launcher=joblib",
        "hydra.sweeper.n_trials=5", f"hydra.sweep.dir={folder}",
    ]  # fmt: skip
    basic = _sweep_folder(tmp_path / "basic", "hydra._internal.core_plugins.basic_sweeper.BasicSweeper")
    with pytest.raises(ValueError, match="BasicSweeper keeps no study to continue"):
        resume_arguments([f"resume={basic}"])
    never = _sweep_folder(tmp_path / "never", OPTUNA_SWEEPER, db=False)
    with pytest.raises(ValueError, match=r"the search's study \(optuna.db\) is not there"):
        resume_arguments([f"resume={never}"])
    with pytest.raises(ValueError, match="neither a run folder .* nor a sweep folder"):
        resume_arguments([f"resume={tmp_path}"])


# ---------------------------------------------------------------------------------------------------- end to end
def _env(**more: str) -> dict[str, str]:
    pythonpath = os.pathsep.join([str(REPO / "src"), str(JOBS)])  # this checkout's hflight, the jobs' tasks
    env = {**os.environ, "PYTHONPATH": pythonpath, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("HFLIGHT_SWEEPER_PID", None)
    return {**env, **more}


def _start(cwd: Path, *overrides: str, log: str = "sweep.log", **env: str) -> launch.Job:
    """``python -m hflight <overrides>`` in ``cwd``, its output in ``cwd/<log>``: the sweeper and the jobs it starts
    in a session of their own, killed when the test is done with them."""
    return launch.Job([sys.executable, "-m", "hflight", *overrides], cwd, _env(**env), console=cwd / log, timeout=240,
                      name=log)  # fmt: skip


def _wait(job: launch.Job) -> str:
    """The sweeper's output once it ended (within 240 s)."""
    return job.wait().output


def _until(condition, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _trials(db: Path, name: str = "tiny") -> list:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{db}").get_trials()


def _summary(folder: Path) -> list[dict[str, str]]:
    return list(csv.DictReader((folder / "summary.csv").open()))


def _lr(trial) -> float:
    return trial.params["args.learning_rate"]


def _steps(folder: Path) -> list[int]:
    return sorted(int(p.name.rpartition("-")[2]) for p in folder.glob("checkpoint-*"))


def _resume(sweep: Path, cwd: Path, *overrides: str, **env: str) -> None:
    resumed = subprocess.run([sys.executable, "-m", "hflight", f"resume={sweep}", *overrides], cwd=cwd, env=_env(**env),
                             capture_output=True, text=True, timeout=300)  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]


def _assert_continued(retry, interrupted, marks: Path) -> None:
    """The retry continued the interrupted trial, not started again: retry_history names it, its training started at
    the step of the interrupted job's last checkpoint (tiny_task's marks), its first logged loss came after that
    step, and its own folder holds no checkpoint of the steps before."""
    old, new = Path(interrupted.user_attrs["hflight:job_dir"]), Path(retry.user_attrs["hflight:job_dir"])
    resumed = int(Path(get_last_checkpoint(old)).name.rpartition("-")[2])
    assert retry.system_attrs["retry_history"] == [interrupted.number] and retry.params == interrupted.params
    assert int((marks / f"{new.name}.started").read_text().split()[2]) == resumed > 0  # the restored global_step
    logged = [int(step) for step in (marks / f"{new.name}.logged").read_text().split()]
    assert logged[0] == resumed + 2 - resumed % 2 and logged[-1] == 8  # logging_steps=2: the next one after it
    assert _steps(new)[0] > resumed and _steps(new)[-1] == 8


def test_a_killed_search_resumes_keeping_its_trials_and_continues_the_killed_trial(tmp_path):
    """SIGKILL to the sweeper while trial 2 trains (after its checkpoint-2; held at the end of step 3 by tiny_task's
    ``TINY_HOLD``): trial 2 stays RUNNING until its heartbeat goes stale; ``resume=<sweep folder>`` marks it FAIL, runs
    its parameters again from its checkpoint, and ends with 4 finished trials, trials 0 and 1 untouched. Trial 1
    (learning rate 0, hopeless) is pruned. With load_best_model_at_end and save_total_limit (as the mrc recipe
    trains): the retry failed at once before ("best_model_checkpoint '<sweep>/2/checkpoint-2' lies outside
    output_dir (<sweep>/3)"); it continues, trial 2's best checkpoint carried over, and ends with an uninterrupted
    run's value. (This run replaced an mrc sweep killed the same way; the mrc recipe's own search runs in
    tests/test_readme_commands.py::test_readme_command_works_as_written, and best-model tracking across folders,
    parity with transformers included, in tests/test_resume.py::
    test_resume_from_a_checkpoint_in_another_folder_keeps_best_model_tracking_as_transformers.)"""
    sweep, marks = tmp_path / "sweep", tmp_path / "marks"
    marks.mkdir()
    best = ["args.load_best_model_at_end=true", "args.metric_for_best_model=eval_loss", "args.save_total_limit=2"]
    proc = _start(tmp_path, *SWEEP, *best, f"hydra.sweep.dir={sweep}", "+hydra/sweeper/pruner=median",
                  "hydra.sweeper.pruner.n_startup_trials=1", TINY_HOLD="2:3", TINY_MARK=str(marks))  # fmt: skip
    _until(lambda: (marks / "2.held").is_file() or proc.process.poll() is not None)
    assert (sweep / "2" / "checkpoint-2" / "trainer_state.json").is_file()
    proc.process.kill()  # the sweeper alone, as before: what it started is left as a SIGKILL leaves it
    proc.process.wait()
    before = _trials(sweep / "optuna.db")
    assert [t.state for t in before] == [TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING]
    assert _lr(before[1]) == 0.0 and before[1].intermediate_values == {2: pytest.approx(UNINTERRUPTED[0.0])}
    assert (
        json.loads((sweep / "1" / "pruned.json").read_text())["step"] == 2 and (sweep / "1" / "checkpoint-2").is_dir()
    )
    assert not (sweep / "1" / "all_results.json").exists()

    _resume(sweep, tmp_path, TINY_MARK=str(marks))
    after = _trials(sweep / "optuna.db")
    assert [(t.number, t.state, t.value) for t in after[:2]] == [(t.number, t.state, t.value) for t in before[:2]]
    assert after[2].state == TrialState.FAIL  # stale heartbeat
    retry = after[3]
    _assert_continued(retry, after[2], marks)
    assert retry.state == TrialState.COMPLETE and retry.value == pytest.approx(UNINTERRUPTED[_lr(retry)], rel=1e-5)
    assert sum(finished(t) for t in after) == 4 and len(after) == 5 and after[4].state != TrialState.FAIL
    overrides = (sweep / "3" / ".hydra" / "overrides.yaml").read_text()
    assert f"args.resume_from_checkpoint={sweep / '2' / 'checkpoint-2'}" in overrides.replace("'", "")
    state = json.loads((sweep / "3" / "trainer_state.json").read_text())
    kept = Path(state["best_model_checkpoint"])  # carried over from trial 2's folder, or a later one of the retry's
    assert state["global_step"] == 8 and kept.is_dir()
    assert kept == sweep / "2" / "checkpoint-2" or kept.parent == sweep / "3"
    rows = _summary(sweep)
    assert [r["job"] for r in rows] == ["0", "1", "2", "3", "4"]
    states = {t.user_attrs["hflight:job_dir"]: t.state.name for t in after}
    states[str(sweep / "2")] = "RESUMED"  # the killed trial, continued by its retry (job 3): one trial, not two
    assert {r["folder"]: r["state"] for r in rows} == states
    assert (sweep / "summary.md").read_text().startswith("# Sweep summary (4 trials)\n")  # n_trials=4
    for picture in ("optimization_history.png", "param_importances.png"):
        assert (sweep / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    best = OmegaConf.load(sweep / "optimization_results.yaml")
    assert best.best_value == min(t.value for t in after if t.state == TrialState.COMPLETE)


def test_the_readme_search_stopped_by_ctrl_c_continues_its_search(tmp_path):
    """The README's search (``+hparams_search=mrc_optuna``: TPE seeded, random for its first trials) at tiny sizes,
    2 trials, its sweep folder given relative; Ctrl-C (SIGINT, sent by a callback in the middle of trial 0's step 2)
    stops trial 0 with its checkpoint, and the output says one thing to do: continue the search, ``resume=`` of the
    sweep folder (it named the trial's folder, after the Python call). Continued so, the search runs trial 0's
    parameters again from its checkpoint, then a new trial that is not trial 0 again (the seeded sampler started its
    sequence anew: the continued search's first new trial had trial 0's parameters). The summary counts trials, the
    interrupted job RESUMED by its retry, each folder absolute before and after the resume (relative before)."""
    sweep = tmp_path / "sweep"
    tiny = [o for o in TINY if not o.startswith("args.num_train_epochs=")] + ["args.num_train_epochs=1"]
    ctrl_c = ["+callbacks.preempt._target_=signal_callbacks.SendSignal", "+callbacks.preempt.signal_name=SIGINT",
              "+callbacks.preempt.step=2"]  # fmt: skip
    job = _start(tmp_path, *tiny, "+hparams_search=mrc_optuna", "hydra.sweeper.n_trials=2", "hydra.sweep.dir=sweep",
                 *ctrl_c)  # fmt: skip
    output = _wait(job)
    assert job.process.returncode == 128 + signal.SIGINT, output[-3000:]
    told = f"To continue this search: hflight-train resume={sweep}\n"
    assert told in output and output.count("resume") == 1, output[-3000:]  # not train(resume_from_checkpoint=...)
    assert told in (sweep / "0" / "error.txt").read_text() and _steps(sweep / "0") == [2]
    assert [(r["job"], r["state"], r["folder"]) for r in _summary(sweep)] == [("0", "FAIL", str(sweep / "0"))]

    _resume(sweep, tmp_path, "+callbacks.preempt.step=null")  # as printed; no Ctrl-C this time
    trials = _trials(sweep / "optuna.db", "mrc")
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.COMPLETE, TrialState.COMPLETE]
    assert trials[1].system_attrs["retry_history"] == [0] and trials[1].params == trials[0].params
    overrides = (sweep / "1" / ".hydra" / "overrides.yaml").read_text().replace("'", "")
    assert f"args.resume_from_checkpoint={sweep / '0' / 'checkpoint-2'}" in overrides
    drawn = [t for t in trials if "retry_history" not in t.system_attrs]  # the sampler's own proposals
    assert [t.number for t in drawn] == [0, 2] and drawn[1].params != drawn[0].params
    rows = [(r["job"], r["state"], r["folder"]) for r in _summary(sweep)]
    assert rows == [("0", "RESUMED", str(sweep / "0"))] + [(n, "COMPLETE", str(sweep / n)) for n in "12"]
    summary = (sweep / "summary.md").read_text()
    assert summary.startswith("# Sweep summary (2 trials)\n") and "job 1 continued it (RESUMED)" in summary


def test_two_sweepers_on_one_storage_share_the_study(tmp_path):
    """Two sweepers, each in its own folder, one SQLite file: 6 trials in all, numbers never collide."""
    db = tmp_path / "shared.db"
    common = [*SWEEP, "hydra.sweeper.n_trials=6", f"hydra.sweeper.storage='sqlite:///{db}'"]
    procs = [_start(tmp_path, *common, f"hydra.sweep.dir={tmp_path / name}", f"hydra.sweeper.sampler.seed={seed}",
                    log=f"{name}.log") for name, seed in (("a", 1), ("b", 2))]  # fmt: skip
    logs = [_wait(proc) for proc in procs]
    assert [p.process.returncode for p in procs] == [0, 0], "\n".join(log[-2000:] for log in logs)
    trials = _trials(db)
    assert [t.number for t in trials] == list(range(6)) and all(t.state == TrialState.COMPLETE for t in trials)
    folders = [Path(t.user_attrs["hflight:job_dir"]).parent.name for t in trials]
    ran = {name: folders.count(name) for name in "ab"}
    assert ran["a"] >= 1 and ran["b"] >= 1 and ran["a"] + ran["b"] == 6
    for name in "ab":
        assert len(_summary(tmp_path / name)) == ran[name]
        for trial in trials:
            if Path(trial.user_attrs["hflight:job_dir"]).parent.name == name:
                results = json.loads((Path(trial.user_attrs["hflight:job_dir"]) / "all_results.json").read_text())
                assert math.isclose(results["eval_loss"], trial.value, rel_tol=1e-9)


#: where the jobs of a signalled batch are held (``TINY_HOLD``) and stop: after checkpoint-2, before checkpoint-4
STOP_STEP = 3


def _stopped_batch(sweep: Path, marks: Path, job: launch.Job, signum: int) -> list:
    """Sends ``signum`` to the sweeper once both jobs of its batch (2 trials, 2 at a time) are held at the end of
    step 3, after their checkpoint-2 (tiny_task's ``TINY_HOLD``: each waits there until the signal reaches it, so
    neither can have run on, whatever the machine's load): each job stops at that step's boundary with a checkpoint,
    the sweeper marks both trials FAIL (interrupted), queues their parameters again (WAITING), writes the summary and
    exits with 128 + the signal number."""
    held = [marks / f"{j}.held" for j in "01"]
    proc = job.process
    _until(lambda: all(p.is_file() for p in held) or proc.poll() is not None)
    assert all((sweep / j / "checkpoint-2" / "trainer_state.json").is_file() for j in "01")
    pids = [int((marks / f"{j}.started").read_text().split()[1]) for j in "01"]
    assert proc.pid not in pids and pids[0] != pids[1]  # two job processes
    proc.send_signal(signum)
    log = _wait(job)
    name = signal.Signals(signum).name
    assert proc.returncode == 128 + signum, log[-3000:]
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-3000:]
    trials = _trials(sweep / "optuna.db")
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.FAIL, TrialState.WAITING, TrialState.WAITING]
    assert all(t.user_attrs["hflight:interrupted"] == f"stopped by {name}" for t in trials[:2])
    for job in "01":
        stopped = re.search(rf"Training stopped by {name} after step (\d+) of", (sweep / job / "error.txt").read_text())
        assert stopped and int(stopped[1]) == STOP_STEP and _steps(sweep / job) == [2, STOP_STEP]
        assert not list((sweep / job).glob(".tmp-*"))  # nothing half-written or left aside
    assert [r["state"] for r in _summary(sweep)] == ["FAIL", "FAIL"]
    return pids


def _retries_continue(sweep: Path, marks: Path, cwd: Path) -> None:
    """``resume=<sweep>``: the two interrupted trials run again from their checkpoints and complete with the values
    of uninterrupted jobs. The continuation is the sweeper's, whatever the launcher: the resumed search runs its
    retries one at a time (``hydra.launcher.n_jobs=1``: joblib runs them in the sweeper's process, without starting
    two workers again; the stopped batch showed two jobs at once)."""
    _resume(sweep, cwd, "hydra.launcher.n_jobs=1", "hydra.sweeper.n_jobs=1", TINY_MARK=str(marks))
    trials = _trials(sweep / "optuna.db")
    assert [t.state for t in trials] == [TrialState.FAIL] * 2 + [TrialState.COMPLETE] * 2
    for retry in trials[2:]:
        _assert_continued(retry, trials[retry.system_attrs["retry_history"][0]], marks)
        assert retry.value == pytest.approx(UNINTERRUPTED[_lr(retry)], rel=1e-5)
    assert [r["state"] for r in _summary(sweep)] == ["RESUMED", "RESUMED", "COMPLETE", "COMPLETE"]


def test_joblib_runs_two_jobs_at_once_and_a_sigterm_stops_both_with_their_checkpoints(tmp_path):
    """hydra/launcher=joblib, 2 jobs at a time, each with half the cores this test runs on as torch threads; SIGTERM
    to the sweeper reaches both jobs, which stop with a checkpoint; the trials are FAIL (interrupted) and continue
    from there on resume. (SIGINT takes the same way, forwarded to the jobs: the submitit test below sends it.)"""
    signum = signal.SIGTERM
    sweep, marks = tmp_path / "sweep", tmp_path / "marks"
    marks.mkdir()
    joblib = ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "hydra.sweeper.n_jobs=2", "hydra.sweeper.n_trials=2"]
    proc = _start(tmp_path, *SWEEP, f"hydra.sweep.dir={sweep}", *joblib, TINY_HOLD=str(STOP_STEP), TINY_MARK=str(marks))
    _stopped_batch(sweep, marks, proc, signum)
    threads = max(1, len(os.sched_getaffinity(0)) // 2)  # the cores this process (and the sweep) may run on
    assert [(marks / f"{j}.started").read_text().split()[0] for j in "01"] == [str(threads)] * 2
    _retries_continue(sweep, marks, tmp_path)


def test_submitit_local_runs_the_jobs_as_its_own_processes_and_sigint_stops_them(tmp_path):
    """hydra/launcher=submitit_local: submitit pickles each job and runs it in a subprocess of its local executor.
    SIGINT to the sweeper reaches the jobs, not submitit's controller processes between them (which would turn it
    into a KeyboardInterrupt, then a second SIGINT and a SIGKILL a second later for their job); the jobs stop with
    their checkpoints, each one's outcome pickled by submitit. (Their continuation on resume is the sweeper's, whatever
    the launcher: the joblib test above shows it.)"""
    sweep, marks = tmp_path / "sweep", tmp_path / "marks"
    marks.mkdir()
    proc = _start(tmp_path, *SWEEP, f"hydra.sweep.dir={sweep}", "hydra/launcher=submitit_local",
                  "hydra.sweeper.n_jobs=2", "hydra.sweeper.n_trials=2",
                  TINY_HOLD=str(STOP_STEP), TINY_MARK=str(marks))  # fmt: skip
    _stopped_batch(sweep, marks, proc, signal.SIGINT)
    assert len(list((sweep / ".submitit").glob("*/*_result.pkl"))) == 2
