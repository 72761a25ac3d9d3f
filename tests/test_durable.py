"""Checkpoints that survive a power loss, and ``save_async``.

The file-system calls a run makes (every ``fsync``/``fdatasync`` with what it reached, every rename, every deletion,
the moment each public call returns) are recorded and replayed under the rules SQLite, LevelDB and etcd assume
(``tests/durability.py``): a file's bytes are durable only after an fsync that saw them as they are, a folder's entry
only after an fsync of the folder that listed it. The replay must find nothing in a real run, and must find something
when any single fsync of the run is removed from the record: every fsync is needed, none is missing.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import safetensors.torch
import torch
import transformers

import hflight
from hflight import durable
from hflight.checkpoints import asynchronous, folders, job
from hflight.checkpoints.manifest import Checksums, get_last_checkpoint, verify_checkpoint
from hflight.checkpoints.storage import local as storage_local
from hflight.checkpoints.writers import torch_file, writer_process

from .checkpoint_runs import make_trainer
from .durability import CHECKPOINT, Recorder, violations
from .support import torch_file_records


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
    fsyncs = [i for i, e in enumerate(events) if e["kind"] == "fsync"]
    publishes = [i for i, e in enumerate(events) if e["kind"] == "rename" and CHECKPOINT.match(Path(e["dst"]).name)]
    assert len(publishes) == 3 and len(fsyncs) > 3 * 8, (len(publishes), len(fsyncs))
    # the sequence of one checkpoint's save: its files, its folder, the rename, the parent, then the retirement
    second = publishes[1]
    before, after = events[second - 1], events[second + 1]
    assert (before["kind"], Path(before["path"]).name) == ("fsync", ".tmp-checkpoint-4"), events[second - 12 : second]
    assert (after["kind"], after["path"]) == ("fsync", out), after
    retired = next(i for i, e in enumerate(events) if e["kind"] == "rename" and e["src"].endswith("/checkpoint-2"))
    assert retired > second + 1 and all(e["kind"] != "fsync" for e in events[second + 2 : retired]), "the retirement"
    shown = [(e["kind"], e.get("path", e.get("dst"))) for e in events[publishes[0] + 3 : retired + 2]]
    print("one checkpoint's save:", *shown, sep="\n")
    for index in fsyncs:
        without = events[:index] + events[index + 1 :]
        assert violations(without, out), f"removing the fsync of {events[index]['path']} goes unnoticed"


def _fsync(path, sync="fsync"):
    fd = os.open(path, os.O_RDONLY)
    try:
        getattr(os, sync)(fd)  # looked up now: the recorder's
    finally:
        os.close(fd)


def _publish(run: Path, steps: str) -> None:
    """A checkpoint written and published by hand, in the order ``steps`` names (one letter each): m make the temporary
    folder, w write its file, a append to it, f fsync the file, F fdatasync it, d fsync the temporary folder, r rename
    it into place (os.replace), R rename it with Path.rename, p fsync the run folder, u delete the published file in
    place."""
    tmp, final = run / ".tmp-checkpoint-1", run / "checkpoint-1"
    actions = {
        "m": tmp.mkdir, "w": lambda: (tmp / "optimizer.pt").write_bytes(b"state" * 10),
        "a": lambda: (tmp / "optimizer.pt").open("ab").write(b"more"), "f": lambda: _fsync(tmp / "optimizer.pt"),
        "F": lambda: _fsync(tmp / "optimizer.pt", "fdatasync"), "d": lambda: _fsync(tmp),
        "r": lambda: os.replace(tmp, final), "R": lambda: tmp.rename(final), "p": lambda: _fsync(run),
        "u": lambda: os.unlink(final / "optimizer.pt"),
    }  # fmt: skip
    for step in steps:
        actions[step]()


@pytest.mark.parametrize(
    "steps, found",
    [
        ("mwfdrp", None),  # the rules followed
        ("mdwfrp", "published before the entry of"),  # the folder fsynced before its file was made
        ("mwfadrp", "optimizer.pt was fsynced as it is"),  # the file changed after its fsync
        ("mwfdRp", None),  # Path.rename (torch's distributed-checkpoint writer renames its .metadata so)
        ("mwfdR", "was not made durable at once"),  # ... and its folder not fsynced after it
        ("mwFdrp", None),  # fdatasync puts a file's bytes on disk too
        ("mwfdrpu", "a file of a published checkpoint, was deleted in place"),
    ],
)
def test_the_replay_is_strict_about_order_and_content(tmp_path, monkeypatch, steps, found):
    """Each rule of the replay on a checkpoint published by hand: a folder fsync counts for the entries it listed, a
    file fsync for the bytes it saw; renames, deletions and fdatasync are recorded whichever call makes them."""
    run = tmp_path / "run"
    recorder = Recorder(run)
    recorder.install(monkeypatch)
    run.mkdir()
    _fsync(tmp_path)
    _publish(run, steps)
    recorder.returned("the save")
    monkeypatch.undo()
    problems = violations(recorder.events, recorder.out)
    if found is None:
        assert problems == []
    else:
        assert any(found in p for p in problems), problems


def test_a_run_folder_made_again_at_the_same_path_gets_its_entry_fsynced_again(tmp_path, factory, monkeypatch):
    """A run folder deleted and made again in one process (a notebook's second run, overwrite_output_dir, a sweep's
    retry): its new entry in its parent is made durable by the new run's first publication too."""
    out = tmp_path / "run"
    make_trainer(out, factory, max_steps=2, save_steps=2).train()
    shutil.rmtree(out)
    trainer = make_trainer(out, factory, max_steps=2, save_steps=2)
    recorder = Recorder(out)
    recorder.install(monkeypatch)
    trainer.train()
    recorder.returned("train")
    monkeypatch.undo()
    assert violations(recorder.events, recorder.out) == []


