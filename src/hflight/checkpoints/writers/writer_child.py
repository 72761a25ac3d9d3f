"""The checkpoint writer process (``hflight.checkpoints.writers.writer_process``), started as ``python -I -c BOOT PATH
FD PARENT tie|-`` (``writer_process.BOOT``: ``PATH`` made its ``sys.path``, then :func:`main`).

Isolated (``-I``) and given the training process's import path in its order (``PATH``: the standard library first,
then the folders ``PYTHONPATH`` and the installation added, as the training process has them) without the working
folder: every module resolves to the file the training process has it from (a backport of a standard-library module
in site-packages stays behind the standard library), installs reachable through ``PYTHONPATH`` alone included, and a
module planted in a shared working folder is never imported in it (``python -m`` would put the working folder
first).

It runs in a session of its own, so that the signals sent to the training job's process group (a stop, a requeue)
are the training process's to handle. The training process kills it when it has nothing left to write (the end of a
run); it ends too when the connection (``FD``) closes, and when that process dies, even in the middle of a file (a
child outliving a killed run would go on writing into its folder): a thread of its own waits on the training process
(a ``pidfd``, Linux 5.3 and newer; elsewhere it polls the parent's pid) and kills this process when it ends, whichever
thread of the training process started it. Started by the training process's main thread (``tie``), Linux's
``PR_SET_PDEATHSIG`` does the same without waiting for this process's interpreter (it follows the thread that started
the child, so it is set only where that thread's life is the process's). Both are set before the imports that take
seconds.

May import: ``hflight.checkpoints.writers.writer_process``.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time


def _kernel_tie() -> None:
    """This process killed when the thread that started it ends (``PR_SET_PDEATHSIG``)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _watch(parent: int) -> None:
    """This process killed once ``parent`` has ended, by a thread of its own; ended now where it has already."""
    try:
        handle = os.pidfd_open(parent)
    except (AttributeError, OSError):  # no pidfd here (an older kernel or Python): the parent's pid polled
        handle = None
    if os.getppid() != parent:  # it had ended already (and the pidfd, if any, is another process's)
        os._exit(0)

    def wait() -> None:
        if handle is not None:
            select.select([handle], [], [])
        else:
            while os.getppid() == parent:
                time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait, name="hflight-writer-tie", daemon=True).start()


def main(argv: list[str]) -> None:
    descriptor, parent, tie = int(argv[0]), int(argv[1]), argv[2] == "tie"
    if tie:
        _kernel_tie()
    _watch(parent)
    from hflight.checkpoints.writers.writer_process import serve

    serve(descriptor)
