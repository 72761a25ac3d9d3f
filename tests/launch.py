"""Launching and finishing the tests' multi-process jobs (torchrun, several Python processes, srun and sbatch
stand-ins, ``accelerate launch``, DeepSpeed's launcher), in one place:

- :data:`TORCHRUN` is the one spelling of torchrun's path beside this Python; :func:`torchrun` its command line, on
  ``--standalone`` (torchrun picks a free port itself) or on a :func:`free_port` of 127.0.0.1, never a fixed port: two
  jobs (or two test processes of ``pytest -n 2``) never meet on one;
- :func:`environment` is what every job gets: the repository's sources first on ``PYTHONPATH`` (after a test's own
  folders: a stand-in's ``sitecustomize``), no downloads, one thread per process, unbuffered output;
- :class:`Job` starts a command in a session of its own and finishes it: its output written straight into a console
  file, a time limit, the whole session (launcher and workers) killed when it ends, fails or hangs (ranks waiting on
  each other), and the exit status checked with the output's tail in the assertion message.

A support module, not a test module (tests/test_structure.py: no test spells torchrun's path or a fixed port but
this one).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REPO_ROOT = TESTS.parent
SRC = REPO_ROOT / "src"
JOBS = TESTS / "jobs"
TORCHRUN = Path(sys.executable).with_name("torchrun")
#: a job's time limit in seconds, unless its test names another
TIMEOUT = 600
#: how much of a job's output an assertion message quotes
TAIL = 5000

needs_torchrun = pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside this Python")


def free_port() -> int:
    """A TCP port of 127.0.0.1 nobody listens on now (the system's choice)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun(processes: int = 2, *options: str, standalone: bool = True) -> list[str]:
    """torchrun starting ``processes`` workers with ``options``: on ``--standalone`` (its own rendezvous on a free
    port), else with the static rendezvous of a plain ``torchrun --nproc_per_node`` on a :func:`free_port`."""
    rendezvous = ["--standalone"] if standalone else ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    return [str(TORCHRUN), *rendezvous, f"--nproc_per_node={processes}", *options]


def environment(*path: str | Path, src: Path = SRC, base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """``base`` (this process's environment) with ``path`` and then ``src`` first on ``PYTHONPATH``, the hub and
    datasets offline, one thread per process, unbuffered output; ``extra`` last."""
    env = dict(os.environ if base is None else base)
    pythonpath = [*map(str, path), str(src), *filter(None, [env.get("PYTHONPATH")])]
    env.update(PYTHONPATH=os.pathsep.join(dict.fromkeys(pythonpath)), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")  # fmt: skip
    env.update(extra)
    return env


@dataclass
class Ended:
    """How a :class:`Job` ended: its exit status and output (``stderr`` empty when it went to ``stdout``)."""

    name: str
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    def tail(self, size: int = TAIL) -> str:
        """The end of its output (of each stream, when they were kept apart)."""
        return f"{self.stdout[-size:]}\n{self.stderr[-size:]}" if self.stderr else self.stdout[-size:]


class Job:
    """``argv`` started in ``cwd`` in a session of its own with ``env`` (:func:`environment` unless given), its output
    written straight into its console file (``cwd/console.txt`` unless ``console`` names another; ``False``: a
    temporary one), so that no job ever waits on a full pipe while the test waits on another. ``merge``: stderr goes
    to the same file (in the order the job wrote them), else it is kept apart and appended to the console once the job
    ended. ``name``: how messages call it. :meth:`wait` ends it; :meth:`ok` also checks that it exited 0.
    :attr:`groups`: process groups of sessions it started itself (a wrapper's job), killed with it."""

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str] | None = None, *, merge: bool = True,
                 console: Path | bool = True, timeout: float = TIMEOUT, name: str | None = None) -> None:  # fmt: skip
        self.argv, self.cwd, self.timeout = [str(a) for a in argv], Path(cwd), timeout
        self.name = name or self.cwd.name
        self.temporary = console is False
        if console is True:
            console = self.cwd / "console.txt"
        self.console = Path(tempfile.mkstemp(prefix="job-", suffix=".txt")[1]) if self.temporary else Path(console)
        self.groups: list[int] = []
        self.ended: Ended | None = None
        self._started = time.monotonic()
        with open(self.console, "wb") as out, tempfile.TemporaryFile() as err:
            self._stderr = None if merge else os.dup(err.fileno())
            self.process = subprocess.Popen(self.argv, cwd=self.cwd, env=environment() if env is None else env,
                                            stdout=out, stderr=subprocess.STDOUT if merge else err,
                                            start_new_session=True)  # fmt: skip

    @property
    def pid(self) -> int:
        return self.process.pid

    def lines(self):
        """The job's output line by line as it comes, until it ends or its time limit runs out (``merge`` only)."""
        assert self._stderr is None, "lines() reads a job started with merge=True"
        with open(self.console, encoding="utf-8", errors="replace") as output:
            pending = ""
            while time.monotonic() - self._started < self.timeout:
                pending += output.readline()
                if pending.endswith("\n"):
                    yield pending
                    pending = ""
                elif self.process.poll() is not None:
                    rest = pending + output.read()
                    yield from rest.splitlines(keepends=True)
                    return
                else:
                    time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL to the job's whole session and to the groups it started."""
        for group in (self.process.pid, *self.groups):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGKILL)

    def wait(self) -> Ended:
        """The job's end: waited for up to its time limit from now (then killed, and the test fails with its
        output's tail); whatever of its session is still running afterwards is killed too."""
        if self.ended is not None:
            return self.ended
        timed_out = False
        try:
            self.process.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            self.kill()
            self.process.wait()
        finally:  # a hung worker (ranks disagreeing on a collective), or a test that failed while it ran
            self.kill()
        self.ended = Ended(self.name, self.process.returncode, *self._output())
        if timed_out:
            raise AssertionError(f"{self.name} did not end within {self.timeout:.0f} s:\n{self.ended.tail()}")
        return self.ended

    def _output(self) -> tuple[str, str]:
        """stdout and stderr (empty when merged); the console then holds both, or is removed when temporary."""
        stdout = self.console.read_text(encoding="utf-8", errors="replace")
        stderr = ""
        if self._stderr is not None:
            with os.fdopen(self._stderr, "rb") as err:
                err.seek(0)
                stderr = err.read().decode("utf-8", errors="replace")
            with open(self.console, "a", encoding="utf-8") as console:
                console.write(stderr)
        if self.temporary:
            self.console.unlink()
        return stdout, stderr

    def ok(self) -> Ended:
        """:meth:`wait`, and the job exited 0 (else the test fails with its output's tail)."""
        ended = self.wait()
        assert ended.returncode == 0, f"{self.name} failed (exit status {ended.returncode}):\n{ended.tail()}"
        return ended


def run(argv: list[str], cwd: Path, env: dict[str, str] | None = None, **options) -> Ended:
    """One :class:`Job`, waited for (not checked: see :meth:`Job.ok`)."""
    return Job(argv, cwd, env, **options).wait()


def all_ok(jobs: dict) -> dict:
    """Every job of ``jobs`` waited for (none left running when one fails), then each checked: key ->
    :class:`Ended`."""
    ended = {key: _waited(job) for key, job in jobs.items()}
    for key, result in ended.items():
        if isinstance(result, AssertionError):
            raise result
        assert result.returncode == 0, f"{key} failed (exit status {result.returncode}):\n{result.tail()}"
    return ended


def _waited(job: Job) -> Ended | AssertionError:
    try:
        return job.wait()
    except AssertionError as failure:  # a time-out: the others are still waited for
        return failure
