"""Mixed precision's autocast, scoped as accelerate scopes it for transformers' ``Trainer``: the model's forward only.

accelerate's ``prepare_model`` (which transformers' ``Trainer`` calls for training and for evaluation) replaces the
model's ``forward`` by one that runs the original under ``torch.autocast`` and converts the floating outputs that
are float16/bfloat16 to float32 (``convert_outputs_to_fp32``); ``compute_loss_context_manager`` adds nothing. So what
runs outside the model's forward (a ``compute_loss`` override's loss, TRL's losses, label smoothing, the backward
pass, clipping, the optimizer step) runs in float32. Lightning's ``MixedPrecision`` plugin instead autocasts every
step as a whole. Here:

- :class:`ForwardAutocast`: Lightning's ``MixedPrecision`` (gradient scaler, optimizer step, state) whose step
  contexts are empty; a run's plain ``MixedPrecision`` is replaced by it (:func:`use_forward_autocast`). Other
  plugins (DeepSpeed's, whose engine casts, the IPU's) stay as Lightning or the backend built them.
- :func:`autocast_forward`: for the span of a fit or an evaluation, the model's ``forward`` as accelerate makes it,
  then the model's own again (saving, pickling and the user's later calls see the model untouched). A backend whose
  ``hf_forward_autocast`` is False (FSDP2: accelerate shards it with a ``MixedPrecisionPolicy`` and wraps no
  forward) keeps its forward.
- fp16's gradient scaler as accelerate's: every optimizer's gradients are unscaled before they are measured,
  clipped or handed to ``on_pre_optimizer_step`` (:func:`unscale_gradients`), a fused optimizer's too (Lightning's
  ``MixedPrecision`` leaves those scaled for the optimizer's own step, so ``max_grad_norm`` clipped gradients still
  multiplied by the loss scale).
- :func:`wrap_forward`: the same patch kept on a model, as accelerate's ``prepare_model(evaluation_mode=True)`` keeps
  it (TRL's reference and reward models); :func:`unwrap_forward` removes it (``unwrap_model(keep_fp32_wrapper=False)``).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch.amp.grad_scaler import OptState

from hflight.run.backend import backend_of

__all__ = ["ForwardAutocast", "autocast_forward", "autocast_of", "unscale_gradients", "unwrap_forward",
           "use_forward_autocast", "wrap_forward"]  # fmt: skip

#: Lightning's mixed precision -> the autocast dtype
DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


class ForwardAutocast(MixedPrecision):
    """Lightning's ``MixedPrecision`` without a step-wide autocast: the training, validation, test and predict steps
    run outside autocast; the model's forward gets it (:func:`autocast_forward`)."""

    @classmethod
    def adopt(cls, plugin: Precision) -> Precision:
        """``plugin`` as a :class:`ForwardAutocast` when it is Lightning's own ``MixedPrecision``, else unchanged."""
        if type(plugin) is not MixedPrecision:
            return plugin
        return cls(plugin.precision, plugin.device, plugin.scaler)  # type: ignore[arg-type]

    def forward_context(self) -> contextlib.AbstractContextManager:  # type: ignore[override]
        return contextlib.nullcontext()

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.precision]

    def autocast(self, **kwargs: Any) -> torch.autocast:
        """accelerate's autocast of the run's precision (``kwargs``: ``torch.autocast``'s, e.g. ``enabled=False``)."""
        return torch.autocast(device_type=self.device, dtype=self.dtype, **kwargs)

    def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """Lightning's step with a gradient scaler, every optimizer unscaled before ``on_before_optimizer_step`` (where
        hflight clips and calls ``on_pre_optimizer_step``), as accelerate's ``clip_grad_norm_`` unscales before
        transformers clips; Lightning leaves a fused optimizer's gradients scaled. ``GradScaler.step`` then hands a
        fused optimizer no scale to divide by again, only whether the gradients overflowed."""
        if self.scaler is None or model.automatic_optimization:
            return super().optimizer_step(optimizer, model, closure, **kwargs)
        closure()  # manual optimization: the backward ran in the training step
        unscale_gradients(self.scaler, [optimizer])
        self._after_closure(model, optimizer)
        output = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return output


