"""hflight.checkpoints.writers.torch_file: torch.save's archive, written by the background checkpoint writer without
holding
the interpreter lock; the same records as torch.save, read by torch.load in every mode."""

from __future__ import annotations

import io
import logging
import struct
import zipfile
import zlib

import pytest
import torch

from hflight.checkpoints.writers import resources, torch_file

from .support import torch_file_records


def _state() -> dict:
    weight = torch.randn(64, 32)
    state = {
        "weight": weight,
        "tied": weight,  # the same tensor: one storage
        "view": weight[3:7],  # a view of it: the same storage, an offset
        "ints": torch.arange(10, dtype=torch.int64),
        "half": torch.randn(5, dtype=torch.bfloat16),
        "empty": torch.empty(0),
        "nested": {"step": 3, "moments": [torch.ones(3), torch.zeros(2, 2)], "name": "adamw"},
    }
    return state


def test_the_records_are_torch_save_s_and_the_data_is_aligned_as_torch_aligns_it(tmp_path):
    state = _state()
    torch.save(state, tmp_path / "reference.pt")
    torch_file.save(state, tmp_path / "written.pt")
    ours, theirs = torch_file_records(tmp_path / "written.pt"), torch_file_records(tmp_path / "reference.pt")
    assert list(ours) == list(theirs)  # the same records in the same order
    differing = [name for name in ours if ours[name] != theirs[name]]
    assert differing == [".data/serialization_id"]  # the pickle, every storage's bytes, the version: torch's
    raw = (tmp_path / "written.pt").read_bytes()
    with zipfile.ZipFile(tmp_path / "written.pt") as archive:
        for info in archive.infolist():
            name_length, extra_length = struct.unpack("<HH", raw[info.header_offset + 26 : info.header_offset + 30])
            assert (info.header_offset + 30 + name_length + extra_length) % 64 == 0, info.filename


@pytest.mark.parametrize("how", [{}, {"weights_only": True}, {"mmap": True}])
def test_torch_load_reads_it_as_it_reads_torch_save_s(tmp_path, how):
    state = _state()
    torch_file.save(state, tmp_path / "written.pt")
    loaded = torch.load(tmp_path / "written.pt", **how)
    assert loaded["tied"] is loaded["weight"]  # shared storage stays shared
    assert loaded["view"].storage_offset() == 3 * 32 and torch.equal(loaded["view"], state["view"])
    for key in ("weight", "ints", "half", "empty"):
        assert loaded[key].dtype == state[key].dtype and torch.equal(loaded[key], state[key])
    assert loaded["nested"]["step"] == 3 and loaded["nested"]["name"] == "adamw"
    assert all(torch.equal(a, b) for a, b in zip(loaded["nested"]["moments"], state["nested"]["moments"]))


def test_a_torch_whose_save_internals_differ_gets_torch_save_itself(tmp_path, monkeypatch):
    """The module drives ``torch.serialization._save``; where this torch's differs, ``torch.save`` writes the file."""
    calls = []
    real_save, real_internal = torch.save, torch.serialization._save

    def changed(obj, zip_file, pickle_module, pickle_protocol, _disable_byteorder_record, new_option=None):
        return real_internal(obj, zip_file, pickle_module, pickle_protocol, _disable_byteorder_record)

    monkeypatch.setattr(torch.serialization, "_save", changed)
    monkeypatch.setattr(torch, "save", lambda obj, path: calls.append(path) or real_save(obj, path))
    torch_file._torch_records.cache_clear()
    try:
        assert torch_file.save({"x": torch.ones(2)}, tmp_path / "written.pt", hasher=None) is False  # not hashed
    finally:
        torch_file._torch_records.cache_clear()
    assert calls == [tmp_path / "written.pt"]
    assert torch.equal(torch.load(tmp_path / "written.pt")["x"], torch.ones(2))


def test_zip64_records_and_directory_are_read_by_zipfile_and_torch_load(tmp_path, monkeypatch):
    """Files past 4 GiB need zip64 sizes and offsets; the framing is exercised on a small file by lowering the limit
    (every size and offset above it goes into zip64 fields)."""
    monkeypatch.setattr(torch_file, "_ZIP64_LIMIT", 16)
    state = _state()
    torch.save(state, tmp_path / "reference.pt")
    torch_file.save(state, tmp_path / "written.pt")
    raw = (tmp_path / "written.pt").read_bytes()
    assert b"PK\x06\x06" in raw and b"PK\x06\x07" in raw  # the zip64 end records
    with zipfile.ZipFile(tmp_path / "written.pt") as archive:
        assert archive.testzip() is None  # every record's CRC-32 checks
    ours, theirs = torch_file_records(tmp_path / "written.pt"), torch_file_records(tmp_path / "reference.pt")
    assert [name for name in ours if ours[name] != theirs.get(name)] == [".data/serialization_id"]
    for how in ({}, {"weights_only": True}, {"mmap": True}):
        loaded = torch.load(tmp_path / "written.pt", **how)
        assert torch.equal(loaded["weight"], state["weight"]) and loaded["tied"] is loaded["weight"]


def test_the_hasher_sees_every_byte_of_the_file(tmp_path):
    import xxhash

    from hflight.checkpoints.manifest import file_digest

    hasher = xxhash.xxh3_128()
    torch_file.save(_state(), tmp_path / "written.pt", hasher=hasher)
    assert hasher.hexdigest() == file_digest(tmp_path / "written.pt")


