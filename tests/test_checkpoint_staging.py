"""``save_async``'s snapshot (``hflight.checkpoints.asynchronous``): one staging area of host memory, allocated once and
reused, each copy over its own bytes of it; copies from a GPU on a side stream, with an event in place of a
device-wide synchronize (a fake ``torch.cuda`` here: these machines have no GPU); checkpoints that come faster than
the disk writes them said once, with the numbers.

In-process, tiny tensors and models."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import transformers

from hflight.checkpoints import asynchronous
from hflight.checkpoints.writers import writer_process

from .support import torch_file_records

LOGGER = "hflight.checkpoints.asynchronous"


def _optimizer_state(scale: float = 1.0) -> dict:
    """An optimizer's state as torch's AdamW holds it, with the dtypes checkpoints carry."""
    return {
        "state": {
            0: {"step": torch.tensor(3.0), "exp_avg": torch.full((5, 7), scale), "exp_avg_sq": torch.ones(5, 7)},
            1: {"step": torch.tensor(3.0), "exp_avg": torch.arange(6, dtype=torch.bfloat16) * scale},
        },
        "param_groups": [{"lr": 0.1, "params": [0, 1]}],
    }


def _odd_state() -> dict:
    """A bias of a few bytes, float8 (no numpy dtype), integers, an empty tensor, a view of a larger tensor."""
    base = torch.arange(40, dtype=torch.float32).reshape(8, 5)
    return {
        "bias": torch.ones(3),
        "fp8": torch.linspace(-1, 1, 17).to(torch.float8_e4m3fn),
        "ids": torch.arange(9, dtype=torch.int64),
        "empty": torch.empty(0, 4),
        "rows": base[2:6],
        "column": base[:, 1],
    }


def _copies(state) -> list[torch.Tensor]:
    found = []

    def walk(value):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, dict):
            [walk(v) for v in value.values()]
        elif isinstance(value, (list, tuple)):
            [walk(v) for v in value]

    walk(state)
    return found


def _checkpoint(writer, states: dict) -> dict:
    """One checkpoint's snapshots, as ``save_checkpoint`` takes them."""
    snapshots = {name: writer.snapshot(name, state) for name, state in states.items()}
    writer.snapshot_done()
    return snapshots


@pytest.fixture(autouse=True)
def thread_writer(monkeypatch):
    """The writer without its writer process: the layout is the same, from memory of the process's own (the shared
    memory of the writer process and its release: tests/test_writer_process.py)."""
    monkeypatch.setattr(writer_process, "available", lambda: False)


class _Made(list):
    threads: list[str]


@pytest.fixture
def allocations(monkeypatch):
    """The staging area's host allocations, as (bytes, pinned, pages made present), with the thread of each in
    ``made.threads``."""
    made, real = _Made(), asynchronous._host_memory
    made_by = made.threads = []

    def host_memory(nbytes, pinned, populate=False):
        made.append((nbytes, pinned, populate))
        made_by.append(threading.current_thread().name)
        return real(nbytes, pinned, populate)

    monkeypatch.setattr(asynchronous, "_host_memory", host_memory)
    return made


# ---- one staging area ------------------------------------------------------------------------------------------------
def test_the_copies_lie_in_one_area_each_storage_copied_once(tmp_path):
    """Every storage of the state has one copy in the area (64-byte aligned), and each tensor is the same view of its
    storage's copy as of its storage: torch.save writes the copy's records as the original's (views of one storage
    are one record, as torch.save writes them), but for its random id."""
    writer = asynchronous.CheckpointWriter(asynchronous=True)
    states = {"optimizer.pt": _optimizer_state(), "odd.pt": _odd_state()}
    _checkpoint(writer, states)  # the first checkpoint lays the area out
    snapshots = _checkpoint(writer, states)
    area = writer._area
    start, end = area.ctypes.data, area.ctypes.data + len(area)
    copies = [t for t in _copies(snapshots) if t.numel()]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in copies}
    assert all(start <= p and p + nbytes <= end for p, nbytes in storages.items())
    assert all((p - start) % 64 == 0 for p, nbytes in storages.items() if nbytes >= 64)
    originals = [t for t in _copies(states) if t.numel()]
    assert len(storages) == len({t.untyped_storage().data_ptr() for t in originals}) == len(copies) - 1, "two views"
    assert writer.snapshot_bytes == len(area) < sum(nbytes + 64 for nbytes in storages.values())
    for name, state in states.items():
        for original, copied in zip(_copies(state), _copies(snapshots[name])):
            assert (copied.dtype, copied.shape, copied.stride(), copied.storage_offset(), copied.device.type) == (
                original.dtype, original.shape, original.stride(), original.storage_offset(), "cpu")  # fmt: skip
            assert torch.equal(copied, original)
    for name in states:
        torch.save(states[name], tmp_path / "original.pt")
        torch.save(snapshots[name], tmp_path / "copy.pt")
        records = [torch_file_records(tmp_path / f"{each}.pt") for each in ("original", "copy")]
        assert list(records[0]) == list(records[1])
        assert {k for k in records[0] if records[0][k] != records[1][k]} <= {".data/serialization_id"}


