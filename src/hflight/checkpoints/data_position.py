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

May import: ``hflight.checkpoints.files``, ``hflight.checkpoints.names``.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

from hflight.checkpoints.files import load_tensors_file
from hflight.checkpoints.names import DATA_POSITION_NAME

FORMAT = "hflight-data-position"
VERSION = 1
#: the keys a replica's entry has, and their types
_ENTRY = {"epoch": int, "batches": int, "end_of_pass": bool}


def describe(dataset: Any) -> dict[str, Any]:
    """The training dataset as a position is tied to it: its type, kind (``map``/``iterable``), length or number of
    shards, features, the shape of its own ``state_dict()`` (the keys and node types of a ``datasets`` stream's
    pipeline: another ``map``/``filter``/``batch`` is another shape), what a ``datasets`` stream reads (its source
    datasets' fingerprints, its files), and a ``fingerprint`` of all of them."""
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
    description["source"] = _source(dataset)
    text = json.dumps(description, sort_keys=True, default=str)
    description["fingerprint"] = _digest(text)
    return description


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


def _identity(value: Any) -> Any:
    if hasattr(value, "_fingerprint"):
        return value._fingerprint
    if isinstance(value, (list, tuple)) or type(value).__name__ == "DataFilesList":
        return [_identity(each) for each in list(value)[:1000]]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return type(value).__name__


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


def write(folder: str | os.PathLike, global_step: int, dataset: dict[str, Any], loader: dict[str, Any],
          ranks: list[dict[str, Any]]) -> None:  # fmt: skip
    """``folder/data_position.pt``, once it is seen to load without running code (a state that does not, a numpy
    array or an object of the dataset's own in its ``state_dict()``, is an error naming what to change)."""
    import torch

    position = {"format": FORMAT, "version": VERSION, "global_step": int(global_step), "dataset": dataset,
                "loader": loader, "ranks": ranks}  # fmt: skip
    buffer = io.BytesIO()
    torch.save(position, buffer)
    try:
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception as exc:
        raise ValueError(
            f"The training data's position ({dataset['type']}: its loader's state_dict()) holds values a checkpoint "
            f"file cannot hold without running code when it is read ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}): a dataset's state_dict() must return dicts, lists, "
            "numbers, strings and tensors."
        ) from None
    with open(Path(folder) / DATA_POSITION_NAME, "wb") as file:
        file.write(buffer.getvalue())


def read(folder: str | os.PathLike) -> dict[str, Any] | None:
    """``folder``'s data position (None: the folder has none), loaded without running code and checked for its
    format: a damaged or crafted file is an error naming it and what is wrong (its checksum is the manifest's)."""
    path = Path(folder) / DATA_POSITION_NAME
    if not path.is_file():
        return None
    position = load_tensors_file(path)
    problem = _format_problem(position)
    if problem is not None:
        raise ValueError(f"Cannot resume from {folder}: {path.name} is not a data position hflight wrote ({problem}).")
    return position


def _format_problem(position: Any) -> str | None:
    if not isinstance(position, dict) or position.get("format") != FORMAT:
        return f"no '{FORMAT}' format key"
    if position.get("version") != VERSION:
        return f"version {position.get('version')!r}, where this hflight reads version {VERSION}"
    for key in ("dataset", "loader"):
        if not isinstance(position.get(key), dict):
            return f"'{key}' is not a mapping"
    ranks = position.get("ranks")
    if not isinstance(ranks, list) or not ranks:
        return "'ranks' is not a list of the replicas' positions"
    for index, entry in enumerate(ranks):
        if not isinstance(entry, dict):
            return f"ranks[{index}] is not a mapping"
        for key, kind in _ENTRY.items():
            if not isinstance(entry.get(key), kind) or (kind is int and entry[key] < 0):
                return f"ranks[{index}]['{key}'] is not a {'non-negative integer' if kind is int else kind.__name__}"
    return None


def check_processes(position: dict[str, Any], processes: int, path: str | os.PathLike) -> None:
    """A position of a stream each process read its own part of continues only on as many processes, or a
    ``ValueError`` naming both counts and what to do (checked before the dataset: split by node for another count, the
    part is another dataset, and this is why)."""
    saved = len(position["ranks"])
    if position["loader"].get("how") != "per_process" or saved == processes:
        return
    raise ValueError(
        f"{path}: the data position was saved by {saved} process(es) each reading its own part of a stream, and this "
        f"run has {processes}: each part's position is its own, and the parts cannot be dealt again without "
        f"repeating or dropping examples. Resume on {saved} process(es), or set ignore_data_skip=True to start the "
        "data over (a stream dispatched from process 0, dispatch_batches=True, continues on any number)."
    )


def check_dataset(position: dict[str, Any], dataset: Any, path: str | os.PathLike) -> None:
    """The position was saved for this dataset (the same :func:`describe`), or a ``ValueError`` naming both and what
    to do, before anything is loaded."""
    saved, now = position["dataset"], describe(dataset)
    if saved.get("fingerprint") == now["fingerprint"]:
        return
    differs = [key for key in ("type", "kind", "length", "num_shards", "features", "state_shape", "source")
               if saved.get(key) != now.get(key)]  # fmt: skip
    shown = ", ".join(f"{key} {_shown(saved.get(key))} where this run's is {_shown(now.get(key))}" for key in differs)
    raise ValueError(
        f"{path}: the data position was saved for another training dataset ({shown or 'another fingerprint'}). "
        "Resume with the dataset the checkpoint was trained on, or set ignore_data_skip=True to start this dataset's "
        "data from its beginning (the run then trains on other data than the run that wrote the checkpoint)."
    )


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."
