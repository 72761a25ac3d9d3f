"""How much of the training thread's interpreter a background checkpoint write (``save_async``) leaves it.

A training loop on a GPU goes as fast as its Python launches kernels: a writer thread that holds the interpreter
lock (pickling, copying bytes into the page cache, hashing) slows it, however idle the GPU. Issue 56 asked for
serialization, hashing and fsync away from the training thread's lock: a writer process, or a thread that lets go of
the lock for all of its heavy work. This script measures what hflight's writer thread leaves the loop.

hflight's Trainer trains GPT-2 124M with AdamW (on the CPU, one thread: the write has the other cores) with
``save_async=True``. At the step after each checkpoint, while that checkpoint is written in the background, the
training thread runs a launch-bound loop (tiny torch operations, as a GPU loop launches kernels) until the checkpoint
is published; its rate, against the same loop's before the first checkpoint, is the share of the interpreter the
write leaves the training thread (1.00: all of it, as a writer process would). For comparison, the same loop beside a
plain thread that writes the same checkpoint's two large files with ``torch.save`` and safetensors' ``save_file``
(the libraries' own writers, as a simple writer thread would) and fsyncs them.

    python benchmarks/checkpoint_gil.py                       # GPT-2 124M (1.4 GiB a checkpoint), 3 checkpoints
    python benchmarks/checkpoint_gil.py --model gpt2-tiny     # the suite's smoke test

The CPU (``lscpu``) and the versions of torch and safetensors are printed with the figures (whether a library's
writer lets go of the lock depends on its version).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_cost import GPT2_MODELS  # noqa: E402

#: how long the loop's rate is measured before the first checkpoint, seconds
BASELINE_S = 1.0
#: the longest the loop waits for a checkpoint to be published, seconds
PUBLISH_LIMIT_S = 120.0


def launch_loop(until: threading.Event | Path | float) -> float:
    """Tiny torch operations (a kernel launch's cost in the interpreter) until ``until`` (an event set, a folder
    published, or a number of seconds); returns how many ran per second."""
    import torch

    a, b = torch.ones(4), torch.ones(4)
    count, began = 0, time.perf_counter()
    if isinstance(until, float):
        done = lambda: time.perf_counter() - began >= until  # noqa: E731
    elif isinstance(until, Path):
        done = lambda: until.is_dir() or time.perf_counter() - began > PUBLISH_LIMIT_S  # noqa: E731
    else:
        done = until.is_set
    while not done():
        for _ in range(100):
            torch.add(a, b)
        count += 100
    return count / (time.perf_counter() - began)


def measure(model_name: str, checkpoints: int, folder: str) -> dict:
    import torch
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    import hflight

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_positions=64, **GPT2_MODELS[model_name]))
    generator = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, model.config.vocab_size, (16,), generator=generator) for _ in range(64)]
    save_steps = 2
    found: dict = {"baseline": None, "writes": []}
    out = Path(folder, "run")

    class Probe(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 1:  # before any checkpoint
                found["baseline"] = launch_loop(BASELINE_S)
            elif state.global_step and state.global_step % save_steps == 0:  # the checkpoint's write is in flight
                began = time.perf_counter()
                rate = launch_loop(out / f"checkpoint-{state.global_step}")
                found["writes"].append((rate, time.perf_counter() - began))

    args = hflight.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=1, max_steps=save_steps * checkpoints + 1,
        save_steps=save_steps, save_total_limit=2, logging_steps=1000, report_to="none", disable_tqdm=True,
        use_cpu=True, save_async=True,
    )  # fmt: skip
    data = [{"input_ids": each, "labels": each} for each in ids]
    trainer = hflight.Trainer(model=model, args=args, train_dataset=data, callbacks=[Probe()])
    trainer.train()
    found["plain"] = plain_thread_writes(trainer, folder, checkpoints)
    last = out / f"checkpoint-{save_steps * checkpoints}"
    found["bytes"] = sum(f.stat().st_size for f in last.rglob("*") if f.is_file())
    return found


def plain_thread_writes(trainer, folder: str, rounds: int) -> list[tuple[float, float]]:
    """The loop beside a plain thread writing the model (safetensors' ``save_file``) and the optimizer
    (``torch.save``) from copies in host memory, each fsynced: (rate, seconds) per round."""
    import torch
    from safetensors.torch import save_file

    model_state = {k: v.detach().clone().contiguous() for k, v in trainer.model.state_dict().items()}
    model_state.pop("lm_head.weight", None)  # tied to the embedding, as save_pretrained drops it
    optimizer_state = trainer.optimizer.state_dict()
    results = []
    for index in range(rounds):
        target = Path(folder, f"plain-{index}")
        target.mkdir()
        done = threading.Event()

        def write(target: Path = target, done: threading.Event = done) -> None:
            try:
                for path, writer in ((target / "model.safetensors", lambda p: save_file(model_state, p)),
                                     (target / "optimizer.pt", lambda p: torch.save(optimizer_state, p))):  # fmt: skip
                    writer(path)
                    descriptor = os.open(path, os.O_RDONLY)
                    os.fsync(descriptor)
                    os.close(descriptor)
            finally:
                done.set()

        began = time.perf_counter()
        writer = threading.Thread(target=write)
        writer.start()
        rate = launch_loop(done)
        writer.join()
        results.append((rate, time.perf_counter() - began))
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2", choices=list(GPT2_MODELS))
    parser.add_argument("--checkpoints", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path(__file__).parent, help="where the checkpoints are written")
    opts = parser.parse_args(argv)
    import safetensors
    import torch

    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "?")
    print(f"CPU: {name}, {os.cpu_count()} cores; torch {torch.__version__}, safetensors {safetensors.__version__}")
    with tempfile.TemporaryDirectory(prefix="checkpoint_gil-", dir=opts.dir) as folder:
        found = measure(opts.model, opts.checkpoints, folder)
    baseline = found["baseline"]
    print(f"{opts.model}: checkpoint {found['bytes'] / 2**20:.0f} MiB; the loop alone: {baseline:,.0f} operations/s")
    print(f"{'beside':44s} {'loop rate':>9s} {'write, s':>9s}  (each)")
    for label, writes in (("hflight's background write (save_async)", found["writes"]),
                          ("a plain thread: torch.save, save_file, fsync", found["plain"])):  # fmt: skip
        shares = [rate / baseline for rate, _ in writes]
        each = " ".join(f"{share:.2f}/{seconds:.2f}" for share, (_, seconds) in zip(shares, writes))
        print(f"{label:44s} {statistics.median(shares):9.2f} {statistics.median(s for _, s in writes):9.2f}  ({each})")


if __name__ == "__main__":
    main()
