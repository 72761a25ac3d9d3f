"""Fixed-shape batches for compiled IPU executables."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch


def _repeat_rows(value: Any, batch_size: int) -> Any:
    """``value`` (a tensor) with ``batch_size`` rows: its first rows repeated after its own (other values as they
    are)."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.size(0) == batch_size:
        return value
    repeats = -(-batch_size // value.size(0))
    return value.repeat(repeats, *([1] * (value.dim() - 1)))[:batch_size]


def pad_on_batch_axis(batch_size: int) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Wrap a collator so that every batch has ``batch_size`` rows, the missing ones repeated from the start of the
    batch (optimum-graphcore's ``pad_on_batch_axis``): an executable compiled for one batch shape can then take an
    epoch's last, incomplete batch. The evaluation loop keeps the real rows of the last batch (the loader's
    ``remainder``, set by ``IPUStrategy.hf_prepare_loader``).

    Example:
        >>> collate = pad_on_batch_axis(4)(lambda rows: {"x": torch.tensor(rows)})
        >>> collate([1, 2, 3])["x"].tolist()
        [1, 2, 3, 1]
    """

    def decorator(collator: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(collator)
        def padded(*args: Any, **kwargs: Any) -> Any:
            batch = collator(*args, **kwargs)
            if isinstance(batch, Mapping):
                for key in list(batch.keys()):
                    batch[key] = _repeat_rows(batch[key], batch_size)
                return batch
            if isinstance(batch, (list, tuple)):
                return type(batch)(_repeat_rows(value, batch_size) for value in batch)
            return _repeat_rows(batch, batch_size)

        return padded

    return decorator
