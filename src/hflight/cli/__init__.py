"""The Hydra entry point: compose -> instantiate -> the same facade a notebook uses.

``python train.py +experiment=mrc`` and the console script ``hflight-train +experiment=mrc`` both end in
:func:`main`, which runs :func:`train` and returns ``cfg.optimized_metric`` for sweepers. :func:`train` builds the
training arguments and the callbacks, and hands everything task-specific to the ``task`` node: a ``_target_`` whose
instance has ``setup(cfg, args, callbacks)`` returning a :class:`TaskRun` (for extractive QA,
``hflight.qa.recipe.MRCRecipe``: data, tokenizer, model, windows and the ``MRCTrainer``, data checked before
anything trains). Then it trains, evaluates and predicts as ``args.do_train``/``do_eval``/``do_predict`` ask,
writing ``train_results.json``, ``eval_results.json``, ``all_results.json``, ``trainer_state.json`` and the model
into ``args.output_dir`` (the Hydra run directory), and prints a table of the final metrics. Beside it: ``curves``
(``training_curves.png`` from ``log_history``) and ``sweep_summary`` (a multirun's ``summary.csv``/``summary.md``).

May import: ``hflight.config``, ``hflight.arguments``, ``hflight.run.interrupt``, ``hflight.surface``,
``hflight._util``, ``hflight.sweeps`` (a job of an Optuna search); the task (``hflight.qa.recipe``) is
instantiated from the config, never imported.

Example:
    >>> from hflight import cli, config  # doctest: +SKIP
    >>> metrics, objects = cli.train(config.compose(["+experiment=mrc", "args.num_train_epochs=1"]))  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import traceback
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

import hydra
import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException, HydraException
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.fabric.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException
from typing_extensions import override

from hflight.arguments import cluster
from hflight.arguments.hardware import check_hardware, describe_backend
from hflight.arguments.training_args import TrainingArguments
from hflight.checkpoints.manifest import get_last_checkpoint
from hflight.config import PRIMARY_CONFIG, VERSION_BASE, hydra_config_path
from hflight.run.interrupt import TrainingInterrupted, requeue_signal, signal_name, terminate_on_signals
from hflight.sweeps.trial import JobPruned, ReportToTrial, job_in_worker_process, job_trial

__all__ = ["TaskRun", "main", "run", "train"]

log = logging.getLogger(__name__)

#: File a failed job leaves in its run directory (the traceback).
ERROR_FILE = "error.txt"
#: File a job of an Optuna search leaves when its trial was pruned (trial number, step, last value).
PRUNED_FILE = "pruned.json"


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

    Raises:
        TypeError, ValueError: invalid training arguments (before anything else is built), missing or empty data
            (before anything is trained).
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    log.info(f"Instantiating training arguments <{TrainingArguments.__module__}.TrainingArguments>")
    args = TrainingArguments.from_config(cfg.args)
    with logger_environment(cfg.get("logger"), args):
        return _train(cfg, args)


def _train(cfg: DictConfig, args: TrainingArguments) -> tuple[dict[str, float], dict[str, Any]]:
    from transformers import set_seed

    _set_cpu_threads(cfg.get("cpu_threads"), _job_hydra_config())
    # A backend that cannot start here (no poptorch for trainer=ipu, no GPU for trainer=gpu) fails now, with its own
    # message, not after the data has been generated and tokenized.
    check_hardware(args)
    args.resume_from_checkpoint = resume_point(args)  # before the task reads the run folder (it reuses its data)
    set_seed(args.seed)  # before the model is initialised, as run_qa.py
    log.info(f"Instantiating task <{cfg.task._target_}>")
    task = instantiate(cfg.task)
    callbacks = instantiate_callbacks(cfg.get("callbacks"))
    reporter = _trial_reporter(cfg)  # a job of an Optuna search: optimized_metric to its trial at each evaluation
    extra = [ConfigHyperparameters(cfg), *([reporter] if reporter else [])]
    built: TaskRun = task.setup(cfg, args, [*callbacks, *extra])
    trainer = built.trainer
    metrics = _train_evaluate_predict(trainer, built, args, reporter)
    if trainer.is_world_process_zero():
        _draw_curves(trainer, args)
    if metrics and trainer.is_world_process_zero():
        from transformers.trainer_pt_utils import metrics_format

        ran = "Evaluated" if args.do_eval or args.do_predict else "Trained"
        title = f"Final metrics ({args.output_dir})\n{ran} with {describe_backend(trainer.lightning_trainer)}"
        print(format_metrics_table(metrics_format(metrics), title))
    objects = dict(args=args, callbacks=callbacks, task=task, trainer=trainer, **built.objects)
    return metrics, objects


def _train_evaluate_predict(
    trainer: Any, built: TaskRun, args: TrainingArguments, reporter: Any = None
) -> dict[str, float]:
    metrics: dict[str, float] = {}
    if args.do_train:
        log.info("Starting training")
        result = trainer.train(resume_from_checkpoint=_resume_from(args.resume_from_checkpoint))
        if reporter is not None and reporter.pruned is not None:  # stopped by the pruner, with its checkpoint
            trainer.save_state()
            raise JobPruned(reporter.trial.number, *reporter.pruned)
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


def _resume_from(value: Any) -> str | bool | None:
    """``args.resume_from_checkpoint`` as ``train()`` takes it: a path, ``true`` (the config's string field holds
    it as "True") for the last valid checkpoint of the output folder, or ``"auto"``: that checkpoint if there is
    one."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return True if value.lower() == "true" else None
    if isinstance(value, str) and value.lower() == AUTO:
        return AUTO
    return value


