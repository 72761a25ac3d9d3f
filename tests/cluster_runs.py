"""Shared by the cluster tests (``test_elastic.py``, ``test_slurm.py``): the commands' tiny sizes, starting and
ending a job through ``tests/launch.py`` (its whole process session is killed on a timeout: nothing may hang), what a
run leaves that an interruption must not change, and one uninterrupted torchrun job (1 node x 2 processes) every
cluster run is compared with, started once per session."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from . import launch, readme
from .support import TINY, clone_environment, fresh_clone

COMMANDS = [step.text for text in readme.documents().values() for step in readme.steps(text, "")]
#: docs/hydra.md's torchrun commands that restart workers.
ELASTIC = next(c for c in COMMANDS if c.startswith("torchrun --standalone") and "--max-restarts" in c)
TWO_NODES = next(c for c in COMMANDS if c.startswith("torchrun --nnodes=2 --nproc_per_node=1"))
#: Appended to every command: the tests' tiny main job, 2 examples per process and step (7 steps an epoch with
#: 2 processes, 14 in all), a loss logged every 3 steps (so some loss is pending at most checkpoints).
SIZES = [o for o in TINY if o != "+experiment=mrc"] + ["args.logging_steps=3", "args.per_device_train_batch_size=2"]


def start(argv: list[str], cwd: Path, name: str, timeout: float = 420, **env: str) -> launch.Job:
    """``argv`` in ``cwd`` (a copy of the repository, or a submit folder), with its sources and ``tests/jobs``
    importable, one thread per process, no launcher variables of this process's own; ``env`` added. Its output is kept
    in ``cwd/<name>.console.txt``; on a timeout its whole session (launcher and workers) is killed and the test
    fails."""
    base = {k: v for k, v in clone_environment(cwd).items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    base["PYTHONPATH"] = os.pathsep.join([base["PYTHONPATH"], str(launch.JOBS)])
    env = launch.environment(src=cwd / "src", base=base, **env)
    return launch.Job(argv, cwd, env, console=cwd / f"{name}.console.txt", timeout=timeout, name=name)


def finish(job: launch.Job) -> tuple[int, str]:
    """Exit status and output, once the job ended (its whole session killed then)."""
    ended = job.wait()
    return ended.returncode, ended.output


def outcome(run_dir: Path) -> dict:
    """What a run leaves that must not depend on an interruption: the weights (bytes), the log history and the
    metrics, timings left out."""
    timing = ("runtime", "per_second")
    state = json.loads((run_dir / "trainer_state.json").read_text())
    results = json.loads((run_dir / "all_results.json").read_text())
    return {
        "weights": (run_dir / "model.safetensors").read_bytes(),
        "log_history": [{k: v for k, v in e.items() if not k.endswith(timing)} for e in state["log_history"]],
        "results": {k: v for k, v in results.items() if not k.endswith(timing)},
    }


def torchrun_argv(command: str, run_dir: str, *extra: str, port: int | None = None) -> list[str]:
    """A documented torchrun command as written, its run folder ``run_dir``, ``$HEAD_NODE:29400`` on 127.0.0.1 at
    ``port``, :data:`SIZES` and ``extra`` appended."""
    tokens = command.replace("$HEAD_NODE:29400", f"127.0.0.1:{port}").split()
    tokens = [f"hydra.run.dir={run_dir}" if t.startswith("hydra.run.dir=") else t for t in tokens]
    return [str(launch.TORCHRUN), *tokens[1:], *SIZES, *extra]


class Reference:
    """The uninterrupted job: docs/hydra.md's elastic torchrun command without a fault, in a fresh copy of the
    repository, started at the first request and finished at the first :meth:`outcome`."""

    _started: Reference | None = None

    def __init__(self) -> None:
        self.cwd = fresh_clone(Path(tempfile.mkdtemp(prefix="hflight-reference-")) / "hflight")
        self.job = start(torchrun_argv(ELASTIC, "outputs/reference"), self.cwd, "reference")
        self.ended: tuple[int, str] | None = None

    @classmethod
    def get(cls) -> Reference:
        if cls._started is None:
            cls._started = cls()
        return cls._started

    def outcome(self) -> dict:
        if self.ended is None:
            self.ended = finish(self.job)
        code, output = self.ended
        assert code == 0, f"the reference job failed:\n{output[-4000:]}"
        return outcome(self.cwd / "outputs" / "reference")


# ---- SLURM's variables for one task ------------------------------------------------------------------------------
#: the stand-ins ``srun`` and ``scontrol`` (test code: they record what SLURM would be asked and do nothing else)
STANDIN = Path(__file__).parent / "slurm_standin"


def slurm_task(monkeypatch, tmp_path: Path, job: str = "4242", **more: str) -> Path:
    """srun's variables for one task of job ``job`` and the stand-in scontrol on PATH; returns scontrol's log."""
    log = tmp_path / "scontrol.log"
    values = dict(SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1", SLURM_NNODES="1", SLURM_JOB_NAME="train",
                  SLURM_JOB_ID=job, SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_NODELIST="localhost",
                  SCONTROL_LOG=str(log), PATH=f"{STANDIN}{os.pathsep}{os.environ['PATH']}")  # fmt: skip
    values.update(more)
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    return log


def requeues(log: Path) -> list[list[str]]:
    return [json.loads(line)["argv"] for line in log.read_text().splitlines()] if log.exists() else []
