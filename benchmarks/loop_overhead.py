"""The loop's own cost per step: a plain PyTorch loop vs transformers.Trainer vs hflight, in lockstep, on a tiny model.

Training (``train()``, one optimizer step per batch), evaluation (``evaluate()`` with ``compute_metrics`` and
``preprocess_logits_for_metrics``, as run_clm.py evaluates) and prediction (``predict()``: every logit back on the
host) of a tiny GPT-2 (hidden 32, 2 layers, 16 tokens a row, built from a config), at batch 1, 2 and 16, where the
model's work is small so the loop's own work shows. The plain loop is the floor: for training, AdamW with HF's
weight-decay grouping, a linear schedule with warmup and clipping (as benchmarks/train_overhead.py); for evaluation,
what an evaluation loop must do: forward with the loss, the loss and the logits moved to the host as numpy (the
logits through ``preprocess_logits_for_metrics`` first), concatenated at the end, ``compute_metrics`` on them. Its
results are checked against transformers' and hflight's on the same inputs (same loss, metrics and predictions), so
it does the same work.

The three runners live in their own processes and take turns (a baton passed round-robin, see train_overhead.py for
why): exactly one computes at any moment, and step k of each runs within the same fraction of a second. A turn ends
at every optimizer step (``on_step_end``) or evaluation batch (``on_prediction_step``), and an evaluation call's last
turn ends when ``evaluate()``/``predict()`` returns, so an evaluation's per-step figure is the whole call (its set-up,
the batches, the concatenation and the metrics) divided by its batches. Each configuration builds fresh trainers
(untimed), then trains ``--warmup`` + ``--steps`` + 1 steps (the warm-up steps and the last one not counted) or
calls ``evaluate()``/``predict()`` ``--calls`` times on ``--steps`` batches, the first call right after the trainer's
construction as a script does. Every figure is given twice: wall-clock time, and the CPU time of the process
(``time.process_time``), which other processes on a loaded machine inflate far less; with one torch thread (the
default) the CPU time is the work done.

    python benchmarks/loop_overhead.py                        # 3 rounds, every mode, batch 1, 2 and 16
    python benchmarks/loop_overhead.py --rounds 5 --modes evaluate predict --batch-sizes 2
    python benchmarks/loop_overhead.py --modes train --stream   # the rows as a datasets stream (its position kept)
    python benchmarks/loop_overhead.py --modes evaluate --batch-sizes 2 16 --busy 1   # a busy neighbour beside
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from references import missing_references  # noqa: E402

if __name__ == "__main__" and missing_references():
    sys.exit("loop_overhead.py compares with transformers.Trainer; missing: " + ", ".join(missing_references()))

import datasets  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from train_overhead import Baton  # noqa: E402
from transformers import EvalPrediction, GPT2Config, GPT2LMHeadModel, default_data_collator, get_scheduler  # noqa: E402

import hflight  # noqa: E402
from hflight.arguments.optimizers import grouped_parameters  # noqa: E402

RUNNERS = ("plain", "transformers", "hflight")
MODES = ("train", "evaluate", "predict")


# ---- the model, the data, the metrics ---------------------------------------------------------------------------
def build_model(opts) -> GPT2LMHeadModel:
    """The same initial weights in every runner; no key/value cache (both trainers set ``config.use_cache`` from
    ``args.use_cache``, False)."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=opts.vocab, n_embd=opts.hidden, n_layer=opts.layers, n_head=2,
                        n_positions=opts.seq_len, bos_token_id=2, eos_token_id=3, pad_token_id=0,
                        use_cache=False)  # fmt: skip
    return GPT2LMHeadModel(config)


def build_data(opts, rows: int, seed: int) -> datasets.Dataset:
    """Rows of random token ids, labels = inputs (a causal LM's blocks, as run_clm.py groups them)."""
    ids = np.random.default_rng(seed).integers(5, opts.vocab, size=(rows, opts.seq_len)).tolist()
    return datasets.Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * opts.seq_len] * rows, "labels": ids})


def preprocess_logits_for_metrics(logits, labels):
    if isinstance(logits, tuple):
        logits = logits[0]
    return logits.argmax(dim=-1)


