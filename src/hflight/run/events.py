"""HF callback events: the one dispatcher, and the Lightning hooks that drive the training loop.

:func:`dispatch` is how every ``TrainerCallback`` event of hflight's core reaches the callbacks (training, evaluation,
prediction, saving, hyperparameter search, hub pushes): it calls transformers' own ``CallbackHandler`` with the
facade's ``args``, ``state`` and ``control`` and applies the ``TrainerControl`` the callbacks return. What a control
flag then means for Lightning is the loop's business (``hflight.run.loop``): ``should_training_stop`` stops the fit,
``should_epoch_stop`` ends the epoch (``HFModule.on_train_batch_start``), ``should_log``/``should_evaluate``/
``should_save`` are acted on at the next step or epoch end.

:class:`LightningEvents` is the thin Lightning ``Callback`` of a training run: each Lightning hook it implements calls
one method of the run's :class:`~hflight.run.loop.TrainingLoop`, and nothing else.

| Lightning hook | the loop |
|---|---|
| ``setup("fit")`` | ``begin``: plan, state, resume position; Lightning's ``max_epochs`` from the plan |
| ``on_train_start`` | ``train_begin`` (``on_train_begin``) |
| ``on_train_epoch_start`` | ``epoch_begin`` (``on_epoch_begin``) |
| ``on_train_epoch_end`` | ``epoch_end`` (``on_epoch_end``, log/evaluate/save); a stop ends the fit |
"""

from __future__ import annotations

from typing import Any

import lightning as L
from transformers.trainer_callback import TrainerControl
from typing_extensions import override

from hflight.surface import TrainerSurface


def dispatch(facade: TrainerSurface, event: str, *args: Any, **kwargs: Any) -> TrainerControl:
    """Fire HF ``event`` (``"on_log"``, ``"on_evaluate"``, ...) on the facade's callbacks; the control they return
    becomes the facade's ``control``, and is returned. ``args``/``kwargs``: the event's own arguments (``logs``,
    ``metrics``)."""
    handler = facade.callback_handler
    facade.control = getattr(handler, event)(facade.args, facade.state, facade.control, *args, **kwargs)
    return facade.control


class LightningEvents(L.Callback):
    """Lightning's fit hooks, mapped onto the training loop (see the module docstring's table)."""

    def __init__(self, loop: Any) -> None:
        self.loop = loop  # the run's hflight.run.loop.TrainingLoop (which imports this module)

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit":  # Lightning launched the processes: the loaders know their rank
            epochs_left = self.loop.begin(trainer.datamodule)
            trainer.fit_loop.max_epochs = epochs_left

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.loop.stop.drop_lightning_notifier()  # Lightning registered its signal handlers just before
        self.loop.train_begin(trainer.datamodule.train_loader, pl_module.device)

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.loop.epoch_begin()

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.loop.epoch_end(counts_batches=trainer.datamodule.cycles is not None):
            trainer.should_stop = True
