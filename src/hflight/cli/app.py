"""The Hydra app: :func:`train` (a composed config -> the task's trainer, trained, evaluated, predicted),
:func:`run` (``train`` with the failure handling and signals of a command-line run; ``optimized_metric`` back to a
sweeper) and :func:`main` (``hflight-train``, ``python -m hflight``, ``python train.py``). :func:`train` hands
everything task-specific to the ``task`` node: a ``_target_`` whose instance has ``setup(cfg, args, callbacks)``
returning a :class:`TaskRun` (for extractive QA, ``hflight.qa.recipe.MRCRecipe``: data, tokenizer, model, windows and
the ``MRCTrainer``, data checked before anything trains). Then it trains, evaluates and predicts as
``args.do_train``/``do_eval``/``do_predict`` ask, writing ``train_results.json``, ``eval_results.json``,
``all_results.json``, ``trainer_state.json`` and the model into ``args.output_dir`` (the Hydra run directory), and
prints a table of the final metrics."""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from typing import Any, Protocol

import hydra
from hydra.experimental.callback import Callback
from hydra.utils import instantiate
from lightning.fabric.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig, OmegaConf

from hflight import durable
from hflight.arguments.hardware import check_hardware, describe_backend
from hflight.arguments.training_args import TrainingArguments
from hflight.checkpoints.manifest import get_last_checkpoint
from hflight.checkpoints.storage import StorageError, storage_for
from hflight.cli.failures import USER_ERRORS, RunFailed, _clear_failure, _describe, _record_failure, _run_dir
from hflight.cli.jobs import (
    PRUNED_FILE,
    _in_multirun,
    _job_hydra_config,
    _requeue_signal_under_launcher,
    _search_folder,
    _set_cpu_threads,
    _trial_reporter,
)
from hflight.cli.loggers import ConfigHyperparameters, ConfigToIntegrations, _close_loggers, logger_environment
from hflight.cli.report import _draw_curves, format_metrics_table, optimized_value
from hflight.cli.resume import _resume_from, finished_run, resume_arguments, resume_command, resume_point, resumed_step
from hflight.cli.streams import best_effort_console
from hflight.config import PRIMARY_CONFIG, VERSION_BASE, check_args_fields, check_command_line, hydra_config_path
from hflight.run.console import command_line
from hflight.run.interrupt import TrainingInterrupted, requeue_signal, signal_name, terminate_on_signals
from hflight.sweeps.trial import JobPruned, job_in_worker_process

__all__ = ["CheckBeforeTheRunFolder", "TaskRun", "check_gpu", "instantiate_callbacks", "main", "run", "train"]

log = logging.getLogger(__name__)


class TaskRun(Protocol):
    """What a task's ``setup(cfg, args, callbacks)`` returns: everything :func:`train` runs, already built."""

    trainer: Any  # an hflight.Trainer (or subclass) holding the model, datasets and callbacks
    objects: dict[str, Any]  # what the task built, returned to a notebook (tokenizer, model, datasets, ...)

    def num_samples(self, split: str) -> int:
        """The size reported as ``{train,eval,predict}_samples`` for split ``train``/``validation``/``test``."""
        ...

    def predict(self, split: str) -> Any:
        """``trainer.predict`` on split ``test`` (a ``PredictionOutput``)."""
        ...


