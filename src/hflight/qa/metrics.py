"""SQuAD v1.1 / v2.0 metrics with the semantics of the official evaluation scripts, plus a torchmetrics Metric.

:func:`squad_metrics` takes the inputs of Hugging Face ``evaluate``'s ``squad`` / ``squad_v2`` metrics::

    predictions = [{"id": str, "prediction_text": str}]                       # SQuAD v1.1
    predictions = [{"id": str, "prediction_text": str, "no_answer_probability": float}]  # SQuAD 2.0
    references  = [{"id": str, "answers": {"text": [str, ...], "answer_start": [int, ...]}}]

and returns, in percent (float64):

* v1.1 (``evaluate-v1.1.py``): ``exact_match``, ``f1``;
* v2.0 (``evaluate-v2.0.py``): ``exact``, ``f1``, ``total``, ``HasAns_exact``, ``HasAns_f1``,
  ``HasAns_total`` (if any question has an answer), ``NoAns_exact``, ``NoAns_f1``, ``NoAns_total`` (if any
  has none), ``best_exact``, ``best_exact_thresh``, ``best_f1``, ``best_f1_thresh``.

Semantics, reproduced operation for operation (so leaderboard predictions score exactly as published):

* normalisation: lower-case, drop ASCII punctuation, drop the words ``a``/``an``/``the``, collapse whitespace;
* token F1 over the normalised whitespace tokens, max over the gold answers; exact match likewise;
* v1.1: a prediction that normalises to nothing scores F1 0; a question without gold answers is an error
  (the official script crashes on it) -- use ``version_2_with_negative=True`` for unanswerable questions;
* v2.0: gold answers that normalise to nothing are dropped and a question left without any has the single
  gold answer ``""``; F1 is 1 when both sides are empty, 0 when only one is; ``HasAns`` is whether the
  question lists any answer at all; with ``no_answer_probability > no_answer_threshold`` (default 1.0, so
  never for probabilities) the question is scored as a no-answer prediction; ``best_*`` come from the
  official ``find_best_thresh`` (questions sorted stably by probability in prediction order, running score
  starting from the number of unanswerable questions, first strict maximum);
* sums are accumulated left to right in reference order (the scripts' loops; Python < 3.12 ``sum``), the
  total is ``100.0 * sum / count``.

Where the scripts crash or disagree with each other, this module decides as follows (documented choices):

* a reference without a prediction is scored 0 (exact and F1) and counted in every total, in v1.1 as the
  official script does (it prints ``Unanswered question ... will receive score 0.`` to stderr) and in v2.0,
  where the official script would crash (it prints ``Missing prediction for ...``); in the best-threshold
  search such a question is simply wrong at every threshold;
* predictions without a reference are ignored (as both scripts do);
* duplicate ids, missing keys, wrong types and NaN probabilities raise :class:`ValueError`.

HF ``evaluate``'s ``squad_v2`` stores ``no_answer_probability`` as float32, so its ``best_*_thresh`` are
float32-rounded; this module keeps the probabilities as given (float64), like the official script.

:class:`SquadMetric` is the same computation as a :class:`torchmetrics.Metric`: ``update`` scores each
question right away (strings cannot be all-gathered) into float64 tensor states, ``compute`` aggregates
the gathered tensors with the same code as :func:`squad_metrics`.
"""

from __future__ import annotations

import collections
import hashlib
import math
import numbers
import re
import string
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "normalize_answer",
    "squad_metrics",
    "squad_references_from_json",
    "SquadMetric",
]

_PUNCTUATION = str.maketrans("", "", string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)


