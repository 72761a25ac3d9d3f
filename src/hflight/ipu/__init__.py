"""Graphcore IPUs for hflight: optimum-graphcore's ``IPUTrainer`` API on Lightning, through poptorch.

``from hflight.ipu import IPUConfig, IPUAccelerator, IPUStrategy, IPUTrainer, IPUTrainingArguments`` (and
``IPUSeq2SeqTrainer``, ``IPUSeq2SeqTrainingArguments``; ``hflight.ipu.utils.check_min_version``). Nothing here
imports poptorch until an accelerator, strategy or trainer is built; then a missing poptorch raises one error that
says what to install. Built against poptorch's documented API and verified against a stand-in of it in the tests;
never run on IPU hardware (the last public poptorch needs torch 2.0.1).

May import: the Lightning side (``accelerator``, ``strategy``, ``precision``, ``runtime``, ``data``, ``config``,
``generation``) only the run's backend hooks (``hflight.run.backend``), the arguments and the checkpoints; the
optimum-graphcore-compatible ``trainer`` also the facade and the run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hflight._util import lazy_exports
from hflight.arguments.registry import register_backends

_EXPORTS = {
    "IPUConfig": "hflight.ipu.config",
    "IncompatibleIPUConfigError": "hflight.ipu.config",
    "IPUAccelerator": "hflight.ipu.accelerator",
    "IPUPrecision": "hflight.ipu.precision",
    "IPUStrategy": "hflight.ipu.strategy",
    "IPUTrainer": "hflight.ipu.trainer",
    "IPUTrainerState": "hflight.ipu.trainer",
    "IPUTrainingArguments": "hflight.ipu.trainer",
    "IPUSeq2SeqTrainer": "hflight.ipu.seq2seq",
    "IPUSeq2SeqTrainingArguments": "hflight.ipu.seq2seq",
    "pad_on_batch_axis": "hflight.ipu.data",
}

__all__ = [
    "IPUAccelerator",
    "IPUConfig",
    "IPUPrecision",
    "IPUSeq2SeqTrainer",
    "IPUSeq2SeqTrainingArguments",
    "IPUStrategy",
    "IPUTrainer",
    "IPUTrainerState",
    "IPUTrainingArguments",
    "IncompatibleIPUConfigError",
    "pad_on_batch_axis",
]

if TYPE_CHECKING:
    from hflight.ipu.accelerator import IPUAccelerator
    from hflight.ipu.config import IncompatibleIPUConfigError, IPUConfig
    from hflight.ipu.data import pad_on_batch_axis
    from hflight.ipu.precision import IPUPrecision
    from hflight.ipu.seq2seq import IPUSeq2SeqTrainer, IPUSeq2SeqTrainingArguments
    from hflight.ipu.strategy import IPUStrategy
    from hflight.ipu.trainer import IPUTrainer, IPUTrainerState, IPUTrainingArguments


register_backends()  # lightning.Trainer(strategy=...) resolves hflight's names once this package is imported

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, __all__)
