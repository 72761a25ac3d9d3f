"""Lightning's own fallbacks for a cluster's moments, kept off: its SLURM checkpoints are never restored.

Lightning, under SLURM, restores the newest ``hpc_ckpt_*.ckpt`` of its ``default_root_dir`` (the output folder) whenever
``fit``/``validate`` gets no checkpoint path: a pickle written by its own auto-requeue, outside hflight's manifest and
checks, which would silently replace the weights (seen: a requeued job that started at epoch 8.1). hflight writes none
(``SLURMEnvironment(auto_requeue=False)``, ``hflight.arguments.cluster.slurm_plugin``), never loads one
(:func:`no_lightning_hpc_restore`), and names any it finds.

May import: nothing of hflight.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: Lightning's file names for its SLURM checkpoints (``hpc_ckpt_<n>.ckpt`` in ``default_root_dir``).
HPC_CHECKPOINT_RE = re.compile(r"^hpc_ckpt_\d+\.ckpt$")


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
