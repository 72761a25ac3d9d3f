"""The model's safetensors files in a checkpoint, written as the safetensors library writes them, past the page cache
and hashed as they are written.

A checkpoint's ``model.safetensors`` (and its shards) comes from transformers' ``save_pretrained``, which hands each
file to ``safetensors.torch.save_file``: the bytes go into the page cache, and the checkpoint job then fsyncs the
file and reads it back to hash it (on a machine whose page cache fills faster than its disk writes, the fsync is most
of a durable save's cost). While a step of a checkpoint job runs with a digest sink (:func:`hashed_into`), the
``save_file`` that transformers' ``modeling_utils`` calls on that thread writes the same file through
:class:`~hflight.checkpoints.writers.direct_file.DirectFile` instead (``O_DIRECT`` where the file system takes it),
hashing every byte on the way: the job's fsync then has only the metadata left, and nothing is read back. Any other
caller, and any other thread, gets safetensors' own ``save_file``.

The file is one safetensors could have written, byte for byte. The header (names, dtypes, shapes, offsets, metadata,
padding) is laid out in the order safetensors gives it, read from the header safetensors writes for the same names,
dtypes and metadata with empty tensors (a few hundred bytes); that header is written back by this module's serializer
and compared with safetensors' byte for byte before it is used (a difference: safetensors writes the file). At first
use a probe state is written both ways and compared whole. (safetensors itself orders several metadata keys anew in
each call: two of its own files of the same tensors may differ there; transformers' metadata has one key.) Tensors
safetensors would refuse or treat specially (sharing storage, not contiguous, sparse, a subclass) and big-endian hosts
go to safetensors' ``save_file``, which refuses or writes them as it does.

May import: ``hflight.checkpoints.writers.direct_file``, ``hflight.checkpoints.manifest``.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import math
import os
import struct
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hflight.checkpoints.writers.direct_file import DirectFile

logger = logging.getLogger(__name__)

#: safetensors pads its header with spaces to a multiple of this
_HEADER_ALIGNMENT = 8
_METADATA_KEY = "__metadata__"

# the digest sink of the checkpoint step running on each thread (hashed_into)
_route = threading.local()
_install_lock = threading.Lock()


# what transformers' modeling_utils called before install() (safetensors' own, or a function someone put there)
_replaced: Callable[..., None] | None = None


def _original_save_file() -> Callable[..., None]:
    if _replaced is not None:
        return _replaced
    from safetensors.torch import save_file

    return save_file


def _serialized(header: dict[str, Any]) -> bytes:
    """A header as safetensors writes it: compact JSON, its 8-byte little-endian length before it, padded with
    spaces."""
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % _HEADER_ALIGNMENT)
    return struct.pack("<Q", len(text)) + text


def _safetensors_header(blob: bytes) -> tuple[dict[str, Any], bytes]:
    """The parsed header of a safetensors file's bytes (keys in the file's order), and its raw bytes with the length."""
    (length,) = struct.unpack("<Q", blob[:8])
    raw = blob[: 8 + length]
    return json.loads(raw[8:].decode("utf-8")), raw


def _plain(tensors: dict[str, Any]) -> bool:
    """Whether every tensor is one this module writes as safetensors does: a dense, contiguous, plain tensor of a dtype
    whose header entries this module gives as safetensors does (:func:`_dtype_agrees`), its bytes its elements (no
    lazy conjugate or negative bit: safetensors writes the memory as it lies), no two sharing storage (safetensors
    refuses those, or drops duplicates: its own ``save_file`` decides)."""
    seen: set[tuple[Any, int]] = set()
    for tensor in tensors.values():
        if type(tensor) is not torch.Tensor or tensor.layout != torch.strided or not tensor.is_contiguous():
            return False
        if tensor.is_quantized or tensor.device.type == "meta" or tensor.is_conj() or tensor.is_neg():
            return False
        if not _dtype_agrees(tensor.dtype):
            return False
        if tensor.numel():
            storage = (tensor.device, tensor.untyped_storage().data_ptr())
            if storage in seen:
                return False
            seen.add(storage)
    return True


def _layout(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> bytes | None:
    """The header safetensors writes for ``tensors``: the order and the metadata from safetensors' header of their
    empty twins, the shapes and offsets of the tensors themselves; None where this module's serializer does not give
    safetensors' bytes for the twins."""
    from safetensors.torch import save

    twins = {name: torch.empty(0, dtype=tensor.dtype) for name, tensor in tensors.items()}
    header, raw = _safetensors_header(save(twins, metadata=metadata))
    if _serialized(header) != raw:
        return None
    offset = 0
    for name, entry in header.items():
        if name == _METADATA_KEY:
            continue
        tensor = tensors[name]
        nbytes = tensor.numel() * tensor.element_size()
        entry["shape"], entry["data_offsets"] = list(tensor.shape), [offset, offset + nbytes]
        offset += nbytes
    return _serialized(header)


def _bytes_of(tensor: torch.Tensor) -> Any:
    """A contiguous tensor's bytes in host memory (copied from a device), as a numpy array of bytes."""
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.view(torch.uint8).numpy()


def _write(tensors: dict[str, torch.Tensor], out: Any, header: bytes) -> None:
    """The file into ``out`` (``write``): the header, then each tensor's bytes in its order."""
    order = [name for name in json.loads(header[8:].decode("utf-8")) if name != _METADATA_KEY]
    out.write(header)
    for name in order:
        if tensors[name].numel():
            out.write(_bytes_of(tensors[name]))


