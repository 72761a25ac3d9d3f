"""TRL's trainers on hflight's Trainer: change one import, keep the script.

    from hflight.trl import SFTConfig, SFTTrainer  # was: from trl import SFTConfig, SFTTrainer

Each trainer here is TRL's own class with hflight's ``Trainer`` in place of transformers' beneath it:
``hflight.trl.SFTTrainer`` subclasses ``trl.SFTTrainer``, whose code (its ``__init__``, data preparation,
``compute_loss``, ``log``, ...) runs as it is, and where TRL calls transformers' Trainer (``super()``,
``self.accelerator``, ``self.args``) it reaches hflight's. The classes, in order: this module's ``SFTTrainer``,
``trl.SFTTrainer``, TRL's base trainer, :class:`TRLTrainerBase`, ``hflight.Trainer``, then ``transformers.Trainer``,
which TRL's ``isinstance`` checks find but whose methods are never run: every method of transformers' Trainer that
hflight's does not define is one its Lightning loop never calls, and :class:`TRLTrainerBase` raises on each, naming
it; a TRL trainer that overrides one is refused when it is built (``hflight.trainer.construction.check_overrides``),
never left silently unused. accelerate's process state, which TRL's code reads through accelerate's functions, is
made as transformers' ``Accelerator`` makes it (:func:`accelerate_state`).

Each config here is TRL's config with hflight's ``TrainingArguments`` beneath it (Lightning's ``accelerator``,
``devices``, ``strategy``, ``num_nodes``, ``save_async``, hflight's checks): ``isinstance(args, trl.SFTConfig)`` holds,
and a config of TRL's own given to a trainer of this module (or to ``hflight.Trainer``) becomes this module's, field for
field (``hflight.arguments.training_args.coerce_training_args``); a script's subclass of one becomes a dataclass of
that subclass over this module's config, so that it stays an instance of both. hflight's ``TrainingArguments`` given
to a trainer here become its config too, hflight's fields kept, where TRL makes its config of transformers' arguments.

Needs TRL (``pip install 'hflight[trl]'``); what was compared with TRL on transformers, trainer by trainer, is in
docs/fine-tuning.md.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from typing import Any

import transformers

from hflight.arguments import process_group
from hflight.arguments.training_args import TrainingArguments, field_values, register_arguments_twin
from hflight.trainer.construction import NOT_CALLED
from hflight.trainer.facade import Trainer

try:
    import trl
except ImportError as missing:  # pragma: no cover - the message is the point
    raise ImportError("hflight.trl needs TRL, which is not installed: pip install 'hflight[trl]'") from missing

#: TRL's trainers and their configs, as TRL exports them (``trl.__init__``)
TRAINERS = ("DistillationTrainer", "DPOTrainer", "GRPOTrainer", "KTOTrainer", "RewardTrainer", "RLOOTrainer",
            "SFTTrainer")  # fmt: skip
CONFIGS = ("DistillationConfig", "DPOConfig", "GRPOConfig", "KTOConfig", "RewardConfig", "RLOOConfig", "SFTConfig")

__all__ = ["TRLTrainerBase", *TRAINERS, *CONFIGS]

#: the fields each config's ``__post_init__`` derives from others and refuses beside them
_DERIVED = {"GRPOConfig": ("generation_batch_size",), "RLOOConfig": ("generation_batch_size",)}
#: the values a config's fields take beyond their annotations, as its ``__post_init__`` reads them (GRPO's
#: ``scale_rewards``: True and False for "group" and "none"); hflight's type checks take them too
_WIDER = {"GRPOConfig": {"scale_rewards": bool}}


def _refused(name: str, why: str) -> Any:
    def refused(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{type(self).__name__}.{name}: transformers.Trainer.{name} is not part of hflight's Trainer, whose "
            f"training loop never calls it ({why})."
        )

    refused.__name__ = refused.__qualname__ = name
    return refused


def _init(self: Any, *args: Any, **kwargs: Any) -> None:
    """hflight's ``Trainer.__init__``, then accelerate's process state, which TRL's code reads through accelerate's
    functions (``set_seed(..., device_specific=True)``, ``gather``, ``broadcast_object_list``) where transformers'
    ``Accelerator`` made it: see :func:`accelerate_state`."""
    Trainer.__init__(self, *args, **kwargs)
    accelerate_state(self.args)


def partial_state(args: Any, device: Any) -> Any:
    """accelerate's ``PartialState`` of this process on ``device`` (the arguments'), which transformers' arguments keep
    as ``distributed_state`` and TRL's code reads (its ``distributed_type``, ranks). Under a launcher the processes are
    connected first, by hflight, as the run would connect them, so the state takes that group (and Lightning the same
    later); a state made before (``use_configured_state``, a script's ``Accelerator()``) is kept."""
    from accelerate.state import PartialState

    if PartialState._shared_state == {}:
        process_group.connect(process_group.default_backend(device, args.ddp_backend))
    return PartialState(cpu=device.type == "cpu")


def accelerate_state(args: Any) -> Any:
    """accelerate's ``AcceleratorState`` for this process, as transformers' ``Accelerator`` makes it (its processes,
    device and precision: ``args``'), over :func:`partial_state`. hflight's own code never reads it."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import TorchDynamoPlugin

    partial_state(args, args.device)
    if AcceleratorState._shared_state.get("_mixed_precision") is not None:
        return AcceleratorState()
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "no"
    return AcceleratorState(mixed_precision=precision, cpu=args.device.type == "cpu", dynamo_plugin=TorchDynamoPlugin(),
                            _from_accelerator=True)  # fmt: skip


@functools.cached_property
def _setup_devices(self: Any) -> Any:
    """hflight's device of this process, and accelerate's state as ``distributed_state`` (transformers' arguments
    keep one there, and TRL's trainers read it)."""
    device = TrainingArguments._setup_devices.func(self)
    if self.distributed_state is None:
        self.distributed_state = partial_state(self, device)
    return device


#: hflight's Trainer beneath TRL's trainers, with transformers' Trainer below it for TRL's ``isinstance`` checks; the
#: methods of transformers' Trainer that hflight's never calls raise, naming themselves
TRLTrainerBase = type(
    "TRLTrainerBase",
    (Trainer, transformers.Trainer),
    {
        "__module__": __name__,
        "__doc__": "hflight's Trainer beneath a TRL trainer (see the module); transformers' Trainer below it for "
        "isinstance only.",
        "__init__": _init,
        **{name: _refused(name, why) for name, why in NOT_CALLED.items() if not hasattr(Trainer, name)},
    },
)


@functools.cache
def _trainer(name: str) -> type:
    theirs = getattr(trl, name)
    config = _config(name.removesuffix("Trainer") + "Config")
    signature = inspect.signature(theirs.__init__)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        """TRL's ``__init__``; hflight's ``TrainingArguments`` given as ``args`` first become this trainer's config,
        hflight's own fields kept (TRL makes its config of transformers' arguments from their ``to_dict()``, which
        would refuse hflight's fields)."""
        bound = signature.bind(self, *args, **kwargs)
        given = bound.arguments.get("args")
        if isinstance(given, TrainingArguments) and not isinstance(given, getattr(trl, config.__name__)):
            bound.arguments["args"] = config(**field_values(config, given)[0])
        theirs.__init__(*bound.args, **bound.kwargs)

    namespace = {"__module__": __name__, "__qualname__": name, "__init__": __init__,
                 "__doc__": f"trl.{name} on hflight's Trainer (see hflight.trl)."}  # fmt: skip
    return type(name, (theirs, TRLTrainerBase), namespace)


@functools.cache
def _config(name: str) -> type:
    theirs = getattr(trl, name)
    namespace = {"__module__": __name__, "__qualname__": name, "_setup_devices": _setup_devices,
                 "__doc__": f"trl.{name} with hflight's TrainingArguments beneath it (see hflight.trl)."}  # fmt: skip
    wider, hints = _WIDER.get(name, {}), typing.get_type_hints(theirs)
    given = {f.name: f for f in dataclasses.fields(theirs) if f.name in wider}
    namespace["__annotations__"] = {field: hints[field] | extra for field, extra in wider.items()}
    namespace |= {field: dataclasses.field(default=f.default, metadata=f.metadata) for field, f in given.items()}
    ours = dataclasses.dataclass(type(name, (theirs, TrainingArguments), namespace))
    register_arguments_twin(theirs, ours, _DERIVED.get(name, ()))
    return ours


def __getattr__(name: str) -> type:
    if name in TRAINERS:
        return _trainer(name)
    if name in CONFIGS:
        return _config(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


for _name in CONFIGS:  # a TRL config given to any trainer becomes its twin here, whichever trainer was imported
    _config(_name)
