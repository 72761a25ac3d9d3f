"""Microseconds to build ``TrainingArguments``: transformers' own vs hflight's (a subclass of it), alternating.

Both build the same arguments (defaults, and a typical fine-tuning set: evaluation and saving by steps, warmup,
best-model tracking) in the same process, interleaved in blocks so that the machine's speed drift hits both alike;
the figure is the median over blocks. transformers' constructor sets up accelerate's process state on every call
(``_setup_devices``); hflight's skips it (Lightning owns the processes) and instead checks field types, the choices
Lightning can run and the fields without a Lightning equivalent.

    python benchmarks/training_args.py                 # defaults: 30 blocks x 200 constructions each
    python benchmarks/training_args.py --blocks 50 --per-block 500
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

import transformers  # noqa: E402

import hflight  # noqa: E402

CASES = {
    "defaults": dict(output_dir="out"),
    "fine-tuning": dict(
        output_dir="out",
        learning_rate=3e-5,
        per_device_train_batch_size=16,
        num_train_epochs=2,
        warmup_steps=0.1,
        eval_strategy="steps",
        eval_steps=100,
        save_steps=200,
        save_total_limit=2,
        load_best_model_at_end=True,
        metric_for_best_model="f1",
        logging_steps=50,
        report_to="none",
        seed=7,
    ),  # fmt: skip
}


def per_call_us(cls: type, kwargs: dict, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        cls(**kwargs)
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=30)
    parser.add_argument("--per-block", type=int, default=200)
    opts = parser.parse_args()
    print(f"transformers {transformers.__version__}, hflight {hflight.__version__}; "
          f"{opts.blocks} blocks x {opts.per_block} constructions, medians")  # fmt: skip
    print(f"{'case':<14}{'transformers (us)':>20}{'hflight (us)':>16}{'hflight/transformers':>24}")
    for name, kwargs in CASES.items():
        for cls in (transformers.TrainingArguments, hflight.TrainingArguments):  # imports and caches warmed up
            per_call_us(cls, kwargs, 20)
        theirs, ours, ratios = [], [], []
        for block in range(opts.blocks):
            order = (transformers.TrainingArguments, hflight.TrainingArguments)
            first, second = order if block % 2 == 0 else order[::-1]
            times = {
                first: per_call_us(first, kwargs, opts.per_block),
                second: per_call_us(second, kwargs, opts.per_block),
            }
            theirs.append(times[transformers.TrainingArguments])
            ours.append(times[hflight.TrainingArguments])
            ratios.append(ours[-1] / theirs[-1])
        print(f"{name:<14}{statistics.median(theirs):>20.0f}{statistics.median(ours):>16.0f}"
              f"{statistics.median(ratios):>24.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
