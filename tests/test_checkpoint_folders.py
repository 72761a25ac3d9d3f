"""Checkpoint folders are complete or absent: each file name spelled in one module, incomplete folders never picked,
a kill at any point of a save or a deletion leaving a complete checkpoint, stale temporary folders removed, and a
failed write (a full disk, any kind of write error) one error naming the folder, the file and the cause, with the
previous checkpoint intact.

The runs are in-process (tests/checkpoint_runs.py: a 32-wide BERT, dropout and a random sampler, so that an exact
resume needs the weights, optimizer, scheduler and RNG states)."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hflight import durable
from hflight.checkpoints import folders as checkpoint
from hflight.checkpoints import job, parts
from hflight.checkpoints.manifest import MANIFEST_NAME, get_last_checkpoint, verify_checkpoint
from hflight.checkpoints.writers import torch_file

from .checkpoint_runs import assert_same, digest, make_trainer


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
    """Also the ``checkpoint-N`` a save_async write made beside its unfinished ``.tmp-checkpoint-N`` (for what an
    override or a callback writes after the save; killed before the publication): not a checkpoint, it would count in
    the rotation. A ``checkpoint-N`` holding a checkpoint (a manifest, transformers' trainer_state.json) stays."""
    (tmp_path / ".tmp-checkpoint-4").mkdir(parents=True)
    (tmp_path / ".tmp-checkpoint-4" / "model.safetensors").write_bytes(b"partial")
    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / "checkpoint-4" / "entropy_ctrl_state.json").write_text("{}")
    (tmp_path / ".tmp-checkpoint-6.replaced").mkdir()
    (tmp_path / "checkpoint-6").mkdir()  # beside a folder replaced, not an unfinished save
    for step, name in ((8, MANIFEST_NAME), (10, "trainer_state.json")):
        (tmp_path / f".tmp-checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / name).write_text("{}")
    with caplog.at_level(logging.WARNING, logger="hflight.checkpoints.folders"):
        make_trainer(tmp_path, factory, max_steps=1, save_strategy="no").train()
    assert not list(tmp_path.glob(".tmp-*"))
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-6", "checkpoint-8"]
    assert ".tmp-checkpoint-4" in caplog.text and ".tmp-checkpoint-6.replaced" in caplog.text
    assert f"{tmp_path / 'checkpoint-4'}: made for a checkpoint whose write was interrupted" in caplog.text


# ==== issue 17: every promise under an adversarial sweep ============================================================
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
    """Replaces torch.save, or hflight's writer of the optimizer's file (``torch_file.save``: ``hasher`` is its third
    argument): fails on ``name`` the way the writer does, having started the file."""

    def __init__(self, name: str, error: Exception, real) -> None:
        self.name, self.error, self.real = name, error, real

    def __call__(self, obj, path, *args, **kwargs):
        if isinstance(path, (str, os.PathLike)) and os.path.basename(path) == self.name:
            Path(path).write_bytes(b"PK\x03\x04")
            raise self.error
        return self.real(obj, path, *args, **kwargs)


def _fail_writing(monkeypatch, name: str, error: Exception) -> None:
    """Writing ``name`` raises ``error``, whichever writer writes it (hflight's for the optimizer's file, torch.save
    for the small ones)."""
    monkeypatch.setattr(parts.torch, "save", _FailingWrite(name, error, torch.save))
    monkeypatch.setattr(torch_file, "save", _FailingWrite(name, error, torch_file.save))


@pytest.mark.parametrize(
    "name, error, free, cause",
    [
        ("optimizer.pt", OSError(errno.ENOSPC, "No space left on device"), 0, "no space left on device"),
        ("scheduler.pt", RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0"), 0,
         "no space left on device"),
        ("rng_state.pth", RuntimeError("basic_ios::clear: iostream error"), 0, "no space left on device"),
        ("rng_state.pth", PermissionError(13, "Permission denied"), 10**9, "permission denied"),
        ("optimizer.pt", OSError(5, "Input/output error"), 10**9, "input/output error"),
    ],
)  # fmt: skip
def test_each_kind_of_write_failure_is_named(saved, tmp_path, factory, monkeypatch, name, error, free, cause):
    out = tmp_path / "run"
    shutil.copytree(saved / "checkpoint-3", out / "checkpoint-3")
    before = digest(out / "checkpoint-3")
    _fail_writing(monkeypatch, name, error)
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
    _fail_writing(monkeypatch, "scheduler.pt", RuntimeError("a bug"))
    with pytest.raises(RuntimeError, match="^a bug$"):
        make_trainer(tmp_path, factory, stop_at=3).train()
