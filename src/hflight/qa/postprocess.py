"""Turn start/end logits of extractive-QA windows into answer texts, vectorised with numpy.

:func:`postprocess_qa_predictions` has the signature and the results of ``postprocess_qa_predictions`` in
Hugging Face's ``examples/pytorch/question-answering/utils_qa.py`` (the post-processing behind
``run_qa.py``), answer for answer and including its tie-breaking, its ``"empty"`` fallback and its
SQuAD 2.0 null handling, but without a Python loop over candidate spans:

* the ``n_best_size`` best start and end positions of every window are taken in the order
  ``np.argsort(logits)[::-1][:n_best_size]`` gives, ties included (rows without ties use a partition,
  rows with ties the very same ``np.argsort``);
* every window gets an ``[n_best, n_best]`` start x end grid, masked where a span is not allowed (a
  position outside the context or past the window's offsets, ``end < start``, longer than
  ``max_answer_length``, or a start without maximal context when ``token_is_max_context`` is given);
  the allowed cells of a whole batch of windows are scored at once (``start + end`` in the logits'
  dtype, so ties between sums are the loop's) and sorted by (window, score descending, start rank, end
  rank) with one packed integer key per span; each window keeps its ``n_best_size`` best;
* each question keeps the ``n_best_size`` best spans over its windows with a stable sort by score,
  which is the order Python's stable ``sorted(..., reverse=True)`` gives the loop (equal scores keep
  window order, then start rank, then end rank);
* SQuAD 2.0: the null answer scores ``min`` over the question's windows of ``start[0] + end[0]``
  (the first window with the minimum wins), is placed after every span scoring at least as much,
  and the prediction is ``""`` when ``null_score - best_non_null.start_logit - best_non_null.end_logit``
  exceeds ``null_score_diff_threshold``;
* the n-best softmax probabilities are computed with the same numpy operations on the same dtype as
  the loop, so ``nbest_predictions.json`` is identical too.

Computation and file writing are separate: :func:`compute_qa_predictions` is pure and returns a
:class:`QAPostprocessResult`; :func:`write_qa_predictions` writes HF's files from it.

SQuAD 2.0 no-answer probability
-------------------------------
HF's ``run_qa.py`` gives ``squad_v2`` a constant ``no_answer_probability`` of 0.0, which makes the
metric's ``best_exact``/``best_f1`` threshold search meaningless. :class:`QAPostprocessResult` carries a
real one per question::

    P(no answer) = exp(s_null) / (exp(s_null) + sum_{s in S} exp(s))

where ``s_null`` is the null score above (``min`` over windows of ``start_logit[0] + end_logit[0]``) and
``S`` are the scores ``start_logit + end_logit`` of the question's ``n_best_size`` best allowed spans
(the same candidates as the n-best list, before the null is merged in). It is a softmax over the null
candidate and the n-best spans, computed in float64 (1.0 when a question has no allowed span). It
rises with the null score and falls with the spans' scores, so sorting questions by it is what
``find_best_thresh`` of the SQuAD 2.0 evaluation needs. ``null_odds`` holds HF's score difference
(``null_odds.json``), which the official script also accepts as ``--na-prob-file``.
"""

from __future__ import annotations

import collections
import gc
import json
import logging
import numbers
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

__all__ = [
    "QAPostprocessResult",
    "compute_qa_predictions",
    "write_qa_predictions",
    "postprocess_qa_predictions",
    "postprocess_qa_predictions_with_scores",
]

#: Windows processed per vectorised batch (bounds the memory of the candidate grids).
_BATCH_FEATURES = 4096

# Candidate kinds in the final n-best lists.
_SPAN, _NULL, _EMPTY = 0, 1, 2


@dataclass
class QAPostprocessResult:
    """Everything :func:`compute_qa_predictions` works out, per question (keys in ``examples`` order).

    Attributes:
        predictions: ``{example id: answer text}``, HF's return value (``""`` = no answer, SQuAD 2.0).
        nbest: ``{example id: [{"start_logit", "end_logit", "text", "probability"}, ...]}``, exactly the
            content of HF's ``nbest_predictions.json`` (the ``"empty"`` placeholder has the keys
            ``text, start_logit, end_logit, probability``, as in HF); ``None`` when computed with
            ``with_nbest=False``.
        null_odds: SQuAD 2.0 only (else ``None``): ``{example id: null_score - best_non_null_score}``,
            HF's ``null_odds.json``; the answer is ``""`` when it exceeds ``null_score_diff_threshold``.
        no_answer_probability: SQuAD 2.0 only (else ``None``): ``{example id: P(no answer)}``, the
            softmax over the null candidate and the n-best spans (see the module docstring).
        version_2_with_negative: the mode the result was computed in.
    """

    predictions: collections.OrderedDict[str, str]
    nbest: collections.OrderedDict[str, list[dict[str, Any]]] | None
    null_odds: collections.OrderedDict[str, float] | None
    no_answer_probability: collections.OrderedDict[str, float] | None
    version_2_with_negative: bool = False

    def to_squad_predictions(self) -> list[dict[str, Any]]:
        """The predictions in the input format of :func:`hflight.qa.metrics.squad_metrics` / HF ``squad(_v2)``.

        ``[{"id", "prediction_text"}]``, plus ``"no_answer_probability"`` (this result's real one) for SQuAD 2.0.
        """
        if not self.version_2_with_negative:
            return [{"id": k, "prediction_text": v} for k, v in self.predictions.items()]
        probs = self.no_answer_probability or {}
        return [
            {"id": k, "prediction_text": v, "no_answer_probability": probs.get(k, 0.0)}
            for k, v in self.predictions.items()
        ]


