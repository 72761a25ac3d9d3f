"""Checkpoints you can trust: complete-or-absent folders, checked resume, no code from checkpoint files.

Every run here is in-process: a 32-wide BERT, 40 random windows, 4 x 2 micro-batches per optimizer step, dropout
on and a random sampler, so that an exact resume needs the weights, optimizer, scheduler and RNG states.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import hflight
from hflight import durable
from hflight.checkpoints import folders as checkpoint
from hflight.checkpoints import job, parts
from hflight.checkpoints.manifest import MANIFEST_NAME, get_last_checkpoint, verify_checkpoint, write_manifest
from hflight.checkpoints.parts import load_rng_file, read_trainer_state
from hflight.checkpoints.weights import load_model_weights


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


_RUNS: dict[str, object] = {}  # built once per session, on first use (the factory fixture is function-scoped)


@pytest.fixture
def reference(tmp_path_factory, factory) -> hflight.Trainer:
    """The uninterrupted 12-step run."""
    if "reference" not in _RUNS:
        trainer = make_trainer(tmp_path_factory.mktemp("reference"), factory, save_strategy="no")
        trainer.train()
        _RUNS["reference"] = trainer
    return _RUNS["reference"]


@pytest.fixture
def saved(tmp_path_factory, factory) -> Path:
    """A run stopped at step 6 with checkpoints at steps 3 and 6 (tests that change them work on copies)."""
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


# ---- the folder format ---------------------------------------------------------------------------------------------
def test_every_checkpoint_file_name_is_spelled_in_one_module():
    """grep finds each checkpoint file name (transformers', accelerate's, DeepSpeed's, hflight's) in
    hflight.checkpoints.names alone: the other modules import it (docstrings aside)."""
    import ast

    from hflight.checkpoints import names

    spelled = [v for k, v in vars(names).items() if k.isupper() and isinstance(v, str) and not k.endswith(("PREFIX",
               "SUFFIX"))] + [*names.WEIGHT_FILES, *names.CONFIG_FILES, "rng_state_"]  # fmt: skip
    # a name with an extension is found inside a longer string too (a message, a piece of an f-string)
    inside = re.compile("|".join(rf"(?<![\w-]){re.escape(n)}" for n in spelled if "." in n.lstrip(".") or n[-1] == "_"))
    src, found = Path(names.__file__).parents[1], {}
    for path in src.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        owners = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, owners) and ast.get_docstring(node, clean=False) is not None}  # fmt: skip
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                hits = {node.value} & set(spelled) | {match.group() for match in inside.finditer(node.value)}
                for name in hits:
                    found.setdefault(name, set()).add(path.relative_to(src).as_posix())
    assert {name: where for name, where in found.items() if where != {"checkpoints/names.py"}} == {}
    assert set(found) == set(spelled)


def test_manifest_lists_every_file_with_its_size_and_checksum(saved):
    import xxhash

    folder = saved / "checkpoint-6"
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    on_disk = {
        p.name: {"size": p.stat().st_size, "xxh3_128": xxhash.xxh3_128(p.read_bytes()).hexdigest()}
        for p in folder.iterdir()
        if p.name != MANIFEST_NAME
    }
    assert manifest["files"] == on_disk and manifest["version"] == 2
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"} <= set(on_disk)
    assert manifest["global_step"] == 6 and manifest["save_only_model"] is False
    assert manifest["run"] == {
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "world_size": 1,
        "num_nodes": 1,
        "seed": 7,
        "data_seed": None,
        "train_sampling_strategy": "random",
        "dataloader_drop_last": False,
        "num_examples": 40,
    }
    assert verify_checkpoint(folder) == manifest
    assert not list(saved.glob(".tmp-*"))


def test_incomplete_folders_are_never_picked(saved, tmp_path, caplog):
    out = tmp_path / "out"
    for step in (3, 6):
        shutil.copytree(saved / f"checkpoint-{step}", out / f"checkpoint-{step}")
    (out / "checkpoint-6" / "optimizer.pt").unlink()  # a folder that lost a file
    shutil.copytree(saved / "checkpoint-6", out / "checkpoint-9")
    with open(out / "checkpoint-9" / "model.safetensors", "r+b") as f:
        f.truncate(100)  # a truncated file
    (out / "checkpoint-12").mkdir()  # an empty folder
    shutil.copytree(saved / "checkpoint-6", out / "checkpoint-15")
    (out / "checkpoint-15" / MANIFEST_NAME).write_text('{"format": "hflight-checkpoint", "files": [')  # cut short
    with caplog.at_level(logging.WARNING, logger="hflight"):
        assert get_last_checkpoint(out) == str(out / "checkpoint-3")
    text = caplog.text
    assert "checkpoint-6" in text and "no optimizer.pt" in text
    assert "checkpoint-9" in text and "model.safetensors is corrupt or truncated (100 bytes" in text
    assert "checkpoint-12 has no model weights" in text
    assert f"Checkpoint manifest {out / 'checkpoint-15' / MANIFEST_NAME} is unreadable" in text


def test_a_kill_at_any_point_of_a_resave_leaves_a_complete_checkpoint(saved, reference, tmp_path, factory, monkeypatch):
    """Re-save checkpoint-6 (resumed from checkpoint-3) and copy the run folder before every line the save routine
    executes (when the folder changed since the last copy): each copy is exactly what a kill at that point leaves.
    Every copy must offer a complete checkpoint whose files are those of the old or the new checkpoint-6, or of
    checkpoint-3 (while checkpoint-6 is renamed aside), and resuming from it must reproduce the uninterrupted run."""
    out = tmp_path / "run"
    for step in (3, 6):
        shutil.copytree(saved / f"checkpoint-{step}", out / f"checkpoint-{step}")
    versions = {name: {digest(out / name)} for name in ("checkpoint-3", "checkpoint-6")}
    snapshots = tmp_path / "snapshots"
    sources = {checkpoint.__file__, job.__file__, durable.__file__}  # the save routine, its job, the publication
    lines, states = [0], [None]

    def snapshot(frame, event, arg):
        if event == "line":
            lines[0] += 1
            # a kill before this line leaves the folder as it is now; a state seen just before is not copied again
            state = sorted((str(p.relative_to(out)), p.stat().st_size, p.stat().st_mtime_ns)
                           for p in out.rglob("*"))  # fmt: skip
            if state != states[0]:
                states[0] = state
                shutil.copytree(out, snapshots / f"{len(list(snapshots.glob('*'))):03d}")
        return snapshot

    def trace(frame, event, arg):
        return snapshot if frame.f_code.co_filename in sources else None

    real_save = checkpoint.save_checkpoint

    def traced_save(*args):
        sys.settrace(trace)
        try:
            return real_save(*args)
        finally:
            sys.settrace(None)

    monkeypatch.setattr(checkpoint, "save_checkpoint", traced_save)
    make_trainer(out, factory, stop_at=6).train(resume_from_checkpoint=str(out / "checkpoint-3"))
    monkeypatch.undo()
    versions["checkpoint-6"].add(digest(out / "checkpoint-6"))  # the new one (training_args.bin names this run)

    copies = sorted(snapshots.iterdir())
    assert lines[0] > 20 and len(copies) > 5, (lines, len(copies))
    picked = {}
    for copy in copies:
        last = get_last_checkpoint(copy)
        assert last is not None, copy.name
        name = Path(last).name
        assert digest(Path(last)) in versions[name], f"{copy.name}: {name} is not one of the complete versions"
        picked.setdefault(name, copy)
    # The instant between the two renames falls back to checkpoint-3; every other instant has checkpoint-6.
    assert set(picked) == {"checkpoint-3", "checkpoint-6"}
    assert list(picked["checkpoint-3"].glob(".tmp-checkpoint-6*"))
    for name, copy in picked.items():
        resumed = make_trainer(copy, factory, model=factory.qa_model(seed=99, dropout=0.1))
        resumed.train(resume_from_checkpoint=True)
        assert_same(reference, resumed, from_step=int(name.split("-")[1]))
        assert not list(copy.glob(".tmp-*")), "stale folders are removed when training starts"


def test_stale_tmp_folders_are_removed_and_logged_when_training_starts(tmp_path, factory, caplog):
    (tmp_path / ".tmp-checkpoint-4").mkdir(parents=True)
    (tmp_path / ".tmp-checkpoint-4" / "model.safetensors").write_bytes(b"partial")
    (tmp_path / ".tmp-checkpoint-6.replaced").mkdir()
    with caplog.at_level(logging.WARNING, logger="hflight.checkpoints.folders"):
        make_trainer(tmp_path, factory, max_steps=1, save_strategy="no").train()
    assert not list(tmp_path.glob(".tmp-*"))
    assert ".tmp-checkpoint-4" in caplog.text and ".tmp-checkpoint-6.replaced" in caplog.text


# ---- checkpoint files never run code -----------------------------------------------------------------------------
class _CreatesMarker:
    """Unpickling this calls open(marker, "w"): a stand-in for any code a crafted checkpoint could run."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_malicious_rng_state_is_never_unpickled(saved, tmp_path, factory):
    folder = copy_checkpoint(saved, tmp_path)
    marker = tmp_path / "pwned"
    rng_file = folder / "rng_state.pth"
    states = torch.load(rng_file, weights_only=False)
    states["python"] = _CreatesMarker(marker)
    torch.save(states, rng_file)
    refresh_manifest(folder)

    trainer = make_trainer(tmp_path / "out", factory)
    before = params(trainer)
    with pytest.raises(ValueError, match=r"rng_state\.pth cannot be loaded safely.*refers to io\.open"):
        trainer.train(resume_from_checkpoint=str(folder))
    assert not marker.exists()
    assert all(torch.equal(before[k], v) for k, v in params(trainer).items()), "checked before the model is touched"
    with pytest.raises(ValueError, match="rng_state.pth cannot be loaded safely"):
        load_rng_file(rng_file)
    assert not marker.exists()
    torch.load(rng_file, weights_only=False)  # the control: unpickled the unsafe way, the file does run code
    assert marker.exists()


