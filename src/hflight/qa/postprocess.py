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
:class:`QAPostprocessResult`; :func:`write_qa_predictions` writes HF's files from it. The computation is a
pipeline of named stages: offsets (:func:`hflight.qa.postprocess_inputs.read_inputs`) -> candidates
(:func:`_window_candidates`) -> ranking (:func:`_rank_per_question`) -> n-best lists (:func:`_nbest_entries`)
-> texts and answers (:func:`_answers`) -> probabilities (:func:`_grouped_softmax`, :func:`_no_answer_probability`).

Inputs are checked (:mod:`hflight.qa.postprocess_inputs`): NaN or infinite logits, empty inputs, unknown or
duplicate ids, and a question without any window (which utils_qa would silently score as wrong) raise
``ValueError`` naming the problem.

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
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from hflight import durable
from hflight.qa.postprocess_inputs import OffsetChunk, QAInputs, read_inputs, read_logits

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
    nbest: collections.OrderedDict[str, list[dict[str, Any]]] | None = None
    null_odds: collections.OrderedDict[str, float] | None = None
    no_answer_probability: collections.OrderedDict[str, float] | None = None
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
# Numeric helpers
# --------------------------------------------------------------------------------------------------------


def _top_k_desc(x: np.ndarray, k: int) -> np.ndarray:
    """Per row, ``np.argsort(row)[-1:-k-1:-1]``: the indices of the k largest values, largest first.

    Rows whose k+1 largest values are all distinct have one possible answer, found without sorting the row; the
    other rows (ties) go through ``np.argsort`` itself, so the tie order is numpy's, exactly as in utils_qa.
    """
    n_rows, width = x.shape
    if k >= width or n_rows == 0:
        return np.argsort(x, axis=-1)[:, ::-1][:, :k]
    compact = x.dtype in (np.float32, np.float16) and width <= 2**16  # a value key and a column in 63 bits
    out, distinct = (_top_k_packed if compact else _top_k_partition)(x, k)
    ties = np.flatnonzero(~distinct)
    if ties.size:
        out[ties] = np.argsort(x[ties], axis=-1)[:, ::-1][:, :k]
    return out


