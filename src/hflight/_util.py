"""Small helpers any layer may use: lazy package exports (PEP 562), walking an exception's chain, a model's tensor-
parallel size, whether a path is an object store's URL, and the last exit callback of a process a signal stopped
(registered when ``hflight`` is imported, see :data:`IGNORE_WHILE_FINALIZING`)."""

from __future__ import annotations

import atexit
import importlib
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str], names: list[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: each name of ``exports`` is imported from its module on first
    access and cached in the package's namespace; any other name is an ``AttributeError``."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        vars(importlib.import_module(package))[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(importlib.import_module(package)), *names})

    return __getattr__, __dir__


def exception_chain(error: BaseException | None) -> Iterator[BaseException]:
    """``error``, then the exception it was raised from or during, and so on (each once, even in a cycle)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


#: the fsspec protocols that are the local disk itself (``file:///scratch/run`` is a local folder)
LOCAL_PROTOCOLS = ("file", "local")


def is_remote(path: Any) -> bool:
    """Whether ``path`` is the URL of a filesystem other than the local disk (``s3://b/run``; not ``/x``,
    ``file:///x``)."""
    if not isinstance(path, str) or "://" not in path:
        return False
    protocol = path.split("://", 1)[0]
    return protocol.replace("+", "").replace("-", "").isalnum() and protocol not in LOCAL_PROTOCOLS


def model_tp_size(model: Any) -> int:
    """The tensor-parallel size transformers gave ``model`` at load time (``from_pretrained(..., tp_plan=...)`` sets
    ``_tp_size``); 1 for any other model, and for None."""
    size = getattr(model, "_tp_size", None) if model is not None else None
    return int(size) if size else 1


def sharded_at_load(model: Any) -> bool:
    """Whether transformers sharded ``model`` when it loaded it (``from_pretrained(..., tp_plan=...)`` or
    ``distributed_config=``): its ``save_pretrained`` then gathers the shards itself, a collective every process
    joins (transformers' ``is_distributed_loading_by_transformers``)."""
    return bool(getattr(model, "is_distributed_loading_by_transformers", False)) if model is not None else False


#: Signals to ignore once the exit callbacks have run, filled by ``hflight.run.interrupt`` when a signal stops a run.
#: After the exit callbacks Python gives every signal it handles its default action back, then tears its modules down
#: (more than a second with torch imported); a SIGTERM arriving there would end the process by the signal instead of
#: with the stop's exit status, as when srun's ``--kill-on-bad-exit`` sends it to a requeued job's task that is still
#: exiting. Ignored signals stay ignored through that teardown.
IGNORE_WHILE_FINALIZING: set[int] = set()


def _ignore_signals_while_finalizing() -> None:
    if IGNORE_WHILE_FINALIZING and threading.current_thread() is threading.main_thread():
        for signum in IGNORE_WHILE_FINALIZING:
            signal.signal(signum, signal.SIG_IGN)


# registered when hflight is first imported, so it runs after the exit callbacks registered later (last in, first out)
atexit.register(_ignore_signals_while_finalizing)
