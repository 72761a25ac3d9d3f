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
import logging
import warnings
from collections.abc import Iterator
from typing import Any

import lightning as L
from transformers.trainer_callback import TrainerCallback

from hflight.arguments import cluster, reporting
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


def build_loggers(args: Any) -> list[Any]:
    """hflight's own Lightning loggers of ``report_to`` (``"csv"``: Lightning's ``CSVLogger`` in
    ``<logging_dir or output_dir>/<run_name or "hflight">/version_N``), each given the ``TrainingArguments`` as
    hyperparameters. transformers' integrations (tensorboard, wandb, mlflow, ...) are callbacks, built with the
    facade's other callbacks (``hflight.arguments.reporting``)."""
    from lightning.pytorch.loggers import CSVLogger

    names = reporting.lightning_names(args.report_to)
    loggers = [CSVLogger(save_dir=_save_dir(args), name=_run_name(args)) for _ in names]
    if loggers and hasattr(args, "to_sanitized_dict"):
        for logger in loggers:
            logger.log_hyperparams({"training_args": args.to_sanitized_dict()})
    return loggers


def split_callbacks(callbacks: list[Any]) -> tuple[list[Any], list[Any]]:
    """HF callbacks (instances or classes) for the CallbackHandler; Lightning callbacks and Lightning logger instances
    (``lightning.pytorch.loggers.Logger``: they receive every logged entry, beside ``report_to``'s) for Lightning."""
    from lightning.pytorch.loggers import Logger

    hf, lightning = [], []
    for cb in callbacks:
        if isinstance(cb, (L.Callback, Logger)):
            lightning.append(cb)
        elif isinstance(cb, TrainerCallback) or (isinstance(cb, type) and issubclass(cb, TrainerCallback)):
            hf.append(cb)
        elif isinstance(cb, type) and issubclass(cb, L.Callback):
            raise TypeError(f"callbacks: pass an instance of the Lightning callback {cb.__name__}, not the class.")
        else:
            raise TypeError(
                f"callbacks: {cb!r} is neither a transformers TrainerCallback (class or instance) nor a Lightning "
                "Callback or Logger instance."
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


def spanned_layout(args: Any) -> tuple[Any, int]:
    """``devices`` and ``num_nodes`` for ``lightning.Trainer``: the arguments' own, except that under an external
    launcher (torchrun, srun) ``devices="auto"`` means one device per process the launcher started on this node, and
    ``num_nodes`` left at 1 means the launcher's nodes, so that the run spans every launched process, data-parallel,
    as transformers' ``Trainer`` does with nothing named (``hflight.arguments.cluster.launched_layout``). Values the
    arguments set otherwise stay; a run that then does not span the launched processes is refused when it starts."""
    devices, num_nodes = _devices(args.devices), args.num_nodes
    layout = cluster.launched_layout()
    if layout is None:
        return devices, num_nodes
    return (layout.devices if devices == "auto" else devices), (layout.num_nodes if num_nodes == 1 else num_nodes)


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
    model the run trains (for an FSDP wrap policy). A fit builds its Lightning loggers from ``report_to`` (``"csv"``)
    and takes those passed among ``callbacks``; an evaluation or prediction logs to ``loggers`` (those of the fit
    before it, which outlive it), else to those passed, else to none."""
    from lightning.pytorch.loggers import Logger

    strategy = strategy_for(args, model) if strategy is None else strategy
    given = [cb for cb in callbacks if isinstance(cb, Logger)]  # Lightning loggers passed in callbacks=
    callbacks = [cb for cb in callbacks if not isinstance(cb, Logger)]
    devices, num_nodes = spanned_layout(args)
    kwargs = {
        "accelerator": accelerator_for(args, strategy),
        "devices": devices,
        "strategy": strategy,
        "num_nodes": num_nodes,
        "precision": precision_for(args, strategy),
        "max_epochs": -1,  # the facade sets the real bound once the loader length is known
        "max_steps": -1,  # HF's TrainerControl stops the run (DefaultFlowCallback at max_steps)
        "logger": [*build_loggers(args), *given] if fitting else (loggers or given or False),
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
    launcher = cluster.launcher_plugin(getattr(args, "requeue_signal", "SIGUSR1"))
    if launcher is not None:  # srun: SLURM's environment, its auto-requeue off (hflight requeues); DeepSpeed's launcher
        kwargs["plugins"] = [launcher]
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
