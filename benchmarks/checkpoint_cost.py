"""What a checkpoint costs the training loop: synchronous without fsync, synchronous durable, asynchronous durable.

For each model, hflight's Trainer trains a few steps of extractive QA (random token ids: the checkpoint's cost does
not depend on the data) with ``save_steps`` so that it writes ``--checkpoints`` checkpoints (AdamW: the weights,
two moments, the scheduler, the RNG states, the config, the trainer state, the manifest), in three modes:

- ``sync``: as before issue 36: the checkpoint written before training goes on, no fsync (``hflight.durable``'s
  fsyncs turned off in this process: the same code otherwise; ``--check-baseline REF`` times the code of git ``REF``
  once, so that the emulation can be compared with the code it stands for);
- ``sync+fsync``: the default now: every file, folder and rename durable before training goes on;
- ``async+fsync``: ``save_async=True``: the state copied into host memory at the step boundary, the rest written and
  published durably by a background thread.

Figures per mode (median over the checkpoints after the first, whose snapshot buffers are allocated; the first
is printed too): ``blocked``, the time ``_save_checkpoint`` holds the loop, and ``waited``, the part of it spent
waiting for the previous checkpoint's background write (checkpoints closer together than the disk can write them;
``--save-steps`` spaces them); ``write``, the background write's own time (files, manifest, fsyncs, publication);
``snapshot``, the host memory the copy holds. The ratios are against
``sync`` in the same run. Targets (issue 36): sync+fsync <= 1.2x, async+fsync <= 0.2x of sync's blocked time.

    python benchmarks/checkpoint_cost.py                                  # MiniLM-L6 QA (MRC) and BERT-base QA
    python benchmarks/checkpoint_cost.py --models minilm --checkpoints 3  # a quicker look
    python benchmarks/checkpoint_cost.py --vs-transformers gpt2           # the synchronous stall against HF's

``--vs-transformers MODEL`` (``gpt2``: GPT-2 124M, ~1.5 GB of checkpoint with AdamW's state; ``gpt2-medium-ish``
shapes below) compares hflight's synchronous durable checkpoint with ``transformers.Trainer._save_checkpoint`` on the
same causal-LM training (``--repeats`` runs of each, alternating; each run writes ``--checkpoints`` checkpoints with
``save_total_limit=2``, so the later ones rotate): the stall of each checkpoint that rotates, best over all runs, and
the ratio (issue 56: at most 1.1x). ``--check-baseline SRC`` adds hflight's code from ``SRC`` (a ``git archive`` of an
earlier commit's ``src``) as a third row. The machine's CPU (``lscpu``) is printed with the figures.

Each mode runs in its own process, one after the other, writing into a folder on the disk of ``--dir`` (default: a
temporary folder beside this script). The figures depend on the disk and its cache: name both with them.
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
from typing import Any

MODELS = {
    # the MRC recipe with a pretrained MiniLM (all-MiniLM-L6-v2's shape): ~22.7M parameters, ~270 MB of state
    "minilm": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536),
    # BERT-base's shape: ~109M parameters
    "bert-base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    # for the test that runs the script end to end
    "tiny": dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64),
}
GPT2_MODELS = {
    "gpt2": dict(n_embd=768, n_layer=12, n_head=12),  # GPT-2 124M
    "gpt2-40m": dict(n_embd=512, n_layer=6, n_head=8),  # ~45M parameters
    "gpt2-tiny": dict(n_embd=32, n_layer=1, n_head=2, vocab_size=1000),  # for the test that runs the script
}
MODES = ("sync", "sync+fsync", "async+fsync")
MIB = 1 << 20


def qa_model_and_data(model_name: str, rows: int) -> tuple[Any, list[dict[str, Any]]]:
    """A BERT QA model of ``model_name``'s shape (random weights, seed 0) and ``rows`` random examples of 64 tokens:
    a checkpoint's cost does not depend on their values."""
    import torch
    from transformers import BertConfig, BertForQuestionAnswering

    torch.manual_seed(0)
    model = BertForQuestionAnswering(BertConfig(vocab_size=30522, max_position_embeddings=512, **MODELS[model_name]))
    generator = torch.Generator().manual_seed(0)
    data = [
        {
            "input_ids": torch.randint(1000, 30000, (64,), generator=generator),
            "attention_mask": torch.ones(64, dtype=torch.long),
            "start_positions": torch.tensor(3),
            "end_positions": torch.tensor(5),
        }
        for _ in range(rows)
    ]
    return model, data


def time_saves(trainer: Any) -> list[float]:
    """The seconds each of ``trainer``'s ``_save_checkpoint`` calls takes (what the training loop waits for), filled
    in as the run saves."""
    blocked: list[float] = []
    real_save = trainer._save_checkpoint

    def timed(*a, **kw):
        start = time.perf_counter()
        real_save(*a, **kw)
        blocked.append(time.perf_counter() - start)

    trainer._save_checkpoint = timed
    return blocked


