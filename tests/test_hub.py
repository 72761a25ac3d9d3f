"""push_to_hub, init_hf_repo, create_model_card and the hub_strategy checkpoint pushes, against a local stand-in of the
Hub's HTTP API (tests/hub_standin.py: no Hub is reachable from this machine), compared with transformers.Trainer
pushing to the same stand-in."""

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


#: the ``hub_strategy`` values the tests push with
STRATEGIES = ("checkpoint", "every_save", "end")


@pytest.fixture(scope="module")
def pushed(tmp_path_factory) -> dict[str, dict]:
    """tests/jobs/hub_job.py once, pushing with every strategy of :data:`STRATEGIES` in turn in the same process (one
    start of torch and transformers for all): per strategy, what transformers' and hflight's trainers pushed."""
    out = tmp_path_factory.mktemp("hub")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src"), "HF_DATASETS_OFFLINE": "1"}
    result = subprocess.run([sys.executable, str(JOBS / "hub_job.py"), str(out), *STRATEGIES], cwd=JOBS,
                            env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


# Files only hflight writes into a checkpoint folder (README "Checkpoints you can trust").


def _comparable(files: list[str]) -> list[str]:
    return sorted(f for f in files if f.rsplit("/", 1)[-1] not in HFLIGHT_ONLY)


@pytest.mark.parametrize("strategy", ["checkpoint", "every_save"])
def test_pushes_what_transformers_pushes(pushed, strategy):
    theirs, ours = pushed[strategy]["transformers"], pushed[strategy]["hflight"]
    assert ours["hub_model_id"] == "team/hflight-run" and theirs["hub_model_id"] == "team/transformers-run"
    assert _comparable(ours["files"]) == _comparable(theirs["files"])
    assert "model.safetensors" in ours["files"] and "README.md" in ours["files"]
    assert not any(f.startswith("checkpoint-") for f in ours["files"])  # checkpoint folders are never uploaded
    if strategy == "checkpoint":
        assert "last-checkpoint/optimizer.pt" in ours["files"]
    assert [summary for summary, _ in ours["commits"]] == [summary for summary, _ in theirs["commits"]]
    assert ours["commits"][-1][0] == "End of training" and ours["commit_oid"]
    assert pushed[strategy]["unknown"] in ([], ["GET /api/agent-harnesses"])  # nothing else of the Hub API was needed


def test_model_card_is_transformers(pushed):
    theirs, ours = pushed["end"]["transformers"]["readme"], pushed["end"]["hflight"]["readme"]
    assert "generated_from_trainer" in ours and "- qa" in ours and "language:\n- en" in ours
    assert ours.replace("hflight-run", "NAME") == theirs.replace("transformers-run", "NAME")


def test_create_model_card_without_hub(tmp_path, factory):
    """create_model_card writes README.md in the output folder (no Hub needed), keeping an existing card's tags."""
    import hflight

    args = hflight.TrainingArguments(str(tmp_path), max_steps=2, report_to="none", save_strategy="no",
                                     disable_tqdm=True)  # fmt: skip
    trainer = hflight.Trainer(factory.qa_model(), args, train_dataset=factory.qa_dataset(8))
    trainer.train()
    trainer.create_model_card(tags=["first"], finetuned_from="tiny-bert", tasks="question-answering")
    trainer.create_model_card(tags=["second"])
    card = (tmp_path / "README.md").read_text(encoding="utf-8")
    assert "- second" in card and "- first" in card  # the second call kept the first call's tags
    assert "learning_rate: 5e-05" in card and "training_steps: 2" in card
