"""``IPUTrainer`` and ``IPUTrainingArguments``: optimum-graphcore's API as an hflight ``Trainer`` on the IPU strategy.

Code written for optimum-graphcore changes one import::

    from hflight.ipu import IPUConfig, IPUTrainer, IPUTrainingArguments   # was: from optimum.graphcore import ...

    trainer = IPUTrainer(model, ipu_config, args, data_collator, eval_data_collator, train_dataset, eval_dataset,
                         tokenizer, model_init, compute_metrics, callbacks, optimizers, preprocess_logits_for_metrics)

The trainer is the facade with an :class:`~hflight.ipu.IPUStrategy` built from the ``IPUConfig`` and the IPU
arguments (``n_ipu``, ``ipu_config_overrides``, ``fp32``, ``loss_scaling``, ``pad_on_batch_axis``, ...); every
transformers callback event, checkpoint file and metric key is the facade's. As in optimum-graphcore, the default
optimizer is poptorch's AdamW without bias correction (LAMB with ``lamb=True``), models train in float16 unless
``fp32=True``, the dataloader getters return ``poptorch.DataLoader``s of combined batches, the state is an
:class:`IPUTrainerState`, and a ``gradient_accumulation_steps`` given in the arguments (even 1) overrides the
``IPUConfig``'s. Differences: ``grad_norm`` is not logged (gradients exist only on the device, where
``max_grad_norm`` clips them), and ``compile_only=True`` returns from ``train()``/``evaluate()`` after compiling
instead of exiting the process.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader
from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import TrainOutput

from hflight.arguments import optimizers as optim
from hflight.arguments.training_args import TrainingArguments, field_values
from hflight.ipu.accelerator import IPUAccelerator
from hflight.ipu.config import IPUConfig
from hflight.ipu.precision import IPUPrecision
from hflight.ipu.strategy import IPUStrategy
from hflight.trainer.facade import Trainer

log = logging.getLogger(__name__)

__all__ = ["IPUTrainer", "IPUTrainerState", "IPUTrainingArguments"]

# ruff: noqa: UP045 - dataclass field types stay parser-friendly (HfArgumentParser, OmegaConf)

#: n_ipu values optimum-graphcore accepts.
ALLOWED_N_IPU = (1, 2, 4, 8, 16, 32, 64, 128)
DATALOADER_MODES = ("sync", "async", "async_rebatched")


@dataclass
class IPUTrainerState(TrainerState):
    """optimum-graphcore's trainer state: transformers' ``TrainerState`` plus ``start_time``, the ``time.time()`` at
    which training first started (-1 before; kept in ``trainer_state.json``, so a resumed run keeps the first start).
    """

    start_time: float = -1.0


@dataclass
class IPUTrainingArguments(TrainingArguments):
    """hflight's ``TrainingArguments`` plus optimum-graphcore's IPU fields.

    As in optimum-graphcore, ``gradient_accumulation_steps`` defaults to None (not given): a value given, even 1,
    overrides the ``IPUConfig``'s, None leaves the ``IPUConfig``'s and reads as 1 afterwards. It, ``auto_loss_scaling``
    and ``gradient_checkpointing`` are appended to ``ipu_config_overrides``, which ``IPUTrainer`` applies to its
    ``IPUConfig``. ``fp16=True`` selects ``16-mixed`` (float32 optimizer state), ``fp32=True`` ``32-true``, and the
    default is optimum-graphcore's float16 (``16-true``).
    """

    gradient_accumulation_steps: Optional[int] = field(
        default=None,
        metadata={
            "help": "Number of update steps to accumulate before performing a backward/update pass (on the IPU). "
            "When given, it overrides the IPU config's value."
        },
    )
    ipu_config_name: Optional[str] = field(
        default=None, metadata={"help": "Pretrained IPU config name or path, if not the same as the model's."}
    )
    n_ipu: Optional[int] = field(
        default=None, metadata={"help": "Number of IPUs: sets the replication factors (n_ipu // IPUs per replica)."}
    )
    fp32: bool = field(default=False, metadata={"help": "Train in float32 instead of float16."})
    lamb: bool = field(default=False, metadata={"help": "Use LAMB instead of AdamW."})
    lamb_no_bias_correction: bool = field(default=False, metadata={"help": "Use LAMB without bias correction."})
    loss_scaling: Optional[float] = field(
        default=None, metadata={"help": "Loss scaling factor (the initial one with auto_loss_scaling)."}
    )
    auto_loss_scaling: bool = field(default=False, metadata={"help": "Automatic loss scaling (experimental)."})
    dataloader_mode: str = field(
        default="sync", metadata={"help": "poptorch data loading mode.", "choices": list(DATALOADER_MODES)}
    )
    compile_only: bool = field(default=False, metadata={"help": "Only compile the executables, then stop."})
    ipu_config_overrides: Optional[str] = field(
        default=None,
        metadata={"help": "Override IPU config values: 'device_iterations=4,gradient_accumulation_steps=64'."},
    )
    pad_on_batch_axis: bool = field(
        default=False, metadata={"help": "Pad each evaluation batch to the combined batch size by repeating rows."}
    )

    def __post_init__(self) -> None:
        accumulation_given = self.gradient_accumulation_steps is not None
        if not accumulation_given:
            self.gradient_accumulation_steps = 1
        super().__post_init__()
        if self.dataloader_mode not in DATALOADER_MODES:
            raise ValueError(
                f"IPUTrainingArguments.dataloader_mode must be one of {', '.join(DATALOADER_MODES)}, "
                f"got {self.dataloader_mode!r}"
            )
        if self.n_ipu is not None and self.n_ipu not in ALLOWED_N_IPU:
            raise ValueError(f"IPUTrainingArguments.n_ipu must be one of {ALLOWED_N_IPU}, got {self.n_ipu}")
        if self.bf16:
            raise ValueError("IPUTrainingArguments: bf16 is not available on the IPU; use fp16=True or fp32=True.")
        if self.fp32 and self.fp16:
            raise ValueError("IPUTrainingArguments: fp32=True and fp16=True contradict each other; choose one.")
        overrides = [f"gradient_accumulation_steps={self.gradient_accumulation_steps}"] if accumulation_given else []
        if self.auto_loss_scaling:
            overrides.append(f"auto_loss_scaling={self.auto_loss_scaling}")
        if self.gradient_checkpointing:
            overrides.append("recompute_checkpoint_every_layer=True")
        if overrides:
            self.ipu_config_overrides = ",".join(filter(None, [self.ipu_config_overrides, *overrides]))

    @classmethod
    def from_args(cls, args: TrainingArguments | None, owner: str) -> IPUTrainingArguments:
        """``args`` as IPU arguments; plain ``TrainingArguments`` are copied field by field, their default
        ``gradient_accumulation_steps=1`` read as not given (it then leaves the ``IPUConfig``'s value)."""
        if isinstance(args, TrainingArguments) and not isinstance(args, cls) and args.gradient_accumulation_steps == 1:
            return cls(**{**field_values(cls, args)[0], "gradient_accumulation_steps": None})
        return super().from_args(args, owner)

    @property
    def ipu_precision(self) -> str:
        """The :class:`~hflight.ipu.IPUPrecision` these arguments ask for."""
        if self.fp32:
            return "32-true"
        return "16-mixed" if self.fp16 else "16-true"


def resolve_ipu_config(ipu_config: IPUConfig | None, args: IPUTrainingArguments) -> IPUConfig:
    """The run's IPUConfig, in optimum-graphcore's order: the given one (or ``args.ipu_config_name``), then the
    replication factors from ``n_ipu``, then ``args.ipu_config_overrides``, then the seed.

    Raises:
        ValueError: ``n_ipu`` is smaller than the IPUs one replica needs (replication factor 0, as optimum-graphcore).
    """
    if ipu_config is None:
        ipu_config = IPUConfig.from_pretrained(args.ipu_config_name) if args.ipu_config_name else IPUConfig()
    config = copy.deepcopy(ipu_config)
    if args.n_ipu is not None:
        if config.replication_factor > 1 or config.inference_replication_factor > 1:
            log.warning("IPUTrainer: n_ipu=%d overrides the IPUConfig's replication factors.", args.n_ipu)
        try:
            config.replication_factor = args.n_ipu // config.ipus_per_replica
            config.inference_replication_factor = args.n_ipu // config.inference_ipus_per_replica
        except ValueError as exc:
            raise ValueError(
                f"n_ipu={args.n_ipu} is smaller than the IPUs one replica uses (ipus_per_replica="
                f"{config.ipus_per_replica}, inference_ipus_per_replica={config.inference_ipus_per_replica}): {exc}"
            ) from exc
    if args.ipu_config_overrides:
        log.info("Overriding IPU config: %s", args.ipu_config_overrides)
        config.update_from_string(args.ipu_config_overrides)
    config.seed = args.seed
    return config


class IPUTrainer(Trainer):
    """optimum-graphcore's ``IPUTrainer`` signature on hflight's facade and the IPU strategy."""

    def __init__(
        self,
        model: nn.Module | None = None,
        ipu_config: IPUConfig | None = None,
        args: TrainingArguments | None = None,
        data_collator: Callable | None = None,
        eval_data_collator: Callable | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        tokenizer: Any = None,
        model_init: Callable[..., nn.Module] | None = None,
        compute_metrics: Callable[[Any], dict] | None = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, Any] = (None, None),
        preprocess_logits_for_metrics: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        args = IPUTrainingArguments.from_args(args, "IPUTrainer")
        self.ipu_config = resolve_ipu_config(ipu_config, args)
        self.ipu_strategy = IPUStrategy(
            self.ipu_config,
            pad_on_batch_axis=args.pad_on_batch_axis,
            compile_only=args.compile_only,
            loss_scaling=args.loss_scaling,
            dataloader_mode=args.dataloader_mode,
            # an explicit accelerator="ipu" in args is Lightning's to resolve; "auto" would pick the CPU
            accelerator=IPUAccelerator() if args.accelerator == "auto" else None,
            precision_plugin=IPUPrecision(args.ipu_precision),
        )
        self.lightning_strategy = self.ipu_strategy
        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=tokenizer,
            model_init=model_init,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )
        self.eval_data_collator = eval_data_collator if eval_data_collator is not None else self.data_collator

    # ---- evaluation batches through eval_data_collator ------------------------------------------------------------
    def _get_dataloader(
        self,
        dataset: Any,
        description: str,
        batch_size: int,
        sampler_fn: Callable[[Any], Any] | None = None,
        is_training: bool = False,
        dataloader_key: str | None = None,
    ) -> DataLoader:
        loader = super()._get_dataloader(dataset, description, batch_size, sampler_fn, is_training, dataloader_key)
        if not is_training:
            loader.collate_fn = self.eval_data_collator
        return loader

    # ---- loaders of combined batches, as optimum-graphcore's getters return them ------------------------------------
    def get_train_dataloader(self) -> DataLoader:
        """A ``poptorch.DataLoader`` whose batches are combined (micro-batch x replication x gradient accumulation x
        device iterations): what one call of the training executable consumes."""
        return self.ipu_strategy.hf_prepare_loader(super().get_train_dataloader(), training=True)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        """A ``poptorch.DataLoader`` of combined inference batches (micro-batch x inference replication x inference
        device iterations), collated by ``eval_data_collator``."""
        return self.ipu_strategy.hf_prepare_loader(super().get_eval_dataloader(eval_dataset), training=False)

    def get_test_dataloader(self, test_dataset: Any) -> DataLoader:
        """As :meth:`get_eval_dataloader`, for ``test_dataset``."""
        return self.ipu_strategy.hf_prepare_loader(super().get_test_dataloader(test_dataset), training=False)

    # ---- the state: optimum-graphcore's IPUTrainerState ------------------------------------------------------------
    @property
    def state(self) -> IPUTrainerState:
        return self.ipu_trainer_state

    @state.setter
    def state(self, state: TrainerState) -> None:
        if type(state) is TrainerState:
            # the facade builds plain states; the IPU state only adds `start_time` (its class default: -1), so the
            # object itself becomes one and whoever holds it keeps holding the trainer's state
            state.__class__ = IPUTrainerState
        if getattr(self, "is_in_train", False) and getattr(state, "start_time", 0.0) < 0:
            state.start_time = time.time()
        self.ipu_trainer_state = state

    # ---- optimizer: poptorch's, as optimum-graphcore builds it ------------------------------------------------------
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is not None:
            return self.optimizer
        poptorch_optim = self.ipu_strategy.poptorch.optim
        args, model = self.args, self.model if model is None else model
        dtypes = self.ipu_strategy.precision_plugin.optimizer_dtypes()
        common = {"lr": args.learning_rate, "loss_scaling": args.loss_scaling, **dtypes}
        if args.lamb or args.lamb_no_bias_correction:
            optimizer = poptorch_optim.LAMB(
                _lamb_groups(model, args.weight_decay),
                betas=(args.adam_beta1, args.adam_beta2),
                eps=args.adam_epsilon,
                max_weight_norm=None,
                bias_correction=not args.lamb_no_bias_correction,
                **common,
            )
            optimizer.variable_attrs.markAsConstant("max_weight_norm")
        else:
            max_norm = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
            optimizer = poptorch_optim.AdamW(
                optim.grouped_parameters(model, args.weight_decay),
                betas=(args.adam_beta1, args.adam_beta2),
                eps=args.adam_epsilon,
                bias_correction=False,
                max_grad_norm=max_norm,
                **common,
            )
        optimizer.variable_attrs.markAsConstant("weight_decay")
        self.optimizer = optimizer
        return optimizer

    # ---- compile_only --------------------------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, **kwargs: Any) -> TrainOutput:
        if self.args.compile_only:
            log.info("compile_only=True: compiling the executables, then stopping.")
            self.ipu_strategy.compile_executables(self, training=True, evaluation=self.eval_dataset is not None)
            return TrainOutput(self.state.global_step, 0.0, {})
        return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"):
        if self.args.compile_only:
            if eval_dataset is not None:
                self.eval_dataset = eval_dataset
            self.ipu_strategy.compile_executables(self, training=False, evaluation=True)
            return {}
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)


def _lamb_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """optimum-graphcore's LAMB groups: decayed weights; biases without LAMB's trust ratio; the rest."""
    decay = set(optim.decay_parameter_names(model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    biases = {n for n, _ in named if "bias" in n}
    return [
        {"params": [p for n, p in named if n in decay and n not in biases], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n in biases], "weight_decay": 0.0, "max_weight_norm": 0.0},
        {"params": [p for n, p in named if n not in decay and n not in biases], "weight_decay": 0.0},
    ]
