"""The processes' connection: where hflight starts the default process group, and where it ends it.

**Connecting** (:func:`connect`). Processes an external launcher started (torchrun, ``srun``, ``accelerate launch``,
the ``deepspeed`` launcher, MPI, LSF) are connected here, once, before Lightning would connect them: by the run
(``hflight.run.run``, with its strategy's backend and timeout) or, earlier, by ``TrainingArguments`` when DeepSpeed
needs the processes up while the script builds its model (ZeRO-3 partitions the model as it is created). One backend
default for both: ``ddp_backend`` (or the strategy's ``process_group_backend``) when set, else NCCL on a CUDA device
and gloo elsewhere, the choice of Lightning and of accelerate. The rendezvous is the launcher's, as Lightning reads it
(its cluster environment sets ``MASTER_ADDR``/``MASTER_PORT`` from srun's, LSF's or MPI's variables), with one
exception: under torchrun with its shared agent store (``TORCHELASTIC_USE_AGENT_STORE=True``, torch >= 2.5) a restarted
attempt would read the dead attempt's addresses from that store (half of the restarts failed in gloo's
``connectFullMesh``, pytorch/pytorch#135712, reproduced with torch alone), so global rank 0 starts a store of its own
for the attempt, publishes its address with a random token on torchrun's store, and the other ranks connect only to a
store that answers with that token. Processes Lightning starts itself (``devices=N`` with no launcher) are connected by
Lightning's strategy, with the same default.

**Aborting and reconnecting** (:func:`abort`, :func:`reconnect`). A rank whose trial of a search over several
processes failed aborts its group, so that a rank waiting for it in a collective leaves it; then every rank replaces
the broken group by a new one on a store the processes still share (the search's, under keys of its own:
``hflight.trainer.hpsearch_backends``), with the same backend, ranks and timeout.

**Ending** (:func:`end`, at exit through :func:`end_at_exit`, or at ``trainer.accelerator.end_training()``).
transformers' processes keep their group until they exit or call accelerate's ``end_training``, which destroys it
(transformers' Trainer never does: ``evaluate()``, ``predict()`` or another ``train()`` after ``train()`` use it), and
so do hflight's: ``train()`` leaves the group up. At exit, on the main thread while the interpreter is whole, the group
is destroyed and the objects that referenced it collected, so that torch destroys it there: gloo's destructor joins its
worker threads with the interpreter lock released. Left to the interpreter's teardown, a worker still freeing a finished
collective (whose tensors have Python objects) asks for the interpreter lock while Python finalizes, and the process
aborts ("terminate called without an active exception", SIGABRT; 3 of 20 two-process runs of a few all-gathers and a
barrier with torch 2.13 alone, 0 of 20 once destroyed). No sleep is involved. Where torch itself keeps a group
referenced after ``destroy_process_group`` (torch 2.13: one group of an FSDP2 device mesh, with torch alone) its workers
stay; they are idle by then (docs/sharding.md).

May import: ``hflight.arguments.cluster`` (the launcher's ranks).
"""

from __future__ import annotations

import atexit
import datetime
import gc
import logging
import os
import secrets
import socket
import sys
import time
from typing import Any

from hflight.arguments import cluster

logger = logging.getLogger(__name__)

__all__ = ["abort", "connect", "connect_strategy", "default_backend", "end", "end_at_exit", "gloo_worker_threads",
           "reconnect"]  # fmt: skip

#: torchrun's store key under which rank 0 publishes the process-group store of the attempt.
ELASTIC_STORE_KEY = "hflight/process_group_store"
#: Lightning's (and torch's) default timeout of the process group's collectives.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


def default_backend(device: Any = None, requested: str | None = None) -> str:
    """``requested`` (``ddp_backend``, a strategy's ``process_group_backend``) when given, else NCCL for a CUDA
    ``device`` and gloo for any other."""
    if requested:
        return requested
    return "nccl" if getattr(device, "type", device) == "cuda" else "gloo"


def connect(backend: str, timeout: datetime.timedelta | None = None) -> bool:
    """Connect the processes an external launcher started into the default process group (``backend``), unless
    there is one process, no external launcher, or the group exists already. Returns whether it connected now."""
    import torch.distributed as dist

    launched = cluster.ranks()
    if launched is None or launched.world_size <= 1 or not dist.is_available() or dist.is_initialized():
        return False
    timeout = timeout or DEFAULT_TIMEOUT
    rank, world_size = launched.global_rank, launched.world_size
    if _uses_agent_store():
        store = _attempt_store(rank, world_size, timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    else:
        _rendezvous_address()
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size, timeout=timeout)
    logger.debug(f"Connected rank {rank} of {world_size} ({backend})")
    end_at_exit()
    return True


