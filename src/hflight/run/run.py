"""The Lightning side of one ``Trainer.train()``, or of one ``evaluate()``/``predict()`` outside training.

The facade (``hflight.trainer``) keeps transformers' surface and creates one :class:`Run` per call; everything
Lightning needs for that call lives here and is handed to the collaborators as an argument, so none of them reads
the facade's private state. A training step, top to bottom: ``Trainer.train`` -> :meth:`Run.fit` -> Lightning ->
``HFModule.training_step`` (``hflight.run.module``) -> the facade's ``training_step`` -> the loop's bookkeeping
(``hflight.run.loop``) -> ``dispatch`` (``hflight.run.events``) -> the callbacks -> ``TrainerControl`` applied.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator
from typing import Any

import lightning as L
from transformers.trainer_utils import TrainOutput

from hflight.arguments import process_group
from hflight.arguments.lightning_kwargs import lightning_trainer_kwargs, quiet_lightning
from hflight.callbacks.hooks import evaluation_weights, weight_hooks
from hflight.checkpoints.asynchronous import CheckpointWriter
from hflight.checkpoints.resume import ResumePoint
from hflight.run.autocast import autocast_forward, use_forward_autocast
from hflight.run.backend import HFBackend, backend_of
from hflight.run.datamodule import HFDataModule
from hflight.run.distributed import World
from hflight.run.eval_precision import refuse_int8_in_training
from hflight.run.evaluation import evaluates_in_process
from hflight.run.events import LightningEvents
from hflight.run.interrupt import handed_over_signals, requeue_signal
from hflight.run.launch_check import check_spans_launch
from hflight.run.lightning_fallbacks import no_lightning_hpc_restore
from hflight.run.loop import TrainingLoop
from hflight.run.module import HFModule
from hflight.run.plan import TrainingPlan
from hflight.surface import TrainerSurface


class TeardownInPlace:
    """A Lightning strategy's ``teardown`` without its moves of the model and the optimizer states to the CPU.

    ``Strategy.teardown`` (which every Lightning strategy's ends in) moves the LightningModule and each optimizer's
    state to the CPU once ``fit``, ``validate`` or ``predict`` is over, to free the device. transformers' ``Trainer``
    keeps the model on ``args.device`` from its construction on, and the optimizer's state beside it: after
    ``train()``, ``evaluate()`` and ``predict()`` the script, the callbacks, the best model and a later ``train()``
    find them there, with nothing copied to the host and back. Installed on the strategy instance (a module-level
    class, so that a strategy ``ddp_spawn`` pickles into its processes still pickles); the rest of the strategy's
    teardown (unwrapping DDP, the precision plugin's, the accelerator's) runs as Lightning's."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    @classmethod
    def install(cls, strategy: Any) -> None:
        """``strategy.teardown`` as this class's (once: a strategy object may serve several runs)."""
        if not isinstance(vars(strategy).get("teardown"), cls):
            strategy.teardown = cls(strategy)

    def __call__(self) -> None:
        strategy = self.strategy
        module, optimizers = strategy.lightning_module, strategy._optimizers
        strategy._optimizers = []  # Strategy.teardown moves the state of each of these to the CPU
        if module is not None:
            module.cpu = lambda: module  # ...and calls the LightningModule's cpu()
        try:
            type(strategy).teardown(strategy)
        finally:
            strategy._optimizers = optimizers
            if module is not None:
                del module.cpu


class Run:
    """One call's ``lightning.Trainer`` and everything around it.

    Fields, and who sets them:

    - ``facade``: the :class:`~hflight.surface.TrainerSurface` the run works for (the facade, at creation).
    - ``fitting``: True for ``train()``, False for an evaluation or prediction outside training (at creation).
    - ``lightning_trainer``: the ``lightning.Trainer``, built from ``args`` by ``lightning_kwargs`` (at creation).
    - ``module``: the :class:`~hflight.run.module.HFModule` around ``facade.model`` (at creation).
    - ``world``: rank, size and collectives of the processes, through the strategy (derived, read when used).
    - ``backend``: the running strategy's :class:`~hflight.run.backend.HFBackend` hooks (derived).
    - ``resume``: the checked checkpoint a training run resumes from, or None (the facade, before creating the run).
    - ``train_batch_size``: the training batch size per device of this run (the facade: ``args.train_batch_size``, or
      what ``auto_find_batch_size`` lowered it to; recorded in ``TrainerState.train_batch_size``).
    - ``loop``: the :class:`~hflight.run.loop.TrainingLoop`, HF's training loop (training runs, at creation), driven by
      Lightning's hooks through a :class:`~hflight.run.events.LightningEvents` callback.
    - ``datamodule``: the :class:`~hflight.run.datamodule.HFDataModule` (training runs, at creation).
    - ``plan``: the loop's :class:`~hflight.run.plan.TrainingPlan` (set by the loop once Lightning launched the
      processes; None before, and outside training).
    - ``epochs_offset``: epochs a resumed run had already trained (the loop's, with the plan).
    - ``evaluator``: the evaluation in progress, if any (``hflight.run.evaluation``, for one evaluation).
    - ``checkpoint_writer``: who finishes each checkpoint's write, now or in the background (``save_async``;
      ``hflight.checkpoints.asynchronous``); ``fit`` waits for it before it returns or raises (at creation).
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
        self.evaluator: Any = None
        if fitting:
            refuse_int8_in_training(facade.args)
        self.loop = TrainingLoop(facade, self, trial, ignore_keys_for_eval) if fitting else None
        callbacks = [*(lightning_callbacks or []), *([LightningEvents(self.loop)] if fitting else [])]
        kwargs = lightning_trainer_kwargs(
            facade.args, callbacks, fitting=fitting, strategy=strategy, model=facade.model, loggers=loggers
        )
        with quiet_lightning():
            self.lightning_trainer = L.Trainer(**kwargs)
        use_forward_autocast(self.lightning_trainer)  # mixed precision: the model's forward autocast, as accelerate's
        TeardownInPlace.install(self.lightning_trainer.strategy)  # the model stays on its device, as transformers'
        check_spans_launch(self.lightning_trainer, facade.args)  # never N copies of a one-process run
        self.world = World(self.lightning_trainer)
        self.checkpoint_writer = CheckpointWriter(bool(getattr(facade.args, "save_async", False)), self.world)
        # hflight's checkpoints only: never Lightning's hpc_ckpt_*.ckpt
        no_lightning_hpc_restore(self.lightning_trainer, report=self.world.rank == 0)
        process_group.connect_strategy(self.lightning_trainer.strategy)  # before Lightning, for a launcher's
        process_group.end_at_exit()  # also the group Lightning connects for the processes it launches itself
        self.module = HFModule(facade, self, facade.model)
        self.datamodule = HFDataModule(facade, self) if fitting else None
        # what an evaluation run was built from (``serves_evaluation``)
        self._built_from = (facade, facade.args, repr(vars(facade.args)), strategy, list(lightning_callbacks or []))

    @property
    def plan(self) -> TrainingPlan | None:
        return self.loop.plan if self.loop is not None else None

    @property
    def epochs_offset(self) -> int:
        return self.loop.epochs_offset if self.loop is not None else 0

    @property
    def epoch_start_rng(self) -> dict[str, Any] | None:
        """The RNG streams as the epoch in progress drew its data order (None outside training)."""
        cycles = self.datamodule.cycles if self.datamodule is not None else None
        return cycles.epoch_start_rng if cycles is not None else None

    @property
    def data_position(self) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None, str | None] | None:
        """The training data's position for a checkpoint (``hflight.run.position``): this process's dataset's and the
        loader's descriptions, this process's entry, and why its stream states are not kept (None: they are); None:
        the loader reports no position, or outside training."""
        tracker = self.datamodule.tracker if self.datamodule is not None else None
        if tracker is None or not tracker.tracked:
            return None
        return tracker.dataset, tracker.loader, tracker.record(), tracker.why

    @property
    def backend(self) -> HFBackend:
        """The running strategy's hooks into the HF loop (eager PyTorch unless a backend such as the IPU's)."""
        return backend_of(self.lightning_trainer.strategy)

    def serves_evaluation(self, facade: TrainerSurface, strategy: Any, lightning_callbacks: list[L.Callback]) -> bool:
        """Whether this run may run another ``evaluate()``/``predict()`` outside training, instead of a new run (and a
        new ``lightning.Trainer``, whose creation scans every installed package's entry points): an evaluation run
        that evaluates without Lightning's ``validate`` (``hflight.run.evaluation.evaluates_in_process``), for the
        same facade, model, strategy and Lightning callbacks, with arguments unchanged since it was built."""
        if self.fitting or not evaluates_in_process(self.lightning_trainer) or self.module.model is not facade.model:
            return False
        built_facade, args, snapshot, built_strategy, callbacks = self._built_from
        same_callbacks = len(callbacks) == len(lightning_callbacks)
        same_callbacks = same_callbacks and all(map(operator.is_, callbacks, lightning_callbacks))
        return (
            built_facade is facade
            and args is facade.args
            and built_strategy is strategy
            and same_callbacks
            and snapshot == repr(vars(args))
        )

    # ---- the weights protocol (EMACallback and the like) -----------------------------------------------------------
    def weight_hooks(self, method: str) -> list[Any]:
        """The facade's callbacks that define ``method`` of the weights protocol (see ``hflight.callbacks.hooks``)."""
        return weight_hooks(self.facade.callback_handler.callbacks, method)

    def evaluation_weights(self) -> contextlib.ExitStack:
        """A context in which the model holds the weights evaluation and saved models use."""
        return evaluation_weights(self.facade.callback_handler.callbacks, self.facade.model)

    # ---- running -----------------------------------------------------------------------------------------------------
    def fit(self) -> None:
        """``lightning.Trainer.fit``, with SIGTERM/SIGINT (and under SLURM the requeue signal) stopping at the next
        step boundary (``hflight.run.interrupt``)."""
        args = self.facade.args
        stop = self.loop.stop.handling_signals(self.lightning_trainer, handed_over_signals(args), requeue_signal(args))
        raising = True
        try:
            with quiet_lightning(), stop, autocast_forward(self.module.model, self.lightning_trainer):
                self.lightning_trainer.fit(self.module, datamodule=self.datamodule)
            raising = False
        finally:  # save_async: the write in flight is published (or fails) before fit is over, also when it raised
            self.checkpoint_writer.close(raising)
            self.datamodule.release_workers()

    def finish_training(self, measure_memory: Any = None) -> TrainOutput:
        """After ``fit``: train metrics, best model, final rotation, ``on_train_end`` (see the loop);
        ``measure_memory(metrics)`` adds the memory metrics before they are logged."""
        return self.loop.finish(self.lightning_trainer.loggers, measure_memory)

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
