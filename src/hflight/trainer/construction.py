"""What the facade's constructor checks and derives before anything runs: its inputs, and facts about the model.

transformers' ``Trainer.__init__`` does the same work inline; here each step is a function the facade calls, with
transformers' error messages where scripts may match on them.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import transformers
from torch import nn
from transformers import DataCollatorWithPadding, PreTrainedTokenizerBase, default_data_collator
from transformers.feature_extraction_sequence_utils import SequenceFeatureExtractor
from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
from transformers.trainer_pt_utils import LabelSmoother
from transformers.trainer_utils import (  # noqa: F401 - validate_quantization_for_training: the facade calls it here
    SaveStrategy,
    unwrap_peft_model,
    validate_quantization_for_training,
)
from transformers.utils import can_return_loss, find_labels

from hflight._util import sharded_at_load


def _require(value: Any, name: str, kinds: tuple[type, ...] | type, hint: str) -> None:
    if value is not None and not isinstance(value, kinds):
        raise TypeError(f"Trainer: `{name}` must be {hint}, got {type(value).__name__}.")


def _check_dataset(name: str, dataset: Any) -> None:
    if (
        dataset is not None
        and not isinstance(dataset, dict)
        and not hasattr(dataset, "__getitem__")
        and not hasattr(dataset, "__iter__")
    ):
        raise TypeError(f"Trainer: `{name}` must be a Dataset (map-style or iterable), got {type(dataset).__name__}.")


def processing_class_of(processing_class: Any, tokenizer: Any) -> Any:
    """``processing_class``, or ``tokenizer`` (its older name); both given and different is an error."""
    if tokenizer is None:
        return processing_class
    if processing_class is not None and processing_class is not tokenizer:
        raise ValueError("Trainer: pass either `processing_class` or its older name `tokenizer`, not both.")
    return tokenizer


_LOOP = (
    "hflight's training loop is Lightning's (hflight.run.loop): override training_step or compute_loss, or add a "
    "TrainerCallback"
)
_FILES = (
    "hflight writes and checks the checkpoint's optimizer, scheduler, scaler and RNG files itself "
    "(hflight.checkpoints.parts): override _save_checkpoint or _load_from_checkpoint"
)

#: ``transformers.Trainer`` methods that hflight's Trainer never calls, with what to do instead. A subclass that
#: overrides one would be silently ignored, so the constructor refuses it (:func:`check_overrides`).
#: ``tests/test_surface.py`` checks that this is every transformers method hflight's Trainer lacks, plus the
#: parallelism sizes it keeps for scripts that read them.
NOT_CALLED: dict[str, str] = {
    **dict.fromkeys(
        (
            "_inner_training_loop", "_run_epoch", "_finalize_training", "_prepare_for_training",
            "_init_training_state", "_build_accelerator_args", "_wrap_model", "_move_model_to_device",
            "_validate_args", "_update_auto_batch_size", "_track_num_input_tokens",
            "_prepare_context_parallel_inputs", "_defer_fsdp_gradient_reduction",
            "_has_mixed_mesh_grads", "_mixed_mesh_grad_norm", "_sync_replicated_trainable_parameters",
        ),
        _LOOP,
    ),
    **dict.fromkeys(
        ("_save_rng_state", "_load_rng_state", "_save_optimizer_and_scheduler", "_save_scaler", "_load_scaler"),
        _FILES,
    ),
    **dict.fromkeys(
        ("get_tp_size", "get_cp_size", "get_sp_size", "get_total_train_batch_size"),
        "hflight has no tensor, context or sequence parallelism (these sizes are 1) and plans the run's batch "
        "arithmetic with the backend's step geometry (hflight.run.plan)",
    ),
    "_clip_grad_norm": "gradient clipping is Lightning's (max_grad_norm becomes gradient_clip_val)",
    "_get_grad_norm": "gradient clipping is Lightning's (max_grad_norm becomes gradient_clip_val)",
    "_get_collator_with_removed_columns": "override _remove_unused_columns, or pass a data_collator",
    "_issue_warnings_after_load": "hflight reports missing and unexpected keys itself: override _load_from_checkpoint",
}  # fmt: skip


def check_overrides(trainer_class: type) -> None:
    """Raise when a class of ``trainer_class``'s hierarchy outside hflight overrides a :data:`NOT_CALLED` method.

    Raises:
        TypeError: naming the class, the method and what to override instead.
    """
    for klass in trainer_class.__mro__:
        if klass.__module__.split(".")[0] in ("hflight", "builtins") or klass is transformers.Trainer:
            continue  # transformers' own Trainer: beneath hflight's for hflight.trl's TRL trainers (isinstance only)
        for name in sorted(NOT_CALLED.keys() & vars(klass).keys()):
            raise TypeError(
                f"{klass.__qualname__}.{name} overrides transformers.Trainer.{name}, which hflight's Trainer never "
                f"calls, so the override would have no effect: {NOT_CALLED[name]}."
            )


def check_inputs(
    args: Any,
    model: Any,
    model_init: Any,
    train_dataset: Any,
    eval_dataset: Any,
    callbacks: Any,
    optimizers: Any,
    compute_metrics: Any,
) -> None:
    """The constructor's arguments have usable types, and exactly one of ``model``/``model_init`` is given.

    Raises:
        RuntimeError, ValueError: transformers' messages for a missing or doubled model, for
            ``save_strategy="best"``/``load_best_model_at_end`` without ``metric_for_best_model``, and for an
            ``eval_strategy`` without an ``eval_dataset``.
        TypeError: naming the argument and the type it must have.
    """
    if (args.save_strategy == SaveStrategy.BEST or args.load_best_model_at_end) and args.metric_for_best_model is None:
        raise ValueError(
            "`args.metric_for_best_model` must be provided when using 'best' save_strategy or if "
            "`args.load_best_model_at_end` is set to `True`."
        )
    if args.eval_strategy is not None and args.eval_strategy != "no" and eval_dataset is None:
        raise ValueError(
            f"You have set `args.eval_strategy` to {args.eval_strategy} but you didn't pass an `eval_dataset` to "
            "`Trainer`. Either set `args.eval_strategy` to `no` or pass an `eval_dataset`. "
        )
    if model is None and model_init is None:
        raise RuntimeError("`Trainer` requires either a `model` or `model_init` argument")
    if model is not None and model_init is not None:
        raise ValueError("`Trainer` requires either a `model` or `model_init` argument, but not both.")
    _require(model, "model", nn.Module, "a torch.nn.Module (e.g. a transformers PreTrainedModel)")
    _check_dataset("train_dataset", train_dataset)
    _check_dataset("eval_dataset", eval_dataset)
    _require(callbacks, "callbacks", (list, tuple), "a list of TrainerCallback or lightning Callback objects")
    if not (isinstance(optimizers, tuple) and len(optimizers) == 2):
        raise TypeError(
            "Trainer: `optimizers` must be a tuple (optimizer, lr_scheduler); use (None, None) for the defaults."
        )
    if compute_metrics is not None and not callable(compute_metrics):
        raise TypeError(f"Trainer: `compute_metrics` must be callable, got {type(compute_metrics).__name__}.")
    if args.batch_eval_metrics and compute_metrics is not None:
        if "compute_result" not in inspect.signature(compute_metrics).parameters:
            raise ValueError(
                "When using `batch_eval_metrics`, your `compute_metrics` function must take a `compute_result` boolean "
                "argument which will be triggered after the last batch of the eval set to signal that the summary "
                "statistics should be returned by the function."
            )


def check_optimizer_inputs(optimizers: tuple[Any, Any], optimizer_cls_and_kwargs: Any, model_init: Any) -> None:
    """transformers' refusals: an optimizer given twice, or an optimizer for a model ``model_init`` replaces (the
    optimizer would update the parameters of a model that is not trained)."""
    if optimizer_cls_and_kwargs is not None and optimizers[0] is not None:
        raise RuntimeError("Passing both `optimizers` and `optimizer_cls_and_kwargs` arguments is incompatible.")
    if model_init is not None and (optimizers[0] is not None or optimizers[1] is not None):
        raise RuntimeError(
            "Passing a `model_init` is incompatible with providing the `optimizers` argument. "
            "You should subclass `Trainer` and override the `create_optimizer_and_scheduler` method."
        )


@dataclass(frozen=True)
class ModelFacts:
    """What the loop needs to know about a model, derived as transformers derives it."""

    accepts_loss_kwargs: bool  # the model normalises its loss by ``num_items_in_batch``
    label_names: list[str]
    can_return_loss: bool
    label_smoother: LabelSmoother | None
    num_params: int  # without embeddings, for ``floating_point_ops``
    loss_shifts_labels: bool  # a causal-LM loss: position 0 of each label row is never a target


def inspect_model(model: nn.Module, args: Any) -> ModelFacts:
    """:class:`ModelFacts` of ``model`` under ``args`` (``label_names``, ``label_smoothing_factor``); a PEFT model is
    inspected through its base model, as transformers does."""
    inspected = unwrap_peft_model(model)
    if hasattr(inspected, "accepts_loss_kwargs"):
        accepts_loss_kwargs = inspected.accepts_loss_kwargs
    else:
        params = inspect.signature(inspected.forward).parameters.values()
        accepts_loss_kwargs = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)
    label_names = find_labels(type(inspected)) if args.label_names is None else list(args.label_names)
    config = getattr(inspected, "config", None)
    return ModelFacts(
        accepts_loss_kwargs=accepts_loss_kwargs,
        label_names=label_names,
        can_return_loss=can_return_loss(type(inspected)),
        label_smoother=_label_smoother(args.label_smoothing_factor, getattr(model, "config", None)),
        num_params=model.num_parameters(exclude_embeddings=True) if hasattr(model, "num_parameters") else 0,
        loss_shifts_labels=LOSS_MAPPING.get(getattr(inspected, "loss_type", None)) is ForCausalLMLoss
        and not getattr(config, "is_encoder_decoder", False),
    )


def _label_smoother(epsilon: float, config: Any) -> LabelSmoother | None:
    """transformers' rule: none without ``label_smoothing_factor``, and none (with its warning) for a multi-label
    classifier, whose BCE loss label smoothing does not apply to."""
    if epsilon == 0:
        return None
    if getattr(config, "problem_type", None) == "multi_label_classification":
        warnings.warn(
            "Label smoothing is not compatible with multi-label classification. "
            "Disabling label smoothing for this training run.",
            UserWarning,
            stacklevel=3,
        )
        return None
    return LabelSmoother(epsilon=epsilon)


def default_collator(processing_class: Any) -> Callable:
    """transformers' default: padding with a tokenizer or feature extractor, ``default_data_collator`` otherwise."""
    if isinstance(processing_class, (PreTrainedTokenizerBase, SequenceFeatureExtractor)):
        return DataCollatorWithPadding(processing_class)
    return default_data_collator


