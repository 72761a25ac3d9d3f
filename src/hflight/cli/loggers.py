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
from transformers import TrainerCallback
from typing_extensions import override

from hflight.arguments.training_args import TrainingArguments

__all__ = ["LOGGER_OPTIONS", "ConfigHyperparameters", "ConfigToIntegrations", "logger_environment", "logger_variables"]

#: ``logger.<name>.<option>`` -> the environment variable transformers' integration callback for ``<name>`` reads
#: (``report_to`` builds those callbacks: ``hflight.arguments.reporting``).
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

    from hflight.arguments.reporting import report_to_names

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


def _composed_config(cfg: DictConfig) -> Any:
    """The composed config as plain containers, resolved where it can be (an interpolation only Hydra's job can
    resolve is kept as written)."""
    from omegaconf import OmegaConf

    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # noqa: BLE001 - e.g. ${hydra:...} outside a Hydra job
        return OmegaConf.to_container(cfg, resolve=False)


class ConfigHyperparameters(L.Callback):
    """Gives the composed config to every logger of a run as hyperparameters (``config/...``; the training
    arguments go under ``training_args/...`` when the loggers are built)."""

    def __init__(self, cfg: DictConfig) -> None:
        self.hyperparameters = {"config": _composed_config(cfg)}

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for logger in trainer.loggers:
            logger.log_hyperparams(self.hyperparameters)


class ConfigToIntegrations(TrainerCallback):
    """Gives the composed config to transformers' integration callbacks of a run (which log the TrainingArguments and
    the model's config themselves), once their run has started: TensorBoard gets it as the text ``config`` (YAML),
    MLflow as parameters ``config.<dotted key>``, W&B as ``wandb.config["config"]``. ``callbacks``: the trainer's
    callback list (``trainer.callback_handler.callbacks``), read when training begins."""

    def __init__(self, cfg: DictConfig, callbacks: list[Any]) -> None:
        self.config = _composed_config(cfg)
        self.callbacks = callbacks
        self.given: set[str] = set()  # once per run: evaluate() after train() logs to the same runs

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        from transformers.integrations import MLflowCallback, TensorBoardCallback, WandbCallback

        for callback in self.callbacks:
            if isinstance(callback, TensorBoardCallback) and callback.tb_writer is not None:
                import yaml

                callback.tb_writer.add_text("config", yaml.safe_dump(self.config, sort_keys=False))
            elif isinstance(callback, MLflowCallback) and "mlflow" not in self.given:
                self._to_mlflow()
            elif isinstance(callback, WandbCallback) and "wandb" not in self.given:
                wandb = sys.modules.get("wandb")
                if wandb is not None and wandb.run is not None:
                    wandb.config.update({"config": self.config}, allow_val_change=True)
                    self.given.add("wandb")

    def _to_mlflow(self) -> None:
        import mlflow
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        if mlflow.active_run() is None:
            return
        flat = {f"config.{key}": str(value)[:MAX_PARAM_VAL_LENGTH] for key, value in _flatten(self.config).items()}
        items = list(flat.items())
        for start in range(0, len(items), MAX_PARAMS_TAGS_PER_BATCH):
            mlflow.log_params(dict(items[start : start + MAX_PARAMS_TAGS_PER_BATCH]))
        self.given.add("mlflow")


def _flatten(values: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(values, Mapping) and values:
        flat: dict[str, Any] = {}
        for key, value in values.items():
            flat.update(_flatten(value, f"{prefix}{key}."))
        return flat
    return {prefix[:-1]: values}


def _close_loggers() -> None:
    """Finish an active wandb run and end an active MLflow run (transformers' MLflowCallback leaves open the run an
    evaluate() after train() starts), so that the next job of a sweep starts its own."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish()
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None and hasattr(mlflow, "active_run") and mlflow.active_run() is not None:
        mlflow.end_run()
