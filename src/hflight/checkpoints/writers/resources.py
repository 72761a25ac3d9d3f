"""The operating-system resources of the checkpoint writers, with one lifetime: made on first use, forgotten in a
forked child, released at ``close()`` and at interpreter exit.

The writers keep what is costly to make from one file or checkpoint to the next: ``direct_file``'s page-aligned
staging buffers, ``torch_file``'s CRC threads, ``asynchronous``'s staging area, and ``writer_process``'s shared
memory and child process. Each such thing is put in a :class:`Resources` when it is made, with how to release it
(unmap, close, shut down, stop) and, where the default of dropping the reference is wrong, how a forked child lets go
of its inherited copy without touching the parent's (a child may not send the parent's writer process its ``exit``,
and has no CRC threads behind its copy of the pool). Every :class:`Resources` of the process is reset in a forked
child (``os.register_at_fork``) and closed at exit (``atexit``); a run's writer closes its own, and the process-wide
pools (:data:`pools`), at the end of ``fit`` (a pool in use elsewhere at that moment is made again at its next use).
A resource added later gets the three by being put here.

Forgetting matters because a fork copies a process's memory and descriptors but only the thread that forked: shared
mappings stay shared (two processes would stage their files in one buffer), a thread pool has no threads (a task
submitted to it waits forever), and a descriptor to another process (the writer child's connection) is one more
writer on it.

May import: nothing of hflight.
"""

from __future__ import annotations

import atexit
import logging
import mmap
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

_every: weakref.WeakSet[Resources] = weakref.WeakSet()


class _Held:
    __slots__ = ("resource", "release", "forget", "key")

    def __init__(
        self, resource: Any, release: Callable[[Any], None], forget: Callable[[Any], None] | None, key: str | None
    ) -> None:
        self.resource, self.release, self.forget, self.key = resource, release, forget, key


class Resources:
    """Resources held together, released together (newest first). ``name`` is for the log."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._held: dict[int, _Held] = {}
        self._keys: dict[str, int] = {}  # the resources made by get(), by their key
        self._lock = threading.Lock()
        _every.add(self)

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, resource: Any, release: Callable[[Any], None], forget: Callable[[Any], None] | None = None) -> Any:
        """``resource`` kept until :meth:`let_go`, :meth:`close` or exit, which call ``release(resource)``; in a forked
        child ``forget(resource)`` is called instead (None: the child only drops its reference). Returns it."""
        with self._lock:
            self._held[id(resource)] = _Held(resource, release, forget, None)
        return resource

    def get(
        self,
        key: str,
        make: Callable[[], Any],
        release: Callable[[Any], None],
        forget: Callable[[Any], None] | None = None,
    ) -> Any:
        """The resource ``key``: made by ``make()`` at first use (and after it was released or forgotten), then held as
        :meth:`hold` holds it."""
        with self._lock:
            known = self._keys.get(key)
            if known is not None:
                return self._held[known].resource
            resource = make()
            self._held[id(resource)] = _Held(resource, release, forget, key)
            self._keys[key] = id(resource)
            return resource

    def let_go(self, resource: Any) -> None:
        """``resource`` released now (nothing where it is not held)."""
        with self._lock:
            held = self._held.pop(id(resource), None)
            if held is not None and held.key is not None:
                del self._keys[held.key]
        if held is not None:
            _release(self.name, held)

    def close(self) -> None:
        """Everything held released, the newest first."""
        with self._lock:
            held, self._held, self._keys = list(self._held.values()), {}, {}
        for each in reversed(held):
            _release(self.name, each)

    def _forget(self) -> None:
        """In a forked child: the inherited resources let go of without releasing the parent's (see the module)."""
        held, self._held, self._keys = list(self._held.values()), {}, {}
        self._lock = threading.Lock()  # a lock held by another thread of the parent stays held in the child
        for each in held:
            if each.forget is not None:
                try:
                    each.forget(each.resource)
                except Exception:  # noqa: BLE001 - nothing of the parent's may be touched: a failure changes nothing
                    pass


def _release(name: str, held: _Held) -> None:
    try:
        held.release(held.resource)
    except Exception as exc:  # noqa: BLE001 - a release that fails leaves that resource to the end of the process
        logger.debug(f"Releasing one of the {name} failed: {type(exc).__name__}: {exc}")


#: the pools every writer of the process shares (``direct_file``'s buffers, ``torch_file``'s CRC threads)
pools = Resources("checkpoint writers' pools")


def close_descriptor(fd: int) -> None:
    """A descriptor closed, whatever state it is in (a forked child's copy; a release)."""
    try:
        os.close(fd)
    except OSError:
        pass


def populate(array: Any) -> None:
    """The pages of ``array`` (a numpy array of bytes over fresh memory) made present: a zero written into each, by
    numpy, which releases the interpreter lock while it runs. (``mmap``'s ``MAP_POPULATE`` holds the lock for the
    whole mapping: 0.09 s for 270 MB, which the training loop waited out whenever another thread allocated.)"""
    if len(array):
        array[:: mmap.PAGESIZE] = 0


def _forget_all() -> None:
    for each in list(_every):
        each._forget()


def _close_all() -> None:
    for each in list(_every):
        each.close()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_all)
atexit.register(_close_all)