def _structured_state() -> dict:
    """What torch.save keeps beyond the numbers: views of one storage (a buffer and a slice of it), a tensor with
    Python attributes (one of them another tensor of the state), a parameter, requires_grad."""
    buf = torch.arange(10, dtype=torch.float32)
    tagged = torch.ones(3)
    tagged.origin, tagged.partner = "ema", buf
    weight = torch.nn.Parameter(torch.full((2, 2), 0.5))
    scaled = torch.arange(4.0).as_subclass(_Scaled).requires_grad_()
    scaled.scale = 0.25
    master = _Master(torch.ones(2), requires_grad=False, kind="fp32 master")
    plain = torch.arange(3.0).as_subclass(_Plain)
    plain.kind = "plain"
    slotted = torch.arange(2.0).as_subclass(_Slotted)
    slotted.factor = 2.5
    return {"buf": buf, "window": buf[2:5], "tagged": tagged, "weight": weight, "leaf": torch.zeros(2).requires_grad_(),
            "scaled": scaled, "master": master, "plain": plain, "slotted": slotted}  # fmt: skip


class _Scaled(torch.Tensor):
    """A tensor subclass with an attribute (the staging area does not take it: a copy of its own)."""


class _Master(torch.nn.Parameter):
    """A Parameter subclass whose own ``__new__`` wants more (as bitsandbytes' ``Params4bit``): detach() gives a plain
    tensor; torch.save writes it as a Parameter with its attributes."""

    def __new__(cls, data, requires_grad=True, kind=None):
        made = torch.Tensor._make_subclass(cls, data, requires_grad)
        made.kind = kind
        return made


class _Plain(torch.Tensor):
    """A subclass with torch_function disabled: detach() gives a plain tensor."""

    __torch_function__ = torch._C._disabled_torch_function_impl


class _Slotted(torch.Tensor):
    """A subclass keeping its attribute in ``__slots__``, which torch.save writes."""

    __slots__ = ("factor",)


def _assert_loads_alike(original: dict, loaded: dict) -> None:
    assert loaded["window"].untyped_storage().data_ptr() == loaded["buf"].untyped_storage().data_ptr()
    assert loaded["window"].storage_offset() == 2 and torch.equal(loaded["window"], original["window"])
    assert loaded["tagged"].origin == "ema" and loaded["tagged"].partner.data_ptr() == loaded["buf"].data_ptr()
    assert type(loaded["weight"]) is torch.nn.Parameter and loaded["weight"].requires_grad
    assert loaded["leaf"].requires_grad and not loaded["buf"].requires_grad
    scaled = loaded["scaled"]
    assert type(scaled) is _Scaled and scaled.scale == 0.25 and scaled.requires_grad, "the subclass's kept"
    master, plain, slotted = loaded["master"], loaded["plain"], loaded["slotted"]  # fault read of issue 67
    assert type(master) is torch.nn.Parameter and master.kind == "fp32 master" and not master.requires_grad
    assert type(plain) is _Plain and plain.kind == "plain" and torch.equal(plain, original["plain"])
    assert type(slotted) is _Slotted and slotted.factor == 2.5


def test_a_snapshot_keeps_the_state_s_structure_as_torch_save_writes_it(tmp_path):
    """Views of one storage stay views of one copy (torch.save wrote 2 records for buf and buf[2:5] where the copy
    had 3), attributes and Parameter types stay: what torch.load returns equals what it returns from the state."""
    state = _structured_state()
    writer = asynchronous.CheckpointWriter(asynchronous=True)
    for _ in range(2):  # laid out, then in the area
        snapshot = _checkpoint(writer, {"state.pt": state})["state.pt"]
    torch.save(state, tmp_path / "original.pt")
    torch.save(snapshot, tmp_path / "copy.pt")
    records = [torch_file_records(tmp_path / f"{each}.pt") for each in ("original", "copy")]
    assert list(records[0]) == list(records[1])
    assert {k for k in records[0] if records[0][k] != records[1][k]} <= {".data/serialization_id"}
    _assert_loads_alike(state, torch.load(tmp_path / "copy.pt", weights_only=False))


