"""Generated tokens under several processes (issue 23): Seq2SeqTrainer.predict with generation under Lightning's DDP
on CPU gives the one-process predictions, in dataset order, each sample once, with batches of different generated
lengths (within a process and between processes) padded with -100 (tests/jobs/seq2seq_ddp_job.py)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).parent / "jobs" / "seq2seq_ddp_job.py"
REPO_ROOT = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]


def _run(out: Path, devices: int) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT / "src")}
    done = subprocess.run([sys.executable, str(JOB), str(out), "--devices", str(devices)], capture_output=True,
                          text=True, timeout=300, env=env, cwd=out)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads((out / "result.json").read_text())


def test_ddp_generation_gathers_like_one_process(tmp_path):
    (tmp_path / "one").mkdir(), (tmp_path / "two").mkdir()
    single, ddp = _run(tmp_path / "one", 1), _run(tmp_path / "two", 2)
    assert (single["world_size"], ddp["world_size"]) == (1, 2)
    assert ddp["predictions"] == single["predictions"] and ddp["label_ids"] == single["label_ids"]
    assert len(ddp["predictions"]) == 11 == ddp["metrics"]["test_rows"]  # no repeats of the padded last batch
    lengths = [sum(token != -100 for token in row) for row in ddp["predictions"]]
    assert len(set(lengths)) > 1  # generated batches of different lengths, joined padded with -100
    assert ddp["metrics"]["test_generated"] == single["metrics"]["test_generated"] == sum(lengths)
    assert math.isfinite(ddp["metrics"]["test_loss"])
