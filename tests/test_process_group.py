"""The process group's lifetime, which ``hflight.arguments.process_group`` owns (no other module of hflight starts,
aborts or ends it): its one end, destroyed on the calling thread with gloo's worker threads joined, no sleeping, and
registered once for the process's exit; the new group on a store a search makes after a failed trial. The end's effect
in real two-process runs is checked by tests/test_distributed.py (every rank of a DDP run has no gloo worker thread left
at exit), the reconnection's by tests/test_hpsearch.py (a trial failing on one rank under torchrun, the search going
on)."""

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


def test_reconnect_replaces_an_aborted_group_by_one_on_the_store_given(one_process_group):
    """What a search does after a failed trial (``hflight.trainer.hpsearch_backends``): the group aborted, then a new
    one on a prefix of the search's store, which works; torch's connection leaves ``sys.excepthook`` as it was."""
    import sys

    hook, store = sys.excepthook, dist.PrefixStore("search/1/group", dist.HashStore())
    process_group.abort()
    process_group.reconnect("gloo", store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    tensor = torch.ones(2)
    dist.all_reduce(tensor)
    assert tensor.tolist() == [1.0, 1.0] and sys.excepthook is hook
    process_group.reconnect("gloo", store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    assert dist.is_initialized() and dist.get_world_size() == 1  # the current group aborted first


def _calls(source: str, names: set[str]) -> list[str]:
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            called = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            found += [f"line {node.lineno}: {called}"] if called in names else []
    return found


#: torch's calls that start, abort or end the default process group
LIFETIME = {"init_process_group", "destroy_process_group", "_abort_process_group"}


def test_only_this_module_starts_aborts_or_ends_the_default_group():
    """``hflight.arguments.process_group`` owns the group's whole lifetime: no other module of hflight calls torch's
    ``init_process_group``, ``destroy_process_group`` or ``_abort_process_group`` (a search's reconnection after a
    failed trial called the first itself)."""
    from pathlib import Path

    import hflight

    package = Path(hflight.__file__).parent
    calls = {str(path.relative_to(package)): _calls(path.read_text(encoding="utf-8"), LIFETIME)
             for path in sorted(package.rglob("*.py"))}  # fmt: skip
    others = {path: found for path, found in calls.items() if found and path != "arguments/process_group.py"}
    assert others == {}
    assert len(calls["arguments/process_group.py"]) >= 4  # the checker finds them where they are
    assert _calls("from torch import distributed as d\nd.init_process_group('gloo')", LIFETIME) == [
        "line 2: init_process_group"
    ]
