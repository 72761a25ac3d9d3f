"""The Hydra entry point: train.py in a child process where a signal stops it (and ``resume=`` continues it),
Hydra's command line in this process (``cli.main()``: mistakes named before anything runs), and
``hflight.cli.train`` on a composed config, as a notebook uses it; the backend check before any data work and the
backend named under the final metrics. Every run is tiny: a few synthetic articles, a 32-wide BERT and a handful of
steps. The README's own commands (main job, sweeps, Optuna, trainer=ort/ipu, torchrun, hflight-train from another
folder) run as written in tests/test_readme_commands.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import open_dict

from hflight import cli
from hflight.checkpoints.manifest import verify_checkpoint
from hflight.config import compose

from .support import RESULT_FILES, TINY

REPO = Path(__file__).resolve().parents[1]


def _run(
    *overrides: str, entry: list[str] | None = None, cwd: Path = REPO, check: bool = True, timeout: int = 300
) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HYDRA_FULL_ERROR": "1",
    }
    command = (entry or [sys.executable, str(REPO / "train.py")]) + list(overrides)
    proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def _check_run_dir(run_dir: Path, v2: bool = False, hydra: bool = True) -> dict:
    for name in RESULT_FILES + ((".hydra/config.yaml",) if hydra else ()):
        assert (run_dir / name).is_file(), f"{name} missing in {run_dir}: {sorted(os.listdir(run_dir))}"
    assert sorted(run_dir.glob("checkpoint-*")), "no checkpoint written"
    assert (run_dir / "tokenizer" / "tokenizer.json").is_file()
    results = json.loads((run_dir / "all_results.json").read_text())
    scores = ("eval_exact", "eval_f1", "eval_HasAns_f1", "eval_best_f1") if v2 else ("eval_exact_match", "eval_f1")
    for key in (*scores, "eval_loss", "train_loss", "train_runtime", "eval_samples"):
        assert key in results, f"{key} missing from all_results.json: {sorted(results)}"
    assert set(json.loads((run_dir / "eval_results.json").read_text())) >= {*scores, "eval_loss"}
    state = json.loads((run_dir / "trainer_state.json").read_text())
    assert any("eval_f1" in entry for entry in state["log_history"])  # evaluated during training
    return results


# ---- the notebook path: compose, then train ------------------------------------------------------------------------
def test_compose_then_train_in_process(tmp_path, caplog):
    """The notebook path: hflight.config.compose, then hflight.cli.train; every object comes back. The finished run
    resumed (``resume=<run folder>``'s ``args.resume_from_checkpoint=true``) trains nothing: it says so and what to
    pass for more, and keeps the run's results (which it returns), where it overwrote them with ``train_loss 0.0``."""
    cfg = compose([*TINY, "args.num_train_epochs=1"], output_dir=tmp_path)
    metrics, objects = cli.train(cfg)
    results = _check_run_dir(tmp_path, hydra=False)  # .hydra/ is written by @hydra.main only
    assert metrics["eval_f1"] == results["eval_f1"] and "eval_loss" in metrics
    assert "eval_HasAns_f1" not in results and not (tmp_path / "eval_null_odds.json").exists()  # SQuAD v1.1
    assert objects["trainer"].eval_examples is objects["examples"]["validation"]
    assert "start_positions" in objects["features"]["validation"].column_names  # labelled: hence eval_loss
    assert objects["tokenizer"].name_or_path == str(tmp_path / "tokenizer")
    assert objects["model"].config.vocab_size == len(objects["tokenizer"])
    from hflight.cli.curves import curves

    assert (tmp_path / "training_curves.png").stat().st_size > 5000  # drawn from the run's log history:
    assert set(curves(objects["trainer"].state.log_history)) >= {"training loss", "learning rate", "eval_f1"}
    kept = {name: (tmp_path / name).read_bytes() for name in [*RESULT_FILES, "training_curves.png"]}
    again = compose([*TINY, "args.num_train_epochs=1", "args.resume_from_checkpoint=true"], output_dir=tmp_path)
    step = objects["trainer"].state.global_step
    assert cli.train(again)[0] == results
    assert {name: (tmp_path / name).read_bytes() for name in kept} == kept
    assert f"The run in {tmp_path} had already finished: its checkpoint at step {step} is the end of its" in caplog.text
    assert f"hflight-train resume={tmp_path} args.max_steps=<more than {step}>" in caplog.text


def test_squad_v2_is_scored_as_squad_v2(tmp_path):
    """SQuAD v2.0 scoring, on synthetic v2 data with unanswerable questions, in the CLI's run (v1.1's in
    test_compose_then_train_in_process). This was the second job of a two-job multirun; each job of a multirun in its
    own folder with its results is the README's ``python train.py -m +experiment=mrc args.learning_rate=1e-4,3e-4
    args.seed=1,2``, run in tests/test_readme_commands.py::test_readme_command_works_as_written."""
    cli.train(compose([*TINY, "args.num_train_epochs=1", "data.version_2_with_negative=true"], output_dir=tmp_path))
    v2 = _check_run_dir(tmp_path, v2=True, hydra=False)  # .hydra/ is written by @hydra.main only
    assert {"eval_exact", "eval_HasAns_f1", "eval_NoAns_f1", "eval_best_f1"} <= set(v2)
    assert (tmp_path / "eval_null_odds.json").is_file()
    squad = json.loads((tmp_path / "data" / "validation.json").read_text())
    assert any(qa.get("is_impossible") for article in squad["data"] for p in article["paragraphs"] for qa in p["qas"])


def test_a_figure_that_cannot_be_written_is_an_error_in_the_log_not_a_failed_run(tmp_path, caplog):
    (tmp_path / "training_curves.png").mkdir()  # the figure's path is taken by a folder
    metrics, _ = cli.train(compose([*TINY, "args.num_train_epochs=1"], output_dir=tmp_path))
    assert "eval_f1" in metrics and (tmp_path / "all_results.json").is_file()
    assert f"Could not draw training_curves.png in {tmp_path}: IsADirectoryError" in caplog.text


def test_failed_job_records_its_error_and_returns_none_in_a_multirun(tmp_path, monkeypatch):
    cfg = compose(["+experiment=mrc", "args.lr_scheduler_type=linea"], output_dir=tmp_path)
    monkeypatch.setattr(cli.app, "_in_multirun", lambda: True)
    assert cli.main(cfg) is None  # a failed trial for the Optuna sweeper, ignored by the basic one
    assert "lr_scheduler_type" in (tmp_path / cli.ERROR_FILE).read_text()


def test_failed_single_run_records_its_error_and_raises(tmp_path):
    cfg = compose(["+experiment=mrc", "args.lr_scheduler_type=linea"], output_dir=tmp_path)
    with pytest.raises(ValueError, match="valid choices"):
        cli.main(cfg)
    assert "lr_scheduler_type" in (tmp_path / cli.ERROR_FILE).read_text()


def test_optimized_metric_must_be_a_final_metric():
    assert cli.optimized_value({"eval_f1": 91.5}, "eval_f1") == 91.5
    assert cli.optimized_value({"eval_f1": 91.5}, None) is None
    with pytest.raises(KeyError, match="eval_f1"):
        cli.optimized_value({"eval_f1": 91.5}, "eval_f2")


def test_metrics_table_is_readable():
    table = cli.format_metrics_table({"eval_exact_match": 88.5, "eval_f1": 91.25}, "Final metrics")
    lines = table.splitlines()
    assert lines[0] == "Final metrics"
    assert len({len(line) for line in lines[1:]}) == 1  # aligned box
    assert any("eval_f1" in line and "91.25" in line for line in lines)


def test_a_backend_that_cannot_start_fails_before_any_data_work(tmp_path):
    """trainer=ipu without poptorch: the IPU backend's own message, and no data generated or tokenized yet."""
    from hflight.ipu.runtime import poptorch_available

    if poptorch_available():
        pytest.skip("poptorch is importable here")
    cfg = compose(["+experiment=mrc", "trainer=ipu"], output_dir=tmp_path)
    with pytest.raises(ModuleNotFoundError, match="The IPU backend needs poptorch"):
        cli.train(cfg)
    assert not (tmp_path / "data").exists() and not (tmp_path / "tokenizer").exists()


NO_GPU = "args.accelerator=gpu (trainer=gpu, gpu_bf16 or ddp) needs a CUDA GPU, and torch finds none here"


def test_no_gpu_fails_before_any_data_work_as_one_message(tmp_path, monkeypatch):
    """Saying that there is no GPU and what runs on the CPU (Lightning's own: "No supported gpu backend found!")."""
    import torch
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = compose(["+experiment=mrc", "trainer=gpu"], output_dir=tmp_path)
    with pytest.raises(MisconfigurationException, match=re.escape(NO_GPU)) as raised:
        cli.train(cfg)
    assert "Train on the CPU with trainer=cpu" in str(raised.value)
    assert isinstance(raised.value, cli.USER_ERRORS)  # reported as its message, without a traceback
    assert not (tmp_path / "data").exists()


def test_the_command_line_finds_the_config_from_another_folder_and_rejects_a_misspelt_option(
    tmp_path, monkeypatch, command_line, capsys
):
    """Hydra's command line (``cli.main()`` with its argv) from a folder that holds no config: a misspelt group option
    fails listing the valid choices, read from the repository's conf/, before anything runs. In this process: the
    installed ``hflight-train`` script running from another folder is the README's ``hflight-train -m +experiment=mrc
    args.seed=1,2``, run as written from an empty folder in
    tests/test_readme_commands.py::test_readme_command_works_as_written."""
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    said = command_line("+experiment=mrc", "trainer=gpux", f"hydra.run.dir={run_dir}")
    assert "trainer=gpux: trainer has no option 'gpux' (its options: cpu, ddp," in said  # the valid choices
    assert "did you mean gpu" in said
    assert not run_dir.exists()  # nothing ran


def test_no_gpu_is_told_before_the_run_folder_is_made(tmp_path, monkeypatch, command_line):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code = command_line("+experiment=mrc", "trainer=gpu", f"hydra.run.dir={tmp_path / 'run'}")
    assert str(code).startswith(f"hflight-train: {NO_GPU}") and "Train on the CPU with trainer=cpu" in str(code)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override", ["args.learning_rat=1e-3", "+args.learning_rat=1e-3"])
def test_a_misspelt_args_key_is_named_with_the_closest_fields(tmp_path, command_line, override):
    """Hydra's advice (append with +) ended in a bare TypeError; either way the key and the closest fields are
    named, before anything runs, and by ``train`` for a config composed with the key added."""
    said = "args.learning_rat is not a field of TrainingArguments: did you mean learning_rate?"
    code = command_line("+experiment=mrc", override, f"hydra.run.dir={tmp_path / 'run'}")
    assert str(code).startswith(f"hflight-train: {said}") and not (tmp_path / "run").exists()
    if not override.startswith("+"):
        return
    cfg = compose(["+experiment=mrc"], output_dir=tmp_path)
    with open_dict(cfg.args):
        cfg.args.learning_rat = 1e-3
    with pytest.raises(ValueError, match=said):
        cli.train(cfg)


@pytest.mark.parametrize(
    ("strategy", "named"),
    [
        ("ort", "Evaluated with strategy 'ort' (ONNX Runtime evaluation, ORTModule training where installed"),
        ("auto", "Evaluated with strategy 'single_device', accelerator 'cpu', precision 32-true"),
    ],
)
def test_final_metrics_name_the_backend_that_evaluated(tmp_path, capsys, strategy, named):
    pytest.importorskip("onnxruntime")
    overrides = [*TINY, "args.num_train_epochs=1", "args.accelerator=cpu", f"args.strategy={strategy}"]
    cli.train(compose(overrides, output_dir=tmp_path))
    table = capsys.readouterr().out
    assert f"Final metrics ({tmp_path})\n{named}" in table


def test_no_data_is_a_clear_error(tmp_path):
    cfg = compose([], output_dir=tmp_path)
    with pytest.raises(ValueError, match="data.train_file"):
        cli.train(cfg)


@pytest.mark.subprocess
def test_sigterm_during_training_saves_a_checkpoint_records_it_and_exits_143(tmp_path, monkeypatch):
    """A preempted job (SIGTERM in the middle of step 3, sent by a callback for determinism) must not look
    successful: checkpoint-3 written, error.txt says what happened and how to resume, exit status 128 + 15."""
    jobs = str(Path(__file__).parent / "jobs")  # for the callback's _target_
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [jobs, os.environ.get("PYTHONPATH")])))
    proc = _run(
        *TINY,
        "args.max_steps=6",
        "args.save_strategy=steps",
        "args.save_steps=100",
        "args.eval_strategy=no",
        "args.load_best_model_at_end=false",
        "+callbacks.preempt._target_=signal_callbacks.SendSignal",
        "+callbacks.preempt.step=3",
        f"hydra.run.dir={tmp_path}",
        check=False,
    )
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr[-3000:]
    assert verify_checkpoint(tmp_path / "checkpoint-3")["global_step"] == 3
    assert not (tmp_path / "train_results.json").exists()
    assert "Traceback" not in proc.stdout + proc.stderr
    # the command that continues it, printed and recorded as it is to be typed: the one instruction on the command
    # line (it said train(resume_from_checkpoint=...) / args.resume_from_checkpoint=... first, for Python)
    command = f"hflight-train resume={tmp_path}"
    assert (tmp_path / cli.ERROR_FILE).read_text() == (
        f"Training stopped by SIGTERM after step 3 of 6; checkpoint saved in {tmp_path / 'checkpoint-3'}.\n"
        f"To continue this run: {command}\n"
    )
    assert f"To continue this run: {command}\n" in proc.stderr
    assert (proc.stdout + proc.stderr).count("resume") == 1, proc.stderr[-3000:]
    _resumes_in_its_folder(command, tmp_path)