@pytest.mark.parametrize(
    "save_async, max_steps, threads",
    [(False, 2, 1), (True, 2, 3), (True, 3, 1 + 2 + 3 + 1)],
    ids=["synchronous", "save_async-last-checkpoint", "save_async-one-before"],
)
def test_a_checkpoint_uses_the_threads_it_needs(tmp_path, factory, monkeypatch, save_async, max_steps, threads):
    """One thread that hashes and fsyncs each file as it is complete; with save_async, the one that writes in the
    background besides, and for the run's last checkpoint (the loop waits for it) one more, so that the model and
    the optimizer state are written side by side; where a checkpoint before the last copies the state, the one that
    makes its staging area after the first step and the helper that copies the optimizer's state beside the next
    step (once per run: the threads of a process's pools end with the run). The checksums' thread is started and
    stopped by one thread: the one that finishes the job. (The files of this tiny model are too small for DirectFile's
    helper thread.)"""
    started, checksums = [], []
    real_start, real_init, real_close = threading.Thread.start, Checksums.__init__, Checksums.close
    monkeypatch.setattr(threading.Thread, "start", lambda self: (started.append(self.name), real_start(self))[1])
    monkeypatch.setattr(Checksums, "__init__", lambda self: (checksums.append(("open", threading.get_ident())),
                                                             real_init(self))[1])  # fmt: skip
    monkeypatch.setattr(Checksums, "close", lambda self: (checksums.append(("close", threading.get_ident())),
                                                          real_close(self))[1])  # fmt: skip
    make_trainer(tmp_path / "run", factory, max_steps=max_steps, save_steps=2, save_async=save_async).train()
    assert len([name for name in started if name.startswith("hflight-")]) == threads, started
    # one checkpoint at the end (and one at step 2 before it): each opens and closes its checksums on one thread
    assert len(checksums) == 2 * (max_steps - 1), checksums
    assert all(opened[1] == closed[1] for opened, closed in zip(checksums[::2], checksums[1::2])), checksums


def test_the_replay_finds_what_transformers_trainer_leaves(tmp_path, factory, monkeypatch):
    """The same run and calls with transformers' Trainer: published nothing durable (the check can fail)."""
    from .support import Factory

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
        # training_args.bin holds output_dir, so does the manifest through its checksum; optimizer.pt is written in
        # the background by hflight.checkpoints.writers.torch_file: torch.save's records in another zip framing
        assert differ == ["checkpoint_manifest.json", "optimizer.pt", "training_args.bin"], differ
        assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
        records = [torch_file_records(folder / "optimizer.pt") for folder in (a, b)]
        assert list(records[0]) == list(records[1])  # the same records, each byte for byte but torch's random id
        assert [k for k in records[0] if records[0][k] != records[1][k]] == [".data/serialization_id"]


@pytest.fixture
def slow_writes(monkeypatch):
    """Each background file write takes ``delay[0]`` seconds longer; ``started`` is set when a write begins."""
    delay, started = [0.5], threading.Event()
    real = job.CheckpointJob.write_later

    def write_later(self, file, step):
        started.set()
        time.sleep(delay[0])
        real(self, file, step)

    monkeypatch.setattr(job.CheckpointJob, "write_later", write_later)
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

    trainer = make_trainer(out, factory, max_steps=7, save_steps=6, save_async=True, callbacks=[After(6, look)])
    trainer.train()
    assert seen == {"published at on_save": False}  # the loop went on while the write was pending
    assert verify_checkpoint(out / "checkpoint-6", full=True) is not None  # train() returned after it