def _probe() -> dict[str, torch.Tensor]:
    """Tensors of several dtypes and sizes, names out of order, an empty and a 0-d one (no random numbers drawn)."""
    return {
        "z.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "a.bias": torch.arange(5, dtype=torch.bfloat16),
        "m.half": torch.arange(6, dtype=torch.float16).reshape(2, 3),
        "ids": torch.arange(7, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "bytes": torch.arange(9, dtype=torch.uint8),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
    }


#: the shapes a dtype's probe holds: 2-d, 1-d, 0-d and empty (safetensors counts the elements of some dtypes its own
#: way: a ``float4_e2m1fn_x2`` of shape (2, 3) is ``"shape":[2,6]`` in its header)
_PROBE_SHAPES = ((2, 3), (5,), (), (0, 2))


@functools.cache
def _dtype_agrees(dtype: torch.dtype) -> bool:
    """Whether this module writes tensors of ``dtype`` as safetensors does: a probe of each of :data:`_PROBE_SHAPES`,
    its bytes made from a count, written both ways and compared whole (checked once per dtype). False where
    safetensors refuses the dtype (its ``save_file`` then raises its own error), or writes another header (the tensor
    goes to safetensors, which writes it its way)."""
    from safetensors.torch import save

    try:
        size = torch.empty(0, dtype=dtype).element_size()
        probe = {
            f"t{index}": (torch.arange(size * math.prod(shape), dtype=torch.int64) % 251).to(torch.uint8)
            .view(dtype).reshape(shape)
            for index, shape in enumerate(_PROBE_SHAPES)
        }  # fmt: skip
        theirs = save(probe)
    except Exception:  # noqa: BLE001 - a dtype torch cannot view bytes as, or safetensors refuses: safetensors' own
        return False
    if _in_memory(probe, None) != theirs:
        logger.debug(f"{dtype}: safetensors' header differs from this module's; its save_file writes such tensors.")
        return False
    return True


@functools.cache
def _agrees() -> bool:
    """Whether this module's file equals safetensors' for a probe state, byte for byte (checked once)."""
    if sys.byteorder != "little":
        return False
    from safetensors.torch import save

    probe, metadata = _probe(), {"format": "pt"}  # one key: safetensors orders several keys anew in each call
    ours = _in_memory(probe, metadata)
    if ours is None:
        return _differs("its header is serialized otherwise")
    if ours != save(probe, metadata=metadata):
        return _differs("the bytes of a probe state differ")
    return True


def _in_memory(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> bytes | None:
    """This module's file of ``tensors`` as bytes, in memory (a probe runs inside a run, whose folders nothing else may
    touch); None where it gives no header for them."""
    header = _layout(tensors, metadata)
    if header is None:
        return None
    ours = io.BytesIO()
    _write(tensors, ours, header)
    return ours.getvalue()


def _differs(why: str) -> bool:
    logger.warning(f"safetensors' save_file writes the checkpoints' model files: hflight's writer does not give this "
                   f"safetensors' file ({why}).")  # fmt: skip
    return False


def save(
    tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str] | None, hasher: Any
) -> bool:
    """``safetensors.torch.save_file(tensors, path, metadata)``, written by this module with every byte given to
    ``hasher`` (``update``); returns False, having written nothing, where safetensors must write it (see the module)."""
    if not isinstance(tensors, dict) or not _plain(tensors) or not _agrees():
        return False
    try:
        header = _layout(tensors, metadata)
    except Exception:  # noqa: BLE001 - metadata or names safetensors refuses: its save_file says why
        return False
    if header is None:
        return False
    with DirectFile(path, hasher) as out:
        _write(tensors, out, header)
    return True


def save_file(tensors: dict[str, torch.Tensor], filename: str | os.PathLike, metadata: dict[str, str] | None = None):
    """``safetensors.torch.save_file``: inside :func:`hashed_into` on this thread, written by :func:`save` and its
    checksum handed to the sink; otherwise, and where :func:`save` declines, the function transformers called before
    (safetensors' own)."""
    sink = getattr(_route, "sink", None)
    if sink is not None:
        elsewhere = getattr(sink, "written_elsewhere", None)
        if elsewhere is not None and elsewhere(tensors, filename, metadata):
            return
        digest = sink.new_digest()
        if save(tensors, filename, metadata, digest):
            sink.add_hashed(filename, digest.hexdigest())
            return
    _original_save_file()(tensors, filename, metadata=metadata)


def install() -> None:
    """transformers' ``modeling_utils`` calls :func:`save_file` (which is safetensors' own outside a checkpoint step);
    called from the thread that makes the checkpoint jobs, before any of their steps runs (once is enough)."""
    global _replaced
    with _install_lock:
        try:
            from transformers import modeling_utils
        except ImportError:  # pragma: no cover - transformers is a dependency
            return
        current = getattr(modeling_utils, "safe_save_file", None)
        if current not in (None, save_file):
            _replaced, modeling_utils.safe_save_file = current, save_file


@contextlib.contextmanager
def hashed_into(sink: Any) -> Iterator[None]:
    """For the block, on this thread: the model's safetensors files are written by this module and their checksums
    given to ``sink`` (``new_digest()``, ``add_hashed(path, digest)``: the job's checksums; and, if it has it,
    ``written_elsewhere(tensors, path, metadata)``: True where another writer, the writer process, wrote the file and
    gave its checksum); a false ``sink`` (or None): nothing changes."""
    if not sink:
        yield
        return
    previous = getattr(_route, "sink", None)
    _route.sink = sink
    try:
        yield
    finally:
        _route.sink = previous
