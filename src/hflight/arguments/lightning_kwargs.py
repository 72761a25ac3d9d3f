"""The one mapping from ``TrainingArguments`` to ``lightning.Trainer`` keyword arguments.

Training semantics (epochs, learning rate, accumulation, clipping, cadence) stay with the facade and its
LightningModule; Lightning receives hardware, strategy, precision, loggers and callbacks. Everything Lightning
would otherwise do on its own and that HF does differently is switched off here, in one visible place:
checkpointing (HF's ``checkpoint-N`` folders are written by the facade; under SLURM, Lightning's auto-requeue and
its ``hpc_ckpt_*.ckpt`` too: ``hflight.arguments.cluster``), the progress bar (HF's
``ProgressCallback`` draws it), sanity validation and distributed sampler injection (the facade's samplers
shard the data the way accelerate does).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import lightning as L
from transformers.trainer_callback import TrainerCallback

from hflight.arguments import cluster
from hflight.arguments.registry import DEFAULT_STRATEGIES, STRATEGY_ACCELERATORS
from hflight.arguments.strategies import strategy_from_args

# (fp16, bf16) -> Lightning precision
PRECISION: dict[tuple[bool, bool], str] = {
    (False, False): "32-true",
    (True, False): "16-mixed",
    (False, True): "bf16-mixed",
}


def _save_dir(args: Any) -> str:
    return getattr(args, "logging_dir", None) or args.output_dir


def _run_name(args: Any) -> str:
    return args.run_name or "hflight"


def _csv(args: Any) -> dict[str, Any]:
    return {"save_dir": _save_dir(args), "name": _run_name(args)}


def _tensorboard(args: Any) -> dict[str, Any]:
    # transformers' TensorBoardCallback reads TENSORBOARD_LOGGING_DIR
    folder = os.environ.get("TENSORBOARD_LOGGING_DIR")
    return {"save_dir": os.path.expanduser(folder) if folder else _save_dir(args), "name": _run_name(args)}


def _mlflow(args: Any) -> dict[str, Any]:
    # transformers' MLflowCallback reads MLFLOW_EXPERIMENT_NAME, MLFLOW_TRACKING_URI and MLFLOW_TAGS (a JSON object)
    env = os.environ
    tags = json.loads(env["MLFLOW_TAGS"]) if env.get("MLFLOW_TAGS") else None
    if tags is not None and not isinstance(tags, dict):
        raise ValueError(f"MLFLOW_TAGS must be a JSON object of tag -> value, got {env['MLFLOW_TAGS']!r}")
    return {
        "experiment_name": env.get("MLFLOW_EXPERIMENT_NAME") or _run_name(args),
        "run_name": args.run_name,
        "tracking_uri": env.get("MLFLOW_TRACKING_URI") or None,  # None: a local ./mlruns in save_dir
        "tags": tags,
        "save_dir": os.path.join(_save_dir(args), "mlruns"),
    }


def _wandb(args: Any) -> dict[str, Any]:
    # transformers' WandbCallback: WANDB_PROJECT (default "huggingface"), the run named args.run_name; wandb itself
    # reads WANDB_ENTITY, WANDB_NAME and WANDB_TAGS (comma-separated), passed on here explicitly
    env = os.environ
    tags = [tag.strip() for tag in env.get("WANDB_TAGS", "").split(",") if tag.strip()]
    return {
        "project": env.get("WANDB_PROJECT") or "huggingface",
        "entity": env.get("WANDB_ENTITY") or None,
        "name": args.run_name or env.get("WANDB_NAME") or None,
        "tags": tags or None,
        "save_dir": _save_dir(args),
    }


#: report_to name -> (Lightning logger class in lightning.pytorch.loggers, its keyword arguments from args and the
#: environment, the package that must be importable: None for none).
LOGGERS: dict[str, tuple[str, Callable[[Any], dict[str, Any]], tuple[str, ...]]] = {
    "csv": ("CSVLogger", _csv, ()),
    "tensorboard": ("TensorBoardLogger", _tensorboard, ("tensorboard", "tensorboardX")),
    "mlflow": ("MLFlowLogger", _mlflow, ("mlflow",)),
    "wandb": ("WandbLogger", _wandb, ("wandb",)),
}


def _installed(name: str) -> bool:
    packages = LOGGERS[name][2]
    return not packages or any(importlib.util.find_spec(package) is not None for package in packages)


def report_to_names(report_to: Any) -> list[str]:
    """Normalise ``report_to`` (None, "none", "all", a name, a comma list or a list) to logger names. "all" means,
    as in transformers, every integration that is installed (among those hflight maps; csv needs nothing)."""
    if report_to is None:
        return []
    names = report_to.split(",") if isinstance(report_to, str) else list(report_to)
    names = [n.strip() for n in names if n and n.strip()]
    if names in (["none"], []):
        return []
    if names == ["all"]:
        return [name for name in LOGGERS if _installed(name)]
    unknown = [n for n in names if n not in LOGGERS]
    if unknown:
        raise ValueError(f"report_to: unknown logger(s) {unknown}; hflight supports {', '.join(LOGGERS)} or 'none'.")
    return names


def logger_kwargs(name: str, args: Any) -> dict[str, Any]:
    """The keyword arguments ``report_to``'s logger ``name`` is built with (see :data:`LOGGERS`)."""
    return LOGGERS[name][1](args)


