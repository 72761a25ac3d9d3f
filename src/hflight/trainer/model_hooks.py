"""Model hooks that ``TrainingArguments`` switch on for the length of ``train()``, as transformers installs them.

- ``debug="underflow_overflow"``: transformers' ``DebugUnderflowOverflow`` watches every module's activations and
  weights for inf/nan and reports the frames that led there (installed once, as transformers does: it stays on the
  model).
- ``neftune_noise_alpha``: NEFTune noise on the input embeddings while training (transformers' own forward hook),
  removed when ``train()`` returns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn
from transformers.debug_utils import DebugOption, DebugUnderflowOverflow
from transformers.integrations.neftune import activate_neftune, deactivate_neftune


@contextlib.contextmanager
def installed(model: nn.Module, args: Any) -> Iterator[None]:
    """The hooks ``args`` asks for on ``model`` while the body runs (``train()``)."""
    if DebugOption.UNDERFLOW_OVERFLOW in args.debug and not getattr(model, "_hflight_debug_overflow", False):
        DebugUnderflowOverflow(model)
        model._hflight_debug_overflow = True  # a second train() must not stack a second detector
    handle = activate_neftune(model, args.neftune_noise_alpha) if args.neftune_noise_alpha is not None else None
    try:
        yield
    finally:
        if handle is not None:
            deactivate_neftune(model, handle)
