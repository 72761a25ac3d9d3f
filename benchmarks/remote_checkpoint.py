"""Checkpoints on object storage (issue 68): what storing them costs, against the same S3 server on this machine
(``moto_server``, started here as a process; tests/s3_server.py), through s3fs.

- **upload**: hflight's upload of a finished checkpoint folder (``ObjectStorage.publish``: the files in one batch,
  confirmed, the manifest last) against s3fs's own ``put`` of the same folder (recursive), in MB/s; target >= 0.9x.
- **download**: hflight's fetch of that checkpoint into an empty folder (``ObjectStorage.fetch``: the manifest, the
  files in one batch, the rename into place) against s3fs's ``get`` (recursive); target >= 0.9x.
- **stall**: a training run with ``save_async`` (MiniLM-L6's shape, a checkpoint every ``--save-steps``), its
  ``output_dir`` local or on the server: the time each checkpoint's save call blocks the training loop (the state's
  copy, and the wait for the previous write, upload included), median per checkpoint, and the run's wall time;
  target: remote <= 1.1x local. Each run in a fresh process, kinds alternating.

Figures: median of ``--rounds`` (min-max beside it); the ratio is hflight's over the reference's, in one run. The
server keeps objects in its memory and shares this machine's cores with the client: a real store adds network latency
and bandwidth limits, and takes the server's CPU off this machine.

    python benchmarks/remote_checkpoint.py                     # MiniLM-L6 (about 270 MB a checkpoint), 3 rounds
    python benchmarks/remote_checkpoint.py --model tiny --rounds 1 --steps 4 --save-steps 2   # a quick check
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

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO)]
from checkpoint_cost import MODELS, qa_model_and_data, time_saves  # noqa: E402

from tests import s3_server  # noqa: E402

BUCKET = "bench"


def _train(model_name: str, out: str, steps: int, save_steps: int, threads: int, options: dict | None) -> dict:
    """One training run (in this process): the seconds each checkpoint's save call blocked, and the wall time."""
    import torch

    import hflight

    torch.set_num_threads(threads)
    model, data = qa_model_and_data(model_name, 64)
    args = hflight.TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=steps,
                                     save_steps=save_steps, save_total_limit=2, logging_steps=1000, report_to="none",
                                     disable_tqdm=True, use_cpu=True, save_async=True,
                                     **({"storage_options": options} if options else {}))  # fmt: skip
    trainer = hflight.Trainer(model, args, train_dataset=data)
    blocked = time_saves(trainer)
    start = time.perf_counter()
    trainer.train()
    return {"blocked": blocked, "wall": time.perf_counter() - start, "staging": trainer.args.output_dir}


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):8.2f} ({min(values):.2f}-{max(values):.2f})"


def transfers(endpoint: str, opts: argparse.Namespace, work: Path) -> dict:
    from hflight.checkpoints.storage import ObjectStorage

    made = _train(opts.model, str(work / "made"), 1, 1, opts.threads, None)
    folder = Path(made["staging"]) / "checkpoint-1"
    size = _folder_bytes(folder)
    fs = s3_server.filesystem(endpoint)
    rows: dict[str, list[float]] = {"s3fs put": [], "hflight upload": [], "s3fs get": [], "hflight download": []}
    options = s3_server.options(endpoint)
    for round_ in range(opts.rounds):
        order = ("s3fs", "hflight") if round_ % 2 == 0 else ("hflight", "s3fs")
        for who in order:
            fs.rm(f"{BUCKET}/{who}", recursive=True) if fs.exists(f"{BUCKET}/{who}") else None
            start = time.perf_counter()
            if who == "s3fs":
                fs.put(str(folder), f"{BUCKET}/s3fs/checkpoint-1", recursive=True)
            else:
                storage = ObjectStorage(f"s3://{BUCKET}/hflight", str(folder.parent), options)
                storage.probe()  # a run's storage is made (and its client started) when training starts
                start = time.perf_counter()
                storage.publish(str(folder))
            rows[f"{who} {'put' if who == 's3fs' else 'upload'}"].append(size / (time.perf_counter() - start) / 1e6)
        for who in order:
            target = work / f"get-{who}-{round_}"
            start = time.perf_counter()
            if who == "s3fs":
                fs.get(f"{BUCKET}/s3fs/checkpoint-1", str(target / "checkpoint-1"), recursive=True)
            else:
                storage = ObjectStorage(f"s3://{BUCKET}/hflight", str(target), options)
                storage.probe()
                start = time.perf_counter()
                storage.fetch(str(target / "checkpoint-1"))
            rows[f"{who} {'get' if who == 's3fs' else 'download'}"].append(size / (time.perf_counter() - start) / 1e6)
            shutil.rmtree(target)
    print(f"\ntransfers of one checkpoint ({size / 1e6:.0f} MB, {sum(1 for p in folder.rglob('*') if p.is_file())} "
          f"files), MB/s, median (min-max) of {opts.rounds}")  # fmt: skip
    for name, values in rows.items():
        print(f"  {name:18s} {_spread(values)}")
    up = statistics.median(rows["hflight upload"]) / statistics.median(rows["s3fs put"])
    down = statistics.median(rows["hflight download"]) / statistics.median(rows["s3fs get"])
    print(f"  upload   hflight/s3fs {up:.2f}x (target >= 0.9x)")
    print(f"  download hflight/s3fs {down:.2f}x (target >= 0.9x)")
    return {"upload_ratio": up, "download_ratio": down, **rows}