def compute_metrics(prediction: EvalPrediction) -> dict[str, float]:
    """run_clm.py's shifted accuracy."""
    preds, labels = prediction.predictions[:, :-1], prediction.label_ids[:, 1:]
    return {"accuracy": float((preds == labels).mean())}


# ---- turn-taking and timing -------------------------------------------------------------------------------------
class PhasedBaton(Baton):
    """train_overhead's baton, reused for one configuration after another: every runner enters a phase together,
    and the turn goes round in either direction (each runner then follows the other ones in turn: a runner's turn
    pays for what the one before it left in the caches)."""

    def __init__(self, ctx, names):
        super().__init__(ctx, names)
        self.barrier = ctx.Barrier(len(self.order))
        self.direction = ctx.Value("i", 1, lock=False)  # guarded by cond

    def enter_phase(self, round_index: int) -> None:
        """Wait for every runner; then all are active again, and the round decides who starts and which way the
        baton goes."""
        if self.barrier.wait() == 0:
            with self.cond:
                for index in range(len(self.order)):
                    self.active[index] = True
                self.turn.value = round_index % len(self.order)
                self.direction.value = 1 if round_index % 2 == 0 else -1
        self.barrier.wait()

    def _advance(self, index: int) -> None:
        for offset in range(1, len(self.order) + 1):
            candidate = (index + self.direction.value * offset) % len(self.order)
            if self.active[candidate]:
                self.turn.value = candidate
                break
        self.cond.notify_all()


class Laps:
    """Wall and CPU time of each of a runner's turns (from getting the baton to handing it on)."""

    def __init__(self, name: str, baton: PhasedBaton):
        self.name, self.baton = name, baton
        self.laps: list[tuple[float, float]] = []
        self._wall = self._cpu = 0.0

    def begin(self) -> None:
        self.baton.wait(self.name)
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def _record(self) -> None:
        self.laps.append((time.perf_counter() - self._wall, time.process_time() - self._cpu))

    def lap(self) -> None:
        """End this turn; the next starts when the baton comes back."""
        self._record()
        self.baton.release(self.name)
        self.begin()

    def finish(self) -> None:
        """End this runner's last turn of the phase."""
        self._record()
        self.baton.retire(self.name)


class LapCallback(transformers.TrainerCallback):
    """A turn per optimizer step and per evaluation batch (both trainers fire these events)."""

    def __init__(self, laps: Laps, train_steps: int):
        self.laps, self.train_steps = laps, train_steps

    def on_train_begin(self, args, state, control, **kwargs):
        self.laps.begin()

    def on_step_end(self, args, state, control, **kwargs):
        self.laps.finish() if state.global_step == self.train_steps else self.laps.lap()

    def on_prediction_step(self, args, state, control, **kwargs):
        self.laps.lap()


# ---- the three runners ------------------------------------------------------------------------------------------
def train_steps(opts) -> int:
    return opts.warmup + opts.steps + 1


def trainer_args(args_cls, opts, batch_size: int, out: str):
    return args_cls(
        output_dir=out, per_device_train_batch_size=batch_size, per_device_eval_batch_size=batch_size,
        max_steps=train_steps(opts), learning_rate=5e-4, warmup_steps=0.1, weight_decay=0.01, max_grad_norm=1.0,
        logging_steps=50, train_sampling_strategy="sequential", save_strategy="no", report_to="none",
        disable_tqdm=True, dataloader_pin_memory=False,
    )  # fmt: skip


def build_runner(name: str, opts, mode: str, batch_size: int, laps: Laps, out: str, data):
    """The plain loop, or a trainer (its training data given when training)."""
    if name == "plain":
        return PlainLoop(opts, mode, batch_size, laps)
    library = transformers if name == "transformers" else hflight
    metrics = dict(compute_metrics=compute_metrics, preprocess_logits_for_metrics=preprocess_logits_for_metrics)
    return library.Trainer(
        build_model(opts), trainer_args(library.TrainingArguments, opts, batch_size, out),
        data_collator=default_data_collator, train_dataset=data if mode == "train" else None,
        callbacks=[LapCallback(laps, train_steps(opts))], **(metrics if mode == "evaluate" else {}),
    )  # fmt: skip


