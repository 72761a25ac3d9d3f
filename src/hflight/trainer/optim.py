"""transformers' optimizer and scheduler surface of the ``Trainer``.

The factories (``optim`` names -> optimizer classes, parameter groups, schedulers) are ``hflight.arguments.optimizers``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.trainer import Trainer as HFTrainer

from hflight.arguments.optimizers import (
    build_scheduler,
    current_learning_rate,
    decay_parameter_names,
    optimizer_cls_and_kwargs,
)

__all__ = ["OptimizerMixin"]


class OptimizerMixin:
    """transformers' optimizer and scheduler surface of the ``Trainer``, over its public attributes (``args``,
    ``model``, ``optimizer``, ``lr_scheduler``, ``optimizer_cls_and_kwargs``).

    ``create_optimizer`` is transformers' own, run on this trainer: it asks ``get_decay_parameter_names`` and
    ``get_optimizer_cls_and_kwargs`` through ``self``, so a subclass that overrides either changes the optimizer built,
    and what transformers does around the class it gets (GaLore/APOLLO's own parameter groups, LOMO's model, the
    layer-wise optimizers' dictionary, optimizer factories, bitsandbytes' 32-bit embeddings) is done as there.
    """

    # transformers binds these helpers to its Trainer the same way.
    from transformers.trainer_pt_utils import get_learning_rates, get_num_trainable_parameters, get_optimizer_group

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        return HFTrainer.create_optimizer(self, model)

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
        """The optimizer class and keyword arguments ``args.optim`` names: transformers' (``model``: needed by
        GaLore, APOLLO and LOMO), or a backend's registered optimizer (``hflight.arguments.optimizers``)."""
        return optimizer_cls_and_kwargs(args, model)
