"""Checkpoints that survive a power loss, and ``save_async``.

The file-system calls a run makes (every ``fsync`` with the file it reached and that file's size and time, every
rename, every deletion, the moment each public call returns) are recorded and replayed under the rules SQLite,
LevelDB and etcd assume: a file's bytes are durable only after an fsync of it, a directory entry only after an fsync
of the directory. The replay (:func:`violations`) must find nothing in a real run, and must find something when any
single fsync of the run is removed from the record: every fsync is needed, none is missing.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import signal
import stat
import threading
import time
from pathlib import Path

import pytest
import torch
import transformers

import hflight
from hflight import durable
from hflight.checkpoints import asynchronous, folders
from hflight.checkpoints.manifest import get_last_checkpoint, verify_checkpoint

from .test_checkpoint import make_trainer

CHECKPOINT = re.compile(r"^checkpoint-\d+$")


# ---- recording ------------------------------------------------------------------------------------------------------
class Recorder:
    """Records fsync/rename/delete calls (from any thread) and the public calls' returns."""

    def __init__(self, out: Path) -> None:
        self.out = str(out)
        self.events: list[tuple] = []
        self.lock = threading.Lock()

    def add(self, *event) -> None:
        with self.lock:
            self.events.append(event)

    def install(self, monkeypatch) -> None:
        real_fsync, real_replace, real_rmtree = os.fsync, os.replace, shutil.rmtree

        def fsync(fd):
            info = os.fstat(fd)
            path = os.readlink(f"/proc/self/fd/{fd}")
            kind = "dir" if stat.S_ISDIR(info.st_mode) else "file"
            real_fsync(fd)
            self.add("fsync", kind, path, (info.st_size, info.st_mtime_ns))

        def replace(src, dst, *args, **kwargs):
            listing = _listing(src) if os.path.isdir(src) else None
            real_replace(src, dst, *args, **kwargs)
            self.add("replace", os.path.abspath(src), os.path.abspath(dst), listing)

        def rmtree(path, *args, **kwargs):
            self.add("rmtree", os.path.abspath(path))
            return real_rmtree(path, *args, **kwargs)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(shutil, "rmtree", rmtree)

    def returned(self, name: str) -> None:
        """A public call returned: what it wrote must be on disk now."""
        inside = {}
        for folder in sorted(Path(self.out).glob("checkpoint-*")):
            inside.update(durable.stamps(folder) or {})
        self.add("returned", name, durable.stamps(self.out) or {}, inside)


def _listing(folder: str) -> dict[str, list[str]]:
    """folder -> its regular files and sub-folders (absolute paths)."""
    found = {}
    for root, dirs, files in os.walk(folder):
        found[os.path.abspath(root)] = [os.path.join(os.path.abspath(root), n) for n in (*files, *dirs)]
    return found