def test_the_last_checkpoint_is_written_from_the_state_itself_before_training_ends(tmp_path, factory, monkeypatch):
    """Training ends after the last checkpoint, so the loop waits for it: its state is not copied first (only the
    checkpoint before it is), it is published when on_save comes, and it holds the final weights."""
    copied, seen, out = [], {}, tmp_path / "run"
    real = asynchronous.CheckpointWriter.snapshot

    def snapshot(self, name, state, **until):
        copied.append(trainer.state.global_step)
        return real(self, name, state, **until)

    def look():
        seen["published at on_save"] = (out / "checkpoint-4").exists()

    monkeypatch.setattr(asynchronous.CheckpointWriter, "snapshot", snapshot)
    trainer = make_trainer(out, factory, max_steps=4, save_steps=2, save_async=True, callbacks=[After(4, look)])
    trainer.train()
    assert copied and set(copied) == {2}
    assert seen == {"published at on_save": True}
    verify_checkpoint(out / "checkpoint-4", full=True)
    saved = safetensors.torch.load_file(out / "checkpoint-4" / "model.safetensors")
    assert saved.keys() and all(torch.equal(saved[k], v) for k, v in trainer.model.state_dict().items() if k in saved)


def test_a_checkpoint_waits_for_the_one_in_flight_and_says_so(tmp_path, factory, monkeypatch, caplog):
    """Each background write but the last (which the loop waits for) is held until the next checkpoint's save has
    begun, and goes on for longer than the wait that is reported: every checkpoint waits for the one before, whatever
    the speed of the machine and its disk. The last one's write is as slow, and the loop's wait for it is not reported
    (it was, as a slow disk, where that write took longer than the threshold)."""
    monkeypatch.setattr(asynchronous, "LONG_WAIT_S", 0.1)
    begun, changed = [], threading.Condition()
    real_save, real_write = folders.save_checkpoint, job.CheckpointJob.write_later

    def save_checkpoint(facade, run, trial=None):
        with changed:
            begun.append(facade.state.global_step)
            changed.notify_all()
        return real_save(facade, run, trial)

    def write_later(self, file, step):
        mine = int(self.final_dir.rsplit("-", 1)[1])
        if not self.last:
            with changed:
                assert changed.wait_for(lambda: any(each > mine for each in begun), timeout=60)
        time.sleep(0.3)  # the last too: the loop's wait for its own last checkpoint is by design, never reported
        real_write(self, file, step)

    monkeypatch.setattr(folders, "save_checkpoint", save_checkpoint)
    monkeypatch.setattr(job.CheckpointJob, "write_later", write_later)
    out = tmp_path / "run"
    trainer = make_trainer(out, factory, max_steps=4, save_steps=1, save_async=True, save_total_limit=2)
    with caplog.at_level(logging.INFO, logger="hflight.checkpoints.asynchronous"):
        trainer.train()
    waits = [r for r in caplog.records if "waited" in r.getMessage() and "background write of" in r.getMessage()]
    assert [re.search(r"checkpoint-\d+", each.getMessage()).group() for each in waits] == [
        f"checkpoint-{n}" for n in (1, 2, 3)
    ]
    # said once as a warning, with the numbers; the later waits at info level
    assert [each.levelno for each in waits] == [logging.WARNING, logging.INFO, logging.INFO]
    warning = waits[0].getMessage()
    assert "Checkpoints come faster than the disk writes them" in warning
    assert "raise save_steps, or write output_dir to a faster disk" in warning
    found = re.search(r"write of checkpoint-1 \((\d+) bytes\) took (\S+) s, and the next checkpoint came (\S+) s "
                      r"after it began, so the training loop waited (\S+) s", warning)  # fmt: skip
    assert found, warning
    nbytes, took, came, waited = int(found[1]), *map(float, found.group(2, 3, 4))
    weights = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    assert 3 * weights <= nbytes < 4 * weights  # the weights and AdamW's two moments
    assert took >= 0.3 and waited > 0 and abs(took - came - waited) < 0.02
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
    """The writer thread's own write (where no writer process runs; a failure in the process is
    tests/test_writer_process.py's)."""
    monkeypatch.setattr(writer_process, "available", lambda: False)
    real = torch_file.save  # the background writer's torch.save

    def full_disk(obj, path, *args, **kwargs):
        if "checkpoint-4" in str(path) and threading.current_thread() is not threading.main_thread():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch_file, "save", full_disk)
    out = tmp_path / "run"
    trainer = make_trainer(out, factory, max_steps=8, save_steps=2, save_async=True, save_total_limit=1)
    with pytest.raises(folders.CheckpointWriteError, match=r"checkpoint-4.*optimizer\.pt failed: no space left"):
        trainer.train()
    assert trainer.state.global_step < 8, "the run stopped"
    assert get_last_checkpoint(out) == str(out / "checkpoint-2")
    assert not (out / ".tmp-checkpoint-4").exists()


