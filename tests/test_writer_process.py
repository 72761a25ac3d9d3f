"""hflight.checkpoints.writers.writer_process: save_async's large files (optimizer.pt, model.safetensors) written by a
child process from shared memory, off the training process's interpreter lock (issue 56, item 4): the same files as a
synchronous save's, a write error in the child failing the checkpoint naming its file, a child that dies replaced
without losing the checkpoint, a child in a session of its own that ends with the training process."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import transformers

import hflight
from hflight.checkpoints import asynchronous, folders, job
from hflight.checkpoints.manifest import get_last_checkpoint, verify_checkpoint
from hflight.checkpoints.writers import writer_process

from .checkpoint_runs import make_trainer
from .support import torch_file_records

pytestmark = pytest.mark.skipif(not writer_process.available(), reason="needs memfd_create (Linux)")


@pytest.fixture(autouse=True)
def any_state(monkeypatch):
    """The writer process takes the tests' tiny states and short runs too (it waits for 64 MiB of tensors and 8
    checkpoints to come), from the first file on (a run's files are the thread's until the child has answered: its
    start holds no checkpoint up)."""
    monkeypatch.setattr(asynchronous, "PROCESS_MIN_BYTES", 0)
    monkeypatch.setattr(asynchronous, "PROCESS_MIN_CHECKPOINTS", 0)
    real = writer_process.WriterProcess._ready
    monkeypatch.setattr(writer_process.WriterProcess, "_ready", lambda self, wait=True: real(self, wait))


@pytest.fixture
def children(monkeypatch):
    """The writer processes the runs start, and what each of their requests answered, by file name."""
    started, answers = [], []
    real_spawn, real_request = writer_process.WriterProcess._spawn, writer_process.WriterProcess._request

    def spawn(self):
        before = self._process
        real_spawn(self)
        if self._process is not before and self._process is not None:
            started.append(self._process)

    def request(self, payload, message):
        answer = real_request(self, payload, message)
        path = message(None)[1]
        answers.append((os.path.basename(os.path.dirname(path)), os.path.basename(path), answer))
        return answer

    monkeypatch.setattr(writer_process.WriterProcess, "_spawn", spawn)
    monkeypatch.setattr(writer_process.WriterProcess, "_request", request)
    return started, answers


def test_the_large_files_are_the_child_s_and_equal_a_synchronous_save_s(tmp_path, factory, children):
    started, answers = children
    background = make_trainer(tmp_path / "async", factory, max_steps=8, save_steps=2, save_async=True)
    background.train()
    make_trainer(tmp_path / "sync", factory, max_steps=8, save_steps=2).train()
    # checkpoint 2 copied into the process's own memory (the shared area is allocated after it, the child started
    # after its write): the thread's; 4 and 6 from the shared area, by the child; 8, the last, from the state itself
    written = {(folder, name) for folder, name, digest in answers if digest}
    assert written == {(f".tmp-checkpoint-{n}", name) for n in (4, 6) for name in ("optimizer.pt", "model.safetensors")}
    for step in (2, 4, 6, 8):
        ours, theirs = tmp_path / "async" / f"checkpoint-{step}", tmp_path / "sync" / f"checkpoint-{step}"
        verify_checkpoint(ours, full=True)  # the child's checksums are the files'
        assert (ours / "model.safetensors").read_bytes() == (theirs / "model.safetensors").read_bytes()
        records = [torch_file_records(folder / "optimizer.pt") for folder in (ours, theirs)]
        assert [name for name in records[0] if records[0][name] != records[1].get(name)] == [".data/serialization_id"]
    (child,) = started
    assert child.poll() is not None, "the child ends with the run's fit"


def test_a_write_error_in_the_child_fails_the_checkpoint_naming_its_file(tmp_path, factory, children, monkeypatch):
    """The child cannot create optimizer.pt (a folder is in its place): its error comes back with its errno."""
    real = job.CheckpointJob.write_later

    def in_the_way(self, file, step):
        if file == "optimizer.pt" and self.folder.endswith(".tmp-checkpoint-4"):
            os.mkdir(os.path.join(self.folder, file))
        return real(self, file, step)

    monkeypatch.setattr(job.CheckpointJob, "write_later", in_the_way)
    out = tmp_path / "run"
    trainer = make_trainer(out, factory, max_steps=8, save_steps=2, save_async=True, save_total_limit=1)
    with pytest.raises(folders.CheckpointWriteError) as raised:
        trainer.train()
    assert str(raised.value).startswith(
        f"Could not save checkpoint {out / 'checkpoint-4'}: writing optimizer.pt failed: is a directory."
    )
    assert get_last_checkpoint(out) == str(out / "checkpoint-2")
    assert not list(out.glob(".tmp-*"))


def test_a_child_that_dies_mid_write_is_replaced_and_the_checkpoint_kept(
    tmp_path, factory, children, monkeypatch, caplog
):
    """The child is killed while it holds checkpoint-4's optimizer.pt (stopped before the request reaches it, so that
    it cannot answer first): the thread writes that file, and the next file starts a new child."""
    started, _ = children
    real_send = writer_process._send

    def send(sock, message, fds=None):
        killing = message[0] == "torch" and ".tmp-checkpoint-4" in message[1] and len(started) == 1
        if killing:
            os.kill(started[0].pid, signal.SIGSTOP)
        real_send(sock, message, fds)
        if killing:
            os.kill(started[0].pid, signal.SIGKILL)

    monkeypatch.setattr(writer_process, "_send", send)
    out = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger=job.__name__):
        make_trainer(out, factory, max_steps=8, save_steps=2, save_async=True).train()
    assert "The checkpoint writer process ended while it wrote" in caplog.text
    assert "optimizer.pt" in caplog.text and "the background writer thread writes it again" in caplog.text
    assert len(started) == 2, "the next file started a new child"
    for step in (2, 4, 6, 8):
        verify_checkpoint(out / f"checkpoint-{step}", full=True)


@pytest.mark.parametrize("started", ["by the main thread", "off the main thread", "as a replacement"])
def test_the_child_has_a_session_of_its_own_and_ends_with_its_training_process(tmp_path, started):
    """Signals to the training job's process group are the training process's; a killed training process takes its
    child with it, also in the middle of a file (it would otherwise go on writing into the run's folder), whichever
    thread started it: the kernel's tie followed the starting thread, so a child started off the main thread (Ray
    Train runs the loop in a worker thread), or started again by the writer thread after one died, outlived it."""
    script = textwrap.dedent(
        """
        import os, sys, threading, time
        import torch
        from hflight.checkpoints.writers import writer_process
        started, fifo = sys.argv[1], sys.argv[2]
        process, area = writer_process.WriterProcess(), None
        def start():
            global area
            area = area if area is not None else process.allocate(4096, pinned=False)
            assert process.ready()
        if started != "off the main thread":
            start()
        if started != "by the main thread":
            if started == "as a replacement":
                process._process.kill()
                process._process.wait()
            thread = threading.Thread(target=start)
            thread.start()
            thread.join()
        # busy with a file: the child waits in the kernel until a reader opens the pipe, which none does
        state = {"t": torch.frombuffer(area, dtype=torch.uint8, count=16)}
        threading.Thread(target=process.save_torch, args=(state, fifo), daemon=True).start()
        print(process._process.pid, os.getsid(process._process.pid), os.getsid(0), flush=True)
        time.sleep(60)
        """
    )
    os.mkfifo(tmp_path / "optimizer.pt")
    parent = subprocess.Popen([sys.executable, "-c", script, started, str(tmp_path / "optimizer.pt")],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    child, child_session, parent_session = map(int, parent.stdout.readline().split())
    assert child_session != parent_session
    time.sleep(0.5)  # the request on its way: the child opens the pipe
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    for _ in range(100):
        if not _running(child):
            break
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail(f"the writer process {child} outlived its training process")


_CHILD_SCRIPT = """
import sys
import torch
import hflight.checkpoints.manifest
from hflight.checkpoints.writers import writer_process
process = writer_process.WriterProcess()
area = process.allocate(4096, pinned=False)
assert process.ready(), "the writer process did not start"
state = {"t": torch.frombuffer(area, dtype=torch.uint8, count=16)}
print(process.save_torch(state, sys.argv[1]))
process.close()
"""


def test_a_module_planted_in_the_working_folder_never_runs_in_the_child(tmp_path):
    """The child starts isolated from the working folder: `python -m` put it first on the child's path, and an
    `xxhash.py` there (any module the child imports) ran in it, where the training process, started as `python
    /path/train.py`, never imports from there; so would a `json.py` (the child's first import) without `-I`."""
    shared = tmp_path / "shared"
    shared.mkdir()
    for name in ("xxhash.py", "json.py"):
        (shared / name).write_text("open('planted-ran', 'w').close()\n")
    script = tmp_path / "train.py"
    script.write_text(_CHILD_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "out.pt")], cwd=shared, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert not (shared / "planted-ran").exists(), "the planted module ran in the writer process"
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.strip()) == 32, "the child wrote the file and gave its checksum"


