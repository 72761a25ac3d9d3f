"""What a SLURM requeue costs: the time from the requeue signal to the process's exit, and from a restart to its first
new optimizer step, against a fresh start.

The main job (``python train.py +experiment=mrc``, or the tests' tiny sizes with ``--tiny``) runs as one SLURM task:
srun's variables, ``resume=auto``, the stand-in ``scontrol`` of ``tests/slurm_standin`` on PATH (it records the
requeue; nothing else of SLURM is simulated). Two runs of the same command:

1. **fresh start, requeued**: in the middle of optimizer step ``--signal-at`` the process sends itself SIGUSR1 (what
   ``#SBATCH --signal=USR1@90`` delivers); it finishes the step, writes ``checkpoint-N``, runs ``scontrol requeue``
   and exits (status 138). Measured: signal -> exit (the wall clock of this script), split into signal -> checkpoint
   complete (``on_save``) and the rest (requeue, the exception's way out, error.txt, the interpreter's exit); the
   target is at most one optimizer step (the median interval between step ends before the signal) plus one
   checkpoint write (``on_save`` minus the stop step's ``on_step_end``). Also: start -> first optimizer step.
2. **the requeued job** (``SLURM_RESTART_COUNT=1``, the same folder): start -> first new optimizer step (it reuses
   the generated data and the trained tokenizer, verifies and loads the checkpoint), against run 1's. The job ends
   there (nothing after that step is measured; the tests show a requeued job finishing its run).

"Start" is when this script starts the process (interpreter start and imports included). One process, one thread
per ``--threads``. Prints the figures and the CPU (``lscpu``).

    python benchmarks/cluster_restart.py                      # the main job, signal during step 60
    python benchmarks/cluster_restart.py --tiny --signal-at 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STANDIN = ROOT / "tests" / "slurm_standin"
TINY = [
    "data.synthetic.num_train_articles=3", "data.synthetic.num_validation_articles=1",
    "data.synthetic.paragraphs_per_article=2", "model.tokenizer_trainer.vocab_size=300", "model.config.hidden_size=32",
    "model.config.intermediate_size=64", "model.config.max_position_embeddings=128", "args.num_train_epochs=2",
    "args.per_device_train_batch_size=2", "args.logging_steps=2",
]  # fmt: skip

try:  # the callback below runs inside the training process, which imports this module by its _target_
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover
    TrainerCallback = object


class Timing(TrainerCallback):
    """Records the wall-clock time of every step end and save into ``path`` (JSON), and sends this process SIGUSR1
    in the middle of step ``signal_at`` (after its forward and backward, before the optimizer step).
    ``first_step_only``: the process exits (status 0) once its first optimizer step is recorded."""

    def __init__(self, path: str, signal_at: int = 0, first_step_only: bool = False) -> None:
        self.path, self.signal_at, self.first_step_only = path, signal_at, first_step_only
        self.record: dict = {"step_end": {}, "save": {}, "signal": None}

    def _write(self) -> None:
        Path(self.path).write_text(json.dumps(self.record))

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.signal_at and state.global_step + 1 == self.signal_at and self.record["signal"] is None:
            self.record["signal"] = time.time()
            self._write()
            os.kill(os.getpid(), signal.SIGUSR1)

    def on_step_end(self, args, state, control, **kwargs):
        self.record["step_end"][state.global_step] = time.time()
        if state.global_step <= 3 or state.global_step >= self.signal_at - 1:
            self._write()
        if self.first_step_only:
            os._exit(0)  # what the benchmark measures of this run is recorded

    def on_save(self, args, state, control, **kwargs):
        self.record["save"][state.global_step] = time.time()
        self._write()


def run(out: Path, timing: Path, sizes: list[str], threads: int, signal_at: int, restarts: int) -> tuple[float, int]:
    """One run of the main job as SLURM task 0 of job 4242; returns (start time, exit status)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(
               SLURM_JOB_ID="4242", SLURM_JOB_NAME="benchmark", SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1",
               SLURM_NNODES="1", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_NODELIST="localhost",
               SCONTROL_LOG=str(out / "scontrol.log"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(threads),
               PATH=os.pathsep.join([str(STANDIN), env["PATH"]]),
               PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parent), env.get("PYTHONPATH")])),
    )  # fmt: skip
    if restarts:
        env["SLURM_RESTART_COUNT"] = str(restarts)
    command = [sys.executable, str(ROOT / "train.py"), "+experiment=mrc", f"hydra.run.dir={out / 'run'}",
               "resume=auto", f"cpu_threads={threads}", "args.disable_tqdm=true", "args.dataloader_pin_memory=false",
               *sizes, "+callbacks.timing._target_=cluster_restart.Timing", f"+callbacks.timing.path={timing}",
               f"+callbacks.timing.signal_at={signal_at}",
               f"+callbacks.timing.first_step_only={bool(restarts)}"]  # fmt: skip
    started = time.time()
    done = subprocess.run(command, cwd=out, env=env, capture_output=True, text=True)
    if done.returncode not in (0, 138):
        sys.exit(f"run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return started, done.returncode, time.time()


def interpreter_exit() -> float:
    """Seconds a Python process that imported what a run imports takes from its last exit callback to its end (the
    interpreter's own teardown of torch, Lightning, transformers, datasets: part of every run's exit)."""
    code = ("import atexit, time, torch, lightning, transformers, datasets, hflight.cli\n"
            "atexit.register(lambda: print(time.time(), flush=True))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return time.time() - float(done.stdout.split()[-1])


def cpu() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny sizes instead of the main job's")
    parser.add_argument("--signal-at", type=int, default=60, help="the optimizer step the requeue signal lands in")
    parser.add_argument("--threads", type=int, default=1)
    options = parser.parse_args()
    sizes = TINY if options.tiny else []
    with tempfile.TemporaryDirectory(prefix="hflight-requeue-") as folder:
        out = Path(folder)
        started, code, ended = run(out, out / "first.json", sizes, options.threads, options.signal_at, 0)
        if code != 138:
            sys.exit(f"the requeue signal did not stop the run (exit {code}): --signal-at beyond the last step?")
        first = json.loads((out / "first.json").read_text())
        restarted, code, _ = run(out, out / "again.json", sizes, options.threads, 0, 1)
        again = json.loads((out / "again.json").read_text())
        requeues = len((out / "scontrol.log").read_text().splitlines())
    steps = {int(k): v for k, v in first["step_end"].items()}
    stop = max(steps)
    saved = first["save"][str(stop)]
    intervals = [steps[s] - steps[s - 1] for s in sorted(steps) if s - 1 in steps and s < stop]
    step_time = statistics.median(intervals) if intervals else float("nan")
    write = saved - steps[stop]
    to_exit = ended - first["signal"]
    fresh_first = steps[min(steps)] - started
    again_steps = {int(k): v for k, v in again["step_end"].items()}
    restart_first = again_steps[min(again_steps)] - restarted
    print(f"hflight: a SLURM requeue of the main job ({'tiny sizes' if options.tiny else '+experiment=mrc'}), one "
          f"task, {options.threads} thread(s), {cpu()}")  # fmt: skip
    print(f"  requeue signal during step {options.signal_at}; stopped after step {stop}; scontrol called {requeues}x")
    print(f"  signal -> exit                      {to_exit:7.3f} s")
    print(f"    signal -> checkpoint complete     {saved - first['signal']:7.3f} s")
    print(f"    checkpoint -> exit (requeue, exit) {ended - saved:6.3f} s")
    print(f"  one optimizer step (median)         {step_time:7.3f} s")
    print(f"  one checkpoint write                {write:7.3f} s")
    target = step_time + write
    print(
        f"  target: step + write                {target:7.3f} s  (signal -> checkpoint complete: "
        f"{(saved - first['signal']) / target:.2f}x of it)"
    )
    print(
        "  of the rest, Python's own exit with torch, Lightning, transformers and datasets imported (measured "
        f"alone): {interpreter_exit():.3f} s"
    )
    print(
        f"  start -> first optimizer step: fresh start {fresh_first:.2f} s, restart {restart_first:.2f} s "
        f"(the restart takes {restart_first / fresh_first:.2f}x the fresh start's time)"
    )


if __name__ == "__main__":
    main()
