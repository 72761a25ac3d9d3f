"""The checkpoint tests' runs and helpers (a support module: tests/test_checkpoint_*.py, tests/test_durable.py).

Every run is in-process: a 32-wide BERT, 40 random windows, 4 x 2 micro-batches per optimizer step, dropout on and a
random sampler, so that an exact resume needs the weights, optimizer, scheduler and RNG states. The uninterrupted
run and a run stopped at step 6 are built once per test process, on first use (conftest's ``reference`` and
``saved`` fixtures), whichever checkpoint module asks first."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

import hflight
from hflight.checkpoints.manifest import MANIFEST_NAME, write_manifest


class StopAt(hflight.TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def make_trainer(out: Path, factory, model=None, stop_at=None, callbacks=(), **overrides) -> hflight.Trainer:
    values = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=12,
        learning_rate=1e-3,
        warmup_steps=2,
        logging_steps=1,
        save_steps=3,
        train_sampling_strategy="random",
        seed=7,
        report_to="none",
        disable_tqdm=True,
        dataloader_pin_memory=False,
    )
    values.update(overrides)
    callbacks = list(callbacks) + ([StopAt(stop_at)] if stop_at else [])
    model = model if model is not None else factory.qa_model(seed=0, dropout=0.1)
    return hflight.Trainer(
        model,
        hflight.TrainingArguments(**values),
        train_dataset=factory.qa_dataset(40),
        eval_dataset=factory.qa_dataset(8, seed=1),
        callbacks=callbacks,
    )


def params(trainer: hflight.Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def losses(trainer: hflight.Trainer) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}


def assert_same(reference: hflight.Trainer, resumed: hflight.Trainer, from_step: int) -> None:
    ref, got = params(reference), params(resumed)
    diff = max((ref[k] - got[k]).abs().max().item() for k in ref)
    assert diff <= 1e-6, f"max abs parameter difference {diff}"
    ref_losses, got_losses = losses(reference), losses(resumed)
    for step in range(from_step + 1, 13):
        assert got_losses[step] == pytest.approx(ref_losses[step], rel=1e-6, abs=1e-7), step


def digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(path.relative_to(folder).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


_RUNS: dict[str, object] = {}  # built once per test process, on first use, whichever test module asks first


def reference_run(tmp_path_factory, factory) -> hflight.Trainer:
    """The uninterrupted 12-step run (conftest's ``reference`` fixture)."""
    if "reference" not in _RUNS:
        trainer = make_trainer(tmp_path_factory.mktemp("reference"), factory, save_strategy="no")
        trainer.train()
        _RUNS["reference"] = trainer
    return _RUNS["reference"]


def saved_run(tmp_path_factory, factory) -> Path:
    """A run stopped at step 6 with checkpoints at steps 3 and 6 (conftest's ``saved`` fixture; tests that change
    them work on copies)."""
    if "saved" not in _RUNS:
        out = tmp_path_factory.mktemp("saved")
        make_trainer(out, factory, stop_at=6).train()
        _RUNS["saved"] = out
    return _RUNS["saved"]


def copy_checkpoint(saved: Path, tmp_path: Path, step: int = 6) -> Path:
    target = tmp_path / "copy" / f"checkpoint-{step}"
    shutil.copytree(saved / f"checkpoint-{step}", target)
    return target


def refresh_manifest(folder: Path) -> None:
    """What a careful attacker (or a tool editing a checkpoint) does: make the manifest match the files again."""
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    write_manifest(str(folder), manifest["global_step"], manifest["save_only_model"], manifest["run"])


class CreatesMarker:
    """Unpickling this calls open(marker, "w"): a stand-in for any code a crafted checkpoint could run."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


class ShardedBert:
    """A BERT QA model whose save_pretrained writes shards (as large models do), built on demand."""

    @staticmethod
    def build(factory, seed=0):
        from transformers import BertForQuestionAnswering

        class ShardedBertForQuestionAnswering(BertForQuestionAnswering):  # the name tells HF which labels it takes
            def save_pretrained(self, *args, **kwargs):
                kwargs.setdefault("max_shard_size", "30KB")
                return super().save_pretrained(*args, **kwargs)

        torch.manual_seed(seed)
        return ShardedBertForQuestionAnswering(factory.config(dropout=0.1))