def _spread_install(root):
    """This environment as an installation whose packages lie in two folders, as EasyBuild's or Spack's do: ``pkgs``
    (every entry of site-packages but typing_extensions, which torch imports) and ``deps`` (typing_extensions), and
    an interpreter with no packages of its own (a bare virtual environment)."""
    import sysconfig

    site = sysconfig.get_paths()["purelib"]
    pkgs, deps = root / "pkgs", root / "deps"
    pkgs.mkdir()
    deps.mkdir()
    for entry in os.listdir(site):
        (deps if entry.startswith("typing_extensions") else pkgs).joinpath(entry).symlink_to(os.path.join(site, entry))
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "bare")], check=True, timeout=120)
    return str(root / "bare" / "bin" / "python"), pkgs, deps


def test_the_child_starts_where_the_training_process_imports_through_pythonpath_alone(tmp_path):
    """torch's dependency reachable only through PYTHONPATH: `python -I` dropped it, the child's `import torch`
    failed, and the thread wrote every file (issue 67, item 3)."""
    base, pkgs, deps = _spread_install(tmp_path)
    script = tmp_path / "train.py"
    script.write_text(_CHILD_SCRIPT)
    src = os.path.dirname(os.path.dirname(hflight.__file__))  # the folder that holds the hflight package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, str(pkgs), str(deps)])}
    done = subprocess.run([base, str(script), str(tmp_path / "out.pt")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(done.stdout.strip()) == 32, "the child wrote the file and gave its checksum"


def test_the_child_resolves_each_module_to_the_training_processs_file(tmp_path):
    """A backport of a standard-library module in site-packages (pip still installs `dataclasses` 0.6 on some
    images): the training process takes the standard library's, which comes first on its path; the child put the
    folders of its packages (site-packages) first and ran the backport (issue 67, item 2)."""
    base, pkgs, deps = _spread_install(tmp_path)
    marker = tmp_path / "backport-ran"
    (pkgs / "dataclasses.py").write_text(f"open({str(marker)!r}, 'w').close()\nraise ImportError('the backport')\n")
    script = tmp_path / "train.py"
    src = os.path.dirname(os.path.dirname(hflight.__file__))  # the folder that holds the hflight package
    script.write_text(f"import sys\nsys.path += {[src, str(pkgs), str(deps)]!r}\n" + _CHILD_SCRIPT)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    done = subprocess.run([base, str(script), str(tmp_path / "out.pt")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=env)  # fmt: skip
    assert not marker.exists(), "the backport ran in the writer process"
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_path_object_on_sys_path_does_not_stop_the_child(monkeypatch, tmp_path):
    """Scripts append ``pathlib.Path`` objects to ``sys.path`` (Python's imports ignore them): the child's path went
    to it as JSON and the checkpoint's write failed with a TypeError (fault read of issue 67)."""
    import json
    from pathlib import Path

    monkeypatch.setattr(sys, "path", [*sys.path, Path(tmp_path), b"/bytes"])
    path = writer_process._child_path()
    assert json.loads(json.dumps(path)) == path and all(isinstance(entry, str) for entry in path)
    assert str(tmp_path) not in path


def test_a_child_that_cannot_start_is_tried_once_and_says_why(tmp_path, factory, children, monkeypatch, caplog):
    """A child that dies as it starts (an import that fails) was started again for every file and after every write,
    silently; now once per run, one warning with its standard error's last line, and the thread writes the files."""
    monkeypatch.setattr(writer_process, "BOOT", "import sys\nsys.stderr.write('ImportError: planted failure\\n')\n"
                                                "sys.exit(1)\n")  # fmt: skip
    make_trainer(tmp_path, factory, max_steps=12, save_steps=2, save_async=True).train()
    started, answers = children
    assert len(started) == 1, f"{len(started)} children started"
    said = [r.message for r in caplog.records if "could not start" in r.message]
    assert len(said) == 1 and "ImportError: planted failure" in said[0], said
    assert all(answer is None for *_, answer in answers)
    for step in range(2, 13, 2):
        verify_checkpoint(tmp_path / f"checkpoint-{step}", full=True)


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its new parent to reap it has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_staging_area_is_shared_memory_reused_and_released_once_written(tmp_path, children):
    """The first checkpoint copies into the process's own memory (the thread writes it); the area made after it is
    the child's memory, made with its pages present by a thread of its own, and reused by the later checkpoints (no
    new memory); a state that grows gets a new area, and the old one is released once the write reading it is over
    (the child told to unmap it with the next message)."""
    import torch

    from hflight.checkpoints.asynchronous import CheckpointWriter

    writer = CheckpointWriter(asynchronous=True)
    state = {"weight": torch.randn(64, 64), "bias": torch.randn(64)}
    made = []
    real = writer._process.allocate
    writer._process.allocate = lambda nbytes, pinned, populate: (
        made.append((nbytes, populate)) or real(nbytes, pinned, populate)
    )
    try:
        for step in (1, 2, 3, 4, 5):
            folder = tmp_path / f"checkpoint-{step}"
            folder.mkdir()
            if step == 4:
                state["extra"] = torch.ones(100)
            snapshot = writer.snapshot("state.pt", state)
            writer.snapshot_done()
            shared = [writer._process.place(t) is not None for t in snapshot.values()]
            assert shared == [step in (2, 3, 5)] * len(state) if step != 4 else shared == [True, True, False]
            digest = writer._process.save_torch(snapshot, folder / "state.pt")
            assert (digest is not None) == (step in (2, 3, 5))
            if step == 1:  # as the writer thread does once its first write is over
                writer._process.start()
            if step == 3:
                assert made == [(writer.snapshot_bytes, True)], "one area, reused by the later checkpoints"
            saved = {name: tensor.clone() for name, tensor in state.items()}
            state["weight"] += 1
        assert len(made) == 2 and list(writer._process._areas) == [1], "the first area released once written"
        loaded = torch.load(tmp_path / "checkpoint-5" / "state.pt")
        assert all(torch.equal(loaded[name], saved[name]) for name in saved)
    finally:
        writer.close(raising=False)
    assert writer._process._process is None and not writer._process._areas


@pytest.mark.parametrize("answered", [False, True], ids=["still starting", "idle"])
def test_close_ends_the_child_at_once(answered):
    """At the end of train() the child has nothing left to write: it is killed, not waited for (a child still starting
    held close() for the seconds of its imports; an idle one for its interpreter's teardown)."""
    process = writer_process.WriterProcess()
    process.allocate(4096, pinned=False)
    if answered:
        assert process.ready()
    else:
        process.start()
    child = process._process
    process.close()
    assert child.poll() == -signal.SIGKILL, "the child was not killed"


def _shared_memory() -> tuple[int, int]:
    """This process's mappings of the writers' shared memory, and its descriptors of it."""
    with open("/proc/self/maps") as maps:
        mapped = sum("memfd:hflight-checkpoint" in line for line in maps)
    descriptors = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            descriptors += "memfd:hflight-checkpoint" in os.readlink(f"/proc/self/fd/{fd}")
    return mapped, descriptors


class _CountSharedMemory(transformers.TrainerCallback):
    def __init__(self):
        self.seen = []

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append(_shared_memory())


def test_the_shared_memory_is_unmapped_at_release_and_gone_when_train_returns(tmp_path, factory):
    """Without a cyclic garbage collection: a job and its steps (which hold the snapshot) made a cycle that kept
    the overflow buffer of the first checkpoint mapped through the run, and the area and its descriptors after
    train() returned and the writer was closed, until a collection ran."""
    counting = _CountSharedMemory()
    gc.collect()
    gc.disable()
    try:
        make_trainer(tmp_path, factory, max_steps=8, save_steps=2, save_async=True, callbacks=[counting]).train()
        after = _shared_memory()
    finally:
        gc.enable()
    # steps 1-2: nothing yet; 3: the first checkpoint's overflow buffer and the area; from 5 on: the area alone
    assert counting.seen[-1][0] == 1 and counting.seen[4][0] == 1, counting.seen
    assert after == (0, 0), "the shared staging memory outlived train()"


def test_a_small_state_is_written_by_the_thread_without_starting_a_process(tmp_path, factory, children, monkeypatch):
    """Below PROCESS_MIN_BYTES of tensors starting the child would cost more than the thread's Python it saves."""
    monkeypatch.setattr(asynchronous, "PROCESS_MIN_BYTES", 1 << 30)
    make_trainer(tmp_path, factory, max_steps=4, save_steps=2, save_async=True).train()
    assert children == ([], [])
    verify_checkpoint(tmp_path / "checkpoint-2", full=True)


@pytest.mark.parametrize("to_come", [None, 7, 8])
def test_the_child_starts_after_the_first_write_where_enough_checkpoints_follow(monkeypatch, to_come):
    """Its start (a second or two of CPU) pays where enough checkpoints follow, or the run does not say how many."""
    import threading

    import torch

    monkeypatch.setattr(asynchronous, "PROCESS_MIN_CHECKPOINTS", 8)
    writer = asynchronous.CheckpointWriter(asynchronous=True)
    started = []
    monkeypatch.setattr(writer._process, "start", lambda: started.append(threading.current_thread().name))

    class Job:
        callbacks_over = threading.Event()

        def finish(self):
            return None

    try:
        for step in (1, 2):
            writer.job("unused", "unused", main=True, to_come=to_come)
            writer.snapshot("optimizer.pt", {"w": torch.ones(64)})
            writer.snapshot_done()
            writer.submit(Job(), f"checkpoint-{step}")
            writer.wait()
    finally:
        writer.close(raising=False)
    expected = [] if to_come == 7 else ["hflight-write-checkpoint-1", "hflight-write-checkpoint-2"]
    assert started == expected


class _SigtermAt(transformers.TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_stop_by_signal_writes_from_the_state_making_no_area_and_starting_no_child(tmp_path, factory, children,
                                                                                      monkeypatch):  # fmt: skip
    """A SIGTERM's checkpoint is the run's last: it was copied, and as the run's first the staging area was made and
    filled and a child started, then killed, all before the stop reported it (issue 67, item 4). Now it is written
    from the state itself, as the last checkpoint of a run that ends is."""
    snapshots, made = [], []
    real_snapshot, real_memory = asynchronous.CheckpointWriter.snapshot, asynchronous._host_memory
    monkeypatch.setattr(
        asynchronous.CheckpointWriter,
        "snapshot",
        lambda self, name, state, **until: snapshots.append(name) or real_snapshot(self, name, state, **until),
    )
    monkeypatch.setattr(asynchronous, "_host_memory", lambda *a, **k: made.append(a) or real_memory(*a, **k))
    real_allocate = writer_process.WriterProcess.allocate
    monkeypatch.setattr(writer_process.WriterProcess, "allocate",
                        lambda self, *a, **k: made.append(a) or real_allocate(self, *a, **k))  # fmt: skip
    with pytest.raises(SystemExit):
        make_trainer(tmp_path, factory, max_steps=12, save_steps=100, save_async=True,
                     callbacks=[_SigtermAt(3)]).train()  # fmt: skip
    assert snapshots == [] and made == [] and children[0] == [], (snapshots, made, children[0])
    verify_checkpoint(tmp_path / "checkpoint-3", full=True)
