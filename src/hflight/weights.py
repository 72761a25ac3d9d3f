"""Moved to :mod:`hflight.checkpoints.weights`; this import path stays."""

from hflight.checkpoints.weights import UnsafeCheckpointFile, checked_weights, load_model_weights  # noqa: F401

__all__ = ["UnsafeCheckpointFile", "checked_weights", "load_model_weights"]
