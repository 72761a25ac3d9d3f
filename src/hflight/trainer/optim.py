"""transformers' optimizer and scheduler surface of the ``Trainer``.

The factories (``optim`` names -> optimizer classes, parameter groups, schedulers) are ``hflight.arguments.optimizers``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hflight.arguments.optimizers import (
    build_scheduler,
    current_learning_rate,
    decay_parameter_names,
    grouped_parameters,
    optimizer_cls_and_kwargs,
)

__all__ = ["OptimizerMixin"]


class OptimizerMixin:
    """transformers' optimizer and scheduler surface of the ``Trainer``, over its public attributes (``args``,
    ``model``, ``optimizer``, ``lr_scheduler``, ``optimizer_cls_and_kwargs``).

    ``create_optimizer`` asks ``get_decay_parameter_names`` and ``get_optimizer_cls_and_kwargs`` through ``self``, as
    transformers does, so a subclass that overrides either changes the optimizer built.
    """

    # transformers binds these helpers to its Trainer the same way.
    from transformers.trainer_pt_utils import get_learning_rates, get_num_trainable_parameters, get_optimizer_group

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            opt_model = self.model if model is None else model
            decay = self.get_decay_parameter_names(opt_model)
            spec = self.optimizer_cls_and_kwargs
            if spec is None:
                spec = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
            optimizer_cls, kwargs = spec
            self.optimizer = optimizer_cls(grouped_parameters(opt_model, self.args.weight_decay, decay), **kwargs)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        if self.lr_scheduler is None:
            self.lr_scheduler = build_scheduler(self.args, optimizer or self.optimizer, num_training_steps)
        return self.lr_scheduler

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        self.create_optimizer()
        self.create_scheduler(num_training_steps=num_training_steps, optimizer=self.optimizer)

    def _get_learning_rate(self) -> float:
        return current_learning_rate(self.lr_scheduler, self.optimizer)

    def get_decay_parameter_names(self, model: nn.Module) -> list[str]:
        """The parameters that get weight decay: all but biases and normalisation weights (transformers' rule)."""
        return decay_parameter_names(model)

    @staticmethod
    def get_optimizer_cls_and_kwargs(args: Any, model: nn.Module | None = None) -> tuple[Any, Any]:
        """The optimizer class and keyword arguments ``args.optim`` names (see :data:`OPTIMIZERS`)."""
        return optimizer_cls_and_kwargs(args)
