"""Which launcher started this process, as Lightning decides it: ranks, restarts, the job, SLURM's requeue signal.

A multi-process run is launched by torchrun (torch elastic; ``accelerate launch`` starts its processes with it), by
DeepSpeed's launcher (``deepspeed --num_gpus N script.py``), by ``srun`` (SLURM), by LSF's ``jsrun``, by MPI, by Ray
Train (the workers of a ``TorchTrainer``, connected by Ray: ``hflight.arguments.ray_train``), or by Lightning itself
(its subprocess launcher). Lightning picks its cluster environment in that order (torch elastic first: it can run
inside SLURM; DeepSpeed's launcher and Ray Train, which Lightning does not know, are given to it as environments of
their own: :func:`launcher_plugin`; Ray Train first of all, as its workers inherit the variables of the SLURM job or
Kubernetes pod that hosts the Ray cluster) and reads the ranks from the launcher's variables; :func:`environment`
makes the same choice, so that ``TrainingArguments.world_size``/``process_index``/``local_process_index`` (which
decide who writes checkpoints and takes the writer lock) agree with Lightning before Lightning exists, whatever
launched the process (``srun`` sets no ``WORLD_SIZE``/``RANK``).

Beside the ranks, what a restart needs:

- :func:`restart` says when a scheduler may have restarted this process (torchrun with ``--max-restarts`` >= 1,
  every attempt; ``SLURM_RESTART_COUNT`` >= 1 for a requeued job), so the command line continues from the last
  checkpoint without being told (``resume=auto``);
- :func:`job_identity` names the job a process belongs to (SLURM's job and array ids, torch elastic's run id, the
  rendezvous address of a Lightning launch), so that the writer lock can tell a rank of the same job from a
  competing run;
- :func:`parse_requeue_signal` checks ``TrainingArguments.requeue_signal`` (SIGUSR1 by default, as Lightning's
  ``SLURMEnvironment``) and :func:`slurm_plugin` gives Lightning its SLURM environment with its own auto-requeue
  switched off: under SLURM the requeue signal goes through hflight's checkpoints (``hflight.run.requeue``), never
  through Lightning's ``hpc_ckpt_*.ckpt``.

May import: nothing of hflight beyond this package (it is below the run, the facade and the checkpoints).
"""

from __future__ import annotations

import functools
import os
import signal
from dataclasses import dataclass
from typing import Any

from hflight.arguments import ray_train

__all__ = [
    "Layout",
    "Ranks",
    "environment",
    "job_identity",
    "deepspeed_launched",
    "launched_layout",
    "launched_world_size",
    "launcher_plugin",
    "parse_requeue_signal",
    "ranks",
    "restart",
    "slurm_detected",
    "slurm_job_id",
    "slurm_plugin",
]

#: Signals a requeue signal may not be: SIGINT is the user's stop, SIGKILL and SIGSTOP cannot be handled.
_RESERVED = ("SIGINT", "SIGKILL", "SIGSTOP")


@dataclass(frozen=True)
class Ranks:
    """The processes of a run as the launcher set them up (one process: ``Ranks(1, 0, 0, 0)``)."""

    world_size: int
    global_rank: int
    local_rank: int
    node_rank: int


def _torchelastic() -> bool:
    import torch.distributed

    return torch.distributed.is_available() and torch.distributed.is_torchelastic_launched()


def slurm_detected() -> bool:
    """SLURM launched this process as Lightning detects it: srun's ``SLURM_NTASKS`` is set and the job is not an
    interactive one (``SLURM_JOB_NAME`` ``bash`` or ``interactive``); torch elastic inside SLURM takes precedence."""
    from lightning.fabric.plugins.environments.slurm import _is_srun_used

    return _is_srun_used() and not _torchelastic()


#: what DeepSpeed's per-node launcher (``deepspeed.launcher.launch``, which the ``deepspeed`` command runs on each
#: node) sets beside torch's ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_*``: the node's rank, the nodes, and the
#: processes on this node (it also passes ``--local_rank=N`` to the script)
DEEPSPEED_LAUNCH_VARIABLES = ("CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE")


def deepspeed_launched() -> bool:
    """DeepSpeed's launcher started this process (not torchrun: ``accelerate launch`` runs DeepSpeed under torchrun)."""
    names = (*DEEPSPEED_LAUNCH_VARIABLES, "RANK", "LOCAL_RANK", "WORLD_SIZE")
    return all(name in os.environ for name in names) and not _torchelastic()


