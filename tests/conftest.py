"""Shared fixtures: real public QA data from ../shared/data (skipped when absent), the tiny models' builder
(:class:`tests.support.Factory`), the torch threads and signal handlers each test starts with, and Hydra's command
line run in this process."""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

import pytest

from .support import Factory

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One torch thread per test process unless the caller says otherwise: CI runs two workers on two cores, where two
# threads each only contend (tests/test_trainer.py alone: 41-42 s of CPU with two threads, 29-31 s with one), and the
# processes the tests start inherit it (the launch helpers already set 1).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402  (after the variable: torch reads it at import; set here too in case a plugin imported it)

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"

#: the test modules that take longest (CI's ``--durations``, summed per module), longest first: CI's two workers take
#: one module at a time (``--dist loadfile``) in collection order, so these go first and the short ones fill in at
#: the end. xdist's own order (the modules with most tests first) dealt the long modules of few tests (Ray Train's,
#: accelerate launch's) last, one worker running them while the other idled
LONGEST_FIRST = (
    "test_benchmarks.py", "test_sweeps.py", "test_accelerate_launch.py", "test_sharding.py", "test_ray_train.py",
    "test_field_sweep.py", "test_signals.py", "test_readme_commands.py", "test_slurm.py", "test_resume.py",
    "test_sharded_dropin.py", "test_remote_checkpoints.py", "test_data_position_ddp.py", "test_tensor_parallel.py",
    "test_run_qa_dropin.py", "test_arguments_on_lightning.py",
    "test_distributed.py", "test_hpsearch.py", "test_install.py", "test_deepspeed.py", "test_torchrun_dropin.py",
    "test_sft_recipe.py", "test_elastic.py", "test_finetune_torchrun.py", "test_notebooks.py", "test_cli.py",
    "test_tracking.py",
)  # fmt: skip


def pytest_configure(config):
    """xdist keeps the collection order of the modules (see :data:`LONGEST_FIRST`)."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """The modules of :data:`LONGEST_FIRST` first, in its order; the others after them, in their own order."""
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """A run with ``cpu_threads`` set (the tests' tiny runs set 1) changes torch's threads for the whole process;
    each test starts with the session's, so results never depend on which tests ran before."""
    import torch

    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


_SESSION_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
_SESSION_HANDLERS = {signum: signal.getsignal(signum) for signum in _SESSION_SIGNALS}


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """A library a test starts may install process-wide signal handlers and keep them (``ray.init`` sets SIGTERM to
    ``sys.exit(15)``); after each test the session's handlers, as they were when the worker started, are put back, so
    a signal test never sees another test's. The session's, not the test's own at its start: a module-scoped fixture
    (Ray Train's ``runs``) is set up before this one and would make its handler the one kept."""
    yield
    for signum, handler in _SESSION_HANDLERS.items():
        if signal.getsignal(signum) is not handler and handler is not None:
            signal.signal(signum, handler)


@pytest.fixture
def command_line(monkeypatch):
    """``hflight-train ARGV`` run in this process (``cli.main()``, Hydra's command line, from the working directory):
    what it exits with (0 when it returns; a message, printed as it is, or a status when it exits). Hydra's global
    state and the root logger's handlers and level are put back after (the handlers a run added closed)."""
    from hydra.core.global_hydra import GlobalHydra

    from hflight import cli

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)

    def hflight_train(*argv: str) -> str | int | None:
        monkeypatch.setattr(sys, "argv", ["hflight-train", *argv])
        try:
            cli.main()
        except SystemExit as exited:
            return exited.code
        return 0

    yield hflight_train
    GlobalHydra.instance().clear()
    for handler in set(root.handlers) - set(handlers):
        handler.close()
    root.handlers[:], root.level = handlers, level


@pytest.fixture
def one_torch_thread():
    """Generation tests: many tiny steps, on a shared 2-core machine far faster on one thread than on two contending
    (``_torch_threads_restored`` puts the session's count back afterwards)."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture
def zlib_crc(monkeypatch):
    """The CRC-32 of an install without ``isal``: zlib's, a large record in parts on the CRC pool's threads
    (hflight.checkpoints.writers.torch_file._crc32)."""
    from hflight.checkpoints.writers import torch_file

    monkeypatch.setattr(torch_file, "_fast_crc32", None)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The folder of real SQuAD-format data sets; skips the test when a fresh clone has none beside it."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real QA data not found at {SHARED_DATA} (only present beside the team's checkouts)")
    return SHARED_DATA


@pytest.fixture(scope="session")  # a stateless class: module-scoped fixtures use it too
def factory() -> type[Factory]:
    return Factory


# ---- the checkpoint tests' runs (tests/checkpoint_runs.py), built once per test process --------------------------
@pytest.fixture
def reference(tmp_path_factory, factory):
    """The uninterrupted 12-step run of the checkpoint tests."""
    from .checkpoint_runs import reference_run

    return reference_run(tmp_path_factory, factory)


@pytest.fixture
def saved(tmp_path_factory, factory) -> Path:
    """A run stopped at step 6 with checkpoints at steps 3 and 6 (tests that change them work on copies)."""
    from .checkpoint_runs import saved_run

    return saved_run(tmp_path_factory, factory)
