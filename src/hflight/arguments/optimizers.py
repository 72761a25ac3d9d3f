"""Optimizers and schedulers: transformers' ``optim`` menu, and what an optimizer asks of the training loop.

Every ``optim`` name of transformers' ``OptimizerNames`` is built by transformers' own
``Trainer.get_optimizer_cls_and_kwargs`` (one dispatch table there, so the class and keyword arguments hflight builds
cannot drift from transformers'); hflight adds only:

- the optimizers a backend registers (:data:`OPTIMIZERS`, e.g. ONNX Runtime's ``"adamw_ort_fused"``);
- for an optimizer whose package is missing, the install command of hflight's extra (:data:`OPTIONAL_PACKAGES`), in
  the exception type transformers raises;
- the questions the loop asks about the optimizer and scheduler it runs (:func:`updates_in_backward`,
  :func:`fused_backward`, :func:`steps_on_metrics`, :func:`set_optimizer_mode`), so that LOMO's fused backward,
  GaLore/APOLLO's layer-wise optimizers, schedule-free optimizers and metric-driven schedulers (``ReduceLROnPlateau``,
  ``GreedyLR``) get what transformers gives them without the loop naming any of them.

Parameter grouping (no weight decay on biases and normalisation weights) and scheduling (``transformers.get_scheduler``,
stepped once per optimizer step) follow transformers exactly, so losses and learning rates agree step for step.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import get_scheduler
from transformers.optimization import GreedyLR
from transformers.trainer_pt_utils import LayerWiseDummyOptimizer, get_parameter_names
from transformers.training_args import OptimizerNames

#: The arguments these factories read: ``hflight.TrainingArguments`` or any object with transformers' optimizer
#: fields (``optim``, ``learning_rate``, ``adam_*``, ``weight_decay``, ``optim_args``, ``lr_scheduler_*``, ...).
#: Typed loosely because ``training_args`` looks up ``optim`` names here (an import the other way would be circular).
TrainingArguments = Any

OptimizerSpec = tuple[type[torch.optim.Optimizer], dict[str, Any]]

#: Optimizers hflight's backends add to transformers' names: ``optim`` name -> ``factory(args)`` returning the class
#: and keyword arguments (ONNX Runtime registers ``"adamw_ort_fused"`` when hflight is imported).
OPTIMIZERS: dict[str, Callable[[TrainingArguments], OptimizerSpec]] = {}

# Same name patterns transformers uses to keep biases and norm weights out of weight decay.
_NO_DECAY_PATTERNS = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]


@dataclass(frozen=True)
class OptionalPackage:
    """The package behind some ``optim`` names: its pip name, transformers' availability check (a function of
    ``transformers.trainer_optimizer``, looked up when asked), hflight's extra that installs it, and the names."""

    pip: str
    check: str
    extra: str
    names: tuple[str, ...]


def _names(*members: OptimizerNames) -> tuple[str, ...]:
    return tuple(member.value for member in members)


_N = OptimizerNames
#: Every ``optim`` name whose optimizer lives outside torch and transformers, by package (pyproject.toml's extras).
OPTIONAL_PACKAGES: tuple[OptionalPackage, ...] = (
    OptionalPackage("schedulefree", "is_schedulefree_available", "schedulefree",
                    _names(_N.SCHEDULE_FREE_ADAMW, _N.SCHEDULE_FREE_RADAM, _N.SCHEDULE_FREE_SGD)),
    OptionalPackage("bitsandbytes", "is_bitsandbytes_available", "bitsandbytes",
                    _names(_N.ADAMW_BNB, _N.ADAMW_8BIT, _N.PAGED_ADAMW, _N.PAGED_ADAMW_8BIT, _N.ADEMAMIX,
                           _N.ADEMAMIX_8BIT, _N.PAGED_ADEMAMIX, _N.PAGED_ADEMAMIX_8BIT, _N.LION, _N.LION_8BIT,
                           _N.PAGED_LION, _N.PAGED_LION_8BIT, _N.RMSPROP_BNB, _N.RMSPROP_8BIT, _N.RMSPROP_32BIT)),
    OptionalPackage("torchao", "is_torchao_available", "torchao", _names(_N.ADAMW_TORCH_4BIT, _N.ADAMW_TORCH_8BIT)),
    OptionalPackage("galore-torch", "is_galore_torch_available", "galore",
                    _names(_N.GALORE_ADAMW, _N.GALORE_ADAMW_8BIT, _N.GALORE_ADAFACTOR, _N.GALORE_ADAMW_LAYERWISE,
                           _N.GALORE_ADAMW_8BIT_LAYERWISE, _N.GALORE_ADAFACTOR_LAYERWISE)),
    OptionalPackage("apollo-torch", "is_apollo_torch_available", "apollo",
                    _names(_N.APOLLO_ADAMW, _N.APOLLO_ADAMW_LAYERWISE)),
    OptionalPackage("lomo-optim", "is_lomo_available", "lomo", _names(_N.LOMO, _N.ADALOMO)),
    OptionalPackage("grokadamw", "is_grokadamw_available", "grokadamw", _names(_N.GROKADAMW)),
    OptionalPackage("torch-optimi", "is_torch_optimi_available", "optimi", _names(_N.STABLE_ADAMW)),
)  # fmt: skip
_PACKAGE_OF = {name: package for package in OPTIONAL_PACKAGES for name in package.names}
#: The optimizers whose ``fused_backward`` transformers hands the loss and learning rate to (accelerate's LOMO path).
_FUSED_BACKWARD = frozenset(_names(_N.LOMO, _N.ADALOMO))


