"""What a cluster scheduler adds to a run, through hflight's checkpoints: SLURM's requeue, torch elastic's restarts,
and Lightning's own fallbacks for these moments switched off.

- **SLURM requeue** (:func:`requeue_job`): once every rank has stopped at the same step boundary and the checkpoint
  is complete (``hflight.run.loop``), global rank 0 runs ``scontrol requeue <job id>`` (``$SLURM_JOB_ID``, or
  ``${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}`` for an array task), once, and tells the other ranks how it went.
  A failed ``scontrol`` is reported; the checkpoint stays either way.
- **Lightning's SLURM checkpoints** (:func:`no_lightning_hpc_restore`): Lightning, under SLURM, restores the newest
  ``hpc_ckpt_*.ckpt`` of its ``default_root_dir`` (the output folder) whenever ``fit``/``validate`` gets no
  checkpoint path: a pickle written by its own auto-requeue, outside hflight's manifest and checks, which would
  silently replace the weights (seen: a requeued job that started at epoch 8.1). hflight writes none
  (``SLURMEnvironment(auto_requeue=False)``, ``hflight.arguments.cluster.slurm_plugin``), never loads one, and names
  any it finds.
- **the process group's end** (:func:`end_process_group_at_exit`): destroyed when the process exits, before the
  interpreter's teardown, where gloo aborts the process in most runs.
- **torch elastic restarts** (:func:`init_elastic_process_group`): since torch 2.5 the processes torchrun starts
  share its rendezvous store (``TORCHELASTIC_USE_AGENT_STORE=True``), which keeps the keys of the attempt before a
  restart; the restarted processes then read a dead peer's address from them and half the restarts fail in gloo's
  ``connectFullMesh`` (``Connection refused``; pytorch/pytorch#135712, reproduced here with torch alone).
  ``TORCHELASTIC_RESTART_COUNT`` cannot tell the attempts apart (each node's agent counts its own). So global rank 0
  starts a store of its own, on a free port, for this attempt only, and publishes its address and a random token on
  torchrun's store; the other ranks take an address only when that store answers with the same token (a stale one
  from an earlier attempt has no listener, or another token), and the process group is initialised on it before
  Lightning would (Lightning then keeps it).

May import: ``hflight.arguments`` (below the run).
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import re
import secrets
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hflight.arguments import cluster

logger = logging.getLogger(__name__)

#: Lightning's file names for its SLURM checkpoints (``hpc_ckpt_<n>.ckpt`` in ``default_root_dir``).
HPC_CHECKPOINT_RE = re.compile(r"^hpc_ckpt_\d+\.ckpt$")
#: Seconds ``scontrol requeue`` may take before it counts as failed.
SCONTROL_TIMEOUT = 60.0
#: torchrun's store key under which rank 0 publishes the process-group store of the attempt.
ELASTIC_STORE_KEY = "hflight/process_group_store"


# ---- the processes a run spans ------------------------------------------------------------------------------------
class WorldMismatchError(ValueError):
    """The Lightning strategy would span fewer (or more) processes than were launched: each process would train a
    model of its own on all the data instead of one model together."""


def check_spans_launch(lightning_trainer: Any, args: Any) -> None:
    """Refuse a run whose strategy does not span every process the launcher started (torchrun, srun, ...) or the
    ``torch.distributed`` group already up: it would run N copies of a one-process job, each writing into the same
    folder. ``args``: the ``TrainingArguments`` (their ``devices``/``num_nodes``/``strategy`` are named)."""
    launched = cluster.launched_world_size()
    spans = lightning_trainer.world_size
    if launched is None or launched == spans:
        return
    strategy = lightning_trainer.strategy
    raise WorldMismatchError(
        f"{launched} processes were launched ({cluster.environment()}: {_launch_variables()}), but the Lightning "
        f"strategy {type(strategy).__name__} spans {spans} (devices={args.devices!r}, num_nodes={args.num_nodes}, "
        f"strategy={args.strategy!r}): each process would train alone on all the data. Leave devices='auto' and "
        "num_nodes=1 (hflight then spans every launched process, as transformers' Trainer does), or set them to the "
        "launch's processes per node and nodes."
    )


def _launch_variables() -> str:
    names = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE", "SLURM_NNODES")
    shown = [f"{name}={os.environ[name]}" for name in names if name in os.environ]
    return ", ".join(shown) if shown else "torch.distributed is initialised"


# ---- SLURM: requeue -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Requeue:
    """How ``scontrol requeue`` went: the job id, whether it succeeded, and what to tell the user."""

    job_id: str | None
    ok: bool
    detail: str


def _run_scontrol(job_id: str | None) -> Requeue:
    if job_id is None:
        return Requeue(None, False, "no SLURM_JOB_ID in the environment, so there is no job to requeue")
    command = ["scontrol", "requeue", job_id]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=SCONTROL_TIMEOUT, check=False)
    except FileNotFoundError:
        return Requeue(job_id, False, "scontrol is not on PATH")
    except subprocess.TimeoutExpired:
        return Requeue(job_id, False, f"`scontrol requeue {job_id}` did not answer within {SCONTROL_TIMEOUT:.0f} s")
    if done.returncode != 0:
        said = (done.stderr or done.stdout or "").strip().splitlines()
        why = f": {said[-1]}" if said else ""
        return Requeue(job_id, False, f"`scontrol requeue {job_id}` exited with status {done.returncode}{why}")
    return Requeue(job_id, True, f"`scontrol requeue {job_id}`")


def requeue_job(world: Any = None) -> Requeue:
    """Requeue this SLURM job: global rank 0 runs ``scontrol requeue``; with several processes (``world``: the run's
    :class:`~hflight.run.distributed.World`, None outside a run) the others get its outcome. Call it on every rank,
    after the checkpoint is complete."""
    rank = world.rank if world is not None else _rank_outside_a_run()
    outcome = _run_scontrol(cluster.slurm_job_id()) if rank == 0 else None
    if world is not None and world.size > 1:
        outcome = world.strategy.broadcast(outcome, src=0)
    if outcome is None:  # another rank, outside a run: rank 0 requeues
        return Requeue(cluster.slurm_job_id(), True, "global rank 0 requeues the job")
    if rank == 0:
        (logger.warning if outcome.ok else logger.error)(
            f"SLURM job {outcome.job_id}: " + ("requeued" if outcome.ok else "requeue failed") + f" ({outcome.detail})"
        )
    return outcome


def _rank_outside_a_run() -> int:
    launched = cluster.ranks()
    return launched.global_rank if launched is not None else 0


def requeue_message(outcome: Requeue, checkpoint: str | None, kept: bool = True) -> str:
    """What a process prints when it stops for a requeue: that the job was requeued and from which checkpoint the
    requeued job continues (``checkpoint``: a folder, or words for one; None: none was saved), or why not
    (``kept``: the checkpoint is a folder that stays)."""
    where = f"from {checkpoint}" if checkpoint else "from the start (no checkpoint was saved)"
    if outcome.ok:
        return (
            f"SLURM job {outcome.job_id} requeued ({outcome.detail}): the requeued job continues {where} "
            "(hflight-train continues a run by itself when SLURM_RESTART_COUNT >= 1; from Python pass "
            "resume_from_checkpoint='auto')."
        )
    stays = f"The checkpoint {checkpoint} is kept: s" if checkpoint and kept else "S"
    return (
        f"Requeuing SLURM job {outcome.job_id} failed: {outcome.detail}. {stays}ubmit the job again with the same "
        "command (resume=auto) to continue."
    )


# ---- Lightning's SLURM checkpoints ----------------------------------------------------------------------------------
def lightning_hpc_checkpoints(folder: str | os.PathLike) -> list[str]:
    """Lightning's ``hpc_ckpt_*.ckpt`` files in ``folder``."""
    path = Path(folder)
    if not path.is_dir():
        return []
    return sorted(p.name for p in path.iterdir() if HPC_CHECKPOINT_RE.match(p.name))


