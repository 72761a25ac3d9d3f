"""``checkpoint-N/data_position.pt``: where the training data was when the checkpoint was taken, so that a resumed run
continues the data from there rather than reading and dropping every batch the run had already trained on
(transformers' way, which for a stream costs as much as the data read so far: its issue 11284 waited 28 hours).

The file is ``torch.save`` of a dict of plain values and tensors (loaded with ``weights_only=True``: nothing in it runs
code; written only after it is seen to load so), checksummed in the manifest like every file of the folder:

- ``format``, ``version``, ``global_step``;
- ``dataset``: the training dataset as :func:`describe` sees it (its type, whether it is map-style or iterable, its
  length or number of shards, its features, the shape of its own state) and their ``fingerprint``, which a resume
  compares with its own training dataset's before anything is loaded;
- ``loader``: how the training loader read it (``how``: ``sampler``, batches drawn by a sampler from a map-style
  dataset; ``dispatched``, process 0 reads the stream and sends each process its slice; ``per_process``, each process
  reads its own), its ``num_workers``, batch size and number of data-parallel replicas;
- ``ranks``: one entry per data-parallel replica, in rank order: the ``epoch`` (pass over the data) and the
  ``batches`` of it trained when the checkpoint was taken, whether that was the pass's last (``end_of_pass``), and
  ``state``: the training loader's own ``state_dict()`` (torchdata's ``StatefulDataLoader``: each worker's dataset
  state, its sampler's position), or None where the position is the batch count alone (a sampler's) or the replica
  reads nothing (dispatched, processes other than 0).

transformers ignores the file (and resumes as it always did). A checkpoint without it (transformers', an older
hflight's, ``save_only_model``) resumes by skipping the trained batches. The run side (what a loader saves and how it
continues) is ``hflight.run.position``.

May import: ``hflight.checkpoints.writers.files``, ``hflight.checkpoints.names``.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

from hflight.checkpoints.names import DATA_POSITION_NAME
from hflight.checkpoints.writers.files import UnsafeCheckpointFile, load_tensors_file

FORMAT = "hflight-data-position"
VERSION = 1
#: the keys a replica's entry has, and their types
_ENTRY = {"epoch": int, "batches": int, "end_of_pass": bool}


def describe(dataset: Any, iterated: Any = None) -> dict[str, Any]:
    """The training dataset as a position is tied to it: its type, kind (``map``/``iterable``), length or number of
    shards, features, the shape of its own ``state_dict()`` (the keys and node types of a ``datasets`` stream's
    pipeline: another ``map``/``filter``/``batch`` is another shape), what a ``datasets`` stream reads (its source
    datasets' and files' content, not where they lie), whether it shuffles through a buffer, whether the dataset the
    loader iterates (``iterated``: the process's part of it, say) has a state of its own, and a ``fingerprint`` of all
    of them."""
    from torch.utils.data import IterableDataset

    kind = "iterable" if isinstance(dataset, IterableDataset) else "map"
    description: dict[str, Any] = {"type": f"{type(dataset).__module__}.{type(dataset).__qualname__}", "kind": kind}
    try:
        description["length"] = len(dataset) if kind == "map" else None
    except TypeError:
        description["length"] = None
    shards = getattr(dataset, "num_shards", None)
    description["num_shards"] = shards if isinstance(shards, int) else None
    features = getattr(dataset, "features", None)
    description["features"] = repr(features) if features is not None else None
    description["state_shape"] = _state_shape(dataset) if kind == "iterable" else None
    description["shuffle_buffer"] = _shuffles_in_a_buffer(dataset)
    description["stateful"] = stateful(iterated if iterated is not None else dataset) if kind == "iterable" else None
    description["source"] = _source(dataset)
    text = json.dumps(description, sort_keys=True, default=str)
    description["fingerprint"] = _digest(text)
    return description


def stateful(dataset: Any) -> bool:
    """Whether ``dataset`` keeps its own position (torchdata's ``Stateful``: ``state_dict()`` and
    ``load_state_dict()``); a stream without one can only be counted through (torchdata's fast-forward)."""
    return callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))


def _state_shape(dataset: Any) -> Any:
    """The keys of ``dataset.state_dict()`` and the node types it names, none of its positions (None: it has none)."""
    state_dict = getattr(dataset, "state_dict", None)
    if not callable(state_dict):
        return None
    try:
        return _shape(state_dict())
    except Exception:  # noqa: BLE001 - a state the dataset cannot give before it is iterated: no shape to compare
        return None


def _nodes(dataset: Any) -> list[Any]:
    """A ``datasets`` stream's pipeline nodes (its ``_ex_iterable`` and those it reads), which nothing public lists."""
    found, pending = [], [getattr(dataset, "_ex_iterable", None)]
    while pending and len(found) < 100:
        node = pending.pop()
        if node is not None:
            found.append(node)
            pending += [getattr(node, "ex_iterable", None), *(getattr(node, "ex_iterables", None) or [])]
    return found


