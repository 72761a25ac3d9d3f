"""The inputs of QA post-processing, read and checked: logits, questions, and the windows' offsets.

:func:`read_logits` and :func:`read_inputs` accept what HF's ``utils_qa.postprocess_qa_predictions`` accepts
(``datasets.Dataset``, a dict of columns or a list of row dicts; numpy arrays, CPU tensors or nested lists of
logits) and turn it into flat numpy arrays, raising ``ValueError`` with a message that names the problem (the
column, the feature, the example) instead of failing somewhere inside the computation.

A ``datasets.Dataset``'s ``offset_mapping`` is read straight from its Arrow buffers, chunk by chunk (no Python
objects per token and no copy of the column): :class:`OffsetChunk` holds one chunk's windows.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["OffsetChunk", "QAInputs", "read_inputs", "read_logits"]


# --------------------------------------------------------------------------------------------------------
# Containers
# --------------------------------------------------------------------------------------------------------


def _is_hf_dataset(obj: Any) -> bool:
    mod = sys.modules.get("datasets")
    return mod is not None and isinstance(obj, mod.Dataset)


def column(obj: Any, name: str, what: str) -> Any:
    """Column ``name`` of a ``datasets.Dataset`` (as a pyarrow ChunkedArray), a dict of columns or a list of rows."""
    if _is_hf_dataset(obj):
        if name not in obj.column_names:
            raise ValueError(f"{what} have no {name!r} column (columns: {obj.column_names})")
        return obj.with_format("arrow")[name]
    if isinstance(obj, Mapping) or (
        hasattr(obj, "keys") and hasattr(obj, "__getitem__") and not isinstance(obj, Sequence)
    ):
        if name not in obj:
            raise ValueError(f"{what} have no {name!r} column (keys: {list(obj.keys())})")
        return obj[name]
    if isinstance(obj, Sequence) and not isinstance(obj, (str, bytes)):
        out = []
        for i, row in enumerate(obj):
            if not isinstance(row, Mapping):
                raise TypeError(
                    f"{what} must be a datasets.Dataset, a dict of columns or a list of dicts; "
                    f"row {i} is a {type(row).__name__}"
                )
            if name not in row:
                raise ValueError(f"{what}: row {i} has no {name!r} key (keys: {list(row.keys())})")
            out.append(row[name])
        return out
    raise TypeError(
        f"{what} must be a datasets.Dataset, a dict of columns or a list of dicts, not {type(obj).__name__}"
    )


def optional_column(obj: Any, name: str) -> list | None:
    """Column ``name`` as a list when the container has it (rows without it give None), else None."""
    if _is_hf_dataset(obj):
        return obj.with_format("arrow")[name].to_pylist() if name in obj.column_names else None
    if isinstance(obj, Mapping) or (hasattr(obj, "keys") and not isinstance(obj, Sequence)):
        return to_pylist(obj[name]) if name in obj else None
    if isinstance(obj, Sequence):
        rows = [row.get(name) if isinstance(row, Mapping) else None for row in obj]
        return rows if any(r is not None for r in rows) else None
    return None


def to_pylist(col: Any) -> list:
    if hasattr(col, "to_pylist"):  # pyarrow
        return col.to_pylist()
    if isinstance(col, np.ndarray):
        return col.tolist()
    return list(col)


# --------------------------------------------------------------------------------------------------------
# Logits
# --------------------------------------------------------------------------------------------------------


def _as_logits(x: Any, name: str) -> np.ndarray:
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        x = x.numpy()
    arr = np.asarray(x)
    if arr.dtype == object:
        raise ValueError(f"{name} must be a numeric array, got an object array (ragged rows?)")
    if arr.ndim != 2:
        raise ValueError(f"{name} must have shape [n_features, seq_len], got shape {arr.shape}")
    if arr.dtype.kind != "f":
        # utils_qa would keep integer logits as integers (and then fail to write them to JSON).
        arr = arr.astype(np.float64)
    if not np.isfinite(arr).all():
        # utils_qa would rank NaN and -inf like numbers (NaN sorts last, -inf first) and give NaN probabilities.
        rows = np.flatnonzero(~np.isfinite(arr).all(axis=1))
        kinds = " and ".join(
            kind for kind, hit in (("NaN", np.isnan(arr[rows]).any()), ("infinite", np.isinf(arr[rows]).any())) if hit
        )
        more = " ..." if rows.size > 5 else ""
        raise ValueError(f"{name} contain {kinds} values (features {rows[:5].tolist()}{more}): logits must be finite")
    return arr


def read_logits(predictions: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(start_logits, end_logits)`` as 2-D finite float arrays of the same shape (at least one position)."""
    if isinstance(predictions, Mapping) or not hasattr(predictions, "__len__") or len(predictions) != 2:
        raise ValueError("predictions must be a pair (start_logits, end_logits)")
    start = _as_logits(predictions[0], "start_logits")
    end = _as_logits(predictions[1], "end_logits")
    if start.shape != end.shape:
        raise ValueError(f"start_logits and end_logits shapes differ: {start.shape} vs {end.shape}")
    if start.shape[1] == 0:
        raise ValueError("the logits have no positions (seq_len is 0)")
    return start, end


