"""Callbacks the HF Trainer lacks, and the weights protocol they use.

``ema.EMACallback`` (exponential moving average of the weights, evaluated and saved in their place); ``hooks``: the
weights protocol through which such a callback swaps the weights evaluation and saving use and writes and loads its
own checkpoint files, and the ``TrainerState`` every run starts from. (HF events are fired by
``hflight.run.events``.)

May import: ``hflight.checkpoints`` (safe file reading), ``hflight.surface``, ``hflight._util``.
"""

from hflight.callbacks.ema import EMACallback

__all__ = ["EMACallback"]
