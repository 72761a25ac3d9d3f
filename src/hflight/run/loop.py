"""HF's training loop, for one ``train()`` call: what transformers' ``_inner_training_loop`` decides, step by step.

Lightning runs the epochs and batches; this object keeps what HF's loop keeps and decides what HF's loop decides:

- **begin** (once Lightning launched the processes): the plan (``hflight.run.plan``), a fresh ``TrainerState``, or the
  resumed checkpoint's with its data position (epochs trained, micro-batches to skip) and RNG streams;
- **bookkeeping**: the running loss (``tr_loss``, with ``logging_nan_inf_filter``), floating-point operations, the
  gradient norm and learning rate of the last step, ``global_step`` and ``epoch``;
- **decisions**: after every step and epoch, transformers' ``_maybe_log_save_evaluate`` (log, evaluate, track the
  best metric, save), called through the facade so a subclass's override takes effect;
- **stops**: ``TrainerControl.should_training_stop``/``should_epoch_stop``, an empty epoch, and SIGTERM/SIGINT
  (``hflight.run.interrupt``: save a checkpoint at the step boundary, then stop);
- **finish**: the train metrics, the best model, the final rotation, ``on_train_end``.

Every HF event goes through :func:`hflight.run.events.dispatch`. The Lightning hooks that drive the loop are mapped in
``hflight.run.events.LightningEvents``; the step-level events come from ``hflight.run.module.HFModule``, in HF's order:

| HF event | when |
|---|---|
| on_train_begin / on_train_end | Lightning's ``on_train_start`` / :meth:`TrainingLoop.finish` after ``fit`` returns |
| on_epoch_begin / on_epoch_end | Lightning's ``on_train_epoch_start`` / ``on_train_epoch_end`` |
| on_step_begin | the first micro-batch of an accumulation cycle |
| on_substep_end | every other micro-batch |
| on_pre_optimizer_step | after clipping (gradients already unscaled) |
| on_optimizer_step | right after ``optimizer.step()`` |
| on_step_end | after ``global_step`` moved, then log/evaluate/save |
| on_save | after a checkpoint is on disk |
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any

import torch
from transformers.trainer_utils import SaveStrategy, TrainOutput, speed_metrics

from hflight.arguments.strategies import finalize_deepspeed
from hflight.callbacks.hooks import new_trainer_state
from hflight.checkpoints import folders, parts, resume
from hflight.checkpoints.manifest import PREFIX
from hflight.run import console
from hflight.run.events import dispatch
from hflight.run.interrupt import StopRequest, signal_name, stopped
from hflight.run.plan import TrainingPlan
from hflight.surface import RunView, TrainerSurface

logger = logging.getLogger(__name__)


class TrainingLoop:
    """HF's loop state and decisions for one ``train()`` call (see the module docstring)."""

    def __init__(
        self, facade: TrainerSurface, run: RunView, trial: Any = None, ignore_keys_for_eval: list[str] | None = None
    ) -> None:
        self.facade = facade
        self.run = run
        self.trial = trial
        self.ignore_keys_for_eval = ignore_keys_for_eval
        self.plan: TrainingPlan | None = None  # set by begin(), once the loader knows its rank
        self.epochs_offset = 0  # epochs a resumed run had already trained
        self.tr_loss = torch.tensor(0.0)
        self.total_loss_scalar = 0.0
        self.globalstep_last_logged = 0
        self.initial_global_step = 0
        self.start_time = time.time()
        self.grad_norm: torch.Tensor | float | None = None
        self.learning_rate: float | None = None
        self.micro_steps_this_epoch = 0
        self.initial_num_input_tokens_seen = 0
        self.stop = StopRequest()
        self.saved_step: int | None = None
        self.warned_nonfinite = False

    def _epoch_index(self) -> int:
        return self.epochs_offset + self.run.lightning_trainer.current_epoch

    # -- beginning -----------------------------------------------------------------------------------------------
    def begin(self, datamodule: Any) -> int:
        """Plan the run, set up the state, position a resumed run in its data and RNG streams; returns the epochs
        Lightning has left to run (-1: unbounded, ``max_steps`` ends the run)."""
        facade, run = self.facade, self.run
        loader = datamodule.train_loader
        # transformers' override point, at its moment (the loader built, nothing trained): the run's arithmetic
        values = facade.set_initial_training_values(facade.args, loader)
        self.plan = plan = TrainingPlan(*values, accumulation=datamodule.geometry.accumulation)
        finalize_deepspeed(run.lightning_trainer.strategy, facade.args, facade.model, plan.max_steps)
        facade.state = new_trainer_state(
            facade.callback_handler.callbacks,
            facade.control,
            is_local_process_zero=facade.is_local_process_zero(),
            is_world_process_zero=facade.is_world_process_zero(),
        )
        facade.state.train_batch_size = run.train_batch_size
        facade.state.compute_steps(facade.args, plan.max_steps)
        epochs_trained, skip = 0, 0
        if run.resume is not None:
            facade.state = resume.resumed_state(facade, run.resume, run.world.size, plan)
            facade._load_callback_state()  # transformers' override point, at its moment: right after the state
            epochs_trained, skip = plan.resume_position(facade.state.global_step, facade.args.ignore_data_skip)
            datamodule.resume_at(skip, lambda: parts.load_rng_state(run.resume, run.world))
        facade.state.init_training_references(facade, plan.max_steps, plan.num_train_epochs, self.trial)
        self.epochs_offset = epochs_trained
        resumed_at = facade.state.global_step if run.resume is not None else None
        console.training_started(facade.args, plan, facade.model, resumed_at, epochs_trained, skip)
        folders.clean_output_dir(facade.args, run.resume.folder if run.resume is not None else None)
        return -1 if plan.unbounded else plan.num_train_epochs - epochs_trained

    def train_begin(self, train_loader: Any, device: torch.device) -> None:
        """Lightning's ``on_train_start``: the optimizer's resumed state, the bookkeeping, ``on_train_begin``."""
        facade = self.facade
        handler = facade.callback_handler
        handler.model, handler.optimizer, handler.lr_scheduler = facade.model, facade.optimizer, facade.lr_scheduler
        handler.train_dataloader = train_loader
        parts.restore_optimizer(facade, self.run)
        self.tr_loss = torch.tensor(0.0, device=device)
        self.start_time = time.time()
        self.initial_global_step = self.globalstep_last_logged = facade.state.global_step
        self.initial_num_input_tokens_seen = facade.state.num_input_tokens_seen  # tokens/s of this call only
        facade.model.zero_grad(set_to_none=True)
        dispatch(facade, "on_train_begin")
        if facade.args.eval_on_start:
            facade._evaluate(self.trial, self.ignore_keys_for_eval, skip_scheduler=True)

    # -- epochs --------------------------------------------------------------------------------------------------
    def epoch_begin(self) -> None:
        self.micro_steps_this_epoch = 0
        dispatch(self.facade, "on_epoch_begin")

    def epoch_end(self, counts_batches: bool) -> bool:
        """``on_epoch_end``, then log/evaluate/save; returns whether training stops. ``counts_batches``: an epoch
        that yielded no batch means the (iterable) dataset is exhausted, which ends training as in HF."""
        if self.micro_steps_this_epoch == 0 and counts_batches:
            self.facade.control.should_training_stop = True
        dispatch(self.facade, "on_epoch_end")
        self.maybe_log_save_evaluate()
        self.stop_if_requested()
        return self.facade.control.should_training_stop

    # -- steps, as the LightningModule reports them ------------------------------------------------------------------
    def step_begin(self) -> None:
        dispatch(self.facade, "on_step_begin")

    def substep_end(self) -> None:
        dispatch(self.facade, "on_substep_end")

    def add_loss(self, loss: torch.Tensor, inputs: Any) -> None:
        facade = self.facade
        self.micro_steps_this_epoch += 1
        if facade.args.logging_nan_inf_filter and not torch.isfinite(loss):
            # HF: a non-finite loss is replaced by the average of the losses logged since the last log.
            self.tr_loss += self.tr_loss / (1 + facade.state.global_step - self.globalstep_last_logged)
        else:
            self.tr_loss += loss.to(self.tr_loss.device)
        facade.current_flos += float(facade.floating_point_ops(inputs))
        self.track_input_tokens(inputs)

    def track_input_tokens(self, inputs: Any) -> None:
        """``include_num_input_tokens_seen``: ``state.num_input_tokens_seen`` grows by this micro-batch's tokens (all,
        or those not padding), summed over the processes, as transformers counts them."""
        facade = self.facade
        mode = facade.args.include_num_input_tokens_seen
        if mode == "no":
            return
        main_input = getattr(facade.model, "main_input_name", "input_ids")
        if main_input not in inputs:
            logger.warning(
                "Tried to track the number of tokens seen, however the current model is not configured properly to "
                "know what item is the input. To fix this, add a `main_input_name` attribute to the model class you "
                "are using."
            )
            return
        pad_id = getattr(facade.processing_class, "pad_token_id", None)
        if mode == "non_padding" and "attention_mask" in inputs:
            tokens = inputs["attention_mask"].sum()
        elif mode == "non_padding" and pad_id is not None:
            tokens = (inputs[main_input] != pad_id).sum()
        else:
            if mode == "non_padding":
                logger.warning(
                    "Could not determine method to count non-padding tokens, falling back to counting all tokens."
                )
            tokens = inputs[main_input].numel()
        device = inputs[main_input].device
        tokens = torch.as_tensor(tokens, device=device, dtype=torch.int64)
        facade.state.num_input_tokens_seen += int(self.run.world.reduce_sum(tokens).item())

    def clip_and_pre_step(self, model: torch.nn.Module) -> None:
        facade = self.facade
        max_norm = facade.args.max_grad_norm
        clip = getattr(model, "clip_grad_norm_", None)  # FSDP-wrapped modules clip their own shards
        norm_limit = max_norm if max_norm and max_norm > 0 else float("inf")
        if clip is not None:
            grad_norm = clip(norm_limit)
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(facade.model.parameters(), norm_limit)
        self.pre_optimizer_step(grad_norm)

    def pre_optimizer_step(self, grad_norm: torch.Tensor | float | None) -> None:
        """``on_pre_optimizer_step``; ``grad_norm`` is logged with the next loss (None: not known on the host)."""
        self.grad_norm = grad_norm
        dispatch(self.facade, "on_pre_optimizer_step")

    def optimizer_stepped(self) -> None:
        dispatch(self.facade, "on_optimizer_step")

    def step_end(self, step_in_epoch: int, learning_rate: float) -> None:
        facade = self.facade
        self.learning_rate = learning_rate
        facade.state.global_step += 1
        facade.state.epoch = self._epoch_index() + (step_in_epoch + 1) / self.plan.steps_in_epoch
        dispatch(facade, "on_step_end")
        self.maybe_log_save_evaluate()
        self.stop_if_requested()

    # -- HF's _maybe_log_save_evaluate -------------------------------------------------------------------------
    def maybe_log_save_evaluate(self) -> None:
        """After a step or an epoch: the facade's ``_maybe_log_save_evaluate`` with transformers' arguments (a
        subclass's override takes effect; the facade's own comes back to :meth:`log_save_evaluate`)."""
        facade = self.facade
        facade._maybe_log_save_evaluate(
            self.tr_loss,
            self.grad_norm,
            facade.model,
            self.trial,
            self._epoch_index(),  # transformers passes its epoch counter, not state.epoch
            self.ignore_keys_for_eval,
            self.start_time,
            learning_rate=self.learning_rate,
        )

    def log_save_evaluate(
        self,
        tr_loss: torch.Tensor,
        grad_norm: torch.Tensor | float | None,
        model: torch.nn.Module,
        trial: Any,
        ignore_keys_for_eval: list[str] | None,
        start_time: float,
        learning_rate: float | None = None,
    ) -> None:
        """transformers' ``_maybe_log_save_evaluate``: log the running loss (``tr_loss`` is reset in place), evaluate
        and track the best metric, save a checkpoint, as the control flags ask."""
        facade = self.facade
        control, state = facade.control, facade.state
        if control.should_log and state.global_step > self.globalstep_last_logged:
            tr_loss_scalar = self.run.world.reduce_mean(tr_loss).item()
            tr_loss -= tr_loss
            logs: dict[str, float] = {"loss": tr_loss_scalar / (state.global_step - self.globalstep_last_logged)}
            if grad_norm is not None:
                logs["grad_norm"] = grad_norm.item() if torch.is_tensor(grad_norm) else grad_norm
            logs["learning_rate"] = learning_rate if learning_rate is not None else facade._get_learning_rate()
            self.total_loss_scalar += tr_loss_scalar
            self.globalstep_last_logged = state.global_step
            facade.store_flos()
            self._warn_if_nonfinite(logs)
            facade.log(logs, start_time)

        if facade.control.should_evaluate:
            metrics = facade._evaluate(trial, ignore_keys_for_eval)
            is_new_best = facade._determine_best_metric(metrics, trial)
            if facade.args.save_strategy == SaveStrategy.BEST:
                facade.control.should_save = is_new_best

        if facade.control.should_save:
            self._save(model, trial)

    def _save(self, model: torch.nn.Module, trial: Any) -> None:
        self.facade._save_checkpoint(model, trial)
        self.saved_step = self.facade.state.global_step
        dispatch(self.facade, "on_save")

    def _warn_if_nonfinite(self, logs: dict[str, float]) -> None:
        """Once per ``train()``: the first logged loss or gradient norm that is NaN or infinite."""
        bad = [k for k in ("loss", "grad_norm") if isinstance(logs.get(k), float) and not math.isfinite(logs[k])]
        if bad and not self.warned_nonfinite:
            self.warned_nonfinite = True
            values = ", ".join(f"{k}={logs[k]}" for k in bad)
            logger.warning(
                f"Step {self.facade.state.global_step}: logged {values}. Training continues, but the model may be "
                "diverging (too high a learning rate, fp16 overflow, bad inputs); with fp16 the gradient scaler skips "
                "steps whose gradients overflow. Only the first occurrence is reported."
            )

    # -- stops ---------------------------------------------------------------------------------------------------
    def stop_if_requested(self) -> None:
        """At a step boundary: if a stop signal arrived (on any rank), save a checkpoint and stop training."""
        facade = self.facade
        step = facade.state.global_step
        self.stop.global_step = step
        signum = self.stop.agreed(self.run.world.strategy)
        if signum is None:
            return
        args, name = facade.args, signal_name(signum)
        if args.save_strategy == SaveStrategy.NO:
            raise stopped(
                signum,
                f"Training stopped by {name} after step {step} of {facade.state.max_steps}; no checkpoint was saved "
                "(save_strategy='no').",
                step,
            )
        if self.saved_step != step:
            self._save(facade.model, self.trial)
        folder = os.path.join(args.output_dir, f"{PREFIX}-{step}")
        raise stopped(
            signum,
            f"Training stopped by {name} after step {step} of {facade.state.max_steps}; checkpoint saved in {folder}. "
            f"Continue with train(resume_from_checkpoint={folder!r}) (args.resume_from_checkpoint={folder} on the "
            "command line).",
            step,
            folder,
        )

    # -- the end ---------------------------------------------------------------------------------------------------
    def token_speed(self, start_time: float) -> dict[str, float]:
        """``Trainer.log(logs, start_time)`` with ``include_num_input_tokens_seen``: transformers' train speed of the
        tokens seen in this ``train()`` call."""
        tokens = self.facade.state.num_input_tokens_seen - self.initial_num_input_tokens_seen
        return speed_metrics("train", start_time, num_tokens=tokens)

    def finish(self, loggers: list[Any], measure_memory: Any = None) -> TrainOutput:
        """After ``fit``: HF's train metrics and log entry, the best model, final rotation, on_train_end; ``loggers``:
        the run's Lightning loggers, flushed after the last entry; ``measure_memory(metrics)``: adds
        ``skip_memory_metrics=False``'s metrics."""
        facade = self.facade
        console.training_completed()
        train_loss = self.train_loss()
        steps_run = facade.state.global_step - self.initial_global_step
        metrics = speed_metrics(
            "train",
            self.start_time,
            num_samples=self.plan.num_train_samples * steps_run / max(facade.state.max_steps, 1),
            num_steps=steps_run,
        )
        facade.store_flos()
        metrics["total_flos"] = facade.state.total_flos
        metrics["train_loss"] = train_loss
        if measure_memory is not None:
            measure_memory(metrics)
        facade.log(metrics)
        for lightning_logger in loggers:  # fit has ended: flush what came after it
            lightning_logger.save()
        if facade.args.load_best_model_at_end and facade.state.best_model_checkpoint is not None:
            facade._load_best_model()
        folders.finalize_rotation(facade.args, facade.state, facade._get_output_dir(self.trial))
        dispatch(facade, "on_train_end")
        return TrainOutput(facade.state.global_step, train_loss, metrics)

    def train_loss(self) -> float:
        """Mean loss over the optimizer steps of this ``train()`` call (HF's ``train_loss``)."""
        self.total_loss_scalar += self.run.world.reduce_mean(self.tr_loss).item()
        self.tr_loss -= self.tr_loss
        steps = self.facade.state.global_step - self.initial_global_step
        return self.total_loss_scalar / max(steps, 0.001)