def environment() -> str:
    """The cluster environment Lightning will choose: ``ray`` (a Ray Train worker), ``torchelastic``, ``deepspeed``
    (DeepSpeed's launcher), ``slurm``, ``lsf``, ``mpi`` (Ray's and DeepSpeed's given to Lightning by
    :func:`launcher_plugin`), or ``lightning`` (no external launcher: Lightning launches the other processes itself,
    or there is one process)."""
    from lightning.fabric.plugins.environments import LSFEnvironment, MPIEnvironment

    if ray_train.worker() is not None:
        return "ray"
    if _torchelastic():
        return "torchelastic"
    if deepspeed_launched():
        return "deepspeed"
    if slurm_detected():
        return "slurm"
    if LSFEnvironment.detect():
        return "lsf"
    if "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ:  # an MPI launch (no mpi4py import here)
        if MPIEnvironment.detect():
            return "mpi"
    return "lightning"


def _int(name: str, default: int = 0) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value)
    except ValueError:
        return default


def ranks(num_nodes: int = 1) -> Ranks | None:
    """The ranks the external launcher set (None for Lightning's own launch or one process: those ranks come from
    ``WORLD_SIZE``/``RANK``/``LOCAL_RANK``/``NODE_RANK``, which Lightning sets for the processes it starts)."""
    ray = ray_train.worker()
    if ray is not None:
        return Ranks(ray.world_size, ray.global_rank, ray.local_rank, ray.node_rank)
    kind = environment()
    if kind == "torchelastic":
        return Ranks(_int("WORLD_SIZE", 1), _int("RANK"), _int("LOCAL_RANK"), _int("GROUP_RANK"))
    if kind == "deepspeed":
        return Ranks(_int("WORLD_SIZE", 1), _int("RANK"), _int("LOCAL_RANK"), _int("CROSS_RANK"))
    if kind == "slurm":
        return Ranks(_int("SLURM_NTASKS", 1), _int("SLURM_PROCID"), _int("SLURM_LOCALID"), _int("SLURM_NODEID"))
    if kind in ("lsf", "mpi"):
        from lightning.fabric.plugins.environments import LSFEnvironment, MPIEnvironment

        env = (LSFEnvironment if kind == "lsf" else MPIEnvironment)()
        return Ranks(env.world_size(), env.global_rank(), env.local_rank(), env.node_rank())
    return None


@dataclass(frozen=True)
class Layout:
    """How an external launcher spread its processes: ``devices`` processes on each of ``num_nodes`` nodes (the
    ``lightning.Trainer`` arguments that span exactly those processes)."""

    devices: int
    num_nodes: int


