"""The last exit callback of a process a signal stopped (no heavy imports: registered when ``hflight`` is imported, so
that it runs after the exit callbacks registered later, atexit being last-in, first-out).

After the exit callbacks Python gives every signal it handles its default action back, then tears its modules down
(more than a second with torch imported). A SIGTERM arriving there would end the process by the signal instead of
with the stop's exit status, as when srun's ``--kill-on-bad-exit`` sends it to a requeued job's task that is still
exiting; ``hflight.run.interrupt`` names the signals here when a run stops, and they are ignored through that teardown.
"""

from __future__ import annotations

import atexit
import signal
import threading

#: signals to ignore once the exit callbacks have run (filled by hflight.run.interrupt when a signal stops a run)
IGNORE_WHILE_FINALIZING: set[int] = set()


def _ignore_signals_while_finalizing() -> None:
    if IGNORE_WHILE_FINALIZING and threading.current_thread() is threading.main_thread():
        for signum in IGNORE_WHILE_FINALIZING:
            signal.signal(signum, signal.SIG_IGN)


atexit.register(_ignore_signals_while_finalizing)
