"""The benchmark scripts run end to end (tiny settings; no timing is asserted here)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_train_overhead_runs_three_trainers_in_lockstep():
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "train_overhead.py"),
        "--rounds",
        "1",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--hidden",
        "16",
        "--layers",
        "1",
        "--seq-len",
        "16",
        "--batch-size",
        "2",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    # The script itself raises unless each runner made exactly warmup + steps + 1 optimizer steps.
    for name in ("plain", "transformers", "hflight"):
        assert re.search(rf"^  {name}\s+\d+\.\d+", out, re.M), out
    for ratio in ("hflight/plain", "hflight/transformers", "transformers/plain"):
        assert re.search(rf"{ratio}\s+= \d+\.\d+", out), out