def optim_name(args: TrainingArguments) -> str:
    return getattr(args.optim, "value", args.optim)


def check_optim_args(optim_args: str | None) -> None:
    """``optim_args`` as transformers reads it (``"k1=v1,k2=v2"``, spaces ignored); a pair without exactly one ``=``
    raises ``ValueError`` naming the field (transformers fails on it with an unpacking error)."""
    if not optim_args:
        return
    for item in optim_args.replace(" ", "").split(","):
        if item.count("=") != 1 or item.startswith("="):
            raise ValueError(
                f"optim_args must be 'key=value' pairs separated by commas (as transformers reads it), got "
                f"{optim_args!r}: {item!r} is not one"
            )


def optimizer_cls_and_kwargs(args: TrainingArguments, model: nn.Module | None = None) -> OptimizerSpec:
    """The optimizer class and keyword arguments that ``args.optim`` names: a backend's registered factory, else
    transformers' ``Trainer.get_optimizer_cls_and_kwargs(args, model)`` (``model``: needed by GaLore, APOLLO, LOMO).

    Raises:
        ImportError/ValueError: as transformers raises them; for a missing optional package, naming hflight's extra.
    """
    name = optim_name(args)
    if name in OPTIMIZERS:
        return OPTIMIZERS[name](args)
    check_optim_args(args.optim_args)
    from transformers.trainer import Trainer as HFTrainer  # the module's: never a replaced top-level name

    try:
        return HFTrainer.get_optimizer_cls_and_kwargs(args, model)
    except (ImportError, ValueError) as exc:
        package = _PACKAGE_OF.get(name)
        if package is None or _available(package):
            raise
        raise type(exc)(
            f"optim={name!r} needs {package.pip}, which is not installed: pip install 'hflight[{package.extra}]' "
            f"(or 'hflight[optimizers]' for every optional optimizer). transformers: {exc}"
        ) from exc


def _available(package: OptionalPackage) -> bool:
    import transformers.trainer_optimizer as hf_optimizers

    return bool(getattr(hf_optimizers, package.check)())


def decay_parameter_names(model: nn.Module) -> list[str]:
    """Names of the parameters that get weight decay: all but biases and normalisation weights (as HF)."""
    return get_parameter_names(model, [nn.LayerNorm], _NO_DECAY_PATTERNS)


def grouped_parameters(
    model: nn.Module, weight_decay: float, decay_names: list[str] | None = None
) -> list[dict[str, Any]]:
    """Two parameter groups, with and without weight decay, over the trainable parameters; ``decay_names``: the
    parameters that decay (default: :func:`decay_parameter_names`)."""
    decay = set(decay_parameter_names(model) if decay_names is None else decay_names)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]