@pytest.mark.parametrize(
    "first, then",
    [
        pytest.param(torch.ones(24, dtype=torch.float16), torch.ones(24, dtype=torch.bfloat16), id="dtype"),
        pytest.param(torch.ones(24), torch.ones(1, 24), id="shape"),
        pytest.param(torch.ones(4, 6), torch.ones(6, 4).t(), id="strides"),
    ],
)
def test_a_slot_reused_by_a_tensor_of_the_same_bytes_seen_otherwise_gives_its_new_view(first, then):
    """The slot's bytes are reused; the tensor over them is the state's, not the one laid out first."""
    writer = asynchronous.CheckpointWriter(asynchronous=True)
    for state in ({"t": first}, {"t": first}, {"t": then}):
        snapshot = _checkpoint(writer, {"state.pt": state})["state.pt"]
    assert writer._slots[("state.pt", "t")].nbytes == then.untyped_storage().nbytes()
    copied = snapshot["t"]
    assert (copied.dtype, copied.shape, copied.stride()) == (then.dtype, then.shape, then.stride())
    assert copied.untyped_storage().data_ptr() == writer._area.ctypes.data and torch.equal(copied, then)


def test_save_pretrained_writes_the_copy_of_a_model_with_tied_weights_as_the_model(tmp_path, factory):
    """Tied weights stay one tensor, and no other two copies look tied (transformers takes tensors whose storages
    start at the same address for tied weights, and would drop one of them)."""
    model = transformers.BertForMaskedLM(factory.config())
    state = model.state_dict()
    tied = ("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight")
    assert state[tied[0]] is state[tied[1]] or state[tied[0]].data_ptr() == state[tied[1]].data_ptr()
    writer = asynchronous.CheckpointWriter(asynchronous=True)
    for _ in range(2):
        snapshot = _checkpoint(writer, {"model": state})["model"]
        assert snapshot[tied[0]].untyped_storage().data_ptr() == snapshot[tied[1]].untyped_storage().data_ptr()
        model.save_pretrained(tmp_path / "copy", state_dict=snapshot)
    model.save_pretrained(tmp_path / "model")
    assert (tmp_path / "copy/model.safetensors").read_bytes() == (tmp_path / "model/model.safetensors").read_bytes()


def test_the_same_state_reuses_its_slots_and_allocates_nothing(allocations):
    """The first checkpoint copies what the area cannot hold into one buffer per snapshot, then the area is laid out
    for its whole layout and allocated once, its pages present (by the writer thread after the write; here, with no
    write, when the next snapshot takes it); the same state at later checkpoints copies into the same storages,
    allocating nothing. A state that grows gets one larger area, packed, for the keys still snapshotted."""
    writer = asynchronous.CheckpointWriter(asynchronous=True)
    first = _checkpoint(writer, {"optimizer.pt": _optimizer_state(), "odd.pt": _odd_state()})
    assert [(pinned, present) for _, pinned, present in allocations] == [(False, False)] * 2  # one overflow each
    laid_out = writer.snapshot_bytes
    second = _checkpoint(writer, {"optimizer.pt": _optimizer_state(2.0), "odd.pt": _odd_state()})
    assert allocations[-1] == (laid_out, False, True) and len(writer._area) == laid_out == writer.snapshot_bytes
    third = _checkpoint(writer, {"optimizer.pt": _optimizer_state(3.0), "odd.pt": _odd_state()})
    assert len(allocations) == 3, "the later checkpoints allocate nothing"
    pointer = lambda t: t.untyped_storage().data_ptr()  # noqa: E731
    assert all(pointer(a) == pointer(b) for a, b in zip(_copies(second), _copies(third), strict=True)), "same slots"
    assert not any(pointer(a) == pointer(b) for a, b in zip(_copies(first), _copies(second), strict=True) if a.numel())
    assert torch.equal(first["optimizer.pt"]["state"][0]["exp_avg"], torch.full((5, 7), 1.0)), "the first is kept"
    assert torch.equal(third["optimizer.pt"]["state"][1]["exp_avg"], torch.arange(6, dtype=torch.bfloat16) * 3)

    grown = {"optimizer.pt": {**_optimizer_state(), "extra": torch.ones(100)}}  # odd.pt is no longer snapshotted
    size = len(writer._area)
    _checkpoint(writer, grown)
    assert len(allocations) == 4, "the extra tensor's overflow"
    again = _checkpoint(writer, grown)
    assert len(allocations) == 5 and allocations[-1] == (writer.snapshot_bytes, False, True)
    assert writer.snapshot_bytes < size + 400, "packed: odd.pt's slots are dropped"
    _checkpoint(writer, grown)
    assert len(allocations) == 5 and torch.equal(again["optimizer.pt"]["extra"], torch.ones(100))


