"""PEFT and TRL's trainers under torchrun, 2 processes (issue 47, items 1 and 4): a LoRA run of the Trainer with a
checkpoint and a resume from it, under DDP and under FSDP2 (``GPT2Block`` wrapped, sharded checkpoints), TRL's SFT
with a LoRA ``peft_config`` and TRL's DPO, each on transformers (TRL on transformers) and on hflight (``hflight.trl``)
in the same script (tests/jobs/finetune_job.py): the same log history on every rank (losses, gradient norms, TRL's
metrics summed over both processes) and the same trainable weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from . import launch

pytest.importorskip("peft")
pytest.importorskip("trl")

JOB = launch.JOBS / "finetune_job.py"
#: transformers' FSDP route on the CPU (tests/test_sharded_dropin.py says why): for transformers' side only
STANDIN = launch.TESTS / "fsdp_standin"
RUNS = ("lora", "lora_resumed", "sft", "dpo", "lora_fsdp", "lora_fsdp_resumed")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Both torchrun jobs at once (two processes each, one thread per process)."""
    root = tmp_path_factory.mktemp("finetune")
    env = {"transformers": launch.environment(STANDIN), "hflight": launch.environment()}
    jobs = {library: launch.Job([*launch.torchrun(2), JOB, root, library], root, env=env[library],
                                console=root / f"{library}.console.txt", timeout=480, name=library)
            for library in ("transformers", "hflight")}  # fmt: skip
    launch.all_ok(jobs)
    return root


def _result(root: Path, library: str, rank: int) -> dict:
    return json.loads((root / library / f"rank{rank}.json").read_text(encoding="utf-8"))


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS)
def test_every_rank_has_transformers_numbers_and_weights(runs, run):
    for rank in (0, 1):
        theirs, ours = _result(runs, "transformers", rank), _result(runs, "hflight", rank)
        assert ours["world_size"] == theirs["world_size"] == 2
        assert len([e for e in ours[run]["log_history"] if "loss" in e]) in (4, 8), rank
        assert ours[run]["log_history"] == theirs[run]["log_history"], rank
        assert ours[run]["weights"] == theirs[run]["weights"] and ours[run]["weights"], rank
        assert ours[run]["best"] == theirs[run]["best"], rank


@pytest.mark.subprocess
@pytest.mark.slow
def test_the_runs_are_data_parallel_and_the_resume_continues(runs):
    """Both processes train one run (an epoch of 64 rows at 2 per process is 16 steps), the resumed LoRA run logs the
    checkpoint's 4 steps and 4 more, as the uninterrupted run (its train_loss is that of its own 4, as in
    transformers), and both end with the best checkpoint's adapters (an early one: the weights are not the last)."""
    ours = _result(runs, "hflight", 0)
    assert ours["lora"]["log_history"][0]["epoch"] == 1 / 16
    for run in ("lora", "lora_fsdp"):
        steps = [[e for e in ours[name]["log_history"] if "loss" in e] for name in (run, f"{run}_resumed")]
        assert len(steps[0]) == 8 and steps[1] == steps[0]
        assert ours[run]["best"] == ours[f"{run}_resumed"]["best"] == "checkpoint-2"  # loaded at the end
    assert {p.name for p in (runs / "hflight" / "lora_fsdp" / "checkpoint-4").iterdir()} >= {
        "pytorch_model_fsdp_0", "optimizer_0"}  # fmt: skip