def launched_layout() -> Layout | None:
    """The processes per node and the nodes torchrun, DeepSpeed's launcher or srun started, when they started more
    than one process (None otherwise, and for Lightning's own launch, which reads ``devices``/``num_nodes`` instead of
    setting them).

    transformers' ``Trainer`` under torchrun trains data-parallel over every process the launcher started, with
    nothing named; Lightning does so only when ``devices`` x ``num_nodes`` equals that world, so hflight derives them
    from the launcher: torchrun's ``LOCAL_WORLD_SIZE`` and ``WORLD_SIZE``, DeepSpeed's ``LOCAL_SIZE`` and
    ``WORLD_SIZE``, srun's ``SLURM_NTASKS_PER_NODE`` (else ``SLURM_NTASKS`` / ``SLURM_NNODES``) and ``SLURM_NNODES``,
    Ray Train's context (the workers on this node, the world).
    """
    kind = environment()
    ray = ray_train.worker() if kind == "ray" else None
    if ray is not None:
        world, per_node = ray.world_size, ray.local_world_size
    elif kind in ("torchelastic", "deepspeed"):
        world = _int("WORLD_SIZE", 1)
        per_node = _int("LOCAL_WORLD_SIZE" if kind == "torchelastic" else "LOCAL_SIZE", world) or world
    elif kind == "slurm":
        world = _int("SLURM_NTASKS", 1)
        nodes = _int("SLURM_NNODES", 0) or _int("SLURM_JOB_NUM_NODES", 1) or 1
        per_node = _int("SLURM_NTASKS_PER_NODE", 0) or max(1, world // nodes)
    else:
        return None
    if world <= 1:
        return None
    return Layout(devices=per_node, num_nodes=max(1, world // max(1, per_node)))


def launched_world_size() -> int | None:
    """How many processes the external launcher started (torchrun, srun, LSF, MPI), or the size of a
    ``torch.distributed`` group this process already joined; None for one process or Lightning's own launch."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    launched = ranks()
    return launched.world_size if launched is not None else None


def restart() -> tuple[str, int] | None:
    """``(variable, count)`` when this process may continue a run its scheduler stopped: under torchrun with
    ``--max-restarts`` >= 1 (``TORCHELASTIC_MAX_RESTARTS``; every attempt, the first included: torch elastic's
    ``TORCHELASTIC_RESTART_COUNT`` is counted by each node's agent and differs between the nodes of one restart, and
    the ranks must agree), or a requeued SLURM job (``SLURM_RESTART_COUNT`` >= 1, the same for every task). None
    otherwise."""
    if environment() == "torchelastic" and _int("TORCHELASTIC_MAX_RESTARTS") >= 1:
        return "TORCHELASTIC_MAX_RESTARTS", _int("TORCHELASTIC_MAX_RESTARTS")
    count = _int("SLURM_RESTART_COUNT")
    if count >= 1:
        return "SLURM_RESTART_COUNT", count
    return None


def slurm_job_id() -> str | None:
    """The id ``scontrol requeue`` takes: ``$SLURM_JOB_ID``, or ``${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}``
    for a task of an array job (None outside SLURM)."""
    array_job, array_task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and array_task:
        return f"{array_job}_{array_task}"
    return os.environ.get("SLURM_JOB_ID") or None


def job_identity() -> str | None:
    """A name shared by every process of this job and by no other run: SLURM's job (and step), torch elastic's run
    id with its rendezvous address, or the rendezvous address Lightning's launcher gave its processes; None for a
    single process."""
    kind = environment()
    if kind == "ray":  # the address is worker 0's, the port a free one Ray picked for this start of the workers
        address = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        return f"ray train {getattr(ray_train.worker(), 'experiment', '?')} at {address}"
    if kind == "slurm":
        step = os.environ.get("SLURM_STEP_ID")
        return f"slurm job {slurm_job_id()}" + (f" step {step}" if step else "")
    if kind == "torchelastic":
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "?")
        return f"torchrun {run_id} at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    if kind == "deepspeed":
        return f"deepspeed launch at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    if kind in ("lsf", "mpi"):
        return f"{kind} job {os.environ.get('LSB_JOBID') or os.environ.get('OMPI_MCA_ess_base_jobid', '?')}"
    if _int("WORLD_SIZE", 1) > 1 and "MASTER_PORT" in os.environ:
        return f"lightning launch at {os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ['MASTER_PORT']}"
    return None


def parse_requeue_signal(value: Any) -> signal.Signals | None:
    """``requeue_signal`` as a signal: a name (``"SIGUSR1"``, ``"USR1"``, any case), a number, or None/"none" for
    no requeue handling.

    Raises:
        ValueError: an unknown signal, or one that cannot be the requeue signal (SIGINT, SIGKILL, SIGSTOP).
    """
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null")):
        return None
    try:
        if isinstance(value, signal.Signals):
            found = value
        elif isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit()):
            found = signal.Signals(int(value))
        else:
            name = str(value).strip().upper()
            found = signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
    except (KeyError, ValueError):
        raise ValueError(
            f"requeue_signal={value!r} is not a signal of this system; use a name such as 'SIGUSR1' (the signal of "
            "#SBATCH --signal=USR1@90), or None for no requeue handling"
        ) from None
    if found.name in _RESERVED:
        raise ValueError(f"requeue_signal={value!r}: {found.name} cannot be the requeue signal; use SIGUSR1 or SIGUSR2")
    return found


def slurm_plugin(requeue_signal: Any) -> Any:
    """Lightning's ``SLURMEnvironment`` with its auto-requeue off (no ``hpc_ckpt_*.ckpt``, no SIGUSR1 handler of
    Lightning's: hflight handles ``requeue_signal``), when SLURM launched this process; else None (Lightning's own
    choice of environment stands)."""
    if not slurm_detected():
        return None
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return SLURMEnvironment(auto_requeue=False, requeue_signal=parse_requeue_signal(requeue_signal) or signal.SIGUSR1)


def launcher_plugin(requeue_signal: Any) -> Any:
    """The cluster environment Lightning is given for the launcher that started this process, where its own choice
    would be wrong: SLURM's with hflight's requeue (:func:`slurm_plugin`); for DeepSpeed's launcher, Lightning's
    environment for processes started outside it with the node's rank from ``CROSS_RANK`` (Lightning reads
    ``NODE_RANK``, which DeepSpeed does not set); for a Ray Train worker, the ranks of Ray's context
    (``hflight.arguments.ray_train``). None: Lightning's own choice stands."""
    if ray_train.worker() is not None:
        return ray_train.lightning_environment()
    if deepspeed_launched():
        return _deepspeed_environment()()
    return slurm_plugin(requeue_signal)


@functools.cache
def _deepspeed_environment() -> type:
    from lightning.fabric.plugins.environments import LightningEnvironment

    class DeepSpeedLauncherEnvironment(LightningEnvironment):
        """Processes started by DeepSpeed's launcher: ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``MASTER_*`` as torch's,
        the node's rank in ``CROSS_RANK``."""

        @staticmethod
        def detect() -> bool:
            return deepspeed_launched()

        def node_rank(self) -> int:
            return _int("CROSS_RANK")

        def teardown(self) -> None:
            """Nothing: the launcher's variables are not Lightning's to remove (Lightning's environment drops
            ``WORLD_SIZE``, and the next run of the script, an ``evaluate()`` after ``train()``, must see it)."""

    return DeepSpeedLauncherEnvironment
