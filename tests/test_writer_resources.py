"""The checkpoint writers' operating-system resources (hflight.checkpoints.writers.resources, issue 62): after a fork,
at close() and at exit. A process forked after a checkpoint (Ray, joblib, a data loader's worker, a user's pool) writes
its own files with its own buffers and threads; the staging memory of save_async is gone when train() returns.

In-process, and processes forked from it; tiny states."""

from __future__ import annotations

import multiprocessing
import os
import queue

import pytest
import torch

from hflight.checkpoints.manifest import new_digest
from hflight.checkpoints.writers import direct_file, resources, torch_file

#: a record this large has its CRC computed in parts on the CRC pool's threads (torch_file._PARALLEL_CRC_BYTES)
_LARGE = 9 << 20


def _state(seed: int, large: bool) -> dict:
    """A state whose bytes tell which process wrote it: many records of 1 MiB (or one of 9 MiB)."""
    generator = torch.Generator().manual_seed(seed)
    if large:
        return {"w": torch.randn(_LARGE // 4, generator=generator)}
    return {f"w{i}": torch.randn(1 << 18, generator=generator) for i in range(10)}


def _write_files(folder: str, seed: int, large: bool, barrier, results) -> None:
    """In a forked worker: files written with torch_file.save, each hashed as written; (path, digest) for each."""
    barrier.wait(timeout=60)
    for index in range(4):
        path = os.path.join(folder, f"worker{seed}-{index}.pt")
        hasher = new_digest()
        assert torch_file.save(_state(seed * 10 + index, large), path, hasher)
        results.put((path, hasher.hexdigest()))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
@pytest.mark.parametrize("large", [False, True], ids=["buffers", "crc threads"])
def test_processes_forked_after_a_checkpoint_write_their_own_files(tmp_path, large, zlib_crc):
    """The parent writes a file first (its staging buffers kept for the next, its CRC threads started); two workers
    forked after it write at the same time. Shared staging buffers gave each worker the other's bytes (files that
    verified against their own checksum, as written, and loaded without complaint); the inherited CRC pool, without
    its threads, hung the first record of 4 MiB or more."""
    assert torch_file.save(_state(0, large=True), tmp_path / "parent.pt", new_digest())
    assert direct_file._spares() and (os.cpu_count() or 1) >= 2
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(2), context.Queue()
    workers = [context.Process(target=_write_files, args=(str(tmp_path), seed, large, barrier, results))
               for seed in (1, 2)]  # fmt: skip
    [worker.start() for worker in workers]
    try:
        written = [results.get(timeout=120) for _ in range(8)]
    except queue.Empty:
        pytest.fail("a forked worker hung writing its file")
    finally:
        for worker in workers:
            worker.join(timeout=5)
            worker.kill()
    for path, digest in written:
        seed, index = (int(part) for part in os.path.basename(path)[6:-3].split("-"))
        expected = _state(seed * 10 + index, large)
        loaded = torch.load(path)
        assert all(torch.equal(loaded[key], expected[key]) for key in expected), f"{path} holds another's bytes"
        hasher = new_digest()
        with open(path, "rb") as file:
            hasher.update(file.read())
        assert hasher.hexdigest() == digest


def test_a_forked_child_lets_go_of_what_it_inherited_and_releases_nothing_of_the_parent_s():
    """In the child: the forget of each resource, not its release (a release would stop the parent's writer process
    or unmap what the parent uses); in the parent, nothing changes."""
    owner = resources.Resources("test")
    calls = []
    owner.hold("a", release=lambda r: calls.append(("release", r)), forget=lambda r: calls.append(("forget", r)))
    made = owner.get("pool", lambda: ["pool"], lambda r: calls.append(("release", "pool")))
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: what it did, through the pipe
        os.write(write, repr((calls, len(owner))).encode())
        os._exit(0)
    os.close(write)
    child_calls, child_held = eval(os.read(read, 4096).decode())  # noqa: S307 - our own child's repr
    os.close(read)
    os.waitpid(pid, 0)
    assert child_calls == [("forget", "a")] and child_held == 0
    assert calls == [] and len(owner) == 2
    assert owner.get("pool", lambda: ["another"], lambda r: None) is made
    owner.close()
    assert calls == [("release", "pool"), ("release", "a")], "newest first"
    assert owner.get("pool", lambda: ["another"], lambda r: None) == ["another"], "made again after its release"
    owner.close()


def test_the_pools_are_released_when_a_run_s_writer_closes(tmp_path, zlib_crc):
    from hflight.checkpoints.asynchronous import CheckpointWriter

    writer = CheckpointWriter(asynchronous=False)
    torch_file.save(_state(0, large=True), tmp_path / "a.pt")
    spares = direct_file._spares()
    assert spares and len(resources.pools) == 2, "the staging buffers and the CRC threads"
    buffers = [each for pair in spares for each in pair]
    writer.close(raising=False)
    assert len(resources.pools) == 0 and all(each.closed for each in buffers)
    torch_file.save(_state(0, large=True), tmp_path / "b.pt")
    assert len(resources.pools) == 2, "made again at the next use"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_process_forked_mid_write_shares_no_staging_buffer_with_the_writer(tmp_path):
    """Forked while a file is half staged (its buffers out of the pool, which the fork's reset would forget): the
    child's writes into what it inherited stay its own. Shared (MAP_SHARED) staging buffers put them into the
    parent's file."""
    data = bytes(range(256)) * 4096
    half = len(data) // 2
    with direct_file.DirectFile(tmp_path / "parent.bin") as file:
        file.write(data[:half])
        pid = os.fork()
        if pid == 0:  # the child scribbles over the buffers it inherited
            for stage in file._maps:
                stage[: len(data)] = b"\xff" * len(data)
            os._exit(0)
        os.waitpid(pid, 0)
        file.write(data[half:])
    assert (tmp_path / "parent.bin").read_bytes() == data, "the child's bytes reached the parent's file"
