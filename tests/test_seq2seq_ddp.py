"""Generated tokens under several processes (issue 23): Seq2SeqTrainer.predict with generation under Lightning's DDP
on CPU gives the one-process predictions, in dataset order, each sample once, with batches of different generated
lengths (within a process and between processes) padded with -100 (tests/jobs/seq2seq_ddp_job.py); its loss is
transformers' Seq2SeqTrainer's under torchrun, bit for bit."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from . import launch

JOB = launch.JOBS / "seq2seq_ddp_job.py"

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]


def _run(out: Path, devices: int, *extra, torchrun: bool = False) -> dict:
    if torchrun:  # transformers' own Seq2SeqTrainer, its processes launched by torchrun
        command = [*launch.torchrun(devices, standalone=False), JOB, out, "--library", "transformers"]
    else:  # hflight's: Lightning launches the processes
        command = [sys.executable, JOB, out, "--devices", devices, *extra]
    launch.Job(command, out, merge=False, console=out.parent / f"{out.name}.console.txt", timeout=300).ok()
    return json.loads((out / "result.json").read_text())


def test_ddp_generation_gathers_like_one_process(tmp_path):
    for name in ("one", "two", "transformers"):
        (tmp_path / name).mkdir()
    # the one-process prediction in the launching process of the DDP job, before its launch: one process fewer
    ddp = _run(tmp_path / "two", 2, "--one-process-first", tmp_path / "one")
    single = json.loads((tmp_path / "one" / "result.json").read_text())
    theirs = _run(tmp_path / "transformers", 2, torchrun=True)
    assert (single["world_size"], ddp["world_size"], theirs["world_size"]) == (1, 2, 2)
    assert ddp["predictions"] == single["predictions"] and ddp["label_ids"] == single["label_ids"]
    assert len(ddp["predictions"]) == 11 == ddp["metrics"]["test_rows"]  # no repeats of the padded last batch
    lengths = [sum(token != -100 for token in row) for row in ddp["predictions"]]
    assert len(set(lengths)) > 1  # generated batches of different lengths, joined padded with -100
    assert ddp["metrics"]["test_generated"] == single["metrics"]["test_generated"] == sum(lengths)
    # transformers under torchrun: the same rows, plus the repeat that filled the last global batch (sample 0,
    # generated beside sample 10), which hflight drops (docs/coming-from-transformers.md)
    assert theirs["predictions"][:11] == ddp["predictions"] and theirs["label_ids"][:11] == ddp["label_ids"]
    assert theirs["metrics"]["test_rows"] == 12 and theirs["label_ids"][11] == theirs["label_ids"][0]
    # the loss counts that repeat in both libraries (the last batch's mean includes it), so it is transformers'
    # exactly, and not the one-process loss
    assert ddp["metrics"]["test_loss"] == theirs["metrics"]["test_loss"]
    assert ddp["metrics"]["test_loss"] != single["metrics"]["test_loss"]
