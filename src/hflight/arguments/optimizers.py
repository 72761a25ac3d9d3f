"""Optimizer and scheduler factories: HF optimizer names as a lookup table.

The table maps an ``optim`` name of ``TrainingArguments`` to a function that returns the optimizer class and
its keyword arguments, the same pairs transformers' ``Trainer.get_optimizer_cls_and_kwargs`` returns. Parameter
grouping (no weight decay on biases and normalisation weights) and scheduling (``transformers.get_scheduler``,
stepped once per optimizer step) follow transformers exactly, so losses and learning rates agree step for step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import get_scheduler
from transformers.trainer_pt_utils import get_parameter_names

#: The arguments these factories read: ``hflight.TrainingArguments`` or any object with transformers' optimizer
#: fields (``optim``, ``learning_rate``, ``adam_*``, ``weight_decay``, ``optim_args``, ``lr_scheduler_*``, ...).
#: Typed loosely because ``training_args`` looks up ``optim`` names here (an import the other way would be circular).
TrainingArguments = Any

OptimizerSpec = tuple[type[torch.optim.Optimizer], dict[str, Any]]

# Same name patterns transformers uses to keep biases and norm weights out of weight decay.
_NO_DECAY_PATTERNS = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]


def _parse_optim_args(optim_args: str | None) -> dict[str, str]:
    """``"momentum=0.9,nesterov=true"`` -> ``{"momentum": "0.9", "nesterov": "true"}`` (HF's ``optim_args``)."""
    if not optim_args:
        return {}
    parsed = {}
    for item in optim_args.replace(" ", "").split(","):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"optim_args must be 'key=value' pairs separated by commas, got {optim_args!r}")
        parsed[key] = value
    return parsed


def _with_optim_args(
    base: dict[str, Any], optim_args: str | None, floats: tuple[str, ...], flags: tuple[str, ...] = ()
):
    extra = _parse_optim_args(optim_args)
    kwargs = dict(base)
    kwargs.update({k: float(v) for k, v in extra.items() if k in floats})
    kwargs.update({k: v.lower() in ("true", "1", "yes") for k, v in extra.items() if k in flags})
    return kwargs


def _adam_kwargs(args: TrainingArguments) -> dict[str, Any]:
    return {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon}


def _adamw_torch(args: TrainingArguments) -> OptimizerSpec:
    return torch.optim.AdamW, _adam_kwargs(args)


def _adamw_torch_fused(args: TrainingArguments) -> OptimizerSpec:
    return torch.optim.AdamW, {**_adam_kwargs(args), "fused": True}


def _adafactor(args: TrainingArguments) -> OptimizerSpec:
    from transformers.optimization import Adafactor

    return Adafactor, {"lr": args.learning_rate, "scale_parameter": False, "relative_step": False}


def _sgd(args: TrainingArguments) -> OptimizerSpec:
    kwargs = _with_optim_args(
        {"lr": args.learning_rate}, args.optim_args, ("momentum", "dampening", "weight_decay"), ("nesterov",)
    )
    return torch.optim.SGD, kwargs


def _adagrad(args: TrainingArguments) -> OptimizerSpec:
    return torch.optim.Adagrad, _with_optim_args(
        {"lr": args.learning_rate}, args.optim_args, ("lr_decay", "weight_decay", "eps")
    )


def _rmsprop(args: TrainingArguments) -> OptimizerSpec:
    kwargs = _with_optim_args(
        {"lr": args.learning_rate}, args.optim_args, ("momentum", "alpha", "eps", "weight_decay"), ("centered",)
    )
    return torch.optim.RMSprop, kwargs


OPTIMIZERS: dict[str, Callable[[TrainingArguments], OptimizerSpec]] = {
    "adamw_torch": _adamw_torch,
    "adamw_torch_fused": _adamw_torch_fused,
    "adafactor": _adafactor,
    "sgd": _sgd,
    "adagrad": _adagrad,
    "rmsprop": _rmsprop,
}


def optimizer_cls_and_kwargs(args: TrainingArguments) -> OptimizerSpec:
    """The optimizer class and keyword arguments that ``args.optim`` names."""
    name = getattr(args.optim, "value", args.optim)
    try:
        factory = OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"Unsupported optim {name!r}; hflight supports: {', '.join(OPTIMIZERS)}") from None
    return factory(args)


def decay_parameter_names(model: nn.Module) -> list[str]:
    """Names of the parameters that get weight decay: all but biases and normalisation weights (as HF)."""
    return get_parameter_names(model, [nn.LayerNorm], _NO_DECAY_PATTERNS)


def grouped_parameters(
    model: nn.Module, weight_decay: float, decay_names: list[str] | None = None
) -> list[dict[str, Any]]:
    """Two parameter groups, with and without weight decay, over the trainable parameters; ``decay_names``: the
    parameters that decay (default: :func:`decay_parameter_names`)."""
    decay = set(decay_parameter_names(model) if decay_names is None else decay_names)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]


def build_scheduler(
    args: TrainingArguments, optimizer: torch.optim.Optimizer, num_training_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """``transformers.get_scheduler`` with the warmup and kwargs of ``args``; stepped once per optimizer step."""
    return get_scheduler(
        getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type),
        optimizer=optimizer,
        num_warmup_steps=args.get_warmup_steps(num_training_steps),
        num_training_steps=num_training_steps,
        scheduler_specific_kwargs=args.lr_scheduler_kwargs or {},
    )


def current_learning_rate(scheduler: Any, optimizer: torch.optim.Optimizer) -> float:
    """The learning rate of the first parameter group, as HF logs it."""
    if scheduler is None or isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        lr = optimizer.param_groups[0]["lr"]
    else:
        lr = scheduler.get_last_lr()[0]
    return lr.item() if torch.is_tensor(lr) else float(lr)


__all__ = [
    "OPTIMIZERS",
    "build_scheduler",
    "current_learning_rate",
    "decay_parameter_names",
    "grouped_parameters",
    "optimizer_cls_and_kwargs",
]