def test_rng_states_written_by_transformers_load_safely(tmp_path):
    import random

    import numpy as np

    states = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    torch.save(states, tmp_path / "rng_state.pth")
    loaded = load_rng_file(tmp_path / "rng_state.pth")
    assert loaded["python"] == states["python"] and np.array_equal(loaded["numpy"][1], states["numpy"][1])
    torch.save({"python": (3, (1, 2), None), "numpy": states["numpy"], "cpu": states["cpu"]}, tmp_path / "bad.pth")
    with pytest.raises(ValueError, match="bad.pth does not hold valid RNG states"):
        load_rng_file(tmp_path / "bad.pth")


def test_weights_in_pytorch_bin_load_with_weights_only_and_a_crafted_one_is_refused(tmp_path, factory):
    source, target = factory.qa_model(seed=1), factory.qa_model(seed=2)
    torch.save(source.state_dict(), tmp_path / "pytorch_model.bin")
    load_model_weights(target, tmp_path)
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in source.state_dict().items())
    marker = tmp_path / "pwned"
    torch.save({**source.state_dict(), "extra": _CreatesMarker(marker)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin cannot be loaded safely.*refers to io\.open"):
        load_model_weights(target, tmp_path)
    assert not marker.exists()


def test_weights_the_model_ties_may_be_absent_from_the_file(tmp_path, factory):
    """save_pretrained writes a tied decoder weight once (as the embedding); loading must not call it missing."""
    from transformers import BertForMaskedLM

    torch.manual_seed(1)
    source = BertForMaskedLM(factory.config())
    source.save_pretrained(tmp_path)
    torch.manual_seed(2)
    target = BertForMaskedLM(factory.config())
    load_model_weights(target, tmp_path)
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in source.state_dict().items())
    assert target.cls.predictions.decoder.weight is target.bert.embeddings.word_embeddings.weight


# ---- trainer_state.json --------------------------------------------------------------------------------------------
GOOD_STATE = {"global_step": 6, "epoch": 1.2, "max_steps": 12, "log_history": []}


@pytest.mark.parametrize(
    "content, message",
    [
        ("{}", r"lacks the key\(s\) 'global_step', 'epoch', 'max_steps', 'log_history'"),
        ("[]", "must hold a JSON object"),
        ('{"global_step": 6,', "is not valid JSON"),
        (json.dumps({**GOOD_STATE, "global_step": "6"}), "key 'global_step' must be an integer, got \"6\""),
        (json.dumps({**GOOD_STATE, "global_step": True}), "key 'global_step' must be an integer"),
        (json.dumps({**GOOD_STATE, "save_steps": None}), "key 'save_steps' must be an integer or a number"),
        (json.dumps({**GOOD_STATE, "log_history": {}}), "key 'log_history' must be a list"),
        (json.dumps({**GOOD_STATE, "log_history": [1]}), "'log_history' entry 0 must be an object"),
        (json.dumps({**GOOD_STATE, "global_step": -1}), "must not be negative"),
        (json.dumps({**GOOD_STATE, "stateful_callbacks": {"X": 3}}), r"'stateful_callbacks'\['X'\]"),
        (json.dumps({**GOOD_STATE, "stateful_callbacks": {"X": {"args": 1}}}), r"with 'args' and 'attributes' objects"),
        (
            '{"global_step": 6, "epoch": NaN, "max_steps": 12, "log_history": []}',
            "key 'epoch' must be a finite number, got NaN",
        ),
        (
            json.dumps({**GOOD_STATE, "best_metric": float("inf"), "best_global_step": 3}),
            "key 'best_metric' must be a finite number, got Infinity",
        ),
        (json.dumps({**GOOD_STATE, "total_flos": float("-inf")}), "key 'total_flos' must be a finite number"),
    ],
)
def test_trainer_state_json_is_validated(tmp_path, content, message):
    path = tmp_path / "trainer_state.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as error:
        read_trainer_state(path)
    assert str(path) in str(error.value)


def test_an_invalid_trainer_state_is_rejected_before_the_model_is_touched(saved, tmp_path, factory):
    folder = copy_checkpoint(saved, tmp_path)
    (folder / "trainer_state.json").write_text("{}")
    refresh_manifest(folder)
    trainer = make_trainer(tmp_path / "out", factory)
    before = params(trainer)
    with pytest.raises(ValueError, match=r"trainer_state\.json lacks the key\(s\) 'global_step'"):
        trainer.train(resume_from_checkpoint=str(folder))
    assert all(torch.equal(before[k], v) for k, v in params(trainer).items())


def test_transformers_starting_point_for_the_best_metric_means_no_best_yet(tmp_path):
    """transformers starts best_metric at -inf/+inf and writes it as such when no evaluation improved on it (a NaN
    metric): that is read as "no best yet"; hflight writes null instead."""
    path = tmp_path / "trainer_state.json"
    path.write_text(json.dumps({**GOOD_STATE, "best_metric": float("-inf"), "best_global_step": None}))
    assert read_trainer_state(path).best_metric is None


def test_a_run_whose_metric_never_improved_writes_a_finite_state_and_resumes(tmp_path, factory):
    """A NaN evaluation metric never beats transformers' starting point (-inf for greater_is_better): hflight keeps it
    in memory as transformers does (EarlyStoppingCallback compares with it), but writes null, not -Infinity."""
    trainer = make_trainer(tmp_path, factory, stop_at=3, eval_strategy="steps", eval_steps=3,
                           metric_for_best_model="score", greater_is_better=True)  # fmt: skip
    trainer.compute_metrics = lambda prediction: {"score": float("nan")}
    trainer.train()
    assert trainer.state.best_metric == float("-inf")
    written = json.loads((tmp_path / "checkpoint-3" / "trainer_state.json").read_text())
    assert written["best_metric"] is None and written["best_global_step"] is None
    resumed = make_trainer(tmp_path / "resumed", factory, max_steps=4, save_strategy="no")
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert resumed.state.global_step == 4


def test_unknown_trainer_state_keys_are_dropped_with_a_warning(tmp_path, caplog):
    path = tmp_path / "trainer_state.json"
    path.write_text(json.dumps({**GOOD_STATE, "from_the_future": 1}))
    with caplog.at_level(logging.WARNING, logger="hflight.checkpoints.resume"):
        assert read_trainer_state(path).global_step == 6
    assert "from_the_future" in caplog.text


# ---- optimizer, scheduler ------------------------------------------------------------------------------------------
def test_a_missing_empty_or_crafted_optimizer_file_is_named(saved, tmp_path, factory):
    folder = copy_checkpoint(saved, tmp_path)
    (folder / "optimizer.pt").unlink()
    with pytest.raises(ValueError, match=r"checkpoint-6 is incomplete or damaged: no optimizer\.pt"):
        make_trainer(tmp_path / "a", factory).train(resume_from_checkpoint=str(folder))

    (folder / "optimizer.pt").write_bytes(b"")
    refresh_manifest(folder)
    with pytest.raises(ValueError, match=r"Cannot restore .*optimizer\.pt: the file is empty \(0 bytes\)"):
        make_trainer(tmp_path / "b", factory).train(resume_from_checkpoint=str(folder))

    marker = tmp_path / "pwned"
    torch.save({"state": {}, "param_groups": _CreatesMarker(marker)}, folder / "optimizer.pt")
    refresh_manifest(folder)
    with pytest.raises(ValueError, match=r"optimizer\.pt cannot be loaded safely.*refers to io\.open"):
        make_trainer(tmp_path / "c", factory).train(resume_from_checkpoint=str(folder))
    assert not marker.exists()

    (folder / MANIFEST_NAME).unlink()  # as transformers.Trainer writes it: no manifest
    (folder / "optimizer.pt").unlink()
    with pytest.raises(ValueError, match=r"has scheduler\.pt but no optimizer\.pt"):
        make_trainer(tmp_path / "d", factory).train(resume_from_checkpoint=str(folder))


def test_save_only_model_folders_resume_from_the_weights_with_a_warning(tmp_path, factory, caplog):
    make_trainer(tmp_path, factory, stop_at=3, save_only_model=True).train()
    folder = tmp_path / "checkpoint-3"
    assert not (folder / "optimizer.pt").exists() and verify_checkpoint(folder)["save_only_model"] is True
    resumed = make_trainer(tmp_path / "resumed", factory, model=factory.qa_model(seed=5, dropout=0.1), max_steps=5)
    with caplog.at_level(logging.WARNING, logger="hflight.checkpoints.resume"):
        resumed.train(resume_from_checkpoint=str(folder))
    assert "saved with save_only_model=True" in caplog.text and "reproducibility is not guaranteed" in caplog.text
    logged = {e["step"]: e for e in resumed.state.log_history if "loss" in e}
    assert sorted(logged) == [1, 2, 3, 4, 5]  # steps 1-3 from the checkpoint's history, 4-5 trained now
    assert logged[4]["learning_rate"] == 0.0  # a fresh schedule starts its warmup again, as in transformers


# ---- resuming with other arguments ---------------------------------------------------------------------------------
def test_changed_arguments_are_named_and_the_new_cadence_wins(saved, tmp_path, factory, caplog):
    folder = copy_checkpoint(saved, tmp_path)
    out = tmp_path / "out"
    trainer = make_trainer(
        out, factory, per_device_train_batch_size=8, gradient_accumulation_steps=1, data_seed=3, save_steps=5
    )
    with caplog.at_level(logging.WARNING, logger="hflight.checkpoints.resume"):
        trainer.train(resume_from_checkpoint=str(folder))
    text = caplog.text
    assert "change the data position or the step arithmetic" in text
    assert "per_device_train_batch_size: 8 (now) != 4 (checkpoint)" in text
    assert "gradient_accumulation_steps: 1 (now) != 2 (checkpoint)" in text
    assert "data_seed: 3 (now) != None (checkpoint)" in text  # the sampler's seed was `seed`, now 3
    assert "save_steps: 5 (now) != 3 (checkpoint)" in text and "this run's logging/evaluation/saving cadence" in text
    assert "seed:" not in text.replace("data_seed", "")
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-12"]
    assert read_trainer_state(out / "checkpoint-10" / "trainer_state.json").save_steps == 5


def test_resuming_with_the_same_arguments_is_silent(saved, tmp_path, factory, caplog):
    folder = copy_checkpoint(saved, tmp_path)
    with caplog.at_level(logging.WARNING, logger="hflight"):
        trainer = make_trainer(tmp_path / "out", factory, save_strategy="no", max_steps=7)
        trainer.train(resume_from_checkpoint=str(folder))
    assert trainer.state.global_step == 7 and "(now) !=" not in caplog.text


# ---- weights -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("damage", ["shape", "missing", "unexpected"])
def test_a_rejected_checkpoint_leaves_the_model_untouched(saved, tmp_path, factory, damage):
    folder = copy_checkpoint(saved, tmp_path)
    weights = load_file(folder / "model.safetensors")
    if damage == "shape":
        weights["qa_outputs.weight"] = torch.zeros(3, 32)
    elif damage == "missing":
        del weights["bert.encoder.layer.1.output.dense.weight"]
    else:
        weights["bert.pooler.extra"] = torch.zeros(2)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    refresh_manifest(folder)
    trainer = make_trainer(tmp_path / "out", factory)
    before = params(trainer)
    expected = {
        "shape": r"shapes \['qa_outputs.weight: \[3, 32\] in the file, \[2, 32\] in the model'\]",
        "missing": r"missing keys \['bert.encoder.layer.1.output.dense.weight'\]",
        "unexpected": r"unexpected keys \['bert.pooler.extra'\]",
    }[damage]
    with pytest.raises(ValueError, match=rf"model\.safetensors does not match BertForQuestionAnswering: {expected}"):
        trainer.train(resume_from_checkpoint=str(folder))
    assert all(torch.equal(before[k], v) for k, v in params(trainer).items())


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


def test_a_sharded_checkpoint_resumes_exactly(reference, tmp_path, factory):
    make_trainer(tmp_path, factory, model=ShardedBert.build(factory), stop_at=6).train()
    folder = tmp_path / "checkpoint-6"
    assert (folder / "model.safetensors.index.json").is_file() and not (folder / "model.safetensors").exists()
    assert len(list(folder.glob("model-*-of-*.safetensors"))) > 2
    resumed = make_trainer(tmp_path / "resumed", factory, model=ShardedBert.build(factory, seed=42))
    resumed.train(resume_from_checkpoint=str(folder))
    assert_same(reference, resumed, from_step=6)

    shard = sorted(folder.glob("model-*-of-*.safetensors"))[-1]
    tensors = load_file(shard)
    key = sorted(tensors)[0]
    tensors[key] = torch.zeros(1)
    save_file(tensors, shard, metadata={"format": "pt"})
    refresh_manifest(folder)
    victim = make_trainer(tmp_path / "victim", factory, model=ShardedBert.build(factory, seed=42))
    before = params(victim)
    with pytest.raises(ValueError, match=rf"model\.safetensors\.index\.json does not match .*{key}: \[1\] in the file"):
        victim.train(resume_from_checkpoint=str(folder))
    assert all(torch.equal(before[k], v) for k, v in params(victim).items())


def test_a_sharded_best_checkpoint_is_loaded_at_the_end(tmp_path, factory):
    trainer = make_trainer(
        tmp_path,
        factory,
        model=ShardedBert.build(factory),
        eval_strategy="steps",
        eval_steps=3,
        load_best_model_at_end=True,
        metric_for_best_model="score",
    )
    scores = iter([1.0, 3.0, 2.0, 0.0])  # evaluations at steps 3, 6, 9, 12: the best is step 6, not the last
    trainer.compute_metrics = lambda prediction: {"score": next(scores)}
    trainer.train()
    assert trainer.state.best_global_step == 6 != trainer.state.global_step
    best = Path(trainer.state.best_model_checkpoint)
    assert best.name == "checkpoint-6" and (best / "model.safetensors.index.json").is_file()
    on_disk = type(trainer.model).from_pretrained(str(best)).state_dict()
    assert all(torch.equal(on_disk[k], v) for k, v in params(trainer).items())


# ---- non-finite losses ---------------------------------------------------------------------------------------------
class NaNFrom(hflight.Trainer):
    """Makes the loss NaN from optimizer step ``nan_from`` on (the weights then turn NaN too)."""

    nan_from = 3

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.state.global_step + 1 >= self.nan_from:
            return loss * float("nan")
        return loss


def test_the_first_nonfinite_logged_loss_is_reported_once(tmp_path, factory, caplog):
    args = hflight.TrainingArguments(
        output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=4, logging_steps=1, save_strategy="no",
        logging_nan_inf_filter=False, report_to="none", disable_tqdm=True, dataloader_pin_memory=False,
    )  # fmt: skip
    trainer = NaNFrom(factory.qa_model(), args, train_dataset=factory.qa_dataset(24))
    with caplog.at_level(logging.WARNING, logger="hflight"):
        trainer.train()
    warnings = [r.getMessage() for r in caplog.records if "logged" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("Step 3: logged loss=nan, grad_norm=nan.")


# ==== issue 17: every promise under an adversarial sweep ============================================================
# ---- 1. deleting a checkpoint is atomic for a reader ---------------------------------------------------------------
def test_a_kill_at_any_point_of_a_deletion_never_offers_a_partial_checkpoint(tmp_path, factory, monkeypatch):
    """save_total_limit=1 with the best model kept: rotation during training and the clean-up at its end delete whole
    checkpoints. The run folder is copied after every file or folder removal (what a kill at that moment leaves):
    every copy offers a checkpoint that holds its weights and all its files, and resuming from it works. (Deleting
    in place left ``checkpoint-12`` holding only ``trainer_state.json``, which counted as a transformers folder.)"""
    out, snapshots = tmp_path / "run", tmp_path / "snapshots"
    real_unlink, real_rmdir = os.unlink, os.rmdir

    def snapshot():
        if out.is_dir():
            shutil.copytree(out, snapshots / f"{len(list(snapshots.glob('*'))):03d}")

    def unlink(path, *args, **kwargs):
        real_unlink(path, *args, **kwargs)
        snapshot()

    def rmdir(path, *args, **kwargs):
        real_rmdir(path, *args, **kwargs)
        snapshot()

    trainer = make_trainer(out, factory, save_total_limit=1, eval_strategy="steps", eval_steps=3,
                           load_best_model_at_end=True, metric_for_best_model="score")  # fmt: skip
    scores = iter([1.0, 3.0, 2.0, 0.0])  # the best is step 6: 3 and 9 go by rotation, 12 at the end
    trainer.compute_metrics = lambda prediction: {"score": next(scores)}
    monkeypatch.setattr(os, "unlink", unlink)
    monkeypatch.setattr(os, "rmdir", rmdir)
    trainer.train()
    monkeypatch.undo()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-6"]

    copies = sorted(snapshots.iterdir())
    assert len(copies) > 20
    picked: dict[str, Path] = {}
    for copy in copies:
        last = get_last_checkpoint(copy)
        assert last is not None, copy.name
        assert (Path(last) / "model.safetensors").is_file(), f"{copy.name}: {Path(last).name} has no weights"
        verify_checkpoint(last)
        picked.setdefault(Path(last).name, copy)
    assert set(picked) == {"checkpoint-12", "checkpoint-6"}  # 6 once 12 has been renamed aside at the end
    assert any(list(copy.glob(".tmp-checkpoint-*.deleting")) for copy in copies), "removals go through a rename"
    for name, copy in picked.items():
        resumed = make_trainer(copy, factory, model=factory.qa_model(seed=99, dropout=0.1))
        resumed.train(resume_from_checkpoint=True)
        assert resumed.state.global_step >= 12, name
        assert not list(copy.glob(".tmp-*")), "leftovers of an interrupted deletion are removed when training starts"


# ---- 2. a rejected checkpoint changes nothing ----------------------------------------------------------------------
def _shrunk_state(state):
    entry = state["state"][0]
    return {**state, "state": {**state["state"], 0: {**entry, "exp_avg": torch.zeros(3)}}}


MISFITS = {
    "no optimizer groups": (
        "optimizer.pt", lambda s: {"state": {}, "param_groups": []},
        r"optimizer\.pt: 'param_groups' has 0 group\(s\), the AdamW this run builds has 2",
    ),
    "optimizer state shape": (
        "optimizer.pt", _shrunk_state,
        r"optimizer\.pt: 'state'\[0\]\['exp_avg'\] is \[3\], parameter bert\.embeddings\.word_embeddings\.weight "
        r"has shape \[100, 32\]",
    ),
    "empty scheduler": (
        "scheduler.pt", lambda s: {},
        r"scheduler\.pt lacks the field\(s\) 'last_epoch', 'base_lrs', '_last_lr', '_step_count' of LambdaLR",
    ),
    "scheduler base_lrs length": (
        "scheduler.pt", lambda s: {**s, "base_lrs": s["base_lrs"][:1]},
        r"scheduler\.pt: field 'base_lrs' has 1 entries, LambdaLR has 2 \(one per parameter group\)",
    ),
    "scheduler overwriting an attribute": (
        "scheduler.pt", lambda s: {**s, "optimizer": {}},
        r"scheduler\.pt: field 'optimizer' is not part of LambdaLR's state",
    ),
}  # fmt: skip


@pytest.mark.parametrize("misfit", MISFITS)
def test_an_optimizer_or_scheduler_state_that_does_not_fit_is_refused_before_anything_changes(
    saved, tmp_path, factory, misfit
):
    """torch loads an optimizer state of no groups, a scheduler state of {} or a base_lrs of the wrong length
    without a word (the last fails at the first scheduler step, naming no file); they were rejected, if at all,
    after the weights had been copied in."""
    name, damage, message = MISFITS[misfit]
    folder = copy_checkpoint(saved, tmp_path)
    torch.save(damage(torch.load(folder / name, weights_only=True)), folder / name)
    refresh_manifest(folder)
    trainer = make_trainer(tmp_path / "out", factory)
    before = params(trainer)
    with pytest.raises(ValueError, match=message):
        trainer.train(resume_from_checkpoint=str(folder))
    assert all(torch.equal(before[k], v) for k, v in params(trainer).items()), "the weights were copied in"
    assert trainer.optimizer is None and trainer.lr_scheduler is None, "nothing was built on the trainer"


# ---- 3. only the regular files of the folder are read --------------------------------------------------------------
@contextlib.contextmanager
def unblocking(fifo: Path, after: float = 30.0):
    """If something opens ``fifo`` for reading (and so blocks), open it for writing after ``after`` seconds so that
    the test fails instead of hanging; the list it yields records whether that was needed."""
    needed: list[bool] = []
    done = threading.Event()

    def watch():
        if not done.wait(after):
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a blocked reader gets end-of-file
                needed.append(True)
            except OSError:  # nobody is reading it
                pass

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield needed
    finally:
        done.set()
        thread.join()


def test_a_named_pipe_among_the_rng_files_is_never_opened(saved, tmp_path, factory):
    folder = copy_checkpoint(saved, tmp_path)
    os.mkfifo(folder / "rng_state_9.pth")  # not in the manifest, not a name a one-process run writes
    with unblocking(folder / "rng_state_9.pth") as needed:
        make_trainer(tmp_path / "a", factory, max_steps=7, save_strategy="no").train(resume_from_checkpoint=str(folder))
    assert not needed, "resume opened the named pipe"

    (folder / "rng_state.pth").unlink()
    os.mkfifo(folder / "rng_state.pth")  # one the manifest lists: refused by what it is, never opened
    with unblocking(folder / "rng_state.pth") as needed, pytest.raises(ValueError) as error:
        make_trainer(tmp_path / "b", factory).train(resume_from_checkpoint=str(folder))
    assert not needed
    assert str(error.value) == f"{folder / 'rng_state.pth'} is a named pipe (FIFO), not a regular file: it is not read."


def test_a_weights_file_linked_from_outside_the_folder_is_refused(saved, tmp_path, factory):
    folder = copy_checkpoint(saved, tmp_path)
    elsewhere = tmp_path / "elsewhere.safetensors"
    weights = load_file(folder / "model.safetensors")
    save_file({k: v + 1 for k, v in weights.items()}, elsewhere, metadata={"format": "pt"})  # same size, other values
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to(elsewhere)
    trainer = make_trainer(tmp_path / "out", factory)
    before = params(trainer)
    with pytest.raises(ValueError, match=rf"model\.safetensors leads outside the checkpoint folder \(to {elsewhere}\)"):
        trainer.train(resume_from_checkpoint=str(folder))
    assert all(torch.equal(before[k], v) for k, v in params(trainer).items())
    assert get_last_checkpoint(folder.parent) is None

    (folder / "model.safetensors").unlink()
    shutil.copy(elsewhere, folder / "weights-copy")
    (folder / "model.safetensors").symlink_to("weights-copy")  # a link inside the folder is only another name
    from hflight.checkpoints.files import regular_file

    assert regular_file(folder, "model.safetensors") == folder / "model.safetensors"


@pytest.mark.parametrize("listed", ["../../outside.txt", "/etc/hostname"])
def test_a_manifest_naming_a_path_outside_the_folder_is_refused(saved, tmp_path, listed):
    folder = copy_checkpoint(saved, tmp_path)
    target = (folder / listed).resolve() if not listed.startswith("/") else Path(listed)
    if not listed.startswith("/"):
        target.write_text("x")
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    # A version-1 manifest (sizes only, still read) listing what is there: sizes alone would pass.
    manifest["version"] = 1
    manifest["files"] = {n: e["size"] if isinstance(e, dict) else e for n, e in manifest["files"].items()}
    manifest["files"][listed] = target.stat().st_size
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    expected = rf"{MANIFEST_NAME} lists '{re.escape(listed)}': a path outside the checkpoint folder"
    with pytest.raises(ValueError, match=expected):
        verify_checkpoint(folder)
    assert get_last_checkpoint(folder.parent) is None


def test_a_shard_index_naming_a_file_outside_the_folder_is_refused_before_it_is_opened(tmp_path, factory):
    make_trainer(tmp_path, factory, model=ShardedBert.build(factory), stop_at=3).train()
    folder = tmp_path / "checkpoint-3"
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    os.mkfifo(tmp_path / "outside.safetensors")  # opening it would block: proof that nothing opens it
    index["weight_map"] = {k: ("../outside.safetensors" if v == shard else v) for k, v in index["weight_map"].items()}
    index_file.write_text(json.dumps(index))
    refresh_manifest(folder)
    trainer = make_trainer(tmp_path / "out", factory, model=ShardedBert.build(factory, seed=5))
    with unblocking(tmp_path / "outside.safetensors") as needed, pytest.raises(ValueError) as error:
        trainer.train(resume_from_checkpoint=str(folder))
    assert not needed
    assert f"{index_file} lists '../outside.safetensors': a path outside the checkpoint folder" in str(error.value)


def test_a_best_checkpoint_outside_the_output_dir_is_an_error(saved, tmp_path, factory):
    """trainer_state.json's best_model_checkpoint decides whose weights load_best_model_at_end loads."""
    folder = copy_checkpoint(saved, tmp_path)
    other_run = tmp_path / "other" / "checkpoint-3"
    shutil.copytree(saved / "checkpoint-3", other_run)
    state = json.loads((folder / "trainer_state.json").read_text())
    state["best_model_checkpoint"], state["best_global_step"], state["best_metric"] = str(other_run), 3, 0.5
    (folder / "trainer_state.json").write_text(json.dumps(state))
    refresh_manifest(folder)
    trainer = make_trainer(tmp_path / "out", factory, load_best_model_at_end=True, metric_for_best_model="loss",
                           eval_strategy="steps", eval_steps=3)  # fmt: skip
    before = params(trainer)
    with pytest.raises(ValueError, match=rf"best_model_checkpoint '{other_run}' lies outside output_dir"):
        trainer.train(resume_from_checkpoint=str(folder))
    assert all(torch.equal(before[k], v) for k, v in params(trainer).items())


@pytest.mark.parametrize("original", ["copied", "moved"])
def test_a_copied_run_folder_takes_its_best_checkpoint_from_the_copy(saved, tmp_path, factory, caplog, original):
    """The common innocent case: the whole run folder was copied (the recorded best path still exists where the
    original run was) or moved (it exists no more). The checkpoint of the same name in the copy is used, also when
    the copy is resumed into another output_dir."""
    copy = tmp_path / "copy"
    shutil.copytree(saved / "checkpoint-3", copy / "checkpoint-3")
    shutil.copytree(saved / "checkpoint-6", copy / "checkpoint-6")
    recorded = saved / "checkpoint-3" if original == "copied" else tmp_path / "moved-away" / "checkpoint-3"
    state = json.loads((copy / "checkpoint-6" / "trainer_state.json").read_text())
    state.update(best_model_checkpoint=str(recorded), best_global_step=3, best_metric=1.0)
    (copy / "checkpoint-6" / "trainer_state.json").write_text(json.dumps(state))
    refresh_manifest(copy / "checkpoint-6")
    for output_dir in (copy, tmp_path / "elsewhere"):
        trainer = make_trainer(output_dir, factory, max_steps=7, save_strategy="no")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hflight.checkpoints.resume"):
            trainer.train(resume_from_checkpoint=str(copy / "checkpoint-6"))
        assert trainer.state.best_model_checkpoint == str(copy / "checkpoint-3")
        assert f"using {copy / 'checkpoint-3'} instead" in caplog.text


# ---- 6. failed writes: one error naming the folder, the file and the cause -----------------------------------------
FULL_DISK_JOB = Path(__file__).parent / "jobs" / "full_disk_job.py"


def _can_mount_a_small_disk() -> bool:
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True)  # fmt: skip
    return probe.returncode == 0


@pytest.mark.subprocess
@pytest.mark.parametrize("room", [0.15, 0.6])
def test_a_full_disk_during_a_save_is_one_error_and_the_previous_checkpoint_stays(saved, tmp_path, room):
    """A real full disk: the run writes into a tmpfs (in a user and mount namespace) that holds checkpoint-3 and
    ``room`` of another checkpoint, so the save of checkpoint-6 runs out of space in a different file each time.
    torch's own errors said "unexpected pos 64 vs 0" or "basic_ios::clear: iostream error", naming nothing."""
    if not shutil.which("unshare") or not _can_mount_a_small_disk():
        pytest.skip("needs unshare with user and mount namespaces to mount a small tmpfs (a real full disk)")
    size = sum(p.stat().st_size for p in (saved / "checkpoint-3").iterdir())
    disk, results = tmp_path / "disk", tmp_path / "results"
    disk.mkdir()
    kib = int(size * (1 + room) / 1024) + 8
    command = f"mount -t tmpfs -o size={kib}k tmpfs {disk} && exec {sys.executable} {FULL_DISK_JOB} {disk} {results}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", command], capture_output=True, text=True, env=env,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((results / "result.json").read_text())
    assert result["type"] == "CheckpointWriteError", result
    message = result["message"]
    assert message.startswith(f"Could not save checkpoint {disk / 'checkpoint-6'}: writing "), message
    assert ": no space left on device. The unfinished folder was removed" in message, message
    failed_file = message.split("writing ")[1].split(" failed")[0]
    assert failed_file in result["checkpoint_files"], (failed_file, result["checkpoint_files"])
    copy = results / "out"
    assert sorted(p.name for p in copy.iterdir() if p.name.startswith(("checkpoint", ".tmp"))) == ["checkpoint-3"]
    assert verify_checkpoint(copy / "checkpoint-3", full=True)["global_step"] == 3
    assert digest(copy / "checkpoint-3") == result["checkpoint_3_before"]


