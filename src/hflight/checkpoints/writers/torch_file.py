"""``torch.save``'s file format, written by the background checkpoint writer without holding the interpreter lock and
past the page cache.

``torch.save`` writes each storage through torch's C++ zip writer with the interpreter lock held: a background
checkpoint write (``save_async``) then stops the training loop's Python for as long as the optimizer's and the
model's bytes take to copy into the page cache (measured: a MiniLM-L6 step of 310 ms took 470 ms while an
``optimizer.pt`` of 180 MB was written beside it). :func:`save` writes the same archive itself: each record stored,
its data aligned to 64 bytes as torch aligns it, its CRC-32 computed (``zlib.crc32``, which releases the lock) before
its header is written, so the file is written front to back, once, through
:class:`~hflight.checkpoints.writers.direct_file.DirectFile` (``O_DIRECT`` where the file system takes it; the lock
released for every large copy and write). Zip64 records and directories where sizes or offsets need them, as ``zipfile``
and torch's reader expect.

The records are torch's own: the pickle, the storages and their keys come from ``torch.serialization._save`` (the
function ``torch.save`` calls), given this module's zip writer in place of torch's; the records torch's own writer
adds at the end (the version, and any other this torch adds) are copied from an archive this torch wrote.
``torch.load`` (with ``weights_only``, with ``mmap``) reads the file as it reads ``torch.save``'s. ``_save`` is
torch's private function: at first use a probe state is written both ways, and where this torch's ``_save`` is not
the function this module was written against, or the records differ in any name, order or byte (the random
serialization id apart), :func:`save` is ``torch.save`` (and says so once in the log).

May import: ``hflight.checkpoints.writers.direct_file``, ``hflight.checkpoints.writers.resources``.
"""

from __future__ import annotations

import concurrent.futures
import functools
import inspect
import io
import logging
import os
import pickle
import struct
import uuid
import zipfile
import zlib
from typing import Any

import torch

from hflight.checkpoints.writers import resources
from hflight.checkpoints.writers.direct_file import DirectFile

try:  # Intel ISA-L's CRC-32 (carry-less multiplication): 13.5 GB/s against zlib 1.2's 2-3.4 GB/s here
    from isal.isal_zlib import crc32 as _fast_crc32
except ImportError:  # zlib's, its large records in parts side by side (_crc32)
    _fast_crc32 = None

logger = logging.getLogger(__name__)

#: torch aligns every storage's bytes in its archive to this (``torch.serialization._get_storage_alignment``)
_DEFAULT_ALIGNMENT = 64
#: the id of the extra field that pads a local header so that the record's data is aligned (torch's "FB")
_PADDING_ID = 0x4246
#: a record of at least this many bytes has its CRC-32 computed in parts, side by side (:func:`_crc32`)
_PARALLEL_CRC_BYTES = 4 << 20
_CRC_POLYNOMIAL = 0xEDB88320  # CRC-32's, reflected (zlib's)
#: above this, a size or offset goes into a zip64 extra field (a test lowers it to exercise the zip64 framing)
_ZIP64_LIMIT = 0xFFFFFFFF
_DOS_DATE = (1980 - 1980) << 9 | 1 << 5 | 1  # 1980-01-01, as torch's and zipfile's fixed-date records
_STORED_VERSION, _ZIP64_VERSION = 20, 45
#: the record torch's writer fills with a random id for each file
_SERIALIZATION_ID = ".data/serialization_id"


def _alignment() -> int:
    get = getattr(torch.serialization, "_get_storage_alignment", None)
    return int(get()) if get is not None else _DEFAULT_ALIGNMENT


def _probe() -> dict[str, Any]:
    """A small state with what checkpoints hold: several dtypes, shared storage, a view, an empty tensor, nesting
    (built without drawing random numbers: the probe runs inside a training run)."""
    weight = torch.arange(96, dtype=torch.float32).reshape(12, 8)
    return {
        "weight": weight,
        "tied": weight,
        "view": weight[2:5],
        "half": torch.arange(6, dtype=torch.bfloat16),
        "ints": torch.arange(4, dtype=torch.int64),
        "empty": torch.empty(0),
        "nested": {"step": 3, "moments": [torch.ones(3), torch.zeros(2, 2)], "name": "adamw"},
    }


def _records(data: bytes | str | os.PathLike) -> list[tuple[str, bytes]]:
    """An archive's records in order, by name without the archive's folder."""
    source = io.BytesIO(data) if isinstance(data, bytes) else data
    with zipfile.ZipFile(source) as archive:
        return [(info.filename.split("/", 1)[1], archive.read(info)) for info in archive.infolist()]


class _RecordNames:
    """A writer for ``torch.serialization._save`` that keeps only the names of the records it is given."""

    def __init__(self) -> None:
        self.names: set[str] = set()

    def write_record(self, name: str, data: Any, size: int) -> None:
        self.names.add(name)

    def write_record_metadata(self, name: str, size: int) -> None:
        self.names.add(name)


