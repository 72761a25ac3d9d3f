"""Shared steps of the drop-in tests of transformers' example scripts (issue 23): copy a script folder, run it in a
subprocess as written (transformers' trainer) and with its one trainer-import line changed to hflight's, and compare
the two output folders number for number."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent / "scripts"
REPO_ROOT = Path(__file__).resolve().parents[1]
TIMINGS = ("_runtime", "_samples_per_second", "_steps_per_second")
# hflight's own addition to every checkpoint folder (README "Checkpoints you can trust").
HFLIGHT_ONLY = {"checkpoint_manifest.json"}


def run(folder: Path, example: str, original: str, changed: str | None, args: list[str]) -> Path:
    """Copy ``tests/scripts/<example>`` to ``folder`` and run ``<example>.py`` with ``args`` (``--output_dir`` is
    ``folder/out``), after replacing the line ``original`` by ``changed`` when given; returns the output folder."""
    shutil.copytree(SCRIPTS / example, folder)
    script = folder / f"{example}.py"
    source = script.read_text(encoding="utf-8")
    assert source.count(original) == 1
    if changed is not None:
        script.write_text(source.replace(original, changed), encoding="utf-8")
    command = [sys.executable, script.name, *args, "--output_dir", str(folder / "out"), "--seed", "0",
               "--report_to", "none", "--disable_tqdm", "true"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    result = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    (folder / "console.txt").write_text(result.stdout + result.stderr, encoding="utf-8")
    assert result.returncode == 0, f"{folder.name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return folder / "out"


def both(root: Path, example: str, original: str, changed: str, args: list[str]) -> dict[str, Path]:
    return {
        "transformers": run(root / "transformers", example, original, None, args),
        "hflight": run(root / "hflight", example, original, changed, args),
    }


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def largest_difference(a, b) -> float:
    return abs(a - b) if isinstance(a, (int, float)) and isinstance(b, (int, float)) else 0.0


def assert_same_results(runs: dict[str, Path], names: tuple[str, ...], rel: float = 1e-6) -> None:
    """The ``*_results.json`` files hold the same keys and the same numbers (timings aside)."""
    for name in names:
        theirs, ours = (read_json(runs[k] / name) for k in ("transformers", "hflight"))
        assert set(ours) == set(theirs), name
        for key, value in theirs.items():
            if not key.endswith(TIMINGS):
                assert ours[key] == pytest.approx(value, rel=rel, abs=1e-9), (name, key, value, ours[key])


def assert_same_log_history(runs: dict[str, Path], min_losses: int, rel: float = 1e-6) -> None:
    """``trainer_state.json``'s ``log_history``: same entries, same keys, same losses, gradient norms, learning
    rates and evaluation metrics (timings aside)."""
    theirs, ours = (read_json(runs[k] / "trainer_state.json")["log_history"] for k in ("transformers", "hflight"))
    assert len(ours) == len(theirs) and sum("loss" in e for e in theirs) >= min_losses
    for a, b in zip(theirs, ours):
        assert set(a) == set(b), (a, b)
        for key, value in a.items():
            if not key.endswith(TIMINGS):
                assert b[key] == pytest.approx(value, rel=rel, abs=1e-9), (a["step"], key, value, b[key])


def files(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def assert_same_files(runs: dict[str, Path], same_text: tuple[str, ...] = ("config.json", "README.md")) -> None:
    """The same set of files (hflight's checkpoint manifests aside), and the same text in ``same_text``."""
    theirs, ours = (files(runs[k]) for k in ("transformers", "hflight"))
    assert {f for f in ours if f.rsplit("/", 1)[-1] not in HFLIGHT_ONLY} == theirs
    for name in same_text:
        assert (runs["hflight"] / name).read_text() == (runs["transformers"] / name).read_text(), name
