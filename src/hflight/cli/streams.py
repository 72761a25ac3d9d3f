"""The console of a command-line run, best effort: ``python train.py ... | tee main.log`` and Ctrl-C end ``tee`` with
the run, and every write after to the dead pipe raised ``BrokenPipeError``, in the middle of the stop's checkpoint (a
progress bar of ``save_pretrained``): the save failed, blamed on the disk, and the checkpoint was lost. The run
folder's log keeps everything; the console may go.

May import: nothing of hflight.
"""

from __future__ import annotations

import errno
import sys
from typing import Any

#: what a write to a console that has gone raises (a pipe whose reader ended, a terminal hung up)
_GONE = (errno.EPIPE, errno.EIO, errno.ENXIO)


class BestEffort:
    """A text stream whose writes and flushes never raise once its other end has gone: from then on it writes
    nothing (everything else is the stream's)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self.gone = False

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                return self._stream.write(text)
            except (OSError, ValueError) as exc:
                self._went(exc)
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self._stream.flush()
            except (OSError, ValueError) as exc:
                self._went(exc)

    def _went(self, exc: BaseException) -> None:
        if isinstance(exc, OSError) and exc.errno not in _GONE:
            raise exc
        self.gone = True  # ValueError: the stream was closed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def best_effort_console() -> None:
    """``sys.stdout`` and ``sys.stderr`` made :class:`BestEffort` (for the rest of the process: a command-line run
    exits after it)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, BestEffort):
            setattr(sys, name, BestEffort(stream))