def _source(dataset: Any) -> list[Any] | None:
    """What a ``datasets`` stream reads: the fingerprints of the datasets it was made from (``to_iterable_dataset``),
    the files it streams (``load_dataset(..., streaming=True)``), its builder and config; None for another dataset."""
    nodes = _nodes(dataset)
    if not nodes:
        return None
    info = getattr(dataset, "info", None)
    found: list[Any] = [getattr(info, "builder_name", None), getattr(info, "config_name", None)]
    for node in nodes:
        for key, value in sorted((getattr(node, "kwargs", None) or {}).items()):
            found.append([key, _identity(value)])
    return found


#: of a list of source datasets or files, how many have their content read (the first, the last, evenly between):
#: the others are told by their size (a resume and a training start read a few rows, not every shard's)
_CONTENT_SAMPLES = 8


def _identity(value: Any, content: bool = True) -> Any:
    """What a pipeline node reads, by content rather than by place: a ``datasets.Dataset`` by its rows (its
    fingerprint is random where datasets could not hash a ``map`` function, and tied to its files' paths), a local file
    by its name, size and ends (the same data staged to another folder is the same data); ``content``: read (else
    its size alone: in a list, :data:`_CONTENT_SAMPLES` of the items are read)."""
    if hasattr(value, "_fingerprint") and hasattr(value, "num_rows"):
        return _rows_identity(value) if content else ["rows", value.num_rows]
    if isinstance(value, (list, tuple)) or type(value).__name__ == "DataFilesList":
        items = list(value)[:1000]
        read = {round(i * (len(items) - 1) / max(_CONTENT_SAMPLES - 1, 1)) for i in range(_CONTENT_SAMPLES)}
        return [_identity(each, content and index in read) for index, each in enumerate(items)]
    if isinstance(value, str) and os.path.isfile(value):
        return _file_identity(value, content)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return type(value).__name__


