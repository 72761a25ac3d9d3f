"""Device memory as ``TrainingArguments`` manage it: ``auto_find_batch_size`` and ``torch_empty_cache_steps``.

``auto_find_batch_size``: transformers wraps its inner training loop in accelerate's ``find_executable_batch_size``,
which, on an out-of-memory error, frees the device cache and retries with 90% of the batch size (rounded down) until
one fits or the size reaches zero. hflight wraps one ``train()`` run (a fresh Lightning run each time) the same way,
starting from ``args.train_batch_size`` (or the size a resumed checkpoint recorded).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import TypeVar

import torch
from transformers.trainer_utils import TrainerMemoryTracker

from hflight._util import exception_chain

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Messages by which allocators report that memory ran out (CUDA/HIP/XPU, MPS, cuDNN, the CPU allocator, HPU): the
#: ones accelerate's ``should_reduce_batch_size`` recognises (accelerate is not a dependency of hflight).
OUT_OF_MEMORY_MESSAGES = (
    " out of memory.",
    "MPS backend out of memory",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
    "DefaultCPUAllocator: can't allocate memory",
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",
)
#: Each retry after an out-of-memory error uses this share of the batch size (rounded down), as accelerate's.
REDUCTION = 0.9


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) says that device or host memory ran out."""
    return any(
        isinstance(e, RuntimeError)
        and len(e.args) == 1
        and isinstance(e.args[0], str)
        and any(message in e.args[0] for message in OUT_OF_MEMORY_MESSAGES)
        for e in exception_chain(error)
    )


def empty_device_cache() -> None:
    """Return the device allocator's cached blocks (``torch_empty_cache_steps``; a no-op on the CPU)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    if torch.backends.mps.is_available():
        torch.mps.empty_cache()
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        torch.xpu.empty_cache()


def release_memory() -> None:
    """Free what the failed attempt left behind before the next one."""
    gc.collect()
    empty_device_cache()


def find_executable_batch_size(run: Callable[[int], T], batch_size: int, enabled: bool) -> T:
    """``run(batch_size)``; when ``enabled``, an out-of-memory error retries it with 90% of the batch size.

    Raises:
        RuntimeError: the batch size reached zero without a run that fits in memory.
    """
    if not enabled:
        return run(batch_size)
    while True:
        if batch_size == 0:
            raise RuntimeError("No executable batch size found, reached zero.")
        try:
            return run(batch_size)
        except Exception as error:  # noqa: BLE001 - only out-of-memory errors are retried
            if not is_out_of_memory(error):
                raise
            smaller = int(batch_size * REDUCTION)
            logger.warning(f"Out of memory with a training batch size of {batch_size}; trying {smaller}.")
            batch_size = smaller
            release_memory()


class MemoryTracker(TrainerMemoryTracker):
    """``skip_memory_metrics=False``: transformers' own tracker (process RSS, and device memory where there is a
    device), told its stage by the facade instead of deriving it from the caller's function name (hflight's stages
    end in functions transformers' table does not know). Same metric names: ``init_mem_cpu_alloc_delta``,
    ``train_mem_cpu_peaked_delta``, ``before_init_mem_cpu``, ...; an evaluation inside ``train()`` is not measured
    on its own, as in transformers."""

    stage = "init"

    def derive_stage(self) -> str:
        return self.stage

    def start_stage(self, stage: str) -> None:
        self.stage = stage
        self.start()

    def stop_stage(self, stage: str, metrics: dict[str, float] | None = None) -> None:
        self.stage = stage
        self.stop_and_update_metrics(metrics)
