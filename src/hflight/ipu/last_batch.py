"""An evaluation's incomplete last batch on the IPU, where the loader does not pad it (``pad_on_batch_axis=False``).

A poptorch executable runs only the input shapes it was compiled for (poptorch refuses another: "create a new
inferenceModel", its message says). :class:`ShapedInference` is what the evaluation calls: the inference executable of
the combined batch (micro-batch x inference replicas x device iterations) for every full batch, and for a batch of
another number of rows (the last one of a set that the combined batch does not divide) a second executable compiled
for it, with one device iteration, its rows spread over the same replicas where they divide them, else on one
replica: no row is repeated, so each replica's loss is the mean over real rows only and the call's loss, weighed by
its rows, is the CPU's (repeating rows to fill the replicas put the repeated rows' losses into it). One executable
is attached to the IPUs at a time. With ``pad_on_batch_axis=True`` the loader pads that batch to the combined size
instead (repeating rows), and only the first executable runs: the outputs are cut to the real rows, and the loss of
that call counts the repeated rows too (the CPU's only where each real row is repeated equally often).

Written against poptorch's documented API; verified against the test stand-in of it.

May import: nothing of hflight.
"""

from __future__ import annotations

from typing import Any

import torch


class ShapedInference:
    """Calls ``main`` (compiled for the rows of its first call: a combined batch) or, for another number of rows, an
    executable of its own made by ``make(options)`` from ``options`` with one device iteration; ``replicas``: the
    inference replication factor. Anything else is ``main``'s."""

    def __init__(self, main: Any, make: Any, options: Any, replicas: int) -> None:
        self.main, self._make, self._options = main, make, options
        self.replicas = max(replicas, 1)
        self.rows: int | None = None  # main's
        self.others: dict[int, Any] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        rows = _rows(args, kwargs)
        if self.rows is None:
            self.rows = rows
        if rows is None or rows == self.rows:
            return self._run(self.main, args, kwargs)
        executable = self.others.get(rows)
        if executable is None:
            options = self._options.clone().deviceIterations(1)
            if rows % self.replicas:  # rows that do not divide the replicas: one replica takes them all
                options = options.replicationFactor(1)
            executable = self.others[rows] = self._make(options)
        return self._run(executable, args, kwargs)

    def _run(self, executable: Any, args: tuple, kwargs: dict) -> Any:
        for other in self.executables():
            if other is not executable and other.isCompiled() and other.isAttachedToDevice():
                other.detachFromDevice()
        return executable(*args, **kwargs)

    def executables(self) -> list[Any]:
        return [self.main, *self.others.values()]

    def __getattr__(self, name: str) -> Any:
        if name in ("main", "others"):
            raise AttributeError(name)
        return getattr(self.main, name)


def _rows(args: tuple, kwargs: dict) -> int | None:
    for value in (*args, *kwargs.values()):
        if torch.is_tensor(value) and value.dim() > 0:
            return int(value.shape[0])
    return None
