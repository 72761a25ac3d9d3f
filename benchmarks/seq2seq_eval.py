"""Seq2Seq evaluation with generation: hflight.Seq2SeqTrainer vs transformers.Seq2SeqTrainer, same model, same data.

    python benchmarks/seq2seq_eval.py                 # the summarization-style setting of the drop-in test
    python benchmarks/seq2seq_eval.py --examples 200  # more examples, longer generations

The model and data are those of tests/test_run_summarization_dropin.py (a tiny BART with d_model 32, random word
"texts" summarised by their first words, a WordPiece tokenizer trained locally), untrained so that generations run to
``--max-length``. Each round evaluates with both trainers in turn (``predict_with_generate``, beam search with
``--beams``), the order alternating; the medians of ``eval_runtime`` are printed with their ratio, and the script
fails unless both trainers produce the same metrics (generated tokens decoded and compared).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import DataCollatorForSeq2Seq

import hflight

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import seq2seq_data  # noqa: E402  (the drop-in test's model and data builders)


def _dataset(tokenizer, examples: int):
    import datasets

    records = seq2seq_data.summarization_records(examples, seed=2)
    sources = tokenizer([r["text"] for r in records], max_length=64, truncation=True)
    targets = tokenizer(text_target=[r["summary"] for r in records], max_length=16, truncation=True)
    return datasets.Dataset.from_dict(
        {"input_ids": sources["input_ids"], "attention_mask": sources["attention_mask"], "labels": targets["input_ids"]}
    )


def _trainer(module, folder: str, tokenizer, dataset, args: argparse.Namespace):
    model = seq2seq_data.bart_model(len(tokenizer), dropout=0.0)
    arguments = module.Seq2SeqTrainingArguments(
        folder,
        per_device_eval_batch_size=args.batch_size,
        predict_with_generate=True,
        generation_max_length=args.max_length,
        generation_num_beams=args.beams,
        report_to="none",
        disable_tqdm=True,
    )

    def compute_metrics(prediction):
        return {"generated_tokens": int((prediction.predictions != tokenizer.pad_token_id).sum())}

    return module.Seq2SeqTrainer(
        model=model,
        args=arguments,
        eval_dataset=dataset,
        processing_class=tokenizer,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model),
        compute_metrics=compute_metrics,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=6)
    parser.add_argument("--max-length", type=int, default=10)
    parser.add_argument("--beams", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = seq2seq_data.tokenizer(Path(tmp) / "tokenizer")
        dataset = _dataset(tokenizer, args.examples)
        trainers = {
            "transformers": _trainer(transformers, f"{tmp}/hf", tokenizer, dataset, args),
            "hflight": _trainer(hflight, f"{tmp}/hl", tokenizer, dataset, args),
        }
        runtimes: dict[str, list[float]] = {name: [] for name in trainers}
        metrics = {}
        for round_ in range(args.rounds):
            for name in sorted(trainers, reverse=bool(round_ % 2)):
                start = time.perf_counter()
                metrics[name] = trainers[name].evaluate()
                runtimes[name].append(time.perf_counter() - start)
    numbers = {name: {k: v for k, v in m.items() if k in ("eval_loss", "eval_generated_tokens")}
               for name, m in metrics.items()}  # fmt: skip
    if numbers["hflight"] != numbers["transformers"]:
        raise SystemExit(f"the trainers disagree: {numbers}")
    medians = {name: statistics.median(times) for name, times in runtimes.items()}
    print(f"examples={args.examples} batch={args.batch_size} max_length={args.max_length} beams={args.beams} "
          f"rounds={args.rounds} threads={args.threads}  metrics equal: {numbers['hflight']}")  # fmt: skip
    for name, median in medians.items():
        print(f"{name:>12}: evaluate() median {median:.3f} s (min {min(runtimes[name]):.3f} s)")
    print(f"ratio hflight / transformers: {medians['hflight'] / medians['transformers']:.2f}")


if __name__ == "__main__":
    main()