# --------------------------------------------------------------------------------------------------------
# Offsets
# --------------------------------------------------------------------------------------------------------


@dataclass
class OffsetChunk:
    """The ``offset_mapping`` of features ``lo:hi`` in flat form: token ``t`` of local feature ``f`` is the flat
    token ``row_start[f] + t``; it has offsets when ``tok_valid`` (not ``None``); its (start, end) characters are
    ``values[pair_pos[tok]]`` and ``values[pair_pos[tok] + 1]``."""

    lo: int
    hi: int
    row_start: np.ndarray
    row_len: np.ndarray
    tok_valid: np.ndarray
    pair_pos: np.ndarray
    values: np.ndarray

    def lookup(self, feat: np.ndarray, tok: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(valid, flat token index) for token positions ``tok`` of local features ``feat`` (broadcast)."""
        inside = tok < self.row_len[feat]
        flat = np.where(inside, self.row_start[feat] + tok, 0)
        if self.tok_valid.size == 0:
            return np.zeros(flat.shape, bool), flat
        return inside & self.tok_valid[flat], flat

    def chars(self, flat: np.ndarray, which: int) -> np.ndarray:
        """Start (``which=0``) or end (``which=1``) character of valid flat tokens."""
        return self.values[self.pair_pos[flat] + which]


_OFFSETS_TYPE = None


def _offsets_type() -> Any:
    import pyarrow as pa

    global _OFFSETS_TYPE
    if _OFFSETS_TYPE is None:
        _OFFSETS_TYPE = pa.list_(pa.list_(pa.int64()))
    return _OFFSETS_TYPE


def _dense_offsets(col: np.ndarray, n_features: int) -> list[OffsetChunk]:
    """A dense [F, L, 2] integer array: every token has offsets."""
    if col.ndim != 3 or col.shape[0] != n_features or col.shape[2] != 2:
        raise ValueError(
            f"features['offset_mapping'] as an array must have shape [{n_features}, seq_len, 2], got {col.shape}"
        )
    n_tok = col.shape[0] * col.shape[1]
    chunk = OffsetChunk(
        lo=0,
        hi=n_features,
        row_start=np.arange(n_features, dtype=np.int64) * col.shape[1],
        row_len=np.full(n_features, col.shape[1], np.int64),
        tok_valid=np.ones(n_tok, bool),
        pair_pos=np.arange(n_tok, dtype=np.int64) * 2,
        values=np.ascontiguousarray(col, dtype=np.int64).reshape(-1),
    )
    return [chunk]


def _as_arrow(col: Any) -> Any:
    """Nested Python lists (``None`` outside the context) as one pyarrow array."""
    import pyarrow as pa

    rows = to_pylist(col)
    for f, row in enumerate(rows):
        if row is None:
            raise ValueError(f"feature {f} has no offset_mapping (None)")
    try:
        return pa.array([r.tolist() if isinstance(r, np.ndarray) else r for r in rows])
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as exc:
        raise ValueError(
            f"features['offset_mapping'] must hold, per feature, a list of (start, end) pairs or None: {exc}"
        ) from exc


def _valid_bits(arr: Any) -> np.ndarray:
    """The validity of every entry of a pyarrow array, from its bitmap (all true without one)."""
    bitmap = arr.buffers()[0]
    if bitmap is None or arr.null_count == 0:
        return np.ones(len(arr), bool)
    bits = np.unpackbits(np.frombuffer(bitmap, np.uint8), bitorder="little")
    return bits[arr.offset : arr.offset + len(arr)].astype(bool)


def _arrow_chunk(col: Any, lo: int) -> OffsetChunk:
    """One chunk of a ``list<list<int64>>`` column, checked: no ``None`` feature, only (start, end) pairs."""
    import pyarrow as pa

    if col.type != _offsets_type():
        if pa.types.is_null(col.type) or (len(col) and col.null_count == len(col)):
            raise ValueError(f"feature {lo} has no offset_mapping (None)")
        try:
            col = col.cast(_offsets_type())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
            raise ValueError(
                "features['offset_mapping'] must hold, per feature, a list of (start, end) integer pairs or None; "
                f"got arrow type {col.type}"
            ) from exc
    if col.null_count:
        f = int(np.flatnonzero(~_valid_bits(col))[0])
        raise ValueError(f"feature {lo + f} has no offset_mapping (None)")
    outer = col.offsets.to_numpy().astype(np.int64)
    inner = col.values
    inner_off = inner.offsets.to_numpy()
    tok_valid = _valid_bits(inner)
    values = inner.values
    if values.null_count:
        raise ValueError("features['offset_mapping'] has a (start, end) pair with a None inside")
    used = slice(int(outer[0]), int(outer[-1]))
    bad = tok_valid[used] & (np.diff(inner_off[used.start : used.stop + 1]) != 2)
    if bad.any():
        t = int(np.flatnonzero(bad)[0]) + used.start
        f = int(np.searchsorted(outer, t, side="right") - 1)
        raise ValueError(f"feature {lo + f}: offset_mapping entry {t - outer[f]} is not a (start, end) pair")
    return OffsetChunk(
        lo=lo,
        hi=lo + len(col),
        row_start=outer[:-1],
        row_len=np.diff(outer),
        tok_valid=tok_valid,
        pair_pos=inner_off[:-1],
        values=values.to_numpy(zero_copy_only=False),
    )


def read_offsets(col: Any, n_features: int) -> list[OffsetChunk]:
    """An ``offset_mapping`` column (arrow, nested lists with ``None``, or a dense [F, L, 2] array) as chunks."""
    import pyarrow as pa

    if isinstance(col, np.ndarray) and col.dtype != object:
        return _dense_offsets(col, n_features)
    if not isinstance(col, (pa.Array, pa.ChunkedArray)):
        col = _as_arrow(col)
    if len(col) != n_features:
        raise ValueError(f"features['offset_mapping'] has {len(col)} rows for {n_features} features")
    chunks, lo = [], 0
    for part in col.chunks if isinstance(col, pa.ChunkedArray) else [col]:
        if len(part):
            chunks.append(_arrow_chunk(part, lo))
            lo += len(part)
    return chunks


def _max_context_mask(rows: list | None, n_features: int, width: int) -> np.ndarray | None:
    """Optional ``token_is_max_context`` ({str(token index): bool} per feature) as a [F, width] mask."""
    if rows is None or all(r is None for r in rows):
        return None
    if len(rows) != n_features:
        raise ValueError(f"features['token_is_max_context'] has {len(rows)} rows for {n_features} features")
    mask = np.ones((n_features, width), bool)
    for f, row in enumerate(rows):
        if row is None:  # utils_qa applies no filter to this feature
            continue
        mask[f] = False
        for key, flag in row.items():
            try:
                i = int(key)
            except (TypeError, ValueError):
                continue
            if flag and str(i) == str(key) and 0 <= i < width:
                mask[f, i] = True
    return mask


# --------------------------------------------------------------------------------------------------------
# Questions and windows
# --------------------------------------------------------------------------------------------------------


@dataclass
class QAInputs:
    """Questions and windows, read and checked: ``feat2ex[f]`` is the question of window ``f``."""

    example_ids: list
    contexts: list[str]
    feat2ex: np.ndarray
    offsets: list[OffsetChunk]
    max_context: np.ndarray | None  # [n_features, width] or None

    @property
    def n_examples(self) -> int:
        return len(self.example_ids)


def _example_index(example_ids: list, contexts: list) -> dict:
    index = {}
    for i, eid in enumerate(example_ids):
        if eid in index:
            raise ValueError(f"duplicate example id {eid!r} (examples {index[eid]} and {i})")
        index[eid] = i
    _check_contexts(example_ids, contexts)
    return index


def _check_contexts(example_ids: list, contexts: list) -> None:
    for i, ctx in enumerate(contexts):
        if not isinstance(ctx, str):
            raise ValueError(f"example {example_ids[i]!r}: context must be a string, got {type(ctx).__name__}")


def _feature_to_example(feature_ids: list, index: dict) -> np.ndarray:
    try:
        return np.fromiter((index[e] for e in feature_ids), np.int64, len(feature_ids))
    except KeyError as exc:
        raise ValueError(f"a feature's example_id {exc.args[0]!r} is not the id of any example") from None
    except TypeError:  # unhashable id
        bad = next(e for e in feature_ids if not isinstance(e, collections.abc.Hashable))
        raise ValueError(f"a feature's example_id {bad!r} is not the id of any example") from None


def _is_arrow_strings(col: Any) -> bool:
    import pyarrow as pa

    return isinstance(col, (pa.Array, pa.ChunkedArray)) and (
        pa.types.is_string(col.type) or pa.types.is_large_string(col.type)
    )


def _arrow_feature_to_example(example_col: Any, feature_col: Any) -> np.ndarray | None:
    """``feat2ex`` computed by Arrow for string id columns without nulls; None when they do not qualify or when
    an id is duplicate or unknown (the Python path then names it)."""
    import pyarrow.compute as pc

    if not (_is_arrow_strings(example_col) and _is_arrow_strings(feature_col)):
        return None
    if example_col.null_count or pc.count_distinct(example_col).as_py() != len(example_col):
        return None
    values = example_col.combine_chunks() if hasattr(example_col, "combine_chunks") else example_col
    index = pc.index_in(feature_col, value_set=values)
    if index.null_count:
        return None
    return np.asarray(index).astype(np.int64)


def _check_coverage(example_ids: list, feat2ex: np.ndarray) -> None:
    """Every question needs a window: one without any would silently get no answer (scored as wrong)."""
    missing = np.flatnonzero(np.bincount(feat2ex, minlength=len(example_ids)) == 0)
    if missing.size:
        shown = ", ".join(repr(example_ids[i]) for i in missing[:5]) + (" ..." if missing.size > 5 else "")
        raise ValueError(
            f"{missing.size} of {len(example_ids)} examples have no feature (window): {shown}. The features must be "
            "the windows of these examples (prepare_validation_features on the same examples, no window dropped)."
        )


def _check_sizes(n_examples: int, n_feature_rows: int, n_features: int) -> None:
    if not n_examples and not n_feature_rows:
        raise ValueError(f"nothing to post-process: examples and features are empty ({n_features} rows of logits)")
    if not n_examples:
        raise ValueError(f"examples are empty, but there are {n_feature_rows} features: pass the examples too")
    if not n_feature_rows:
        raise ValueError(
            f"features are empty (no windows) for {n_examples} examples: pass the windows of the examples "
            "(prepare_validation_features)"
        )
    if n_feature_rows != n_features:
        raise ValueError(f"Got {n_features} predictions (logit rows) and {n_feature_rows} features")


def read_inputs(examples: Any, features: Any, n_features: int, width: int) -> QAInputs:
    """Questions (``id``, ``context``) and windows (``example_id``, ``offset_mapping``, optional
    ``token_is_max_context``) for ``n_features`` rows of logits of ``width`` positions.

    Raises:
        ValueError: empty inputs, missing columns, unknown or duplicate ids, an example without any window,
            a feature count that is not the logits' row count, malformed offsets.
        TypeError: an unsupported container.
    """
    id_col, context_col = column(examples, "id", "examples"), column(examples, "context", "examples")
    feature_col, offsets_col = (
        column(features, "example_id", "features"),
        column(features, "offset_mapping", "features"),
    )
    _check_sizes(len(id_col), len(feature_col), n_features)
    example_ids, contexts = to_pylist(id_col), to_pylist(context_col)
    feat2ex = _arrow_feature_to_example(id_col, feature_col)
    if feat2ex is None:
        feat2ex = _feature_to_example(to_pylist(feature_col), _example_index(example_ids, contexts))
    elif not _is_arrow_strings(context_col):
        _check_contexts(example_ids, contexts)
    _check_coverage(example_ids, feat2ex)
    return QAInputs(
        example_ids=example_ids,
        contexts=contexts,
        feat2ex=feat2ex,
        offsets=read_offsets(offsets_col, n_features),
        max_context=_max_context_mask(optional_column(features, "token_is_max_context"), n_features, width),
    )
