"""Continuing a run after a restart: ``resume=auto`` on the command line, the scheduler's variables that imply it,
what the run folder already holds (data, tokenizer) reused, the ranks of one job told from a competing run, and
processes that would start from different checkpoints stopped. The runs themselves: ``test_slurm.py``,
``test_elastic.py``."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

import hflight
from hflight import cli
from hflight.arguments import cluster
from hflight.checkpoints.writelock import OutputDirInUse, output_dir_lock
from hflight.qa import made
from hflight.qa.synthetic import write_squad_files
from hflight.qa.tokenizer import squad_texts, train_wordpiece_tokenizer

from . import launch
from .support import TINY

LAUNCHER_VARIABLES = ("SLURM_", "TORCHELASTIC_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_")


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith(LAUNCHER_VARIABLES):
            monkeypatch.delenv(name)


# ---- resume=auto and the schedulers' variables ----------------------------------------------------------------------
def test_resume_auto_is_the_runs_own_folder_and_names_a_conflict():
    assert cli.resume_arguments(["+experiment=mrc", "resume=auto", "hydra.run.dir=outputs/1"]) == [
        "+experiment=mrc", "hydra.run.dir=outputs/1", "args.resume_from_checkpoint=auto"
    ]  # fmt: skip
    with pytest.raises(ValueError, match="resume=auto sets args.resume_from_checkpoint; give one of the two"):
        cli.resume_arguments(["resume=auto", "args.resume_from_checkpoint=x"])


@pytest.mark.parametrize(
    "variables, expected",
    [
        ({}, None),
        ({"SLURM_RESTART_COUNT": "0", "SLURM_NTASKS": "1"}, None),
        ({"SLURM_RESTART_COUNT": "2"}, ("SLURM_RESTART_COUNT", 2)),
        # torchrun --max-restarts: every attempt (each node's agent counts its own restarts)
        ({"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_RESTART_COUNT": "0"},
         ("TORCHELASTIC_MAX_RESTARTS", 3)),
        ({"TORCHELASTIC_RUN_ID": "r", "TORCHELASTIC_MAX_RESTARTS": "0"}, None),
    ],
)  # fmt: skip
def test_which_scheduler_may_have_restarted_this_process(monkeypatch, variables, expected):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    assert cluster.restart() == expected


def test_resume_point_auto_a_restart_and_an_empty_folder(monkeypatch, tmp_path, caplog):
    def point(value, **variables):
        for name, setting in variables.items():
            monkeypatch.setenv(name, setting)
        return cli.resume_point(hflight.TrainingArguments(str(tmp_path), resume_from_checkpoint=value))

    with caplog.at_level(logging.WARNING, logger="hflight.cli"):
        assert point(None) is None and point("auto") is None
    assert f"resume=auto: {tmp_path} holds no complete checkpoint; starting fresh." in caplog.text
    (tmp_path / "checkpoint-3").mkdir()  # incomplete: no weights
    assert point("auto") is None
    caplog.clear()
    for name, size in (("model.safetensors", 10), ("trainer_state.json", 2)):
        (tmp_path / "checkpoint-3" / name).write_bytes(b"x" * size)
    with caplog.at_level(logging.WARNING, logger="hflight.cli"):
        assert point("auto") == "auto" and point("True") == "True" and point(None) is None
        assert point(None, SLURM_RESTART_COUNT="1") == "auto"
    assert "restarts its jobs (SLURM_RESTART_COUNT=1): continuing as resume=auto" in caplog.text
    assert point(str(tmp_path / "checkpoint-3")) == str(tmp_path / "checkpoint-3")  # an explicit path stays


# ---- what the run folder holds is reused --------------------------------------------------------------------------
def test_generated_data_is_reused_with_its_recipe_and_another_recipe_is_refused_when_resuming(tmp_path, caplog):
    data = tmp_path / "data"
    train, validation = write_squad_files(data, 2, 1, 2, seed=0)
    stamp = train.stat().st_mtime_ns
    time.sleep(0.01)
    with caplog.at_level(logging.INFO, logger="hflight.qa.made"):
        assert write_squad_files(data, 2, 1, 2, seed=0, resuming=True) == (train, validation)
    assert train.stat().st_mtime_ns == stamp and "Reusing synthetic SQuAD data" in caplog.text
    with pytest.raises(ValueError) as refused:
        write_squad_files(data, 3, 1, 2, seed=0, resuming=True)
    assert f"{data} holds synthetic SQuAD data made with other settings (num_train_articles: 2 there, 3 now)" in str(
        refused.value
    )
    assert train.stat().st_mtime_ns == stamp  # nothing replaced
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hflight.qa.made"):
        write_squad_files(data, 3, 1, 2, seed=0)  # a fresh run: replaced, said
    assert "Replacing synthetic SQuAD data" in caplog.text and train.stat().st_mtime_ns != stamp
    assert json.loads((data / made.RECORD_NAME).read_text())["recipe"]["num_train_articles"] == 3


def test_a_trained_tokenizer_is_reused_for_the_same_texts_and_refused_for_others_when_resuming(tmp_path):
    train, _ = write_squad_files(tmp_path / "data", 2, 1, 2, seed=0)
    folder = tmp_path / "tokenizer"
    first = train_wordpiece_tokenizer(squad_texts(train), folder, vocab_size=200)
    stamp = (folder / "tokenizer.json").stat().st_mtime_ns
    again = train_wordpiece_tokenizer(squad_texts(train), folder, vocab_size=200, resuming=True)
    assert again.get_vocab() == first.get_vocab() and (folder / "tokenizer.json").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="a trained tokenizer made with other settings .*texts_sha256"):
        train_wordpiece_tokenizer(["other text", "entirely"], folder, vocab_size=200, resuming=True)
    with pytest.raises(ValueError, match="vocab_size: 200 there, 300 now"):
        train_wordpiece_tokenizer(squad_texts(train), folder, vocab_size=300, resuming=True)


def test_the_mrc_recipe_resumes_on_its_run_folders_data_and_refuses_other_settings(tmp_path):
    """The command line's run: a finished run, then `resume=auto` with another data size is an error naming it."""
    run_dir = tmp_path / "run"
    base = [*TINY, "args.num_train_epochs=1", f"hydra.run.dir={run_dir}"]
    done = subprocess.run([sys.executable, "-m", "hflight", *base], capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    changed = subprocess.run([sys.executable, "-m", "hflight", *base, "resume=auto",
                              "data.synthetic.num_train_articles=4"], capture_output=True, text=True, timeout=600,
                             cwd=tmp_path)  # fmt: skip
    output = changed.stdout + changed.stderr
    assert changed.returncode == 1, output[-3000:]
    assert "holds synthetic SQuAD data made with other settings (num_train_articles: 3 there, 4 now)" in output


# ---- one job, several processes -----------------------------------------------------------------------------------
HOLD = """
import sys, time
from hflight.checkpoints.writelock import output_dir_lock
with output_dir_lock(sys.argv[1], job=sys.argv[2], rank=0):
    print("held", flush=True)
    time.sleep(60)
"""


def test_the_writer_lock_tells_a_rank_of_the_same_job_from_a_competing_run(tmp_path):
    console = tmp_path.with_name(f"{tmp_path.name}-holder.txt")
    holder = launch.Job([sys.executable, "-c", HOLD, tmp_path, "slurm job 4242"], tmp_path, console=console,
                        timeout=120, name="the lock's holder")  # fmt: skip
    try:
        assert next(holder.lines()).strip() == "held"
        with pytest.raises(OutputDirInUse) as same, output_dir_lock(tmp_path, job="slurm job 4242", rank=1):
            pass
        assert f"Output folder {tmp_path} is written by rank 0 of this same job (slurm job 4242: process " in str(
            same.value
        )
        assert "save_on_each_node=True" in str(same.value)
        with pytest.raises(OutputDirInUse) as again, output_dir_lock(tmp_path, job="slurm job 4242", rank=0):
            pass
        assert "is written by an earlier run of this same job and rank (slurm job 4242, rank 0:" in str(again.value)
        with pytest.raises(OutputDirInUse) as other, output_dir_lock(tmp_path, job="slurm job 99", rank=0):
            pass
        assert "is in use by another training run: process" in str(other.value)
        assert "(slurm job 4242, rank 0)" in str(other.value)
    finally:
        holder.kill()
        holder.wait()  # its output kept


def test_processes_that_would_start_from_different_checkpoints_stop_naming_each(monkeypatch, tmp_path, factory):
    """A restart one node takes for a first start (or different paths per node) would train different models, or
    wait for each other forever: every rank stops before the first step, naming each one's start."""
    from hflight.run.distributed import World

    monkeypatch.setattr(World, "gather_objects", lambda self, values: [*values, "checkpoint-4 (step 4)"])
    monkeypatch.setattr(World, "size", property(lambda self: 2))
    args = hflight.TrainingArguments(str(tmp_path), max_steps=2, report_to="none", disable_tqdm=True)
    trainer = hflight.Trainer(factory.qa_model(), args, train_dataset=factory.qa_dataset(8))
    with pytest.raises(RuntimeError) as different:
        trainer.train()
    assert str(different.value).startswith(
        "The 2 processes of this run do not start from the same checkpoint (rank 0: a fresh start; rank 1: "
        "checkpoint-4 (step 4))."
    )
    assert not Path(tmp_path, "checkpoint-1").exists()


def test_resuming_on_another_number_of_nodes_is_said(tmp_path, factory, caplog):
    """As for the number of processes: the checkpoint records the nodes it was written with (its manifest)."""
    values = dict(max_steps=2, save_steps=2, report_to="none", disable_tqdm=True, per_device_train_batch_size=4)
    hflight.Trainer(factory.qa_model(), hflight.TrainingArguments(str(tmp_path), **values),
                    train_dataset=factory.qa_dataset(16)).train()  # fmt: skip
    manifest_file = tmp_path / "checkpoint-2" / "checkpoint_manifest.json"
    manifest = json.loads(manifest_file.read_text())
    assert manifest["run"]["num_nodes"] == 1
    manifest["run"]["num_nodes"] = 2  # written by a run on two nodes
    manifest_file.write_text(json.dumps(manifest))
    args = hflight.TrainingArguments(str(tmp_path), **{**values, "max_steps": 3})
    resumed = hflight.Trainer(factory.qa_model(), args, train_dataset=factory.qa_dataset(16))
    with caplog.at_level(logging.WARNING, logger="hflight.checkpoints.resume"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert "num_nodes: 1 (now) != 2 (checkpoint)" in caplog.text