def test_a_failed_write_of_the_last_checkpoint_raises_once_its_side_by_side_writes_are_over(
    tmp_path, factory, monkeypatch
):
    """The run's last checkpoint writes the optimizer state and the model side by side: the optimizer's failure is
    raised, naming its file, after the model's write beside it is over (the unfinished folder removed only then)."""
    real_save, real_model_save = torch_file.save, hflight.Trainer._save
    model_writes = []

    def full_disk(obj, path, *args, **kwargs):
        if "checkpoint-8" in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_save(obj, path, *args, **kwargs)

    def model_save(self, output_dir=None, state_dict=None):
        real_model_save(self, output_dir, state_dict=state_dict)
        time.sleep(0.3)  # a slow model write: the optimizer's has failed by now
        model_writes.append((output_dir, os.path.isdir(output_dir)))  # its folder still there when it is done

    monkeypatch.setattr(torch_file, "save", full_disk)
    monkeypatch.setattr(hflight.Trainer, "_save", model_save)
    out = tmp_path / "run"
    trainer = make_trainer(out, factory, max_steps=8, save_steps=2, save_async=True, save_total_limit=1)
    with pytest.raises(folders.CheckpointWriteError, match=r"checkpoint-8.*optimizer\.pt failed: no space left"):
        trainer.train()
    assert model_writes[-1] == (str(out / ".tmp-checkpoint-8"), True)
    assert get_last_checkpoint(out) == str(out / "checkpoint-6")
    assert not (out / ".tmp-checkpoint-8").exists()


def test_save_model_from_a_callback_during_a_background_write_leaves_accelerate_and_the_model_alone(
    tmp_path, factory, monkeypatch
):
    """A callback's save_model while the background thread writes the checkpoint's model: accelerate's module (whose
    unwrapping would import DeepSpeed, installed but not imported here) and the live model are as they were once
    training is over, and the writer thread changed neither (the two saves are made to overlap: the background one
    starts first, the callback's ends last)."""
    import accelerate.utils.other as unwrapping

    monkeypatch.delitem(sys.modules, "deepspeed", raising=False)
    original = unwrapping.is_deepspeed_available
    model = factory.qa_model(seed=0, dropout=0.1)
    real, seen = model.save_pretrained, []
    writer_in, loop_in = threading.Event(), threading.Event()

    def save_pretrained(*args, **kwargs):
        background = threading.current_thread() is not threading.main_thread()
        seen.append((background, "should_save_on_this_rank" in vars(model)))
        (writer_in if background else loop_in).set()
        (loop_in if background else writer_in).wait(10)
        if not background:  # the callback's save ends after the background one
            mine, deadline = unwrapping.is_deepspeed_available, time.monotonic() + 10
            while unwrapping.is_deepspeed_available is mine and _writing() and time.monotonic() < deadline:
                time.sleep(0.01)
        return real(*args, **kwargs)

    model.save_pretrained = save_pretrained
    exported = tmp_path / "exported"
    export = After(2, lambda: (writer_in.wait(10), trainer.save_model(str(exported))))  # during the background write
    trainer = make_trainer(tmp_path / "run", factory, model=model, max_steps=2, save_steps=2, save_async=True,
                           callbacks=[export])  # fmt: skip
    trainer.train()
    assert unwrapping.is_deepspeed_available is original
    assert sorted(seen) == [(False, False), (True, False)], seen  # no attribute set on the live model either
    assert (exported / "model.safetensors").is_file()
    assert verify_checkpoint(tmp_path / "run" / "checkpoint-2", full=True) is not None


def _writing() -> bool:
    return any(t.name.startswith("hflight-write") and t.is_alive() for t in threading.enumerate())


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
    assert again["a"].untyped_storage().data_ptr() == snapshot["a"].untyped_storage().data_ptr(), "buffers reused"
    assert writer.snapshot_bytes == 12