def label_items(batch: dict) -> torch.Tensor:
    """The loss's denominator as both trainers give it to a model that accepts it: the batch's labels other than
    -100 (before the causal shift)."""
    return batch["labels"].ne(-100).sum()


class PlainLoop:
    """The floor: the same work without a trainer."""

    def __init__(self, opts, mode: str, batch_size: int, laps: Laps):
        self.opts, self.mode, self.batch_size, self.laps = opts, mode, batch_size, laps
        self.model = build_model(opts)

    def train(self, data) -> None:
        model, opts = self.model, self.opts
        model.train()
        loader = torch.utils.data.DataLoader(data, batch_size=self.batch_size, collate_fn=default_data_collator)
        optimizer = torch.optim.AdamW(grouped_parameters(model, 0.01), lr=5e-4, fused=True)
        total = train_steps(opts)
        warmup = math.ceil(0.1 * total)  # warmup_steps=0.1 as a ratio, rounded up as HF does
        scheduler = get_scheduler("linear", optimizer, num_warmup_steps=warmup, num_training_steps=total)
        self.laps.begin()
        for step, batch in enumerate(loader, 1):
            model(**batch, num_items_in_batch=label_items(batch)).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if step == total:
                self.laps.finish()
                break
            self.laps.lap()

    def evaluate(self, data) -> dict:
        """Forward with the loss; loss, logits (preprocessed when evaluating) and labels to the host; concatenated;
        the metrics."""
        model, evaluating = self.model, self.mode == "evaluate"
        model.eval()
        loader = torch.utils.data.DataLoader(data, batch_size=self.batch_size, collate_fn=default_data_collator)
        losses, preds, labels = [], [], []
        with torch.no_grad():
            for batch in loader:
                output = model(**batch, num_items_in_batch=label_items(batch))
                logits = output.logits
                if evaluating:
                    logits = preprocess_logits_for_metrics(logits, batch["labels"])
                losses.append(output.loss.detach().repeat(len(batch["labels"])).cpu().numpy())
                preds.append(logits.cpu().numpy())
                labels.append(batch["labels"].cpu().numpy())
                self.laps.lap()
        result = EvalPrediction(predictions=np.concatenate(preds), label_ids=np.concatenate(labels))
        metrics = {f"{'eval' if evaluating else 'test'}_loss": float(np.concatenate(losses).mean())}
        if evaluating:
            metrics["eval_accuracy"] = compute_metrics(result)["accuracy"]
        return {"metrics": metrics, "predictions": result.predictions}


def evaluation_call(runner, mode: str, data) -> dict:
    if isinstance(runner, PlainLoop):
        return runner.evaluate(data)
    if mode == "evaluate":
        return {"metrics": runner.evaluate(data), "predictions": None}
    output = runner.predict(data)
    return {"metrics": output.metrics, "predictions": output.predictions}


def digest(result: dict) -> dict:
    """What the three runners must agree on: the loss, the metrics, and the predictions (as sums)."""
    keys = ("eval_loss", "eval_accuracy", "test_loss")
    metrics = {k: v for k, v in result["metrics"].items() if k in keys}
    preds = result["predictions"]
    if preds is not None:
        preds = np.asarray(preds, dtype=np.float64)
        metrics.update(shape=preds.shape, sum=float(preds.sum()), sum_sq=float((preds**2).sum()))
    return metrics