def call_model_init(model_init: Callable[..., nn.Module], trial: Any = None) -> nn.Module:
    """``model_init()``, or ``model_init(trial)`` when it takes an argument; more arguments raise (transformers' rule
    and error)."""
    from transformers.trainer_utils import number_of_arguments

    n_args = number_of_arguments(model_init)
    if n_args > 1:
        raise RuntimeError("model_init should have 0 or 1 argument.")
    model = model_init() if n_args == 0 else model_init(trial)
    if model is None:
        raise RuntimeError("model_init should not return None.")
    return model


def prepare_model_for_training(model: nn.Module, args: Any) -> None:
    """What transformers' ``train()`` does to the model before building the optimizer: Liger's kernels patched in
    (``use_liger_kernel``, with ``liger_kernel_config``: transformers' own ``apply_liger_kernel``, which raises its
    ``ImportError`` where liger-kernel is not installed), then activation checkpointing."""
    if args.use_liger_kernel:
        from transformers.integrations.liger import apply_liger_kernel

        apply_liger_kernel(model, args.liger_kernel_config)
    enable_activation_checkpointing(model, args)


def enable_activation_checkpointing(model: nn.Module, args: Any) -> None:
    """``gradient_checkpointing_enable`` with ``args.gradient_checkpointing_kwargs`` when asked and supported."""
    if args.gradient_checkpointing and hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)