class _FailingWrite:
    """Replaces torch.save in hflight.checkpoints.folders: fails on ``name`` the way torch's zip writer does."""

    def __init__(self, name: str, error: Exception) -> None:
        self.name, self.error, self.real = name, error, torch.save

    def __call__(self, obj, path, *args, **kwargs):
        if os.path.basename(path) == self.name:
            Path(path).write_bytes(b"PK\x03\x04")  # torch had started the file
            raise self.error
        return self.real(obj, path, *args, **kwargs)


@pytest.mark.parametrize(
    "name, error, free, cause",
    [
        ("optimizer.pt", RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0"), 0,
         "no space left on device"),
        ("scheduler.pt", RuntimeError("basic_ios::clear: iostream error"), 0, "no space left on device"),
        ("rng_state.pth", PermissionError(13, "Permission denied"), 10**9, "permission denied"),
        ("optimizer.pt", OSError(5, "Input/output error"), 10**9, "input/output error"),
    ],
)  # fmt: skip
def test_each_kind_of_write_failure_is_named(saved, tmp_path, factory, monkeypatch, name, error, free, cause):
    out = tmp_path / "run"
    shutil.copytree(saved / "checkpoint-3", out / "checkpoint-3")
    before = digest(out / "checkpoint-3")
    monkeypatch.setattr(parts.torch, "save", _FailingWrite(name, error))
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real_usage(p)._replace(free=free))
    trainer = make_trainer(out, factory, stop_at=6)
    with pytest.raises(checkpoint.CheckpointWriteError) as raised:
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    assert str(raised.value) == (
        f"Could not save checkpoint {out / 'checkpoint-6'}: writing {name} failed: {cause}. The unfinished folder was "
        f"removed; the checkpoints already in {out} are unchanged."
    )
    assert isinstance(raised.value, OSError)  # the command line reports it as one message (a user error)
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint-3"]
    assert digest(out / "checkpoint-3") == before