def test_the_area_is_allocated_by_the_writer_thread_once_its_write_is_over(allocations):
    """Not on the loop's thread (its pages made present there would stall the next checkpoint's copies), and not
    beside the write (on two cores, three busy threads slowed the loop)."""
    writer = asynchronous.CheckpointWriter(asynchronous=True)
    calls = []
    for step in (1, 2):
        snapshot = _checkpoint(writer, {"optimizer.pt": _optimizer_state(step)})["optimizer.pt"]
        job = _Job(calls, snapshot)
        job.finish = lambda job=job: calls.append(("write", len(allocations)))
        writer.submit(job, f"checkpoint-{step}")
        writer.wait()
    assert calls == [("write", 1), ("write", 2)], "the area after the first write, before the second"
    assert allocations.threads == ["MainThread", "hflight-write-checkpoint-1"]
    assert allocations[-1][2], "its pages made present"
    writer.close(raising=False)


# ---- copies from a GPU (a fake torch.cuda) ---------------------------------------------------------------------------
class _FakeCuda:
    """The part of ``torch.cuda`` the snapshot uses, recording every call in order; copies run on the CPU."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.training = self.Stream(self, "training")
        self.current = self.training

    class Stream:
        def __init__(self, fake, name="side", device=None):
            self.fake, self.name = fake, name
            if name == "side":
                fake.calls.append(("new stream", device))

        def wait_stream(self, other):
            self.fake.calls.append(("wait_stream", self.name, other.name))

        def wait_event(self, event):
            self.fake.calls.append(("wait_event", self.name, event.number))

    class Event:
        def __init__(self, fake):
            self.fake, self.number = fake, sum(1 for c in fake.calls if c[0] == "record")

        def record(self, stream):
            self.fake.calls.append(("record", self.number, stream.name))

        def synchronize(self):
            self.fake.calls.append(("synchronize", self.number, threading.current_thread().name))

    def install(self, monkeypatch):
        fake = self

        @contextlib.contextmanager
        def stream(side):
            fake.current, before = side, fake.current
            yield
            fake.current = before

        def copy_(tensor, source, non_blocking=False):
            fake.calls.append(("copy", fake.current.name, non_blocking))
            return real_copy(tensor, source)

        def no_synchronize(*args, **kwargs):
            raise AssertionError("torch.cuda.synchronize stalls the loop until every copy is done")

        def pin_memory(tensor, *args, **kwargs):
            raise AssertionError("a tensor pinned on its own")

        def empty(*args, pin_memory=False, **kwargs):
            fake.calls.append(("pin", args[0])) if pin_memory else None
            return real_empty(*args, **kwargs)

        real_copy, real_empty = torch.Tensor.copy_, torch.empty
        monkeypatch.setattr(asynchronous, "_on_gpu", lambda tensor: True)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "synchronize", no_synchronize)
        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: self.Stream(self, "side", device))
        monkeypatch.setattr(torch.cuda, "Event", lambda: self.Event(self))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.training)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.Tensor, "copy_", copy_)
        monkeypatch.setattr(torch.Tensor, "record_stream", lambda tensor, s: fake.calls.append(("keep", s.name)))
        monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
        monkeypatch.setattr(torch, "empty", empty)


class _Job:
    """What the writer needs of a job: its ``finish`` records when it reads the copies."""

    def __init__(self, calls, snapshot):
        self.calls, self.snapshot, self.callbacks_over = calls, snapshot, threading.Event()

    def finish(self):
        self.calls.append(("write", threading.current_thread().name))
        self.read = {k: v.clone() for k, v in self.snapshot["state"][0].items()}


def test_copies_from_a_gpu_are_queued_on_a_side_stream_that_the_training_stream_waits_for(monkeypatch):
    fake = _FakeCuda()
    fake.install(monkeypatch)
    writer = asynchronous.CheckpointWriter(asynchronous=True)
    calls, jobs = fake.calls, []
    for step in (1, 2):
        begun = len(calls)
        snapshot = writer.snapshot("optimizer.pt", _optimizer_state(step))
        model = writer.snapshot("model", _odd_state())
        writer.snapshot_done()
        jobs.append(_Job(calls, snapshot))
        writer.submit(jobs[-1], f"checkpoint-{step}")
        writer.wait()
        mine = [c for c in calls[begun:] if c[0] != "new stream"]
        events = [c[1] for c in mine if c[0] == "record"]
        expected = []  # each snapshot's: after the training stream's work, its copies, its event, waited for
        for event, copied in zip(events, (snapshot, model), strict=True):
            count = len({t.untyped_storage().data_ptr() for t in _copies(copied) if t.numel()})  # each storage once
            expected += [("wait_stream", "side", "training"), *[("copy", "side", True), ("keep", "side")] * count]
            expected += [("record", event, "side"), ("wait_event", "training", event)]
        pins = [c for c in mine if c[0] == "pin"]
        assert [c for c in mine if c[0] not in ("pin", "synchronize", "write")] == expected
        # the writer thread waits for the events, then writes; the loop's thread never waits for them
        thread = f"hflight-write-checkpoint-{step}"
        written = [c for c in mine if c[0] != "pin"]
        assert written[-3:] == [*[("synchronize", e, thread) for e in events], ("write", thread)]
        assert torch.equal(jobs[-1].read["exp_avg"], torch.full((5, 7), float(step)))
        # one pinned area for every copy, after the first checkpoint's write (the writer thread's); none at the second
        assert pins == ([("pin", writer.snapshot_bytes)] if step == 1 else [])
        assert writer._pinned
    assert sum(1 for c in calls if c[0] == "new stream") == 1, "one side stream, kept"


def test_an_area_made_for_host_tensors_is_pinned_once_they_come_from_a_gpu(monkeypatch):
    fake, on_gpu = _FakeCuda(), [False]
    fake.install(monkeypatch)
    monkeypatch.setattr(asynchronous, "_on_gpu", lambda tensor: on_gpu[0])
    writer = asynchronous.CheckpointWriter(asynchronous=True)
    _checkpoint(writer, {"optimizer.pt": _optimizer_state()})
    assert not [c for c in fake.calls if c[0] in ("pin", "record")], "host tensors: copied now, nothing pinned"
    on_gpu[0] = True
    for _ in range(2):
        _checkpoint(writer, {"optimizer.pt": _optimizer_state()})
    assert [c for c in fake.calls if c[0] == "pin"] == [("pin", writer.snapshot_bytes)]


# ---- checkpoints faster than the disk (the warning itself: tests/test_durable.py) -----------------------------------
def test_a_wait_that_no_checkpoint_follows_is_not_said(tmp_path, monkeypatch, caplog):
    """A wait for the write in flight before a push, a stop or the end of ``fit`` is not a checkpoint's: nothing is
    said; the checkpoint that comes next did not wait."""

    class SlowJob(_Job):
        def finish(self):
            time.sleep(0.2)

    writer = asynchronous.CheckpointWriter(asynchronous=True)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for step in (1, 2):
            writer.wait()  # save_checkpoint's, before the checkpoint's job: nothing in flight
            writer.job(str(tmp_path / "tmp"), str(tmp_path / "final"), main=True)
            writer.snapshot("optimizer.pt", _optimizer_state())
            writer.submit(SlowJob([], None), f"checkpoint-{step}")
            writer.wait()  # before a push to the hub
        writer.close(raising=False)
    assert not [r for r in caplog.records if r.name == LOGGER]


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc/self/status (Linux)")
def test_a_save_async_run_holds_one_copy_of_the_state_at_most(tmp_path):
    """The first checkpoint copies the state into a buffer of its own; the area the later ones copy into was made
    (its pages present) while that buffer was still held: two copies of the state from then on (issue 67, item 1).
    Now the buffer goes once written, before the area is made: the run's peak grows by the state's one copy and the
    writers' fixed buffers, not by two copies (measured: +94 MiB +35 for a state of 94 MiB, +306 +19 for 306)."""
    import json

    from .launch import JOBS

    grew = {}
    for mode in ("none", "async"):
        done = subprocess.run([sys.executable, str(JOBS / "save_async_memory.py"), str(tmp_path / mode), mode],
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        result = json.loads(done.stdout.strip().splitlines()[-1])
        grew[mode], state = result["peak"] - result["after_first"], result["state"]
    extra = grew["async"] - grew["none"]
    assert extra <= state + (48 << 20), f"save_async's peak grew by {extra >> 20} MiB for a state of {state >> 20} MiB"


def test_the_staging_area_is_made_after_the_first_step_so_the_first_checkpoint_copies_into_it(
    tmp_path, factory, monkeypatch
):
    """The first checkpoint copied into fresh memory of its own (its pages faulted in on the loop's thread, a tenth
    of a second for 270 MB), then the area was made after its write: save_async saved nothing over the synchronous
    save in a run of 4 checkpoints (issue 67). Now the area is made once the state exists (the first step), by a thread
    of its own, its pages present; every checkpoint, the first included, copies into it, and nothing else is made."""
    from .checkpoint_runs import make_trainer

    made = []
    real = asynchronous._host_memory
    monkeypatch.setattr(asynchronous, "_host_memory", lambda nbytes, pinned, populate=False: (
        made.append((threading.current_thread().name, populate)), real(nbytes, pinned, populate))[1])  # fmt: skip
    make_trainer(tmp_path, factory, max_steps=8, save_steps=2, save_async=True).train()
    assert made == [("hflight-staging-area", True)], made


# ---- what the loop pays beside a background write (issue 67, save_async on short runs) ------------------------------
def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_the_staging_area_s_pages_are_made_present_without_holding_the_interpreter_lock():
    """``mmap``'s MAP_POPULATE faulted the area's pages in with the interpreter lock held: the training loop stood
    still while the staging-area thread allocated (0.09 s for 270 MB, once a run). Now the pages are written one by one
    by numpy, the lock released: the loop's thread runs all along (its longest pause is a fraction of the allocation),
    and the pages are present once it returns."""
    nbytes = 384 << 20
    made, took = [], []

    def allocate():
        start = time.perf_counter()
        made.append(asynchronous._host_memory(nbytes, pinned=False, populate=True))
        took.append(time.perf_counter() - start)

    before = _resident_bytes()
    thread = threading.Thread(target=allocate)
    longest, last = 0.0, time.perf_counter()
    thread.start()
    while thread.is_alive():
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    thread.join()
    assert len(made[0]) == nbytes and _resident_bytes() - before >= 0.9 * nbytes
    assert longest < took[0] / 3, f"the loop's thread paused {longest:.3f} s of an allocation of {took[0]:.3f} s"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's")
def test_every_thread_of_a_background_write_keeps_the_loop_s_priority(tmp_path, factory, monkeypatch):
    """A write beside training once lowered its threads' priority (nice +10) so that the loop got the cores first. But
    the loop waits for such writes too (the next checkpoint's snapshot, the end of a fit that ends between two
    checkpoints, a push, a stop by signal, the uploads they start), and a lowered thread cannot be raised back: with two
    busy processes beside it the loop waited 3.61 s instead of 0.55 s (the fault read of issue 67). Every thread of a
    write, and every thread it starts, runs at the loop's priority; the run here ends between two checkpoints, so its
    end waits for a write beside training."""
    from hflight.checkpoints.job import CheckpointJob

    from .checkpoint_runs import make_trainer

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    base, seen, real = nice(), [], CheckpointJob.finish

    def finish(self):
        helper = threading.Thread(target=lambda: seen.append(nice()))
        helper.start()
        helper.join()
        seen.append(nice())
        return real(self)

    monkeypatch.setattr(CheckpointJob, "finish", finish)
    make_trainer(tmp_path, factory, max_steps=5, save_steps=2, save_async=True).train()
    assert seen == [base] * 6, seen  # checkpoints 2, 4 (the end of the fit waits for it) and 5: a thread each, and one
    assert nice() == base  # that each started


def test_a_large_snapshot_is_copied_by_two_threads_byte_for_byte(monkeypatch):
    """One thread copied 270 MB in 0.045 s with torch's byte copy; two, with numpy's, in 0.027 s (the loop waits for
    the copy). Above ``PARALLEL_COPY_BYTES`` the second half of the pieces goes to a helper thread; every byte lands
    where the single copy puts it, across the pieces' edges, whatever the sizes."""
    import numpy as np

    monkeypatch.setattr(asynchronous, "PARALLEL_COPY_BYTES", 1000)
    monkeypatch.setattr(asynchronous, "COPY_PIECE_BYTES", 97)
    threads, real = [], asynchronous._copy_pieces

    def copy_pieces(pieces):
        threads.append((threading.current_thread().name, sum(len(target) for target, _ in pieces)))
        real(pieces)

    monkeypatch.setattr(asynchronous, "_copy_pieces", copy_pieces)
    rng = np.random.default_rng(0)
    sources = [rng.integers(0, 256, size, dtype=np.uint8) for size in (1, 96, 97, 98, 500, 1234, 3)]
    targets = [np.zeros_like(source) for source in sources]
    asynchronous._copy_on_host(list(zip(targets, sources)))
    assert all((target == source).all() for target, source in zip(targets, sources))
    names = {name.split("_")[0] for name, _ in threads}
    assert names == {"MainThread", "hflight-copy"}, threads
    assert sum(nbytes for _, nbytes in threads) == sum(len(source) for source in sources)
    # below the threshold: this thread alone
    threads.clear()
    monkeypatch.setattr(asynchronous, "PARALLEL_COPY_BYTES", 1 << 30)
    asynchronous._copy_on_host(list(zip(targets, sources)))
    assert [name for name, _ in threads] == ["MainThread"]


# ---- the optimizer's state copied beside the next step ---------------------------------------------------------------
class _HalveMoments(transformers.TrainerCallback):
    """A user's callback that changes the optimizer's state in place before a step (a reset of its moments)."""

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        for entry in optimizer.state.values():
            entry["exp_avg"].mul_(0.5)


class _HalvingTrainer:
    """A user's trainer whose ``training_step`` changes the optimizer's state in place (made a subclass below)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        for entry in self.optimizer.state.values():
            entry["exp_avg"].mul_(0.5)
        return super().training_step(model, inputs, num_items_in_batch)


def _slow_helper_copies(monkeypatch) -> dict:
    """The helper thread's copies slowed (0.3 s before each): a step that did not wait for them would change the
    state first. Returns what was seen: the bytes the helper copied, and whether a step came while it copied."""
    seen = {"helper bytes": 0, "a step waited": False}
    real_pieces, real_before = asynchronous._copy_pieces, asynchronous.CheckpointWriter._before_a_step

    def copy_pieces(pieces):
        if threading.current_thread().name.startswith("hflight-copy"):
            time.sleep(0.3)
            seen["helper bytes"] += sum(len(target) for target, _ in pieces)
        real_pieces(pieces)

    def before_a_step(self, *args):
        seen["a step waited"] |= self._copying is not None and not self._copying.done()
        real_before(self, *args)

    monkeypatch.setattr(asynchronous, "_copy_pieces", copy_pieces)
    monkeypatch.setattr(asynchronous.CheckpointWriter, "_before_a_step", before_a_step)
    return seen


def _optimizer_files(out) -> dict:
    return {step: torch.load(out / f"checkpoint-{step}" / "optimizer.pt", weights_only=True) for step in (2, 4)}


def _assert_same_optimizer_states(ours: dict, theirs: dict) -> None:
    for step in theirs:
        for index, entry in theirs[step]["state"].items():
            for key, value in entry.items():
                assert torch.equal(ours[step]["state"][index][key], value), (step, index, key)


def test_the_optimizer_s_state_is_copied_beside_the_next_step_which_waits_for_it(tmp_path, factory, monkeypatch):
    """save_async copied the whole state at the step boundary (0.03 s for MiniLM's 270 MB on the loop's thread, two
    thirds of it the optimizer's moments). Nothing but a torch optimizer's step() changes an optimizer's state, so its
    copy is now made by a helper thread while the next step runs its forward and backward, and every optimizer step
    waits for it first (a pre-hook of torch's): each checkpoint's optimizer.pt is the synchronous run's, though the
    copy here takes longer than a forward and backward."""
    from .checkpoint_runs import make_trainer

    theirs = make_trainer(tmp_path / "sync", factory, max_steps=6, save_steps=2)
    theirs.train()
    seen = _slow_helper_copies(monkeypatch)
    make_trainer(tmp_path / "async", factory, max_steps=6, save_steps=2, save_async=True).train()
    assert seen["helper bytes"] > 0 and seen["a step waited"], seen
    _assert_same_optimizer_states(_optimizer_files(tmp_path / "async"), _optimizer_files(tmp_path / "sync"))
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    assert not _global_optimizer_pre_hooks, "the step hook outlived the run"


class _ResetMomentsAtEpochEnd(transformers.TrainerCallback):
    """A warm restart: the moments zeroed at each epoch's end, after the checkpoint of its last step."""

    def on_epoch_end(self, args, state, control, optimizer=None, **kwargs):
        for entry in optimizer.state.values():
            entry["exp_avg"].zero_()


class _HalveMomentsOnEvaluation(transformers.TrainerCallback):
    """The moments halved when an evaluation is logged (at an epoch's end, after the checkpoint of its last step)."""

    def on_log(self, args, state, control, logs=None, optimizer=None, **kwargs):
        if logs and "eval_loss" in logs:
            for entry in optimizer.state.values():
                entry["exp_avg"].mul_(0.5)


_USER_CODE = {
    "on_step_begin callback": [_HalveMoments()],
    "on_epoch_end callback": [_ResetMomentsAtEpochEnd()],
    "on_log callback": [_HalveMomentsOnEvaluation()],
    "trainer subclass": [],
}


@pytest.mark.parametrize("change", list(_USER_CODE))
def test_a_user_s_code_after_a_checkpoint_has_the_optimizer_s_state_copied_at_the_boundary(
    tmp_path, factory, monkeypatch, change
):
    """User code that runs between a checkpoint and the next step may change the optimizer's state in place: a
    callback of the step's events, or, where the checkpoint is an epoch's last step, of the epoch's end, its evaluation
    and logs (the fault read of issue 67: a warm restart at on_epoch_end went half into the copy made beside the step),
    or a trainer subclass's methods. Copied beside the step, the checkpoint would hold the change. With any such code
    the copy is made at the boundary, as before: optimizer.pt is the synchronous run's (the same code in both runs),
    and the helper copies nothing. A checkpoint at step 5, an epoch's last, evaluated at the epoch's end."""
    import hflight

    from .checkpoint_runs import make_trainer

    def run(out, **overrides):
        trainer = make_trainer(out, factory, max_steps=8, save_steps=5, eval_strategy="epoch",
                               callbacks=_USER_CODE[change], **overrides)  # fmt: skip
        if change == "trainer subclass":
            trainer.__class__ = type("Halving", (_HalvingTrainer, hflight.Trainer), {})
        trainer.train()

    run(tmp_path / "sync")
    seen = _slow_helper_copies(monkeypatch)
    run(tmp_path / "async", save_async=True)
    assert seen["helper bytes"] == 0, seen
    files = {
        out: torch.load(tmp_path / out / "checkpoint-5" / "optimizer.pt", weights_only=True)
        for out in ("sync", "async")
    }
    _assert_same_optimizer_states({5: files["async"]}, {5: files["sync"]})


def test_a_learning_rate_a_scheduler_fills_after_a_checkpoint_s_evaluation_is_copied_at_the_boundary(
    tmp_path, factory, monkeypatch
):
    """A learning rate held as a tensor, and a scheduler that steps on the epoch's evaluation (ReduceLROnPlateau fills
    the tensor in place) after the checkpoint of the epoch's last step: copied beside the next step, optimizer.pt held
    the reduced rate (0.0005 against 0.001: the fault read of issue 67), and a resume reduced it twice. Only the
    optimizer's per-parameter state is copied beside the step; its param_groups are copied at the boundary."""
    import hflight

    def run(out, **overrides):
        model = factory.qa_model(seed=0, dropout=0.1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3))
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=0)
        args = hflight.TrainingArguments(
            output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=12,
            save_steps=10, eval_strategy="epoch", metric_for_best_model="eval_loss", seed=7, report_to="none",
            disable_tqdm=True, dataloader_pin_memory=False, **overrides,
        )  # fmt: skip
        hflight.Trainer(model, args, train_dataset=factory.qa_dataset(40), eval_dataset=factory.qa_dataset(8, seed=1),
                        optimizers=(optimizer, scheduler)).train()  # fmt: skip
        return torch.load(out / "checkpoint-10" / "optimizer.pt", weights_only=True)

    theirs = run(tmp_path / "sync")
    seen = _slow_helper_copies(monkeypatch)
    ours = run(tmp_path / "async", save_async=True)
    assert seen["helper bytes"] > 0, seen  # the moments were copied beside the step
    assert torch.equal(ours["param_groups"][0]["lr"], theirs["param_groups"][0]["lr"]), (ours, theirs)
    assert float(theirs["param_groups"][0]["lr"]) == pytest.approx(1e-3)  # not reduced yet when the checkpoint came
    _assert_same_optimizer_states({10: ours}, {10: theirs})


def test_a_forked_process_s_optimizer_step_does_not_wait_for_the_parent_s_copy(monkeypatch):
    """torch's step pre-hook is the process's: a forked child inherits it with the copy in flight, but not the helper
    thread that makes it, and its first optimizer step waited forever (the fault read of issue 67). The child's steps
    change nothing of the parent's: they do not wait."""
    gate = threading.Event()
    real = asynchronous._copy_pieces
    monkeypatch.setattr(asynchronous, "_copy_pieces", lambda pieces: (
        threading.current_thread().name.startswith("hflight-copy") and gate.wait(30), real(pieces))[1])  # fmt: skip
    writer = asynchronous.CheckpointWriter(asynchronous=True)
    writer.job("unused", "unused", main=True)
    writer.snapshot("optimizer.pt", _optimizer_state(), until=object())
    writer.snapshot_done()
    assert writer._copying is not None and not writer._copying.done()
    child = os.fork()
    if child == 0:  # the child: a plain SGD step
        weight = torch.nn.Parameter(torch.ones(3))
        weight.grad = torch.ones(3)
        torch.optim.SGD([weight], lr=0.1).step()
        os._exit(0)
    stepped, deadline = False, time.monotonic() + 20
    try:
        while not stepped and time.monotonic() < deadline:
            stepped = os.waitpid(child, os.WNOHANG) != (0, 0)
            time.sleep(0.05)
    finally:
        if not stepped:
            os.kill(child, 9)
            os.waitpid(child, 0)
        gate.set()
        writer.close(raising=False)
    assert stepped, "the child's optimizer step waited for the parent's copy"


def test_only_an_optimizer_stepped_through_torch_s_hooked_step_has_its_copy_made_beside_the_step():
    """The step waits through a pre-hook of torch's ``Optimizer.step``: an optimizer whose instance was given another
    step (the IPU's runs on the device), or that is not a torch optimizer, has its state copied at the boundary; torch's
    LR schedulers wrap the step they call, which is the class's."""
    from hflight.checkpoints.folders import _steps_with_hooks

    weights = [torch.nn.Parameter(torch.ones(3))]
    plain = torch.optim.AdamW(weights)
    scheduled = torch.optim.AdamW(weights)
    torch.optim.lr_scheduler.LambdaLR(scheduled, lambda step: 1.0)
    replaced = torch.optim.AdamW(weights)
    replaced.step = lambda *args, **kwargs: None
    assert "step" in vars(scheduled) and _steps_with_hooks(plain) and _steps_with_hooks(scheduled)
    assert not _steps_with_hooks(replaced) and not _steps_with_hooks(object())
