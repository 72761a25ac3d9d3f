"""``hflight.Trainer``: the transformers ``Trainer`` surface, wired to a ``lightning.Trainer``.

The facade keeps HF's constructor, methods, override points, ``TrainerState``/``TrainerControl`` and files. Each
``train()``, and each ``evaluate()``/``predict()`` outside training, creates one :class:`hflight.run.run.Run` (the
Lightning side of that call: module, datamodule, HF's training loop, evaluation); the parts of this package
(``data``, ``steps``, ``optim``, ``hpsearch``, ``hub``, ...) implement transformers' surface over public state, and
the collaborators in ``hflight.run`` and ``hflight.checkpoints`` get the run and the facade's public surface as
arguments (``hflight.surface``). Only this module touches the facade's private state.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset
from transformers.trainer_callback import (
    CallbackHandler,
    DefaultFlowCallback,
    PrinterCallback,
    ProgressCallback,
    TrainerCallback,
    TrainerControl,
)
from transformers.trainer_jit_checkpoint import JITCheckpointCallback
from transformers.trainer_pt_utils import log_metrics, metrics_format, save_metrics, save_state
from transformers.trainer_utils import EvalLoopOutput, PredictionOutput, TrainOutput, enable_full_determinism, set_seed

from hflight.arguments import cluster, reporting
from hflight.arguments.lightning_kwargs import split_callbacks
from hflight.arguments.training_args import TrainingArguments, coerce_training_args
from hflight.callbacks.hooks import new_trainer_state
from hflight.checkpoints import folders, parts, resume, weights
from hflight.checkpoints.writelock import output_dir_lock
from hflight.run import console, evaluation
from hflight.run.backend import HFBackend, backend_of
from hflight.run.distributed import World
from hflight.run.events import dispatch
from hflight.run.run import Run
from hflight.trainer import construction, memory, model_hooks, steps
from hflight.trainer.accelerator import RunAccelerator
from hflight.trainer.construction import default_collator
from hflight.trainer.data import DataLoadersMixin
from hflight.trainer.hpsearch import HyperparameterSearchMixin
from hflight.trainer.hub import HubMixin
from hflight.trainer.optim import OptimizerMixin
from hflight.trainer.steps import StepsMixin

DEFAULT_CALLBACKS = [DefaultFlowCallback]


class Trainer(DataLoadersMixin, StepsMixin, OptimizerMixin, HyperparameterSearchMixin, HubMixin):
    """The transformers ``Trainer`` API, running on PyTorch Lightning.

    Same constructor (parameter names, order and defaults as transformers 5.x), same methods and return types;
    ``tokenizer=`` is accepted as the older name of ``processing_class``. Callbacks may be HF ``TrainerCallback``s
    (classes or instances) or Lightning ``Callback``s (handed to the ``lightning.Trainer``).

    Example:
        >>> from hflight import Trainer, TrainingArguments  # doctest: +SKIP
        >>> Trainer(model, TrainingArguments("out"), train_dataset=ds).train()  # doctest: +SKIP
    """

    #: The Lightning strategy of every run (a name or a ``Strategy``); None: ``args.strategy``. The compat trainers
    #: (``IPUTrainer``, ``ORTTrainer``) set their strategy object here.
    lightning_strategy: Any = None
    #: Whether ``compute_loss`` returns a loss already scaled for gradient accumulation (None: decided as in
    #: transformers, from ``model_accepts_loss_kwargs`` and ``compute_loss_func``).
    loss_is_scaled_for_ga: bool | None = None
    #: hflight's opt-in (off: transformers' default): on a resume without ``restore_callback_states_from_checkpoint``,
    #: set the saved attributes of each stateful callback onto the callback in use (an ``EarlyStoppingCallback``'s
    #: patience counter survives the resume, transformers #28544); transformers restores nothing then.
    restore_callback_attributes: bool = False

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
        self._memory_tracker = memory.MemoryTracker(self.args.skip_memory_metrics)
        self._memory_tracker.start_stage("init")
        console.set_process_log_level(self.args)
        self._run: Run | None = None  # the run of the call in progress, or of the last one
        processing_class = construction.processing_class_of(processing_class, tokenizer)
        self._seed()
        construction.check_overrides(type(self))
        construction.check_inputs(
            self.args, model, model_init, train_dataset, eval_dataset, callbacks, optimizers, compute_metrics
        )
        construction.check_optimizer_inputs(optimizers, optimizer_cls_and_kwargs, model_init)
        self.create_accelerator_and_postprocess()
        self.model_init = model_init
        self.model = model if model is not None else self.call_model_init()
        construction.validate_quantization_for_training(self.model)  # transformers' own refusals (quantized models)
        vars(self).update(construction.transformers_attributes(self.args, self.model))
        self.processing_class = processing_class
        self._adopt_model(self.model)
        self.data_collator = data_collator if data_collator is not None else default_collator(processing_class)
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.compute_loss_func, self.compute_metrics = compute_loss_func, compute_metrics
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        (self.optimizer, self.lr_scheduler), self.optimizer_cls_and_kwargs = optimizers, optimizer_cls_and_kwargs
        self.neftune_noise_alpha = self.args.neftune_noise_alpha
        self._user_scheduler = self.lr_scheduler is not None
        self._train_batch_size = self.args.train_batch_size  # auto_find_batch_size may lower it
        self.current_gradient_accumulation_steps, self.current_flos, self.is_in_train = 1, 0, False
        self.hp_name, self.hp_search_backend, self._trial, self.objective = None, None, None, None
        self._setup_callbacks(callbacks or [])
        if self.args.push_to_hub:
            self.init_hf_repo()
        if self.args.should_save:
            os.makedirs(self.args.output_dir, exist_ok=True)
        dispatch(self, "on_init_end")
        if getattr(self.model, "config", None) is not None:
            self.model.config.use_cache = self.args.use_cache
        self._memory_tracker.stop_stage("init")

    # ---- construction helpers ----------------------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        """transformers builds its accelerate ``Accelerator`` here; hflight's answers from the run in progress."""
        self.accelerator = RunAccelerator(lambda: self._run, self.args, lambda: self.model)
        self.gather_function = self.accelerator.gather_for_metrics

    def _seed(self) -> None:
        enable_full_determinism(self.args.seed) if self.args.full_determinism else set_seed(self.args.seed)

    def _adopt_model(self, model: nn.Module) -> None:
        construction.place_model(model, self.args, self.place_model_on_device)
        facts = construction.inspect_model(model, self.args)
        self.model_accepts_loss_kwargs, self.label_names = facts.accepts_loss_kwargs, facts.label_names
        self.can_return_loss, self.label_smoother = facts.can_return_loss, facts.label_smoother
        self._num_params, self._loss_shifts_labels = facts.num_params, facts.loss_shifts_labels

    def _setup_callbacks(self, callbacks: list[Any]) -> None:
        hf_callbacks, self._lightning_callbacks = split_callbacks(callbacks)
        # transformers' integration callbacks for report_to (tensorboard, wandb, mlflow, ...), where transformers
        # puts them; hflight's "csv" is a Lightning logger (hflight.arguments.reporting)
        defaults: list[Any] = [*DEFAULT_CALLBACKS, *reporting.integration_callbacks(self.args.report_to)]
        if self.args.enable_jit_checkpoint:  # transformers' own callback: SIGTERM -> checkpoint at the next step
            defaults.append(JITCheckpointCallback())
            defaults[-1].set_trainer(self)
        self.callback_handler = CallbackHandler(
            defaults + hf_callbacks, self.model, self.processing_class, self.optimizer, self.lr_scheduler
        )
        self.add_callback(PrinterCallback if self.args.disable_tqdm else ProgressCallback)
        self.control = TrainerControl()
        self.state = new_trainer_state(
            self.callback_handler.callbacks,
            self.control,
            is_local_process_zero=self.is_local_process_zero(),
            is_world_process_zero=self.is_world_process_zero(),
        )

    def call_model_init(self, trial: Any = None) -> nn.Module:
        return construction.call_model_init(self.model_init, trial)

    # ---- callbacks ---------------------------------------------------------------------------------------------
    def add_callback(self, callback: type[TrainerCallback] | TrainerCallback) -> None:
        self.callback_handler.add_callback(callback)

    def pop_callback(self, callback: type[TrainerCallback] | TrainerCallback) -> TrainerCallback | None:
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback: type[TrainerCallback] | TrainerCallback) -> None:
        self.callback_handler.remove_callback(callback)

    # ---- the run: the Lightning side of the call in progress ---------------------------------------------------
    def _new_run(self, fitting: bool, **kwargs: Any) -> Run:
        strategy, callbacks = self.lightning_strategy, self._lightning_callbacks
        if not fitting and self._run is not None and self._run.serves_evaluation(self, strategy, callbacks):
            return self._run  # another evaluation outside train(), nothing changed: no new lightning.Trainer
        # the loggers outlive a fit: evaluate()/predict() after train() log to the same ones, as in transformers
        loggers = None if fitting or self._run is None else self._run.lightning_trainer.loggers
        self._run = Run(
            self, fitting=fitting, strategy=strategy, lightning_callbacks=callbacks, loggers=loggers, **kwargs
        )
        return self._run

    @property
    def lightning_trainer(self) -> Any:
        """The ``lightning.Trainer`` of the call in progress, or of the last one (None before any)."""
        return self._run.lightning_trainer if self._run is not None else None

    def _world(self) -> World:
        return self.accelerator.world

    def _backend(self) -> HFBackend:
        """The hooks of the running (or last) strategy; before any run, those of the configured one."""
        if self._run is not None:
            return self._run.backend
        return backend_of(self.lightning_strategy if self.lightning_strategy is not None else self.args.strategy)

    # ---- per-batch pieces that need the run ---------------------------------------------------------------------
    def _get_num_items_in_batch(self, batch_samples: list[Any], device: torch.device | None) -> torch.Tensor | None:
        return steps.count_items_in_cycle(self, batch_samples, self._backend(), self._world(), self._loss_shifts_labels)

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        return steps.floating_point_ops(self.model, inputs, self._num_params)

    def set_initial_training_values(
        self, args: Any, dataloader: DataLoader
    ) -> tuple[int, int, int, int, int, int | None, int]:
        return steps.initial_training_values(self, args, dataloader, self._backend(), self._train_batch_size)

    def store_flos(self) -> None:
        self.state.total_flos += steps.flos_of_every_process(self.current_flos, self._world(), self.args.device)
        self.current_flos = 0

    # ---- training ----------------------------------------------------------------------------------------------
    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> TrainOutput:
        self._memory_tracker.start_stage("train")
        resume_from_checkpoint = resume.requested(resume_from_checkpoint, self.args)
        # One writer per run folder (a trial's: run-{id}), from before the folder is read until the last checkpoint.
        job, rank = cluster.job_identity(), self.args.process_index  # the lock tells ranks of a job from other runs
        folder = self.args.output_dir if trial is None else self._get_output_dir(trial)
        with output_dir_lock(folder, enabled=self.args.should_save, job=job, rank=rank), folders.storing(self.args):
            self._trial = trial
            self._prepare_model_for_training()
            self._hp_search_setup(trial)  # a search's trial onto self.args, after model_init (transformers' moment)
            if self.hp_search_backend is not None and trial is not None:
                self._train_batch_size = self.args.train_batch_size  # the trial's batch size
            point = resume.resolve_resume(self, resume_from_checkpoint)
            if point is not None and self.args.auto_find_batch_size and point.state.train_batch_size is not None:
                self._train_batch_size = point.state.train_batch_size  # the size the checkpoint's run found
            with model_hooks.installed(self.model, self.args):
                return memory.find_executable_batch_size(
                    lambda batch_size: self._train_once(batch_size, point, trial, ignore_keys_for_eval),
                    self._train_batch_size,
                    self.args.auto_find_batch_size,
                )

    def _train_once(self, batch_size: int, point: Any, trial: Any, ignore_keys: list[str] | None) -> TrainOutput:
        """One Lightning run of ``train()`` with training batches of ``batch_size``."""
        self._train_batch_size = batch_size
        if not self._user_scheduler:
            self.lr_scheduler = None  # HF rebuilds its own scheduler for every run (and every batch-size retry)
        self.is_in_train = True
        try:  # also when the run cannot be built (fsdp on the CPU): not "in train" afterwards
            run = self._new_run(True, resume=point, trial=trial, ignore_keys_for_eval=ignore_keys,
                                train_batch_size=batch_size)  # fmt: skip
            run.fit()
        finally:
            self.is_in_train = False
        output = run.finish_training(lambda metrics: self._memory_tracker.stop_stage("train", metrics))
        self._finish_current_push()  # the checkpoint uploads still running, as transformers after on_train_end
        return output

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        return self._get_dataloader(
            self.train_dataset, "Training", self._train_batch_size, self._get_train_sampler, is_training=True
        )

    def _prepare_model_for_training(self) -> None:
        """A fresh model from ``model_init`` (and optimizer), or a fresh schedule; Liger, activation checkpointing."""
        if self.model_init is not None:
            self._seed()
            self.model = self.call_model_init(self._trial)
            self._adopt_model(self.model)
            self.optimizer, self.lr_scheduler = None, None
        construction.prepare_model_for_training(self.model, self.args)

    # ---- evaluation --------------------------------------------------------------------------------------------
    def _evaluate(self, trial: Any, ignore_keys_for_eval: list[str] | None, skip_scheduler: bool = False) -> dict:
        return evaluation.evaluate_in_training(self, trial, ignore_keys_for_eval, skip_scheduler)

    def _maybe_log_save_evaluate(
        self, tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, learning_rate=None
    ) -> None:
        loop = self._run.loop
        loop.log_save_evaluate(tr_loss, grad_norm, model, trial, ignore_keys_for_eval, start_time, learning_rate)

    def _determine_best_metric(self, metrics: dict[str, float], trial: Any) -> bool:
        return evaluation.update_best_metric(self.args, self.state, metrics)

    def evaluate(
        self,
        eval_dataset: Dataset | dict[str, Dataset] | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> dict[str, float]:
        tracked = not isinstance(eval_dataset if eval_dataset is not None else self.eval_dataset, dict)
        if tracked:  # a dict of data sets: each one's evaluate() is measured
            self._memory_tracker.start_stage("eval")
        metrics = evaluation.evaluate(self, eval_dataset, ignore_keys, metric_key_prefix)
        if tracked:
            self._memory_tracker.stop_stage("eval", metrics)
        return metrics

    def predict(
        self, test_dataset: Dataset, ignore_keys: list[str] | None = None, metric_key_prefix: str = "test"
    ) -> PredictionOutput:
        self._memory_tracker.start_stage("test")
        output = evaluation.predict(self, test_dataset, ignore_keys, metric_key_prefix)
        self._memory_tracker.stop_stage("test", output.metrics)
        return output

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
        trainer scores after post-processing), the default uses ``self.compute_metrics``. Inside ``train()`` it runs
        in the training run; otherwise in an evaluation run (``hflight.run.evaluation``)."""
        if prediction_loss_only is None:
            prediction_loss_only = self.args.prediction_loss_only
        run = self._run if self.is_in_train else self._new_run(False)
        return evaluation.run_evaluation_loop(
            self, run, dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix, compute_metrics
        )

    # ---- logging, saving ---------------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.state.epoch is not None:
            logs["epoch"] = self.state.epoch
        if self.args.include_num_input_tokens_seen != "no":
            logs["num_input_tokens_seen"] = self.state.num_input_tokens_seen
            if start_time is not None and self._run is not None and self._run.fitting:
                logs.update(self._run.loop.token_speed(start_time))
        output = {**logs, "step": self.state.global_step}
        self.state.log_history.append(output)
        if self._run is not None and self.is_world_process_zero():
            numbers = {k: v for k, v in logs.items() if isinstance(v, (int, float))}
            for logger in self._run.lightning_trainer.loggers:
                logger.log_metrics(numbers, self.state.global_step)
                if not self.is_in_train:  # evaluate()/predict() log after their Lightning run has finalized
                    logger.save()
        dispatch(self, "on_log", logs)

    log_metrics, metrics_format = log_metrics, metrics_format
    save_metrics = folders.on_disk_when_returned(save_metrics)  # transformers' own, then fsynced
    save_state = folders.on_disk_when_returned(save_state)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        folders.save_model(self, output_dir if output_dir is not None else self.args.output_dir, self._backend())
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        processor = weights.saved_processor(self.processing_class, self.data_collator)
        weights.save_model_files(self.model, processor, output_dir, self.args, state_dict)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        weights.load_model_weights(model if model is not None else self.model, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str) -> None:  # at train start, the run resuming checkpoint
        parts.restore_optimizer(self, self._run)  # the states read and checked with its weights

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        folder = folders.save_checkpoint(self, self._run, trial)
        if self.args.push_to_hub:
            self._push_from_checkpoint(folder)

    def _load_best_model(self) -> None:
        resume.load_best_model(self, self._run)

    def _load_callback_state(self) -> None:
        # outside train() (a state set by hand), the callbacks are rebuilt from self.state, as transformers does
        point = self._run.resume if self._run is not None else None
        parts.restore_callback_states(self, point, self.state)

    def end(self) -> None:
        """Finish the loggers and destroy the process group (after everything that needs the other processes)."""
        self.accelerator.end_training()

    def is_local_process_zero(self) -> bool:
        return self.args.local_process_index == 0

    def is_world_process_zero(self) -> bool:
        return self._world().rank == 0
