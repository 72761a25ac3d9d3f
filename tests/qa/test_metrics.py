"""hflight.qa.metrics: the official SQuAD v1.1 / v2.0 scores, to the last printed digit, and SquadMetric."""

from __future__ import annotations

import collections
import json
import re
import string
from pathlib import Path

import numpy as np
import pytest
import torch

from hflight.qa.metrics import SquadMetric, normalize_answer, squad_metrics, squad_references_from_json

# ------------------------------------------------------------------------------------------------
# An independent transcription of the official scripts' logic (dict-based, explicit left-to-right sums)
# ------------------------------------------------------------------------------------------------


PUNCTUATION = set(string.punctuation)


def _official_normalize(s):
    s = s.lower()
    s = "".join(ch for ch in s if ch not in PUNCTUATION)
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def _token_f1(pred_toks, gold_toks):
    same = sum((collections.Counter(pred_toks) & collections.Counter(gold_toks)).values())
    if same == 0:
        return 0
    p, r = 1.0 * same / len(pred_toks), 1.0 * same / len(gold_toks)
    return (2 * p * r) / (p + r)


def official_v1(qas, preds):
    """evaluate-v1.1.py: qas = [(id, [gold texts])], preds = {id: text}."""
    em = f1 = total = 0
    for qid, golds in qas:
        total += 1
        if qid not in preds:
            continue
        pred = _official_normalize(preds[qid])
        em += max(pred == _official_normalize(g) for g in golds)
        f1 += max(_token_f1(pred.split(), _official_normalize(g).split()) for g in golds)
    return {"exact_match": 100.0 * em / total, "f1": 100.0 * f1 / total}


def official_v2(qas, preds, na_probs, na_prob_thresh=1.0):
    """evaluate-v2.0.py (+ find_all_best_thresh, as HF's squad_v2 always runs it); every question predicted."""
    has_ans = {qid: bool(golds) for qid, golds in qas}
    exact_raw, f1_raw = {}, {}
    for qid, golds in qas:
        golds = [g for g in golds if _official_normalize(g)] or [""]
        pred = preds[qid]
        exact_raw[qid] = max(int(_official_normalize(g) == _official_normalize(pred)) for g in golds)
        scores = []
        for g in golds:
            gt, pt = _official_normalize(g).split() if g else [], _official_normalize(pred).split() if pred else []
            scores.append(int(gt == pt) if not gt or not pt else _token_f1(pt, gt))
        f1_raw[qid] = max(scores)

    def threshold(raw):
        return {q: float(not has_ans[q]) if na_probs[q] > na_prob_thresh else s for q, s in raw.items()}

    def summary(ex, f1, qids):
        e = f = 0
        for q in qids:
            e += ex[q]
            f += f1[q]
        return 100.0 * e / len(qids), 100.0 * f / len(qids), len(qids)

    ex_t, f1_t = threshold(exact_raw), threshold(f1_raw)
    out = dict(zip(("exact", "f1", "total"), summary(ex_t, f1_t, list(exact_raw))))
    for name, qids in (
        ("HasAns", [q for q in has_ans if has_ans[q]]),
        ("NoAns", [q for q in has_ans if not has_ans[q]]),
    ):
        if qids:
            out.update(zip((f"{name}_exact", f"{name}_f1", f"{name}_total"), summary(ex_t, f1_t, qids)))
    for name, raw in (("exact", exact_raw), ("f1", f1_raw)):
        cur = best = sum(1 for q in has_ans if not has_ans[q])
        best_thresh = 0.0
        for qid in sorted(na_probs, key=lambda q: na_probs[q]):
            if qid not in raw:
                continue
            cur += raw[qid] if has_ans[qid] else (-1 if preds[qid] else 0)
            if cur > best:
                best, best_thresh = cur, na_probs[qid]
        out[f"best_{name}"] = 100.0 * best / len(raw)
        out[f"best_{name}_thresh"] = best_thresh
    return out


def as_qas(references):
    return [(r["id"], list(r["answers"]["text"])) for r in references]


# ------------------------------------------------------------------------------------------------
# Real leaderboard predictions against the README's official numbers
# ------------------------------------------------------------------------------------------------


