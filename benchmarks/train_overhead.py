"""Seconds per optimizer step: a plain PyTorch loop vs transformers.Trainer vs hflight, alternating in one run.

All three train the same tiny BERT question-answering model (built from a config) on the same synthetic
windows with the same optimizer (AdamW, HF weight-decay grouping), linear schedule with warmup and gradient
clipping. Start-up is excluded: each run's clock starts at the end of its ``warmup`` optimizer step and stops at
its last one, measured the same way for all three (timestamps taken when the step has finished).

    python benchmarks/train_overhead.py                 # defaults: 3 rounds x 60 steps
    python benchmarks/train_overhead.py --rounds 5 --steps 100 --hidden 256
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

import datasets  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import BertConfig, BertForQuestionAnswering, default_data_collator, get_scheduler  # noqa: E402

import hflight  # noqa: E402
from hflight.optim import grouped_parameters  # noqa: E402


def build_model(opts) -> BertForQuestionAnswering:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=2000,
        hidden_size=opts.hidden,
        num_hidden_layers=opts.layers,
        num_attention_heads=4,
        intermediate_size=opts.hidden * 4,
        max_position_embeddings=opts.seq_len,
    )
    return BertForQuestionAnswering(config)


def build_data(opts) -> datasets.Dataset:
    rng = np.random.default_rng(0)
    n = opts.batch_size * (opts.steps + opts.warmup)
    ids = rng.integers(5, 2000, size=(n, opts.seq_len))
    start = rng.integers(1, opts.seq_len - 8, size=n)
    return datasets.Dataset.from_dict(
        {
            "input_ids": ids.tolist(),
            "attention_mask": np.ones_like(ids).tolist(),
            "start_positions": start.tolist(),
            "end_positions": (start + 3).tolist(),
        }
    )


class StepClock(transformers.TrainerCallback):
    """Timestamps at the end of every optimizer step (works for both HF and hflight)."""

    def __init__(self):
        self.stamps: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.stamps.append(time.perf_counter())


def per_step(stamps: list[float], warmup: int) -> float:
    measured = stamps[warmup - 1 :]
    return (measured[-1] - measured[0]) / (len(measured) - 1)


def train_args(opts, cls, out):
    return cls(
        output_dir=out,
        per_device_train_batch_size=opts.batch_size,
        max_steps=opts.steps + opts.warmup,
        learning_rate=5e-4,
        warmup_steps=0.1,
        weight_decay=0.01,
        max_grad_norm=1.0,
        logging_steps=50,
        train_sampling_strategy="sequential",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_pin_memory=False,
    )


def run_trainer(trainer_cls, args_cls, opts, data) -> float:
    clock = StepClock()
    with tempfile.TemporaryDirectory() as out:
        trainer = trainer_cls(build_model(opts), train_args(opts, args_cls, out), train_dataset=data, callbacks=[clock])
        trainer.train()
    return per_step(clock.stamps, opts.warmup)


def run_plain(opts, data) -> float:
    model = build_model(opts)
    model.train()
    loader = torch.utils.data.DataLoader(data, batch_size=opts.batch_size, collate_fn=default_data_collator)
    optimizer = torch.optim.AdamW(grouped_parameters(model, 0.01), lr=5e-4)
    total = opts.steps + opts.warmup
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=int(0.1 * total + 0.999), num_training_steps=total)
    stamps = []
    for batch in loader:
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        stamps.append(time.perf_counter())
    return per_step(stamps, opts.warmup)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed optimizer steps at the start of each run")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    opts = parser.parse_args()

    data = build_data(opts)
    runners = {
        "plain": lambda: run_plain(opts, data),
        "transformers": lambda: run_trainer(transformers.Trainer, transformers.TrainingArguments, opts, data),
        "hflight": lambda: run_trainer(hflight.Trainer, hflight.TrainingArguments, opts, data),
    }
    times: dict[str, list[float]] = {name: [] for name in runners}
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, threads {torch.get_num_threads()}")
    print(
        f"model: BERT-QA hidden={opts.hidden} layers={opts.layers}, batch {opts.batch_size} x {opts.seq_len} tokens; "
        f"{opts.rounds} rounds x {opts.steps} timed steps (+{opts.warmup} warm-up)"
    )
    for round_index in range(opts.rounds):
        order = list(runners) if round_index % 2 == 0 else list(reversed(runners))
        for name in order:
            times[name].append(runners[name]())
        print(f"round {round_index + 1}: " + ", ".join(f"{n} {times[n][-1] * 1e3:.2f} ms" for n in runners))

    median = {name: statistics.median(values) for name, values in times.items()}
    print("\nseconds per optimizer step (median over rounds):")
    for name, value in median.items():
        print(f"  {name:13s} {value:.5f}")
    print(f"\nhflight / plain loop      = {median['hflight'] / median['plain']:.3f}   (target <= 1.03)")
    print(f"hflight / transformers    = {median['hflight'] / median['transformers']:.3f}   (target <= 1.00)")
    print(f"transformers / plain loop = {median['transformers'] / median['plain']:.3f}")


if __name__ == "__main__":
    main()