def worker(model_name: str, mode: str, out: str, checkpoints: int) -> dict:
    import hflight

    if mode == "sync":
        try:
            from hflight import durable
        except ImportError:  # the code before issue 36: nothing to turn off
            durable = None
        if durable is not None:
            durable.fsync_file = durable.fsync_dir = lambda path: None
    model, data = qa_model_and_data(model_name, 64)
    save_steps = int(os.environ.get("CHECKPOINT_COST_SAVE_STEPS", "8"))
    extra = {"save_async": True} if mode.startswith("async") else {}
    args = hflight.TrainingArguments(
        output_dir=out, per_device_train_batch_size=2, max_steps=save_steps * checkpoints, save_steps=save_steps,
        save_total_limit=2, logging_steps=1000, report_to="none", disable_tqdm=True, use_cpu=True, **extra,
    )  # fmt: skip
    trainer = hflight.Trainer(model, args, train_dataset=data)
    blocked: list[float] = []
    real_save = trainer._save_checkpoint

    def timed(*a, **kw):
        waited.append(0.0)
        start = time.perf_counter()
        real_save(*a, **kw)
        blocked.append(time.perf_counter() - start)

    trainer._save_checkpoint = timed
    writes: list[float] = []
    waited: list[float] = []
    writer_state = {}
    try:
        from hflight.checkpoints import asynchronous

        real_run, real_wait = asynchronous.CheckpointWriter._run, asynchronous.CheckpointWriter.wait

        def wait(self, *args, **kwargs):
            start = time.perf_counter()
            real_wait(self, *args, **kwargs)
            waited[-1] += time.perf_counter() - start

        asynchronous.CheckpointWriter.wait = wait

        def run(self, *args):
            start = time.perf_counter()
            real_run(self, *args)
            writes.append(time.perf_counter() - start)
            writer_state["snapshot"] = self.snapshot_bytes

        asynchronous.CheckpointWriter._run = run
    except ImportError:
        pass
    trainer.train()
    params = sum(p.numel() for p in model.parameters())
    size = sum(f.stat().st_size for f in Path(out, f"checkpoint-{save_steps * checkpoints}").iterdir())
    return {
        "blocked": blocked, "waited": waited, "write": writes, "snapshot": writer_state.get("snapshot", 0),
        "params": params, "checkpoint_bytes": size, "hflight": str(Path(hflight.__file__).parent),
    }  # fmt: skip


