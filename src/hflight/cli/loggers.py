"""Experiment loggers of a command-line run: the ``logger`` group's options as the environment variables
transformers' integrations read, the composed config as every logger's hyperparameters, and a wandb run finished
between the jobs of a sweep."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import lightning as L
from omegaconf import DictConfig
from typing_extensions import override

from hflight.arguments.training_args import TrainingArguments

__all__ = ["LOGGER_OPTIONS", "ConfigHyperparameters", "logger_environment", "logger_variables"]

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


def _close_loggers() -> None:
    """Finish an active wandb run, so that the next job of a sweep starts its own."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish()