def _top_k_packed(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(top-k indices, whether the row's k+1 largest are distinct) from a few candidates per row
    (:func:`_top_candidates`), each packed into one integer (value descending, then column) and sorted per row."""
    n_rows, width = x.shape
    flat = _top_candidates(x, k + 1)
    row = flat // width
    key = (_descending_int_key(x.reshape(-1)[flat])[0] << 16) | (flat - row * width)
    counts = np.bincount(row, minlength=n_rows)
    table = np.full((n_rows, int(counts.max())), np.iinfo(np.int64).max)  # candidate counts differ: pad
    table[row, np.arange(flat.size) - (np.cumsum(counts) - counts)[row]] = key
    table.sort(axis=1)
    best = table[:, : k + 1]
    value = best >> 16
    return (best[:, :k] & 0xFFFF).astype(np.intp), (value[:, 1:] != value[:, :-1]).all(axis=-1)


def _top_k_partition(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_top_k_packed` for dtypes without a compact sort key (float64): a partition of every row."""
    n_rows, width = x.shape
    top = np.sort(np.partition(x, width - k - 1, axis=-1)[:, width - k - 1 :], axis=-1)  # k+1 largest, ascending
    distinct = (top[:, 1:] > top[:, :-1]).all(axis=-1)
    out = np.empty((n_rows, k), np.intp)
    ok = np.flatnonzero(distinct)
    xs = x[ok]
    cols = (np.flatnonzero(xs >= top[ok, 1:2]) % width).reshape(ok.size, k)  # exactly k per distinct row
    out[ok] = np.take_along_axis(cols, np.argsort(-np.take_along_axis(xs, cols, 1), axis=-1), 1)
    return out, distinct


def _top_candidates(x: np.ndarray, m: int) -> np.ndarray:
    """Flat indices (row-major) of a few entries per row that include the row's ``m`` largest.

    With ``q`` a quarter of the row, column ``c < q`` heads the block ``{c, c + q, c + 2q, c + 3q}`` (the last
    columns of an odd width join the last block). The ``m``-th largest block maximum is a lower bound on the row's
    ``m``-th largest value (``m`` disjoint blocks each hold an entry at least that large), so the entries at or above
    it include the ``m`` largest: about ``m + 3`` per row for random logits, found with a partition over a quarter of
    the row.
    """
    n_rows, width = x.shape
    q = width // 4
    if q < m:
        bound = np.partition(x, width - m, axis=-1)[:, width - m]
    else:
        blocks = np.maximum(x[:, :q], x[:, q : 2 * q])
        np.maximum(blocks, x[:, 2 * q : 3 * q], out=blocks)
        np.maximum(blocks, x[:, 3 * q : 4 * q], out=blocks)
        if width > 4 * q:
            blocks[:, -1] = np.maximum(blocks[:, -1], x[:, 4 * q :].max(axis=1))
        bound = np.partition(blocks, q - m, axis=-1)[:, q - m]
    return np.flatnonzero(x >= bound[:, None])


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
# Candidates: each window's best allowed spans
# --------------------------------------------------------------------------------------------------------


@dataclass
class _Spans:
    """Candidate spans, one entry each: question, window, score (``start + end`` logit), the start and end tokens
    (flat indices into their window's offsets chunk) and, once resolved (:meth:`with_chars`), character offsets."""

    ex: np.ndarray
    feature: np.ndarray
    score: np.ndarray
    start_logit: np.ndarray
    end_logit: np.ndarray
    start_token: np.ndarray
    end_token: np.ndarray
    a: np.ndarray | None = None
    b: np.ndarray | None = None

    def take(self, index: np.ndarray) -> _Spans:
        return _Spans(*(None if (v := getattr(self, f.name)) is None else v[index] for f in fields(self)))

    def with_chars(self, offsets: list[OffsetChunk]) -> _Spans:
        """The spans with ``a``/``b``: the start character of the start token, the end character of the end token.
        Resolved only for the spans that can be answers (the offsets are large and read at random)."""
        chunk_of = np.searchsorted(np.array([c.hi for c in offsets]), self.feature, side="right")
        a, b = np.zeros(self.feature.size, np.int64), np.zeros(self.feature.size, np.int64)
        for i, chunk in enumerate(offsets):
            sel = np.flatnonzero(chunk_of == i) if len(offsets) > 1 else slice(None)
            a[sel], b[sel] = chunk.chars(self.start_token[sel], 0), chunk.chars(self.end_token[sel], 1)
        return replace(self, a=a, b=b)

    @staticmethod
    def concat(parts: list[_Spans], dtype: np.dtype) -> _Spans:
        if not parts:
            ints, floats = np.zeros(0, np.int64), np.zeros(0, dtype)
            return _Spans(ints, ints, floats, floats, floats, ints, ints)
        return _Spans(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(_Spans)[:7]))


def _allowed_cells(s_idx, e_idx, ok_s, ok_e, max_answer_length, width):
    """(window, start rank, end rank) of the cells of each window's top-k start x top-k end grid that utils_qa
    keeps, in its insertion order: both positions have offsets and ``0 <= end - start < max_answer_length``."""
    limit = max(0, min(max_answer_length, width + 1))
    # A start without offsets moves far after every end (end - start hugely negative), an end without offsets far
    # before every start: then one unsigned comparison of end - start tests everything.
    small = width < 8192
    itype, utype, far = (np.int16, np.uint16, 10_000) if small else (np.int32, np.uint32, 2**29)
    s = np.where(ok_s, s_idx, -far).astype(itype)
    e = np.where(ok_e, e_idx, -2 * far).astype(itype)
    allowed = (e[:, None, :] - s[:, :, None]).view(utype) < limit
    k = s_idx.shape[1]
    window, cell = np.divmod(np.flatnonzero(allowed), k * k)
    start_rank, end_rank = np.divmod(cell, k)
    return window, start_rank, end_rank


def _batch_candidates(start, end, chunk: OffsetChunk, lo, hi, k, n, max_answer_length, max_context) -> _Spans:
    """The ``n`` best allowed spans of each window ``lo:hi`` (all in one offsets chunk), best first."""
    st, en = start[lo:hi], end[lo:hi]
    local = np.arange(lo - chunk.lo, hi - chunk.lo)[:, None]
    s_idx, e_idx = _top_k_desc(st, k), _top_k_desc(en, k)
    ok_s, flat_s = chunk.lookup(local, s_idx)
    ok_e, flat_e = chunk.lookup(local, e_idx)
    if max_context is not None:
        ok_s &= np.take_along_axis(max_context[lo:hi], s_idx, 1)
    b, si, ei = _allowed_cells(s_idx, e_idx, ok_s, ok_e, max_answer_length, st.shape[1])
    cell_s, cell_e = b * k + si, b * k + ei  # into the [windows, k] arrays, flattened
    s_pos, e_pos = s_idx.reshape(-1)[cell_s], e_idx.reshape(-1)[cell_e]
    s_val, e_val = st.reshape(-1)[b * st.shape[1] + s_pos], en.reshape(-1)[b * en.shape[1] + e_pos]
    score = s_val + e_val  # in the logits' dtype, as the loop adds numpy scalars
    order = _order_by_row_score_cell(b, score, si * k + ei, k * k)
    per_window = np.bincount(b, minlength=hi - lo)
    rank = np.arange(order.size) - np.repeat(np.cumsum(per_window) - per_window, per_window)  # b[order] is sorted
    kept = order[rank < n]  # each window's n best, in order
    return _Spans(
        ex=np.zeros(0, np.int64),  # set for all batches at once
        feature=b[kept] + lo,
        score=score[kept],
        start_logit=s_val[kept],
        end_logit=e_val[kept],
        start_token=flat_s.reshape(-1)[cell_s[kept]],
        end_token=flat_e.reshape(-1)[cell_e[kept]],
    )


def _window_candidates(start, end, inputs: QAInputs, n: int, max_answer_length: int) -> _Spans:
    """Each window's ``n`` best allowed spans, ordered by (window, score descending, start rank, end rank).

    A span beyond its window's ``n`` best can never be among its question's ``n`` best (``n`` spans of the same
    window come before it in the loop's order), so cutting per window changes nothing.
    """
    k = min(n, start.shape[1])
    parts = [
        _batch_candidates(start, end, chunk, lo, min(lo + _BATCH_FEATURES, chunk.hi), k, n, max_answer_length,
                          inputs.max_context)
        for chunk in inputs.offsets
        for lo in range(chunk.lo, chunk.hi, _BATCH_FEATURES)
    ]  # fmt: skip
    spans = _Spans.concat(parts, np.result_type(start.dtype, end.dtype))
    spans.ex = inputs.feat2ex[spans.feature]
    return spans


# --------------------------------------------------------------------------------------------------------
# Ranking: each question's best spans over its windows
# --------------------------------------------------------------------------------------------------------


@dataclass
class _Ranked:
    """Each question's ``n`` best spans, best first (``rank`` within the question); ``count`` per question."""

    spans: _Spans
    rank: np.ndarray
    count: np.ndarray
    nonempty: np.ndarray  # the span's text is not ""


def _rank_per_question(spans: _Spans, inputs: QAInputs, n: int) -> _Ranked:
    """A stable sort by (question, score descending): equal scores keep window order, then start and end rank,
    which is the order Python's stable ``sorted(..., reverse=True)`` gives utils_qa's candidate list."""
    contexts, n_examples = inputs.contexts, inputs.n_examples
    spans = spans.take(_stable_order_by_row_score(spans.ex, spans.score))
    counts = np.bincount(spans.ex, minlength=n_examples)
    rank = np.arange(spans.ex.size) - (np.cumsum(counts) - counts)[spans.ex]
    keep = rank < n
    spans = spans.take(keep).with_chars(inputs.offsets)
    ctx_len = np.fromiter((len(c) for c in contexts), np.int64, n_examples)
    return _Ranked(spans, rank[keep], np.minimum(counts, n), _slice_nonempty(spans.a, spans.b, ctx_len[spans.ex]))


@dataclass
class _Null:
    """SQuAD 2.0: each question's null answer, from the window with the lowest ``start[0] + end[0]``."""

    score: np.ndarray
    start_logit: np.ndarray
    end_logit: np.ndarray


def _null_answers(start: np.ndarray, end: np.ndarray, feat2ex: np.ndarray, n_examples: int) -> _Null:
    feat_null = start[:, 0] + end[:, 0]
    order = np.lexsort((feat_null, feat2ex))  # per question: min null score, first window on ties (strict >)
    per_example = np.bincount(feat2ex, minlength=n_examples)
    null_feat = order[np.cumsum(per_example) - per_example]
    return _Null(feat_null[null_feat], start[null_feat, 0], end[null_feat, 0])


# --------------------------------------------------------------------------------------------------------
# The n-best lists: spans, the null answer (SQuAD 2.0) and the "empty" placeholder
# --------------------------------------------------------------------------------------------------------


@dataclass
class _Entries:
    """Every question's final n-best list, entries contiguous per question (``first``, ``count``) and in order."""

    ex: np.ndarray
    kind: np.ndarray  # _SPAN, _NULL or _EMPTY
    score: np.ndarray
    start_logit: np.ndarray
    end_logit: np.ndarray
    a: np.ndarray
    b: np.ndarray
    has_text: np.ndarray  # text is not "" (the "empty" placeholder has one)
    first: np.ndarray
    count: np.ndarray
    wide: np.ndarray  # per question: utils_qa's score array is float64 (the "empty" placeholder is in it)


def _list_positions(ranked: _Ranked, null: _Null | None, n: int):
    """Where each span and the null go in utils_qa's list: (span position, span kept, null kept, list length)."""
    n_examples = ranked.count.size
    t_ex, t = ranked.spans.ex, ranked.spans
    if null is None:
        return ranked.rank, np.ones(t_ex.size, bool), np.zeros(n_examples, bool), ranked.count, None
    # The null goes after every span scoring at least as much (stable sort; it was appended last).
    p = np.bincount(t_ex, weights=t.score >= null.score[t_ex], minlength=n_examples).astype(np.int64)
    pos = np.where(ranked.rank < p[t_ex], ranked.rank, ranked.rank + 1)
    span_in = pos < n  # the list is cut to n_best_size after the null is merged in
    zero_zero = np.bincount(t_ex, weights=(t.a == 0) & (t.b == 0), minlength=n_examples) > 0
    null_in = (p < n) | ~zero_zero  # utils_qa adds the null back unless a span has offsets (0, 0)
    return pos, span_in, null_in, np.bincount(t_ex[span_in], minlength=n_examples) + null_in, p


def _nbest_entries(ranked: _Ranked, null: _Null | None, n: int, dtype: np.dtype) -> _Entries:
    """Merge the null answer into each question's spans and add utils_qa's ``"empty"`` placeholder (first) to a
    list that is empty or holds a single entry with an empty text."""
    n_examples, t = ranked.count.size, ranked.spans
    pos, span_in, null_in, n_list, null_pos = _list_positions(ranked, null, n)
    lone_span_empty = np.zeros(n_examples, bool)
    lone_span_empty[t.ex[span_in]] = ~ranked.nonempty[span_in]  # read only where the list is one span, no null
    empty_in = (n_list == 0) | ((n_list == 1) & (null_in | lone_span_empty))
    ex_all = np.arange(n_examples)
    null_ex, empty_ex, span_sel = ex_all[null_in], ex_all[empty_in], np.flatnonzero(span_in)
    ex = np.concatenate([t.ex[span_sel], null_ex, empty_ex])
    position = np.concatenate([pos[span_sel], null_pos[null_ex] if null else null_ex, np.full(empty_ex.size, -1)])
    kind = np.concatenate([np.full(span_sel.size, _SPAN), np.full(null_ex.size, _NULL), np.full(empty_ex.size, _EMPTY)])
    src = np.concatenate([span_sel, null_ex, empty_ex])  # index into the span arrays / the questions
    order = np.lexsort((position, ex))
    ex, kind, src = ex[order], kind[order], src[order]
    is_span, is_null = kind == _SPAN, kind == _NULL

    def pick(span_values, null_values, empty_value, out_dtype):
        out = np.full(ex.size, empty_value, dtype=out_dtype)
        out[is_span] = span_values[src[is_span]]
        if null_values is not None:
            out[is_null] = null_values[src[is_null]]
        return out

    zero, no_null = dtype.type(0), null is None
    count = np.bincount(ex, minlength=n_examples)
    wide = np.zeros(n_examples, bool)
    wide[empty_ex] = True  # the Python float 0.0 of "empty" makes utils_qa's score array float64
    return _Entries(
        ex=ex,
        kind=kind,
        score=pick(t.score, None if no_null else null.score, zero, dtype),
        start_logit=pick(t.start_logit, None if no_null else null.start_logit, zero, dtype),
        end_logit=pick(t.end_logit, None if no_null else null.end_logit, zero, dtype),
        a=pick(t.a, np.zeros(n_examples, np.int64), 0, np.int64),
        b=pick(t.b, np.zeros(n_examples, np.int64), 0, np.int64),
        has_text=pick(ranked.nonempty, np.zeros(n_examples, bool), True, bool),
        first=np.cumsum(count) - count,
        count=count,
        wide=wide | (dtype == np.float64),
    )


# --------------------------------------------------------------------------------------------------------
# Texts and answers
# --------------------------------------------------------------------------------------------------------


def _answers(entries: _Entries, null: _Null | None, contexts: list[str], threshold: float):
    """(answer texts, SQuAD 2.0 null odds or None) per question.

    SQuAD v1.1: the first entry's text. SQuAD 2.0: the best non-null entry is the first whose text is not ``""``
    (the ``"empty"`` placeholder counts); the answer is ``""`` when ``null score - its start and end logits``
    exceeds ``threshold``. Where utils_qa raises IndexError (every entry's text is ``""``) the ``"empty"``
    placeholder is the best non-null answer.
    """
    n_examples = entries.count.size
    if null is None:
        best, best_ok = entries.first, np.ones(n_examples, bool)
    else:
        rows = np.flatnonzero(entries.has_text)
        found, first_row = np.unique(entries.ex[rows], return_index=True)
        best, best_ok = np.zeros(n_examples, np.int64), np.zeros(n_examples, bool)
        best[found], best_ok[found] = rows[first_row], True
    texts = [
        "empty" if (kind == _EMPTY or not ok) else contexts[i][a:b]
        for i, (kind, ok, a, b) in enumerate(
            zip(entries.kind[best].tolist(), best_ok.tolist(), entries.a[best].tolist(), entries.b[best].tolist())
        )
    ]
    if null is None:
        return texts, None
    zero = entries.score.dtype.type(0)
    score_diff = (
        null.score
        - np.where(best_ok, entries.start_logit[best], zero)
        - np.where(best_ok, entries.end_logit[best], zero)
    )
    return ["" if no else text for text, no in zip(texts, (score_diff > threshold).tolist())], score_diff


def _best_span_texts(candidates: _Spans, inputs: QAInputs, n: int) -> list[str]:
    """SQuAD v1.1 answers without ranking every span or building the lists (what :func:`_answers` gives): each
    question's best span, or ``"empty"`` when it has no allowed span, or only one and its text is ``""``.

    Candidates come grouped by window, best first, so a question's best span is the best of its windows' first
    spans, the earliest window winning a tie (the stable sort of the loop)."""
    contexts = inputs.contexts
    firsts = np.flatnonzero(np.r_[True, candidates.feature[1:] != candidates.feature[:-1]])[: candidates.ex.size]
    order = firsts[_stable_order_by_row_score(candidates.ex[firsts], candidates.score[firsts])]
    ex = candidates.ex[order]
    best = candidates.take(order[np.r_[True, ex[1:] != ex[:-1]]] if ex.size else order).with_chars(inputs.offsets)
    count = np.bincount(candidates.ex, minlength=inputs.n_examples)
    ctx_len = np.fromiter((len(contexts[i]) for i in best.ex.tolist()), np.int64, best.ex.size)
    use = (np.minimum(count[best.ex], n) > 1) | _slice_nonempty(best.a, best.b, ctx_len)  # lists hold min(count, n)
    texts = ["empty"] * inputs.n_examples
    for i, x, y in zip(best.ex[use].tolist(), best.a[use].tolist(), best.b[use].tolist()):
        texts[i] = contexts[i][x:y]
    return texts


# --------------------------------------------------------------------------------------------------------
# The pipeline
# --------------------------------------------------------------------------------------------------------


def _check_settings(n_best_size: Any, max_answer_length: Any, null_score_diff_threshold: Any) -> None:
    if not isinstance(n_best_size, numbers.Integral) or isinstance(n_best_size, bool) or n_best_size < 1:
        raise ValueError(f"n_best_size must be a positive integer, got {n_best_size!r}")
    if not isinstance(max_answer_length, numbers.Integral) or isinstance(max_answer_length, bool):
        raise ValueError(f"max_answer_length must be an integer, got {max_answer_length!r}")
    if not isinstance(null_score_diff_threshold, numbers.Real) or isinstance(null_score_diff_threshold, bool):
        raise ValueError(f"null_score_diff_threshold must be a real number, got {null_score_diff_threshold!r}")


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
            duplicate ids, NaN or infinite logits, empty inputs, an example without any feature).
        TypeError: an unsupported container.
    """
    _check_settings(n_best_size, max_answer_length, null_score_diff_threshold)
    n, v2 = int(n_best_size), bool(version_2_with_negative)
    start, end = read_logits(predictions)
    # Each array is ranked in its own dtype (as np.argsort sees it); sums promote as numpy scalars do.
    dtype = np.result_type(start.dtype, end.dtype)
    inputs = read_inputs(examples, features, *start.shape)
    logger.info(f"Post-processing {inputs.n_examples} example predictions split into {start.shape[0]} features.")

    candidates = _window_candidates(start, end, inputs, n, int(max_answer_length))
    ids = inputs.example_ids
    if not (v2 or with_nbest):  # answers only: no n-best lists to build
        return QAPostprocessResult(collections.OrderedDict(zip(ids, _best_span_texts(candidates, inputs, n))))
    ranked = _rank_per_question(candidates, inputs, n)
    null = _null_answers(start, end, inputs.feat2ex, inputs.n_examples) if v2 else None
    entries = _nbest_entries(ranked, null, n, dtype)
    return _ranked_result(entries, ranked, null, inputs, null_score_diff_threshold, with_nbest)


def _ranked_result(
    entries: _Entries,
    ranked: _Ranked,
    null: _Null | None,
    inputs: QAInputs,
    null_score_diff_threshold: float,
    with_nbest: bool,
) -> QAPostprocessResult:
    """The answers from the n-best lists; the lists themselves if asked for; SQuAD 2.0 (``null`` given): the null
    odds and no-answer probabilities."""
    ids = inputs.example_ids
    texts, score_diff = _answers(entries, null, inputs.contexts, null_score_diff_threshold)
    nbest = None
    if with_nbest:
        probabilities = _grouped_softmax(entries.score, entries.wide, entries.first, entries.count)
        nbest = _nbest_lists(ids, inputs.contexts, entries, probabilities)
    return QAPostprocessResult(
        predictions=collections.OrderedDict(zip(ids, texts)),
        nbest=nbest,
        null_odds=None if null is None else collections.OrderedDict(zip(ids, score_diff.tolist())),
        no_answer_probability=None
        if null is None
        else collections.OrderedDict(zip(ids, _no_answer_probability(null.score, ranked).tolist())),
        version_2_with_negative=null is not None,
    )


def _nbest_lists(example_ids: list, contexts: list[str], entries: _Entries, probabilities: np.ndarray):
    """The n-best dicts of every question, keys in utils_qa's order (entries are contiguous per question)."""
    gc_enabled = gc.isenabled()
    gc.disable()  # hundreds of thousands of small dicts: no need for cyclic GC passes while building them
    try:
        rows = [
            {"text": "empty", "start_logit": 0.0, "end_logit": 0.0, "probability": pr}
            if kind == _EMPTY
            else {"start_logit": sl, "end_logit": el, "text": contexts[ex][a:b], "probability": pr}
            for kind, ex, a, b, sl, el, pr in zip(
                entries.kind.tolist(),
                entries.ex.tolist(),
                entries.a.tolist(),
                entries.b.tolist(),
                entries.start_logit.tolist(),
                entries.end_logit.tolist(),
                probabilities.tolist(),
            )
        ]
        return collections.OrderedDict(
            (eid, rows[lo : lo + cnt])
            for eid, lo, cnt in zip(example_ids, entries.first.tolist(), entries.count.tolist())
        )
    finally:
        if gc_enabled:
            gc.enable()


