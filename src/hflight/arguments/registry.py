"""hflight's backends in Lightning's registries.

:func:`register_backends` adds hflight's accelerators and strategy names to Lightning's registries, so
``TrainingArguments(accelerator="ipu")``, ``strategy="ipu"``, ``strategy="ort"`` and the Hydra options ``trainer=ipu`` /
``trainer=ort`` select them, and so does ``lightning.Trainer(strategy="ort")`` once ``hflight.ort`` (or
``hflight.ipu``) is imported. It runs when the arguments are first imported, not at ``import hflight``, and imports
neither poptorch nor onnxruntime: those are needed only when a backend is constructed, which then fails with one
message saying what to install.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Protocol, TypedDict

if TYPE_CHECKING:
    from lightning.pytorch.strategies import Strategy
    from torch import nn
    from transformers import TrainingArguments

    from hflight.arguments.deepspeed import DeepSpeedConfigResolver

__all__ = [
    "BACKEND_PACKAGES",
    "CHECKPOINTS",
    "DEFAULT_STRATEGIES",
    "SHARDING",
    "STRATEGY_ACCELERATORS",
    "CheckpointForms",
    "DeepSpeedBuilder",
    "FSDPBuilder",
    "ProcessGroupSettings",
    "ShardingBuilders",
    "TensorParallelBuilder",
    "register_backends",
]

#: accelerator name -> the strategy hflight selects for it when ``strategy="auto"`` (filled by registration).
DEFAULT_STRATEGIES: dict[str, str] = {}
#: strategy name -> the accelerator hflight selects for it when ``accelerator="auto"`` (filled by registration).
STRATEGY_ACCELERATORS: dict[str, str] = {}


class ProcessGroupSettings(TypedDict, total=False):
    """``ddp_backend`` and ``ddp_timeout`` as the keyword arguments of Lightning's DDP, FSDP and DeepSpeed strategies
    (only those the arguments set)."""

    process_group_backend: str
    timeout: timedelta


class FSDPBuilder(Protocol):
    """Builds the strategy for ``fsdp``/``fsdp_config`` (FSDP2, or FSDP1 for ``version`` 1) from the checked
    arguments, the model its plan names layers of, and the number of processes the run spans."""

    def __call__(
        self, args: TrainingArguments, model: nn.Module, world_size: int, process_group: ProcessGroupSettings
    ) -> Strategy: ...


class DeepSpeedBuilder(Protocol):
    """Builds the strategy for ``deepspeed`` from the config resolved from the arguments."""

    def __call__(self, resolver: DeepSpeedConfigResolver, process_group: ProcessGroupSettings) -> Strategy: ...


class TensorParallelBuilder(Protocol):
    """Builds the strategy for a model transformers loaded tensor-parallel (``from_pretrained(tp_plan=...)``), checked
    against the number of processes the run spans."""

    def __call__(self, model: nn.Module, world_size: int, process_group: ProcessGroupSettings) -> Strategy: ...


@dataclass
class ShardingBuilders:
    """The builders of the sharding strategies for transformers' ``fsdp`` and ``deepspeed`` arguments (set by
    ``hflight.sharding.registration``; the arguments never import ``hflight.sharding``)."""

    fsdp: FSDPBuilder | None = None
    deepspeed: DeepSpeedBuilder | None = None
    tensor_parallel: TensorParallelBuilder | None = None


#: the sharding strategies' builders (filled by registration).
SHARDING = ShardingBuilders()


class SaveAsyncRefusal(Protocol):
    """Why ``save_async`` cannot write the checkpoints of a run of these arguments (None: it can)."""

    def __call__(self, args: TrainingArguments) -> str | None: ...


@dataclass
class CheckpointForms:
    """What the checkpoint forms a run will write say about its arguments, before it starts (set by
    ``hflight.sharding.registration`` from ``hflight.checkpoints.forms``: the arguments never import
    ``hflight.checkpoints``)."""

    save_async_refusal: SaveAsyncRefusal | None = None


#: the checkpoint forms' answers (filled by registration).
CHECKPOINTS = CheckpointForms()

#: hflight's backend modules; each has ``register(accelerator_registry, strategy_registry)``.
BACKEND_PACKAGES: tuple[str, ...] = (
    "hflight.ipu.registration",
    "hflight.ort.registration",
    "hflight.sharding.registration",
)


def register_backends() -> None:
    """Add hflight's accelerators and strategies to Lightning's registries (idempotent)."""
    from lightning.pytorch.accelerators import AcceleratorRegistry
    from lightning.pytorch.strategies import StrategyRegistry

    for name in BACKEND_PACKAGES:
        importlib.import_module(name).register(AcceleratorRegistry, StrategyRegistry)