class AcceleratedView(torch.optim.Optimizer):
    """An optimizer as transformers' ``create_scheduler`` sees it: behind accelerate's ``AcceleratedOptimizer``, a
    wrapper over the same parameter groups. transformers 5.23 builds its scheduler after accelerate wrapped the
    optimizer, so ``get_scheduler`` never recognises a ``LayerWiseDummyOptimizer`` there (its per-parameter
    schedulers, which torch 2.13 could not build, never exist): the layer-wise optimizers keep ``learning_rate`` and
    the schedule moves the dummy's learning rate, the one logged. Only such an optimizer is seen through this view."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:  # no Optimizer.__init__: the groups are shared
        self.optimizer = optimizer

    param_groups = property(lambda self: self.optimizer.param_groups)
    defaults = property(lambda self: self.optimizer.defaults)
    state = property(lambda self: self.optimizer.state)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)


def build_scheduler(
    args: TrainingArguments, optimizer: torch.optim.Optimizer, num_training_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    """``transformers.get_scheduler`` with the warmup and kwargs of ``args``, over the optimizer as transformers'
    scheduler sees it (:class:`AcceleratedView` for a layer-wise optimizer)."""
    return get_scheduler(
        getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type),
        optimizer=AcceleratedView(optimizer) if isinstance(optimizer, LayerWiseDummyOptimizer) else optimizer,
        num_warmup_steps=args.get_warmup_steps(num_training_steps),
        num_training_steps=num_training_steps,
        scheduler_specific_kwargs=args.lr_scheduler_kwargs or {},
    )


# ---- what the loop asks about the optimizer and scheduler it runs ---------------------------------------------------
def steps_on_metrics(scheduler: Any) -> bool:
    """Whether ``scheduler`` steps on an evaluation metric, after each evaluation, instead of once per optimizer step
    (``ReduceLROnPlateau``, transformers' ``GreedyLR``: transformers' ``lr_scheduler_type`` "reduce_lr_on_plateau",
    "greedy")."""
    return isinstance(scheduler, (torch.optim.lr_scheduler.ReduceLROnPlateau, GreedyLR))


def current_learning_rate(scheduler: Any, optimizer: torch.optim.Optimizer) -> float:
    """The learning rate of the first parameter group, as HF logs it."""
    if scheduler is None or steps_on_metrics(scheduler):
        lr = optimizer.param_groups[0]["lr"]
    else:
        lr = scheduler.get_last_lr()[0]
    return lr.item() if torch.is_tensor(lr) else float(lr)


def _lomo_classes() -> tuple[type, ...]:
    """LOMO's optimizer classes, when lomo_optim is imported (an optimizer of its classes means it is)."""
    module = sys.modules.get("lomo_optim")
    return (module.Lomo, module.AdaLomo) if module is not None else ()


def updates_in_backward(optimizer: Any) -> bool:
    """Whether ``optimizer`` moves the parameters during the backward pass, so its ``step()`` does nothing: LOMO and
    AdaLomo (gradient hooks; accelerate skips their step) and transformers' ``LayerWiseDummyOptimizer`` (GaLore/APOLLO
    ``*_layerwise``: a per-parameter optimizer stepped in each parameter's post-accumulate-grad hook)."""
    return isinstance(optimizer, (LayerWiseDummyOptimizer, *_lomo_classes()))


def passes_learning_rate(args: TrainingArguments) -> bool:
    """Whether transformers' ``training_step`` hands the learning rate to the backward pass ("lomo", "adalomo")."""
    return optim_name(args) in _FUSED_BACKWARD


def step_taken_in_backward(scheduler: Any) -> None:
    """The optimizer step of an optimizer that updated the parameters in the backward pass: nothing to do, but the
    scheduler's optimizer counts as stepped (torch's schedulers record ``optimizer.step()`` calls to warn about a
    schedule stepped first; transformers' step there is accelerate's wrapper, whose no-op step counts)."""
    optimizer = getattr(scheduler, "optimizer", None)
    if optimizer is not None:
        optimizer._opt_called = True  # what torch's LRScheduler.step checks


def fused_backward(args: TrainingArguments, optimizer: Any) -> Callable[[torch.Tensor, float], None] | None:
    """LOMO's ``fused_backward(loss, lr)`` when transformers hands it the backward pass: ``optim`` is "lomo" or
    "adalomo" and the optimizer is one of LOMO's (transformers' ``training_step`` passes the learning rate to
    accelerate's ``backward``, which then calls it); None otherwise."""
    if passes_learning_rate(args) and isinstance(optimizer, _lomo_classes()):
        return optimizer.fused_backward
    return None


def set_optimizer_mode(optimizer: Any, training: bool) -> None:
    """``optimizer.train()`` or ``optimizer.eval()`` where the optimizer has them (schedule-free optimizers keep two
    parameter sequences: the one trained, and the average evaluated), as transformers calls them: ``train()`` at every
    training step, ``eval()`` when an evaluation loop starts."""
    method = getattr(optimizer, "train" if training else "eval", None)
    if callable(method):
        method()


__all__ = [
    "OPTIMIZERS",
    "OPTIONAL_PACKAGES",
    "AcceleratedView",
    "OptionalPackage",
    "build_scheduler",
    "check_optim_args",
    "current_learning_rate",
    "decay_parameter_names",
    "fused_backward",
    "grouped_parameters",
    "optim_name",
    "optimizer_cls_and_kwargs",
    "passes_learning_rate",
    "set_optimizer_mode",
    "step_taken_in_backward",
    "steps_on_metrics",
    "updates_in_backward",
]
