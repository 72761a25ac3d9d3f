"""``IPUPrecision``: precision on the IPU, where poptorch runs forward, backward and the optimizer step in one call.

There is no host backward, no host optimizer step and no host gradient clipping: the plugin halves the model on
the host for the 16-bit modes (poptorch then compiles it in float16) and tells the poptorch optimizer which dtypes
to accumulate in.

| precision | weights and activations | gradient accumulation, first / second moments |
|---|---|---|
| ``32-true`` | float32 | float32 |
| ``16-true`` | float16 | float16, float16 / float32 (optimum-graphcore's default, ``fp32=False``) |
| ``16-mixed`` | float16 | float32, float32 / float32 |
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from typing_extensions import override

# precision -> (model dtype, accum_type, first_order_momentum_accum_type, second_order_momentum_accum_type)
_DTYPES: dict[str, tuple[torch.dtype, torch.dtype, torch.dtype, torch.dtype]] = {
    "32-true": (torch.float32, torch.float32, torch.float32, torch.float32),
    "16-true": (torch.float16, torch.float16, torch.float16, torch.float32),
    "16-mixed": (torch.float16, torch.float32, torch.float32, torch.float32),
}


class IPUPrecision(Precision):
    """Precision for :class:`~hflight.ipu.IPUStrategy`: ``"32-true"``, ``"16-true"`` or ``"16-mixed"``."""

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in _DTYPES:
            raise ValueError(
                f"IPUPrecision: precision={precision!r} is not supported on the IPU; "
                f"choose one of {', '.join(_DTYPES)}."
            )
        self.precision = precision

    @classmethod
    def adopt(cls, plugin: Precision) -> IPUPrecision:
        """The IPU counterpart of a Lightning precision plugin (Lightning builds one from ``precision=``)."""
        if isinstance(plugin, IPUPrecision):
            return plugin
        return cls(str(getattr(plugin, "precision", "32-true")))

    @property
    def model_dtype(self) -> torch.dtype:
        return _DTYPES[self.precision][0]

    def optimizer_dtypes(self) -> dict[str, torch.dtype]:
        """Keyword arguments for a poptorch optimizer: the dtypes it accumulates gradients and moments in."""
        _, accum, first, second = _DTYPES[self.precision]
        return {
            "accum_type": accum,
            "first_order_momentum_accum_type": first,
            "second_order_momentum_accum_type": second,
        }

    @override
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.to(self.model_dtype) if self.model_dtype != torch.float32 else module

    @override
    def convert_input(self, data: Any) -> Any:
        if self.model_dtype == torch.float32:
            return data
        from lightning.fabric.utilities.apply_func import apply_to_collection

        return apply_to_collection(
            data, torch.Tensor, lambda t: t.to(self.model_dtype) if torch.is_floating_point(t) else t
        )

    @override
    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        """Nothing to do: the device ran the backward pass inside the training call."""

    @override
    def optimizer_step(self, optimizer: Any, model: Any, closure: Any, **kwargs: Any) -> Any:
        raise MisconfigurationException(
            "On the IPU the optimizer step runs on the device, inside the poptorch training call; a host "
            "optimizer.step() must not be called."
        )

    @override
    def clip_gradients(self, *args: Any, **kwargs: Any) -> None:
        raise MisconfigurationException(
            "On the IPU gradients are clipped on the device: set max_grad_norm on the poptorch optimizer "
            "(hflight maps TrainingArguments.max_grad_norm to it)."
        )