def readme_tables(shared_data: Path):
    """{file stem prefix: {metric: printed string}} for v1.1 and v2.0, and the v2 HasAns/NoAns totals."""
    v1, v2, totals, section = {}, {}, (), None
    for line in (shared_data / "README.md").read_text().splitlines():
        if line.startswith("SQuAD v1.1, against"):
            section = "v1"
        elif line.startswith("SQuAD 2.0, against"):
            section = "v2"
        if section is None or not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if section == "v2" and "HasAns" in line:
            totals = tuple(int(n.replace(",", "")) for n in re.findall(r"\(([\d,]+)\)", line))
        if not re.fullmatch(r"\d+\.\d+", cells[1] if len(cells) > 1 else ""):
            continue
        name = cells[0].split(" (")[0].rstrip(".").rstrip("-")
        if section == "v1":
            v1[name] = {"exact_match": cells[1], "f1": cells[2], "note": cells[0]}
        else:
            has_exact, has_f1 = (c.strip() for c in cells[3].split("/"))
            v2[name] = {
                "exact": cells[1],
                "f1": cells[2],
                "HasAns_exact": has_exact,
                "HasAns_f1": has_f1,
                "NoAns_exact": cells[4],
            }
    return v1, v2, totals


def prediction_file(folder: Path, name: str) -> Path:
    matches = [p for p in folder.glob("*.json") if p.stem == name or p.stem.startswith(name)]
    assert len(matches) == 1, (name, matches)
    return matches[0]


def assert_reproduces(got: float, printed: str):
    decimals = len(printed.split(".")[1])
    assert f"{got:.{decimals}f}" == printed
    if len(printed.replace(".", "").lstrip("0")) >= 14:  # the full repr is printed: bit-for-bit equality
        assert got == float(printed) and repr(got) == printed


@pytest.fixture(scope="module")
def v1_references(shared_data):
    return squad_references_from_json(shared_data / "squad-v1.1" / "dev-v1.1.json")


@pytest.fixture(scope="module")
def v2_key_references(shared_data):
    return squad_references_from_json(str(shared_data / "squad-v2.0-dev-key" / "dev-v2.0-answer-key.json"))


def test_readme_tables_parse(shared_data):
    v1, v2, totals = readme_tables(shared_data)
    assert len(v1) == 5 and len(v2) == 3 and totals == (5928, 5945)


def test_leaderboard_v1_reproduces_official_scores(shared_data, v1_references, capfd):
    v1, _, _ = readme_tables(shared_data)
    assert len(v1_references) == 10570
    for name, expected in v1.items():
        preds = json.loads(prediction_file(shared_data / "leaderboard-predictions" / "v1.1", name).read_text())
        listed = [{"id": k, "prediction_text": v} for k, v in preds.items()]
        got = squad_metrics(listed, v1_references)
        assert list(got) == ["exact_match", "f1"]
        assert_reproduces(got["exact_match"], expected["exact_match"])
        assert_reproduces(got["f1"], expected["f1"])
        if unanswered := re.search(r"(\d+) questions unanswered", expected["note"]):
            assert squad_metrics(preds, v1_references) == got  # the official {id: text} file works as is
        err = capfd.readouterr().err
        assert err.count("Unanswered question") == (2 * int(unanswered.group(1)) if unanswered else 0)
        assert "will receive score 0." in err or not unanswered


def test_leaderboard_v2_reproduces_official_scores(shared_data, v2_key_references):
    _, v2, (has_total, no_total) = readme_tables(shared_data)
    refs = v2_key_references
    assert len(refs) == 11873
    # the answer key has answer_start -1 everywhere: only the texts matter
    assert all(s == -1 for r in refs for s in r["answers"]["answer_start"])
    for name, expected in v2.items():
        preds = json.loads(prediction_file(shared_data / "leaderboard-predictions" / "v2.0", name).read_text())
        listed = [{"id": k, "prediction_text": v, "no_answer_probability": 0.0} for k, v in preds.items()]
        got = squad_metrics(listed, refs, version_2_with_negative=True)
        assert list(got) == [
            "exact", "f1", "total", "HasAns_exact", "HasAns_f1", "HasAns_total",
            "NoAns_exact", "NoAns_f1", "NoAns_total", "best_exact", "best_exact_thresh", "best_f1", "best_f1_thresh",
        ]  # fmt: skip
        for key, printed in expected.items():
            assert_reproduces(got[key], printed)
        assert (got["total"], got["HasAns_total"], got["NoAns_total"]) == (11873, has_total, no_total)
        assert got["NoAns_f1"] == got["NoAns_exact"]
        if name.startswith("bert"):  # the same as a plain transcription of the official script, digit for digit
            assert got == official_v2(as_qas(refs), preds, {k: 0.0 for k in preds})


