"""hflight.checkpoints.writers.direct_file: a file written front to back through an aligned staging buffer, past the
page
cache where the file system allows it, else through it; the bytes and the length exactly what was written."""

from __future__ import annotations

import errno
import os

import pytest
import xxhash

from hflight.checkpoints.writers import direct_file
from hflight.checkpoints.writers.direct_file import BLOCK, DirectFile


def _pieces() -> list[bytes]:
    """Pieces of awkward lengths: smaller than a block, across a staging buffer's end, exactly a block, empty."""
    rng = __import__("random").Random(0)
    return [rng.randbytes(n) for n in (7, 3 * BLOCK + 5, 0, BLOCK, 9 * BLOCK - 1, 1)]


@pytest.fixture
def small_stage(monkeypatch):
    monkeypatch.setattr(direct_file, "STAGE_BYTES", 2 * BLOCK)  # many flushes on a small file


@pytest.mark.parametrize("direct", [True, False])
def test_the_file_holds_exactly_the_bytes_written(tmp_path, small_stage, direct):
    pieces, hasher = _pieces(), xxhash.xxh3_128()
    with DirectFile(tmp_path / "f", hasher, direct=direct) as out:
        for piece in pieces:
            out.write(piece)
        assert out.tell() == sum(map(len, pieces))
    assert (tmp_path / "f").read_bytes() == b"".join(pieces)  # the last block's padding cut off
    assert hasher.hexdigest() == xxhash.xxh3_128(b"".join(pieces)).hexdigest()


def test_direct_io_is_used_where_the_file_system_takes_it(tmp_path):
    """On Linux file systems that take O_DIRECT (ext4, xfs: the CI's), the file goes past the page cache."""
    if not getattr(os, "O_DIRECT", 0):
        pytest.skip("this platform has no O_DIRECT")
    try:
        os.close(os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
    except OSError:
        pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT")
    with DirectFile(tmp_path / "f") as out:
        out.write(b"x" * (BLOCK + 3))
        assert out.direct
    assert (tmp_path / "f").read_bytes() == b"x" * (BLOCK + 3)


def test_a_file_system_refusing_o_direct_at_the_write_gets_the_page_cache(tmp_path, small_stage, monkeypatch):
    """Some file systems (FUSE, network) open with O_DIRECT and refuse the write: the rest goes through the page cache,
    the file is whole."""
    real, refused = os.pwrite, []

    def pwrite(fd, data, offset):
        if not refused:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    pieces = _pieces()
    with DirectFile(tmp_path / "f") as out:
        for piece in pieces:
            out.write(piece)
    assert refused and not out.direct
    assert (tmp_path / "f").read_bytes() == b"".join(pieces)


def test_a_file_system_refusing_o_direct_at_the_open_gets_the_page_cache(tmp_path, monkeypatch):
    real = os.open

    def open_(path, flags, *rest):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(path, flags, *rest)

    monkeypatch.setattr(os, "open", open_)
    with DirectFile(tmp_path / "f") as out:
        out.write(b"abc")
        assert not out.direct
    assert (tmp_path / "f").read_bytes() == b"abc"


@pytest.mark.parametrize("size", [3, 7 * BLOCK])  # the last write (in close), a helper thread's write (in write)
def test_other_write_errors_are_raised(tmp_path, small_stage, monkeypatch, size):
    def pwrite(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(OSError, match="No space left"), DirectFile(tmp_path / "f") as out:
        out.write(b"a" * size)


@pytest.mark.parametrize("size", [5000, 2 * BLOCK + 5000])  # the whole file in close's write; after a full buffer
def test_a_refusal_at_the_last_write_still_cuts_the_padding_off(tmp_path, small_stage, monkeypatch, size):
    """A file system that opens with O_DIRECT and refuses close's write of the padded last block (a file under one
    staging buffer has no other write): the page cache takes that write, and the file is cut to its length."""
    real, refused, last = os.pwrite, [], size // direct_file.STAGE_BYTES * direct_file.STAGE_BYTES

    def pwrite(fd, data, offset):
        if offset == last and not refused:  # close's write: the last block, padded
            refused.append(len(data))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    data = os.urandom(size)
    with DirectFile(tmp_path / "f") as out:
        out.write(data)
    assert refused == [-(-5000 // BLOCK) * BLOCK] and not out.direct
    assert (tmp_path / "f").read_bytes() == data


def test_no_descriptor_is_left_open_when_the_staging_buffers_cannot_be_had(tmp_path, monkeypatch):
    def no_memory():
        raise MemoryError

    monkeypatch.setattr(direct_file, "_take_buffers", no_memory)
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(MemoryError):
        DirectFile(tmp_path / "f")
    assert set(os.listdir("/proc/self/fd")) == before