def build_loggers(args: Any) -> list[Any]:
    """One Lightning logger per ``report_to`` name, each given the ``TrainingArguments`` as hyperparameters."""
    from lightning.pytorch import loggers as lightning_loggers

    loggers = []
    for logger_name in report_to_names(args.report_to):
        class_name, _, packages = LOGGERS[logger_name]
        try:
            loggers.append(getattr(lightning_loggers, class_name)(**logger_kwargs(logger_name, args)))
        except (ImportError, ModuleNotFoundError) as exc:
            raise ImportError(
                f'report_to={logger_name!r} needs {" or ".join(packages)}: pip install "hflight[{logger_name}]" ({exc})'
            ) from exc
    if loggers and hasattr(args, "to_sanitized_dict"):
        for logger in loggers:
            logger.log_hyperparams({"training_args": args.to_sanitized_dict()})
    return loggers


def split_callbacks(callbacks: list[Any]) -> tuple[list[Any], list[L.Callback]]:
    """HF callbacks (instances or classes) for the CallbackHandler, Lightning callbacks for Lightning."""
    hf, lightning = [], []
    for cb in callbacks:
        if isinstance(cb, L.Callback):
            lightning.append(cb)
        elif isinstance(cb, TrainerCallback) or (isinstance(cb, type) and issubclass(cb, TrainerCallback)):
            hf.append(cb)
        elif isinstance(cb, type) and issubclass(cb, L.Callback):
            raise TypeError(f"callbacks: pass an instance of the Lightning callback {cb.__name__}, not the class.")
        else:
            raise TypeError(
                f"callbacks: {cb!r} is neither a transformers TrainerCallback (class or instance) nor a Lightning "
                "Callback instance."
            )
    return hf, lightning


def precision_for(args: Any, strategy: Any = None) -> str:
    """Lightning's precision for ``fp16``/``bf16``. ``fp16`` on the CPU runs in full precision, as transformers'
    (accelerate enables fp16 autocast and the gradient scaler only off the CPU), where Lightning would turn
    ``16-mixed`` into ``bf16-mixed``; a backend's strategy (IPU, ORT) keeps its own choice."""
    if args.fp16 and not args.bf16 and _runs_on_cpu(args, args.strategy if strategy is None else strategy):
        return PRECISION[(False, False)]
    return PRECISION[(bool(args.fp16), bool(args.bf16))]


def _runs_on_cpu(args: Any, strategy: Any) -> bool:
    from lightning.pytorch.accelerators import CPUAccelerator

    from hflight.arguments.training_args import resolved_device_type

    if isinstance(strategy, str) and strategy in STRATEGY_ACCELERATORS:
        return False  # a backend strategy (its accelerator is not the CPU's)
    if not isinstance(strategy, str) and not type(strategy).__module__.startswith("lightning."):
        return False  # a backend's strategy object
    accelerator = accelerator_for(args, strategy)
    if args.use_cpu or isinstance(accelerator, CPUAccelerator) or accelerator == "cpu":
        return True
    return accelerator == "auto" and resolved_device_type(args) == "cpu"


