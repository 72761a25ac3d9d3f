"""A run spans every process the launcher started, or it does not start.

Under torchrun, ``srun`` or ``accelerate launch`` a strategy that spans fewer processes than were launched (one device
named under a two-process launch) would run N copies of a one-process job, each writing into the same folder;
:func:`check_spans_launch` refuses it before anything runs, naming both sizes.

May import: ``hflight.arguments`` (below the run).
"""

from __future__ import annotations

import os
from typing import Any

from hflight.arguments import cluster


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
    names = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "CROSS_SIZE", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE",
             "SLURM_NNODES")  # fmt: skip
    shown = [f"{name}={os.environ[name]}" for name in names if name in os.environ]
    return ", ".join(shown) if shown else "torch.distributed is initialised"
