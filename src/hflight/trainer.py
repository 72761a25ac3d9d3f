"""``hflight.Trainer``: the transformers ``Trainer`` surface, wired to a ``lightning.Trainer``.

The facade keeps HF's constructor, methods, override points, ``TrainerState``/``TrainerControl`` and files; the
work runs elsewhere: ``module.HFModule`` (optimizer steps), ``datamodule`` (loaders, accumulation cycles),
``callbacks.bridge`` (HF events, log/evaluate/save), ``evaluation`` (evaluation loop), ``checkpoint`` (files),
``resume`` (checked resume), ``interrupt`` (SIGTERM/SIGINT: checkpoint at the step boundary, non-zero exit),
``steps`` (loss and prediction step), ``optim`` (optimizers, schedulers) and ``lightning_kwargs`` (the one mapping
from ``TrainingArguments`` to ``lightning.Trainer``).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import time
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, SequentialSampler
from transformers import DataCollatorWithPadding, PreTrainedTokenizerBase, default_data_collator
from transformers.feature_extraction_sequence_utils import SequenceFeatureExtractor
from transformers.trainer_callback import (
    CallbackHandler,
    DefaultFlowCallback,
    ExportableState,
    PrinterCallback,
    ProgressCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
)
from transformers.trainer_pt_utils import (
    LabelSmoother,
    log_metrics,
    metrics_format,
    save_metrics,
    save_state,
)
from transformers.trainer_utils import (
    EvalLoopOutput,
    PredictionOutput,
    SaveStrategy,
    TrainOutput,
    enable_full_determinism,
    set_seed,
    speed_metrics,
)
from transformers.utils import can_return_loss, find_labels

from hflight import checkpoint, distributed, evaluation, hpsearch, optim, resume, steps
from hflight.backend import HFBackend, backend_of
from hflight.callbacks.bridge import HFEventBridge
from hflight.datamodule import HFDataModule, make_dataloader, remove_unused_columns, train_sampler
from hflight.lightning_kwargs import lightning_trainer_kwargs, quiet_lightning, split_callbacks
from hflight.module import HFModule
from hflight.plan import TrainingPlan
from hflight.training_args import TrainingArguments, coerce_training_args

DEFAULT_CALLBACKS = [DefaultFlowCallback]


def _require(value: Any, name: str, kinds: tuple[type, ...] | type, hint: str) -> None:
    if value is not None and not isinstance(value, kinds):
        raise TypeError(f"Trainer: `{name}` must be {hint}, got {type(value).__name__}.")


class Trainer:
    """The transformers ``Trainer`` API, running on PyTorch Lightning.

    Same constructor (parameter names, order and defaults as transformers 5.x), same methods and return types;
    ``tokenizer=`` is accepted as the older name of ``processing_class``. Callbacks may be HF ``TrainerCallback``s
    (classes or instances) or Lightning ``Callback``s (handed to the ``lightning.Trainer``).

    Example:
        >>> from hflight import Trainer, TrainingArguments  # doctest: +SKIP
        >>> Trainer(model, TrainingArguments("out"), train_dataset=ds).train()  # doctest: +SKIP
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        args: TrainingArguments | None = None,
        data_collator: Callable | None = None,
        train_dataset: Dataset | IterableDataset | None = None,
        eval_dataset: Dataset | dict[str, Dataset] | None = None,
        processing_class: Any = None,
        model_init: Callable[..., nn.Module] | None = None,
        compute_loss_func: Callable | None = None,
        compute_metrics: Callable[[Any], dict] | None = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, Any] = (None, None),
        optimizer_cls_and_kwargs: tuple[type[torch.optim.Optimizer], dict[str, Any]] | None = None,
        preprocess_logits_for_metrics: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        *,
        tokenizer: Any = None,
    ) -> None:
        self.args = coerce_training_args(args)
        self._lightning_trainer: L.Trainer | None = None
        self._lightning_module: HFModule | None = None
        self._evaluator: evaluation.Evaluator | None = None
        self._loop: HFEventBridge | None = None
        self._plan: TrainingPlan | None = None
        self._resume: resume.ResumePoint | None = None
        self._epochs_offset = 0
        self._signature_columns: list[str] | None = None
        if tokenizer is not None:
            if processing_class is not None and processing_class is not tokenizer:
                raise ValueError("Trainer: pass either `processing_class` or its older name `tokenizer`, not both.")
            processing_class = tokenizer
        enable_full_determinism(self.args.seed) if self.args.full_determinism else set_seed(self.args.seed)
        self._validate_inputs(model, model_init, train_dataset, eval_dataset, callbacks, optimizers, compute_metrics)
        if self.args.save_strategy == SaveStrategy.BEST and self.args.metric_for_best_model is None:
            raise ValueError("`args.metric_for_best_model` must be provided when using 'best' save_strategy.")

        self.model_init = model_init
        if model is None:
            model = self.call_model_init()
        self.model = model
        self.processing_class = processing_class
        self._inspect_model(model)
        self.data_collator = data_collator if data_collator is not None else self._default_collator(processing_class)
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.compute_loss_func, self.compute_metrics = compute_loss_func, compute_metrics
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.optimizer, self.lr_scheduler = optimizers
        self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs
        self._user_scheduler = self.lr_scheduler is not None
        self.loss_is_scaled_for_ga: bool | None = None
        self.current_gradient_accumulation_steps = 1
        self.current_flos = 0
        self.is_in_train = False
        self.hp_name, self.hp_search_backend, self._trial = None, None, None
        self.objective: Any = None

        hf_callbacks, self._lightning_callbacks = split_callbacks(callbacks or [])
        self.callback_handler = CallbackHandler(
            DEFAULT_CALLBACKS + hf_callbacks, self.model, processing_class, self.optimizer, self.lr_scheduler
        )
        self.add_callback(PrinterCallback if self.args.disable_tqdm else ProgressCallback)
        if self.args.should_save:
            os.makedirs(self.args.output_dir, exist_ok=True)
        self.control = TrainerControl()
        self.state = self._fresh_state()
        self.control = self.callback_handler.on_init_end(self.args, self.state, self.control)

    # ---- construction helpers ----------------------------------------------------------------------------------
    @staticmethod
    def _validate_inputs(model, model_init, train_dataset, eval_dataset, callbacks, optimizers, compute_metrics):
        if model is None and model_init is None:
            raise RuntimeError("`Trainer` requires either a `model` or `model_init` argument")
        if model is not None and model_init is not None:
            raise ValueError("`Trainer` requires either a `model` or `model_init` argument, but not both.")
        _require(model, "model", nn.Module, "a torch.nn.Module (e.g. a transformers PreTrainedModel)")
        for name, ds in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
            if (
                ds is not None
                and not isinstance(ds, dict)
                and not hasattr(ds, "__getitem__")
                and not hasattr(ds, "__iter__")
            ):
                raise TypeError(
                    f"Trainer: `{name}` must be a Dataset (map-style or iterable), got {type(ds).__name__}."
                )
        _require(callbacks, "callbacks", (list, tuple), "a list of TrainerCallback or lightning Callback objects")
        if not (isinstance(optimizers, tuple) and len(optimizers) == 2):
            raise TypeError(
                "Trainer: `optimizers` must be a tuple (optimizer, lr_scheduler); use (None, None) for the defaults."
            )
        if compute_metrics is not None and not callable(compute_metrics):
            raise TypeError(f"Trainer: `compute_metrics` must be callable, got {type(compute_metrics).__name__}.")

    def _inspect_model(self, model: nn.Module) -> None:
        if hasattr(model, "accepts_loss_kwargs"):
            self.model_accepts_loss_kwargs = model.accepts_loss_kwargs
        else:
            params = inspect.signature(model.forward).parameters.values()
            self.model_accepts_loss_kwargs = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)
        self.label_names = find_labels(type(model)) if self.args.label_names is None else list(self.args.label_names)
        self.can_return_loss = can_return_loss(type(model))
        eps = self.args.label_smoothing_factor
        self.label_smoother = LabelSmoother(epsilon=eps) if eps != 0 else None
        self._num_params = model.num_parameters(exclude_embeddings=True) if hasattr(model, "num_parameters") else 0

    @staticmethod
    def _default_collator(processing_class: Any) -> Callable:
        if isinstance(processing_class, (PreTrainedTokenizerBase, SequenceFeatureExtractor)):
            return DataCollatorWithPadding(processing_class)
        return default_data_collator

    def _fresh_state(self) -> TrainerState:
        stateful = [cb for cb in self.callback_handler.callbacks + [self.control] if isinstance(cb, ExportableState)]
        return TrainerState(
            is_local_process_zero=self.is_local_process_zero(),
            is_world_process_zero=self.is_world_process_zero(),
            stateful_callbacks=stateful,
        )

    def call_model_init(self, trial: Any = None) -> nn.Module:
        n_args = len(inspect.signature(self.model_init).parameters)
        model = self.model_init() if n_args == 0 else self.model_init(trial)
        if model is None:
            raise RuntimeError("model_init should not return None.")
        return model

    # ---- callbacks ---------------------------------------------------------------------------------------------
    def add_callback(self, callback: type[TrainerCallback] | TrainerCallback) -> None:
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback: type[TrainerCallback] | TrainerCallback) -> TrainerCallback | None:
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback: type[TrainerCallback] | TrainerCallback) -> None:
        self.callback_handler.remove_callback(callback)

    # ---- data --------------------------------------------------------------------------------------------------
    def _set_signature_columns_if_needed(self) -> None:
        if self._signature_columns is None:
            columns = list(inspect.signature(self.model.forward).parameters)
            self._signature_columns = columns + list({"label", "label_ids", *self.label_names})

    def _remove_unused_columns(self, dataset: Any, description: str | None = None) -> Any:
        if not self.args.remove_unused_columns:
            return dataset
        self._set_signature_columns_if_needed()
        return remove_unused_columns(dataset, self._signature_columns, description)

    def _world(self) -> tuple[int, int]:
        trainer = self._lightning_trainer
        if trainer is not None:
            return trainer.world_size, trainer.global_rank
        return self.args.world_size, self.args.process_index

    def _get_dataloader(self, dataset: Any, description: str, batch_size: int, training: bool) -> DataLoader:
        if dataset is None:
            raise ValueError(f"Trainer: {description.lower()} requires a dataset.")
        dataset = self._remove_unused_columns(dataset, description)
        sampler = None
        if not isinstance(dataset, IterableDataset):
            sampler = self._get_train_sampler(dataset) if training else self._get_eval_sampler(dataset)
        collator = self._collator(training)
        return make_dataloader(dataset, self.args, collator, batch_size, sampler, *self._world())

    def _collator(self, training: bool) -> Callable:
        """The collator of training (``training``) or evaluation batches: ``data_collator`` for both, as in HF."""
        return self.data_collator

    def _get_train_sampler(self, train_dataset: Any = None) -> torch.utils.data.Sampler:
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        return train_sampler(dataset, self.args, self.processing_class)

    def _get_eval_sampler(self, eval_dataset: Any) -> torch.utils.data.Sampler:
        return SequentialSampler(eval_dataset)

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        return self._get_dataloader(self.train_dataset, "Training", self.args.train_batch_size, training=True)

    def get_eval_dataloader(self, eval_dataset: str | Dataset | None = None) -> DataLoader:
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError(
                "Trainer: evaluation requires an eval_dataset. Pass `eval_dataset=` to the Trainer or to evaluate()."
            )
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        return self._get_dataloader(dataset, "Evaluation", self.args.eval_batch_size, training=False)

    def get_test_dataloader(self, test_dataset: Dataset) -> DataLoader:
        return self._get_dataloader(test_dataset, "test", self.args.eval_batch_size, training=False)

    def num_examples(self, dataloader: DataLoader) -> int:
        try:
            return len(dataloader.dataset)
        except (NameError, AttributeError, TypeError):
            return len(dataloader) * self.args.per_device_train_batch_size

    def _count_items_in_cycle(self, batches: list[Any]) -> torch.Tensor | None:
        return steps.count_items_in_cycle(self, batches)

    def _prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        if len(inputs) == 0:
            self._set_signature_columns_if_needed()
            raise ValueError(
                "The batch received was empty, your model won't be able to train on it. Double-check that your "
                f"training dataset contains keys expected by the model: {','.join(self._signature_columns)}."
            )
        device = self._lightning_module.device if self._lightning_module is not None else None
        return move_data_to_device(inputs, device) if device is not None else inputs

    # ---- optimizer and scheduler -------------------------------------------------------------------------------
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        if self.optimizer is None:
            opt_model = self.model if model is None else model
            self.optimizer = optim.build_optimizer(self.args, opt_model, self.optimizer_cls_and_kwargs)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        if self.lr_scheduler is None:
            self.lr_scheduler = optim.build_scheduler(self.args, optimizer or self.optimizer, num_training_steps)
        return self.lr_scheduler

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        self.create_optimizer()
        self.create_scheduler(num_training_steps=num_training_steps, optimizer=self.optimizer)

    def _get_learning_rate(self) -> float:
        return optim.current_learning_rate(self.lr_scheduler, self.optimizer)

    # ---- per-batch override points -----------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return steps.compute_loss(self, model, inputs, return_outputs, num_items_in_batch)

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        return steps.training_step(self, model, inputs, num_items_in_batch)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        return steps.prediction_step(self, model, inputs, prediction_loss_only, ignore_keys)

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        main_input = getattr(self.model, "main_input_name", "input_ids")
        if main_input in inputs and self._num_params:
            return 6 * inputs[main_input].numel() * self._num_params
        return 0

    def store_flos(self) -> None:
        self.state.total_flos += self.current_flos
        self.current_flos = 0

    # ---- Lightning wiring --------------------------------------------------------------------------------------
    def _ensure_module(self) -> HFModule:
        if self._lightning_module is None or self._lightning_module.model is not self.model:
            self._lightning_module = HFModule(self, self.model)
        return self._lightning_module

    def _lightning_strategy(self) -> Any:
        """The strategy of the ``lightning.Trainer``s: ``args.strategy`` (compat trainers bring an instance)."""
        return None

    def _new_lightning_trainer(self, extra_callbacks: list[L.Callback], fitting: bool) -> L.Trainer:
        callbacks = self._lightning_callbacks + extra_callbacks
        kwargs = lightning_trainer_kwargs(self.args, callbacks, fitting=fitting, strategy=self._lightning_strategy())
        with quiet_lightning():
            trainer = L.Trainer(**kwargs)
        self._lightning_trainer = trainer
        return trainer

    def _validation_trainer(self) -> L.Trainer:
        return self._new_lightning_trainer([], fitting=False)

    # Collectives through the running strategy (identity in a single process): see hflight.distributed.
    def _strategy(self) -> Any:
        return self._lightning_trainer.strategy if self._lightning_trainer is not None else None

    def _backend(self) -> HFBackend:
        """The running strategy's hooks into the HF loop (eager PyTorch unless a backend such as the IPU's)."""
        return backend_of(self._strategy())

    def _gather(self, value: Any, pad_dim: int | None = None) -> Any:
        return distributed.gather(self._strategy(), value, pad_dim)

    def _pad_across_processes(self, value: Any) -> Any:
        return distributed.pad_across_processes(self._strategy(), value)

    def _barrier(self) -> None:
        distributed.barrier(self._strategy())

    def _reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        return distributed.reduce_mean(self._strategy(), value)

    def _weight_hooks(self, method: str) -> list[Any]:
        """Callbacks that take part in the weights protocol (e.g. ``EMACallback``): those defining ``method``."""
        return [cb for cb in self.callback_handler.callbacks if callable(getattr(cb, method, None))]

    def _evaluation_weights(self) -> contextlib.ExitStack:
        """The weights evaluation and saved models use (moving averages when an EMA callback is attached)."""
        stack = contextlib.ExitStack()
        for callback in self._weight_hooks("averaged_weights"):
            stack.enter_context(callback.averaged_weights(self.model))
        return stack

    # ---- training ----------------------------------------------------------------------------------------------
    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> TrainOutput:
        if kwargs:
            raise TypeError(f"train() got unexpected keyword arguments: {', '.join(kwargs)}.")
        if resume_from_checkpoint is False:
            resume_from_checkpoint = None
        if resume_from_checkpoint is None and self.args.resume_from_checkpoint:
            resume_from_checkpoint = self.args.resume_from_checkpoint
        self.is_in_train = True
        self._trial = trial
        if trial is not None and self.hp_search_backend is not None:
            self.args = hpsearch.apply_trial(self, self._hp_base_args, trial)
        if self.model_init is not None:
            enable_full_determinism(self.args.seed) if self.args.full_determinism else set_seed(self.args.seed)
            self.model = self.call_model_init(trial)
            self._inspect_model(self.model)
            self.optimizer, self.lr_scheduler = None, None
        elif not self._user_scheduler:
            self.lr_scheduler = None  # HF rebuilds its own scheduler for every train() call
        if self.args.gradient_checkpointing and hasattr(self.model, "gradient_checkpointing_enable"):
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs
            )
        self._resume = resume.resolve_resume(self, resume_from_checkpoint)
        module = self._ensure_module()
        self._loop = HFEventBridge(self, trial, ignore_keys_for_eval)
        trainer = self._new_lightning_trainer([self._loop], fitting=True)
        try:
            with quiet_lightning(), self._loop.stop.handling_signals(trainer):
                trainer.fit(module, datamodule=HFDataModule(self))
        finally:
            self.is_in_train = False
        return self._loop.finish_training()

    def hyperparameter_search(
        self,
        hp_space: Callable[[Any], dict[str, Any]] | None = None,
        compute_objective: Callable[[dict[str, float]], float] | None = None,
        n_trials: int = 20,
        direction: str | list[str] = "minimize",
        backend: str | None = None,
        hp_name: Callable[[Any], str] | None = None,
        **kwargs: Any,
    ):
        """Search hyperparameters with optuna (HF's semantics; needs ``model_init``). Returns a ``BestRun``
        (a list of them for several ``direction``s). See ``hflight.hpsearch``."""
        self._hp_base_args = self.args
        return hpsearch.hyperparameter_search(
            self, hp_space, compute_objective, n_trials, direction, backend, hp_name, **kwargs
        )

    # ---- evaluation --------------------------------------------------------------------------------------------
    def _evaluate(self, trial: Any, ignore_keys_for_eval: list[str] | None, skip_scheduler: bool = False) -> dict:
        metrics = self.evaluate(ignore_keys=ignore_keys_for_eval)
        hpsearch.report(self, trial, self.state.global_step, metrics)
        if isinstance(self.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) and not skip_scheduler:
            key = self.args.metric_for_best_model
            key = key if key.startswith("eval_") else f"eval_{key}"
            self.lr_scheduler.step(metrics[checkpoint.metric_key(key, metrics)])
        return metrics

    def _determine_best_metric(self, metrics: dict[str, float], trial: Any = None) -> bool:
        return checkpoint.update_best_metric(self, metrics)

    def evaluate(
        self,
        eval_dataset: Dataset | dict[str, Dataset] | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> dict[str, float]:
        override = eval_dataset is not None
        eval_dataset = eval_dataset if override else self.eval_dataset
        if isinstance(eval_dataset, dict):
            metrics: dict[str, float] = {}
            for name, dataset in eval_dataset.items():
                metrics.update(self.evaluate(dataset if override else name, ignore_keys, f"{metric_key_prefix}_{name}"))
            return metrics
        dataloader = self.get_eval_dataloader(eval_dataset)
        start_time = time.time()
        output = self.evaluation_loop(
            dataloader,
            description="Evaluation",
            prediction_loss_only=True if self.compute_metrics is None else None,
            ignore_keys=ignore_keys,
            metric_key_prefix=metric_key_prefix,
        )
        output.metrics.update(self._speed_metrics(metric_key_prefix, start_time, output.num_samples))
        self.log(output.metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, output.metrics)
        return output.metrics

    def predict(
        self, test_dataset: Dataset, ignore_keys: list[str] | None = None, metric_key_prefix: str = "test"
    ) -> PredictionOutput:
        dataloader = self.get_test_dataloader(test_dataset)
        start_time = time.time()
        output = self.evaluation_loop(
            dataloader, description="Prediction", ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix
        )
        output.metrics.update(self._speed_metrics(metric_key_prefix, start_time, output.num_samples))
        self.control = self.callback_handler.on_predict(self.args, self.state, self.control, output.metrics)
        return PredictionOutput(predictions=output.predictions, label_ids=output.label_ids, metrics=output.metrics)

    def _speed_metrics(self, prefix: str, start_time: float, num_samples: int) -> dict[str, float]:
        total_batch_size = self.args.eval_batch_size * self._world()[0]
        num_steps = math.ceil(num_samples / total_batch_size)
        return speed_metrics(prefix, start_time, num_samples=num_samples, num_steps=num_steps)

    def evaluation_loop(
        self,
        dataloader: DataLoader,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
        *,
        compute_metrics: Any = ...,
    ) -> EvalLoopOutput:
        """HF's evaluation loop; ``compute_metrics=None`` collects predictions without scoring them (the QA
        trainer scores after post-processing), the default uses ``self.compute_metrics``."""
        if prediction_loss_only is None:
            prediction_loss_only = self.args.prediction_loss_only
        return evaluation.run_evaluation_loop(
            self, dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix, compute_metrics
        )

    # ---- logging, saving ---------------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.state.epoch is not None:
            logs["epoch"] = self.state.epoch
        output = {**logs, "step": self.state.global_step}
        self.state.log_history.append(output)
        if self._lightning_trainer is not None and self.is_world_process_zero():
            for logger in self._lightning_trainer.loggers:
                logger.log_metrics(
                    {k: v for k, v in logs.items() if isinstance(v, (int, float))}, self.state.global_step
                )
        self.control = self.callback_handler.on_log(self.args, self.state, self.control, logs)

    log_metrics = log_metrics
    metrics_format = metrics_format
    save_metrics = save_metrics
    save_state = save_state

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        backend = self._backend()
        backend.hf_sync_to_host()
        if self.is_world_process_zero():
            checkpoint.save_model_files(self.model, self.processing_class, output_dir, self.args)
            backend.hf_save_files(output_dir)

    def _save_checkpoint(self, trial: Any = None) -> None:
        checkpoint.save_checkpoint(self)

    def is_local_process_zero(self) -> bool:
        return self.args.local_process_index == 0

    def is_world_process_zero(self) -> bool:
        return self._world()[1] == 0 if self._lightning_trainer is not None else self.args.process_index == 0