def resume_point(args: TrainingArguments) -> str | None:
    """``args.resume_from_checkpoint`` as this run will use it. ``resume=auto`` (``args.resume_from_checkpoint=auto``),
    and, when nothing else was asked, a process a scheduler may have restarted (torchrun with ``--max-restarts`` >= 1,
    a requeued SLURM job: ``hflight.arguments.cluster.restart``) continue from the run folder's last valid checkpoint
    (``"auto"``: ``train()`` picks it, checksums included, and skips damaged ones) or, when the folder holds none,
    start fresh, saying so (None)."""
    value = _resume_from(args.resume_from_checkpoint)
    restarted = cluster.restart()
    if value is None and restarted is not None:
        log.warning(
            f"Started by a scheduler that restarts its jobs ({restarted[0]}={restarted[1]}): continuing as "
            f"resume=auto, from the last valid checkpoint of {args.output_dir} if it has one."
        )
        value = AUTO
    if value != AUTO:
        return args.resume_from_checkpoint if value is not None else None
    if get_last_checkpoint(args.output_dir) is None:
        log.warning(f"resume=auto: {args.output_dir} holds no complete checkpoint; starting fresh.")
        return None
    return AUTO


def _draw_curves(trainer: Any, args: TrainingArguments) -> None:
    """``training_curves.png`` in the run folder. The results are on disk by now, so a figure that cannot be drawn
    (a full disk, say) is reported as an error in the log, not as a failed run."""
    from hflight.cli.curves import FILE_NAME, plot_training_curves

    try:
        path = plot_training_curves(trainer.state.log_history, Path(args.output_dir) / FILE_NAME, args.run_name)
    except (OSError, ValueError) as exc:
        log.error(f"Could not draw {FILE_NAME} in {args.output_dir}: {_describe(exc)}")
        return
    if path is None:
        log.info(f"No {FILE_NAME}: nothing was logged (log_history is empty)")
    else:
        log.info(f"Training curves: {path}")


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
    other time, at once; either way ``error.txt`` says so and the process exits with 128 + the signal number, in a
    multirun too.
    """
    _requeue_signal_under_launcher(cfg)
    try:
        # under SLURM the requeue signal requeues the job; after a stop the command line exits
        with terminate_on_signals(requeue_signal(cfg.args), process_exits=_on_command_line()):
            metrics, _ = train(cfg)
            return optimized_value(metrics, cfg.get("optimized_metric"))
    except TrainingInterrupted as exc:
        hint = f"To continue this run: {resume_command(_run_dir(cfg))}\n" if exc.checkpoint else ""
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


def main(cfg: DictConfig | None = None) -> float | None:
    """``hflight-train [overrides]`` (also ``python -m hflight``, ``python train.py``) on the command line, with
    ``resume=<run folder>`` expanded first (:func:`resume_arguments`); ``main(cfg)`` runs a composed config (see
    :func:`run`)."""
    if cfg is not None:
        return run(cfg)
    try:
        sys.argv[1:] = resume_arguments(sys.argv[1:])
    except ValueError as exc:
        raise SystemExit(f"hflight-train: {exc}") from None
    return _hydra_main()


@hydra.main(version_base=VERSION_BASE, config_path=hydra_config_path(), config_name=PRIMARY_CONFIG)
def _hydra_main(cfg: DictConfig) -> float | None:
    return run(cfg)


# ---------------------------------------------------------------------------------------------------- resume
#: The command-line key that continues a run in its own folder.
RESUME_KEY = "resume"
#: ``resume=auto``: continue this run's folder (``hydra.run.dir``) from its last valid checkpoint, or start fresh.
AUTO = "auto"


def _override_key(token: str) -> str | None:
    """The key an override sets (``+experiment=mrc`` -> ``experiment``); None for a flag or its value."""
    if token.startswith("-") or "=" not in token:
        return None
    return token.split("=", 1)[0].lstrip("+~")


def resume_arguments(argv: list[str]) -> list[str]:
    """``argv`` with ``resume=<run folder>`` replaced by that run's own command: its saved overrides
    (``.hydra/overrides.yaml``; an override in ``argv`` replaces the saved one of the same key), its
    ``--config-dir`` (from ``.hydra/hydra.yaml``, unless ``argv`` has one), ``hydra.run.dir=<the folder>`` (the
    same folder again) and ``args.resume_from_checkpoint=true`` (its last valid checkpoint). A job of a sweep
    resumes as one run: its ``+hparams_search=`` preset is dropped (its trial's values are among its overrides) and
    ``hydra.mode=RUN`` added. ``resume=auto`` is ``args.resume_from_checkpoint=auto``: this run's own folder
    (``hydra.run.dir``), continued from its last valid checkpoint or started fresh (:func:`resume_point`). Without
    ``resume=``, ``argv`` unchanged.

    Raises:
        ValueError: ``resume=`` twice, with ``-m``, with ``hydra.run.dir``, or naming no run folder;
            ``resume=auto`` with ``args.resume_from_checkpoint``.
    """
    given = [token for token in argv if _override_key(token) == RESUME_KEY]
    if not given:
        return argv
    if len(given) > 1 or given[0].startswith(("+", "~")):
        raise ValueError(
            f"give one run folder as {RESUME_KEY}=<run folder> (or {RESUME_KEY}={AUTO}), got {' '.join(given)}"
        )
    rest = [token for token in argv if token is not given[0]]
    if given[0].split("=", 1)[1] == AUTO:  # this run's own folder: its last valid checkpoint, or a fresh start
        if any(_override_key(token) == "args.resume_from_checkpoint" for token in rest):
            raise ValueError(f"{RESUME_KEY}={AUTO} sets args.resume_from_checkpoint; give one of the two")
        return [*rest, f"args.resume_from_checkpoint={AUTO}"]
    folder = Path(given[0].split("=", 1)[1]).expanduser().resolve()
    if (folder / SWEEP_CONFIG).is_file():
        return sweep_resume_arguments(folder, rest)
    if {"-m", "--multirun"} & set(rest):
        raise ValueError(f"{RESUME_KEY}= continues one run; it cannot be combined with -m/--multirun")
    keys = {_override_key(token) for token in rest} - {None}
    if "hydra.run.dir" in keys:
        raise ValueError(f"{RESUME_KEY}= writes into the run folder itself; drop hydra.run.dir")
    saved = _saved_overrides(folder)
    dropped = keys | {"args.resume_from_checkpoint", "hparams_search"}
    kept = [token for token in saved if _override_key(token) not in dropped]
    has_config_dir = any(token.startswith(("--config-dir", "-cd")) for token in rest)
    config_dir = [] if has_config_dir else _saved_config_dirs(folder)
    ending = [f"hydra.run.dir={folder}", "hydra.mode=RUN", "args.resume_from_checkpoint=true"]
    return [*config_dir, *kept, *rest, *ending]


#: What a sweeper writes at the root of a sweep folder: the sweep's composed config, Hydra's part included.
SWEEP_CONFIG = "multirun.yaml"
#: The sweeper whose searches can be continued (their study is in a database).
OPTUNA_SWEEPER = "hydra_plugins.hflight_optuna_sweeper.optuna_sweeper.OptunaSweeper"


def sweep_resume_arguments(folder: Path, rest: list[str]) -> list[str]:
    """``resume=<sweep folder>``: the sweep's own command (its overrides from ``multirun.yaml``, an override in
    ``rest`` replacing the saved one of the same key), ``-m`` and ``hydra.sweep.dir=<the folder>``. The Optuna
    sweeper then reopens the study and runs trials until it holds ``n_trials`` finished ones; job folders number on.

    Raises:
        ValueError: the folder's sweep is not an Optuna search (Hydra's basic sweeper keeps no study to continue)
            or its study was never created.
    """
    import yaml

    saved = yaml.safe_load((folder / SWEEP_CONFIG).read_text(encoding="utf-8")) or {}
    hydra_node = saved.get("hydra") or {}
    target = (hydra_node.get("sweeper") or {}).get("_target_")
    if target != OPTUNA_SWEEPER:
        raise ValueError(
            f"{RESUME_KEY}={folder}: a sweep of {target or 'an unknown sweeper'} keeps no study to continue; only an "
            "Optuna search (+hparams_search=..., hydra/sweeper=optuna) can be continued. Run its unfinished jobs with "
            f"{RESUME_KEY}=<job folder>"
        )
    storage = (hydra_node.get("sweeper") or {}).get("storage")
    if storage is None and not (folder / "optuna.db").is_file():
        raise ValueError(f"{RESUME_KEY}={folder}: the search's study (optuna.db) is not there: it never started")
    overrides = hydra_node.get("overrides") or {}
    keys = {_override_key(token) for token in rest} - {None}
    dropped = keys | {"hydra.sweep.dir", "hydra.mode", RESUME_KEY}
    kept = [t for t in [*overrides.get("task", []), *overrides.get("hydra", [])] if _override_key(t) not in dropped]
    has_config_dir = any(token.startswith(("--config-dir", "-cd")) for token in rest)
    config_dir = [] if has_config_dir else _config_dirs(hydra_node)
    rest = [token for token in rest if token not in ("-m", "--multirun")]
    return ["-m", *config_dir, *kept, *rest, f"hydra.sweep.dir={folder}"]


def _saved_overrides(folder: Path) -> list[str]:
    import yaml

    saved = folder / ".hydra" / "overrides.yaml"
    if not saved.is_file():
        raise ValueError(
            f"{RESUME_KEY}={folder}: neither a run folder (no .hydra/overrides.yaml there) nor a sweep folder (no "
            f"{SWEEP_CONFIG}); pass the folder a run or a search wrote, e.g. outputs/mrc/runs/<date>_<time> or "
            "outputs/mrc/multiruns/<date>_<time>"
        )
    overrides = yaml.safe_load(saved.read_text(encoding="utf-8")) or []
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise ValueError(f"{saved} is not a list of overrides")
    return overrides


def _saved_config_dirs(folder: Path) -> list[str]:
    """``--config-dir DIR`` when the run was started with one (Hydra records it in ``.hydra/hydra.yaml``)."""
    import yaml

    hydra_file = folder / ".hydra" / "hydra.yaml"
    if not hydra_file.is_file():
        return []
    return _config_dirs((yaml.safe_load(hydra_file.read_text(encoding="utf-8")) or {}).get("hydra", {}))


def _config_dirs(hydra_node: dict[str, Any]) -> list[str]:
    runtime = hydra_node.get("runtime") or {}
    for source in runtime.get("config_sources") or []:
        if source.get("provider") == "command-line" and source.get("schema") == "file":
            return ["--config-dir", source["path"]]
    return []


def resume_command(run_dir: str | os.PathLike) -> str:
    """The command that continues the run in ``run_dir`` (printed when a run is interrupted)."""
    return f"hflight-train {RESUME_KEY}={run_dir}"


# ---------------------------------------------------------------------------------------------------- building
def _set_cpu_threads(threads: Any, hydra_config: Any = None) -> None:
    """``torch.set_num_threads(cpu_threads)``; unset, a job that shares the machine with the sweep's other jobs
    (joblib, submitit's local executor) gets the cores divided between them."""
    if threads is None and hydra_config is not None:
        from hflight.sweeps.launchers import threads_per_job

        threads = threads_per_job(hydra_config)
        if threads is not None:
            log.info(f"cpu_threads={threads}: this machine's cores shared by the sweep's jobs running together")
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


# ---------------------------------------------------------------------------------------------------- loggers
#: ``logger.<name>.<option>`` -> the environment variable transformers' integration for ``<name>`` reads (and
#: ``hflight.arguments.lightning_kwargs`` passes to the Lightning logger's constructor).
LOGGER_OPTIONS: dict[str, dict[str, str]] = {
    "tensorboard": {"log_dir": "TENSORBOARD_LOGGING_DIR"},
    "wandb": {"project": "WANDB_PROJECT", "entity": "WANDB_ENTITY", "tags": "WANDB_TAGS", "name": "WANDB_NAME"},
    "mlflow": {
        "experiment_name": "MLFLOW_EXPERIMENT_NAME",
        "tracking_uri": "MLFLOW_TRACKING_URI",
        "tags": "MLFLOW_TAGS",
    },
}


def logger_variables(options: Mapping[str, Any] | None, report_to: list[str]) -> dict[str, str]:
    """The environment variables the ``logger`` node's options stand for (null options set nothing).

    Raises:
        ValueError: an unknown logger or option, or options for a logger ``report_to`` does not use.
    """
    import json

    variables: dict[str, str] = {}
    for name, values in (options or {}).items():
        if name not in LOGGER_OPTIONS:
            raise ValueError(f"logger.{name}: unknown logger; options exist for {', '.join(LOGGER_OPTIONS)}")
        if name not in report_to:
            raise ValueError(f"logger.{name} is set but args.report_to={report_to} does not log to {name}")
        for option, value in (values or {}).items():
            if option not in LOGGER_OPTIONS[name]:
                raise ValueError(
                    f"logger.{name}.{option}: unknown option; {name} has {', '.join(LOGGER_OPTIONS[name])}"
                )
            if value is None or value == [] or value == {}:
                continue
            if isinstance(value, (list, tuple)):
                value = ",".join(str(v) for v in value)
            elif isinstance(value, Mapping):
                value = json.dumps(dict(value))
            variables[LOGGER_OPTIONS[name][option]] = str(value)
    return variables


@contextlib.contextmanager
def logger_environment(options: Any, args: TrainingArguments) -> Iterator[None]:
    """Set :func:`logger_variables` of ``options`` (the config's ``logger`` node) while the block runs."""
    from omegaconf import OmegaConf

    from hflight.arguments.lightning_kwargs import report_to_names

    plain = OmegaConf.to_container(options, resolve=True) if isinstance(options, DictConfig) else options
    variables = logger_variables(plain, report_to_names(args.report_to))
    previous = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class ConfigHyperparameters(L.Callback):
    """Gives the composed config to every logger of a run as hyperparameters (``config/...``; the training
    arguments go under ``training_args/...`` when the loggers are built)."""

    def __init__(self, cfg: DictConfig) -> None:
        from omegaconf import OmegaConf

        try:
            config = OmegaConf.to_container(cfg, resolve=True)
        except Exception:  # noqa: BLE001 - an interpolation only Hydra's job can resolve: log it as written
            config = OmegaConf.to_container(cfg, resolve=False)
        self.hyperparameters = {"config": config}

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for logger in trainer.loggers:
            logger.log_hyperparams(self.hyperparameters)


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


def _requeue_signal_under_launcher(cfg: DictConfig) -> None:
    """A job that submitit runs on SLURM requeues on submitit's signal (SIGUSR2), unless configured otherwise."""
    from omegaconf import open_dict

    from hflight.sweeps.launchers import requeue_signal_under_launcher

    args = cfg.get("args")
    if args is None or "requeue_signal" not in args:
        return
    wanted = requeue_signal_under_launcher(args.requeue_signal)
    if wanted != args.requeue_signal:
        log.info(f"Run by submitit on SLURM: args.requeue_signal={wanted} (the signal submitit asks SLURM for)")
        with open_dict(args):
            args.requeue_signal = wanted


def _job_hydra_config() -> Any:
    """The Hydra config of this job of a multirun (None otherwise)."""
    return HydraConfig.get() if _in_multirun() else None


def _trial_reporter(cfg: DictConfig) -> Any:
    """:class:`hflight.sweeps.trial.ReportToTrial` for a job of hflight's Optuna sweeper, else None."""
    hydra_config = _job_hydra_config()
    if hydra_config is None:
        return None
    trial = job_trial(hydra_config)
    return None if trial is None else ReportToTrial(trial, cfg.get("optimized_metric"))


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
