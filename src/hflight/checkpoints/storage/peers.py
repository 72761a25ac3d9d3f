"""The processes of a multi-process job as a checkpoint's upload sees them (issue 68, item 5): each process uploads the
files it wrote, process 0 the rest, and process 0 writes the manifest object once every process's upload is confirmed.

The processes tell each other how far each upload is through the job's key-value store (``torch.distributed``'s, the
one they met through: torchrun's agent store, or the TCP store of process 0), never through a collective: uploads run
beside training (``save_async``), on threads of their own, while the training loop's thread runs the collectives.

Each checkpoint is one *round*, numbered per URL in the process (every Trainer writing that URL counts on: a round's
keys are never used twice in a job) on the training loop's thread of every process when its save begins (every
process saves the same checkpoints in the same order), so the rounds agree even where a write failed on one process:

- ``<round>/ready``: process 0's word that the checkpoint's folder is published and the stale copy of it in the store
  removed (``go``), or that the other processes should not upload (``skip: <cause>``; process 0 uploads the whole
  folder itself later);
- ``<round>/<rank>``: process ``rank``'s answer once its files are uploaded (``ok``) or given up (``failed: <cause>``);
- ``<round>/end``: process 0 is done with the checkpoint (its manifest uploaded, or given up). A process's upload of
  its files ends only then, so that a process whose run fails meanwhile does not exit (and have torchrun or srun end
  the others) while process 0 still uploads the manifest.

Which process wrote a file is read from its name (:func:`owner`): ``rng_state_<rank>.pth``, a distributed checkpoint's
``__<rank>_<n>.distcp`` shard, DeepSpeed's ``*zero_pp_rank_<rank>_*`` partitions; every other file is process 0's.

May import: ``hflight.checkpoints`` (its own modules).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from hflight.checkpoints.names import PROCESS_FILE_RE


def owner(name: str, size: int) -> int:
    """The rank of the process that wrote checkpoint file ``name`` (a path inside the folder) in a job of ``size``
    processes: the one its name carries, else 0."""
    found = PROCESS_FILE_RE.search(name)
    if found is None:
        return 0
    rank = int(next(group for group in found.groups() if group is not None))
    return rank if rank < size else 0


#: the longest pause between two looks at the store while waiting for another process's word
POLL_S = 0.25
#: how long a wait for another process's word goes on once this process's main thread has ended
EXIT_GRACE_S = 120.0
#: when this process's waits first saw its main thread ended
_EXIT: dict[str, float] = {}


class Peers:
    """This process (``rank`` of ``size``) and the job's key-value ``store`` (``torch.distributed.Store``: ``set``,
    ``get``, ``wait`` with a timeout, callable from any thread)."""

    def __init__(self, rank: int, size: int, store: Any) -> None:
        self.rank, self.size, self.store = rank, size, store

    @classmethod
    def of(cls, rank: int, size: int) -> Peers | None:
        """The job's peers when it has several processes in an initialized ``torch.distributed`` group, else None
        (one process: it uploads everything itself)."""
        if size <= 1:
            return None
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        from torch.distributed.distributed_c10d import _get_default_store

        return cls(rank, size, _get_default_store())

    def tell(self, key: str, value: str) -> None:
        self.store.set(key, value)

    def hear(self, key: str, timeout_s: float) -> str | None:
        """The value of ``key`` once it is set; None when it is not within ``timeout_s``, when the store is gone, or
        :data:`EXIT_GRACE_S` after this process's main thread has ended (the process is exiting: an upload in flight
        still finishes when its peers answer, and a peer that died never holds the exit for long). (Polled: the
        store's own ``wait`` logs a warning for every timeout.)"""
        deadline, pause = time.monotonic() + timeout_s, 0.005
        while True:
            try:
                if self.store.check([key]):
                    value = self.store.get(key)
                    return value.decode() if isinstance(value, bytes) else str(value)
            except Exception:  # noqa: BLE001 - the store's server is gone: the job is ending
                return None
            now = time.monotonic()
            if not threading.main_thread().is_alive():  # one grace for the whole exit, however many waits
                _EXIT.setdefault("since", now)
                deadline = min(deadline, _EXIT["since"] + EXIT_GRACE_S)
            if now >= deadline:
                return None
            time.sleep(min(pause, deadline - now))
            pause = min(pause * 2, POLL_S)
