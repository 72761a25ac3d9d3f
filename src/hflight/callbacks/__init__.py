"""Callbacks: the HF-event bridge (internal) and extras the HF Trainer lacks."""

from hflight.callbacks.ema import EMACallback

__all__ = ["EMACallback"]
