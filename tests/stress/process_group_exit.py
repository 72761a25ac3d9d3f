"""Stress test of the process group's end at exit: many two-process torchrun jobs, a few at a time, counting the runs
whose process aborted ("terminate called without an active exception", SIGABRT) or failed otherwise.

    python tests/stress/process_group_exit.py --runs 50 --at-once 2 hflight-ddp hflight-fsdp2 transformers

Not part of the suite (its whole point is many runs); run it beside the suite to load the machine as CI does. The
modes are tests/stress/exit_job.py's. Prints, per mode: runs, failures, aborts, and the gloo worker threads the ranks
still had when the interpreter's teardown began.
"""

from __future__ import annotations

import argparse
import collections
import os
import socket
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

JOB = Path(__file__).resolve().parent / "exit_job.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def one_run(mode: str, out: Path) -> tuple[int, bool, list[str]]:
    command = [str(TORCHRUN), "--nnodes=1", "--nproc_per_node=2", "--rdzv-backend=c10d",
               f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--max-restarts=0", str(JOB), str(out), mode]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(JOB.parents[2] / "src")}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    aborted = "terminate called" in done.stderr or "Signal 6" in done.stderr or "SIGABRT" in done.stderr
    (out / "console.txt").write_text(done.stdout + done.stderr)
    return done.returncode, aborted, sorted(p.read_text() for p in out.glob("threads_*.txt"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modes", nargs="+", choices=["hflight-ddp", "hflight-fsdp2", "transformers",
                                                      "transformers-as-is"])  # fmt: skip
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--at-once", type=int, default=2)
    opts = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="exit_stress_"))
    for mode in opts.modes:
        with ThreadPoolExecutor(opts.at_once) as pool:
            results = list(pool.map(lambda i, m=mode: one_run(m, root / m / str(i)), range(opts.runs)))
        failed = sum(rc != 0 for rc, _, _ in results)
        aborted = sum(abort for _, abort, _ in results)
        threads = collections.Counter(",".join(t) for _, _, t in results)
        print(f"{mode}: {opts.runs} runs, {failed} failed, {aborted} aborted; gloo worker threads per rank at "
              f"teardown: {dict(threads)}  (logs: {root / mode})", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
