"""How long a run is: transformers' ``set_initial_training_values`` as a pure, table-tested function."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

from hflight.run.backend import StepGeometry, backend_of

#: ``num_train_epochs`` of a run that only ``max_steps`` bounds (as transformers: ``sys.maxsize``).
UNBOUNDED = sys.maxsize


@dataclass(frozen=True)
class TrainingPlan:
    """The numbers HF derives before its first step; ``steps_in_epoch`` is micro-batches per epoch."""

    num_train_epochs: int
    num_update_steps_per_epoch: int
    num_examples: int
    num_train_samples: float
    total_train_batch_size: int
    steps_in_epoch: int
    max_steps: int
    accumulation: int = 1  # loader batches per optimizer step

    @property
    def unbounded(self) -> bool:
        """No epoch count: an iterable dataset, which ``max_steps`` ends (``num_train_epochs`` is :data:`UNBOUNDED`)."""
        return self.num_train_epochs == UNBOUNDED

    def resume_position(self, global_step: int, ignore_data_skip: bool = False) -> tuple[int, int]:
        """(epochs already trained, micro-batches to skip in the current epoch) for a run resumed at
        ``global_step``, as HF computes them."""
        epochs_trained = global_step // self.num_update_steps_per_epoch
        if ignore_data_skip:
            return epochs_trained, 0
        return epochs_trained, (global_step % self.num_update_steps_per_epoch) * self.accumulation


def plan_training(
    args: Any,
    len_dataloader: int | None,
    num_examples: int | None,
    world_size: int = 1,
    geometry: StepGeometry | None = None,
) -> TrainingPlan:
    """Epochs, steps and sample counts for ``args`` over a loader of ``len_dataloader`` micro-batches.

    ``geometry`` says how many loader batches make an optimizer step and how many samples that step consumes;
    by default ``gradient_accumulation_steps`` batches of ``per_device_train_batch_size`` on each of ``world_size``
    processes (a backend that accumulates on its device passes its own, see ``hflight.run.backend``).

    Example:
        >>> from types import SimpleNamespace
        >>> a = SimpleNamespace(max_steps=-1, num_train_epochs=2.0, gradient_accumulation_steps=2,
        ...                     per_device_train_batch_size=4)
        >>> plan_training(a, len_dataloader=5, num_examples=20).max_steps
        6
    """
    if geometry is None:
        # eager: accumulation on the host
        geometry = backend_of(None).hf_geometry(args, world_size, args.per_device_train_batch_size)
    if len_dataloader == 0:
        raise ValueError(
            "The training dataloader is empty: the train_dataset has no examples (or fewer than one batch with "
            "dataloader_drop_last=True). Pass a non-empty train_dataset."
        )
    if len_dataloader is not None:
        return _plan_sized(args, len_dataloader, num_examples, geometry)
    if args.max_steps > 0:
        return _plan_unsized(args, geometry)
    raise ValueError(
        "args.max_steps must be set to a positive value if the training dataloader does not have a length "
        f"(an IterableDataset), was {args.max_steps}"
    )


def _plan_sized(args: Any, len_dataloader: int, num_examples: int | None, geometry: StepGeometry) -> TrainingPlan:
    """A loader with a length: ``max_steps`` (when positive) or ``num_train_epochs`` decides the run's length."""
    accumulation, total_train_batch_size = geometry.accumulation, geometry.samples_per_step
    steps_per_epoch = max(len_dataloader // accumulation + int(len_dataloader % accumulation > 0), 1)
    # As transformers 5: only a negative max_steps means "use num_train_epochs". max_steps=0 plans the epochs, but
    # the run's max_steps is 0, so DefaultFlowCallback stops training after its first optimizer step.
    max_steps = args.max_steps if args.max_steps >= 0 else math.ceil(args.num_train_epochs * steps_per_epoch)
    if args.max_steps > 0:
        num_train_epochs = max_steps // steps_per_epoch + int(max_steps % steps_per_epoch > 0)
        num_train_samples: float = max_steps * total_train_batch_size
    else:
        num_train_epochs = math.ceil(args.num_train_epochs)
        num_train_samples = num_examples * args.num_train_epochs
    return TrainingPlan(
        num_train_epochs,
        steps_per_epoch,
        num_examples,
        num_train_samples,
        total_train_batch_size,
        len_dataloader,
        max_steps,
        accumulation,
    )


def _plan_unsized(args: Any, geometry: StepGeometry) -> TrainingPlan:
    """An iterable dataset without a length: ``max_steps`` steps in one unbounded "epoch"."""
    accumulation, total_train_batch_size = geometry.accumulation, geometry.samples_per_step
    return TrainingPlan(
        num_train_epochs=UNBOUNDED,
        num_update_steps_per_epoch=args.max_steps,
        num_examples=total_train_batch_size * args.max_steps,
        num_train_samples=args.max_steps * total_train_batch_size,
        total_train_batch_size=total_train_batch_size,
        steps_in_epoch=args.max_steps * accumulation,
        max_steps=args.max_steps,
        accumulation=accumulation,
    )
