"""``enable_jit_checkpoint`` (issue 16): transformers' own JITCheckpointCallback on hflight's Trainer. A SIGTERM
during training gives, under both trainers, the same callback list, the same checkpoint at the same moment (its
sentinel file removed once complete) and the same last step; the run then ends normally, as transformers' does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .support import HFLIGHT_ONLY

JOBS = Path(__file__).resolve().parent / "jobs"
REPO_ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.subprocess

# Files only hflight writes into a checkpoint folder (README "Checkpoints you can trust").


def _run(tmp_path: Path, *kinds: str) -> dict[str, dict]:
    """The job for each trainer in ``kinds``, in one process: the result of each, by name."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src")}
    result = subprocess.run([sys.executable, str(JOBS / "jit_checkpoint_job.py"), str(tmp_path), *kinds],
                            env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    lines = [line.split(" ", 2) for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    return {kind: json.loads(value) for _, kind, value in lines}


def test_a_sigterm_gives_transformers_jit_checkpoint(tmp_path):
    results = _run(tmp_path, "transformers", "hflight")
    theirs, ours = results["transformers"], results["hflight"]
    assert "JITCheckpointCallback" in ours["callbacks"] and ours["callbacks"] == theirs["callbacks"]
    assert list(theirs["checkpoints"]) == ["checkpoint-3"] and list(ours["checkpoints"]) == ["checkpoint-3"]
    files = {name: [f for f in names if f not in HFLIGHT_ONLY] for name, names in ours["checkpoints"].items()}
    assert files == theirs["checkpoints"]
    assert "checkpoint-is-incomplete.txt" not in ours["checkpoints"]["checkpoint-3"]
    assert ours["global_step"] == theirs["global_step"] < 8  # training stopped after the checkpoint
    assert ours["sigterm_handler_restored"] and theirs["sigterm_handler_restored"]