def normalize_answer(text: str) -> str:
    """Lower-case, drop ASCII punctuation and the articles a/an/the, collapse whitespace (SQuAD's normalisation)."""
    text = text.lower().translate(_PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _num_same(pred_counts: Mapping[str, int], gold_counts: Mapping[str, int]) -> int:
    """``sum((Counter(pred) & Counter(gold)).values())``: tokens in common, with multiplicity."""
    if len(pred_counts) > len(gold_counts):
        pred_counts, gold_counts = gold_counts, pred_counts
    return sum(min(n, gold_counts[t]) for t, n in pred_counts.items() if t in gold_counts)


def _f1_from_counts(num_same: int, n_pred: int, n_gold: int) -> float:
    """The scripts' token F1 from counts (same operations, so the same float)."""
    if num_same == 0:
        return 0
    precision = 1.0 * num_same / n_pred
    recall = 1.0 * num_same / n_gold
    return (2 * precision * recall) / (precision + recall)


class _Normalized:
    """A text's normalised form, tokens and token counts (cached per distinct string)."""

    __slots__ = ("text", "n_tokens", "counts")

    def __init__(self, raw: str) -> None:
        self.text = normalize_answer(raw)
        tokens = self.text.split()
        self.n_tokens = len(tokens)
        self.counts = collections.Counter(tokens)


def _f1_v1(pred: _Normalized, gold: _Normalized) -> float:
    """evaluate-v1.1.py's f1_score (an empty prediction or gold scores 0)."""
    return _f1_from_counts(_num_same(pred.counts, gold.counts), pred.n_tokens, gold.n_tokens)


def _f1_v2(gold: _Normalized, pred: _Normalized) -> float:
    """evaluate-v2.0.py's compute_f1: 1 when both sides are empty (no answer), 0 when only one is."""
    if gold.n_tokens == 0 or pred.n_tokens == 0:
        return int(gold.n_tokens == pred.n_tokens)
    return _f1_from_counts(_num_same(gold.counts, pred.counts), pred.n_tokens, gold.n_tokens)


# --------------------------------------------------------------------------------------------------------
# Input validation
# --------------------------------------------------------------------------------------------------------


def _gold_texts(ref: Mapping, where: str) -> list[str]:
    answers = ref["answers"]
    if isinstance(answers, Mapping):
        if "text" not in answers:
            raise ValueError(f"{where}: 'answers' has no 'text' list")
        texts = answers["text"]
    elif isinstance(answers, Sequence) and not isinstance(answers, (str, bytes)):
        texts = []
        for a in answers:  # the official JSON layout: [{"text": ..., "answer_start": ...}]
            if not isinstance(a, Mapping) or "text" not in a:
                raise ValueError(
                    f"{where}: 'answers' must be {{'text': [...], 'answer_start': [...]}} or a list of {{'text': ...}}"
                )
            texts.append(a["text"])
    else:
        raise ValueError(
            f"{where}: 'answers' must be {{'text': [...], 'answer_start': [...]}}, got {type(answers).__name__}"
        )
    if isinstance(texts, (str, bytes)) or not isinstance(texts, (Sequence, np.ndarray)):
        raise ValueError(f"{where}: answers['text'] must be a list of strings, got {type(texts).__name__}")
    texts = list(texts)
    for t in texts:
        if not isinstance(t, str):
            raise ValueError(f"{where}: answers['text'] must hold strings, got {type(t).__name__}")
    return texts


def _check_references(references: Any) -> list[tuple[str, list[str]]]:
    if isinstance(references, (str, bytes, Mapping)) or not hasattr(references, "__iter__"):
        raise ValueError("references must be a list of {'id': ..., 'answers': {'text': [...], 'answer_start': [...]}}")
    out, seen = [], {}
    for i, ref in enumerate(references):
        if not isinstance(ref, Mapping):
            raise ValueError(f"reference {i} must be a dict with 'id' and 'answers', got {type(ref).__name__}")
        for key in ("id", "answers"):
            if key not in ref:
                raise ValueError(f"reference {i} has no {key!r} key (keys: {list(ref.keys())})")
        qid = ref["id"]
        if not isinstance(qid, str):
            raise ValueError(f"reference {i}: 'id' must be a string, got {type(qid).__name__}")
        if qid in seen:
            raise ValueError(f"duplicate reference id {qid!r} (references {seen[qid]} and {i})")
        seen[qid] = i
        out.append((qid, _gold_texts(ref, f"reference {qid!r}")))
    return out


def _check_predictions(predictions: Any, version_2: bool) -> dict[str, tuple[str, float, int]]:
    """{id: (text, no_answer_probability, position)}; a {id: text} mapping is accepted (probabilities 0.0)."""
    if isinstance(predictions, Mapping):
        out = {}
        for pos, (qid, text) in enumerate(predictions.items()):
            if not isinstance(qid, str) or not isinstance(text, str):
                raise ValueError(
                    "predictions as a mapping must be {id: answer text} of strings; "
                    f"got {qid!r}: {type(text).__name__}"
                )
            out[qid] = (text, 0.0, pos)
        return out
    if isinstance(predictions, (str, bytes)) or not hasattr(predictions, "__iter__"):
        raise ValueError("predictions must be a list of {'id': ..., 'prediction_text': ...} dicts")
    keys = ("id", "prediction_text", "no_answer_probability") if version_2 else ("id", "prediction_text")
    out = {}
    for i, pred in enumerate(predictions):
        if not isinstance(pred, Mapping):
            raise ValueError(f"prediction {i} must be a dict, got {type(pred).__name__}")
        for key in keys:
            if key not in pred:
                hint = " (use 0.0 when the model gives none)" if key == "no_answer_probability" else ""
                raise ValueError(f"prediction {i} has no {key!r} key{hint} (keys: {list(pred.keys())})")
        qid, text = pred["id"], pred["prediction_text"]
        if not isinstance(qid, str):
            raise ValueError(f"prediction {i}: 'id' must be a string, got {type(qid).__name__}")
        if not isinstance(text, str):
            raise ValueError(f"prediction {qid!r}: 'prediction_text' must be a string, got {type(text).__name__}")
        prob = 0.0
        if version_2:
            prob = pred["no_answer_probability"]
            if hasattr(prob, "item") and not isinstance(prob, numbers.Real):  # a 0-d array or 1-element tensor
                try:
                    prob = prob.item()
                except (ValueError, RuntimeError):
                    raise ValueError(f"prediction {qid!r}: 'no_answer_probability' must be a single number") from None
            if isinstance(prob, bool) or not isinstance(prob, numbers.Real):
                raise ValueError(
                    f"prediction {qid!r}: 'no_answer_probability' must be a number, got {type(prob).__name__}"
                )
            prob = float(prob)
            if math.isnan(prob):
                raise ValueError(f"prediction {qid!r}: 'no_answer_probability' is NaN")
        if qid in out:
            raise ValueError(f"duplicate prediction id {qid!r} (predictions {out[qid][2]} and {i})")
        out[qid] = (text, prob, i)
    return out


# --------------------------------------------------------------------------------------------------------
# Per-question scores and the aggregation shared by squad_metrics and SquadMetric
# --------------------------------------------------------------------------------------------------------

# Columns of the per-question records (float64).
_EXACT, _F1, _ANSWERED, _HAS_ANS, _NA_PROB, _PRED_NONEMPTY, _PRED_POS, _ROW = range(8)
_N_COLUMNS = 8


def _score_questions(predictions: Any, references: Any, version_2: bool) -> tuple[np.ndarray, list[str]]:
    """One float64 record per reference, in reference order (see the column constants), and the ids.

    ``_PRED_POS`` is the position of the question's prediction in ``predictions`` (the tie order of the
    best-threshold search), ``_ROW`` the position of the reference in ``references``.
    """
    refs = _check_references(references)
    preds = _check_predictions(predictions, version_2)
    records = np.zeros((len(refs), _N_COLUMNS), np.float64)
    cache: dict[str, _Normalized] = {}

    def norm(text: str) -> _Normalized:
        n = cache.get(text)
        if n is None:
            n = cache[text] = _Normalized(text)
        return n

    for row, (qid, golds) in enumerate(refs):
        rec = records[row]
        rec[_ROW] = row
        rec[_HAS_ANS] = bool(golds)
        if not version_2 and not golds:
            raise ValueError(
                f"reference {qid!r} has no gold answer: SQuAD v1.1 needs at least one "
                f"(use version_2_with_negative=True for unanswerable questions)"
            )
        if qid not in preds:
            if version_2:
                print(f"Missing prediction for {qid}")
            else:
                print(f"Unanswered question {qid} will receive score 0.", file=sys.stderr)
            continue
        text, prob, pos = preds[qid]
        rec[_ANSWERED] = 1.0
        rec[_NA_PROB] = prob
        rec[_PRED_POS] = pos
        rec[_PRED_NONEMPTY] = bool(text)
        pred = norm(text)
        if version_2:
            gold_norms = [g for g in (norm(t) for t in golds) if g.text] or [norm("")]
            rec[_EXACT] = max(int(g.text == pred.text) for g in gold_norms)
            rec[_F1] = max(_f1_v2(g, pred) for g in gold_norms)
        else:
            gold_norms = [norm(t) for t in golds]
            rec[_EXACT] = max(pred.text == g.text for g in gold_norms)
            rec[_F1] = max(_f1_v1(pred, g) for g in gold_norms)
    return records, [qid for qid, _ in refs]


def _left_sum(values: np.ndarray) -> float:
    """Left-to-right float64 sum (the scripts' ``+=`` loops; NOT numpy's pairwise or Python 3.12's compensated sum)."""
    return float(np.add.accumulate(values)[-1]) if values.size else 0.0


def _aggregate(records: np.ndarray, version_2: bool, no_answer_threshold: float = 1.0) -> dict[str, Any]:
    """The official scripts' totals from per-question records (rows in reference order)."""
    total = records.shape[0]
    if total == 0:
        raise ValueError("no references to score")
    exact, f1 = records[:, _EXACT], records[:, _F1]
    if not version_2:
        return {"exact_match": 100.0 * _left_sum(exact) / total, "f1": 100.0 * _left_sum(f1) / total}

    answered = records[:, _ANSWERED] > 0
    has_ans = records[:, _HAS_ANS] > 0
    na_prob = records[:, _NA_PROB]
    pred_na = answered & (na_prob > no_answer_threshold)
    exact_t = np.where(pred_na, (~has_ans).astype(np.float64), exact)
    f1_t = np.where(pred_na, (~has_ans).astype(np.float64), f1)

    out: dict[str, Any] = {
        "exact": 100.0 * _left_sum(exact_t) / total,
        "f1": 100.0 * _left_sum(f1_t) / total,
        "total": total,
    }
    for name, mask in (("HasAns", has_ans), ("NoAns", ~has_ans)):
        n = int(mask.sum())
        if n:
            out[f"{name}_exact"] = 100.0 * _left_sum(exact_t[mask]) / n
            out[f"{name}_f1"] = 100.0 * _left_sum(f1_t[mask]) / n
            out[f"{name}_total"] = n

    # find_best_thresh: answered questions by no-answer probability (stable: prediction order on ties).
    idx = np.flatnonzero(answered)
    order = idx[np.lexsort((records[idx, _PRED_POS], na_prob[idx]))]
    num_no_ans = float(np.count_nonzero(~has_ans[idx]))
    no_ans_penalty = np.where(records[order, _PRED_NONEMPTY] > 0, -1.0, 0.0)
    for name, raw in (("exact", exact), ("f1", f1)):
        diffs = np.where(has_ans[order], raw[order], no_ans_penalty)
        running = np.add.accumulate(np.concatenate([[num_no_ans], diffs]))
        best = int(np.argmax(running))  # first strict maximum, as the script's `cur_score > best_score`
        out[f"best_{name}"] = 100.0 * float(running[best]) / total
        out[f"best_{name}_thresh"] = float(na_prob[order[best - 1]]) if best > 0 else 0.0
    return out


def squad_metrics(
    predictions: Any,
    references: Any,
    version_2_with_negative: bool = False,
    no_answer_threshold: float = 1.0,
) -> dict[str, Any]:
    """Score SQuAD predictions exactly as the official v1.1 / v2.0 evaluation scripts do.

    Args:
        predictions: ``[{"id", "prediction_text"}]`` (+ ``"no_answer_probability"`` for SQuAD 2.0), as HF
            ``evaluate``'s ``squad``/``squad_v2``; a ``{id: answer text}`` mapping (the official prediction
            file) is accepted too, with no-answer probabilities 0.0.
        references: ``[{"id", "answers": {"text": [...], "answer_start": [...]}}]`` (only the texts are used;
            the official ``[{"text", "answer_start"}]`` answer lists are accepted too).
        version_2_with_negative: SQuAD 2.0 scoring (unanswerable questions, ``""`` = no answer).
        no_answer_threshold: SQuAD 2.0: a question whose ``no_answer_probability`` exceeds this is scored
            as predicted unanswerable (the official ``--na-prob-thresh``, default 1.0).

    Returns:
        v1.1: ``{"exact_match", "f1"}``; v2.0: ``{"exact", "f1", "total", "HasAns_*", "NoAns_*",
        "best_exact", "best_exact_thresh", "best_f1", "best_f1_thresh"}`` (percentages, float64).

    Raises:
        ValueError: malformed inputs (missing keys, wrong types, duplicate ids, no references, NaN
            probabilities, a v1.1 reference without answers).
    """
    if isinstance(no_answer_threshold, bool) or not isinstance(no_answer_threshold, numbers.Real):
        raise ValueError(f"no_answer_threshold must be a number, got {no_answer_threshold!r}")
    records, _ = _score_questions(predictions, references, bool(version_2_with_negative))
    return _aggregate(records, bool(version_2_with_negative), float(no_answer_threshold))


def squad_references_from_json(data: Mapping | str) -> list[dict[str, Any]]:
    """References in :func:`squad_metrics`' format from SQuAD JSON (a path or the loaded ``{"data": [...]}``).

    Questions come in file order; ``is_impossible`` questions get no answers (``plausible_answers`` are
    not answers), as in the official SQuAD 2.0 script.
    """
    if isinstance(data, (str, bytes)) or hasattr(data, "__fspath__"):
        import json

        with open(data, encoding="utf-8") as f:
            data = json.load(f)
    if not isinstance(data, Mapping) or not isinstance(data.get("data"), list):
        raise ValueError("SQuAD JSON must be an object with a 'data' list")
    refs = []
    for article in data["data"]:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                answers = [] if qa.get("is_impossible") else qa.get("answers", [])
                refs.append(
                    {
                        "id": qa["id"],
                        "answers": {
                            "text": [a["text"] for a in answers],
                            "answer_start": [a.get("answer_start", -1) for a in answers],
                        },
                    }
                )
    return refs


# --------------------------------------------------------------------------------------------------------
# torchmetrics
# --------------------------------------------------------------------------------------------------------


def _id_hash_halves(ids: list[str]) -> np.ndarray:
    """A 64-bit BLAKE2b hash of each id as two exact float64 halves, shape [n, 2]."""
    out = np.empty((len(ids), 2), np.float64)
    for row, qid in enumerate(ids):
        h = int.from_bytes(hashlib.blake2b(qid.encode("utf-8"), digest_size=8).digest(), "little")
        out[row, 0], out[row, 1] = h >> 32, h & 0xFFFFFFFF
    return out


try:
    import torch
    from torchmetrics import Metric
    from torchmetrics.utilities import dim_zero_cat
except ImportError:  # pragma: no cover - torchmetrics is a dependency of hflight
    Metric = object  # type: ignore[assignment,misc]

#: Columns of SquadMetric's state rows: the per-question record, then the id hash (high, low 32 bits).
_STATE_COLUMNS = _N_COLUMNS + 2


class SquadMetric(Metric):  # type: ignore[misc,valid-type]
    """SQuAD v1.1 / v2.0 as a :class:`torchmetrics.Metric`; ``compute()`` equals :func:`squad_metrics`.

    ``update(predictions, references)`` takes one batch in :func:`squad_metrics`' format (each batch's
    predictions must cover its own references). Strings cannot be all-gathered, so each question is scored
    at once into one float64 row: exact, F1, answered, has-answer, no-answer probability, prediction
    non-empty, position of the prediction within its batch, position of the reference within its batch,
    and a 64-bit BLAKE2b hash of the question id (as two exact 32-bit halves).

    The single state ``records`` is a list of flat float64 tensors reduced with ``"cat"`` (one all-gather;
    a process without data contributes an empty float64 tensor). ``compute()`` concatenates the rows
    (batch after batch, process after process), drops repeated question ids keeping the first occurrence
    (``DistributedSampler`` pads the last batch with repeated samples) and aggregates with the same code as
    :func:`squad_metrics`: the result equals ``squad_metrics`` on the concatenated batches, in that order.
    The metric stays in float64 (``set_dtype`` to anything else is refused).
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, version_2_with_negative: bool = False, no_answer_threshold: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if isinstance(no_answer_threshold, bool) or not isinstance(no_answer_threshold, numbers.Real):
            raise ValueError(f"no_answer_threshold must be a number, got {no_answer_threshold!r}")
        self.version_2_with_negative = bool(version_2_with_negative)
        self.no_answer_threshold = float(no_answer_threshold)
        self.add_state("records", default=[], dist_reduce_fx="cat")
        super().set_dtype(torch.float64)  # also the dtype of the empty tensor an idle process contributes

    def set_dtype(self, dst_type: Any) -> SquadMetric:
        if dst_type not in (torch.float64, "float64", "torch.float64", "double"):
            raise ValueError("SquadMetric keeps its per-question scores in float64; other dtypes are not supported")
        return super().set_dtype(torch.float64)

    def update(self, predictions: Any, references: Any) -> None:  # type: ignore[override]
        records, ids = _score_questions(predictions, references, self.version_2_with_negative)
        rows = np.concatenate([records, _id_hash_halves(ids)], axis=1)
        self.records.append(torch.as_tensor(rows.reshape(-1), dtype=torch.float64, device=self.device))

    def compute(self) -> dict[str, Any]:
        if isinstance(self.records, list) and not self.records:
            raise ValueError("SquadMetric.compute() called before any update(): no references to score")
        rows = dim_zero_cat(self.records).detach().cpu().numpy().astype(np.float64).reshape(-1, _STATE_COLUMNS)
        # Batch of each row (a batch starts where the reference position is 0), before dropping repeats.
        batch = np.cumsum(rows[:, _ROW] == 0) - 1
        _, first = np.unique(rows[:, _N_COLUMNS:], axis=0, return_index=True)
        keep = np.sort(first)
        records, batch = rows[keep, :_N_COLUMNS].copy(), batch[keep]
        # The prediction order of the concatenated batches: (batch, position within the batch).
        span = float(records[:, _PRED_POS].max() + 1) if records.size else 1.0
        records[:, _PRED_POS] = batch * span + records[:, _PRED_POS]
        return _aggregate(records, self.version_2_with_negative, self.no_answer_threshold)