class WritesIntoTheCheckpoint(transformers.TrainerCallback):
    """Writes a file of its own into ``checkpoint-N`` at ``on_save`` (as PEFT's and other save callbacks do)."""

    def __init__(self, text):
        self.text = text

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        folder.mkdir(exist_ok=True)
        (folder / "extra.txt").write_text(f"{self.text} {state.global_step}")


@pytest.mark.parametrize("save_async", [False, True], ids=["synchronous", "save_async"])
def test_what_on_save_writes_into_the_checkpoint_stays_in_it(tmp_path, factory, slow_writes, save_async):
    """Files a callback writes into ``checkpoint-N`` at on_save are in every checkpoint, in both write modes (with
    save_async, on_save comes before the background publication, which takes them into the folder it publishes), also
    where the checkpoint replaces a folder of the same name (a second run into the same output folder)."""
    out = tmp_path / "run"
    for text in ("first", "second"):
        trainer = make_trainer(out, factory, max_steps=6, save_steps=2, save_async=save_async,
                               callbacks=[WritesIntoTheCheckpoint(text)])  # fmt: skip
        trainer.train()
        for step in (2, 4, 6):
            assert (out / f"checkpoint-{step}" / "extra.txt").read_text() == f"{text} {step}", (text, step)
            assert verify_checkpoint(out / f"checkpoint-{step}", full=True) is not None
    assert not list(out.glob(".tmp-*"))


def test_a_snapshot_keeps_keys_that_print_alike_apart():
    """A dict with the keys ``1`` and ``"1"`` holds two tensors: two buffers."""
    writer = asynchronous.CheckpointWriter(asynchronous=True)
    snapshot = writer.snapshot("optimizer", {"state": {1: torch.ones(2), "1": torch.zeros(2)}})
    assert torch.equal(snapshot["state"][1], torch.ones(2)) and torch.equal(snapshot["state"]["1"], torch.zeros(2))
    assert writer.snapshot_bytes == 16


@pytest.mark.parametrize("save_async", [False, True], ids=["synchronous", "save_async"])
def test_a_failed_rotation_is_logged_and_the_run_goes_on(tmp_path, factory, monkeypatch, caplog, save_async):
    """Removing an older checkpoint fails after the new one is published: the new one is whole, the old one is left,
    the failure is logged and training goes on (transformers' rotation ignores such failures too)."""

    def refused(folder):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(folder))

    monkeypatch.setattr(storage_local, "remove_checkpoint", refused)  # the local storage removes checkpoints
    out = tmp_path / "run"
    trainer = make_trainer(out, factory, max_steps=6, save_steps=2, save_async=save_async, save_total_limit=1)
    with caplog.at_level(logging.WARNING, logger="hflight.checkpoints.job"):
        trainer.train()
    assert trainer.state.global_step == 6
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert all(verify_checkpoint(out / f"checkpoint-{n}", full=True) is not None for n in (2, 4, 6))
    warnings = [
        r.getMessage() for r in caplog.records if "removing older checkpoints after it failed" in r.getMessage()
    ]
    assert len(warnings) == 2 and "Permission denied" in warnings[0], warnings


def test_a_background_failure_that_is_not_a_write_failure_leaves_no_unfinished_folder(tmp_path, factory, monkeypatch):
    monkeypatch.setattr(writer_process, "available", lambda: False)  # a failure of the writer thread's own code
    real = torch_file.save

    def bug(obj, path, *args, **kwargs):
        if "checkpoint-4" in str(path):
            raise ValueError("a bug in the writer")
        return real(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch_file, "save", bug)
    out = tmp_path / "run"
    trainer = make_trainer(out, factory, max_steps=8, save_steps=2, save_async=True)
    with pytest.raises(ValueError, match="a bug in the writer"):
        trainer.train()
    assert get_last_checkpoint(out) == str(out / "checkpoint-2")
    assert not list(out.glob(".tmp-*"))


def test_a_file_system_that_opens_with_o_direct_and_refuses_its_writes_gets_whole_checkpoints(
    tmp_path, factory, monkeypatch
):
    """Every O_DIRECT write refused (EINVAL, as some FUSE and network file systems do after taking the open): the
    background writer's files go through the page cache, their lengths exact, so the checkpoints verify and resume."""
    import fcntl

    real, refused = os.pwrite, []

    def pwrite(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    out = tmp_path / "run"
    make_trainer(out, factory, max_steps=4, save_steps=2, save_async=True).train()
    assert refused, "the writer tried O_DIRECT"
    for step in (2, 4):
        verify_checkpoint(out / f"checkpoint-{step}", full=True)
    resumed = make_trainer(out, factory, max_steps=4, save_steps=2)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert resumed.state.global_step == 4