def test_v2_key_answer_start_is_not_used(v2_key_references):
    refs = v2_key_references[:500]
    moved = [
        {"id": r["id"], "answers": {"text": r["answers"]["text"], "answer_start": [0] * len(r["answers"]["text"])}}
        for r in refs
    ]
    preds = [
        {"id": r["id"], "prediction_text": (r["answers"]["text"] or [""])[0], "no_answer_probability": 0.0}
        for r in refs
    ]
    assert squad_metrics(preds, refs, True) == squad_metrics(preds, moved, True)
    assert squad_metrics(preds, refs, True)["exact"] == 100.0


@pytest.mark.parametrize("thresh", [1.0, 0.5])
def test_v2_best_threshold_with_real_probabilities(shared_data, v2_key_references, thresh):
    """Random no-answer probabilities (rounded: many ties), predictions in a shuffled order, extra ids."""
    preds = json.loads(prediction_file(shared_data / "leaderboard-predictions" / "v2.0", "nlnet").read_text())
    rng = np.random.default_rng(17)
    ids = list(preds)
    rng.shuffle(ids)
    probs = {k: float(np.round(rng.random(), 2)) for k in ids}
    listed = [{"id": k, "prediction_text": preds[k], "no_answer_probability": probs[k]} for k in ids]
    listed.append({"id": "not-a-question", "prediction_text": "x", "no_answer_probability": 0.5})
    got = squad_metrics(listed, v2_key_references, True, no_answer_threshold=thresh)
    expected = official_v2(as_qas(v2_key_references), preds, dict(probs, **{"not-a-question": 0.5}), thresh)
    assert got == expected
    assert got["best_f1"] >= got["f1"] - 1e-9 or thresh < 1.0  # the sweep ends at the thresh-1.0 score


# ------------------------------------------------------------------------------------------------
# Semantics on small cases
# ------------------------------------------------------------------------------------------------


def test_normalization():
    assert normalize_answer("The  Quick, brown-fox!") == "quick brownfox"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("theatre") == "theatre"
    assert normalize_answer("¿Qué?\u00a0Sí") == "¿qué sí"  # only ASCII punctuation; unicode whitespace splits
    for s in ["The  Quick, brown-fox!", "a the an", " x\ty ", "Ünïcode—dash", ""]:
        assert normalize_answer(s) == _official_normalize(s)


def _ref(qid, *texts):
    return {"id": qid, "answers": {"text": list(texts), "answer_start": [0] * len(texts)}}


def test_v1_scores_by_hand(capfd):
    refs = [_ref("a", "Denver Broncos", "the Broncos"), _ref("b", "blue whale"), _ref("c", "x")]
    preds = [{"id": "a", "prediction_text": "Broncos"}, {"id": "b", "prediction_text": "a whale of a blue whale"}]
    got = squad_metrics(preds, refs)
    # a: EM with "the Broncos" after normalisation; b: p = 2/4, r = 2/2 -> F1 2/3; c: unanswered -> 0
    assert got["exact_match"] == 100.0 * 1 / 3
    assert got["f1"] == 100.0 * (1.0 + 2 / 3) / 3
    assert "Unanswered question c will receive score 0." in capfd.readouterr().err
    assert got == official_v1(as_qas(refs), {p["id"]: p["prediction_text"] for p in preds})
    # a prediction that normalises to nothing scores 0 in v1.1, even against an empty-normalising gold
    assert squad_metrics([{"id": "t", "prediction_text": "The"}], [_ref("t", "the")]) == {
        "exact_match": 100.0,
        "f1": 0.0,
    }


def test_v2_empty_gold_handling():
    refs = [
        _ref(
            "no",
        ),  # unanswerable
        _ref("the", "The", "."),  # answers that normalise to nothing: the gold becomes ""
        _ref("yes", "Paris", "the city of Paris"),
    ]

    def score(**texts):
        preds = [{"id": k, "prediction_text": v, "no_answer_probability": 0.0} for k, v in texts.items()]
        return squad_metrics(preds, refs, version_2_with_negative=True)

    got = score(no="", the="", yes="paris")
    assert got["exact"] == 100.0 and got["f1"] == 100.0
    assert got["HasAns_total"] == 2 and got["NoAns_total"] == 1  # "the" lists answers, so it HasAns
    got = score(no="something", the="the", yes="city")
    assert got["NoAns_exact"] == 0.0
    assert got["HasAns_exact"] == 50.0  # "the" normalises to "" = the gold ""
    precision, recall = 1.0 * 1 / 1, 1.0 * 1 / 3  # "city" vs "city of paris"
    assert got["HasAns_f1"] == 100.0 * (1 + (2 * precision * recall) / (precision + recall)) / 2 == 75.0
    only_has = squad_metrics([{"id": "yes", "prediction_text": "Paris", "no_answer_probability": 0.0}], refs[2:], True)
    assert "NoAns_total" not in only_has and only_has["HasAns_total"] == 1