def test_the_crc_of_a_record_checksummed_in_parts_checks(tmp_path, monkeypatch, zlib_crc):
    """Without ``isal``, a large record's CRC-32 is computed in parts side by side (from 4 MiB): the threshold lowered
    so that the larger storages are, each record's CRC still checks and the records are torch.save's."""
    monkeypatch.setattr(torch_file, "_PARALLEL_CRC_BYTES", 1000)  # the 64x32 float weight: 4 parts
    monkeypatch.setattr(torch_file.os, "cpu_count", lambda: 4)
    state = _state()
    torch.save(state, tmp_path / "reference.pt")
    torch_file.save(state, tmp_path / "written.pt")
    with zipfile.ZipFile(tmp_path / "written.pt") as archive:
        assert archive.testzip() is None
    ours, theirs = torch_file_records(tmp_path / "written.pt"), torch_file_records(tmp_path / "reference.pt")
    assert [name for name in ours if ours[name] != theirs.get(name)] == [".data/serialization_id"]


@pytest.fixture
def fresh_probe():
    """The module's check of this torch, made again in the test and again after it."""
    torch_file._torch_records.cache_clear()
    yield
    torch_file._torch_records.cache_clear()


def test_every_record_torch_s_writer_adds_at_the_end_is_carried_in_its_place(tmp_path, monkeypatch, fresh_probe):
    """A torch whose writer ends its archives with one more record (after the serialization id): the file has it too,
    with torch's bytes, in torch's order."""
    real_save = torch.save

    def save_with_a_new_record(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        if isinstance(f, io.BytesIO):
            f.seek(0)
        with zipfile.ZipFile(f, "a") as archive:
            archive.writestr(f"{archive.namelist()[0].split('/')[0]}/.data/new_end_record", b"torch 9")

    monkeypatch.setattr(torch, "save", save_with_a_new_record)
    state = _state()
    torch.save(state, tmp_path / "reference.pt")
    assert torch_file.save(state, tmp_path / "written.pt") is True  # still hflight's writer
    ours, theirs = torch_file_records(tmp_path / "written.pt"), torch_file_records(tmp_path / "reference.pt")
    assert list(ours) == list(theirs) and list(ours)[-2:] == [".data/serialization_id", ".data/new_end_record"]
    assert [name for name in ours if ours[name] != theirs[name]] == [".data/serialization_id"]


def test_a_writer_whose_records_differ_from_torch_save_s_on_the_probe_gives_way_to_torch_save(
    tmp_path, monkeypatch, fresh_probe, caplog
):
    """The probe written both ways at first use: where any record's bytes differ (here the byte order record, as a
    torch that changed what ``_save`` hands its writer would make them), ``torch.save`` writes every file."""
    real = torch_file._ZipRecords.write_record

    def write_record(self, name, data, size):
        if name == "byteorder":
            data, size = "big", 3
        real(self, name, data, size)

    monkeypatch.setattr(torch_file._ZipRecords, "write_record", write_record)
    with caplog.at_level(logging.WARNING, logger="hflight.checkpoints.writers.torch_file"):
        assert torch_file.save({"x": torch.ones(2)}, tmp_path / "written.pt") is False
    assert "the bytes of ['byteorder'] differ" in caplog.text
    assert torch_file_records(tmp_path / "written.pt")["byteorder"] == b"little"  # torch.save's file


@pytest.mark.parametrize("size", [0, 5, 4 << 20, (8 << 20) + 3, (17 << 20) + 11])
def test_a_large_record_s_crc_computed_in_parts_is_zlib_s(size, monkeypatch, zlib_crc):
    """Without ``isal``, records of 4 MiB and more are checksummed in parts side by side and the parts' CRCs
    combined."""
    monkeypatch.setattr(torch_file.os, "cpu_count", lambda: 4)
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size)).numpy()
    view = memoryview(data)
    assert torch_file._crc32(view) == zlib.crc32(view)
    if size >= 8 << 20:  # in parts: the combination of the parts' CRCs, not one crc32 of the whole
        whole = zlib.crc32
        monkeypatch.setattr(torch_file.zlib, "crc32", lambda piece, *a: whole(piece, *a) if len(piece) < size else 0)
        assert torch_file._crc32(view) == whole(view)


@pytest.mark.parametrize("size", [0, 1, 63, 4097, (9 << 20) + 5])
def test_the_crc_is_isa_l_s_on_one_thread_and_equals_zlib_s(size, monkeypatch):
    """``isal`` (a dependency) computes every record's CRC-32, the whole record on the writing thread: no CRC threads
    beside it (a background write's parallel CRC took the training loop's core), and zlib's value, from any offset of
    a storage's bytes."""
    assert torch_file._fast_crc32 is not None, "isal is a dependency of hflight: its CRC-32 is used"
    monkeypatch.setattr(torch_file.os, "cpu_count", lambda: 4)
    pools = len(resources.pools)
    data = torch.randint(0, 256, (size + 3,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size)).numpy()
    view = memoryview(data)[3:]
    assert torch_file._crc32(view) == zlib.crc32(view)
    assert len(resources.pools) == pools, "no CRC pool made"
