"""``report_to`` as transformers reads it.

Every integration name transformers knows (``transformers.integrations.INTEGRATION_TO_CALLBACK``: tensorboard, wandb,
mlflow, comet_ml, clearml, ...) is transformers' own ``TrainerCallback``, built and placed where
``transformers.Trainer`` places it (after ``DefaultFlowCallback``, before the caller's callbacks). hflight fires the
HF events those callbacks listen to at transformers' moments, so a run writes what transformers writes: the same
metric names (``train/loss``, ``eval/f1``: transformers' ``rewrite_logs``), steps, hyperparameters and run names,
read from the same environment variables (``WANDB_PROJECT``, ``MLFLOW_TRACKING_URI``, ``TENSORBOARD_LOGGING_DIR``...).

hflight adds one name of its own, ``"csv"``: Lightning's ``CSVLogger`` (no package needed; the command line's default
logger). Other Lightning loggers are passed as instances in ``callbacks=`` (see ``lightning_kwargs``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["LIGHTNING_NAMES", "INSTALL", "integration_callbacks", "lightning_names", "report_to_names"]

#: hflight's own ``report_to`` names, each a Lightning logger (built in ``hflight.arguments.lightning_kwargs``).
LIGHTNING_NAMES = ("csv",)

#: integration -> what to ``pip install`` for it (hflight's extras for the three the suite runs against).
INSTALL = {
    "tensorboard": '"hflight[tensorboard]"',
    "wandb": '"hflight[wandb]"',
    "mlflow": '"hflight[mlflow]"',
    "azure_ml": "azureml-core",
    "comet_ml": "comet-ml",
    "dagshub": "dagshub mlflow",
    "dvclive": "dvclive",
    "neptune": "neptune",
    "codecarbon": "codecarbon",
    "clearml": "clearml",
    "flyte": "flytekit flytekitplugins-deck-standard",
    "swanlab": "swanlab",
    "trackio": "trackio",
    "kubeflow": "kubeflow",
}


def _integrations() -> dict[str, type]:
    from transformers.integrations import INTEGRATION_TO_CALLBACK

    return INTEGRATION_TO_CALLBACK


def report_to_names(report_to: Any) -> list[str]:
    """``report_to`` (None, "none", "all", a name, a comma list or a list) as a list of names. "all" is every
    installed integration, as transformers decides it (``get_available_reporting_integrations``).

    Raises:
        ValueError: a name that is neither one of transformers' integrations nor hflight's ``"csv"``.
    """
    if report_to is None:
        return []
    names = report_to.split(",") if isinstance(report_to, str) else list(report_to)
    names = [n.strip() for n in names if n and n.strip()]
    if names in (["none"], []):
        return []
    if names == ["all"]:
        from transformers.integrations import get_available_reporting_integrations

        return list(get_available_reporting_integrations())
    known = [*_integrations(), *LIGHTNING_NAMES]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"report_to: unknown integration(s) {unknown}; known: {', '.join(known)}, 'all' or 'none'.")
    return names


def lightning_names(report_to: Any) -> list[str]:
    """The names of ``report_to`` that are hflight's Lightning loggers (``"csv"``)."""
    return [name for name in report_to_names(report_to) if name in LIGHTNING_NAMES]


def integration_callbacks(report_to: Any) -> list[Any]:
    """transformers' integration callbacks for ``report_to``, built (as ``transformers.Trainer`` builds them).

    Raises:
        ImportError: an integration whose package is not installed, with the command that installs it.
    """
    callbacks = []
    for name in report_to_names(report_to):
        if name in LIGHTNING_NAMES:
            continue
        callback_class = _integrations()[name]
        try:
            callbacks.append(callback_class())
        except (RuntimeError, ImportError) as exc:  # transformers' "<X>Callback requires <package> to be installed"
            install = INSTALL.get(name, name)
            raise ImportError(f"report_to={name!r} needs its package: pip install {install} ({exc})") from exc
    return callbacks
