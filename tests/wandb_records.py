"""Reads a W&B offline run file (``run-<id>.wandb``) without W&B's service: test code.

The file is a LevelDB-style log (the layout of ``wandb/sdk/internal/datastore.py`` in W&B releases up to 0.2x, which
later releases moved into their Go core): a 7-byte header (``:W&B``, key 0xBEE1, version 0), then 32 KiB blocks of
chunks, each a 7-byte header (CRC-32, length, type: 1 full, 2 first, 3 middle, 4 last) and its bytes; a block's tail
shorter than a chunk header is padding. Each record is a protobuf ``wandb.proto.wandb_internal_pb2.Record``, parsed
with W&B's own message classes.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _payloads(data: bytes) -> Iterator[bytes]:
    if not data.startswith(HEADER):
        raise ValueError(f"not a W&B run file (header {data[:7]!r})")
    position, pending = len(HEADER), b""
    while position + 7 <= len(data):
        left_in_block = BLOCK - position % BLOCK
        if left_in_block < 7:  # padding at a block's end
            position += left_in_block
            continue
        checksum, length, kind = struct.unpack("<IHB", data[position : position + 7])
        chunk = data[position + 7 : position + 7 + length]
        if len(chunk) < length:
            break  # a run still being written: its last chunk incomplete
        if zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF != checksum:
            raise ValueError(f"W&B run file: chunk at byte {position} fails its checksum")
        position += 7 + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
            pending = b""


def records(path: Path) -> list:
    """Every record of the run file, as W&B's protobuf ``Record`` messages."""
    from wandb.proto import wandb_internal_pb2

    parsed = []
    for payload in _payloads(Path(path).read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        parsed.append(record)
    return parsed


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def history(path: Path) -> list[dict]:
    """The rows ``wandb.log`` wrote, each a dict of key -> value (``_step``, ``_timestamp`` and ``_runtime`` too)."""
    return [{_key(i): json.loads(i.value_json) for i in r.history.item} for r in records(path) if r.HasField("history")]


def config(path: Path) -> dict:
    """The run's config as its updates left it (key -> value)."""
    values: dict = {}
    for record in records(path):
        if record.HasField("config"):
            for item in record.config.update:
                values[_key(item)] = json.loads(item.value_json)
            for item in record.config.remove:
                values.pop(_key(item), None)
    return values


def run(path: Path):
    """The run record (display name, project, tags, ...)."""
    return next(r.run for r in records(path) if r.HasField("run"))
