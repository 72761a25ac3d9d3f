"""The Hydra entry point: compose -> instantiate -> the same facade a notebook uses.

``python train.py +experiment=mrc`` and the console script ``hflight-train +experiment=mrc`` both end in
:func:`main`, which runs :func:`train` and returns ``cfg.optimized_metric`` for sweepers. :func:`train` builds the
training arguments and the callbacks, and hands everything task-specific to the ``task`` node (for extractive QA,
``hflight.qa.recipe.MRCRecipe``); then it trains, evaluates and predicts, writes the ``*_results.json`` and the
model into the run folder, and prints a table of the final metrics. The modules, by what they do:

- :mod:`~hflight.cli.app`: :func:`train`, :func:`run`, :func:`main` (the Hydra app), the task's :class:`TaskRun`.
- :mod:`~hflight.cli.resume`: ``resume=<run or sweep folder>`` and ``resume=auto``.
- :mod:`~hflight.cli.failures`: ``error.txt``, user errors told as one message.
- :mod:`~hflight.cli.loggers`: the ``logger`` group's options, the config as hyperparameters.
- :mod:`~hflight.cli.report`: the final metrics' table, ``optimized_metric``, ``training_curves.png``.
- :mod:`~hflight.cli.jobs`: a run as a job of a sweep (threads, its Optuna trial, submitit's requeue signal).
- :mod:`~hflight.cli.curves`: ``training_curves.png`` (a multirun's summary is ``hflight.sweeps.summary``).

May import: ``hflight.config``, ``hflight.arguments``, ``hflight.run.interrupt``, ``hflight.run.console`` (what the
console says on the command line), ``hflight.checkpoints.manifest``, ``hflight.surface``, ``hflight._util``,
``hflight.sweeps`` (a job of an Optuna search: ``trial``, ``launchers``); the task (``hflight.qa.recipe``) is
instantiated from the config, never imported.

Example:
    >>> from hflight import cli, config  # doctest: +SKIP
    >>> metrics, objects = cli.train(config.compose(["+experiment=mrc", "args.num_train_epochs=1"]))  # doctest: +SKIP
"""

import os

# Before torch is imported (libgomp reads it once, as it loads): torch's OpenMP threads wait for work asleep, not
# spinning. On cores shared with other work, spinning threads stall each other (the main job took 9x as long on two
# busy cores); on idle cores the waits cost a few percent. The thread count, and so the numbers, stay torch's.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from hflight.cli.app import TaskRun, instantiate_callbacks, main, run, train  # noqa: E402
from hflight.cli.failures import ERROR_FILE, USER_ERRORS, RunFailed  # noqa: E402
from hflight.cli.jobs import PRUNED_FILE  # noqa: E402
from hflight.cli.loggers import LOGGER_OPTIONS, ConfigHyperparameters, logger_environment, logger_variables
from hflight.cli.report import format_metrics_table, optimized_value
from hflight.cli.resume import (
    AUTO,
    OPTUNA_SWEEPER,
    RESUME_KEY,
    SWEEP_CONFIG,
    resume_arguments,
    resume_command,
    resume_point,
    sweep_resume_arguments,
)

__all__ = [
    "AUTO",
    "ERROR_FILE",
    "LOGGER_OPTIONS",
    "OPTUNA_SWEEPER",
    "PRUNED_FILE",
    "RESUME_KEY",
    "SWEEP_CONFIG",
    "USER_ERRORS",
    "ConfigHyperparameters",
    "RunFailed",
    "TaskRun",
    "format_metrics_table",
    "instantiate_callbacks",
    "logger_environment",
    "logger_variables",
    "main",
    "optimized_value",
    "resume_arguments",
    "resume_command",
    "resume_point",
    "run",
    "sweep_resume_arguments",
    "train",
]
