"""A pytest plugin for TRL's tests run offline (``-p tests.trl_upstream.plugin``): loaded before the test modules
import ``datasets.load_dataset``, it maps ``trl-internal-testing/zen`` (and its configurations) to the parquet files
:mod:`tests.trl_upstream.standins` built (the folder in ``HFLIGHT_TRL_STANDINS``), any other name unchanged, and limits
each test's time (``HFLIGHT_TRL_TEST_TIMEOUT`` seconds, SIGALRM) so that one hang fails that test, not the run."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import signal
from pathlib import Path

import datasets
import pytest

#: the data sets served locally: hub id -> folder name under HFLIGHT_TRL_STANDINS
LOCAL = {"trl-internal-testing/zen": "zen"}


class StandInMissing(FileNotFoundError):
    """A configuration of a served data set that was not built."""


def local_files(path: str, name: str | None) -> dict[str, str] | None:
    """The split files of ``path``'s configuration ``name`` when the stand-ins serve it, else None."""
    folder = LOCAL.get(path)
    if folder is None:
        return None
    config = Path(os.environ["HFLIGHT_TRL_STANDINS"]) / folder / str(name)
    if not config.is_dir():
        raise StandInMissing(f"{path}: configuration {name!r} has no local stand-in (looked in {config})")
    return {split.stem: str(split) for split in sorted(config.glob("*.parquet"))}


def serving(load_dataset):
    @functools.wraps(load_dataset)
    def load(path, name=None, *args, **kwargs):
        files = local_files(path, name) if isinstance(path, str) else None
        if files is None:
            return load_dataset(path, name, *args, **kwargs)
        if args:
            raise TypeError(f"{path}: the stand-in takes load_dataset's options by name, not {args!r}")
        return load_dataset("parquet", data_files=files, **kwargs)

    load.served = True
    return load


if not getattr(datasets.load_dataset, "served", False):
    datasets.load_dataset = serving(datasets.load_dataset)
datasets.disable_progress_bars()


def missing_in_installed_trl(qualified: str):
    """What a name TRL's tests import from TRL stands for where the installed TRL (newer than the tests) no longer has
    it (the harness rewrites such imports on both sides, :func:`tests.trl_upstream.compare.adapt_to_installed_trl`):
    an ``is_<package>_available`` check answers whether the package imports; anything else raises when used, naming
    itself, so that only the tests that use it fail."""
    name = qualified.rpartition(".")[2]
    if name.startswith("is_") and name.endswith("_available"):
        return lambda: importlib.util.find_spec(name.removeprefix("is_").removesuffix("_available")) is not None

    def missing(*args, **kwargs):
        raise ImportError(f"{qualified} is not in the installed TRL {importlib.metadata.version('trl')} (version skew)")

    return missing


class TimedOut(Exception):
    """A test ran past HFLIGHT_TRL_TEST_TIMEOUT."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    limit = int(os.environ.get("HFLIGHT_TRL_TEST_TIMEOUT", "0"))

    def expire(signum, frame):
        raise TimedOut(f"{item.nodeid} ran past {limit} s")

    if limit:
        previous = signal.signal(signal.SIGALRM, expire)
        signal.alarm(limit)
    try:
        yield
    finally:
        if limit:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
