"""``TrainingArguments``: the transformers 5.x training arguments that hflight supports, plus Lightning's own.

Field names, defaults and ``__post_init__`` semantics follow ``transformers.TrainingArguments`` (5.23), so that
transformers' own callbacks (``DefaultFlowCallback``, ``EarlyStoppingCallback``, ``ProgressCallback``,
``PrinterCallback``) and ``TrainerState.compute_steps`` work on an instance unchanged. Every field type is one
that both ``transformers.HfArgumentParser`` and OmegaConf/Hydra structured configs understand; where transformers
uses a ``Union`` the field takes the simpler type and ``__post_init__`` normalises the richer runtime values.
"""

# Field types are spelt `Optional[...]`/`List[...]`/`Dict[str, Any]` (the typing forms HfArgumentParser and OmegaConf
# both document); `_convert` below matches them through `typing.get_origin`.
# ruff: noqa: UP006, UP035, UP045

import contextlib
import copy
import dataclasses
import functools
import json
import logging
import math
import numbers
import os
import typing
import warnings
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Dict, List, Optional, Tuple

from omegaconf import DictConfig, ListConfig, OmegaConf
from transformers.pytorch_utils import is_torch_greater_or_equal_than_2_8
from transformers.trainer_utils import IntervalStrategy, SaveStrategy, SchedulerType
from transformers.training_args import OptimizerNames, trainer_log_levels
from transformers.utils import logging as hf_logging

logger = logging.getLogger(__name__)

__all__ = [
    "LIGHTNING_FIELDS",
    "SUPPORTED_ACCELERATORS",
    "SUPPORTED_OPTIMIZERS",
    "SUPPORTED_TRAIN_SAMPLING_STRATEGIES",
    "TrainingArguments",
    "coerce_training_args",
    "register_parser_types",
    "supported_accelerators",
    "supported_optimizers",
    "supported_strategies",
]

#: ``optim`` values hflight can build (see ``hflight.optim``); all are transformers ``OptimizerNames`` values.
SUPPORTED_OPTIMIZERS: Tuple[str, ...] = ("adamw_torch", "adamw_torch_fused", "adafactor", "sgd", "adagrad", "rmsprop")
#: ``train_sampling_strategy`` values hflight implements (transformers also has "batch_rebalance").
SUPPORTED_TRAIN_SAMPLING_STRATEGIES: Tuple[str, ...] = ("random", "sequential", "group_by_length")
#: ``accelerator`` names accepted by hflight (Lightning's names).
SUPPORTED_ACCELERATORS: Tuple[str, ...] = ("auto", "cpu", "gpu", "cuda", "mps", "tpu")
#: Fields that come from ``lightning.Trainer`` and have no transformers counterpart.
LIGHTNING_FIELDS: Tuple[str, ...] = ("accelerator", "devices", "strategy", "num_nodes")
#: ``include_num_input_tokens_seen`` values (booleans map to "all" / "no", as in transformers).
_INPUT_TOKENS_CHOICES: Tuple[str, ...] = ("all", "non_padding", "no")

# Same rule as transformers: the fused AdamW is the default optimizer from torch 2.8 on.
_DEFAULT_OPTIM = "adamw_torch_fused" if is_torch_greater_or_equal_than_2_8 else "adamw_torch"

# Dict-typed fields that also accept a JSON object string (as transformers' `_VALID_DICT_FIELDS`).
_JSON_DICT_FIELDS = ("lr_scheduler_kwargs", "activation_checkpointing_kwargs", "gradient_checkpointing_kwargs")

_TRUE_STRINGS = ("true", "yes", "y", "t", "1")
_FALSE_STRINGS = ("false", "no", "n", "f", "0")


def supported_strategies() -> Tuple[str, ...]:
    """Valid ``strategy`` names: "auto" and Lightning's registered strategies (hflight's backends, such as "ipu" and
    "ort", register there when ``hflight`` is imported)."""
    from lightning.pytorch.strategies import StrategyRegistry

    return ("auto", *StrategyRegistry.available_strategies())


def supported_accelerators() -> Tuple[str, ...]:
    """Valid ``accelerator`` names: Lightning's built-in ones and every registered accelerator (e.g. "ipu")."""
    from lightning.pytorch.accelerators import AcceleratorRegistry

    return tuple(dict.fromkeys((*SUPPORTED_ACCELERATORS, *sorted(AcceleratorRegistry.available_accelerators()))))


def supported_optimizers() -> Tuple[str, ...]:
    """Valid ``optim`` names: the optimizers ``hflight.optim`` can build (backends may add their own)."""
    from hflight.optim import OPTIMIZERS

    return tuple(OPTIMIZERS)