def _no_answer_probability(null_score: np.ndarray, ranked: _Ranked) -> np.ndarray:
    """exp(s_null) / (exp(s_null) + sum exp(s_span)) over each question's n-best spans, in float64."""
    s_null = null_score.astype(np.float64)
    spans = ranked.spans.score.astype(np.float64)
    top = np.full(s_null.shape, -np.inf)
    has = ranked.count > 0
    first = np.cumsum(ranked.count) - ranked.count
    top[has] = spans[first[has]]  # spans are sorted best first within each question
    m = np.maximum(s_null, top)

    def weight(s, m_):
        with np.errstate(invalid="ignore", over="ignore"):
            return np.where(s == m_, 1.0, np.exp(s - m_))

    w_null = weight(s_null, m)
    w_spans = np.bincount(ranked.spans.ex, weights=weight(spans, m[ranked.spans.ex]), minlength=s_null.size)
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
    durable.sync_files(paths.values())  # on disk before the run reports them
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
    return _postprocess(
        examples, features, predictions, version_2_with_negative, n_best_size, max_answer_length,
        null_score_diff_threshold, output_dir, prefix, log_level, with_nbest=True,
    )  # fmt: skip


def _postprocess(
    examples, features, predictions, version_2_with_negative, n_best_size, max_answer_length,
    null_score_diff_threshold, output_dir, prefix, log_level, with_nbest: bool,
) -> QAPostprocessResult:  # fmt: skip
    """The two public functions' body: compute, then write HF's files when ``output_dir`` is given."""
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
        with_nbest=with_nbest or output_dir is not None,
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
    return _postprocess(
        examples, features, predictions, version_2_with_negative, n_best_size, max_answer_length,
        null_score_diff_threshold, output_dir, prefix, log_level, with_nbest=False,
    ).predictions  # fmt: skip