def run_configuration(name: str, opts, mode: str, batch_size: int, laps: Laps, out: str) -> tuple[list, dict | None]:
    """One configuration of one runner (the baton is held only while timed). Returns the laps of each call (one
    call for training) and the last call's digest."""
    if mode == "train":
        data = build_data(opts, batch_size * (train_steps(opts) + 2), seed=1)  # + what the loaders read ahead
        if opts.stream:  # a datasets stream: hflight's loader keeps its position after every batch
            data = data.to_iterable_dataset(num_shards=4)
        runner = build_runner(name, opts, mode, batch_size, laps, out, data)
        laps.baton.enter_phase(opts.round)
        runner.train(data) if name == "plain" else runner.train()
        return [laps.laps], None
    data = build_data(opts, batch_size * opts.steps, seed=2)
    runner = build_runner(name, opts, mode, batch_size, laps, out, data)
    calls, result = [], None
    laps.baton.enter_phase(opts.round)
    laps.begin()
    for call in range(opts.calls):
        start = len(laps.laps)
        result = evaluation_call(runner, mode, data)
        laps.finish() if call == opts.calls - 1 else laps.lap()  # the call's tail: concatenation, metrics, logging
        calls.append(laps.laps[start:])
    return calls, digest(result)


def runner_process(name: str, opts, configurations, baton: PhasedBaton, results) -> None:
    torch.set_num_threads(opts.threads)
    sys.stdout = open(os.devnull, "w")  # the trainers' log lines
    transformers.logging.set_verbosity_error()
    try:
        with tempfile.TemporaryDirectory() as out:
            for round_index in range(opts.rounds + 1):  # round 0: warm-up (lazy imports, allocator), not reported
                opts.round = round_index
                for mode, batch_size in configurations:
                    laps = Laps(name, baton)
                    calls, result = run_configuration(name, opts, mode, batch_size, laps, out)
                    results.put((name, round_index, mode, batch_size, calls, result, None))
    except BaseException:  # report to the parent; the others stop at the next phase
        results.put((name, None, None, None, None, None, traceback.format_exc()))
        baton.barrier.abort()
        baton.retire(name)


# ---- figures ------------------------------------------------------------------------------------------------------
def per_step(opts, mode: str, calls: list[list[tuple[float, float]]]) -> tuple[float, float]:
    """(wall, cpu) seconds per step: training's timed steps, or evaluation calls' whole time over their batches."""
    if mode == "train":
        (laps,) = calls
        if len(laps) != train_steps(opts):
            raise RuntimeError(f"{len(laps)} optimizer steps timed, expected {train_steps(opts)}")
        timed = laps[opts.warmup : -1]
    else:
        for laps in calls:
            if len(laps) != opts.steps + 1:
                raise RuntimeError(f"{len(laps)} turns in an evaluation call, expected {opts.steps} batches + 1")
        timed = [lap for laps in calls for lap in laps]
    steps = len(timed) if mode == "train" else opts.steps * len(calls)
    return sum(w for w, _ in timed) / steps, sum(c for _, c in timed) / steps


def check_same_results(digests: dict[str, dict], mode: str, batch_size: int) -> None:
    reference = digests["transformers"]
    for name in ("plain", "hflight"):
        for key, value in reference.items():
            other = digests[name].get(key)
            close = other == value if key == "shape" else other is not None and math.isclose(other, value, rel_tol=1e-5)
            if not close:
                raise RuntimeError(f"{mode} at batch {batch_size}: {name}'s {key} is {other}, transformers' {value}")


def cpu_description() -> str:
    model, flags = "unknown CPU", set()
    with open("/proc/cpuinfo", encoding="utf-8") as info:
        for line in info:
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
    return f"{model}, {os.cpu_count()} CPUs; flags: {' '.join(f for f in wanted if f in flags) or 'none of interest'}"


