"""Moved to :mod:`hflight.checkpoints.weights`; this import path stays."""

from hflight.checkpoints.files import UnsafeCheckpointFile
from hflight.checkpoints.weights import checked_weights, load_model_weights

__all__ = ["UnsafeCheckpointFile", "checked_weights", "load_model_weights"]