def stalls(endpoint: str, opts: argparse.Namespace, work: Path) -> dict:
    found: dict[str, dict[str, list[float]]] = {"local": {"blocked": [], "wall": []},
                                                  "remote": {"blocked": [], "wall": []}}  # fmt: skip
    for round_ in range(opts.rounds):
        for kind in ("local", "remote") if round_ % 2 == 0 else ("remote", "local"):
            out = str(work / f"run-{kind}-{round_}") if kind == "local" else f"s3://{BUCKET}/run-{round_}"
            env = {**os.environ, **s3_server.CREDENTIALS, "AWS_ENDPOINT_URL": endpoint,
                   "HFLIGHT_STAGING_DIR": str(work / f"staging-{round_}")}  # fmt: skip
            command = [sys.executable, __file__, "--worker", out, "--model", opts.model, "--steps", str(opts.steps),
                       "--save-steps", str(opts.save_steps), "--threads", str(opts.threads)]  # fmt: skip
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"the {kind} run failed:\n{done.stderr[-3000:]}")
            record = json.loads(done.stdout.strip().splitlines()[-1])
            found[kind]["blocked"].append(statistics.median(record["blocked"]))
            found[kind]["wall"].append(record["wall"])
    count = opts.steps // opts.save_steps
    print(f"\nsave_async, {opts.model}, {opts.steps} steps, a checkpoint every {opts.save_steps} ({count}), "
          f"{opts.threads} training thread(s): median (min-max) of {opts.rounds} runs")  # fmt: skip
    for kind, rows in found.items():
        print(f"  {kind:7s} blocked per checkpoint {_spread(rows['blocked'])} s   run {_spread(rows['wall'])} s")
    ratio = statistics.median(found["remote"]["blocked"]) / statistics.median(found["local"]["blocked"])
    wall = statistics.median(found["remote"]["wall"]) / statistics.median(found["local"]["wall"])
    print(f"  stall remote/local {ratio:.2f}x (target <= 1.1x); whole run remote/local {wall:.2f}x")
    return {"stall_ratio": ratio, "wall_ratio": wall, **found}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="minilm", choices=sorted(MODELS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--save-steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker is not None:
        print(json.dumps(_train(opts.model, opts.worker, opts.steps, opts.save_steps, opts.threads, None)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        os.environ.update(s3_server.CREDENTIALS)
        with s3_server.moto_server(work / "moto.log") as endpoint:
            s3_server.filesystem(endpoint).mkdir(BUCKET)
            print(f"S3 server: moto_server at {endpoint}; CPU: {_cpu()}")
            transfers(endpoint, opts, work)
            stalls(endpoint, opts, work)


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{os.cpu_count()} cores"


if __name__ == "__main__":
    main()
