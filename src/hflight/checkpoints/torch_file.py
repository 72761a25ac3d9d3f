"""``torch.save``'s file format, written without holding the interpreter lock while the tensor bytes go to disk.

``torch.save`` writes each storage through torch's C++ zip writer with the interpreter lock held: a background
checkpoint write (``save_async``) then stops the training loop's Python for as long as the optimizer's and the
model's bytes take to copy into the page cache (measured: a MiniLM-L6 step of 310 ms took 470 ms while an
``optimizer.pt`` of 180 MB was written beside it). :func:`save` produces the same archive with Python's ``zipfile``
(stored, each data record aligned to 64 bytes as torch aligns it): ``zlib.crc32`` and the file writes release the
lock for large buffers, so the loop runs while the bytes are copied.

The records are torch's own: the pickle, the storages and their keys come from ``torch.serialization._save`` (the
function ``torch.save`` calls), given this module's zip writer in place of torch's; the version record is the one
this torch writes. ``torch.load`` (with ``weights_only``, with ``mmap``) reads the file as it reads ``torch.save``'s.
Where this torch's ``_save`` is not the function this module was written against, :func:`save` is ``torch.save``.

May import: nothing of hflight.
"""

from __future__ import annotations

import functools
import inspect
import io
import os
import pickle
import struct
import uuid
import zipfile
from typing import Any

import torch

#: torch aligns every storage's bytes in its archive to this (``torch.serialization._get_storage_alignment``)
_DEFAULT_ALIGNMENT = 64
#: the id of the extra field that pads a local header so that the record's data is aligned (torch's "FB")
_PADDING_ID = 0x4246
_LOCAL_HEADER = 30  # the fixed part of a zip local file header
_ZIP64_EXTRA = 20  # zipfile's zip64 extra field in a local header
_CHUNK = 64 << 20  # bytes handed to one write (and one crc32), the lock released for each


def _alignment() -> int:
    get = getattr(torch.serialization, "_get_storage_alignment", None)
    return int(get()) if get is not None else _DEFAULT_ALIGNMENT


@functools.cache
def _torch_records() -> dict[str, bytes] | None:
    """The records ``torch.save`` writes itself at the end of an archive (``version``), from an empty save; None
    when this torch's ``_save`` is not the one this module drives."""
    save = getattr(torch.serialization, "_save", None)
    expected = ["obj", "zip_file", "pickle_module", "pickle_protocol", "_disable_byteorder_record"]
    if save is None or list(inspect.signature(save).parameters) != expected:
        return None
    buffer = io.BytesIO()
    torch.save({}, buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as archive:
        records = {info.filename.split("/", 1)[1]: archive.read(info) for info in archive.infolist()}
    return {"version": records["version"]} if "version" in records else None


def _storage_bytes(storage: Any) -> memoryview:
    """A CPU view of an untyped storage's bytes (no copy for a CPU storage)."""
    if storage.device.type != "cpu":
        storage = storage.cpu()
    view = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
    return memoryview(view.numpy())


class _ZipRecords:
    """The writer ``torch.serialization._save`` writes its records to, over ``zipfile``: stored, each record's data
    aligned to ``alignment`` bytes in the file."""

    def __init__(self, handle: Any, archive: str, alignment: int) -> None:
        self._zip = zipfile.ZipFile(handle, "w", zipfile.ZIP_STORED, allowZip64=True)
        self._archive, self._alignment = archive, alignment

    def write_record(self, name: str, data: Any, size: int) -> None:
        if isinstance(data, str):
            data = data.encode("utf-8")
        view = memoryview(data) if isinstance(data, (bytes, bytearray, memoryview)) else _storage_bytes(data)
        view = view.cast("B")[:size]
        info = zipfile.ZipInfo(f"{self._archive}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
        info.compress_type = zipfile.ZIP_STORED
        info.file_size = size
        zip64 = size * 1.05 > zipfile.ZIP64_LIMIT  # zipfile's own test for a record of this size
        start = self._zip.start_dir  # where this record's local header begins
        header = _LOCAL_HEADER + len(info.filename.encode("ascii")) + (_ZIP64_EXTRA if zip64 else 0) + 4
        pad = -(start + header) % self._alignment
        info.extra = struct.pack("<HH", _PADDING_ID, pad) + b"Z" * pad
        with self._zip.open(info, "w", force_zip64=zip64) as out:
            for begin in range(0, size, _CHUNK):
                out.write(view[begin : begin + _CHUNK])

    def write_record_metadata(self, name: str, size: int) -> None:
        raise NotImplementedError("hflight's torch file writer writes the data (torch's skip_data is not supported)")

    def close(self, records: dict[str, bytes]) -> None:
        for name, data in records.items():
            self.write_record(name, data, len(data))
        serialization_id = f"{uuid.uuid4().int:040d}"[:40].encode("ascii")
        self.write_record(".data/serialization_id", serialization_id, len(serialization_id))
        self._zip.close()


def save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj, path)``, the tensor bytes written with the interpreter lock released (see the module)."""
    records = _torch_records()
    if records is None:
        torch.save(obj, path)
        return
    archive = os.path.splitext(os.path.basename(os.fspath(path)))[0] or "archive"
    with open(path, "wb") as handle:
        writer = _ZipRecords(handle, archive, _alignment())
        torch.serialization._save(obj, writer, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
        writer.close(records)
