"""The INFO lines a transformers user reads on the console, at transformers' moments, with transformers' wording.

They go through ``transformers.trainer``'s logger, the one ``transformers.Trainer`` writes to, so whatever a script
does to transformers' logging (``transformers.logging.set_verbosity_info()``, ``TRANSFORMERS_VERBOSITY``, the
explicit format, disabling the default handler) applies to hflight's run the same way; the facade sets transformers'
verbosity from ``args.log_level``/``log_level_replica`` (``args.get_process_log_level()``) as transformers'
``Trainer.__init__`` does.

On the command line (:func:`command_line`) two of transformers' lines give way to the command line's own: how to
continue a stopped run, and the train metrics of a resumed run that had nothing left to train.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from transformers.trainer_pt_utils import get_model_param_count
from transformers.utils import logging as hf_logging

logger = hf_logging.get_logger("transformers.trainer")

#: Not empty while the command line runs a job (:func:`command_line`).
_COMMAND_LINE: list[bool] = []


@contextlib.contextmanager
def command_line(active: bool = True) -> Iterator[None]:
    """While ``hflight-train`` runs a job (``active``): a stopped run's message leaves out the Python call that
    continues it (the command line prints its own ``hflight-train resume=`` command: one instruction, the one to
    type), and a ``train()`` resumed at the end of its training logs no train metrics (a line of zeros, nothing having
    been trained; the command line says that the run had already finished, and keeps its results). A script or a
    notebook gets transformers' behaviour: the Python call, and ``Trainer.train``'s log of the metrics (``on_log``)."""
    if not active:
        yield
        return
    _COMMAND_LINE.append(True)
    try:
        yield
    finally:
        _COMMAND_LINE.pop()


def on_command_line() -> bool:
    """Whether the command line runs this job (see :func:`command_line`)."""
    return bool(_COMMAND_LINE)


def set_process_log_level(args: Any) -> None:
    """transformers' verbosity for this process: ``log_level`` on the logging process, ``log_level_replica`` on the
    others (``passive`` keeps the current level)."""
    hf_logging.set_verbosity(args.get_process_log_level())


def training_started(args: Any, plan: Any, model: Any, resumed_at: int | None, data: str = "") -> None:
    """The "***** Running training *****" block, before the first step; ``resumed_at``: the global step a resumed
    run continues from (None for a fresh run); ``data``: its line (the checkpoint, the step, how the data is taken
    up: ``hflight.run.position.describe_start``)."""
    logger.info("***** Running training *****")
    logger.info(f"  Num examples = {plan.num_examples:,}")
    logger.info(f"  Num Epochs = {plan.num_train_epochs:,}")
    logger.info(f"  Num update steps per epoch = {plan.num_update_steps_per_epoch:,}")
    logger.info(f"  Instantaneous batch size per device = {args.per_device_train_batch_size:,}")
    logger.info(f"  Total train batch size (w. parallel, distributed & accumulation) = {plan.total_train_batch_size:,}")
    logger.info(f"  Gradient Accumulation steps = {args.gradient_accumulation_steps}")
    logger.info(f"  Total optimization steps = {plan.max_steps:,}")
    logger.info(f"  Number of trainable parameters = {get_model_param_count(model, trainable_only=True):,}")
    if resumed_at is not None:  # one line: the checkpoint, the step, how the data is taken up
        logger.info(f"  {data}")


def training_completed() -> None:
    logger.info("\n\nTraining completed. Do not forget to share your model on huggingface.co/models =)\n\n")


def evaluation_started(description: str, num_examples: int | None, batch_size: int) -> None:
    """The "***** Running Evaluation *****" (or Prediction) block."""
    logger.info(f"\n***** Running {description} *****")
    logger.info(f"  Num examples = {num_examples}" if num_examples is not None else "  Num examples: Unknown")
    logger.info(f"  Batch size = {batch_size}")


def columns_ignored(columns: list[str], description: str | None, model_name: str) -> None:
    """The note about dataset columns the model's ``forward`` does not take (they are removed)."""
    where = "" if description is None else f"in the {description} set"
    names = ", ".join(columns)
    logger.info(
        f"The following columns {where} don't have a corresponding argument in `{model_name}.forward` and have been "
        f"ignored: {names}. If {names} are not expected by `{model_name}.forward`,  you can safely ignore this message."
    )
