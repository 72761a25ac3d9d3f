"""What hflight asks of HF callbacks besides their events: their exported state, and the weights protocol.

- A fresh ``TrainerState`` lists the callbacks that export state (``ExportableState``, e.g. ``EarlyStoppingCallback``)
  so that checkpoints carry it, as transformers does.
- The weights protocol: a callback that defines ``averaged_weights(model)`` (a context manager) decides which weights
  evaluation and saved models use, and ``save_checkpoint_state``/``check_checkpoint_state``/``load_checkpoint_state``
  let it keep files of its own in a checkpoint (``hflight.callbacks.ema.EMACallback`` does both).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

from torch import nn
from transformers.trainer_callback import ExportableState, TrainerControl, TrainerState

from hflight.surface import weight_hooks  # the protocol's discovery, below every package

__all__ = ["evaluation_weights", "new_trainer_state", "weight_hooks"]


def new_trainer_state(
    callbacks: Iterable[Any], control: TrainerControl, *, is_local_process_zero: bool, is_world_process_zero: bool
) -> TrainerState:
    """A ``TrainerState`` for a new run, listing the stateful ones of ``callbacks`` and ``control``."""
    stateful = [cb for cb in [*callbacks, control] if isinstance(cb, ExportableState)]
    return TrainerState(
        is_local_process_zero=is_local_process_zero,
        is_world_process_zero=is_world_process_zero,
        stateful_callbacks=stateful,
    )


def evaluation_weights(callbacks: Iterable[Any], model: nn.Module) -> contextlib.ExitStack:
    """A context in which ``model`` holds the weights evaluation and saved models use (moving averages when an EMA
    callback is attached; the raw weights come back afterwards)."""
    stack = contextlib.ExitStack()
    for callback in weight_hooks(callbacks, "averaged_weights"):
        stack.enter_context(callback.averaged_weights(model))
    return stack