def test_a_failure_that_is_not_a_write_is_not_disguised_as_one(saved, tmp_path, factory, monkeypatch):
    monkeypatch.setattr(parts.torch, "save", _FailingWrite("scheduler.pt", RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="^a bug$"):
        make_trainer(tmp_path, factory, stop_at=3).train()


# ---- 7. silent corruption ------------------------------------------------------------------------------------------
def _flip_bytes(path: Path, count: int = 8) -> None:
    data = bytearray(path.read_bytes())
    for i in range(count):
        data[-100 - 7 * i] ^= 0xFF  # in the tensor data, past the header: still a valid safetensors file
    path.write_bytes(bytes(data))


def test_flipped_bytes_in_the_weights_are_found_on_resume(saved, tmp_path, factory):
    folder = copy_checkpoint(saved, tmp_path)
    _flip_bytes(folder / "model.safetensors")
    load_file(folder / "model.safetensors")  # still loads: only the checksum tells
    trainer = make_trainer(tmp_path / "out", factory)
    before = params(trainer)
    with pytest.raises(ValueError, match=r"checkpoint-6 is incomplete or damaged: model\.safetensors is damaged: its "
                                         r"content differs from the checksum recorded when it was saved"):  # fmt: skip
        trainer.train(resume_from_checkpoint=str(folder))
    assert all(torch.equal(before[k], v) for k, v in params(trainer).items())


class DamageBest(hflight.TrainerCallback):
    """Flips bytes in the best checkpoint's weights once it is written (damage between saving and loading it)."""

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == 12:
            _flip_bytes(Path(args.output_dir) / "checkpoint-6" / "model.safetensors")


def test_flipped_bytes_in_the_best_checkpoint_are_found_before_it_is_loaded(tmp_path, factory):
    trainer = make_trainer(tmp_path, factory, eval_strategy="steps", eval_steps=3, load_best_model_at_end=True,
                           metric_for_best_model="score", callbacks=[DamageBest()])  # fmt: skip
    scores = iter([1.0, 3.0, 2.0, 0.0])
    trainer.compute_metrics = lambda prediction: {"score": next(scores)}
    with pytest.raises(ValueError, match=r"checkpoint-6 is incomplete or damaged: model\.safetensors is damaged"):
        trainer.train()


# ---- 8. smaller items ----------------------------------------------------------------------------------------------
def test_a_crafted_ema_state_is_refused_as_unsafe(saved, tmp_path, factory):
    from hflight.callbacks.ema import STATE_FILE, EMACallback
    from hflight.checkpoints.files import UnsafeCheckpointFile

    folder = copy_checkpoint(saved, tmp_path)
    marker = tmp_path / "pwned"
    torch.save({"raw": _CreatesMarker(marker), "num_updates": 1}, folder / STATE_FILE)
    refresh_manifest(folder)
    trainer = make_trainer(tmp_path / "out", factory, callbacks=[EMACallback(decay=0.9)])
    with pytest.raises(UnsafeCheckpointFile) as error:
        trainer.train(resume_from_checkpoint=str(folder))
    assert str(error.value).startswith(f"{folder / STATE_FILE} cannot be loaded safely: it holds objects other than")
    assert "weights_only=False" not in str(error.value) and not marker.exists()


# ---- issue 16: checkpoints that interoperate -----------------------------------------------------------------------
def test_a_missing_checkpoint_path_raises_transformers_error_text(tmp_path, factory):
    missing = tmp_path / "nowhere" / "checkpoint-3"
    with pytest.raises(ValueError) as error:
        make_trainer(tmp_path / "out", factory).train(resume_from_checkpoint=str(missing))
    assert str(error.value) == f"Can't find a valid checkpoint at {missing}"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=f"^Can't find a valid checkpoint at {tmp_path / 'empty'}"):
        load_model_weights(factory.qa_model(), tmp_path / "empty")