def unscale_gradients(scaler: torch.amp.GradScaler | None, optimizers: list[torch.optim.Optimizer]) -> None:
    """accelerate's ``unscale_gradients``: the gradients of each of ``optimizers``, fused or not, divided by the loss
    scale of ``scaler`` (None or disabled: no scaling) once per step: those already unscaled since the scaler's last
    ``update`` (by ``trainer.accelerator.clip_grad_norm_`` in the step) stay as they are."""
    if scaler is None or not scaler.is_enabled():
        return
    for optimizer in optimizers:
        if scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
            scaler.unscale_(optimizer)


def use_forward_autocast(lightning_trainer: Any) -> None:
    """The run's precision plugin, when it is Lightning's ``MixedPrecision``, replaced by :class:`ForwardAutocast`."""
    strategy = lightning_trainer.strategy
    strategy.precision_plugin = ForwardAutocast.adopt(strategy.precision_plugin)


def autocast_of(lightning_trainer: Any) -> ForwardAutocast | None:
    """The run's :class:`ForwardAutocast`, or None (full precision, or a plugin that casts by itself)."""
    plugin = lightning_trainer.precision_plugin
    return plugin if isinstance(plugin, ForwardAutocast) else None


class _AutocastForward:
    """A model's ``forward`` under ``torch.autocast``, its float16/bfloat16 outputs as float32 (accelerate's
    ``prepare_model``). Bound to the model as a method, so that a deep copy of the model calls its own forward."""

    __name__ = "forward"

    def __init__(self, model: torch.nn.Module, device_type: str, dtype: torch.dtype) -> None:
        self.device_type, self.dtype = device_type, dtype
        self.original = model.__dict__.get("forward")  # an instance forward the model had (called as it is)
        # what ``inspect.signature`` reads (transformers' unused-column removal), as accelerate's ``__wrapped__``
        wrapped = type(model).forward if self.original is None else getattr(self.original, "__func__", None)
        if wrapped is not None:
            self.__wrapped__ = wrapped

    def __call__(self, model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        from accelerate.utils.operations import convert_to_fp32

        with torch.autocast(device_type=self.device_type, dtype=self.dtype):
            outputs = (
                self.original(*args, **kwargs)
                if self.original is not None
                else type(model).forward(model, *args, **kwargs)
            )
        return convert_to_fp32(outputs)


def _patch(model: torch.nn.Module) -> _AutocastForward | None:
    forward = model.__dict__.get("forward")
    return forward.__func__ if isinstance(getattr(forward, "__func__", None), _AutocastForward) else None


def wrap_forward(model: torch.nn.Module, device_type: str, dtype: torch.dtype) -> bool:
    """``model.forward`` under autocast to ``dtype`` on ``device_type``, its outputs float32; False when it already
    was (the patch stays as it is)."""
    if _patch(model) is not None:
        return False
    model.__dict__["forward"] = types.MethodType(_AutocastForward(model, device_type, dtype), model)
    return True


def unwrap_forward(model: torch.nn.Module) -> None:
    """``model``'s forward as it was before :func:`wrap_forward`."""
    patch = _patch(model)
    if patch is None:
        return
    if patch.original is None:
        del model.__dict__["forward"]
    else:
        model.__dict__["forward"] = patch.original


@contextlib.contextmanager
def autocast_forward(model: torch.nn.Module, lightning_trainer: Any) -> Iterator[None]:
    """For the span of the block, ``model``'s forward autocast as accelerate's ``prepare_model`` makes it, when the
    run is mixed-precision and its backend autocasts the forward; a forward already patched stays as it is."""
    plugin = autocast_of(lightning_trainer)
    wrapped = False
    if plugin is not None and backend_of(lightning_trainer.strategy).hf_forward_autocast:
        wrapped = wrap_forward(model, plugin.device, plugin.dtype)
    try:
        yield
    finally:
        if wrapped:
            unwrap_forward(model)