def connect_strategy(strategy: Any) -> bool:
    """:func:`connect` with a Lightning strategy's backend (its ``process_group_backend``, else :func:`default_backend`
    for its device) and timeout, before the strategy would connect; Lightning keeps the group."""
    backend = default_backend(getattr(strategy, "root_device", None), getattr(strategy, "_process_group_backend", None))
    return connect(backend, getattr(strategy, "_timeout", None))


def _rendezvous_address() -> None:
    """``MASTER_ADDR``/``MASTER_PORT`` as Lightning's cluster environment of the launcher finds them, where the launcher
    set none (srun's node list, LSF's and MPI's hosts); torchrun, accelerate's and DeepSpeed's launchers set both."""
    if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
        return
    from lightning.fabric.plugins import environments

    chosen = {
        "slurm": lambda: environments.SLURMEnvironment(auto_requeue=False),
        "lsf": environments.LSFEnvironment,
        "mpi": environments.MPIEnvironment,
    }.get(cluster.environment())
    if chosen is None:
        raise RuntimeError(
            f"The processes were launched ({cluster.environment()}) without MASTER_ADDR and MASTER_PORT: set both to "
            "the address and a free port of the node of global rank 0."
        )
    environment = chosen()
    os.environ.setdefault("MASTER_ADDR", str(environment.main_address))
    os.environ.setdefault("MASTER_PORT", str(environment.main_port))


# ---- aborted and connected again -------------------------------------------------------------------------------------
def abort() -> None:
    """Abort the default process group: its collectives stop waiting, on this rank, and (once the group is
    destroyed: gloo closes its connections only then) on the ranks that wait for this one. Nothing if there is none."""
    from torch.distributed import distributed_c10d

    if distributed_c10d.is_initialized():
        distributed_c10d._abort_process_group()


def reconnect(backend: str, store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> None:
    """A new default process group on ``store`` in place of the current one, which is aborted first (a failed
    trial's, or one broken by a rank that aborted its own): every rank calls it with the same store (a
    ``torch.distributed.PrefixStore`` of keys no earlier group used), ``backend``, ``world_size`` and ``timeout``."""
    import torch.distributed as dist

    abort()
    hook = sys.excepthook
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    sys.excepthook = hook  # torch adds its "[rank0]: " prefix to uncaught errors at each connection: once is enough
    end_at_exit()


# ---- the end ---------------------------------------------------------------------------------------------------------
_END_REGISTERED: list[bool] = []


def end_at_exit() -> None:
    """:func:`end` when the process exits (registered once per process)."""
    if not _END_REGISTERED:
        _END_REGISTERED.append(True)
        atexit.register(end)


def end() -> None:
    """Destroy the default process group (with every group made from it) and collect what referenced it, so that
    torch destroys the groups now, on this thread: gloo joins its worker threads then, with the interpreter lock
    released, and none is left to free a collective while the interpreter finalizes. Nothing if there is no group.

    Garbage is collected first, while the group is still registered: a DDP wrapper left in a reference cycle then goes
    without taking the group with it (its reducer would destroy the group holding the interpreter lock, and a gloo
    worker waiting for that lock to free a collective's tensors would never be joined)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    gc.collect()
    try:
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - the process is ending; say why and go on
        logger.debug(f"Could not destroy the process group: {exc}")
        return
    gc.collect()


def gloo_worker_threads() -> int:
    """How many of gloo's worker threads (``pt_gloo_runloop``) this process has: 2 per live gloo group (Linux; 0 where
    ``/proc`` does not list threads)."""
    count = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm", encoding="utf-8") as comm:
                count += comm.read().strip() == "pt_gloo_runloop"
        except OSError:
            continue
    return count


# ---- torch elastic: a process-group store per attempt ---------------------------------------------------------------
def _uses_agent_store() -> bool:
    return cluster.environment() == "torchelastic" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _attempt_store(rank: int, world_size: int, timeout: datetime.timedelta) -> Any:
    import torch.distributed as dist

    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    if rank == 0:
        token = secrets.token_hex(8)
        own = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        own.set("hflight/token", token)
        agent.set(ELASTIC_STORE_KEY, f"{own.port}:{token}")
        return own
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        port_text, _, token = agent.get(ELASTIC_STORE_KEY).decode().partition(":")
        try:
            if _listening(host, int(port_text)):  # else a stale address: nothing listens there any more
                wait = datetime.timedelta(seconds=2)
                own = dist.TCPStore(host, int(port_text), world_size, is_master=False, timeout=wait)
                if own.get("hflight/token").decode() == token:  # not another attempt's store on a reused port
                    own.set_timeout(timeout)
                    return own
        except (RuntimeError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"Rank {rank}: no process-group store of this torchrun attempt answered at {host} within "
                f"{timeout.total_seconds():.0f} s (rank 0 did not start?)"
            )
        time.sleep(0.1)