_REPORTED: set[str] = set()  # folders whose hpc_ckpt files this process named already


def no_lightning_hpc_restore(lightning_trainer: Any, report: bool) -> None:
    """Keep ``lightning_trainer`` from restoring an ``hpc_ckpt_*.ckpt`` of its ``default_root_dir`` (Lightning does
    so under SLURM when ``fit``/``validate`` get no checkpoint path); ``report``: name any such file (rank 0; once
    per folder). hflight restores from ``checkpoint-N`` folders only, before Lightning runs."""
    found = lightning_hpc_checkpoints(lightning_trainer.default_root_dir)
    if not found:
        return
    if report and os.path.realpath(lightning_trainer.default_root_dir) not in _REPORTED:
        _REPORTED.add(os.path.realpath(lightning_trainer.default_root_dir))
        logger.warning(
            f"{lightning_trainer.default_root_dir} holds Lightning's SLURM checkpoint(s) {', '.join(found)} (written "
            "by Lightning's own auto-requeue: a pickle, outside hflight's checkpoint manifest and checks). hflight "
            "never loads them: it continues from checkpoint-N folders only. Delete them once you no longer need them."
        )
    # Lightning's connector takes a checkpoint path the user set on the trainer (`trainer.ckpt_path = ...`) as it
    # is, without looking for hpc_ckpt files; hflight sets "none" that way (the setter itself treats None as unset).
    connector = getattr(lightning_trainer, "_checkpoint_connector", None)
    if connector is None or not hasattr(connector, "_user_managed"):  # a Lightning this was not written against
        raise RuntimeError(
            f"{lightning_trainer.default_root_dir} holds {', '.join(found)}, which this Lightning version would load "
            "under SLURM, and hflight cannot keep it from doing so: move the file(s) out of the run folder."
        )
    connector._ckpt_path, connector._user_managed = None, True