def test_v2_threshold_and_missing_predictions(capfd):
    refs = [_ref("h1", "red"), _ref("h2", "green"), _ref("n1"), _ref("n2")]
    preds = [
        {"id": "h1", "prediction_text": "red", "no_answer_probability": 0.2},
        {"id": "h2", "prediction_text": "blue", "no_answer_probability": 0.9},
        {"id": "n1", "prediction_text": "green", "no_answer_probability": 0.8},
        {"id": "n2", "prediction_text": "", "no_answer_probability": 0.1},
    ]
    got = squad_metrics(preds, refs, True)
    assert got["exact"] == 50.0 and got["best_exact"] == 75.0 and got["best_exact_thresh"] == 0.2
    assert got == official_v2(
        as_qas(refs),
        {p["id"]: p["prediction_text"] for p in preds},
        {p["id"]: p["no_answer_probability"] for p in preds},
    )
    # above no_answer_threshold a question counts as predicted unanswerable
    assert squad_metrics(preds, refs, True, no_answer_threshold=0.5)["exact"] == 75.0
    # a missing prediction scores 0 and counts in every total
    missing = squad_metrics(preds[:3], refs, True)
    assert missing["total"] == 4 and missing["NoAns_exact"] == 0.0 and missing["exact"] == 25.0
    assert "Missing prediction for n2" in capfd.readouterr().out


def test_malformed_inputs():
    refs = [_ref("a", "x")]
    ok = [{"id": "a", "prediction_text": "x"}]
    cases = [
        ([{"prediction_text": "x"}], refs, False, "no 'id'"),
        ([{"id": "a"}], refs, False, "no 'prediction_text'"),
        ([{"id": "a", "prediction_text": None}], refs, False, "must be a string"),
        (ok + ok, refs, False, "duplicate prediction id 'a'"),
        (ok, refs + refs, False, "duplicate reference id 'a'"),
        (ok, [{"id": "a"}], False, "no 'answers'"),
        (ok, [{"answers": {"text": ["x"]}}], False, "no 'id'"),
        (ok, [{"id": "a", "answers": {"answer_start": [1]}}], False, "no 'text'"),
        (ok, [{"id": "a", "answers": {"text": "x"}}], False, "list of strings"),
        (ok, [{"id": "a", "answers": {"text": [1]}}], False, "hold strings"),
        (ok, [], False, "no references"),
        (ok, [_ref("a")], False, "no gold answer"),
        (ok, refs, True, "no 'no_answer_probability'"),
        ([{"id": "a", "prediction_text": "x", "no_answer_probability": float("nan")}], refs, True, "NaN"),
        ([{"id": "a", "prediction_text": "x", "no_answer_probability": "0.1"}], refs, True, "must be a number"),
        ("a", refs, False, "list"),
        (ok, {"a": "x"}, False, "list"),
    ]
    for preds, references, v2, message in cases:
        with pytest.raises(ValueError, match=message):
            squad_metrics(preds, references, version_2_with_negative=v2)
    with pytest.raises(ValueError, match="no_answer_threshold"):
        squad_metrics(ok, refs, True, no_answer_threshold="1")
    # numpy / tensor probabilities are numbers
    for prob in (np.float32(0.25), torch.tensor(0.25)):
        got = squad_metrics([{"id": "a", "prediction_text": "x", "no_answer_probability": prob}], refs, True)
        assert got["exact"] == 100.0


# ------------------------------------------------------------------------------------------------
# SquadMetric (torchmetrics)
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def v2_case(shared_data, v2_key_references):
    preds = json.loads(prediction_file(shared_data / "leaderboard-predictions" / "v2.0", "bert-single").read_text())
    rng = np.random.default_rng(3)
    listed = [
        {"id": r["id"], "prediction_text": preds[r["id"]], "no_answer_probability": float(np.round(rng.random(), 1))}
        for r in v2_key_references
    ]
    return listed, v2_key_references


