"""What users call and catch on checkpoints; the code lives in :mod:`hflight.checkpoints`. This import path stays."""

from hflight.checkpoints.files import IncompleteCheckpointError, UnsafeCheckpointFile
from hflight.checkpoints.folders import CheckpointWriteError  # noqa: F401
from hflight.checkpoints.manifest import get_last_checkpoint, verify_checkpoint
from hflight.checkpoints.optim_state import IncompatibleTrainingState  # noqa: F401
from hflight.checkpoints.writelock import OutputDirInUse  # noqa: F401

__all__ = [
    "CheckpointWriteError", "IncompatibleTrainingState", "IncompleteCheckpointError", "OutputDirInUse",
    "UnsafeCheckpointFile", "get_last_checkpoint", "verify_checkpoint",
]  # fmt: skip