# ---- the replay ----------------------------------------------------------------------------------------------------
def violations(events: list[tuple], out: str) -> list[str]:
    """What a power loss at some point of ``events`` could lose that the rules say must survive:

    a. a checkpoint folder renamed into place before each of its files and folders was fsynced;
    b. a checkpoint's rename into place not followed at once by an fsync of its folder; an older checkpoint retired
       (renamed aside or deleted), or a public call returned, while the rename of a newer one was not durable;
    c. a public call returned while a file of a checkpoint, or a file it left directly in the run folder, was not
       fsynced since it last changed; or while a file new since the previous return was not made durable by an fsync
       of the run folder (and the run folder's own entry by an fsync of its parent).
    """
    out = os.path.abspath(out)
    problems: list[str] = []
    synced_files: dict[str, set] = {}  # path -> stamps fsynced
    synced_dirs: dict[str, int] = {}  # path -> index of the last fsync
    published: list[tuple[int, str]] = []  # renames into checkpoint-N not yet followed by a parent fsync
    previous: dict[str, tuple] = {}
    first_file_sync: dict[str, int] = {}
    for index, event in enumerate(events):
        kind = event[0]
        if kind == "fsync":
            _, what, path, stamp = event
            if what == "file":
                synced_files.setdefault(path, set()).add(stamp)
                first_file_sync.setdefault(path, index)
            else:
                synced_dirs[path] = index
                published = [(i, p) for i, p in published if not (os.path.dirname(p) == path and i < index)]
        elif kind == "replace":
            _, src, dst, listing = event
            if CHECKPOINT.match(os.path.basename(dst)) and listing is not None:
                for folder, entries in listing.items():
                    for entry in entries:
                        if entry not in listing and not synced_files.get(entry):  # a file (folders: the keys)
                            problems.append(f"{dst} published before {entry} was fsynced")
                    if folder not in synced_dirs:
                        problems.append(f"{dst} published before its folder {folder} was fsynced")
                published.append((index, dst))
                following = events[index + 1] if index + 1 < len(events) else None
                if following is None or following[:3] != ("fsync", "dir", os.path.dirname(dst)):
                    problems.append(f"the rename to {dst} was not made durable at once (fsync of its folder)")
            elif CHECKPOINT.match(os.path.basename(src)):
                problems += [f"{src} retired while the rename to {p} was not durable" for _, p in published]
        elif kind == "rmtree":
            if CHECKPOINT.match(os.path.basename(event[1])) or event[1].endswith(".replaced"):
                problems += [f"{event[1]} deleted while the rename to {p} was not durable" for _, p in published]
        elif kind == "returned":
            _, name, files, checkpoint_files = event
            problems += [f"{name} returned while the rename to {p} was not durable" for _, p in published]
            for path, stamp in checkpoint_files.items():  # fsynced where it was written: in place or before the rename
                where = {path, re.sub(r"/(checkpoint-\d+)/", r"/.tmp-\1/", path)}
                if not any(stamp in synced_files.get(p, set()) for p in where):
                    problems.append(f"{name} returned with {path} not fsynced")
            for path, stamp in files.items():
                if stamp not in synced_files.get(path, set()):
                    problems.append(f"{name} returned with {os.path.basename(path)} not fsynced since it changed")
                if path not in previous:
                    last_dir_sync = synced_dirs.get(out, -1)
                    if last_dir_sync < first_file_sync.get(path, index):
                        problems.append(f"{name} returned before the entry of new {os.path.basename(path)} was durable")
            if not previous and files and os.path.dirname(out) not in synced_dirs:
                problems.append(f"{name} returned before the run folder's own entry was durable")
            previous = dict(files)
    return problems


def _run_recorded(tmp_path, factory, monkeypatch, **overrides) -> tuple[Recorder, hflight.Trainer]:
    out = tmp_path / "run"
    recorder = Recorder(out)
    trainer = make_trainer(out, factory, max_steps=6, save_steps=2, save_total_limit=1, **overrides)
    recorder.install(monkeypatch)
    result = trainer.train()
    recorder.returned("train")
    trainer.save_model()
    recorder.returned("save_model")
    trainer.save_metrics("train", result.metrics)
    recorder.returned("save_metrics")
    trainer.save_state()
    recorder.returned("save_state")
    monkeypatch.undo()
    return recorder, trainer


@pytest.mark.parametrize("save_async", [False, True], ids=["synchronous", "save_async"])
def test_every_fsync_of_a_run_is_needed_and_none_is_missing(tmp_path, factory, monkeypatch, save_async):
    recorder, _ = _run_recorded(tmp_path, factory, monkeypatch, save_async=save_async)
    events, out = recorder.events, recorder.out
    assert violations(events, out) == []
    fsyncs = [i for i, e in enumerate(events) if e[0] == "fsync"]
    publishes = [e for e in events if e[0] == "replace" and CHECKPOINT.match(os.path.basename(e[2]))]
    assert len(publishes) == 3 and len(fsyncs) > 3 * 8, (len(publishes), len(fsyncs))
    # the sequence of one checkpoint's save: its files, its folder, the rename, the parent, then the retirement
    names = [Path(e[2]).name if e[0] == "fsync" else e[0] for e in events]
    second = names.index("replace", names.index("replace") + 1)
    assert names[second - 1] == ".tmp-checkpoint-4" and names[second + 1] == "run", names[second - 12 : second + 3]
    retired = next(i for i, e in enumerate(events) if e[0] == "replace" and e[1].endswith("/checkpoint-2"))
    assert retired > second + 1 and all(e[0] != "fsync" for e in events[second + 2 : retired]), "the retirement"
    print("one checkpoint's save:", *(e[:3] for e in events[names.index("replace") + 3 : retired + 2]), sep="\n")
    for index in fsyncs:
        without = events[:index] + events[index + 1 :]
        assert violations(without, out), f"removing fsync {events[index][1:3]} goes unnoticed"


