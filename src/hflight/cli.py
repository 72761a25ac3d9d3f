"""The Hydra entry point: compose -> instantiate -> the same facade a notebook uses.

``python train.py +experiment=mrc`` and the console script ``hflight-train +experiment=mrc`` both end in
:func:`main`, which runs :func:`train` and returns ``cfg.optimized_metric`` for sweepers. :func:`train` builds the
training arguments and the callbacks, and hands everything task-specific to the ``task`` node: a ``_target_`` whose
instance has ``setup(cfg, args, callbacks)`` returning a :class:`TaskRun` (for extractive QA,
``hflight.qa.recipe.MRCRecipe``: data, tokenizer, model, windows and the ``MRCTrainer``, data checked before
anything trains). Then it trains, evaluates and predicts as ``args.do_train``/``do_eval``/``do_predict`` ask,
writing ``train_results.json``, ``eval_results.json``, ``all_results.json``, ``trainer_state.json`` and the model
into ``args.output_dir`` (the Hydra run directory), and prints a table of the final metrics.

Example:
    >>> from hflight import cli, config  # doctest: +SKIP
    >>> metrics, objects = cli.train(config.compose(["+experiment=mrc", "args.num_train_epochs=1"]))  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException, HydraException
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.fabric.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from hflight.arguments.hardware import check_hardware, describe_backend
from hflight.arguments.training_args import TrainingArguments
from hflight.config import PRIMARY_CONFIG, VERSION_BASE, find_config_dir
from hflight.run.interrupt import TrainingInterrupted, signal_name, terminate_on_signals

__all__ = ["TaskRun", "main", "run", "train"]

log = logging.getLogger(__name__)

#: File a failed job leaves in its run directory (the traceback).
ERROR_FILE = "error.txt"


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

    Raises:
        TypeError, ValueError: invalid training arguments (before anything else is built), missing or empty data
            (before anything is trained).
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    log.info(f"Instantiating training arguments <{TrainingArguments.__module__}.TrainingArguments>")
    args = TrainingArguments.from_config(cfg.args)

    from transformers import set_seed
    from transformers.trainer_pt_utils import metrics_format

    _set_cpu_threads(cfg.get("cpu_threads"))
    # A backend that cannot start here (no poptorch for trainer=ipu, no GPU for trainer=gpu) fails now, with its own
    # message, not after the data has been generated and tokenized.
    check_hardware(args)
    set_seed(args.seed)  # before the model is initialised, as run_qa.py
    log.info(f"Instantiating task <{cfg.task._target_}>")
    task = instantiate(cfg.task)
    callbacks = instantiate_callbacks(cfg.get("callbacks"))
    built: TaskRun = task.setup(cfg, args, callbacks)
    trainer = built.trainer

    metrics: dict[str, float] = {}
    if args.do_train:
        log.info("Starting training")
        result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
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

    if metrics and trainer.is_world_process_zero():
        ran = "Evaluated" if args.do_eval or args.do_predict else "Trained"
        title = f"Final metrics ({args.output_dir})\n{ran} with {describe_backend(trainer.lightning_trainer)}"
        print(format_metrics_table(metrics_format(metrics), title))
    objects = dict(args=args, callbacks=callbacks, task=task, trainer=trainer, **built.objects)
    return metrics, objects


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

    SIGTERM and SIGINT stop training at the next step boundary with a checkpoint (``hflight.interrupt``) and, at any
    other time, at once; either way ``error.txt`` says so and the process exits with 128 + the signal number, in a
    multirun too.
    """
    try:
        with terminate_on_signals():
            metrics, _ = train(cfg)
            return optimized_value(metrics, cfg.get("optimized_metric"))
    except TrainingInterrupted as exc:
        where = _record_failure(cfg, f"{exc}\n")
        log.error(f"Run stopped by {signal_name(exc.signum)}; recorded in {where}")
        raise
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


def _config_path() -> str | None:
    try:
        return str(find_config_dir())
    except FileNotFoundError:
        return None  # a non-editable install: pass --config-dir (see hflight.config)


@hydra.main(version_base=VERSION_BASE, config_path=_config_path(), config_name=PRIMARY_CONFIG)
def main(cfg: DictConfig) -> float | None:
    """``hflight-train [overrides]`` on the command line; ``main(cfg)`` runs a composed config (see :func:`run`)."""
    return run(cfg)


# ---------------------------------------------------------------------------------------------------- building
def _set_cpu_threads(threads: Any) -> None:
    if threads is None:
        return
    import torch

    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"cpu_threads must be a positive integer or null, got {threads!r}")
    torch.set_num_threads(threads)


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


# ---------------------------------------------------------------------------------------------------- reporting
def optimized_value(metrics: Mapping[str, float], name: str | None) -> float | None:
    """``metrics[name]`` as a float (None for no name); an unknown name raises, listing the available ones."""
    if not name:
        return None
    if name not in metrics:
        raise KeyError(f"optimized_metric={name!r} is not among the final metrics: {', '.join(sorted(metrics))}")
    return float(metrics[name])


def format_metrics_table(metrics: Mapping[str, Any], title: str) -> str:
    """A boxed two-column table of ``metrics`` under ``title`` (which may span several lines)."""
    rows = [(str(k), str(v)) for k, v in metrics.items()]
    kw = max(len("metric"), *(len(k) for k, _ in rows))
    vw = max(len("value"), *(len(v) for _, v in rows))
    rule = f"+-{'-' * kw}-+-{'-' * vw}-+"
    lines = [title, rule, f"| {'metric':<{kw}} | {'value':>{vw}} |", rule]
    lines += [f"| {k:<{kw}} | {v:>{vw}} |" for k, v in rows]
    lines.append(rule)
    return "\n".join(lines)


def _in_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _run_dir(cfg: DictConfig) -> Path:
    for get in (lambda: cfg.paths.output_dir, lambda: HydraConfig.get().runtime.output_dir):
        try:
            value = get()
        except Exception:  # noqa: BLE001 - an unresolvable config must not hide the original error
            continue
        if value:
            return Path(value)
    return Path.cwd()


#: Failures caused by the configuration, the data or a checkpoint (reported by their message, not a traceback).
USER_ERRORS = (
    ValueError,
    TypeError,
    KeyError,
    OSError,
    ImportError,
    OmegaConfBaseException,
    HydraException,
    MisconfigurationException,  # Lightning's: e.g. trainer=gpu where no GPU is available
)


class RunFailed(CompactHydraException):
    """A user error of a command-line run, re-raised for Hydra to print as one message (no traceback)."""


def _record_failure(cfg: DictConfig, text: str) -> Path:
    path = _run_dir(cfg) / ERROR_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        log.error(f"Could not write {path}: {exc}")
    return path


def _describe(exc: BaseException) -> str:
    """``Type: message`` (a KeyError's message without the quotes ``str`` adds)."""
    message = exc.args[0] if isinstance(exc, KeyError) and len(exc.args) == 1 else exc
    return f"{type(exc).__name__}: {message}"


def _on_command_line() -> bool:
    """Whether this runs as a job of Hydra's command line (``@hydra.main``), which prints what the job raises;
    ``hflight.config.compose`` (notebooks, tests) leaves Hydra uninitialised."""
    from hydra.core.global_hydra import GlobalHydra

    return GlobalHydra.instance().is_initialized()


def _close_loggers() -> None:
    """Finish an active wandb run, so that the next job of a sweep starts its own."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish()
