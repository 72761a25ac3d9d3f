"""How a command-line run reports failures: once, readably, in ``error.txt`` too; and SIGTERM/SIGINT outside training.

One child process runs the real ``train.py`` with a user error (it fails before any training); the rest calls
``hflight.cli.main`` on a composed config with the failing piece monkeypatched. SIGTERM during a command-line
training run is ``test_cli.py::test_sigterm_during_training_saves_a_checkpoint_records_it_and_exits_143``.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hflight import cli
from hflight.config import compose
from hflight.run.interrupt import TrainingInterrupted

REPO = Path(__file__).resolve().parents[1]


def run_train_py(*overrides: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    command = [sys.executable, str(REPO / "train.py"), *overrides]
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.subprocess
def test_a_user_error_is_reported_once_without_a_traceback(tmp_path):
    proc = run_train_py("+experiment=mrc", "args.lr_scheduler_type=linea", f"hydra.run.dir={tmp_path}")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1
    assert output.count("Unknown lr_scheduler_type 'linea'; valid choices are: linear") == 1, output
    assert "Traceback" not in output
    assert f"the traceback is in {tmp_path / 'error.txt'}" in output
    recorded = (tmp_path / "error.txt").read_text()
    assert recorded.startswith("Traceback") and "Unknown lr_scheduler_type 'linea'" in recorded


# ---- in-process: cli.main on a composed config ------------------------------------------------------------------
@pytest.fixture
def cfg(tmp_path):
    return compose(["+experiment=mrc"], output_dir=tmp_path)


def fail_with(exc: BaseException):
    def train(cfg):
        raise exc

    return train


def test_an_unexpected_error_is_raised_with_its_traceback_logged_nowhere_else(cfg, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(cli.app, "train", fail_with(RuntimeError("boom")))
    with caplog.at_level(logging.INFO, logger="hflight.cli"), pytest.raises(RuntimeError, match="boom"):
        cli.main(cfg)
    assert "RuntimeError: boom" in (tmp_path / cli.ERROR_FILE).read_text()
    assert [r.getMessage() for r in caplog.records] == [f"Run failed; the traceback is in {tmp_path / 'error.txt'}"]
    assert not any(r.exc_info for r in caplog.records)  # Hydra prints the traceback, once


def test_on_the_command_line_a_user_error_becomes_one_compact_message(cfg, tmp_path, monkeypatch):
    from hydra.errors import CompactHydraException

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(cli.app, "_on_command_line", lambda: True)
    monkeypatch.setattr(cli.app, "train", fail_with(KeyError("optimized_metric='eval_f2' is not among the metrics")))
    with pytest.raises(CompactHydraException) as error:
        cli.main(cfg)
    assert str(error.value) == "KeyError: optimized_metric='eval_f2' is not among the metrics"
    assert isinstance(error.value.__cause__, KeyError)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(KeyError):  # the full error, as Hydra users expect
        cli.main(cfg)


def test_a_failed_checkpoint_write_is_one_compact_message(cfg, tmp_path, monkeypatch):
    """torch reports a full disk as RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs
    0"), which the command line printed with its traceback; hflight's CheckpointWriteError is a user error."""
    import shutil

    from hydra.errors import CompactHydraException

    from hflight.checkpoints import folders as checkpoint

    folder = tmp_path / ".tmp-checkpoint-6"
    folder.mkdir()
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real_usage(p)._replace(free=0))  # the disk is full

    def train(cfg):
        what = f"checkpoint {tmp_path / 'checkpoint-6'}"
        with checkpoint.writing(str(folder), what, discard=True, file="optimizer.pt"):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(cli.app, "_on_command_line", lambda: True)
    monkeypatch.setattr(cli.app, "train", train)
    with pytest.raises(CompactHydraException) as error:
        cli.main(cfg)
    assert str(error.value) == (
        f"CheckpointWriteError: Could not save checkpoint {tmp_path / 'checkpoint-6'}: writing optimizer.pt failed: no "
        f"space left on device. The unfinished folder was removed; the checkpoints already in {tmp_path} are unchanged."
    )
    assert not folder.exists()


def test_in_a_multirun_a_job_logs_one_line_for_a_user_error_and_the_traceback_otherwise(cfg, monkeypatch, caplog):
    monkeypatch.setattr(cli.app, "_in_multirun", lambda: True)
    monkeypatch.setattr(cli.app, "train", fail_with(ValueError("bad data")))
    with caplog.at_level(logging.ERROR, logger="hflight.cli"):
        assert cli.main(cfg) is None
    assert len(caplog.records) == 1 and caplog.records[0].exc_info is None
    assert caplog.records[0].getMessage().startswith("Job failed: ValueError: bad data (traceback in")
    caplog.clear()
    monkeypatch.setattr(cli.app, "train", fail_with(ZeroDivisionError("bug")))
    with caplog.at_level(logging.ERROR, logger="hflight.cli"):
        assert cli.main(cfg) is None
    assert len(caplog.records) == 1 and caplog.records[0].exc_info[0] is ZeroDivisionError


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_outside_of_training_is_recorded_and_exits_non_zero(cfg, tmp_path, monkeypatch, signum):
    def train(cfg):
        os.kill(os.getpid(), signum)  # e.g. while the data is being tokenized
        raise AssertionError("the signal should have stopped the run")

    before = signal.getsignal(signum)
    monkeypatch.setattr(cli.app, "train", train)
    with pytest.raises(TrainingInterrupted) as stopped:
        cli.main(cfg)
    assert stopped.value.code == 128 + signum
    assert (tmp_path / "error.txt").read_text().startswith(f"Terminated by {signal.Signals(signum).name} outside")
    assert signal.getsignal(signum) is before