def report(opts, configurations, figures, load_start) -> None:
    load_end = os.getloadavg()
    print(f"\nms per step (median over {opts.rounds} rounds); +ms = above the plain loop; load average (1 min) "
          f"{load_start[0]:.1f} at the start, {load_end[0]:.1f} at the end")  # fmt: skip
    for clock, index in (("wall-clock", 0), ("CPU time", 1)):
        print(f"\n{clock}:")
        print(f"{'mode':9} {'batch':>5} {'plain':>8} {'transformers':>14} {'hflight':>14} {'hf/tr':>7} {'hf/plain':>9}")
        for mode, batch_size in configurations:
            rounds = figures[(mode, batch_size)]
            ms = {n: statistics.median(r[n][index] for r in rounds) * 1e3 for n in RUNNERS}
            extra = {n: statistics.median((r[n][index] - r["plain"][index]) * 1e3 for r in rounds) for n in RUNNERS}
            ratio = {key: statistics.median(r[key[0]][index] / r[key[1]][index] for r in rounds)
                     for key in (("hflight", "transformers"), ("hflight", "plain"))}  # fmt: skip
            cells = [f"{ms[n]:7.2f} ({extra[n]:+5.2f})" for n in ("transformers", "hflight")]
            print(f"{mode:9} {batch_size:>5} {ms['plain']:8.2f} {cells[0]:>14} {cells[1]:>14} "
                  f"{ratio['hflight', 'transformers']:7.3f} {ratio['hflight', 'plain']:9.3f}")  # fmt: skip
    print("\nhf/tr per round (min-max over the rounds):")
    for mode, batch_size in configurations:
        rounds = figures[(mode, batch_size)]
        each = sorted(r["hflight"][0] / r["transformers"][0] for r in rounds)
        print(f"{mode:9} {batch_size:>5}  wall-clock {each[0]:.3f}-{each[-1]:.3f}")
    print("\ntargets: hflight <= transformers (hf/tr <= 1.00) and within 1 ms per step of the plain loop")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 2, 16])
    parser.add_argument("--steps", type=int, default=64, help="timed optimizer steps, or batches per evaluation call")
    parser.add_argument("--warmup", type=int, default=5, help="untimed optimizer steps at the start of training")
    parser.add_argument("--calls", type=int, default=3, help="evaluate()/predict() calls per trainer")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each runner")
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--stream", action="store_true", help="train on the rows as a datasets stream")
    parser.add_argument("--busy", type=int, default=0, help="processes that keep a core busy beside the runners")
    opts = parser.parse_args()
    if opts.steps < 2 or opts.warmup < 1 or opts.calls < 1 or opts.rounds < 1:
        parser.error("--steps must be >= 2, --warmup, --calls and --rounds >= 1")
    configurations = [(mode, batch) for mode in opts.modes for batch in opts.batch_sizes]
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, hflight {hflight.__version__}; "
          f"{opts.threads} torch thread(s) per runner; {cpu_description()}")  # fmt: skip
    print(f"model: GPT-2 hidden {opts.hidden}, {opts.layers} layers, vocab {opts.vocab}, {opts.seq_len} tokens a row; "
          f"{opts.steps} timed steps (training: +{opts.warmup} warm-up), {opts.calls} evaluation calls per trainer, "
          f"runners in lockstep{'; training on a datasets stream' if opts.stream else ''}")  # fmt: skip
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(opts.busy)]
    if busy:
        print(f"{opts.busy} busy process(es) beside the runners (a neighbour on a shared machine)")
    try:
        _measure(opts, configurations)
    finally:
        for process in busy:
            process.kill()


def _measure(opts, configurations) -> None:
    load_start = os.getloadavg()
    ctx = multiprocessing.get_context("spawn")
    baton, results = PhasedBaton(ctx, RUNNERS), ctx.Queue()
    processes = [ctx.Process(target=runner_process, args=(n, opts, configurations, baton, results), name=n)
                 for n in RUNNERS]  # fmt: skip
    for process in processes:
        process.start()
    collected: dict = {}
    for _ in range(len(RUNNERS) * len(configurations) * (opts.rounds + 1)):
        name, round_index, mode, batch_size, calls, result, error = results.get()
        if error is not None:
            for process in processes:
                process.terminate()
            raise RuntimeError(f"runner {name!r} failed:\n{error}")
        collected[(round_index, mode, batch_size, name)] = (calls, result)
    for process in processes:
        process.join()
    figures = {config: [] for config in configurations}
    for round_index in range(1, opts.rounds + 1):
        for mode, batch_size in configurations:
            runs = {n: collected[(round_index, mode, batch_size, n)] for n in RUNNERS}
            if mode != "train":
                check_same_results({n: runs[n][1] for n in RUNNERS}, mode, batch_size)
            figures[(mode, batch_size)].append({n: per_step(opts, mode, runs[n][0]) for n in RUNNERS})
    report(opts, configurations, figures, load_start)


if __name__ == "__main__":
    main()