# ---- the process group's end -----------------------------------------------------------------------------------------
_END_REGISTERED: list[bool] = []


def end_process_group_at_exit() -> None:
    """Destroy the default process group when the process exits, if it is still there (once per process). Left to
    the interpreter's own teardown, torch 2.13's gloo group aborts the process in most runs ("terminate called
    without an active exception", SIGABRT: 15 of 25 two-process torchrun runs of a few all-reduces, none with the
    group destroyed first), which torchrun takes for a failed worker (and restarts)."""
    if not _END_REGISTERED:
        _END_REGISTERED.append(True)
        atexit.register(_destroy_process_group)


#: Seconds the exit gives gloo's worker threads to take the interpreter lock (see :func:`_destroy_process_group`).
_WORKERS_LET_GO = 0.05


def _destroy_process_group() -> None:
    """At exit: gloo's worker threads drop a finished collective's tensors themselves, and dropping a tensor that has a
    Python object takes the interpreter lock; a thread still waiting for it when the interpreter finalizes is ended
    mid-C++ and the process aborts ("terminate called without an active exception", seen with FSDP2 on gloo: 1 in 8
    runs, the last all-gather's work released by ``pt_gloo_runloop`` in ``take_gil``). A short sleep hands them the
    lock first; then the groups are destroyed."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        time.sleep(_WORKERS_LET_GO)
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - the process is exiting; say why and go on
            logger.debug(f"Could not destroy the process group at exit: {exc}")
        time.sleep(_WORKERS_LET_GO)


# ---- torch elastic: a process-group store per attempt ---------------------------------------------------------------
def _uses_agent_store() -> bool:
    return cluster.environment() == "torchelastic" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def init_elastic_process_group(strategy: Any) -> None:
    """Under torchrun with its shared store (see the module docstring), initialise the default process group on a
    store of this attempt's own before Lightning does; elsewhere, or when it exists already, nothing."""
    import torch
    import torch.distributed as dist

    world_size = cluster.ranks().world_size if _uses_agent_store() else 1
    if world_size <= 1 or not dist.is_available() or dist.is_initialized():
        return
    from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device

    launched = cluster.ranks()
    timeout = getattr(strategy, "_timeout", None) or datetime.timedelta(minutes=30)
    backend = getattr(strategy, "_process_group_backend", None)
    backend = backend or _get_default_process_group_backend_for_device(
        getattr(strategy, "root_device", None) or torch.device("cpu")
    )
    store = _attempt_store(launched.global_rank, world_size, timeout)
    logger.debug(f"Process group of this torchrun attempt: rank {launched.global_rank} of {world_size} ({backend})")
    dist.init_process_group(backend, store=store, rank=launched.global_rank, world_size=world_size, timeout=timeout)


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
