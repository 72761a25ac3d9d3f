"""Hardware the arguments ask for: is it there (before any data is prepared), and what ran (for the results table)."""

from __future__ import annotations

from typing import Any

import lightning as L

from hflight.arguments.lightning_kwargs import lightning_trainer_kwargs, quiet_lightning


def check_hardware(args: Any) -> None:
    """Build, and drop, the accelerator, strategy and precision plugin ``args`` select, as ``lightning.Trainer``
    builds them for a run, so that a backend that cannot start here fails at once with its own message (poptorch
    missing for ``accelerator="ipu"``, onnxruntime for ``strategy="ort"``, no GPU for ``accelerator="gpu"``): an
    entry point calls it before it prepares any data. Nothing is set up: no device, process group or logger."""
    with quiet_lightning():
        L.Trainer(**lightning_trainer_kwargs(args, [], fitting=False))


def _registered(registry: dict[str, dict[str, Any]], key: str, cls: type) -> tuple[str, str | None]:
    """``cls``'s registered name (its own ``strategy_name`` when registered, else the first entry that builds it)
    and its description when that name is the only entry for the class (Lightning registers ``DDPStrategy`` under
    ten names whose descriptions differ in the start method)."""
    names = [name for name, entry in registry.items() if entry[key] is cls]
    own = getattr(cls, "strategy_name", None)
    name = own if own in names else (names or [cls.__name__])[0]
    description = registry[name].get("description") if len(names) == 1 else None
    return name, description if description != cls.__name__ else None


def describe_backend(lightning_trainer: Any) -> str:
    """What ran, in Lightning's registered names and descriptions, e.g. ``strategy 'ort' (ONNX Runtime evaluation,
    ...), accelerator 'cpu', precision 32-true``."""
    from lightning.pytorch.accelerators import AcceleratorRegistry
    from lightning.pytorch.strategies import StrategyRegistry

    # item access only: the registries' own get() builds an instance
    strategy, description = _registered(StrategyRegistry, "strategy", type(lightning_trainer.strategy))
    accelerator, _ = _registered(AcceleratorRegistry, "accelerator", type(lightning_trainer.accelerator))
    described = f"strategy {strategy!r}" + (f" ({description})" if description else "")
    return f"{described}, accelerator {accelerator!r}, precision {lightning_trainer.precision}"
