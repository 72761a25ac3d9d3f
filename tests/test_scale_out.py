"""Scale-out is Lightning's: a run launched externally by torchrun (the multi-node path: one process per device,
Lightning's TorchElasticEnvironment) trains through the real entry point and writes one set of results."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .test_cli import REPO, TINY


@pytest.mark.subprocess
@pytest.mark.slow
def test_torchrun_two_processes_through_train_py(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH")
    run_dir = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [
        torchrun, "--standalone", "--nproc_per_node=2", str(REPO / "train.py"), *TINY, "trainer=ddp_cpu",
        f"hydra.run.dir={run_dir}",
    ]  # fmt: skip
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(command)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert proc.stdout.count("Final metrics") == 1  # printed by rank 0 only
    checkpoint = sorted(run_dir.glob("checkpoint-*"))[-1]
    assert sorted(p.name for p in checkpoint.glob("rng_state*")) == ["rng_state_0.pth", "rng_state_1.pth"]
    results = json.loads((run_dir / "all_results.json").read_text())
    assert {"eval_f1", "eval_exact_match", "train_loss"} <= set(results)
    state = json.loads((run_dir / "trainer_state.json").read_text())
    # 2 processes x 8 windows per step: half the steps one process would take for the same 2 epochs
    single = -(-results["train_samples"] // 8) * 2
    assert state["global_step"] == -(-results["train_samples"] // 16) * 2 < single
    validation = json.loads((run_dir / "data" / "validation.json").read_text())
    questions = {qa["id"] for article in validation["data"] for p in article["paragraphs"] for qa in p["qas"]}
    assert set(json.loads((run_dir / "eval_predictions.json").read_text())) == questions  # every question, once
    assert not Path(tmp_path / "outputs").exists()  # every process used the given run directory
