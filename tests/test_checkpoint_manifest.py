"""The checkpoint manifest and its verification: every file listed with its size and checksum, flipped bytes found
before a checkpoint (or the best one) is used, a manifest entry without its checksum refused, and only the regular
files inside the folder read: no named pipe opened, no file linked or named from outside it, the best checkpoint
taken from the run folder it is in.

The runs are in-process (tests/checkpoint_runs.py)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import hflight
from hflight.checkpoints.manifest import MANIFEST_NAME, get_last_checkpoint, verify_checkpoint

from .checkpoint_runs import ShardedBert, copy_checkpoint, make_trainer, params, refresh_manifest


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
    from hflight.checkpoints.writers.files import regular_file

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
