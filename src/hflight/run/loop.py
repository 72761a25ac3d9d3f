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

import dataclasses
import logging
import math
import os
import time
from typing import Any

import torch
from transformers.trainer_utils import SaveStrategy, TrainOutput, speed_metrics

from hflight.callbacks.hooks import new_trainer_state
from hflight.checkpoints import folders, parts, resume
from hflight.checkpoints.manifest import PREFIX
from hflight.checkpoints.names import DATA_POSITION_NAME
from hflight.run import console, requeue
from hflight.run.events import dispatch
from hflight.run.interrupt import StopRequest, signal_name, stopped
from hflight.run.plan import TrainingPlan
from hflight.run.position import Start, describe_start, start_of
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
        self.resumed_batches = 0  # micro-batches of its first pass a resumed run had already trained
        self.tracker: Any = None  # the training data's position (hflight.run.position.DataTracker)
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
        self.epoch_end_pending = False  # the last step ended an epoch whose end has not run yet
        self.loss_since_step = 0  # train_loss averages the steps after this one
        self.began = False  # on_train_begin dispatched (Lightning skips on_train_start for a run without a step)

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
        run.backend.hf_run_planned(facade.args, facade.model, plan.max_steps)
        facade.state = new_trainer_state(
            facade.callback_handler.callbacks,
            facade.control,
            is_local_process_zero=facade.is_local_process_zero(),
            is_world_process_zero=facade.is_world_process_zero(),
        )
        facade.state.is_hyper_param_search = self.trial is not None  # integrations read it (W&B: a run per trial)
        facade.state.train_batch_size = run.train_batch_size
        facade.state.compute_steps(facade.args, plan.max_steps)
        self.tracker = datamodule.tracker
        start = Start(0)
        if run.resume is not None:
            nodes = run.lightning_trainer.num_nodes
            facade.state = resume.resumed_state(facade, run.resume, run.world.size, plan, nodes)
            facade._load_callback_state()  # transformers' override point, at its moment: right after the state
            start = self._data_start(loader)
            datamodule.resume_at(
                start,
                lambda: parts.load_rng_state(run.resume, run.world),
                lambda: parts.load_rng_state(run.resume, run.world, epoch_start=True),
            )
        facade.state.init_training_references(facade, plan.max_steps, plan.num_train_epochs, self.trial)
        self._check_same_start()
        self._start_bookkeeping()
        self.epochs_offset, self.resumed_batches = start.epoch, start.batches
        resumed_at = facade.state.global_step if run.resume is not None else None
        data = describe_start(start, run.resume.folder, resumed_at) if run.resume is not None else ""
        console.training_started(facade.args, plan, facade.model, resumed_at, data)
        folders.clean_output_dir(facade.args, run.resume.folder if run.resume is not None else None)
        return -1 if plan.unbounded else plan.num_train_epochs - start.epoch

    def _data_start(self, loader: Any) -> Start:
        """Where the resumed run's data starts and how it is taken up (``hflight.run.position.start_of``, the one
        place that decides), for this process's data-parallel replica (the processes of a tensor-parallel group share
        one position). A stream dispatched from replica 0 is taken up as replica 0 decides: the others read nothing,
        but they step through its batches with it."""
        facade, run = self.facade, self.run
        step = facade.state.global_step
        arithmetic = self.plan.resume_position(step, facade.args.ignore_data_skip)
        where = os.path.join(run.resume.folder, DATA_POSITION_NAME)
        replicas, replica = run.world.data_parallel
        described = self.tracker.dataset if self.tracker is not None else None
        start = start_of(run.resume.data_position, loader, arithmetic, facade.args.ignore_data_skip,
                         (replicas, replica), where, step, described)  # fmt: skip
        if getattr(loader, "how", None) == "dispatched" and replicas > 1:
            first = run.world.gather_objects([dataclasses.replace(start, state=None)])[0]
            start = start if replica == 0 else first
        if start.how == "read" and run.resume.data_position is not None:
            process = f" (data-parallel replica {replica})" if replicas > 1 else ""
            logger.warning(describe_start(start, run.resume.folder, step) + process)
        return start

    def trained_through(self, position: dict[str, Any] | None) -> None:
        """The optimizer step of a cycle whose last batch left the training loader at ``position`` was taken."""
        if self.tracker is not None:
            self.tracker.trained(position)

    def _check_same_start(self) -> None:
        """Every process starts from the same checkpoint (or none); processes that disagree (a restart one node took
        for a first start, different paths per node) would train different models, or wait for each other forever:
        they all stop here, naming each one's start."""
        world, point = self.run.world, self.run.resume  # by name: nodes without a shared disk each have a folder
        mine = f"{os.path.basename(point.folder)} (step {self.facade.state.global_step})" if point else "a fresh start"
        starts = world.gather_objects([mine])
        if len(set(starts)) > 1:
            listed = "; ".join(f"rank {rank}: {start}" for rank, start in enumerate(starts))
            raise RuntimeError(
                f"The {world.size} processes of this run do not start from the same checkpoint ({listed}). Give "
                "every process the same resume_from_checkpoint (resume=auto continues each from the run folder's last "
                "valid checkpoint)."
            )

    def _start_bookkeeping(self) -> None:
        """Running loss, logging position and ``train_loss``'s first step at the start of the call (also when a
        resumed run has no step left, so Lightning never starts training)."""
        self.tr_loss = torch.tensor(0.0)
        self.initial_global_step = self.globalstep_last_logged = self.facade.state.global_step
        self.loss_since_step = self.initial_global_step  # train_loss: the mean over this call's steps (transformers')
        if self.run.resume is not None and self.run.resume.continued:
            self._continue_loop(self.run.resume)

    def train_begin(self, train_loader: Any, device: torch.device) -> None:
        """Lightning's ``on_train_start``: the optimizer's resumed state, the bookkeeping, ``on_train_begin``."""
        facade = self.facade
        handler = facade.callback_handler
        handler.model, handler.optimizer, handler.lr_scheduler = facade.model, facade.optimizer, facade.lr_scheduler
        handler.train_dataloader = train_loader
        if self.run.resume is not None:  # transformers' override point, called when resuming
            facade._load_optimizer_and_scheduler(self.run.resume.folder)
        self.tr_loss = self.tr_loss.to(device)
        self.start_time = time.time()
        self.initial_num_input_tokens_seen = facade.state.num_input_tokens_seen  # tokens/s of this call only
        facade.model.zero_grad(set_to_none=True)
        self.began = True
        dispatch(facade, "on_train_begin")
        if self.run.resume is not None and self.run.resume.continued and self.epoch_end_pending:
            self._finish_pending_epoch(self.run.resume)
        if facade.args.eval_on_start:
            facade._evaluate(self.trial, self.ignore_keys_for_eval, skip_scheduler=True)

    # -- epochs --------------------------------------------------------------------------------------------------
    def epoch_begin(self) -> None:
        # a resumed pass counts the batches trained before the checkpoint (one that ended with them is not empty)
        self.micro_steps_this_epoch, self.resumed_batches = self.resumed_batches, 0
        dispatch(self.facade, "on_epoch_begin")

    def epoch_end(self, counts_batches: bool) -> bool:
        """``on_epoch_end``, then log/evaluate/save; returns whether training stops. ``counts_batches``: an epoch
        that yielded no batch means the (iterable) dataset is exhausted, which ends training as in HF."""
        if self.micro_steps_this_epoch == 0 and counts_batches:
            self.facade.control.should_training_stop = True
        self.epoch_end_pending = False
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
            console.logger.warning(  # transformers' own line, on its logger
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
                console.logger.warning(
                    "Could not determine method to count non-padding tokens, falling back to counting all tokens."
                )
            tokens = inputs[main_input].numel()
        device = inputs[main_input].device
        tokens = torch.as_tensor(tokens, device=device, dtype=torch.int64)
        # over every process, as transformers' gather: a tensor-parallel group's copies of a batch each count
        facade.state.num_input_tokens_seen += int(self.run.world.every_process(tokens).sum().item())

    def clip_and_pre_step(self, model: torch.nn.Module) -> None:
        facade = self.facade
        max_norm = facade.args.max_grad_norm
        clip = getattr(model, "clip_grad_norm_", None)  # FSDP-wrapped modules clip their own shards
        norm_limit = max_norm if max_norm and max_norm > 0 else float("inf")
        if clip is not None:
            grad_norm = clip(norm_limit)
        else:
            grad_norm = self.run.backend.hf_clip_grad_norm(facade.model.parameters(), norm_limit)
        self.pre_optimizer_step(grad_norm)

    def pre_optimizer_step(self, grad_norm: torch.Tensor | float | None) -> None:
        """``on_pre_optimizer_step``; ``grad_norm`` is logged with the next loss (None: not known on the host)."""
        self.grad_norm = grad_norm
        dispatch(self.facade, "on_pre_optimizer_step")

    def optimizer_stepped(self) -> None:
        dispatch(self.facade, "on_optimizer_step")

    def step_end(self, step_in_epoch: int, learning_rate: float) -> None:
        facade = self.facade
        self.run.checkpoint_writer.raise_if_failed()  # save_async: a background write that failed stops the run
        self.learning_rate = learning_rate
        facade.state.global_step += 1
        facade.state.epoch = self._epoch_index() + (step_in_epoch + 1) / self.plan.steps_in_epoch
        # Until the epoch's end has run, a checkpoint of this step records that it is pending (a run continued from
        # it runs it first: :meth:`_finish_pending_epoch`).
        self.epoch_end_pending = step_in_epoch + 1 >= self.plan.steps_in_epoch or facade.control.should_epoch_stop
        dispatch(facade, "on_step_end")
        if facade.state.global_step == self.initial_global_step + 1:  # the state exists: save_async's area made
            folders.prepare_staging(facade, self.run)
        self.epoch_end_pending = self.epoch_end_pending or facade.control.should_epoch_stop
        self.maybe_log_save_evaluate()
        if not facade.control.should_training_stop:  # training ends after this epoch's end: the stop waits for it
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
        if self._would_rewrite_the_resumed_checkpoint(trial):
            return
        self.facade._save_checkpoint(model, trial)
        self.saved_step = self.facade.state.global_step
        try:
            dispatch(self.facade, "on_save")
        finally:  # save_async: the folder is published after on_save, with what its callbacks wrote into it
            self.run.checkpoint_writer.callbacks_done()

    def _would_rewrite_the_resumed_checkpoint(self, trial: Any) -> bool:
        """Whether this save would write the very checkpoint the run resumed from, before any step (an epoch end the
        checkpoint already holds): it is left as it is, with its data position."""
        point, step = self.run.resume, self.facade.state.global_step
        if point is None or step != self.initial_global_step:
            return False
        folder = os.path.join(self.facade._get_output_dir(trial), f"{PREFIX}-{step}")
        same = os.path.exists(folder) and os.path.samefile(folder, point.folder)
        if same:
            logger.info(f"{folder} is the checkpoint this run resumed from, at the same step: not written again.")
            self.facade.control.should_save = False
        return same

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
        """At a step boundary: if a stop signal arrived (on any rank), save a checkpoint and stop training; for SLURM's
        requeue signal, requeue the job once the checkpoint is complete (``hflight.run.requeue``)."""
        facade = self.facade
        step = facade.state.global_step
        self.stop.global_step = step
        signum = self.stop.agreed(self.run.world.strategy)
        if signum is None:
            return
        args, name = facade.args, signal_name(signum)
        stopped_by = f"Training stopped by {name} after step {step} of {facade.state.max_steps}"
        folder = None
        facade.control.should_training_stop = True  # its checkpoint is the run's last: written from the state itself
        if args.save_strategy != SaveStrategy.NO:
            if self.saved_step != step:
                self._save(facade.model, self.trial)
            self.run.checkpoint_writer.wait()  # save_async: the checkpoint is published before it is reported
            folder = os.path.join(args.output_dir, f"{PREFIX}-{step}")
        self.stop.exiting = True  # the checkpoint is on disk: a signal from now on changes nothing
        if self.stop.requeue:
            outcome = requeue.requeue_job(self.run.world)
            saved = f"checkpoint saved in {folder}" if folder else "no checkpoint was saved (save_strategy='no')"
            raise stopped(signum, f"{stopped_by}; {saved}. {requeue.requeue_message(outcome, folder)}", step, folder)
        if folder is None:
            raise stopped(signum, f"{stopped_by}; no checkpoint was saved (save_strategy='no').", step)
        how = (
            ""  # hflight-train prints its own command (hflight.run.console.command_line)
            if console.on_command_line()
            else f" Continue with train(resume_from_checkpoint={folder!r}) (args.resume_from_checkpoint={folder} on "
            "the command line)."
        )
        raise stopped(signum, f"{stopped_by}; checkpoint saved in {folder}.{how}", step, folder)

    # -- the end ---------------------------------------------------------------------------------------------------
    def token_speed(self, start_time: float) -> dict[str, float]:
        """``Trainer.log(logs, start_time)`` with ``include_num_input_tokens_seen``: transformers' train speed of the
        tokens seen in this ``train()`` call."""
        tokens = self.facade.state.num_input_tokens_seen - self.initial_num_input_tokens_seen
        return speed_metrics("train", start_time, num_tokens=tokens)

    def finish(self, loggers: list[Any], measure_memory: Any = None) -> TrainOutput:
        """After ``fit``: HF's train metrics and log entry (none on the command line for a resumed run that trained
        nothing: ``hflight.run.console.command_line``), the best model, final rotation, on_train_end; ``loggers``:
        the run's Lightning loggers, flushed after the last entry; ``measure_memory(metrics)``: adds
        ``skip_memory_metrics=False``'s metrics."""
        facade = self.facade
        if not self.began:  # no step to run (num_train_epochs=0, resumed at the last step): transformers begins anyway
            trainer = self.run.lightning_trainer
            self.train_begin(trainer.datamodule.train_loader, trainer.strategy.root_device)
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
        if not (steps_run == 0 and self.run.resume is not None and console.on_command_line()):
            facade.log(metrics)  # transformers logs a call that trained nothing too; the command line says why instead
        for lightning_logger in loggers:  # fit has ended: flush what came after it
            lightning_logger.save()
        if facade.args.load_best_model_at_end and facade.state.best_model_checkpoint is not None:
            facade._load_best_model()
        folders.finalize_rotation(facade.args, facade.state, facade._get_output_dir(self.trial))
        dispatch(facade, "on_train_end")
        return TrainOutput(facade.state.global_step, train_loss, metrics)

    def train_loss(self) -> float:
        """Mean loss over the optimizer steps of this ``train()`` call (HF's ``train_loss``); of the whole run for a
        run continued by ``resume_from_checkpoint="auto"`` (:meth:`_continue_loss`)."""
        self.total_loss_scalar += self.run.world.reduce_mean(self.tr_loss).item()
        self.tr_loss -= self.tr_loss
        steps = self.facade.state.global_step - self.loss_since_step
        return self.total_loss_scalar / max(steps, 0.001)

    # -- the loss across a restart ---------------------------------------------------------------------------------
    def progress(self) -> dict[str, Any]:
        """What a checkpoint records of the loop beyond ``TrainerState`` (every rank calls it: their running losses
        are gathered): the sum of the losses logged since step ``since_step``, each rank's loss not logged yet, the
        last logged step, and whether the step ended an epoch whose end (``on_epoch_end``, the epoch's evaluation
        and save) has not run yet."""
        pending = self.run.world.gather_objects([float(self.tr_loss.item())])
        return {
            "sum": self.total_loss_scalar,
            "since_step": self.loss_since_step,
            "pending": pending,
            "last_logged_step": self.globalstep_last_logged,
            "epoch_end_pending": self.epoch_end_pending,
        }

    def _continue_loop(self, point: Any) -> None:
        """A run continued by ``resume_from_checkpoint="auto"`` goes on with the checkpoint's loss bookkeeping, so it
        logs the losses and the ``train_loss`` of the run that did not stop (an explicit resume reports, as
        transformers does, over the steps of its own call). A record that does not fit this run (another number of
        processes, a value out of range) is ignored with a warning."""
        record = (point.manifest or {}).get("loop")
        step, world = self.facade.state.global_step, self.run.world
        fits = (
            isinstance(record, dict)
            and all(type(record.get(k)) is int and 0 <= record[k] <= step for k in ("since_step", "last_logged_step"))
            and type(record.get("sum")) in (int, float)
            and math.isfinite(record["sum"])
            and isinstance(record.get("pending"), list)
            and len(record["pending"]) == world.size
            and all(type(v) in (int, float) and math.isfinite(v) for v in record["pending"])
        )
        if not fits:
            if record is not None:
                logger.warning(f"{point.folder}: its loss record does not fit this run; train_loss covers this call.")
            return
        self.total_loss_scalar = float(record["sum"])
        self.loss_since_step = record["since_step"]
        self.globalstep_last_logged = record["last_logged_step"]
        self.tr_loss = torch.tensor(float(record["pending"][world.rank]))
        self.epoch_end_pending = record.get("epoch_end_pending") is True and not point.model_only

    def _finish_pending_epoch(self, point: Any) -> None:
        """The checkpoint was written after the last step of an epoch and before that epoch's end (a stop signal at
        that step boundary, or a step checkpoint there): run the epoch end now, with the RNG streams it had (so the
        next epoch draws the same data order), as the run that did not stop ran it."""
        facade, run = self.facade, self.run
        parts.load_rng_state(point, run.world)
        if run.datamodule is not None and run.datamodule.cycles is not None:
            run.datamodule.cycles.restore_rng = None  # restored now, before the epoch end, not again
        self.epoch_end_pending = False
        dispatch(facade, "on_epoch_end")
        self.maybe_log_save_evaluate()
        if facade.control.should_training_stop:
            run.lightning_trainer.should_stop = True
