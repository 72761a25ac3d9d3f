"""``Trainer.accelerator`` for code written against transformers' ``Trainer``, answered by the Lightning run.

transformers' ``Trainer`` keeps an ``accelerate.Accelerator`` in ``self.accelerator``, and subclasses call it:
``self.accelerator.backward(loss)`` in a custom ``training_step``, ``gather_for_metrics`` in an evaluation loop,
``is_main_process`` before writing a file, ``unwrap_model`` before saving. hflight has no accelerate state (Lightning
owns devices, processes and precision), so :class:`RunAccelerator` offers that part of accelerate's API and routes each
call to the run in progress: backward through the ``LightningModule`` (precision scaling, strategy hooks), collectives
through the run's :class:`~hflight.run.distributed.World`, autocast through Lightning's precision plugin. Outside a run
it answers for a single process on ``args.device``. The rest of accelerate's API is not there (an ``AttributeError``
names it); docs/coming-from-transformers.md lists what is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from hflight.arguments import process_group
from hflight.run.distributed import World
from hflight.surface import RunView


class RunAccelerator:
    """accelerate's ``Accelerator`` surface that transformers ``Trainer`` subclasses use, on hflight's runs.

    Args:
        current_run: returns the run in progress (or the last one), None before any.
        args: the trainer's ``TrainingArguments`` (device and ranks before any run).
    """

    def __init__(self, current_run: Callable[[], RunView | None], args: Any) -> None:
        self._current_run = current_run
        self._args = args

    @property
    def world(self) -> World:
        """hflight's own: the processes of the run in progress (or the last one); before any run, those the arguments
        describe. The facade's ranks and collectives come from here."""
        run = self._current_run()
        return run.world if run is not None else World(args=self._args)

    # ---- processes and device ----------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        run = self._current_run()
        return run.module.device if run is not None else self._args.device

    @property
    def num_processes(self) -> int:
        return self.world.size

    @property
    def process_index(self) -> int:
        return self.world.rank

    @property
    def local_process_index(self) -> int:
        return self._args.local_process_index

    @property
    def is_main_process(self) -> bool:
        return self.world.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    def wait_for_everyone(self) -> None:
        self.world.barrier()

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.is_local_main_process:
            print(*args, **kwargs)

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        with self._args.main_process_first(local=False):
            yield

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        with self._args.main_process_first(local=True):
            yield

    # ---- the step ----------------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backward through the run's LightningModule (its precision plugin scales the loss, its strategy syncs)."""
        run = self._current_run()
        if run is None or not run.fitting:
            raise RuntimeError("accelerator.backward() is only available while Trainer.train() runs.")
        # outside autocast, as transformers' backward (accelerate autocasts the model's forward only): Lightning's
        # precision context spans the whole training_step, and the autograd engine takes the caller's autocast state
        # into the backward pass, where it would recast fp32 gradients to bf16/fp16
        with torch.autocast(device_type=loss.device.type, enabled=False):
            run.module.manual_backward(loss, **kwargs)

    def autocast(self, autocast_handler: Any = None) -> contextlib.AbstractContextManager:
        """Lightning's precision context of the run (autocast under mixed precision); empty outside a run."""
        run = self._current_run()
        if run is None:
            return contextlib.nullcontext()
        return run.lightning_trainer.precision_plugin.forward_context()

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def unwrap_model(
        self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True
    ) -> nn.Module:
        """``model`` without the wrappers a strategy or ``torch.compile`` put around it."""
        while True:
            if hasattr(model, "_orig_mod") and not keep_torch_compile:
                model = model._orig_mod
            elif isinstance(getattr(model, "module", None), nn.Module):
                model = model.module
            else:
                return model

    # ---- collectives -------------------------------------------------------------------------------------------
    def gather(self, tensor: Any) -> Any:
        return self.world.gather(tensor)

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Every process's values concatenated along the first dimension (hflight's evaluation loop cuts the
        repeated samples of the last batch itself, after gathering)."""
        if use_gather_object:
            return self.world.gather_objects(input_data)
        return self.world.gather(input_data)

    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        if pad_first:
            raise NotImplementedError("pad_across_processes(pad_first=True) is not available in hflight.")
        return self.world.pad_across_processes(tensor, dim=dim, pad_index=pad_index)

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum", scale: float = 1.0) -> torch.Tensor:
        if reduction not in ("sum", "mean"):
            raise ValueError(f"reduce: reduction must be 'sum' or 'mean', got {reduction!r}")
        reduced = self.world.reduce_sum(tensor) if reduction == "sum" else self.world.reduce_mean(tensor)
        return reduced * scale if scale != 1.0 else reduced

    def end_training(self) -> None:
        """Finish the run's loggers and end the process group (accelerate's ``end_training``), as hflight ends it at
        exit (``hflight.arguments.process_group.end``)."""
        run = self._current_run()
        if run is not None:
            for logger in run.lightning_trainer.loggers:
                logger.finalize("success")
        process_group.end()