def _strategy_name(args: Any) -> str:
    strategy = args.strategy
    if isinstance(strategy, str):
        return strategy
    name = getattr(strategy, "strategy_name", None)
    return (name() if callable(name) else name) or type(strategy).__name__.lower()


def transformers_attributes(args: Any, model: nn.Module) -> dict[str, Any]:
    """The public attributes a ``transformers.Trainer`` has after its constructor that describe how the model is
    placed and sharded, with hflight's values: Lightning wraps the model when a run starts (so ``model_wrapped`` is
    the model itself until then), its FSDP/DeepSpeed strategies shard it, and nothing is model-parallel; a model
    transformers sharded at load time (tensor parallelism) stays where it was loaded. ``place_model_on_device``:
    transformers' rule (:func:`place_model` acts on it)."""
    strategy = _strategy_name(args).lower()
    devices = {d for d in (getattr(model, "hf_device_map", None) or {}).values() if d not in ("cpu", "disk")}
    attributes = {
        "deepspeed": None,
        "is_deepspeed_enabled": "deepspeed" in strategy or bool(getattr(args, "deepspeed", None)),
        "is_fsdp_enabled": "fsdp" in strategy or bool(getattr(args, "fsdp", None)),
        "is_fsdp_xla_enabled": False,
        "is_fsdp_xla_v1_enabled": False,
        "is_fsdp_xla_v2_enabled": False,
        "is_distributed_loading_by_transformers": sharded_at_load(model),
        "is_model_parallel": len(devices) > 1,
        "model_wrapped": model,
        "hub_model_id": None,
    }
    placed = getattr(args, "place_model_on_device", None)
    # transformers' rule: not a model-parallel, DeepSpeed, FSDP or load-time-sharded model, nor before a full
    # fp16/bf16 evaluation (which casts the model and moves it in one step)
    postponed = (
        attributes["is_model_parallel"]
        or attributes["is_deepspeed_enabled"]
        or attributes["is_fsdp_enabled"]
        or attributes["is_distributed_loading_by_transformers"]
        or getattr(args, "fp16_full_eval", False)
        or getattr(args, "bf16_full_eval", False)
    )
    attributes["place_model_on_device"] = bool(placed) if placed is not None else not postponed
    return attributes


def place_model(model: nn.Module, args: Any, place: bool) -> None:
    """transformers' device placement (``Trainer.__init__``, and ``train()`` after ``model_init``): ``model`` moved to
    ``args.device`` when ``place`` (``place_model_on_device``), so that the script, the callbacks and every later
    ``train()``/``evaluate()`` see it there (hflight's runs leave it there: ``hflight.run.run``). Not a
    bitsandbytes-quantized model (it has no ``.to``), and not where Lightning starts the run's processes itself (the
    process that builds the trainer forks or spawns them, and a fork cannot use the CUDA memory its parent holds: each
    process's run places its own model)."""
    from transformers.utils.quantization_config import QuantizationMethod

    from hflight.arguments import cluster
    from hflight.arguments.strategies import lightning_launches_several

    if not place or getattr(model, "quantization_method", None) == QuantizationMethod.BITS_AND_BYTES:
        return
    if cluster.launched_world_size() is None and lightning_launches_several(args):
        return
    model.to(args.device)
