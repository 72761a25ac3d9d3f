"""The checkpoint writer process (``hflight.checkpoints.writer_process``): ``python -m hflight.checkpoints.writer_child
FD PARENT tie|-``.

It runs in a session of its own, so that the signals sent to the training job's process group (a stop, a requeue)
are the training process's to handle. It ends when the training process closes the connection (``FD``), and, tied
(``tie``: started by the training process's main thread), when that process dies, even in the middle of a file (a
child outliving a killed run would go on writing into its folder): Linux's ``PR_SET_PDEATHSIG``, set before the
imports that take seconds.

May import: ``hflight.checkpoints.writer_process``.
"""

from __future__ import annotations

import os
import signal
import sys


def _die_with(parent: int) -> None:
    """This process is killed when ``parent``'s thread that started it ends (``PR_SET_PDEATHSIG``)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it had ended already
        os._exit(0)


def main(argv: list[str]) -> None:
    descriptor, parent, tie = int(argv[0]), int(argv[1]), argv[2] == "tie"
    if tie:
        _die_with(parent)
    from hflight.checkpoints.writer_process import serve

    serve(descriptor)


if __name__ == "__main__":
    main(sys.argv[1:])