def _resumes_in_its_folder(command: str, run_dir: Path) -> None:
    """The printed command, with a larger args.max_steps, continues the interrupted run (6 steps) to step 8 in its
    folder: same folder, one log history, the composed config and the arguments in the logger's hyperparameters, the
    final evaluation logged after training. (One resume: a finished run resumed with more steps or epochs continues
    in its folder too, as docs/hydra.md's ``hflight-train resume=<run folder> args.num_train_epochs=4`` shows in
    tests/test_readme_commands.py::test_readme_command_works_as_written.)"""
    folders_before = sorted(os.listdir(run_dir.parent))
    entry = [sys.executable, "-m", "hflight"]
    _run(*command.split()[1:], "args.save_steps=3", "args.max_steps=8", entry=entry, cwd=run_dir.parent)
    state = json.loads((run_dir / "trainer_state.json").read_text())
    assert state["global_step"] == 8 and (run_dir / "train_results.json").is_file()
    assert not (run_dir / cli.ERROR_FILE).exists()  # the interruption's, gone once the run completed
    assert verify_checkpoint(run_dir / "checkpoint-6")["global_step"] == 6  # saved after the resume, every 3 steps
    assert sorted(os.listdir(run_dir.parent)) == folders_before
    assert [e["step"] for e in state["log_history"] if "loss" in e] == [2, 4, 6, 8]  # logging_steps=2, no repeats
    overrides = (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert "args.max_steps=8" in overrides and "args.max_steps=6" not in overrides
    assert (run_dir / "training_curves.png").stat().st_size > 5000
    # each resumed run logs into a new version of the run's CSV logger, the composed config and the arguments as its
    # hyperparameters (the best checkpoint still tracked inside the folder on resume: the README's resume= command)
    import yaml

    versions = sorted((run_dir / "hflight").glob("version_*"))
    assert [v.name for v in versions] == ["version_0", "version_1"]
    hparams = yaml.safe_load((versions[-1] / "hparams.yaml").read_text())
    assert hparams["config"]["task_name"] == "mrc" and hparams["config"]["paths"]["output_dir"] == str(run_dir)
    assert hparams["training_args"]["max_steps"] == 8


def test_a_finished_run_resumed_on_the_command_line_logs_no_line_of_zeros(tmp_path, command_line, capsys):
    """``hflight-train resume=<finished run>`` trains nothing: it says so and logs no train metrics (it printed
    ``{'train_runtime': 0.0031, ..., 'train_loss': 0.0, ...}`` before its warning, and wrote that row into the CSV
    logger's new version). From Python the same call logs them, as transformers' Trainer does:
    tests/test_callbacks.py::test_resuming_at_the_last_step_begins_and_ends_training_as_transformers."""
    run_dir, one_epoch = tmp_path / "run", [o for o in TINY if not o.startswith("args.num_train_epochs=")]
    assert command_line(*one_epoch, "args.num_train_epochs=1", f"hydra.run.dir={run_dir}") == 0
    trained = capsys.readouterr().out
    assert "{'train_runtime': " in trained  # the run that trained logged its train metrics
    assert command_line(f"resume={run_dir}") == 0
    resumed = capsys.readouterr()
    assert f"The run in {run_dir} had already finished" in resumed.out + resumed.err
    assert "train_runtime': " not in resumed.out + resumed.err
    logged = [path.read_text() for path in sorted(run_dir.glob("hflight/version_*/metrics.csv"))]
    assert "train_runtime" in logged[0] and not any("train_runtime" in text for text in logged[1:])


def test_resume_arguments_replace_saved_overrides_and_name_mistakes(tmp_path):
    (tmp_path / ".hydra").mkdir()
    saved = "- +experiment=mrc\n- +hparams_search=mrc_optuna\n- args.seed=1\n- args.max_steps=6\n"
    (tmp_path / ".hydra" / "overrides.yaml").write_text(saved)  # a job of an Optuna sweep
    assert cli.resume_arguments([f"resume={tmp_path}", "args.max_steps=9"]) == [
        "+experiment=mrc",
        "args.seed=1",
        "args.max_steps=9",
        f"hydra.run.dir={tmp_path}",
        "hydra.mode=RUN",
        "args.resume_from_checkpoint=true",
    ]
    assert cli.resume_arguments(["args.seed=2"]) == ["args.seed=2"]
    (tmp_path / "empty").mkdir()
    for argv, message in [
        ([f"resume={tmp_path / 'nope'}"], f"resume={tmp_path / 'nope'}: no such folder"),
        ([f"resume={tmp_path / 'empty'}"], "neither a run folder"),
        ([f"resume={tmp_path}", "-m"], "multirun"),
        ([f"resume={tmp_path}", "hydra.run.dir=x"], "hydra.run.dir"),
        ([f"resume={tmp_path}", f"resume={tmp_path}"], "one run folder"),
    ]:
        with pytest.raises(ValueError, match=message):
            cli.resume_arguments(argv)


@pytest.mark.parametrize("given", [None, "ACTIVE"])
def test_the_command_line_s_openmp_threads_wait_asleep_unless_told_otherwise(given):
    """On cores shared with other work, torch's spinning OpenMP threads made the main job 9x slower; the command line
    has them wait asleep (OMP_WAIT_POLICY=PASSIVE, before torch loads its OpenMP runtime: its spin count is 0). A
    user's own setting stays."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"  # the runtime prints its settings as it loads
    if given:
        env["OMP_WAIT_POLICY"] = given
    shown = subprocess.run([sys.executable, "-c", "import hflight.cli, torch; torch.ones(2) + 1"], env=env,
                           capture_output=True, text=True, timeout=300).stderr  # fmt: skip
    spin = re.search(r"GOMP_SPINCOUNT = '(\d+)'", shown)
    assert spin is not None, shown[-2000:]
    assert (spin.group(1) == "0") == (given is None), shown[-2000:]
