"""How a run's failure is kept and told: ``error.txt`` (the traceback) in the run folder, and which failures are
the user's (configuration, data, a checkpoint), reported as one message without a traceback."""

from __future__ import annotations

import logging
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException, HydraException
from lightning.fabric.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from hflight import durable

__all__ = ["ERROR_FILE", "USER_ERRORS", "RunFailed"]

log = logging.getLogger(__name__)

#: File a failed job leaves in its run directory (the traceback).
ERROR_FILE = "error.txt"


def _run_dir(cfg: DictConfig) -> Path:
    for get in (lambda: cfg.paths.output_dir, lambda: HydraConfig.get().runtime.output_dir):
        try:
            value = get()
        except Exception:  # noqa: BLE001 - an unresolvable config must not hide the original error
            continue
        if value:
            return Path(value)
    return Path.cwd()


#: Failures caused by the configuration, the data or a checkpoint (reported by their message, not a traceback).

USER_ERRORS = (
    ValueError,
    TypeError,
    KeyError,
    OSError,
    ImportError,
    OmegaConfBaseException,
    HydraException,
    MisconfigurationException,  # Lightning's: e.g. trainer=gpu where no GPU is available
)


class RunFailed(CompactHydraException):
    """A user error of a command-line run, re-raised for Hydra to print as one message (no traceback)."""


def _record_failure(cfg: DictConfig, text: str) -> Path:
    path = _run_dir(cfg) / ERROR_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        durable.sync_files([path])  # on disk before the failure names it
    except OSError as exc:
        log.error(f"Could not write {path}: {exc}")
    return path


def _clear_failure(cfg: DictConfig) -> None:
    """A run that completed in a folder holding an earlier attempt's ``error.txt`` (the interruption ``resume=``
    continued, a requeued job's first attempt): the file goes, so that the folder no longer says the run failed."""
    path = _run_dir(cfg) / ERROR_FILE
    try:
        if not path.is_file():
            return
        path.unlink(missing_ok=True)  # every process of a run may get here
        durable.fsync_dir(path.parent)
    except OSError as exc:
        log.error(f"Could not remove {path} of the earlier attempt: {exc}")
        return
    log.info(f"The run completed: removed {path} of the earlier attempt")


def _describe(exc: BaseException) -> str:
    """``Type: message`` (a KeyError's message without the quotes ``str`` adds)."""
    message = exc.args[0] if isinstance(exc, KeyError) and len(exc.args) == 1 else exc
    return f"{type(exc).__name__}: {message}"
