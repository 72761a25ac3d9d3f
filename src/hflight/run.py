"""The Lightning side of one ``Trainer.train()``, or of one ``evaluate()``/``predict()`` outside training.

The facade (``hflight.trainer.Trainer``) keeps transformers' surface and creates one :class:`Run` per call; everything
Lightning needs for that call lives here and is handed to the collaborators as an argument, so none of them reads
the facade's private state. Layers (each imports only those below it)::

    facade (trainer.py)  ->  run (run.py)  ->  Lightning pieces  ->  backends (backend.py; ipu/, ort/ strategies)
                                               module, datamodule, callbacks.bridge, evaluation,
                                               checkpoint, resume, steps, plan, distributed
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
from transformers.trainer_utils import TrainOutput

from hflight.backend import HFBackend, backend_of
from hflight.callbacks.bridge import HFEventBridge
from hflight.callbacks.hooks import evaluation_weights, weight_hooks
from hflight.datamodule import HFDataModule
from hflight.distributed import World
from hflight.interrupt import handed_over_signals
from hflight.lightning_kwargs import lightning_trainer_kwargs, quiet_lightning
from hflight.module import HFModule
from hflight.plan import TrainingPlan
from hflight.resume import ResumePoint
from hflight.surface import TrainerSurface


class Run:
    """One call's ``lightning.Trainer`` and everything around it.

    Fields, and who sets them:

    - ``facade``: the :class:`~hflight.surface.TrainerSurface` the run works for (the facade, at creation).
    - ``fitting``: True for ``train()``, False for an evaluation or prediction outside training (at creation).
    - ``lightning_trainer``: the ``lightning.Trainer``, built from ``args`` by ``lightning_kwargs`` (at creation).
    - ``module``: the :class:`~hflight.module.HFModule` around ``facade.model`` (at creation).
    - ``world``: rank, size and collectives of the processes, through the strategy (derived, read when used).
    - ``backend``: the running strategy's :class:`~hflight.backend.HFBackend` hooks (derived).
    - ``resume``: the checked checkpoint a training run resumes from, or None (the facade, before creating the run).
    - ``train_batch_size``: the training batch size per device of this run (the facade: ``args.train_batch_size``, or
      what ``auto_find_batch_size`` lowered it to; recorded in ``TrainerState.train_batch_size``).
    - ``bridge``: the :class:`~hflight.callbacks.bridge.HFEventBridge` firing HF events (training runs, at creation).
    - ``datamodule``: the :class:`~hflight.datamodule.HFDataModule` (training runs, at creation).
    - ``plan``: the :class:`~hflight.plan.TrainingPlan` (the bridge, once Lightning launched the processes).
    - ``epochs_offset``: epochs a resumed run had already trained (the bridge, with the plan).
    - ``evaluator``: the evaluation in progress, if any (``hflight.evaluation``, for the length of one evaluation).
    """

    def __init__(
        self,
        facade: TrainerSurface,
        *,
        fitting: bool,
        strategy: Any = None,
        lightning_callbacks: list[L.Callback] | None = None,
        resume: ResumePoint | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        train_batch_size: int | None = None,
        loggers: list[Any] | None = None,
    ) -> None:
        self.facade = facade
        self.train_batch_size = train_batch_size if train_batch_size is not None else facade.args.train_batch_size
        self.fitting = fitting
        self.resume = resume
        self.plan: TrainingPlan | None = None
        self.epochs_offset = 0
        self.evaluator: Any = None
        self.bridge = HFEventBridge(facade, self, trial, ignore_keys_for_eval) if fitting else None
        callbacks = [*(lightning_callbacks or []), *([self.bridge] if self.bridge is not None else [])]
        kwargs = lightning_trainer_kwargs(
            facade.args, callbacks, fitting=fitting, strategy=strategy, model=facade.model, loggers=loggers
        )
        with quiet_lightning():
            self.lightning_trainer = L.Trainer(**kwargs)
        self.world = World(self.lightning_trainer)
        self.module = HFModule(facade, self, facade.model)
        self.datamodule = HFDataModule(facade, self) if fitting else None

    @property
    def backend(self) -> HFBackend:
        """The running strategy's hooks into the HF loop (eager PyTorch unless a backend such as the IPU's)."""
        return backend_of(self.lightning_trainer.strategy)

    # ---- the weights protocol (EMACallback and the like) -----------------------------------------------------------
    def weight_hooks(self, method: str) -> list[Any]:
        """The facade's callbacks that define ``method`` of the weights protocol (see ``hflight.callbacks.hooks``)."""
        return weight_hooks(self.facade.callback_handler.callbacks, method)

    def evaluation_weights(self) -> contextlib.ExitStack:
        """A context in which the model holds the weights evaluation and saved models use."""
        return evaluation_weights(self.facade.callback_handler.callbacks, self.facade.model)

    # ---- running -----------------------------------------------------------------------------------------------------
    def fit(self) -> None:
        """``lightning.Trainer.fit``, with SIGTERM/SIGINT stopping at the next step boundary (``hflight.interrupt``)."""
        handed_over = handed_over_signals(self.facade.args)
        with quiet_lightning(), self.bridge.stop.handling_signals(self.lightning_trainer, handed_over):
            self.lightning_trainer.fit(self.module, datamodule=self.datamodule)

    def finish_training(self) -> TrainOutput:
        """After ``fit``: train metrics, best model, final rotation, ``on_train_end`` (see the bridge)."""
        return self.bridge.finish_training()

    @contextlib.contextmanager
    def evaluating(self, evaluator: Any) -> Iterator[Any]:
        """``evaluator`` is the evaluation in progress for the duration; the backend's evaluation model is left
        afterwards."""
        self.evaluator = evaluator
        try:
            yield evaluator
        finally:
            self.module.close_evaluation()
            self.evaluator = None

    def device(self) -> torch.device:
        """The device the model's inputs go to."""
        return self.module.device
