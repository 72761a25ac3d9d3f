"""Seconds per optimizer step: a plain PyTorch loop vs transformers.Trainer vs hflight, alternating in one run.

All three train the same tiny BERT question-answering model (built from a config, same initial weights) on the
same synthetic windows with the same optimizer (fused AdamW, the default ``optim`` of both trainers, with HF's
weight-decay grouping), a linear schedule with warmup and gradient clipping.

On a shared machine the speed of the same kernels drifts by 10-20% over seconds, which swamps a few percent of
framework overhead when whole runs alternate. So the three runs go in *lockstep*: each lives in its own process
(run as threads of one process, every runner was ~35% slower here) and a baton passes round-robin at the end of every
optimizer step, so exactly one of them computes at any moment and step k of each runs within the same fraction of
a second as step k of the others. A step's time is taken from the moment its runner gets the baton to the end of
its optimizer step, so it includes everything a trainer does between two steps (data loading, collation,
callbacks, logging, Lightning's loop). Start-up, the first ``--warmup`` steps and the last step (whose neighbours
may overlap a finished runner's teardown) are excluded.
``--rounds`` repeats the whole experiment with fresh trainers; the figures are medians over rounds.

    python benchmarks/train_overhead.py                 # defaults: 3 rounds x 60 steps
    python benchmarks/train_overhead.py --rounds 5 --steps 100 --hidden 256
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import statistics
import tempfile
import time
import traceback
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

import datasets  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import BertConfig, BertForQuestionAnswering, default_data_collator, get_scheduler  # noqa: E402

import hflight  # noqa: E402
from hflight.arguments.optimizers import grouped_parameters  # noqa: E402

RUNNERS = ("plain", "transformers", "hflight")


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
    n = opts.batch_size * total_steps(opts)
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


def total_steps(opts) -> int:
    return opts.warmup + opts.steps + 1


class Baton:
    """Round-robin turn-taking between runner processes, one optimizer step per turn."""

    def __init__(self, ctx, names):
        self.order = list(names)
        self.cond = ctx.Condition()
        self.turn = ctx.Value("i", 0, lock=False)  # index into order; guarded by cond
        self.active = ctx.Array("b", [True] * len(self.order), lock=False)

    def wait(self, name: str) -> None:
        index = self.order.index(name)
        with self.cond:
            self.cond.wait_for(lambda: self.turn.value == index)

    def release(self, name: str) -> None:
        """Pass the turn to the next runner still running."""
        with self.cond:
            self._advance(self.order.index(name))

    def retire(self, name: str) -> None:
        """A runner is done (or failed): never wait for it again; pass the turn on if it held it."""
        index = self.order.index(name)
        with self.cond:
            self.active[index] = False
            if self.turn.value == index:
                self._advance(index)

    def _advance(self, index: int) -> None:
        for offset in range(1, len(self.order) + 1):
            candidate = (index + offset) % len(self.order)
            if self.active[candidate]:
                self.turn.value = candidate
                break
        self.cond.notify_all()


class StepTimer:
    """Per-step durations of one runner: from getting the baton to the end of its optimizer step."""

    def __init__(self, name: str, baton: Baton, total: int):
        self.name, self.baton, self.total = name, baton, total
        self.durations: list[float] = []
        self.resumed = 0.0

    def begin(self) -> None:
        self.baton.wait(self.name)
        self.resumed = time.perf_counter()

    def step_done(self) -> None:
        self.durations.append(time.perf_counter() - self.resumed)
        finished = len(self.durations) == self.total
        if finished:
            self.baton.retire(self.name)
        else:
            self.baton.release(self.name)
            self.begin()


def per_step(durations: list[float], warmup: int) -> float:
    timed = durations[warmup:-1]
    return sum(timed) / len(timed)


class TimerCallback(transformers.TrainerCallback):
    """The same timer driven by HF events (fired by transformers.Trainer and by hflight alike)."""

    def __init__(self, timer: StepTimer):
        self.timer = timer

    def on_train_begin(self, args, state, control, **kwargs):
        self.timer.begin()

    def on_step_end(self, args, state, control, **kwargs):
        self.timer.step_done()


def train_args(opts, cls, out):
    return cls(
        output_dir=out,
        per_device_train_batch_size=opts.batch_size,
        max_steps=total_steps(opts),
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


def make_trainer_run(trainer_cls, args_cls, opts, data, timer: StepTimer, out: str):
    trainer = trainer_cls(
        build_model(opts), train_args(opts, args_cls, out), train_dataset=data, callbacks=[TimerCallback(timer)]
    )
    return trainer.train


def make_plain_run(opts, data, timer: StepTimer):
    model = build_model(opts)

    def run() -> None:
        model.train()
        loader = torch.utils.data.DataLoader(data, batch_size=opts.batch_size, collate_fn=default_data_collator)
        optimizer = torch.optim.AdamW(grouped_parameters(model, 0.01), lr=5e-4, fused=True)
        total = total_steps(opts)
        warmup = math.ceil(0.1 * total)  # warmup_steps=0.1 as a ratio, rounded up as HF does
        scheduler = get_scheduler("linear", optimizer, num_warmup_steps=warmup, num_training_steps=total)
        timer.begin()
        for batch in loader:
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            timer.step_done()

    return run


def build_run(name: str, opts, data, timer: StepTimer, out: str):
    if name == "plain":
        return make_plain_run(opts, data, timer)
    if name == "transformers":
        return make_trainer_run(transformers.Trainer, transformers.TrainingArguments, opts, data, timer, out)
    return make_trainer_run(hflight.Trainer, hflight.TrainingArguments, opts, data, timer, out)


def runner_process(name: str, opts, baton: Baton, results) -> None:
    """One runner in its own process (own main thread, allocator and thread pool), timed through the baton."""
    timer = StepTimer(name, baton, total_steps(opts))
    try:
        data = build_data(opts)
        with tempfile.TemporaryDirectory() as out:
            build_run(name, opts, data, timer, out)()
        results.put((name, timer.durations, None))
    except BaseException:  # report to the parent, and let the other runners go on
        baton.retire(name)
        results.put((name, None, traceback.format_exc()))


def one_round(opts, order) -> dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    baton = Baton(ctx, order)
    results = ctx.Queue()
    processes = [ctx.Process(target=runner_process, args=(name, opts, baton, results), name=name) for name in order]
    for process in processes:
        process.start()
    durations = {}
    for _ in processes:
        name, values, error = results.get()
        if error is not None:
            for process in processes:
                process.terminate()
            raise RuntimeError(f"runner {name!r} failed:\n{error}")
        durations[name] = values
    for process in processes:
        process.join()
    for name, values in durations.items():
        if len(values) != total_steps(opts):
            raise RuntimeError(f"{name} ran {len(values)} optimizer steps, expected {total_steps(opts)}")
    return {name: per_step(durations[name], opts.warmup) for name in RUNNERS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60, help="timed optimizer steps per runner and round")
    parser.add_argument("--warmup", type=int, default=5, help="untimed optimizer steps at the start of each run")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    opts = parser.parse_args()
    if opts.steps < 2 or opts.warmup < 1:
        parser.error("--steps must be >= 2 and --warmup >= 1")

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, threads {torch.get_num_threads()}")
    print(
        f"model: BERT-QA hidden={opts.hidden} layers={opts.layers}, batch {opts.batch_size} x {opts.seq_len} tokens; "
        f"{opts.rounds} rounds x {opts.steps} timed steps (+{opts.warmup} warm-up), runners in lockstep"
    )
    times: dict[str, list[float]] = {name: [] for name in RUNNERS}
    ratios: dict[str, list[float]] = {"hflight/plain": [], "hflight/transformers": [], "transformers/plain": []}
    for round_index in range(opts.rounds):
        order = RUNNERS if round_index % 2 == 0 else tuple(reversed(RUNNERS))
        result = one_round(opts, order)
        for name in RUNNERS:
            times[name].append(result[name])
        for key in ratios:
            a, b = key.split("/")
            ratios[key].append(result[a] / result[b])
        print(f"round {round_index + 1}: " + ", ".join(f"{n} {result[n] * 1e3:.2f} ms" for n in RUNNERS))

    print("\nseconds per optimizer step (median over rounds):")
    for name in RUNNERS:
        print(f"  {name:13s} {statistics.median(times[name]):.5f}")
    target = {"hflight/plain": "<= 1.03", "hflight/transformers": "<= 1.00", "transformers/plain": "reference"}
    print("\nframework time per step over the plain loop (median of the per-round differences):")
    for name in RUNNERS[1:]:
        extra = statistics.median(t - p for t, p in zip(times[name], times["plain"]))
        print(f"  {name:13s} {extra * 1e3:+.2f} ms")
    print("\nratios (median of the per-round ratios):")
    for key, values in ratios.items():
        spread = f"range {min(values):.3f}-{max(values):.3f}"
        print(f"  {key:22s} = {statistics.median(values):.3f}   ({spread}; target {target[key]})")


if __name__ == "__main__":
    main()