def _rows_identity(dataset: Any) -> list[Any]:
    """A ``datasets.Dataset``: its number of rows, features and a digest of its first, middle and last rows as Arrow
    stores them (decoded values, an image's, say, may print differently each time)."""
    rows = dataset.num_rows
    picked = sorted({0, rows // 2, rows - 1}) if rows else []
    digest = _digest(repr(dataset.features))
    if picked:
        import pyarrow as pa

        table = dataset.with_format("arrow")[picked]
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
        digest = _digest(digest + sink.getvalue().to_pybytes().hex())
    return ["rows", rows, digest]


def _file_identity(path: str, content: bool = True) -> list[Any]:
    """A local file: its name, size and (``content``) a digest of its first and last 4 KiB."""
    size = os.path.getsize(path)
    if not content:
        return ["file", os.path.basename(path), size]
    with open(path, "rb") as file:
        head = file.read(1 << 12)
        file.seek(max(size - (1 << 12), 0))
        tail = file.read(1 << 12)
    import xxhash

    return ["file", os.path.basename(path), size, xxhash.xxh3_64_hexdigest(head + tail)]


def _shuffles_in_a_buffer(dataset: Any) -> bool:
    """Whether a ``datasets`` stream shuffles through a buffer (``IterableDataset.shuffle(buffer_size=...)``), whose
    content its state does not hold (datasets refills it on a resume, as it documents): read from its pipeline's
    nodes, which nothing public names."""
    return any(type(node).__name__ == "BufferShuffledExamplesIterable" for node in _nodes(dataset))


def _shape(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): (v if k == "type" and isinstance(v, str) else _shape(v)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_shape(v) for v in value]
    return type(value).__name__


def _digest(text: str) -> str:
    import xxhash

    return xxhash.xxh3_128_hexdigest(text.encode("utf-8"))


def unstorable(value: Any) -> str | None:
    """Why ``value`` (a stream's state) cannot be kept in a file read without running code (a numpy value, an object
    of the dataset's own in its ``state_dict()``), or None: it can."""
    problem = _serialized(value)[1]
    return None if problem is None else _unstorable_why(problem)


def _unstorable_why(problem: str) -> str:
    return (
        f"its stream state holds values a checkpoint file cannot hold without running code when it is read "
        f"({problem}): a dataset's state_dict() must return dicts, lists, numbers, strings and tensors"
    )


def _serialized(value: Any) -> tuple[bytes, str | None]:
    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    try:
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        if "GLOBAL" in str(exc):  # torch's message names the global it refused further down
            first = next((line.strip() for line in str(exc).splitlines() if "GLOBAL" in line), first)
        return b"", f"{type(exc).__name__}: {first}"
    return buffer.getvalue(), None


def write(
    folder: str | os.PathLike,
    global_step: int,
    dataset: dict[str, Any],
    loader: dict[str, Any],
    ranks: list[dict[str, Any]],
    datasets: dict[str, Any] | None = None,
    why: str | None = None,
) -> str | None:
    """``folder/data_position.pt``, once it is seen to load without running code. A stream state that does not (a
    numpy value in a dataset's ``state_dict()``) is left out, the file saying why (``why``), so that a resume reads
    and drops the trained batches as transformers does; returns that reason (None: every state kept). ``datasets``:
    each process's dataset description by fingerprint (``ranks[i]["dataset"]`` names one); ``why``: why the states
    are not to be used, already known."""
    position = {"format": FORMAT, "version": VERSION, "global_step": int(global_step), "dataset": dataset,
                "datasets": datasets or {}, "loader": loader, "ranks": ranks, "why": why}  # fmt: skip
    data, problem = _serialized(position)
    if problem is not None:
        why = _unstorable_why(problem)
        position.update(ranks=[dict(entry, state=None) for entry in ranks], why=why)
        data, _ = _serialized(position)
    with open(Path(folder) / DATA_POSITION_NAME, "wb") as file:
        file.write(data)
    return why if problem is not None else None


def read(folder: str | os.PathLike) -> dict[str, Any] | None:
    """``folder``'s data position (None: the folder has none), loaded without running code and checked for its
    format: a damaged or crafted file is an error naming it and what is wrong (its checksum is the manifest's)."""
    path = Path(folder) / DATA_POSITION_NAME
    if not path.is_file():
        return None
    try:
        position = load_tensors_file(path)
    except UnsafeCheckpointFile as exc:
        raise UnsafeCheckpointFile(f"{exc} Set ignore_data_skip=True to resume without reading it.") from None
    problem = _format_problem(position)
    if problem is not None:
        raise ValueError(
            f"Cannot resume from {folder}: {path.name} is not a data position hflight wrote ({problem}). Set "
            "ignore_data_skip=True to resume without reading it."
        )
    return position


def _format_problem(position: Any) -> str | None:
    if not isinstance(position, dict) or position.get("format") != FORMAT:
        return f"no '{FORMAT}' format key"
    if position.get("version") != VERSION:
        return f"version {position.get('version')!r}, where this hflight reads version {VERSION}"
    for key in ("dataset", "loader"):
        if not isinstance(position.get(key), dict):
            return f"'{key}' is not a mapping"
    if not isinstance(position.get("datasets", {}), dict) or not isinstance(position.get("why") or "", str):
        return "'datasets' is not a mapping or 'why' not a string"
    ranks = position.get("ranks")
    if not isinstance(ranks, list) or not ranks:
        return "'ranks' is not a list of the replicas' positions"
    for index, entry in enumerate(ranks):
        if not isinstance(entry, dict):
            return f"ranks[{index}] is not a mapping"
        for key, kind in _ENTRY.items():
            if not isinstance(entry.get(key), kind) or (kind is int and entry[key] < 0):
                return f"ranks[{index}]['{key}'] is not a {'non-negative integer' if kind is int else kind.__name__}"
        if not isinstance(entry.get("dataset") or "", str):
            return f"ranks[{index}]['dataset'] is not a fingerprint"
    return None


def saved_description(position: dict[str, Any], rank: int | None) -> dict[str, Any]:
    """The description of the dataset process ``rank`` read when the position was saved (each process's own where
    each read its own data; process 0's for a file that holds only that, or for ``rank`` None)."""
    ranks = position["ranks"]
    fingerprint = ranks[rank].get("dataset") if rank is not None and rank < len(ranks) else None
    return position.get("datasets", {}).get(fingerprint) or position["dataset"]


def difference(saved: dict[str, Any], now: dict[str, Any]) -> str | None:
    """Where two dataset descriptions differ, shown at the first place they part (None: the same fingerprint)."""
    if saved.get("fingerprint") == now.get("fingerprint"):
        return None
    keys = ("type", "kind", "length", "num_shards", "features", "state_shape", "shuffle_buffer", "stateful", "source")
    parts = []
    for key in keys:
        if saved.get(key) != now.get(key):
            was, is_ = _where_they_part(_text(saved.get(key)), _text(now.get(key)))
            parts.append(f"{key} {was} where this run's is {is_}")
    return ", ".join(parts) or "another fingerprint"


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def _where_they_part(a: str, b: str, context: int = 30) -> tuple[str, str]:
    """``a`` and ``b`` cut around the first character where they differ (each whole when short)."""
    if len(a) <= 80 and len(b) <= 80:
        return a, b
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    begin = max(first - context, 0)

    def cut(text: str) -> str:
        return ("..." if begin else "") + text[begin : first + context] + ("..." if first + context < len(text) else "")

    return cut(a), cut(b)