@functools.cache
def _torch_records() -> list[tuple[str, bytes | None]] | None:
    """The records ``torch.save``'s own writer adds at the end of an archive, in its order (the version, the
    serialization id, and whatever else this torch adds; None in place of the serialization id, written anew for each
    file), once this module's writer is seen, on a probe state, to give ``torch.save``'s records exactly (names,
    order, bytes; the serialization id apart). None where it does not, or where this torch's ``_save`` is not the
    function this module drives: ``torch.save`` is used then."""
    save = getattr(torch.serialization, "_save", None)
    expected = ["obj", "zip_file", "pickle_module", "pickle_protocol", "_disable_byteorder_record"]
    if save is None or list(inspect.signature(save).parameters) != expected:
        return _differs("torch.serialization._save has another signature")
    buffer = io.BytesIO()
    torch.save(_probe(), buffer)
    reference = _records(buffer.getvalue())
    written_by_save = _RecordNames()
    save(_probe(), written_by_save, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    end = [(name, None if name == _SERIALIZATION_ID else data) for name, data in reference
           if name not in written_by_save.names]  # fmt: skip
    probe = io.BytesIO()  # in memory: the probe runs inside a run, whose folders nothing else may touch
    _write_archive(_probe(), probe, "probe", end)
    ours = _records(probe.getvalue())
    if [name for name, _ in ours] != [name for name, _ in reference]:
        return _differs(f"records {[n for n, _ in ours]} where torch.save writes {[n for n, _ in reference]}")
    differing = [a for (a, x), (_, y) in zip(ours, reference) if x != y and a != _SERIALIZATION_ID]
    if differing:
        return _differs(f"the bytes of {differing} differ from torch.save's")
    return end


def _differs(why: str) -> None:
    logger.warning(f"torch.save writes the background checkpoint writer's tensor files: hflight's writer does not "
                   f"give this torch's archive ({why}).")  # fmt: skip
    return None


def _storage_bytes(storage: Any) -> memoryview:
    """A CPU view of an untyped storage's bytes (no copy for a CPU storage)."""
    if storage.device.type != "cpu":
        storage = storage.cpu()
    view = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
    return memoryview(view.numpy())


def _gf2_times(matrix: list[int] | tuple[int, ...], vector: int) -> int:
    """A 32x32 matrix over GF(2) (its columns as 32-bit integers) times a vector."""
    total, column = 0, 0
    while vector:
        if vector & 1:
            total ^= matrix[column]
        vector >>= 1
        column += 1
    return total


def _gf2_product(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """``a`` after ``b``."""
    return tuple(_gf2_times(a, column) for column in b)


@functools.lru_cache(maxsize=256)
def _zeros_operator(nbytes: int) -> tuple[int, ...]:
    """The operator that turns the CRC-32 of some bytes into the CRC-32 of those bytes followed by ``nbytes`` zeros
    (without the pre- and post-conditioning, which cancel in :func:`_crc32_combine`): zlib's ``crc32_combine``."""
    operator = tuple(1 << n for n in range(32))  # the identity
    power = (_CRC_POLYNOMIAL, *(1 << n for n in range(31)))  # one zero bit
    for _ in range(3):  # one zero byte
        power = _gf2_product(power, power)
    while nbytes:
        if nbytes & 1:
            operator = _gf2_product(power, operator)
        nbytes >>= 1
        if nbytes:
            power = _gf2_product(power, power)
    return operator


def _crc32_combine(first: int, second: int, second_length: int) -> int:
    """The CRC-32 of two byte strings one after the other, from their CRC-32s and the second's length."""
    return _gf2_times(_zeros_operator(second_length), first) ^ second


def _crc32(view: memoryview) -> int:
    """``zlib.crc32(view)``: by ISA-L where ``isal`` is installed (a dependency of hflight; it releases the interpreter
    lock, and at 13.5 GB/s one thread takes 0.013 s for a 180 MB ``optimizer.pt``: a background write's CRC keeps off
    the training loop's core); else by zlib, a large record in equal parts side by side (``zlib.crc32`` releases the
    interpreter lock), their CRCs combined, on as many threads as the machine has cores (at most 8)."""
    if _fast_crc32 is not None:
        return _fast_crc32(view)
    parts = min(8, os.cpu_count() or 1, len(view) // _PARALLEL_CRC_BYTES)
    if parts < 2:
        return zlib.crc32(view)
    # the pool's threads, one fewer than the parts (this thread takes the first); a forked process makes its own
    pool = resources.pools.get(
        "torch_file.crc", lambda: concurrent.futures.ThreadPoolExecutor(7, thread_name_prefix="hflight-crc32"),
        lambda executor: executor.shutdown(wait=False),
    )  # fmt: skip
    step = -(-len(view) // parts)
    pieces = [view[begin : begin + step] for begin in range(0, len(view), step)]
    try:
        others = [pool.submit(zlib.crc32, piece) for piece in pieces[1:]]
    except RuntimeError:  # released meanwhile (no checkpoint writer open any more): the whole record here
        return zlib.crc32(view)
    crc = zlib.crc32(pieces[0])
    for piece, other in zip(pieces[1:], others):
        crc = _crc32_combine(crc, other.result(), len(piece))
    return crc


class _ZipRecords:
    """The writer ``torch.serialization._save`` writes its records to: each record stored, its data aligned to
    ``alignment`` bytes in the file, written once, front to back, into ``out`` (a
    :class:`~hflight.checkpoints.writers.direct_file.DirectFile`; the probe's: a ``BytesIO``); the central directory at
    :meth:`close`."""

    def __init__(self, out: DirectFile, archive: str, alignment: int) -> None:
        self._out, self._archive, self._alignment = out, archive, alignment
        self._entries: list[tuple[bytes, int, int, int]] = []  # name, crc, size, local header offset

    def write_record(self, name: str, data: Any, size: int) -> None:
        if isinstance(data, str):
            data = data.encode("utf-8")
        view = memoryview(data) if isinstance(data, (bytes, bytearray, memoryview)) else _storage_bytes(data)
        view = view.cast("B")[:size]
        crc = _crc32(view)
        filename = f"{self._archive}/{name}".encode("ascii")
        offset = self._out.tell()
        zip64 = size >= _ZIP64_LIMIT
        extra = struct.pack("<HHQQ", 1, 16, size, size) if zip64 else b""
        fixed = 30 + len(filename) + len(extra) + 4  # with the padding field's own header
        pad = -(offset + fixed) % self._alignment
        extra += struct.pack("<HH", _PADDING_ID, pad) + b"Z" * pad
        shown = 0xFFFFFFFF if zip64 else size
        version = _ZIP64_VERSION if zip64 else _STORED_VERSION
        header = struct.pack("<IHHHHHIIIHH", 0x04034B50, version, 0, 0, 0, _DOS_DATE, crc, shown, shown,
                             len(filename), len(extra))  # fmt: skip
        self._out.write(header + filename + extra)
        self._out.write(view)
        self._entries.append((filename, crc, size, offset))

    def write_record_metadata(self, name: str, size: int) -> None:
        raise NotImplementedError("hflight's torch file writer writes the data (torch's skip_data is not supported)")

    def close(self, records: list[tuple[str, bytes | None]]) -> None:
        """The records torch's writer adds at the end (None: a serialization id of this file's own), then the
        directory."""
        for name, data in records:
            if data is None:
                data = f"{uuid.uuid4().int:040d}"[:40].encode("ascii")
            self.write_record(name, data, len(data))
        start = self._out.tell()
        for filename, crc, size, offset in self._entries:
            large_size, large_offset = size >= _ZIP64_LIMIT, offset >= _ZIP64_LIMIT
            wide = ([size, size] if large_size else []) + ([offset] if large_offset else [])
            extra = struct.pack(f"<HH{len(wide)}Q", 1, 8 * len(wide), *wide) if wide else b""
            version = _ZIP64_VERSION if wide else _STORED_VERSION
            shown_size = 0xFFFFFFFF if large_size else size
            shown_offset = 0xFFFFFFFF if large_offset else offset
            self._out.write(struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, version, version, 0, 0, 0, _DOS_DATE, crc,
                                        shown_size, shown_size, len(filename), len(extra), 0, 0, 0, 0, shown_offset)
                            + filename + extra)  # fmt: skip
        end = self._out.tell()
        count, length = len(self._entries), end - start
        if count >= 0xFFFF or start >= _ZIP64_LIMIT or length >= _ZIP64_LIMIT:
            self._out.write(struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, _ZIP64_VERSION, _ZIP64_VERSION, 0, 0, count,
                                        count, length, start))  # fmt: skip
            self._out.write(struct.pack("<IIQI", 0x07064B50, 0, end, 1))
            count, length, start = min(count, 0xFFFF), min(length, 0xFFFFFFFF), min(start, 0xFFFFFFFF)
        self._out.write(struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, length, start, 0))


def save(obj: Any, path: str | os.PathLike, hasher: Any = None) -> bool:
    """``torch.save(obj, path)``, written front to back without holding the interpreter lock for the tensor bytes
    and past the page cache where the file system allows it (see the module). ``hasher``: given every byte of the
    file (``update``), so its checksum needs no second read. Returns whether it was (False: ``torch.save`` wrote the
    file, ``hasher`` untouched)."""
    records = _torch_records()
    if records is None:
        torch.save(obj, path)
        return False
    _write(obj, path, hasher, records)
    return True


def _write(obj: Any, path: str | os.PathLike, hasher: Any, records: list[tuple[str, bytes | None]]) -> None:
    """``obj``'s archive into ``path`` through this module's writer, ending with ``records`` (torch's end records)."""
    archive = os.path.splitext(os.path.basename(os.fspath(path)))[0] or "archive"
    with DirectFile(path, hasher) as out:
        _write_archive(obj, out, archive, records)


def _write_archive(obj: Any, out: Any, archive: str, records: list[tuple[str, bytes | None]]) -> None:
    """``obj``'s archive, named ``archive`` inside, written into ``out`` (``write``, ``tell``)."""
    writer = _ZipRecords(out, archive, _alignment())
    torch.serialization._save(obj, writer, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    writer.close(records)