# --------------------------------------------------------------------------------------------------------
# Input handling
# --------------------------------------------------------------------------------------------------------


def _is_hf_dataset(obj: Any) -> bool:
    mod = sys.modules.get("datasets")
    return mod is not None and isinstance(obj, mod.Dataset)


def _column(obj: Any, name: str, what: str) -> Any:
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


def _optional_column(obj: Any, name: str) -> list | None:
    """Column ``name`` as a list when the container has it (rows without it give None), else None."""
    if _is_hf_dataset(obj):
        return obj.with_format("arrow")[name].to_pylist() if name in obj.column_names else None
    if isinstance(obj, Mapping) or (hasattr(obj, "keys") and not isinstance(obj, Sequence)):
        return _to_pylist(obj[name]) if name in obj else None
    if isinstance(obj, Sequence):
        rows = [row.get(name) if isinstance(row, Mapping) else None for row in obj]
        return rows if any(r is not None for r in rows) else None
    return None


def _to_pylist(col: Any) -> list:
    if hasattr(col, "to_pylist"):  # pyarrow
        return col.to_pylist()
    if isinstance(col, np.ndarray):
        return col.tolist()
    return list(col)


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
    if np.isnan(arr).any():
        rows = np.flatnonzero(np.isnan(arr).any(axis=1))
        raise ValueError(f"{name} contain NaN (features {rows[:5].tolist()}{' ...' if rows.size > 5 else ''})")
    return arr


