"""SLURM's requeue, through hflight's checkpoints.

Once every rank has stopped at the same step boundary and the checkpoint is complete (``hflight.run.loop``), global
rank 0 runs ``scontrol requeue <job id>`` (``$SLURM_JOB_ID``, or ``${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}`` for an
array task), once, and tells the other ranks how it went. A failed ``scontrol`` is reported; the checkpoint stays
either way.

May import: ``hflight.arguments`` (below the run).
"""

from __future__ import annotations

import logging
import subprocess
from dataclasses import dataclass
from typing import Any

from hflight.arguments import cluster

logger = logging.getLogger(__name__)

#: Seconds ``scontrol requeue`` may take before it counts as failed.
SCONTROL_TIMEOUT = 60.0


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