def test_the_replay_finds_what_transformers_trainer_leaves(tmp_path, factory, monkeypatch):
    """The same run and calls with transformers' Trainer: published nothing durable (the check can fail)."""
    from .conftest import Factory

    out = tmp_path / "hf"
    recorder = Recorder(out)
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=4, max_steps=4, save_steps=2, save_total_limit=1,
        report_to="none", disable_tqdm=True, use_cpu=True,
    )  # fmt: skip
    trainer = transformers.Trainer(Factory.qa_model(seed=0), args, train_dataset=Factory.qa_dataset(16))
    recorder.install(monkeypatch)
    trainer.train()
    recorder.returned("train")
    trainer.save_model()
    recorder.returned("save_model")
    monkeypatch.undo()
    found = violations(recorder.events, recorder.out)
    assert any("train returned with" in p and "checkpoint-4/optimizer.pt not fsynced" in p for p in found), found
    assert any("save_model returned with model.safetensors not fsynced" in p for p in found), found


def test_generated_files_are_renamed_into_place_durably(tmp_path, monkeypatch):
    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd))[1])  # fmt: skip
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append(("replace", str(a), str(b))), real_replace(a, b))[1])
    from hflight.qa import made

    made.write_record(tmp_path, {"n": 1})
    monkeypatch.undo()
    (tmp,) = [c[1] for c in calls if c[0] == "replace"]
    assert calls == [("fsync", tmp), ("replace", tmp, str(tmp_path / made.RECORD_NAME)), ("fsync", str(tmp_path))]


# ---- faults ----------------------------------------------------------------------------------------------------------
def _failing_fsync(monkeypatch, fails, code):
    real = os.fsync

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if fails(path, os.path.isdir(path)):
            raise OSError(code, os.strerror(code))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
def test_a_failing_fsync_fails_the_save_loudly_and_keeps_the_previous_checkpoint(tmp_path, factory, monkeypatch, code):
    out = tmp_path / "run"
    trainer = make_trainer(out, factory, max_steps=4, save_steps=2, save_total_limit=1)
    _failing_fsync(monkeypatch, lambda path, is_dir: "checkpoint-4" in path and path.endswith("optimizer.pt"), code)
    with pytest.raises(folders.CheckpointWriteError) as raised:
        trainer.train()
    monkeypatch.undo()
    assert f"writing optimizer.pt failed: {os.strerror(code).lower()}" in str(raised.value)
    assert get_last_checkpoint(out) == str(out / "checkpoint-2")
    assert verify_checkpoint(out / "checkpoint-2", full=True) is not None
    assert not (out / ".tmp-checkpoint-4").exists()


def test_a_filesystem_without_folder_fsync_is_named_once_and_the_save_goes_on(tmp_path, factory, monkeypatch, caplog):
    out = tmp_path / "run"
    trainer = make_trainer(out, factory, max_steps=6, save_steps=2)
    _failing_fsync(monkeypatch, lambda path, is_dir: is_dir, errno.EINVAL)
    monkeypatch.setattr(durable, "_warned_filesystems", set())
    with caplog.at_level(logging.WARNING, logger="hflight.durable"):
        trainer.train()
    monkeypatch.undo()
    warnings = [r.getMessage() for r in caplog.records if r.name == "hflight.durable"]
    assert len(warnings) == 1 and "cannot fsync a folder (Invalid argument)" in warnings[0], warnings
    assert get_last_checkpoint(out) == str(out / "checkpoint-6")


# ---- save_async ------------------------------------------------------------------------------------------------------
def test_save_async_writes_the_synchronous_checkpoint_byte_for_byte(tmp_path, factory):
    folders_written = {}
    for save_async in (False, True):
        out = tmp_path / f"async-{save_async}"
        make_trainer(out, factory, save_async=save_async, save_total_limit=2).train()
        folders_written[save_async] = out
    for name in ("checkpoint-9", "checkpoint-12"):
        a, b = (folders_written[flag] / name for flag in (False, True))
        differ = [p.name for p in sorted(a.iterdir()) if p.read_bytes() != (b / p.name).read_bytes()]
        # training_args.bin holds output_dir, so does the manifest through its checksum
        assert differ == ["checkpoint_manifest.json", "training_args.bin"], differ
        assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())


@pytest.fixture
def slow_writes(monkeypatch):
    """Each background file write takes ``delay[0]`` seconds longer; ``started`` is set when a write begins."""
    delay, started = [0.5], threading.Event()
    real = asynchronous.Deferred.run

    def run(self, tracker):
        started.set()
        time.sleep(delay[0])
        real(self, tracker)

    monkeypatch.setattr(asynchronous.Deferred, "run", run)
    return delay, started


class After(transformers.TrainerCallback):
    def __init__(self, step, action):
        self.step, self.action = step, action

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.action()


