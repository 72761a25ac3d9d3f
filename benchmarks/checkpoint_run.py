"""What checkpoints cost a whole training run: its wall time with and without them, end to end.

``benchmarks/checkpoint_cost.py`` times the save call, which is what the loop waits for; with ``save_async`` the rest
of the write happens beside the training steps and may slow them down (the interpreter lock, memory bandwidth, the
page cache), and the last write is waited for at the end of the run. This script times what a user pays: the wall
time of ``trainer.train()`` (the last checkpoint's write, its fsyncs and its publication included), for

- ``transformers``: ``transformers.Trainer``, its checkpoints written before training goes on (no fsync);
- ``hflight sync``: hflight's default, each checkpoint written and made durable before training goes on;
- ``hflight save_async``: ``save_async=True``, the model's tensors copied at the step boundary and the optimizer's
  beside the next step's forward and backward, written in the background (on Linux its large files by the writer
  process, ``hflight.checkpoints.writers.writer_process``, where 7 or more checkpoints are to come);
- ``hflight save_async thread``: the same, its files all written by the background thread (the writer process's
  threshold, ``asynchronous.PROCESS_MIN_BYTES``, raised above the state);

each beside the same trainer's run without checkpoints (``save_strategy="no"``), with 1 and 2 training threads
(``torch.set_num_threads``; with 1 on this 2-core machine the writer has a core of its own, as on a GPU machine).
Per checkpoint: (run with checkpoints - run without) / checkpoints, best of ``--rounds`` alternating runs, each run
in a fresh process; hflight's two kinds share their runs without checkpoints (the same run: ``save_async`` does
nothing without a checkpoint), so each one's baseline is the best of both. Target (issue 42): ``save_async`` <= 0.3x
the synchronous cost with a free core, and never above it without one.

    python benchmarks/checkpoint_run.py                      # MiniLM-L6 QA: 24 steps, a checkpoint every 6
    python benchmarks/checkpoint_run.py --threads 1 --rounds 2

The model is MiniLM-L6's shape (22.7M parameters, AdamW: about 270 MB a checkpoint) with random weights and random
token ids: a checkpoint's cost does not depend on them. The figures depend on the disk and its page cache: name both.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_cost import MODELS, qa_model_and_data  # noqa: E402
from references import missing_references  # noqa: E402

KINDS = ("transformers", "hflight sync", "hflight save_async", "hflight save_async thread")


def worker(kind: str, checkpoints: bool, threads: int, model_name: str, steps: int, save_steps: int, out: str) -> dict:
    import torch
    import transformers

    import hflight

    torch.set_num_threads(threads)
    model, data = qa_model_and_data(model_name, 2 * steps)
    library = transformers if kind == "transformers" else hflight
    fields = dict(
        output_dir=out, per_device_train_batch_size=2, max_steps=steps, logging_steps=1000, report_to="none",
        disable_tqdm=True, use_cpu=True, save_strategy="steps" if checkpoints else "no", save_steps=save_steps,
    )  # fmt: skip
    if kind.startswith("hflight save_async"):
        fields["save_async"] = True
    if kind == "hflight save_async thread":
        from hflight.checkpoints import asynchronous

        asynchronous.PROCESS_MIN_BYTES = 1 << 62  # the writer thread writes every file
    trainer = library.Trainer(model, library.TrainingArguments(**fields), train_dataset=data)
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    written = sorted(p.name for p in Path(out).iterdir() if p.name.startswith("checkpoint-"))
    return {"wall": wall, "checkpoints": written}


def run_once(kind: str, checkpoints: bool, threads: int, opts: argparse.Namespace, folder: Path) -> dict:
    out = tempfile.mkdtemp(prefix="run-", dir=folder)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    spec = [kind, str(int(checkpoints)), str(threads), opts.model, str(opts.steps), str(opts.save_steps), out]
    done = subprocess.run([sys.executable, __file__, "--worker", *spec], capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{kind} ({'with' if checkpoints else 'without'} checkpoints) failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    expected = opts.steps // opts.save_steps if checkpoints else 0
    if checkpoints and len(result["checkpoints"]) != expected:
        raise SystemExit(f"{kind} wrote {result['checkpoints']}, expected {expected} checkpoints")
    shutil.rmtree(out, ignore_errors=True)  # each run writes about 1 GB of checkpoints
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="minilm", choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--save-steps", type=int, default=6)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3, help="alternating runs of each kind; the best counts")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--dir", type=Path, default=Path(__file__).parent, help="where the runs write")
    parser.add_argument("--worker", nargs=7, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        kind, checkpoints, threads, model, steps, save_steps, out = opts.worker
        print(json.dumps(worker(kind, checkpoints == "1", int(threads), model, int(steps), int(save_steps), out)))
        return
    missing = missing_references()
    if missing and "transformers" in opts.kinds:
        raise SystemExit(f"the transformers reference needs: {', '.join(missing)}")
    count = opts.steps // opts.save_steps
    print(f"{opts.model}: {opts.steps} steps, a checkpoint every {opts.save_steps} ({count} checkpoints), best of "
          f"{opts.rounds} alternating runs, each in its own process, writing under {opts.dir}")  # fmt: skip
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="checkpoint_run-", dir=opts.dir) as folder:
        for threads in opts.threads:
            walls: dict[tuple[str, bool], list[float]] = {}
            for _ in range(opts.rounds):
                for kind in opts.kinds:
                    for checkpoints in (False, True):
                        found = run_once(kind, checkpoints, threads, opts, Path(folder))
                        walls.setdefault((kind, checkpoints), []).append(found["wall"])
            results[str(threads)] = _report(threads, walls, opts.kinds, count)
            results[str(threads) + " by round"] = _report_rounds(walls, opts.kinds, count)
    print(json.dumps(results))


def _report(threads: int, walls: dict, kinds: list[str], count: int) -> dict:
    print(f"\n{threads} training thread{'s' if threads > 1 else ''}:")
    print(f"{'kind':<20} {'no ckpt s':>9} {'ckpt s':>8} {'per ckpt s':>10} {'x sync':>7}   all runs (no ckpt | ckpt)")
    plain = {kind: min(w for k in _baseline(kind, kinds) for w in walls[k, False]) for kind in kinds}
    best = {kind: (plain[kind], min(walls[kind, True])) for kind in kinds}
    per = {kind: (saving - plain) / count for kind, (plain, saving) in best.items()}
    sync = per.get("hflight sync")
    for kind in kinds:
        ratio = f"{per[kind] / sync:7.2f}" if sync and sync > 0 else f"{'-':>7}"
        runs = " | ".join(" ".join(f"{w:.2f}" for w in walls[kind, saving]) for saving in (False, True))
        print(f"{kind:<20} {best[kind][0]:9.2f} {best[kind][1]:8.2f} {per[kind]:10.3f} {ratio}   {runs}")
    return {kind: {"per_checkpoint": per[kind], "walls": [walls[kind, False], walls[kind, True]]} for kind in kinds}


def _baseline(kind: str, kinds: list[str]) -> list[str]:
    """The kinds whose runs without checkpoints are ``kind``'s baseline: hflight's kinds without checkpoints are the
    same run (save_async does nothing without a checkpoint), so all of them count towards each one's, which halves the
    noise of the subtraction."""
    return [each for each in kinds if each.startswith("hflight")] if kind.startswith("hflight") else [kind]


def _report_rounds(walls: dict, kinds: list[str], count: int) -> dict:
    """Per checkpoint, each round: (the run with checkpoints - the same round's run without, hflight's two kinds'
    mean) / checkpoints, from runs next to each other in time (a machine shared with other work slows whole runs:
    they differed by 1-2 s here); the median over the rounds, and their spread."""
    print("by round (each run with checkpoints against its round's runs without), per checkpoint:")
    print(f"{'kind':<20} {'median s':>9} {'min..max s':>16} {'x sync':>7}")
    per = {}
    for kind in kinds:
        plain = [statistics.mean(runs) for runs in zip(*(walls[k, False] for k in _baseline(kind, kinds)))]
        per[kind] = [(saving - base) / count for saving, base in zip(walls[kind, True], plain)]
    sync = statistics.median(per["hflight sync"]) if "hflight sync" in per else None
    for kind in kinds:
        middle = statistics.median(per[kind])
        ratio = f"{middle / sync:7.2f}" if sync and sync > 0 else f"{'-':>7}"
        spread = f"{min(per[kind]):.3f}..{max(per[kind]):.3f}"
        print(f"{kind:<20} {middle:9.3f} {spread:>16} {ratio}")
    return {kind: {"per_checkpoint": statistics.median(per[kind]), "rounds": per[kind]} for kind in kinds}


if __name__ == "__main__":
    main()