@pytest.fixture(scope="module")
def v1_case(shared_data, v1_references):
    preds = json.loads(prediction_file(shared_data / "leaderboard-predictions" / "v1.1", "r-net").read_text())
    return [{"id": r["id"], "prediction_text": preds[r["id"]]} for r in v1_references], v1_references


def _chunks(n, sizes):
    bounds, lo = [], 0
    for size in sizes:
        if lo >= n:
            break
        bounds.append((lo, min(n, lo + size)))
        lo += size
    if lo < n:
        bounds.append((lo, n))
    return bounds


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_squad_metric_equals_squad_metrics_over_chunks(version, v1_case, v2_case):
    preds, refs = v1_case if version == "v1" else v2_case
    v2 = version == "v2"
    expected = squad_metrics(preds, refs, v2)
    metric = SquadMetric(version_2_with_negative=v2)
    for lo, hi in _chunks(len(refs), [1, 999, 3000, 17, 2500]):
        metric.update(preds[lo:hi], refs[lo:hi])
    assert metric.compute() == expected
    if v2:
        metric.reset()
        metric.update(preds, refs)
        assert metric.compute() == expected
        thresholded = SquadMetric(version_2_with_negative=True, no_answer_threshold=0.45)
        thresholded.update(preds, refs)
        assert thresholded.compute() == squad_metrics(preds, refs, True, no_answer_threshold=0.45)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_squad_metric_merge_state(version, v1_case, v2_case):
    preds, refs = v1_case if version == "v1" else v2_case
    v2 = version == "v2"
    half = len(refs) // 2 + 3
    first, second = SquadMetric(v2), SquadMetric(v2)
    first.update(preds[:100], refs[:100])
    first.update(preds[100:half], refs[100:half])
    second.update(preds[half:], refs[half:])
    second.merge_state(first)  # torchmetrics puts the incoming state first
    assert second.compute() == squad_metrics(preds, refs, v2)


@pytest.mark.filterwarnings("ignore:The ``compute`` method")
def test_squad_metric_distributed_sync_simulated(v2_case):
    """Two processes, each with its own metric; an all-gather stand-in returns both processes' states."""
    preds, refs = v2_case
    half = 5000
    rank1 = SquadMetric(True)
    rank1.update(preds[half:], refs[half:])
    rank1_state = torch.cat(rank1.records)

    def all_gather(tensor, group=None):
        return [tensor, rank1_state]

    rank0 = SquadMetric(True, dist_sync_fn=all_gather, distributed_available_fn=lambda: True)
    rank0.update(preds[:2000], refs[:2000])
    rank0.update(preds[2000:half], refs[2000:half])
    assert rank0.compute() == squad_metrics(preds, refs, True)
    # a process that saw no data contributes an empty float64 tensor
    idle = SquadMetric(True, dist_sync_fn=all_gather, distributed_available_fn=lambda: True)
    assert idle.compute() == squad_metrics(preds[half:], refs[half:], True)


def test_squad_metric_drops_repeated_questions(v1_case):
    preds, refs = v1_case
    metric = SquadMetric()
    metric.update(preds[:300], refs[:300])
    metric.update(preds[250:600], refs[250:600])  # e.g. DistributedSampler padding
    assert metric.compute() == squad_metrics(preds[:600], refs[:600])


@pytest.mark.filterwarnings("ignore:The ``compute`` method")
def test_squad_metric_errors_and_dtype():
    metric = SquadMetric()
    with pytest.raises(ValueError, match="before any update"):
        metric.compute()
    with pytest.raises(ValueError, match="duplicate prediction id"):
        metric.update([{"id": "a", "prediction_text": "x"}] * 2, [_ref("a", "x")])
    with pytest.raises(ValueError, match="float64"):
        metric.set_dtype(torch.float32)
    metric.float()  # nn.Module dtype casts leave the float64 state alone
    metric.update([{"id": "a", "prediction_text": "x"}], [_ref("a", "x")])
    assert metric.records[0].dtype == torch.float64
    assert metric.compute() == {"exact_match": 100.0, "f1": 100.0}
    assert metric([{"id": "b", "prediction_text": "y"}], [_ref("b", "z")]) == {"exact_match": 0.0, "f1": 0.0}