def compare_worker(kind: str, model_name: str, out: str, checkpoints: int) -> dict:
    """``kind`` ("transformers" or "hflight") trains ``model_name`` (a GPT-2 shape) on the CPU and times each
    ``_save_checkpoint``."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    if kind == "transformers":
        from transformers import Trainer, TrainingArguments
    else:
        from hflight import Trainer, TrainingArguments
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_positions=64, **GPT2_MODELS[model_name]))
    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, model.config.vocab_size, (16,), generator=generator) for _ in range(32)]
    data = [{"input_ids": each, "labels": each} for each in ids]
    save_steps = int(os.environ.get("CHECKPOINT_COST_SAVE_STEPS", "2"))
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=1, max_steps=save_steps * checkpoints, save_steps=save_steps,
        save_total_limit=2, logging_steps=1000, report_to="none", disable_tqdm=True,
        use_cpu=os.environ.get("CHECKPOINT_COST_DEVICE", "cpu") == "cpu",
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=data)
    blocked = time_saves(trainer)
    trainer.train()
    last = Path(out, f"checkpoint-{save_steps * checkpoints}")
    import hflight

    return {
        "blocked": blocked, "params": sum(p.numel() for p in model.parameters()),
        "checkpoint_bytes": sum(f.stat().st_size for f in last.rglob("*") if f.is_file()),
        "hflight": str(Path(hflight.__file__).parent),
    }  # fmt: skip


def compare(opts: argparse.Namespace) -> None:
    """hflight's synchronous checkpoint stall against transformers' (see the module)."""
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "?")
    print(f"CPU: {name}, {os.cpu_count()} cores; training on {opts.device}")
    kinds = [("transformers", None), ("hflight", None)]
    if opts.check_baseline:
        kinds.append(("hflight", opts.check_baseline))
    found: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="checkpoint_cost-", dir=opts.dir) as folder:
        for _ in range(opts.repeats):
            for kind, src in kinds:
                label = kind if src is None else f"hflight ({src})"
                out = tempfile.mkdtemp(prefix=f"{kind}-", dir=folder)
                env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
                env["CHECKPOINT_COST_SAVE_STEPS"] = str(opts.save_steps)
                if src:
                    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
                env["CHECKPOINT_COST_DEVICE"] = opts.device
                command = [sys.executable, __file__, "--compare-worker", kind, opts.vs_transformers, out,
                           str(opts.checkpoints)]  # fmt: skip
                result = subprocess.run(command, capture_output=True, text=True, env=env)
                if result.returncode != 0:
                    raise SystemExit(f"{label} failed:\n{result.stderr[-3000:]}")
                run = json.loads(result.stdout.strip().splitlines()[-1])
                found.setdefault(label, []).extend(run["blocked"][2:])  # the checkpoints that rotate
                shutil.rmtree(out, ignore_errors=True)
        print(f"{opts.vs_transformers}: {run['params'] / 1e6:.1f}M parameters, checkpoint "
              f"{run['checkpoint_bytes'] / MIB:.0f} MiB; stall of each rotating checkpoint, s")  # fmt: skip
        base = min(found["transformers"])
        for label, values in found.items():
            listed = " ".join(f"{v:.3f}" for v in values)
            print(f"{label:<40} best {min(values):7.3f}  x transformers {min(values) / base:5.2f}   ({listed})")


def _steady(values: list[float]) -> float:
    return statistics.median(values[1:]) if len(values) > 1 else values[0]


def run_mode(
    model: str, mode: str, folder: Path, checkpoints: int, save_steps: int, pythonpath: str | None = None
) -> dict:
    out = tempfile.mkdtemp(prefix=f"{model}-{mode.replace('+', '-')}-", dir=folder)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    env["CHECKPOINT_COST_SAVE_STEPS"] = str(save_steps)
    command = [sys.executable, __file__, "--worker", model, mode, out, str(checkpoints)]
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"{model} {mode} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["minilm", "bert-base"], choices=list(MODELS))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                        help="the modes to run (default: all); sync, the ratios' reference, always runs")  # fmt: skip
    parser.add_argument("--checkpoints", type=int, default=4)
    parser.add_argument("--save-steps", type=int, default=8, help="optimizer steps between checkpoints")
    parser.add_argument("--dir", type=Path, default=Path(__file__).parent)
    parser.add_argument("--check-baseline", metavar="SRC", help="src/ folder of hflight before issue 36 (a git "
                        "worktree of the commit): its synchronous save is timed beside the emulated one")  # fmt: skip
    parser.add_argument("--vs-transformers", metavar="MODEL", choices=list(GPT2_MODELS),
                        help="compare the synchronous checkpoint's stall with transformers.Trainer's")  # fmt: skip
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model trains "
                        "(--vs-transformers)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3, help="runs of each trainer (--vs-transformers)")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--compare-worker", nargs=4, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.compare_worker:
        kind, model, out, checkpoints = opts.compare_worker
        print(json.dumps(compare_worker(kind, model, out, int(checkpoints))))
        return
    if opts.vs_transformers:
        if "--save-steps" not in sys.argv:
            opts.save_steps = 2
        if "--checkpoints" not in sys.argv:
            opts.checkpoints = 3
        compare(opts)
        return
    if opts.worker:
        model, mode, out, checkpoints = opts.worker
        print(json.dumps(worker(model, mode, out, int(checkpoints))))
        return
    with tempfile.TemporaryDirectory(prefix="checkpoint_cost-", dir=opts.dir) as folder:
        print(f"under {folder}: {opts.checkpoints} checkpoints per run, every {opts.save_steps} steps")
        columns = ("model", "mode", "blocked s", "waited s", "first s", "x sync", "write s", "snapshot MiB")
        print("{:<10} {:<14} {:>9} {:>8} {:>8} {:>7} {:>8} {:>12}".format(*columns))
        for model in opts.models:
            runs = (Path(folder), opts.checkpoints, opts.save_steps)
            results = {mode: run_mode(model, mode, *runs) for mode in MODES if mode == "sync" or mode in opts.modes}
            if opts.check_baseline:
                results["sync (git ref)"] = run_mode(model, "sync", *runs, opts.check_baseline)
            base = _steady(results["sync"]["blocked"])
            params, size = results["sync"]["params"] / 1e6, results["sync"]["checkpoint_bytes"] / MIB
            print(f"{model}: {params:.1f}M parameters, checkpoint {size:.0f} MiB")
            if opts.check_baseline:
                print(f"sync (git ref): the code in {results['sync (git ref)']['hflight']}")
            for mode, found in results.items():
                _print_row(model, mode, found, base)


def _print_row(model: str, mode: str, found: dict, base: float) -> None:
    blocked = _steady(found["blocked"])
    write = f"{_steady(found['write']):8.2f}" if found["write"] and mode.startswith("async") else f"{'-':>8}"
    snapshot = f"{found['snapshot'] / MIB:12.0f}" if found["snapshot"] else f"{'-':>12}"
    ratio, waited = blocked / base, _steady(found["waited"]) if found.get("waited") else 0.0
    first = found["blocked"][0]
    print(f"{model:<10} {mode:<14} {blocked:9.3f} {waited:8.3f} {first:8.3f} {ratio:7.2f} {write} {snapshot}")


if __name__ == "__main__":
    main()
