"""The process group's one end (``hflight.arguments.process_group``): destroyed on the calling thread with gloo's
worker threads joined, no sleeping, and registered once for the process's exit. Its effect in real two-process runs is
checked by tests/test_distributed.py (every rank of a DDP run has no gloo worker thread left at exit)."""

from __future__ import annotations

import atexit
import datetime
import time

import pytest
import torch
import torch.distributed as dist

from hflight.arguments import process_group


@pytest.fixture
def one_process_group():
    """A one-process gloo group, with one collective done (its worker threads have had work)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))  # fmt: skip
    tensor = torch.ones(3)
    dist.all_reduce(tensor)
    deadline = time.monotonic() + 10  # gloo names its worker threads once they run: under load, not at once
    while process_group.gloo_worker_threads() < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_end_destroys_the_group_and_joins_its_gloo_workers_without_sleeping(one_process_group, monkeypatch):
    assert process_group.gloo_worker_threads() >= 2

    def no_sleep(seconds):
        raise AssertionError(f"the process group's end slept {seconds} s")

    monkeypatch.setattr("time.sleep", no_sleep)
    process_group.end()
    assert not dist.is_initialized()
    assert process_group.gloo_worker_threads() == 0


def test_end_without_a_group_does_nothing():
    assert not dist.is_initialized()
    process_group.end()


def test_the_end_is_registered_for_the_exit_once(monkeypatch):
    registered = []
    monkeypatch.setattr(process_group, "_END_REGISTERED", [])
    monkeypatch.setattr(atexit, "register", registered.append)
    process_group.end_at_exit()
    process_group.end_at_exit()
    assert registered == [process_group.end]


def test_one_backend_default():
    assert process_group.default_backend(torch.device("cpu")) == "gloo"
    assert process_group.default_backend(torch.device("cuda", 1)) == "nccl"
    assert process_group.default_backend(None) == "gloo"
    assert process_group.default_backend(torch.device("cuda"), "gloo") == "gloo"  # ddp_backend / the strategy's


def test_connect_leaves_a_single_process_alone(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    assert process_group.connect("gloo") is False
    assert not dist.is_initialized()