@dataclass
class TrainingArguments:
    """Training arguments of hflight: the supported subset of ``transformers.TrainingArguments`` (v5) plus Lightning's.

    Names, defaults and derived values match transformers 5.23, so scripts written for ``transformers.Trainer``
    carry over. Supported transformers fields, by group:

    * Output and duration: ``output_dir``, ``per_device_train_batch_size``, ``per_device_eval_batch_size``,
      ``num_train_epochs``, ``max_steps``, ``gradient_accumulation_steps``.
    * Optimisation: ``learning_rate``, ``weight_decay``, ``adam_beta1``, ``adam_beta2``, ``adam_epsilon``,
      ``max_grad_norm``, ``optim`` (one of ``SUPPORTED_OPTIMIZERS``), ``optim_args``, ``lr_scheduler_type``,
      ``lr_scheduler_kwargs``, ``warmup_steps`` (int steps, or a float in [0, 1) as a ratio of the total),
      ``label_smoothing_factor``, ``average_tokens_across_devices``.
    * Precision and memory: ``fp16``, ``bf16``, ``activation_checkpointing`` (+ ``_kwargs``) and its deprecated
      alias ``gradient_checkpointing`` (+ ``_kwargs``), ``torch_compile``.
    * Reproducibility: ``seed``, ``data_seed``, ``full_determinism``.
    * Data: ``train_sampling_strategy``, ``length_column_name``, ``remove_unused_columns``, ``label_names``,
      ``dataloader_num_workers``, ``dataloader_drop_last``, ``dataloader_pin_memory``,
      ``dataloader_persistent_workers``, ``dataloader_prefetch_factor``.
    * Logging: ``logging_strategy``, ``logging_steps``, ``logging_first_step``, ``logging_nan_inf_filter``,
      ``log_level``, ``disable_tqdm``, ``report_to``, ``run_name``, ``include_num_input_tokens_seen``,
      ``skip_memory_metrics``.
    * Evaluation: ``eval_strategy``, ``eval_steps``, ``eval_delay``, ``eval_on_start``, ``prediction_loss_only``,
      ``eval_accumulation_steps``, ``eval_do_concat_batches``, ``batch_eval_metrics``, ``include_for_metrics``.
    * Checkpoints: ``save_strategy``, ``save_steps``, ``save_total_limit``, ``save_only_model``,
      ``load_best_model_at_end``, ``metric_for_best_model``, ``greater_is_better``, ``ignore_data_skip``,
      ``restore_callback_states_from_checkpoint``, ``resume_from_checkpoint``.
    * Script flags: ``do_train``, ``do_eval``, ``do_predict``.

    Lightning extras (names and defaults of ``lightning.Trainer``): ``accelerator`` (one of
    ``SUPPORTED_ACCELERATORS`` or a Lightning ``Accelerator``), ``devices`` ("auto", an int, a string such as
    "0,1", or a list of device indices; "2" is normalised to ``2``), ``strategy`` (see ``supported_strategies()``, or
    a Lightning ``Strategy``), ``num_nodes``.

    After ``__post_init__`` the strategies and ``lr_scheduler_type``/``optim`` hold transformers' enums
    (``IntervalStrategy``, ``SaveStrategy``, ``SchedulerType``, ``OptimizerNames``); ``report_to`` is a list
    (``None``, "none" or ``["none"]`` give ``[]``, "all" every installed integration, and a comma-separated
    string is split). Dict fields accept a JSON object string (on the command line after
    ``register_parser_types(parser)``). Wrong types raise ``TypeError`` and unknown
    choices ``ValueError``, both naming the field. Hub, DDP/FSDP/DeepSpeed and device-tuning fields of
    transformers are not supported; ``coerce_training_args`` rejects a transformers instance that sets them.
    """

    # --- Output ---
    output_dir: Optional[str] = field(
        default=None, metadata={"help": "Where checkpoints and predictions are written ('trainer_output' if unset)."}
    )

    # --- Training duration and batch size ---
    per_device_train_batch_size: int = field(default=8, metadata={"help": "Batch size per device for training."})
    num_train_epochs: float = field(default=3.0, metadata={"help": "Total number of training epochs."})
    max_steps: int = field(
        default=-1, metadata={"help": "If > 0: total number of optimizer steps; overrides num_train_epochs."}
    )

    # --- Learning rate and scheduler ---
    learning_rate: float = field(default=5e-5, metadata={"help": "Initial learning rate."})
    lr_scheduler_type: str = field(
        default="linear", metadata={"help": "Scheduler type; one of transformers' SchedulerType values."}
    )
    lr_scheduler_kwargs: Optional[Dict[str, Any]] = field(
        default=None, metadata={"help": "Extra scheduler arguments (a dict, or a JSON object string)."}
    )
    warmup_steps: float = field(
        default=0, metadata={"help": "Linear warmup steps: an int, or a float in [0, 1) as a ratio of total steps."}
    )

    # --- Optimizer ---
    optim: str = field(
        default=_DEFAULT_OPTIM, metadata={"help": f"Optimizer; one of {', '.join(SUPPORTED_OPTIMIZERS)}."}
    )
    optim_args: Optional[str] = field(
        default=None, metadata={"help": "Extra optimizer arguments as 'key=value,key2=value2'."}
    )
    weight_decay: float = field(default=0.0, metadata={"help": "Weight decay (not applied to biases and norms)."})
    adam_beta1: float = field(default=0.9, metadata={"help": "Beta1 of Adam-type optimizers."})
    adam_beta2: float = field(default=0.999, metadata={"help": "Beta2 of Adam-type optimizers."})
    adam_epsilon: float = field(default=1e-8, metadata={"help": "Epsilon of Adam-type optimizers."})

    # --- Regularisation and stability ---
    gradient_accumulation_steps: int = field(
        default=1, metadata={"help": "Number of batches to accumulate gradients over before an optimizer step."}
    )
    average_tokens_across_devices: bool = field(
        default=True, metadata={"help": "All-reduce the token count across devices for the loss normalisation."}
    )
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient clipping norm; 0 disables clipping."})
    label_smoothing_factor: float = field(default=0.0, metadata={"help": "Label smoothing factor (0: none)."})

    # --- Mixed precision ---
    bf16: bool = field(default=False, metadata={"help": "bfloat16 mixed precision training."})
    fp16: bool = field(default=False, metadata={"help": "float16 mixed precision training."})

    # --- Activation checkpointing ---
    activation_checkpointing: Optional[bool] = field(
        default=None,
        metadata={"help": "Enable activation (gradient) checkpointing.", "nargs": "?", "const": True},
    )
    activation_checkpointing_kwargs: Optional[Dict[str, Any]] = field(
        default=None, metadata={"help": "Keyword arguments for activation checkpointing (dict or JSON string)."}
    )
    gradient_checkpointing: Optional[bool] = field(
        default=None,
        metadata={"help": "Deprecated alias of `activation_checkpointing`.", "nargs": "?", "const": True},
    )
    gradient_checkpointing_kwargs: Optional[Dict[str, Any]] = field(
        default=None, metadata={"help": "Deprecated alias of `activation_checkpointing_kwargs`."}
    )

    # --- Compilation ---
    torch_compile: bool = field(default=False, metadata={"help": "Compile the model with `torch.compile()`."})

    # --- Logging ---
    logging_strategy: str = field(default="steps", metadata={"help": "When to log: 'no', 'steps' or 'epoch'."})
    logging_steps: float = field(
        default=500, metadata={"help": "Log every X steps: an int, or a float in [0, 1) as a ratio of total steps."}
    )
    logging_first_step: bool = field(default=False, metadata={"help": "Also log the first global step."})
    logging_nan_inf_filter: bool = field(
        default=True, metadata={"help": "Drop NaN/Inf training losses from the logged average."}
    )
    include_num_input_tokens_seen: str = field(
        default="no",
        metadata={
            "help": "Track input tokens seen: 'all', 'non_padding' or 'no' (booleans map to 'all'/'no').",
            "nargs": "?",  # a bare `--include_num_input_tokens_seen` means "all", as transformers' bool flag
            "const": "all",
        },
    )
    log_level: str = field(
        default="passive",
        metadata={
            "help": "Log level of the main process ('passive' keeps the current one).",
            "choices": list(trainer_log_levels),
        },
    )
    disable_tqdm: Optional[bool] = field(
        default=None,
        metadata={"help": "Disable progress bars (default: when transformers' log level is above warning)."},
    )
    report_to: Optional[List[str]] = field(
        default=None,
        metadata={"help": "Integrations to report to: names, 'all', or 'none' (the default, also for None)."},
    )
    run_name: Optional[str] = field(default=None, metadata={"help": "Optional name of the run for loggers."})

    # --- Evaluation ---
    eval_strategy: str = field(default="no", metadata={"help": "When to evaluate: 'no', 'steps' or 'epoch'."})
    eval_steps: Optional[float] = field(
        default=None,
        metadata={"help": "Evaluate every X steps (int, or float in [0, 1) ratio); defaults to logging_steps."},
    )
    eval_delay: float = field(
        default=0, metadata={"help": "Epochs or steps to wait before the first evaluation, per eval_strategy."}
    )
    per_device_eval_batch_size: int = field(default=8, metadata={"help": "Batch size per device for evaluation."})
    prediction_loss_only: bool = field(
        default=False, metadata={"help": "Evaluation and prediction return the loss only."}
    )
    eval_on_start: bool = field(default=False, metadata={"help": "Evaluate once before training as a sanity check."})
    eval_do_concat_batches: bool = field(
        default=True, metadata={"help": "Concatenate predictions across batches (False: keep a list per batch)."}
    )
    eval_accumulation_steps: Optional[int] = field(
        default=None, metadata={"help": "Move predictions to the CPU every X evaluation steps."}
    )

    # --- Metrics ---
    include_for_metrics: List[str] = field(
        default_factory=list, metadata={"help": "Extra data passed to compute_metrics: 'inputs', 'loss'."}
    )
    batch_eval_metrics: bool = field(default=False, metadata={"help": "Compute evaluation metrics batch by batch."})

    # --- Checkpoints ---
    save_only_model: bool = field(
        default=False, metadata={"help": "Save model weights only (no optimizer/scheduler/RNG state)."}
    )
    save_strategy: str = field(default="steps", metadata={"help": "When to save: 'no', 'steps', 'epoch' or 'best'."})
    save_steps: float = field(
        default=500, metadata={"help": "Save every X steps: an int, or a float in [0, 1) as a ratio of total steps."}
    )
    save_total_limit: Optional[int] = field(
        default=None, metadata={"help": "Keep at most this many checkpoints in output_dir."}
    )

    # --- Best model ---
    load_best_model_at_end: bool = field(
        default=False, metadata={"help": "Load the best checkpoint at the end of training."}
    )
    metric_for_best_model: Optional[str] = field(
        default=None, metadata={"help": "Metric that ranks checkpoints (defaults to 'loss' where needed)."}
    )
    greater_is_better: Optional[bool] = field(
        default=None, metadata={"help": "Whether a larger metric is better (derived from the metric's name)."}
    )

    # --- Resuming ---
    ignore_data_skip: bool = field(
        default=False, metadata={"help": "On resume, do not skip the batches already seen in the current epoch."}
    )
    restore_callback_states_from_checkpoint: bool = field(
        default=False, metadata={"help": "Restore callback states saved in the checkpoint."}
    )

    # --- Reproducibility ---
    full_determinism: bool = field(default=False, metadata={"help": "Enable full determinism (slow; for debugging)."})
    seed: int = field(default=42, metadata={"help": "Random seed set at the beginning of training."})
    data_seed: Optional[int] = field(default=None, metadata={"help": "Seed for data samplers (default: seed)."})

    # --- Data loading ---
    dataloader_drop_last: bool = field(default=False, metadata={"help": "Drop the last incomplete batch."})
    dataloader_num_workers: int = field(
        default=0, metadata={"help": "Data loading worker processes (0: load in the main process)."}
    )
    dataloader_pin_memory: bool = field(default=True, metadata={"help": "Pin memory in data loaders."})
    dataloader_persistent_workers: bool = field(
        default=False, metadata={"help": "Keep data loader workers alive between epochs."}
    )
    dataloader_prefetch_factor: Optional[int] = field(
        default=None, metadata={"help": "Batches loaded in advance by each worker (needs workers > 0)."}
    )
    remove_unused_columns: bool = field(
        default=True, metadata={"help": "Drop dataset columns the model's forward does not accept."}
    )
    label_names: Optional[List[str]] = field(
        default=None, metadata={"help": "Keys of the inputs that hold the labels."}
    )
    train_sampling_strategy: str = field(
        default="random",
        metadata={
            "help": "Training sampler: 'random', 'sequential' or 'group_by_length'.",
            "choices": list(SUPPORTED_TRAIN_SAMPLING_STRATEGIES),
        },
    )
    length_column_name: str = field(
        default="length", metadata={"help": "Column with precomputed lengths for 'group_by_length'."}
    )

    # --- Debugging ---
    skip_memory_metrics: bool = field(default=True, metadata={"help": "Skip memory profiler metrics."})

    # --- Script flags ---
    do_train: bool = field(default=False, metadata={"help": "Run training (for scripts; unused by the Trainer)."})
    do_eval: bool = field(default=False, metadata={"help": "Run evaluation (set when eval_strategy is not 'no')."})
    do_predict: bool = field(default=False, metadata={"help": "Run prediction (for scripts; unused by the Trainer)."})
    resume_from_checkpoint: Optional[str] = field(
        default=None, metadata={"help": "Checkpoint folder to resume from (for scripts)."}
    )

    # --- Lightning ---
    accelerator: str = field(
        default="auto",
        metadata={"help": f"Lightning accelerator: {', '.join(SUPPORTED_ACCELERATORS)} or a registered one (ipu)."},
    )
    devices: str = field(
        default="auto", metadata={"help": "Lightning devices: 'auto', a count (e.g. 2), or indices such as '0,1'."}
    )
    strategy: str = field(
        default="auto", metadata={"help": "Lightning strategy, e.g. 'auto', 'ddp', 'fsdp', 'deepspeed', 'ipu', 'ort'."}
    )
    num_nodes: int = field(default=1, metadata={"help": "Number of nodes (machines) for distributed training."})

    def __post_init__(self):
        self._coerce_types()
        self._normalise()
        # Choices, converted to transformers' enums where transformers uses one.
        for name, (enum_cls, choices) in _CHOICES.items():
            setattr(self, name, _check_choice(name, getattr(self, name), enum_cls, choices()))
        self._derive()
        self._validate()

    def _coerce_types(self) -> None:
        """Coerce CLI strings and OmegaConf containers to the field types; anything else is a TypeError."""
        hints = _type_hints(type(self))
        for f in dataclasses.fields(self):
            if f.init:
                setattr(self, f.name, _check_type(f.name, getattr(self, f.name), hints[f.name]))

    def _normalise(self) -> None:
        """Defaults and normal forms, as transformers sets them (output_dir, JSON dict fields, renamed fields, ...)."""
        if self.output_dir is None:
            self.output_dir = "trainer_output"
            logger.info("No output directory specified, defaulting to 'trainer_output'.")
        self.output_dir = os.path.expanduser(self.output_dir)
        for name in _JSON_DICT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, _parse_json_dict(name, value))
        self._rename_checkpointing_fields()
        if self.disable_tqdm is None:
            self.disable_tqdm = (
                hf_logging.get_logger("transformers.training_args").getEffectiveLevel() > logging.WARNING
            )
        if isinstance(self.include_num_input_tokens_seen, bool):
            self.include_num_input_tokens_seen = "all" if self.include_num_input_tokens_seen else "no"
        elif self.include_num_input_tokens_seen.lower() in ("true", "false"):
            self.include_num_input_tokens_seen = "all" if self.include_num_input_tokens_seen.lower() == "true" else "no"
        self.report_to = _normalize_report_to(self.report_to)
        self.devices = _normalize_devices(self.devices)
        if isinstance(self.warmup_steps, float) and self.warmup_steps >= 1 and self.warmup_steps.is_integer():
            self.warmup_steps = int(self.warmup_steps)

    def _rename_checkpointing_fields(self) -> None:
        """transformers 5 renamed ``gradient_checkpointing(_kwargs)`` to ``activation_checkpointing(_kwargs)``: both
        names are accepted (the old ones with a FutureWarning) and kept equal."""
        for old, new in (
            ("gradient_checkpointing", "activation_checkpointing"),
            ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),
        ):
            if getattr(self, new) is None and getattr(self, old) is not None:
                message = f"`{old}` is deprecated and will be removed in v6. Use `{new}` instead."
                warnings.warn(message, FutureWarning, stacklevel=5)
                setattr(self, new, getattr(self, old))
            setattr(self, old, getattr(self, new))
        if self.activation_checkpointing is None:
            self.activation_checkpointing = self.gradient_checkpointing = False

    def _derive(self) -> None:
        """Values transformers derives from others (``do_eval``, ``eval_steps``, ``metric_for_best_model``, ...)."""
        if self.do_eval is False and self.eval_strategy != IntervalStrategy.NO:
            self.do_eval = True
        if self.eval_strategy == IntervalStrategy.STEPS and (self.eval_steps is None or self.eval_steps == 0):
            if self.logging_steps > 0:
                logger.info(f"using `logging_steps` to initialize `eval_steps` to {self.logging_steps}")
                self.eval_steps = self.logging_steps
            else:
                raise ValueError(
                    f"evaluation strategy {self.eval_strategy.value} requires either non-zero eval_steps "
                    "or logging_steps"
                )
        if (
            self.load_best_model_at_end
            or self.lr_scheduler_type in (SchedulerType.REDUCE_ON_PLATEAU, SchedulerType.GREEDY)
        ) and self.metric_for_best_model is None:
            self.metric_for_best_model = "loss"
        if self.greater_is_better is None and self.metric_for_best_model is not None:
            self.greater_is_better = not self.metric_for_best_model.endswith("loss")

    def _validate(self) -> None:
        """Value constraints and combinations: transformers' `_validate_args` plus hflight's range checks."""
        for name, (lower, description) in _LOWER_BOUNDS.items():
            value = getattr(self, name)
            if value is not None and value < lower:
                raise ValueError(f"{name} must be {description}, got {value!r}")

        if self.logging_strategy == IntervalStrategy.STEPS and self.logging_steps == 0:
            raise ValueError("logging strategy 'steps' requires non-zero logging_steps")
        for kind, strategy_cls in (("logging", IntervalStrategy), ("eval", IntervalStrategy), ("save", SaveStrategy)):
            steps = getattr(self, f"{kind}_steps")
            if getattr(self, f"{kind}_strategy") == strategy_cls.STEPS and steps > 1:
                if steps != int(steps):
                    raise ValueError(f"{kind}_steps must be an integer if bigger than 1: {steps}")
                setattr(self, f"{kind}_steps", int(steps))

        if self.load_best_model_at_end and self.save_strategy != SaveStrategy.BEST:
            if self.eval_strategy != self.save_strategy:
                raise ValueError(
                    "load_best_model_at_end requires the save and eval strategy to match, except when "
                    f"save_strategy='best', but found eval_strategy={self.eval_strategy.value!r} and "
                    f"save_strategy={self.save_strategy.value!r}"
                )
            if self.eval_strategy == IntervalStrategy.STEPS and self.save_steps % self.eval_steps != 0:
                if self.eval_steps < 1 or self.save_steps < 1:
                    if not (self.eval_steps < 1 and self.save_steps < 1):
                        raise ValueError(
                            "load_best_model_at_end requires save_steps to be a multiple of eval_steps, which cannot "
                            f"be guaranteed when mixing ratio and absolute steps: save_steps={self.save_steps}, "
                            f"eval_steps={self.eval_steps}"
                        )
                    scale = 1_000_000  # integer arithmetic, as transformers, to avoid float remainders
                    if (self.save_steps * scale) % (self.eval_steps * scale) != 0:
                        raise ValueError(
                            "load_best_model_at_end requires save_steps to be a multiple of eval_steps, but "
                            f"save_steps={self.save_steps} is not a multiple of eval_steps={self.eval_steps}"
                        )
                else:
                    raise ValueError(
                        "load_best_model_at_end requires save_steps to be a round multiple of eval_steps, but "
                        f"save_steps={self.save_steps} is not a round multiple of eval_steps={self.eval_steps}"
                    )

        if self.fp16 and self.bf16:
            raise ValueError("fp16 and bf16: at most one of them can be True, but not both")
        for scheduler in (SchedulerType.REDUCE_ON_PLATEAU, SchedulerType.GREEDY):
            if self.lr_scheduler_type == scheduler and self.eval_strategy == IntervalStrategy.NO:
                raise ValueError(f"lr_scheduler_type {scheduler.value!r} requires an eval_strategy other than 'no'")
        if self.dataloader_num_workers == 0 and self.dataloader_prefetch_factor is not None:
            raise ValueError(
                "dataloader_prefetch_factor can only be set when data is loaded in worker processes, i.e. when "
                "dataloader_num_workers > 0"
            )

    # ------------------------------------------------------------------ conversions

    @classmethod
    def from_hf(cls, hf_args: Any) -> "TrainingArguments":
        """Build hflight arguments from a ``transformers.TrainingArguments`` (or a subclass) instance.

        Every supported field is copied (enums as their values); ``use_cpu=True`` becomes ``accelerator="cpu"``;
        the other Lightning fields get their defaults.

        Raises:
            TypeError: ``hf_args`` is not a transformers ``TrainingArguments``.
            ValueError: a field hflight does not support is set to a non-default value (all such fields are named).
        """
        from transformers import TrainingArguments as HFTrainingArguments

        if not isinstance(hf_args, HFTrainingArguments):
            raise TypeError(f"from_hf expects a transformers.TrainingArguments, got {type(hf_args).__name__}")
        unsupported = _unsupported_hf_settings(hf_args)
        if unsupported:
            details = ", ".join(f"{name}={value!r}" for name, value in unsupported)
            raise ValueError(
                f"{type(hf_args).__name__} sets fields that hflight does not support: {details}. Remove them "
                "(or leave them at their defaults) to train with hflight."
            )
        kwargs = {name: _plain(getattr(hf_args, name)) for name in _shared_field_names()}
        if getattr(hf_args, "use_cpu", False):
            kwargs["accelerator"] = "cpu"
        return cls(**kwargs)

    @classmethod
    def from_args(cls, args: "TrainingArguments | None", owner: str) -> "TrainingArguments":
        """``args`` as this class, for a trainer with its own arguments class (``IPUTrainer``, ``ORTTrainer``): None
        gives the defaults, an instance of this class is used as it is, other hflight ``TrainingArguments`` are
        copied field by field (the new class's own fields get their defaults).

        Raises:
            TypeError: ``args`` is not an hflight ``TrainingArguments`` (``owner`` names the trainer).
        """
        if args is None:
            return cls()
        if isinstance(args, cls):
            return args
        if isinstance(args, TrainingArguments):
            return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init})
        raise TypeError(f"{owner}: args must be {cls.__name__} or TrainingArguments, got {type(args).__name__}")

    def to_dict(self) -> Dict[str, Any]:
        """The init fields as a dict, enums replaced by their values (Lightning objects by their class name)."""
        d = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self) if f.init}
        for name in ("accelerator", "strategy"):
            if not isinstance(d[name], str):
                d[name] = type(d[name]).__name__
        return d

    def to_picklable(self) -> "TrainingArguments":
        """A shallow copy for ``torch.save`` (``training_args.bin``): Lightning accelerator and strategy objects are
        replaced by their registered names, so the file never holds a live strategy (its model, device handles)."""
        clone = copy.copy(self)
        for name, attribute in (("accelerator", "name"), ("strategy", "strategy_name")):
            value = getattr(clone, name)
            if not isinstance(value, str):
                registered = getattr(value, attribute, None)
                registered = registered() if callable(registered) else registered
                setattr(clone, name, registered if isinstance(registered, str) else "auto")
        return clone

    def to_json_string(self) -> str:
        """The arguments as an indented JSON string."""
        return json.dumps(self.to_dict(), indent=2)

    def to_sanitized_dict(self) -> Dict[str, Any]:
        """``to_dict()`` plus the batch sizes, non-scalar values as strings (for TensorBoard's hparams)."""
        d = {**self.to_dict(), "train_batch_size": self.train_batch_size, "eval_batch_size": self.eval_batch_size}
        return {k: v if type(v) in (bool, int, float, str) else str(v) for k, v in d.items()}

    # ------------------------------------------------------------------ derived values

    def get_warmup_steps(self, num_training_steps: int) -> int:
        """Number of warmup steps: ``warmup_steps`` if >= 1, else that ratio of ``num_training_steps`` rounded up."""
        return int(self.warmup_steps) if self.warmup_steps >= 1 else math.ceil(num_training_steps * self.warmup_steps)

    @property
    def train_batch_size(self) -> int:
        """Training batch size of one process (hflight never uses ``DataParallel``)."""
        return self.per_device_train_batch_size

    @property
    def eval_batch_size(self) -> int:
        """Evaluation batch size of one process."""
        return self.per_device_eval_batch_size

    @property
    def world_size(self) -> int:
        """Number of processes: from ``torch.distributed`` once initialised, else ``WORLD_SIZE`` (default 1)."""
        dist = _initialized_dist()
        if dist is not None:
            return dist.get_world_size()
        return int(os.environ.get("WORLD_SIZE", "1"))

    @property
    def process_index(self) -> int:
        """Global rank: ``torch.distributed``, else ``RANK`` (torchrun), else Lightning's node/local ranks."""
        dist = _initialized_dist()
        if dist is not None:
            return dist.get_rank()
        if "RANK" in os.environ:
            return int(os.environ["RANK"])
        per_node = max(1, self.world_size // max(1, self.num_nodes))
        return int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0"))) * per_node + self.local_process_index

    @property
    def local_process_index(self) -> int:
        """Rank of this process on its node (``LOCAL_RANK``, set by torchrun and Lightning; default 0)."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def should_log(self) -> bool:
        """Whether this process logs: the main process of each node (transformers' ``log_on_each_node=True``)."""
        return self.local_process_index == 0

    @property
    def should_save(self) -> bool:
        """Whether this process writes checkpoints: the global main process (``save_on_each_node=False``)."""
        return self.process_index == 0

    def get_process_log_level(self) -> int:
        """Log level of this process: ``log_level`` on logging processes, ``warning`` on replicas."""
        level = trainer_log_levels[self.log_level]
        main_level = hf_logging.get_verbosity() if level == -1 else level
        return main_level if self.should_log else logging.WARNING

    @contextlib.contextmanager
    def main_process_first(self, local: bool = True, desc: str = "work"):
        """Run the body on the main process first, then on the replicas (a no-op outside ``torch.distributed``).

        Args:
            local: main process of each node (True) or of the whole job (False).
            desc: a description of the work, for debug logs.
        """
        dist = _initialized_dist()
        if dist is None or self.world_size <= 1:
            yield
            return
        is_main = (self.local_process_index if local else self.process_index) == 0
        try:
            if not is_main:
                logger.debug(f"{self.process_index}: waiting for the main process to perform {desc}")
                dist.barrier()
            yield
        finally:
            if is_main:
                dist.barrier()


# ---------------------------------------------------------------------- helpers


def coerce_training_args(args: Any) -> TrainingArguments:
    """hflight ``TrainingArguments`` from ``args``: ours unchanged, a transformers one converted, None as default.

    Raises:
        TypeError: ``args`` is neither of these.
        ValueError: a transformers instance sets fields hflight does not support (see ``TrainingArguments.from_hf``).
    """
    if isinstance(args, TrainingArguments):
        return args
    if args is None:
        logger.info("No `TrainingArguments` passed, using `output_dir=tmp_trainer`.")
        return TrainingArguments(output_dir="tmp_trainer")
    from transformers import TrainingArguments as HFTrainingArguments

    if isinstance(args, HFTrainingArguments):
        return TrainingArguments.from_hf(args)
    raise TypeError(
        "args must be an hflight.TrainingArguments, a transformers.TrainingArguments or None, "
        f"got {type(args).__name__}"
    )


def register_parser_types(parser: Any) -> Any:
    """Let an argparse/``HfArgumentParser`` parse the dict fields (``--lr_scheduler_kwargs '{"a": 1}'``) as JSON.

    argparse cannot call ``Dict[str, Any]`` on a string, so without this the dict fields can only be set from
    JSON/YAML files (``parse_json_file``/``parse_yaml_file``) or in Python. Returns ``parser``.
    """
    parser.register("type", Dict[str, Any], lambda text: _parse_json_dict("dict field", text))
    return parser


# Choice tables: field -> (transformers enum or None, function returning the valid values).
_CHOICES: Dict[str, Tuple[Optional[type], Callable[[], Tuple[str, ...]]]] = {
    "lr_scheduler_type": (SchedulerType, lambda: tuple(s.value for s in SchedulerType)),
    "optim": (OptimizerNames, supported_optimizers),
    "logging_strategy": (IntervalStrategy, lambda: tuple(s.value for s in IntervalStrategy)),
    "eval_strategy": (IntervalStrategy, lambda: tuple(s.value for s in IntervalStrategy)),
    "save_strategy": (SaveStrategy, lambda: tuple(s.value for s in SaveStrategy)),
    "train_sampling_strategy": (None, lambda: SUPPORTED_TRAIN_SAMPLING_STRATEGIES),
    "include_num_input_tokens_seen": (None, lambda: _INPUT_TOKENS_CHOICES),
    "log_level": (None, lambda: tuple(trainer_log_levels)),
    "accelerator": (None, supported_accelerators),
    "strategy": (None, supported_strategies),
}

# Lower bounds: field -> (smallest valid value, wording for the error).
_LOWER_BOUNDS: Dict[str, Tuple[float, str]] = {
    "per_device_train_batch_size": (1, "a positive integer"),
    "per_device_eval_batch_size": (1, "a positive integer"),
    "gradient_accumulation_steps": (1, "a positive integer"),
    "eval_accumulation_steps": (1, "a positive integer or None"),
    "warmup_steps": (0, ">= 0 (an int, or a float in [0, 1) for a ratio)"),
    "num_nodes": (1, "a positive integer"),
    "dataloader_num_workers": (0, ">= 0"),
}

# Runtime values a field accepts beyond its annotation (the annotation stays parser-friendly).
_EXTRA_TYPES: Dict[str, Tuple[type, ...]] = {
    "devices": (int, list, tuple),
    "report_to": (str,),
    "include_num_input_tokens_seen": (bool,),
    **{name: (str,) for name in _JSON_DICT_FIELDS},
}


@functools.cache
def _type_hints(cls: type) -> Dict[str, Any]:
    return typing.get_type_hints(cls)


def _describe(hint: Any) -> str:
    """A readable name for a type hint: ``float``, ``Optional[int]``, ``List[str]``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        return f"Optional[{_describe(next(a for a in args if a is not type(None)))}]"
    if origin in (list, List):
        return f"List[{_describe(args[0])}]"
    if origin in (dict, Dict):
        return "Dict[str, Any]"
    return getattr(hint, "__name__", str(hint))


def _check_type(name: str, value: Any, hint: Any) -> Any:
    """``value`` checked against ``hint`` (numeric and boolean strings converted), else a ``TypeError``."""
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=True)
    extra = _EXTRA_TYPES.get(name, ())
    if name in ("accelerator", "strategy") and not isinstance(value, str):
        extra = _lightning_object_types(name)
    if isinstance(value, extra) and (bool in extra or not isinstance(value, bool)):
        return list(value) if isinstance(value, tuple) else value
    converted = _convert(value, hint)
    if converted is _INVALID:
        expected = " or ".join([_describe(hint), *(t.__name__ for t in extra)])
        raise TypeError(f"TrainingArguments.{name} expects {expected}, got {value!r} ({type(value).__name__})")
    return converted


_INVALID = object()


def _convert(value: Any, hint: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:  # Optional[X]
        return None if value is None else _convert(value, next(a for a in args if a is not type(None)))
    if origin in (list, List):
        if not isinstance(value, (list, tuple)):
            return _INVALID
        items = [_convert(v, args[0]) for v in value]
        return _INVALID if any(i is _INVALID for i in items) else items
    if origin in (dict, Dict):
        return dict(value) if isinstance(value, dict) else _INVALID
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE_STRINGS + _FALSE_STRINGS:
            return value.lower() in _TRUE_STRINGS
        return _INVALID
    if hint is int:
        if isinstance(value, str):
            value = _number(value)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return _INVALID
        return int(value) if float(value).is_integer() else _INVALID
    if hint is float:
        if isinstance(value, str):
            value = _number(value)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return _INVALID
        return value if isinstance(value, (int, float)) else float(value)
    if hint is str:
        return value if isinstance(value, str) else _INVALID
    return value


def _number(text: str) -> Any:
    """``"8"`` -> 8, ``"1e-3"`` -> 0.001; anything else unchanged (and then rejected)."""
    for parse in (int, float):
        try:
            return parse(text.strip())
        except ValueError:
            pass
    return text


def _lightning_object_types(name: str) -> Tuple[type, ...]:
    """Lightning ``Accelerator``/``Strategy`` instances are accepted in place of their names."""
    if name == "accelerator":
        from lightning.pytorch.accelerators import Accelerator

        return (Accelerator,)
    from lightning.pytorch.strategies import Strategy

    return (Strategy,)


def _check_choice(name: str, value: Any, enum_cls: Optional[type], choices: Tuple[str, ...]) -> Any:
    """``value`` as a member of ``enum_cls`` (or the plain string); an unknown value raises ``ValueError``."""
    if not isinstance(value, str):  # a Lightning Accelerator/Strategy instance
        return value
    lookup = {c: c for c in choices}
    if enum_cls is not None:
        for member in enum_cls:
            if member.value in lookup:
                # Values, and the names OmegaConf writes for enums ("IntervalStrategy.STEPS", "STEPS").
                for key in (member.value, member.name, f"{enum_cls.__name__}.{member.name}"):
                    lookup[key] = member
    key = value.value if isinstance(value, Enum) else value
    if key not in lookup:
        raise ValueError(f"Unknown {name} {key!r}; valid choices are: {', '.join(choices)}")
    return lookup[key]


def _parse_json_dict(name: str, text: str) -> Dict[str, Any]:
    """A JSON object string as a dict, with string values converted as transformers does."""
    from transformers.training_args import _convert_str_dict

    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise TypeError(f"TrainingArguments.{name} expects a dict or a JSON object string, got {text!r}") from err
    if not isinstance(value, dict):
        raise TypeError(f"TrainingArguments.{name} expects a dict or a JSON object string, got {text!r}")
    return _convert_str_dict(value)


def _normalize_report_to(value: Any) -> List[str]:
    if value is None:
        return []
    names = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else list(value)
    if names == ["all"]:
        from transformers.integrations import get_available_reporting_integrations

        return list(get_available_reporting_integrations())
    if names == ["none"]:
        return []
    return names


def _normalize_devices(value: Any) -> Any:
    """``"2"`` -> 2 and ``"-1"`` -> -1 for Lightning; "auto", "0,1", ints and lists stay as they are."""
    if isinstance(value, str):
        text = value.strip()
        if text.lstrip("-").isdigit():
            return int(text)
        return text
    return value


def _initialized_dist() -> Any:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _plain(value: Any) -> Any:
    """Enums replaced by their values, in containers too (containers are copied)."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


# ---------------------------------------------------------------------- transformers conversion

# transformers fields hflight ignores: `local_rank` is set by the deprecated launcher (ranks come from env vars),
# `use_cpu` is translated to `accelerator="cpu"` by `from_hf`.
_IGNORED_HF_FIELDS = ("local_rank", "use_cpu")


def _shared_field_names() -> List[str]:
    return [f.name for f in dataclasses.fields(TrainingArguments) if f.init and f.name not in LIGHTNING_FIELDS]


def _hf_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _is_hf_default(hf_args: Any, name: str, value: Any, default: Any) -> bool:
    """Whether ``value`` is transformers' default, counting the values its ``__post_init__`` derives itself."""
    derived = _HF_DERIVED_DEFAULTS.get(name)
    if derived is not None and derived(hf_args, value):
        return True
    try:
        return bool(value == default) or _plain(value) == _plain(default)
    except Exception:  # noqa: BLE001 - objects without a usable __eq__ count as changed
        return False


def _default_accelerator_config(hf_args: Any, value: Any) -> bool:
    if value is None:
        return True
    from transformers.trainer_pt_utils import AcceleratorConfig

    return value == AcceleratorConfig()


def _derived_compile_backend(hf_args: Any, value: Any) -> bool:
    if value is None or not hf_args.torch_compile:
        return value is None
    from transformers.utils import is_torch_hpu_available, is_torch_neuron_available

    if not hf_args.use_cpu and is_torch_hpu_available():
        return value == "hpu_backend"
    if not hf_args.use_cpu and is_torch_neuron_available():
        return value == "neuron"
    return value == "inductor"


def _derived_mp_context(hf_args: Any, value: Any) -> bool:
    from transformers.utils import is_torch_mps_available

    return value is None or (value == "fork" and hf_args.dataloader_num_workers > 1 and is_torch_mps_available())


# Fields whose value transformers' __post_init__ rewrites from its default: field -> "is this still the default?".
_HF_DERIVED_DEFAULTS: Dict[str, Callable[[Any, Any], bool]] = {
    "accelerator_config": _default_accelerator_config,
    "debug": lambda hf_args, value: value in ("", None) or list(value) == [],
    "torch_compile_backend": _derived_compile_backend,
    "dataloader_multiprocessing_context": _derived_mp_context,
}


def _unsupported_hf_settings(hf_args: Any) -> List[Tuple[str, Any]]:
    """(name, value) of every field of ``hf_args`` that hflight lacks and that differs from its default."""
    ours = {f.name for f in dataclasses.fields(TrainingArguments)}
    found = []
    for f in dataclasses.fields(hf_args):
        if not f.init or f.name in ours or f.name in _IGNORED_HF_FIELDS:
            continue
        value = getattr(hf_args, f.name)
        if not _is_hf_default(hf_args, f.name, value, _hf_default(f)):
            found.append((f.name, value))
    return found