def _devices(value: Any) -> Any:
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    return value


def strategy_for(args: Any, model: Any = None) -> Any:
    """``args.strategy``; for "auto", the strategy a backend accelerator needs (``accelerator="ipu"`` runs the IPU
    strategy, which Lightning 2.x no longer picks by itself); transformers' ``ddp_*``, ``fsdp`` and ``deepspeed``
    arguments as Lightning's DDP, FSDP and DeepSpeed strategies (``hflight.arguments.strategies``; ``model``: the model
    the FSDP wrap policy names its layers of)."""
    if args.strategy == "auto" and isinstance(args.accelerator, str) and args.accelerator in DEFAULT_STRATEGIES:
        return DEFAULT_STRATEGIES[args.accelerator]
    return strategy_from_args(args.strategy, args, model)


def accelerator_for(args: Any, strategy: Any) -> Any:
    """``args.accelerator``; for "auto", the accelerator a backend strategy needs (``strategy="ipu"``). A strategy
    object that already carries an accelerator (it ran under an earlier ``lightning.Trainer`` of this facade) keeps
    it: Lightning refuses an accelerator given twice."""
    if isinstance(strategy, str):
        return STRATEGY_ACCELERATORS.get(strategy, "auto") if args.accelerator == "auto" else args.accelerator
    if getattr(strategy, "accelerator", None) is not None:
        return "auto"
    return args.accelerator


def lightning_trainer_kwargs(
    args: Any,
    callbacks: list[L.Callback],
    fitting: bool,
    strategy: Any = None,
    model: Any = None,
    loggers: list[Any] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``lightning.Trainer`` for a ``fit`` (``fitting``) or an evaluation; ``strategy``
    replaces ``args.strategy`` (a compat trainer such as ``IPUTrainer`` brings its own instance); ``model``: the
    model the run trains (for an FSDP wrap policy). A fit builds its loggers from ``report_to``; an evaluation or
    prediction logs to ``loggers`` (those of the fit before it, which outlive it) or to none."""
    strategy = strategy_for(args, model) if strategy is None else strategy
    kwargs = {
        "accelerator": accelerator_for(args, strategy),
        "devices": _devices(args.devices),
        "strategy": strategy,
        "num_nodes": args.num_nodes,
        "precision": precision_for(args, strategy),
        "max_epochs": -1,  # the facade sets the real bound once the loader length is known
        "max_steps": -1,  # HF's TrainerControl stops the run (DefaultFlowCallback at max_steps)
        "logger": build_loggers(args) if fitting else (loggers or False),
        "callbacks": callbacks,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "use_distributed_sampler": False,
        # full_determinism: transformers' enable_full_determinism ran when the facade was built (CUBLAS_WORKSPACE_CONFIG
        # ":16:8", deterministic algorithms, cuDNN); Lightning's deterministic=True would overwrite it with ":4096:8".
        "deterministic": None,
        "default_root_dir": args.output_dir,
        "log_every_n_steps": 1,
    }
    slurm = cluster.slurm_plugin(getattr(args, "requeue_signal", "SIGUSR1"))
    if slurm is not None:  # under srun: Lightning's SLURM environment, its auto-requeue off (hflight requeues)
        kwargs["plugins"] = [slurm]
    return kwargs


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Hide Lightning's informational banners (devices found, tips, "fit stopped") while the facade drives it:
    an HF user sees HF's output, once per run, not Lightning's once per ``evaluate()``. Warnings still show."""
    rank_zero_logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    previous = rank_zero_logger.level
    if previous <= logging.INFO:
        rank_zero_logger.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            # The module has a validation_step for evaluate(); fit deliberately has no val loader (HF's control
            # decides when to evaluate), so Lightning's "no val_dataloader" notice is noise here.
            warnings.filterwarnings("ignore", message=".*no `val_dataloader`.*")
            warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\)` is deprecated.*")
            # Lightning's all_gather still calls the functional all_gather newer torch deprecates (once per
            # gathered tensor during distributed evaluation); nothing a user can act on.
            warnings.filterwarnings("ignore", message=".*torch.distributed.nn.functional.all_gather is deprecated.*")
            yield
    finally:
        rank_zero_logger.setLevel(previous)