# ---------------------------------------------------------------------------------------------------- entry points
def train(cfg: DictConfig) -> tuple[dict[str, float], dict[str, Any]]:
    """Build everything from ``cfg``, train, evaluate and predict; return ``(metrics, objects)``.

    ``metrics`` merges the ``train_*``, ``eval_*`` and ``predict_*`` results; ``objects`` holds what was built
    (``args``, ``callbacks``, ``task``, ``trainer`` and the task's own objects: for MRC ``model_args``,
    ``data_args``, ``tokenizer``, ``model``, ``examples``, ``features``) for a notebook to keep working with.
    The composed config and the training arguments go to every logger of ``report_to`` as hyperparameters
    (``logger.<name>.*`` options set the environment variables transformers' integrations read, for the length of
    the call), and ``training_curves.png`` is drawn into the run folder from ``trainer.state.log_history``.

    A run resumed from the last checkpoint of a run that had already finished trains nothing: it says so, keeps the
    run's results, and returns the metrics of its ``all_results.json``.

    Raises:
        TypeError, ValueError: invalid training arguments (before anything else is built; a key of ``args`` that is
            not a field is named, with the closest ones), missing or empty data (before anything is trained).
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    log.info(f"Instantiating training arguments <{TrainingArguments.__module__}.TrainingArguments>")
    check_args_fields(cfg.args.keys())
    args = TrainingArguments.from_config(cfg.args)
    with logger_environment(cfg.get("logger"), args):
        return _train(cfg, args)


def _train(cfg: DictConfig, args: TrainingArguments) -> tuple[dict[str, float], dict[str, Any]]:
    from transformers import set_seed

    _set_cpu_threads(cfg.get("cpu_threads"), _job_hydra_config())
    # A backend that cannot start here (no poptorch for trainer=ipu, no GPU for trainer=gpu) fails now, with its own
    # message, not after the data has been generated and tokenized.
    check_gpu(args.accelerator)
    check_hardware(args)
    if args.should_save:  # an object store that cannot take the checkpoints: said before the data is made
        storage_for(args).probe()
    args.resume_from_checkpoint = resume_point(args)  # before the task reads the run folder (it reuses its data)
    set_seed(args.seed)  # before the model is initialised, as run_qa.py
    log.info(f"Instantiating task <{cfg.task._target_}>")
    task = instantiate(cfg.task)
    callbacks = instantiate_callbacks(cfg.get("callbacks"))
    reporter = _trial_reporter(cfg)  # a job of an Optuna search: optimized_metric to its trial at each evaluation
    extra = [ConfigHyperparameters(cfg), *([reporter] if reporter else [])]
    built: TaskRun = task.setup(cfg, args, [*callbacks, *extra])
    trainer = built.trainer
    trainer.add_callback(ConfigToIntegrations(cfg, trainer.callback_handler.callbacks))
    metrics = _train_evaluate_predict(trainer, built, args, reporter)
    if metrics is None:  # resumed at the end of a finished run: nothing trained, its results kept
        metrics = _saved_results(args.output_dir)
    elif trainer.is_world_process_zero():
        _draw_curves(trainer, args)
    if metrics and trainer.is_world_process_zero():
        from transformers.trainer_pt_utils import metrics_format

        ran = "Evaluated" if args.do_eval or args.do_predict else "Trained"
        title = f"Final metrics ({args.output_dir})\n{ran} with {describe_backend(trainer.lightning_trainer)}"
        print(format_metrics_table(metrics_format(metrics), title))
    _check_stored(trainer, args)
    objects = dict(args=args, callbacks=callbacks, task=task, trainer=trainer, **built.objects)
    return metrics, objects


def _check_stored(trainer: Any, args: TrainingArguments) -> None:
    """With a ``remote_output_dir``: the run's own files (predictions, results) stored beside its checkpoints, and
    the command fails when its last checkpoint could not be stored (it is kept in the staging folder)."""
    storage = storage_for(args)
    if not storage.remote or not trainer.is_world_process_zero():
        return
    own = [e.path for e in os.scandir(args.output_dir) if e.is_file() and not e.name.startswith(".")]  # no locks
    storage.put_files(args.output_dir, own)
    missing = storage.settle()
    last = get_last_checkpoint(args.output_dir)
    if last is not None and os.path.abspath(last) in missing:
        raise StorageError(
            f"The run's last checkpoint {last} could not be stored in {storage.where(last)}; it is kept in the "
            f"staging folder {args.output_dir}. Upload it (or run again with the same output_dir once the store "
            "answers) before relying on the bucket."
        )


def _train_evaluate_predict(
    trainer: Any, built: TaskRun, args: TrainingArguments, reporter: Any = None
) -> dict[str, float] | None:
    """The metrics of training, evaluation and prediction, each saved; None (nothing saved) when the checkpoint the
    run resumed from was already the end of its training."""
    metrics: dict[str, float] = {}
    if args.do_train:
        log.info("Starting training")
        resume_from = _resume_from(args.resume_from_checkpoint)
        start = resumed_step(args.output_dir, resume_from)
        result = trainer.train(resume_from_checkpoint=resume_from)
        if reporter is not None and reporter.pruned is not None:  # stopped by the pruner, with its checkpoint
            trainer.save_state()
            raise JobPruned(reporter.trial.number, *reporter.pruned)
        if start and trainer.state.global_step <= start:
            state = trainer.state
            log.warning(finished_run(args.output_dir, start, state.max_steps, state.num_train_epochs))
            return None
        trainer.save_model()
        train_metrics = {**result.metrics, "train_samples": built.num_samples("train")}
        trainer.save_metrics("train", train_metrics)
        trainer.save_state()
        metrics.update(train_metrics)
    if args.do_eval:
        log.info("Starting evaluation")
        eval_metrics = {**trainer.evaluate(), "eval_samples": built.num_samples("validation")}
        trainer.save_metrics("eval", eval_metrics)
        metrics.update(eval_metrics)
    if args.do_predict:
        log.info("Starting prediction")
        output = built.predict("test")
        predict_metrics = {**output.metrics, "predict_samples": built.num_samples("test")}
        trainer.save_metrics("predict", predict_metrics)
        metrics.update(predict_metrics)
    return metrics


def run(cfg: DictConfig) -> float | None:
    """:func:`train`, then the value of ``cfg.optimized_metric`` (None when it is unset).

    A failure is recorded in ``error.txt`` (the traceback) in the run directory and reported once: a user error
    (bad configuration, data or checkpoint: ``ValueError``, ``TypeError``, ``KeyError``, ``OSError``, ...) as its
    message, anything else with its traceback. In a multirun the job then returns None, so that the other jobs still
    run and the sweep completes: Hydra's basic sweeper ignores return values, and the Optuna sweeper records a trial
    whose value is not a float as failed and goes on (it would crash on NaN: Optuna 2's ``Study.tell`` raises on it,
    also when marking the trial failed). A single run re-raises; on the command line (``python train.py``,
    ``hflight-train``) Hydra then prints a user error as one message, without a traceback
    (``HYDRA_FULL_ERROR=1`` shows it).

    SIGTERM and SIGINT stop training at the next step boundary with a checkpoint (``hflight.run.interrupt``) and, at any
    other time, at once; either way ``error.txt`` says so, with the command that continues the run (the search, for a
    trial of an Optuna search), and the process exits with 128 + the signal number, in a multirun too. A run that
    completes removes the ``error.txt`` of an earlier attempt in its folder (the interruption it continued).
    """
    _requeue_signal_under_launcher(cfg)
    on_command_line = _on_command_line()
    try:
        # under SLURM the requeue signal requeues the job; after a stop the command line exits, having said how to
        # continue (only the command to type: the console leaves out the Python call)
        signals = terminate_on_signals(requeue_signal(cfg.args), process_exits=on_command_line)
        with signals, command_line(on_command_line):
            metrics, _ = train(cfg)
            value = optimized_value(metrics, cfg.get("optimized_metric"))
        _clear_failure(cfg)  # an earlier attempt's error.txt (the interruption this run continued)
        return value
    except TrainingInterrupted as exc:
        hint = _how_to_continue(cfg, exc.checkpoint)
        where = _record_failure(cfg, f"{exc}\n{hint}")
        log.error(f"Run stopped by {signal_name(exc.signum)}; recorded in {where}")
        if hint:
            print(hint, end="", file=sys.stderr, flush=True)
        if _in_multirun() and job_in_worker_process():
            return None  # the sweeper, which forwarded the signal, stops the sweep once every job has stopped
        raise
    except JobPruned as exc:
        path = _run_dir(cfg) / PRUNED_FILE
        path.write_text(json.dumps({"trial": exc.number, "step": exc.step, "value": exc.value}) + "\n", "utf-8")
        durable.sync_files([path])  # on disk before the job reports it
        log.warning(f"Job pruned: {exc}; its checkpoint is in {_run_dir(cfg)} ({PRUNED_FILE})")
        return None
    except Exception as exc:
        where = _record_failure(cfg, traceback.format_exc())
        user_error = isinstance(exc, USER_ERRORS)
        if _in_multirun():
            log.error(
                f"Job failed: {_describe(exc)} (traceback in {where}). The sweep goes on with the remaining jobs.",
                exc_info=None if user_error else exc,
            )
            return None
        log.error(f"Run failed; the traceback is in {where}")
        if user_error and _on_command_line() and not os.environ.get("HYDRA_FULL_ERROR"):
            raise RunFailed(_describe(exc)) from exc
        raise
    finally:
        _close_loggers()


def _how_to_continue(cfg: DictConfig, checkpoint: str | None) -> str:
    """The command that continues a stopped run: ``resume=<sweep folder>`` for a trial of an Optuna search (the
    search continues, the trial from its checkpoint), ``resume=<run folder>`` for a run stopped with a checkpoint."""
    search = _search_folder()
    if search is not None:
        return f"To continue this search: {resume_command(search)}\n"
    return f"To continue this run: {resume_command(_run_dir(cfg))}\n" if checkpoint else ""


def main(cfg: DictConfig | None = None) -> float | None:
    """``hflight-train [overrides]`` (also ``python -m hflight``, ``python train.py``) on the command line, with
    ``resume=<run folder>`` expanded first (:func:`resume_arguments`); ``main(cfg)`` runs a composed config (see
    :func:`run`)."""
    if cfg is not None:
        return run(cfg)
    best_effort_console()  # a console that goes (| tee ended by Ctrl-C) never fails the run; its log keeps all
    try:
        sys.argv[1:] = resume_arguments(sys.argv[1:])
        check_command_line(sys.argv[1:])  # before Hydra: an unknown field (it would advise +), a slip's meaning
    except ValueError as exc:
        raise SystemExit(f"hflight-train: {exc}") from None
    return _hydra_main()


@hydra.main(version_base=VERSION_BASE, config_path=hydra_config_path(), config_name=PRIMARY_CONFIG)
def _hydra_main(cfg: DictConfig) -> float | None:
    return run(cfg)


def _saved_results(output_dir: str) -> dict[str, float]:
    """The metrics a run saved in ``all_results.json`` (none if it saved none)."""
    path = os.path.join(output_dir, "all_results.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as saved:
        return json.load(saved)


def check_gpu(accelerator: str | None) -> None:
    """``args.accelerator`` ``gpu`` (or ``cuda``; ``trainer=gpu``, ``gpu_bf16``, ``ddp``) needs a CUDA device here.

    Raises:
        MisconfigurationException: torch finds none, saying so and naming the CPU's choices (Lightning's would only
            say "No supported gpu backend found!").
    """
    import torch

    if str(accelerator).lower() not in ("gpu", "cuda") or torch.cuda.is_available():
        return
    build = f"torch {torch.__version__}" + (", a build without CUDA" if torch.version.cuda is None else "")
    raise MisconfigurationException(
        f"args.accelerator={accelerator} (trainer=gpu, gpu_bf16 or ddp) needs a CUDA GPU, and torch finds none here "
        f"({build}). Train on the CPU with trainer=cpu (trainer=ddp_cpu for several processes), or with "
        "trainer=default, which takes a GPU where there is one and the CPU otherwise."
    )


class CheckBeforeTheRunFolder(Callback):
    """A Hydra callback (``hydra.callbacks`` in ``conf/hydra/default.yaml``) that checks, once the command line's
    config is composed and before Hydra makes the run folder, what would make the run fail at once: a GPU asked for
    where there is none (:func:`check_gpu`). The command exits with the message, as it does for a wrong ``resume=``
    (Hydra turns a callback's exceptions into warnings; ``SystemExit`` is not one of them)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            check_gpu(OmegaConf.select(config, "args.accelerator", throw_on_resolution_failure=False))
        except MisconfigurationException as exc:
            raise SystemExit(f"hflight-train: {exc}") from None


def instantiate_callbacks(callbacks_cfg: DictConfig | None) -> list[Any]:
    """One callback per ``_target_`` node of the ``callbacks`` group (HF TrainerCallbacks or Lightning Callbacks)."""
    callbacks: list[Any] = []
    if not callbacks_cfg:
        return callbacks
    if not isinstance(callbacks_cfg, DictConfig):
        raise TypeError("callbacks must be a mapping of name -> _target_ node")
    for name, node in callbacks_cfg.items():
        if isinstance(node, DictConfig) and "_target_" in node:
            log.info(f"Instantiating callback <{node._target_}>")
            callbacks.append(instantiate(node))
        elif node is not None:
            raise TypeError(f"callbacks.{name} must be a node with a _target_ (or null to disable it)")
    return callbacks


def _on_command_line() -> bool:
    """Whether this runs as a job of Hydra's command line (``@hydra.main``), which prints what the job raises;
    ``hflight.config.compose`` (notebooks, tests) leaves Hydra uninitialised."""
    from hydra.core.global_hydra import GlobalHydra

    return GlobalHydra.instance().is_initialized()