@pytest.mark.subprocess
def test_ctrl_c_with_the_console_piped_to_a_tee_it_ends_keeps_the_stop_checkpoint(tmp_path):
    """`python train.py ... | tee main.log`, then Ctrl-C: the terminal's SIGINT ends `tee` too, and the stop's save
    wrote its progress bar into the dead pipe: the save failed ("writing config.json failed: broken pipe"), no resume
    line was recorded, the steps since the last checkpoint lost. The console is best effort now: the stop's
    checkpoint is written, error.txt gives the command that continues the run, and the status is 130."""
    from .support import TINY

    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    tiny = [o for o in TINY if not o.startswith(("args.num_train_epochs=", "args.disable_tqdm="))]
    command = [sys.executable, str(REPO / "train.py"), *tiny, "args.num_train_epochs=200", "args.logging_steps=1",
               f"hydra.run.dir={tmp_path}"]  # fmt: skip
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        seen = b""
        while b"'loss'" not in seen:  # training has begun
            line = proc.stdout.readline()
            assert line, seen[-3000:].decode(errors="replace")
            seen += line
        proc.stdout.close()  # `tee` ends: the pipe's reader is gone
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=300) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    error = (tmp_path / "error.txt").read_text()
    assert "Training stopped by SIGINT" in error and "To continue this run:" in error, error
    assert "pipe" not in error.lower(), error
    import re

    from hflight.checkpoints.manifest import verify_checkpoint

    (folder,) = re.findall(r"checkpoint saved in (\S+checkpoint-\d+)", error)
    verify_checkpoint(folder, full=True)


@pytest.mark.parametrize(
    "token, said",
    [
        ("learning_rate=1e-4", r"learning_rate is not a key of the config: did you mean args.learning_rate=1e-4\?"),
        ("+experiment=mcr", r"experiment=mcr: experiment has no option 'mcr' \(its options: .*\); did you mean mrc\?"),
        ("trainer=ddpp", r"trainer=ddpp: trainer has no option .ddpp. .*did you mean ddp or ddp_cpu\?"),
        (
            "hydra/launcher=joblb",
            r"hydra/launcher has no option 'joblb' \(its options: .*joblib.*\); did you mean joblib",
        ),
    ],
)
def test_the_command_line_says_what_a_slip_meant_before_hydra(token, said):
    """A transformers user's reflex (a field without args.) and a misspelt option got Hydra's generic errors ("Key
    'learning_rate' is not in struct", "Could not find 'experiment/mcr'")."""
    from hflight.config import check_command_line

    with pytest.raises(ValueError, match=said):
        check_command_line([token])
    check_command_line(["+experiment=mrc", "args.learning_rate=1e-4", "cpu_threads=1", "trainer=ddp"])


def test_the_command_line_check_knows_the_options_hydra_finds(tmp_path):
    """Options that are not files of hflight's tree are options all the same: plugins' configs (the joblib launcher,
    Optuna's pruners) and a user's ``--config-dir`` (CI's README sweep and the wheel's own config dir were refused)."""
    from hflight.config import check_command_line

    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text("# @package _global_\n", encoding="utf-8")
    check_command_line(["+experiment=mrc", "hydra/launcher=joblib", "+hydra/sweeper/pruner=median"])
    check_command_line(["hydra/launcher=submitit_local"])
    check_command_line(["--config-dir", str(tmp_path), "+experiment=mine"])
    check_command_line([f"--config-dir={tmp_path}", "+experiment=mine"])
    with pytest.raises(ValueError, match="did you mean mine"):
        check_command_line(["--config-dir", str(tmp_path), "+experiment=mien"])
    # a key Hydra accepts, from the fault read: added with +, set by a _global_ experiment, or another primary's own;
    # an option of a folder the primary config's hydra.searchpath adds
    (tmp_path / "experiment" / "seeded.yaml").write_text("# @package _global_\nseed: 1\n", encoding="utf-8")
    (tmp_path / "extra" / "model").mkdir(parents=True)
    (tmp_path / "extra" / "model" / "my_tiny.yaml").write_text("{}\n", encoding="utf-8")
    primary = f"defaults:\n  - train\n  - _self_\nseed: 3\nhydra:\n  searchpath:\n    - file://{tmp_path / 'extra'}\n"
    (tmp_path / "mytrain.yaml").write_text(primary, encoding="utf-8")
    check_command_line(["+seed=42"])
    check_command_line(["--config-dir", str(tmp_path), "+experiment=seeded", "seed=7"])
    check_command_line(["--config-dir", str(tmp_path), "--config-name", "mytrain", "seed=7", "model=my_tiny"])
    with pytest.raises(ValueError, match="did you mean args.seed=7"):
        check_command_line(["+experiment=mrc", "seed=7"])