def test_weights_saved_again_after_the_save_resume_with_a_warning_and_a_killed_resave_is_refused(
    reference, tmp_path, factory, monkeypatch, caplog
):
    """A user re-shards a checkpoint's weights (``save_pretrained(max_shard_size=...)``: new shard names, a new index,
    the old shards deleted first). The complete re-save resumes, with a warning that names what changed, and
    continues exactly; every state a kill during that re-save leaves (old shards gone, some new ones written, the old
    index still there), or a new shard cut short, is refused and changes nothing."""
    import transformers.modeling_utils as modeling_utils

    make_trainer(tmp_path, factory, model=ShardedBert.build(factory), stop_at=6).train()
    folder = tmp_path / "checkpoint-6"
    before = sorted(p.name for p in folder.glob("model-*-of-*.safetensors"))
    snapshots, real_save = tmp_path / "killed", modeling_utils.safe_save_file

    def snapshot_then_save(tensors, filename, *args, **kwargs):
        shutil.copytree(folder, snapshots / f"{len(list(snapshots.glob('*'))):02d}" / "checkpoint-6")
        return real_save(tensors, filename, *args, **kwargs)

    resaver = ShardedBert.build(factory, seed=3)
    resaver.config.use_cache = False  # as in the checkpoint's config.json (the Trainer sets args.use_cache)
    load_model_weights(resaver, folder)
    monkeypatch.setattr(modeling_utils, "safe_save_file", snapshot_then_save)
    resaver.save_pretrained(folder, max_shard_size="60KB")
    monkeypatch.undo()
    after = sorted(p.name for p in folder.glob("model-*-of-*.safetensors"))
    assert after and not set(after) & set(before)

    resumed = make_trainer(tmp_path / "resumed", factory, model=ShardedBert.build(factory, seed=42))
    with caplog.at_level(logging.WARNING, logger="hflight"):
        resumed.train(resume_from_checkpoint=str(folder))
    assert_same(reference, resumed, from_step=6)
    warning = next(r.getMessage() for r in caplog.records if "saved again" in r.getMessage())
    assert warning.startswith(f"Checkpoint {folder}: its model weights were saved again after the checkpoint was")
    assert f"new: {after[0]}" in warning and "rewritten: model.safetensors.index.json" in warning
    assert f"no longer there: {before[0]}" in warning

    killed = sorted(snapshots.iterdir())
    assert len(killed) == len(after)
    cut = tmp_path / "cut" / "checkpoint-6"
    shutil.copytree(folder, cut)
    with open(cut / after[-1], "r+b") as handle:
        handle.truncate((cut / after[-1]).stat().st_size // 2)
    for copy in [*(k / "checkpoint-6" for k in killed), cut]:
        assert get_last_checkpoint(copy.parent) is None, copy
        victim = make_trainer(tmp_path / "victim", factory, model=ShardedBert.build(factory, seed=42))
        untouched = params(victim)
        with pytest.raises(ValueError, match=r"checkpoint-6 is incomplete or damaged: (no model-|model-.* is corrupt)"):
            victim.train(resume_from_checkpoint=str(copy))
        assert all(torch.equal(untouched[k], v) for k, v in params(victim).items())


def test_shards_written_beside_a_single_weights_file_are_ignored_with_a_warning(saved, tmp_path, factory, caplog):
    """save_pretrained(max_shard_size=...) into a checkpoint holding model.safetensors writes shards and an index but
    leaves model.safetensors, which transformers loads first: so does hflight, and says so."""
    folder = copy_checkpoint(saved, tmp_path)
    other = factory.qa_model(seed=11, dropout=0.1)  # the same configuration: config.json is written unchanged
    other.config.use_cache = False  # as the Trainer set it (args.use_cache) before the checkpoint was written
    other.save_pretrained(folder, max_shard_size="30KB")
    assert (folder / "model.safetensors.index.json").is_file()
    trainer = make_trainer(tmp_path / "out", factory, max_steps=7, save_strategy="no")
    with caplog.at_level(logging.WARNING, logger="hflight"):
        trainer.train(resume_from_checkpoint=str(folder))
    assert "does not list (model-00001-of-" in caplog.text
    assert "They are ignored: the weights are read from model.safetensors, as saved." in caplog.text


def test_weights_go_in_through_the_model_own_load_state_dict(saved, tmp_path, factory):
    """On resume and on best-model loading, after hflight's header checks, as transformers loads them."""
    from transformers import BertForQuestionAnswering

    calls = []

    class RemappingBertForQuestionAnswering(BertForQuestionAnswering):  # the name tells HF its labels
        def load_state_dict(self, state_dict, strict=True, assign=False):
            calls.append((len(state_dict), strict))
            state_dict = {k: (v + 1 if k == "qa_outputs.bias" else v) for k, v in state_dict.items()}
            return super().load_state_dict(state_dict, strict=strict, assign=assign)

    torch.manual_seed(0)
    model = RemappingBertForQuestionAnswering(factory.config(dropout=0.1))
    folder = copy_checkpoint(saved, tmp_path)
    saved_bias = load_file(folder / "model.safetensors")["qa_outputs.bias"]
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["RemappingBertForQuestionAnswering"]
    (folder / "config.json").write_text(json.dumps(config))
    refresh_manifest(folder)
    loaded = {}

    class AtStart(hflight.TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            loaded["bias"] = model.qa_outputs.bias.detach().clone()

    trainer = make_trainer(tmp_path / "out", factory, model=model, max_steps=7, save_strategy="no",
                           callbacks=[AtStart()])  # fmt: skip
    trainer.train(resume_from_checkpoint=str(folder))
    assert calls == [(len(model.state_dict()), False)]
    assert torch.equal(loaded["bias"], saved_bias + 1)

    calls.clear()
    best = make_trainer(tmp_path / "best", factory, model=model, max_steps=6, eval_strategy="steps", eval_steps=3,
                        load_best_model_at_end=True, metric_for_best_model="score")  # fmt: skip
    scores = iter([2.0, 1.0])
    best.compute_metrics = lambda prediction: {"score": next(scores)}
    best.train()
    assert calls == [(len(model.state_dict()), False)] and best.state.best_global_step == 3


@pytest.mark.parametrize("entry", [{"size": 7}, 7, {"size": 7, "xxh3_128": "not-hex"}])
def test_a_version_2_manifest_entry_without_its_checksum_is_refused(saved, tmp_path, entry):
    """From version 2 on, an entry without a valid checksum could only be accepted unchecked: it is refused, naming
    the file (a version-1 manifest, sizes only, is still read: the test above)."""
    folder = copy_checkpoint(saved, tmp_path)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    assert manifest["version"] == 2
    name = "trainer_state.json"
    size = (folder / name).stat().st_size
    manifest["files"][name] = entry if not isinstance(entry, dict) else {**entry, "size": size}
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=rf"version 2\) has no valid size and xxh3_128 checksum for {name}"):
        verify_checkpoint(folder)
    assert get_last_checkpoint(folder.parent) is None