@dataclass
class _Offsets:
    """The windows' ``offset_mapping`` in flat form: token ``t`` of feature ``f`` is ``row_start[f] + t``.

    ``tok_valid`` is false for ``None`` offsets; a valid token's (start, end) characters are
    ``values[pair_pos[tok]]`` and ``values[pair_pos[tok] + 1]``.
    """

    row_start: np.ndarray
    row_len: np.ndarray
    tok_valid: np.ndarray
    pair_pos: np.ndarray
    values: np.ndarray

    def lookup(self, feat: np.ndarray, tok: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(valid, flat token index) for token positions ``tok`` of features ``feat`` (broadcast)."""
        inside = tok < self.row_len[feat]
        flat = np.where(inside, self.row_start[feat] + tok, 0)
        if self.tok_valid.size == 0:
            return np.zeros(flat.shape, bool), flat
        return inside & self.tok_valid[flat], flat

    def chars(self, flat: np.ndarray, which: int) -> np.ndarray:
        """Start (``which=0``) or end (``which=1``) character of valid flat tokens."""
        return self.values[self.pair_pos[flat] + which]


_OFFSETS_TYPE = None


def _read_offsets(col: Any, n_features: int) -> _Offsets:
    """Read an ``offset_mapping`` column (arrow, nested lists with ``None``, or a dense [F, L, 2] array)."""
    import pyarrow as pa

    global _OFFSETS_TYPE
    if _OFFSETS_TYPE is None:
        _OFFSETS_TYPE = pa.list_(pa.list_(pa.int64()))
    if isinstance(col, np.ndarray) and col.dtype != object:  # dense: every token valid
        if col.ndim != 3 or col.shape[0] != n_features or col.shape[2] != 2:
            raise ValueError(
                f"features['offset_mapping'] as an array must have shape [{n_features}, seq_len, 2], got {col.shape}"
            )
        n_tok = col.shape[0] * col.shape[1]
        return _Offsets(
            row_start=np.arange(n_features, dtype=np.int64) * col.shape[1],
            row_len=np.full(n_features, col.shape[1], np.int64),
            tok_valid=np.ones(n_tok, bool),
            pair_pos=np.arange(n_tok, dtype=np.int64) * 2,
            values=np.ascontiguousarray(col, dtype=np.int64).reshape(-1),
        )
    if not isinstance(col, (pa.Array, pa.ChunkedArray)):
        rows = _to_pylist(col)
        for f, row in enumerate(rows):
            if row is None:
                raise ValueError(f"feature {f} has no offset_mapping (None)")
        try:
            col = pa.array([r.tolist() if isinstance(r, np.ndarray) else r for r in rows])
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as exc:
            raise ValueError(
                f"features['offset_mapping'] must hold, per feature, a list of (start, end) pairs or None: {exc}"
            ) from exc
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if len(col) != n_features:
        raise ValueError(f"features['offset_mapping'] has {len(col)} rows for {n_features} features")
    if col.type != _OFFSETS_TYPE:
        if pa.types.is_null(col.type) or (len(col) and col.null_count == len(col)):
            raise ValueError("feature 0 has no offset_mapping (None)")
        try:
            col = col.cast(_OFFSETS_TYPE)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
            raise ValueError(
                "features['offset_mapping'] must hold, per feature, a list of (start, end) integer pairs or None; "
                f"got arrow type {col.type}"
            ) from exc
    if col.null_count:
        f = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
        raise ValueError(f"feature {f} has no offset_mapping (None)")
    outer = col.offsets.to_numpy().astype(np.int64)
    inner = col.values
    inner_off = inner.offsets.to_numpy().astype(np.int64)
    tok_valid = inner.is_valid().to_numpy(zero_copy_only=False)
    values = inner.values
    if values.null_count:
        raise ValueError("features['offset_mapping'] has a (start, end) pair with a None inside")
    values = values.to_numpy(zero_copy_only=False)
    used = slice(outer[0], outer[-1]) if len(outer) > 1 else slice(0, 0)
    bad = tok_valid[used] & (np.diff(inner_off)[used] != 2)
    if bad.any():
        t = int(np.flatnonzero(bad)[0]) + used.start
        f = int(np.searchsorted(outer, t, side="right") - 1)
        raise ValueError(f"feature {f}: offset_mapping entry {t - outer[f]} is not a (start, end) pair")
    return _Offsets(
        row_start=outer[:-1], row_len=np.diff(outer), tok_valid=tok_valid, pair_pos=inner_off[:-1], values=values
    )


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
# Vectorised selection
# --------------------------------------------------------------------------------------------------------


def _top_k_desc(x: np.ndarray, k: int) -> np.ndarray:
    """Per row, ``np.argsort(row)[-1:-k-1:-1]``: the indices of the k largest values, largest first.

    Rows whose k+1 largest values are all distinct have one possible answer, found with a partition; the
    other rows (ties) go through ``np.argsort`` itself, so the tie order is numpy's, exactly as in utils_qa.
    """
    n_rows, width = x.shape
    if k >= width or n_rows == 0:
        return np.argsort(x, axis=-1)[:, ::-1][:, :k]
    top = np.sort(np.partition(x, width - k - 1, axis=-1)[:, width - k - 1 :], axis=-1)  # k+1 largest, ascending
    distinct = (np.diff(top, axis=-1) > 0).all(axis=-1)
    out = np.empty((n_rows, k), np.intp)
    ok = np.flatnonzero(distinct)
    if ok.size:
        xs = x if ok.size == n_rows else x[ok]
        cols = np.nonzero(xs >= top[ok, 1][:, None])[1].reshape(ok.size, k)  # exactly k per row
        order = np.argsort(-np.take_along_axis(xs, cols, 1), axis=-1)
        out[ok] = np.take_along_axis(cols, order, 1)
    bad = np.flatnonzero(~distinct)
    if bad.size:
        out[bad] = np.argsort(x[bad], axis=-1)[:, ::-1][:, :k]
    return out


def _descending_int_key(scores: np.ndarray) -> tuple[np.ndarray, int] | None:
    """(key, bits): an int64 in [0, 2**bits) that sorts ascending as ``scores`` sort descending.

    -0.0 and 0.0 get the same key (they tie in Python's sort). None for dtypes without a compact key (float64).
    """
    if scores.dtype == np.float32:
        ibits, nbits = np.int32, 32
    elif scores.dtype == np.float16:
        ibits, nbits = np.int16, 16
    else:
        return None
    bits = (scores + scores.dtype.type(0)).view(ibits)  # + 0 turns -0.0 into +0.0
    ascending = bits ^ ((bits >> (nbits - 1)) & ibits(2 ** (nbits - 1) - 1))  # monotone in the float value
    return (~ascending).astype(np.int64) + 2 ** (nbits - 1), nbits


def _order_by_row_score_cell(row: np.ndarray, score: np.ndarray, cell: np.ndarray, n_cells: int) -> np.ndarray:
    """Permutation sorting candidates by row, then score descending, then cell (unique keys, so any sort is exact)."""
    cell_bits = max(1, (n_cells - 1).bit_length())
    row_bits = max(1, int(row.max()).bit_length()) if row.size else 1
    packed = _descending_int_key(score)
    if packed is not None and row_bits + packed[1] + cell_bits <= 63:
        key, score_bits = packed
        key = (row.astype(np.int64) << (score_bits + cell_bits)) | (key << cell_bits) | cell
        return np.argsort(key)
    return np.lexsort((cell, -score.astype(np.float64), row))


def _stable_order_by_row_score(row: np.ndarray, score: np.ndarray) -> np.ndarray:
    """Stable permutation sorting by row, then score descending (ties keep their order, as Python's sort)."""
    packed = _descending_int_key(score)
    if packed is not None and row.size and int(row.max()).bit_length() + packed[1] <= 63:
        # The candidates are nearly sorted already (window order, best first): timsort runs through them.
        return np.argsort((row.astype(np.int64) << packed[1]) | packed[0], kind="stable")
    return np.lexsort((-score.astype(np.float64), row))


def _slice_nonempty(a: np.ndarray, b: np.ndarray, length: np.ndarray) -> np.ndarray:
    """Whether ``s[a:b]`` is non-empty for strings of the given lengths (Python slice semantics)."""

    def norm(i):
        i = np.where(i < 0, i + length, i)
        return np.clip(i, 0, length)

    return norm(b) > norm(a)


def _grouped_softmax(scores: np.ndarray, wide: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Softmax within each contiguous group, with the exact numpy operations of utils_qa on each group.

    Groups flagged ``wide`` are computed in float64 (utils_qa's ``np.array`` of the scores becomes float64
    when the Python-float ``"empty"`` placeholder is in the list), others in the logits' dtype.
    Groups of equal length and width are stacked so that each row reduces exactly as the 1-D loop does.
    """
    probs = np.empty(scores.shape[0], np.float64)
    for is_wide in (False, True):
        for length in np.unique(lengths[wide == is_wide]):
            rows = np.flatnonzero((wide == is_wide) & (lengths == length))
            idx = starts[rows][:, None] + np.arange(length)
            vals = scores[idx].astype(np.float64) if is_wide else scores[idx]
            exp_scores = np.exp(vals - np.max(vals, axis=1, keepdims=True))
            probs[idx] = exp_scores / exp_scores.sum(axis=1, keepdims=True)
    return probs


# --------------------------------------------------------------------------------------------------------
# The computation
# --------------------------------------------------------------------------------------------------------


def compute_qa_predictions(
    examples,
    features,
    predictions,
    version_2_with_negative: bool = False,
    n_best_size: int = 20,
    max_answer_length: int = 30,
    null_score_diff_threshold: float = 0.0,
    with_nbest: bool = True,
) -> QAPostprocessResult:
    """Compute answers, n-best lists and (SQuAD 2.0) null odds and no-answer probabilities; writes nothing.

    Args:
        examples: the questions: a ``datasets.Dataset``, a dict of columns or a list of dicts with ``id``
            and ``context``.
        features: the tokenized windows, in the order of the logits: same containers, with ``example_id``
            and ``offset_mapping`` (per token a ``(start, end)`` character pair, ``None`` outside the
            context), optionally ``token_is_max_context`` (utils_qa's ``{str(token index): bool}``).
        predictions: ``(start_logits, end_logits)``, each of shape ``[n_features, seq_len]`` (numpy arrays,
            CPU tensors or nested lists; non-float logits are cast to float64).
        version_2_with_negative: SQuAD 2.0 mode (questions may have no answer).
        n_best_size: how many start and end positions per window, and how many spans per question, to keep.
        max_answer_length: the longest allowed span, in tokens.
        null_score_diff_threshold: SQuAD 2.0: predict no answer when ``null_odds`` exceeds this.
        with_nbest: also build the n-best lists (needed to write ``nbest_predictions.json``).

    Returns:
        A :class:`QAPostprocessResult`.

    Raises:
        ValueError: malformed predictions or features (shapes, counts, missing columns, unknown or
            duplicate ids, NaN logits, a SQuAD 2.0 example without any feature).
        TypeError: an unsupported container.
    """
    if not isinstance(n_best_size, numbers.Integral) or isinstance(n_best_size, bool) or n_best_size < 1:
        raise ValueError(f"n_best_size must be a positive integer, got {n_best_size!r}")
    if not isinstance(max_answer_length, numbers.Integral) or isinstance(max_answer_length, bool):
        raise ValueError(f"max_answer_length must be an integer, got {max_answer_length!r}")
    if not isinstance(null_score_diff_threshold, numbers.Real) or isinstance(null_score_diff_threshold, bool):
        raise ValueError(f"null_score_diff_threshold must be a real number, got {null_score_diff_threshold!r}")
    n_best_size, max_answer_length = int(n_best_size), int(max_answer_length)
    if isinstance(predictions, Mapping) or not hasattr(predictions, "__len__") or len(predictions) != 2:
        raise ValueError("predictions must be a pair (start_logits, end_logits)")
    all_start = _as_logits(predictions[0], "start_logits")
    all_end = _as_logits(predictions[1], "end_logits")
    if all_start.shape != all_end.shape:
        raise ValueError(f"start_logits and end_logits shapes differ: {all_start.shape} vs {all_end.shape}")
    # Each array is ranked in its own dtype (as np.argsort sees it); sums promote as numpy scalars do.
    dtype = np.result_type(all_start.dtype, all_end.dtype)
    n_features, width = all_start.shape
    if width == 0:
        raise ValueError("the logits have no positions (seq_len is 0)")

    # Questions and windows.
    example_ids = _to_pylist(_column(examples, "id", "examples"))
    contexts = _to_pylist(_column(examples, "context", "examples"))
    feature_example_ids = _to_pylist(_column(features, "example_id", "features"))
    offsets_col = _column(features, "offset_mapping", "features")
    if len(feature_example_ids) != n_features:
        raise ValueError(f"Got {n_features} predictions (logit rows) and {len(feature_example_ids)} features")
    example_index = {}
    for i, eid in enumerate(example_ids):
        if eid in example_index:
            raise ValueError(f"duplicate example id {eid!r} (examples {example_index[eid]} and {i})")
        example_index[eid] = i
    for i, ctx in enumerate(contexts):
        if not isinstance(ctx, str):
            raise ValueError(f"example {example_ids[i]!r}: context must be a string, got {type(ctx).__name__}")
    try:
        feat2ex = np.fromiter((example_index[e] for e in feature_example_ids), np.int64, n_features)
    except KeyError as exc:
        raise ValueError(f"a feature's example_id {exc.args[0]!r} is not the id of any example") from None
    except TypeError:  # unhashable id
        bad = next(e for e in feature_example_ids if not isinstance(e, collections.abc.Hashable))
        raise ValueError(f"a feature's example_id {bad!r} is not the id of any example") from None
    n_examples = len(example_ids)
    offsets = _read_offsets(offsets_col, n_features)
    max_ctx = _max_context_mask(_optional_column(features, "token_is_max_context"), n_features, width)
    n_per_example = np.bincount(feat2ex, minlength=n_examples)
    if version_2_with_negative and n_examples and (n_per_example == 0).any():
        e = int(np.flatnonzero(n_per_example == 0)[0])
        raise ValueError(f"example {example_ids[e]!r} has no feature: SQuAD 2.0 needs at least one window per question")

    logger.info(f"Post-processing {n_examples} example predictions split into {n_features} features.")

    # 1. Per window: the n_best_size best allowed spans, from a start x end grid.
    n = n_best_size
    k = min(n_best_size, width)
    parts: dict[str, list[np.ndarray]] = collections.defaultdict(list)
    for lo in range(0, n_features, _BATCH_FEATURES):
        hi = min(lo + _BATCH_FEATURES, n_features)
        st, en = all_start[lo:hi], all_end[lo:hi]
        feats = np.arange(lo, hi)[:, None]
        s_idx, e_idx = _top_k_desc(st, k), _top_k_desc(en, k)
        s_val, e_val = np.take_along_axis(st, s_idx, 1), np.take_along_axis(en, e_idx, 1)
        ok_s, flat_s = offsets.lookup(feats, s_idx)
        ok_e, flat_e = offsets.lookup(feats, e_idx)
        if max_ctx is not None:
            ok_s &= max_ctx[feats, s_idx]
        # Allowed (start rank, end rank) cells: 0 <= end - start < max_answer_length, both in the context.
        span_len = e_idx.astype(np.int32)[:, None, :] - s_idx.astype(np.int32)[:, :, None]
        allowed = span_len.view(np.uint32) < max(0, min(max_answer_length, width + 1))
        allowed &= ok_s[:, :, None]
        allowed &= ok_e[:, None, :]
        b, si, ei = np.nonzero(allowed)  # window, then start rank, then end rank: the loop's insertion order
        score = s_val[b, si] + e_val[b, ei]
        order = _order_by_row_score_cell(b, score, si * k + ei, k * k)
        b, si, ei, score = b[order], si[order], ei[order], score[order]
        rank = np.arange(b.size) - np.searchsorted(b, b)  # rank within its window
        keep = rank < n  # each window's n_best_size best spans
        b, si, ei = b[keep], si[keep], ei[keep]
        parts["feature"].append(b + lo)
        parts["score"].append(score[keep])
        parts["start_logit"].append(s_val[b, si])
        parts["end_logit"].append(e_val[b, ei])
        parts["a"].append(offsets.chars(flat_s[b, si], 0))
        parts["b"].append(offsets.chars(flat_e[b, ei], 1))
    cand = {
        name: (
            np.concatenate(parts[name])
            if parts[name]
            else np.zeros(0, dtype if name in ("score", "start_logit", "end_logit") else np.int64)
        )
        for name in ("feature", "score", "start_logit", "end_logit", "a", "b")
    }
    cand_ex = feat2ex[cand["feature"]]

    # 2. Per question: the n_best_size best spans over its windows (stable: window order, then rank).
    order = _stable_order_by_row_score(cand_ex, cand["score"])
    cand = {name: v[order] for name, v in cand.items()}
    cand_ex = cand_ex[order]
    counts = np.bincount(cand_ex, minlength=n_examples)
    group_start = np.cumsum(counts) - counts
    rank = np.arange(cand_ex.size) - group_start[cand_ex]
    keep = rank < n
    t_ex, t_rank = cand_ex[keep], rank[keep]
    t_score, t_sl, t_el = cand["score"][keep], cand["start_logit"][keep], cand["end_logit"][keep]
    t_a, t_b = cand["a"][keep], cand["b"][keep]
    t_count = np.minimum(counts, n)
    ctx_len = np.fromiter((len(c) for c in contexts), np.int64, n_examples)
    t_nonempty = _slice_nonempty(t_a, t_b, ctx_len[t_ex])

    # 3. The final n-best list of each question: spans, the null answer (v2), the "empty" placeholder.
    zero = dtype.type(0)
    if version_2_with_negative:
        feat_null = all_start[:, 0] + all_end[:, 0]
        f_order = np.lexsort((feat_null, feat2ex))  # per question: min null score, first window on ties
        first = np.cumsum(n_per_example) - n_per_example
        null_feat = f_order[first]
        null_score = feat_null[null_feat]
        null_sl, null_el = all_start[null_feat, 0], all_end[null_feat, 0]
        # The null answer goes after every span scoring at least as much (stable sort, appended last).
        p = np.bincount(t_ex, weights=t_score >= null_score[t_ex], minlength=n_examples).astype(np.int64)
        t_pos = np.where(t_rank < p[t_ex], t_rank, t_rank + 1)
        span_in = t_pos < n  # the list is cut to n_best_size after the null is merged in
        zero_zero = np.bincount(t_ex, weights=(t_a == 0) & (t_b == 0), minlength=n_examples) > 0
        null_in = (p < n) | ~zero_zero  # utils_qa adds the null back unless a span has offsets (0, 0)
        n_list = np.bincount(t_ex[span_in], minlength=n_examples) + null_in
    else:
        t_pos = t_rank
        span_in = np.ones(t_ex.size, bool)
        null_in = np.zeros(n_examples, bool)
        n_list = t_count
    # First entry's text is "" when the list is a lone null or a lone empty-text span.
    lone_span_empty = np.zeros(n_examples, bool)
    lone_span_empty[t_ex[span_in]] = ~t_nonempty[span_in]  # only read where the list has one span and no null
    single_empty_text = (n_list == 1) & (null_in | lone_span_empty)
    empty_in = (n_list == 0) | single_empty_text

    ex_all = np.arange(n_examples)
    null_ex, empty_ex = ex_all[null_in], ex_all[empty_in]
    span_sel = np.flatnonzero(span_in)
    e_ex = np.concatenate([t_ex[span_sel], null_ex, empty_ex])
    e_pos = np.concatenate(
        [t_pos[span_sel], p[null_ex] if version_2_with_negative else null_ex, np.full(empty_ex.size, -1)]
    )
    e_kind = np.concatenate(
        [np.full(span_sel.size, _SPAN), np.full(null_ex.size, _NULL), np.full(empty_ex.size, _EMPTY)]
    )
    e_src = np.concatenate([span_sel, null_ex, empty_ex])  # index into the span arrays / examples
    e_order = np.lexsort((e_pos, e_ex))
    e_ex, e_kind, e_src = e_ex[e_order], e_kind[e_order], e_src[e_order]
    is_span, is_null = e_kind == _SPAN, e_kind == _NULL

    def pick(span_vals, null_vals, empty_val, out_dtype):
        out = np.full(e_ex.size, empty_val, dtype=out_dtype)
        out[is_span] = span_vals[e_src[is_span]]
        if null_vals is not None:
            out[is_null] = null_vals[e_src[is_null]]
        return out

    e_score = pick(t_score, null_score if version_2_with_negative else None, zero, dtype)
    e_sl = pick(t_sl, null_sl if version_2_with_negative else None, zero, dtype)
    e_el = pick(t_el, null_el if version_2_with_negative else None, zero, dtype)
    e_a = pick(t_a, np.zeros(n_examples, np.int64), 0, np.int64)
    e_b = pick(t_b, np.zeros(n_examples, np.int64), 0, np.int64)
    e_count = np.bincount(e_ex, minlength=n_examples)
    e_first = np.cumsum(e_count) - e_count

    # 4. The answer of each question.
    e_has_text = np.where(
        is_span, t_nonempty[np.where(is_span, e_src, 0)] if t_nonempty.size else False, e_kind == _EMPTY
    )
    if not version_2_with_negative:
        best = e_first
        best_ok = np.ones(n_examples, bool)
    else:
        # The best non-null prediction: the first entry whose text is not "" (the "empty" placeholder counts).
        cand_rows = np.flatnonzero(e_has_text)
        found_ex, first_idx = np.unique(e_ex[cand_rows], return_index=True)
        best = np.zeros(n_examples, np.int64)
        best_ok = np.zeros(n_examples, bool)
        best[found_ex] = cand_rows[first_idx]
        best_ok[found_ex] = True
    predictions_out: collections.OrderedDict[str, str] = collections.OrderedDict()
    best_kind = e_kind[best]
    best_a, best_b = e_a[best], e_b[best]
    best_texts = [
        "empty" if (kind == _EMPTY or not ok) else contexts[i][a:b]
        for i, (kind, ok, a, b) in enumerate(
            zip(best_kind.tolist(), best_ok.tolist(), best_a.tolist(), best_b.tolist())
        )
    ]
    null_odds = no_answer_probability = None
    if not version_2_with_negative:
        for eid, text in zip(example_ids, best_texts):
            predictions_out[eid] = text
    else:
        # utils_qa raises IndexError when every entry has an empty text; we fall back to its "empty" placeholder.
        best_sl = np.where(best_ok, e_sl[best], zero)
        best_el = np.where(best_ok, e_el[best], zero)
        score_diff = null_score - best_sl - best_el
        is_null_answer = score_diff > null_score_diff_threshold
        null_odds = collections.OrderedDict(zip(example_ids, score_diff.tolist()))
        for eid, text, no_ans in zip(example_ids, best_texts, is_null_answer.tolist()):
            predictions_out[eid] = "" if no_ans else text
        no_answer_probability = collections.OrderedDict(
            zip(example_ids, _no_answer_probability(null_score, t_ex, t_score, t_count).tolist())
        )

    # 5. The n-best lists with their softmax probabilities.
    nbest = None
    if with_nbest:
        wide = np.zeros(n_examples, bool)
        wide[empty_ex] = True  # the Python float 0.0 of "empty" makes utils_qa's score array float64
        if dtype == np.float64:
            wide[:] = True
        probs = _grouped_softmax(e_score, wide, e_first, e_count)
        gc_enabled = gc.isenabled()
        gc.disable()  # hundreds of thousands of small dicts: no need for cyclic GC passes while building them
        try:
            nbest = _nbest_lists(example_ids, contexts, e_kind, e_ex, e_a, e_b, e_sl, e_el, probs, e_first, e_count)
        finally:
            if gc_enabled:
                gc.enable()

    return QAPostprocessResult(
        predictions=predictions_out,
        nbest=nbest,
        null_odds=null_odds,
        no_answer_probability=no_answer_probability,
        version_2_with_negative=bool(version_2_with_negative),
    )


def _nbest_lists(example_ids, contexts, e_kind, e_ex, e_a, e_b, e_sl, e_el, probs, e_first, e_count):
    """The n-best dicts of every question, keys in utils_qa's order (entries are contiguous per question)."""
    entries = [
        {"text": "empty", "start_logit": 0.0, "end_logit": 0.0, "probability": pr}
        if kind == _EMPTY
        else {"start_logit": sl, "end_logit": el, "text": contexts[ex][a:b], "probability": pr}
        for kind, ex, a, b, sl, el, pr in zip(
            e_kind.tolist(), e_ex.tolist(), e_a.tolist(), e_b.tolist(), e_sl.tolist(), e_el.tolist(), probs.tolist()
        )
    ]
    return collections.OrderedDict(
        (eid, entries[lo : lo + cnt]) for eid, lo, cnt in zip(example_ids, e_first.tolist(), e_count.tolist())
    )


def _no_answer_probability(
    null_score: np.ndarray, t_ex: np.ndarray, t_score: np.ndarray, t_count: np.ndarray
) -> np.ndarray:
    """exp(s_null) / (exp(s_null) + sum exp(s_span)) over each question's n-best spans, in float64."""
    s_null = null_score.astype(np.float64)
    spans = t_score.astype(np.float64)
    top = np.full(s_null.shape, -np.inf)
    has = t_count > 0
    first = np.cumsum(t_count) - t_count
    top[has] = spans[first[has]]  # spans are sorted best first within each question
    m = np.maximum(s_null, top)

    def weight(s, m_):
        with np.errstate(invalid="ignore", over="ignore"):
            return np.where(s == m_, 1.0, np.exp(s - m_))

    w_null = weight(s_null, m)
    w_spans = np.bincount(t_ex, weights=weight(spans, m[t_ex]), minlength=s_null.size)
    return w_null / (w_null + w_spans)


# --------------------------------------------------------------------------------------------------------
# Writing and the HF-compatible entry points
# --------------------------------------------------------------------------------------------------------


def write_qa_predictions(
    result: QAPostprocessResult, output_dir: str | os.PathLike, prefix: str | None = None
) -> dict[str, str]:
    """Write HF's ``predictions.json``, ``nbest_predictions.json`` and (SQuAD 2.0) ``null_odds.json``.

    Names get ``{prefix}_`` in front when ``prefix`` is given; the format is utils_qa's
    (``json.dumps(..., indent=4)`` plus a newline). Returns ``{"predictions"|"nbest"|"null_odds": path}``.

    Raises:
        NotADirectoryError: ``output_dir`` is not an existing directory (utils_qa does not create it either).
        ValueError: the result was computed with ``with_nbest=False``.
    """
    if not os.path.isdir(output_dir):
        raise NotADirectoryError(f"{output_dir} is not a directory")
    if result.nbest is None:
        raise ValueError(
            "the result has no n-best lists: compute it with with_nbest=True to write nbest_predictions.json"
        )

    def name(base: str) -> str:
        return os.path.join(output_dir, base if prefix is None else f"{prefix}_{base}")

    contents = {
        "predictions": ("predictions.json", result.predictions),
        "nbest": ("nbest_predictions.json", result.nbest),
    }
    if result.version_2_with_negative:
        contents["null_odds"] = ("null_odds.json", result.null_odds)
    paths = {}
    for key, (base, data) in contents.items():
        path = name(base)
        logger.info(f"Saving {key} to {path}.")
        with open(path, "w") as writer:
            writer.write(json.dumps(data, indent=4) + "\n")
        paths[key] = path
    return paths


def postprocess_qa_predictions_with_scores(
    examples,
    features,
    predictions,
    version_2_with_negative: bool = False,
    n_best_size: int = 20,
    max_answer_length: int = 30,
    null_score_diff_threshold: float = 0.0,
    output_dir: str | os.PathLike | None = None,
    prefix: str | None = None,
    log_level: int | None = None,
) -> QAPostprocessResult:
    """Like :func:`postprocess_qa_predictions` but returns the full :class:`QAPostprocessResult`

    (answers, n-best lists, and for SQuAD 2.0 the null odds and a real no-answer probability per question).
    Writes HF's files too when ``output_dir`` is given.
    """
    if log_level is not None:
        logger.setLevel(log_level)
    result = compute_qa_predictions(
        examples,
        features,
        predictions,
        version_2_with_negative=version_2_with_negative,
        n_best_size=n_best_size,
        max_answer_length=max_answer_length,
        null_score_diff_threshold=null_score_diff_threshold,
        with_nbest=True,
    )
    if output_dir is not None:
        write_qa_predictions(result, output_dir, prefix)
    return result


def postprocess_qa_predictions(
    examples,
    features,
    predictions,
    version_2_with_negative: bool = False,
    n_best_size: int = 20,
    max_answer_length: int = 30,
    null_score_diff_threshold: float = 0.0,
    output_dir: str | os.PathLike | None = None,
    prefix: str | None = None,
    log_level: int | None = None,
) -> collections.OrderedDict[str, str]:
    """HF ``utils_qa.postprocess_qa_predictions``, vectorised: ``{example id: answer text}`` in examples order.

    Args:
        examples: questions with ``id`` and ``context`` (``datasets.Dataset``, dict of columns, or list of dicts).
        features: windows with ``example_id`` and ``offset_mapping`` (``None`` for non-context tokens), one
            per row of the logits.
        predictions: ``(start_logits, end_logits)``, arrays of shape ``[n_features, seq_len]``.
        version_2_with_negative: questions may have no answer (SQuAD 2.0); the answer is then ``""``.
        n_best_size: start/end positions per window and spans per question kept.
        max_answer_length: longest allowed answer, in tokens.
        null_score_diff_threshold: predict no answer when ``null_score - best_span_score`` exceeds it.
        output_dir: if given (an existing directory), write ``predictions.json``, ``nbest_predictions.json``
            and, for SQuAD 2.0, ``null_odds.json`` there, exactly as utils_qa does.
        prefix: prepended to those file names as ``{prefix}_``.
        log_level: as utils_qa's: the level of this module's logger (``None`` leaves it alone).

    Answers, n-best lists and null odds are identical to utils_qa's loop (see the module docstring).
    """
    if log_level is not None:
        logger.setLevel(log_level)
    result = compute_qa_predictions(
        examples,
        features,
        predictions,
        version_2_with_negative=version_2_with_negative,
        n_best_size=n_best_size,
        max_answer_length=max_answer_length,
        null_score_diff_threshold=null_score_diff_threshold,
        with_nbest=output_dir is not None,
    )
    if output_dir is not None:
        write_qa_predictions(result, output_dir, prefix)
    return result.predictions