def test_save_async_does_not_block_and_train_waits_for_the_last_write(tmp_path, factory, slow_writes):
    out = tmp_path / "run"
    seen = {}

    def look():
        seen["published at on_save"] = (out / "checkpoint-6").exists()

    trainer = make_trainer(out, factory, max_steps=6, save_steps=6, save_async=True, callbacks=[After(6, look)])
    trainer.train()
    assert seen == {"published at on_save": False}  # the loop went on while the write was pending
    assert verify_checkpoint(out / "checkpoint-6", full=True) is not None  # train() returned after it


def test_a_checkpoint_waits_for_the_one_in_flight_and_says_so(tmp_path, factory, slow_writes, monkeypatch, caplog):
    monkeypatch.setattr(asynchronous, "LONG_WAIT_S", 0.1)
    out = tmp_path / "run"
    trainer = make_trainer(out, factory, max_steps=4, save_steps=1, save_async=True, save_total_limit=2)
    with caplog.at_level(logging.WARNING, logger="hflight.checkpoints.asynchronous"):
        trainer.train()
    waits = [r.getMessage() for r in caplog.records if "Waiting for the background write" in r.getMessage()]
    assert waits and "checkpoint-1" in waits[0], waits
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]


def test_an_exception_waits_for_the_write_in_flight_and_publishes_it_whole(tmp_path, factory, slow_writes):
    def fail():
        raise RuntimeError("a bug in a callback")

    out = tmp_path / "run"
    trainer = make_trainer(out, factory, max_steps=8, save_steps=4, save_async=True, callbacks=[After(4, fail)])
    with pytest.raises(RuntimeError, match="a bug in a callback"):
        trainer.train()
    assert verify_checkpoint(out / "checkpoint-4", full=True) is not None
    assert not list(out.glob(".tmp-*"))


def test_sigterm_waits_for_the_write_in_flight_and_reports_a_published_checkpoint(tmp_path, factory, slow_writes):
    out = tmp_path / "run"
    trainer = make_trainer(out, factory, max_steps=8, save_steps=4, save_async=True,
                           callbacks=[After(4, lambda: os.kill(os.getpid(), signal.SIGTERM))])  # fmt: skip
    with pytest.raises(BaseException, match="checkpoint saved in") as stopped:
        trainer.train()
    folder = re.search(r"checkpoint saved in (\S+?)[.;]? ", str(stopped.value)).group(1)
    assert Path(folder).name in ("checkpoint-4", "checkpoint-5")
    assert verify_checkpoint(folder, full=True) is not None


def test_a_failed_background_write_stops_the_run_and_keeps_the_previous_checkpoint(tmp_path, factory, monkeypatch):
    real = torch.save

    def full_disk(obj, path, *args, **kwargs):
        if "checkpoint-4" in str(path) and threading.current_thread() is not threading.main_thread():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    out = tmp_path / "run"
    trainer = make_trainer(out, factory, max_steps=8, save_steps=2, save_async=True, save_total_limit=1)
    with pytest.raises(folders.CheckpointWriteError, match=r"checkpoint-4.*optimizer\.pt failed: no space left"):
        trainer.train()
    assert trainer.state.global_step < 8, "the run stopped"
    assert get_last_checkpoint(out) == str(out / "checkpoint-2")
    assert not (out / ".tmp-checkpoint-4").exists()


@pytest.mark.parametrize(
    "settings, named",
    [
        (dict(deepspeed={"zero_optimization": {"stage": 2}}), "deepspeed"),
        (dict(fsdp="full_shard", fsdp_config={"state_dict_type": "SHARDED_STATE_DICT"}), "SHARDED_STATE_DICT"),
        (dict(save_on_each_node=True, num_nodes=2), "save_on_each_node"),
    ],
)
def test_save_async_refuses_checkpoints_it_cannot_write_in_the_background(tmp_path, settings, named):
    if "deepspeed" in settings:
        pytest.importorskip("deepspeed")
    with pytest.raises(ValueError, match=f"save_async=True cannot be combined with .*{named}"):
        hflight.TrainingArguments(output_dir=str(tmp_path), save_async=True, **settings)


def test_a_snapshot_is_a_copy_taken_at_the_step_boundary():
    writer = asynchronous.CheckpointWriter(asynchronous=True)
    weight = torch.ones(3)
    state = {"a": weight, "tied": weight, "groups": [{"lr": 0.1, "params": [0]}]}
    snapshot = writer.snapshot("model", state)
    weight.add_(1)  # the next step
    assert torch.equal(snapshot["a"], torch.ones(3)) and snapshot["tied"] is snapshot["a"]
    assert snapshot["groups"] == state["groups"] and snapshot["groups"] is not state["groups"]
    again = writer.snapshot("model", state)
    assert again["a"] is snapshot["a"], "the buffers are reused"
    assert writer.snapshot_bytes == 12
