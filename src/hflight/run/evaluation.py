"""Evaluation and prediction: HF's ``evaluation_loop`` semantics with Lightning doing the running.

Outside of ``fit``, the loop runs as Lightning's ``validate`` (devices, precision, strategy, Lightning callbacks).
Inside ``fit`` Lightning has no public way to validate *now* (HF's ``should_evaluate`` can fire at any step),
so the same per-batch code is driven directly under the fit's precision context: that is the one contained
mechanism for mid-training evaluation. Where ``validate`` would add nothing but its own bookkeeping (one process on
Lightning's single-device strategy, no backend, full or mixed precision, no Lightning callbacks or loggers to call:
:func:`evaluates_in_process`), an evaluation outside ``fit`` is driven the same direct way, doing what ``validate``
does there (the model placed on the device and in eval mode, then its modes restored; inference mode; the precision
plugin's step context; SIGTERM stopping between batches): Lightning's per-batch hooks, progress and result
bookkeeping cost more than a small model's forward (benchmarks/loop_overhead.py).

Every batch's outputs move to the CPU as numpy at once, so device memory stays bounded by one batch; the
arrays are concatenated once at the end, padded with -100 like HF.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from transformers.trainer_callback import TrainerState
from transformers.trainer_pt_utils import find_batch_size, nested_numpify
from transformers.trainer_utils import (
    EvalLoopOutput,
    EvalPrediction,
    PredictionOutput,
    SaveStrategy,
    denumpify_detensorize,
    speed_metrics,
)

from hflight.arguments.lightning_kwargs import quiet_lightning
from hflight.arguments.optimizers import set_optimizer_mode, steps_on_metrics
from hflight.run import console, eval_precision
from hflight.run.autocast import ForwardAutocast, autocast_forward
from hflight.run.datamodule import EvaluationData, loader_length
from hflight.run.events import dispatch
from hflight.run.interrupt import sigterm_exits_non_zero, sigterm_stops_between_batches
from hflight.surface import RunView, TrainerSurface


def _pad_concat(arrays: list[np.ndarray], padding_index: int) -> np.ndarray:
    arrays = [np.atleast_1d(a) for a in arrays]
    if all(a.shape[1:] == arrays[0].shape[1:] for a in arrays):
        return np.concatenate(arrays, axis=0)
    trailing = tuple(max(a.shape[d] for a in arrays) for d in range(1, arrays[0].ndim))
    out = np.full((sum(a.shape[0] for a in arrays), *trailing), padding_index, dtype=arrays[0].dtype)
    row = 0
    for a in arrays:
        out[(slice(row, row + a.shape[0]), *(slice(0, s) for s in a.shape[1:]))] = a
        row += a.shape[0]
    return out


def nested_concat(items: list[Any], padding_index: int = -100) -> Any:
    """Concatenate same-structured batches (arrays, tuples/lists or dicts of them) along the first axis."""
    first = items[0]
    if isinstance(first, (list, tuple)):
        return type(first)(nested_concat([it[i] for it in items], padding_index) for i in range(len(first)))
    if isinstance(first, Mapping):
        return type(first)({k: nested_concat([it[k] for it in items], padding_index) for k in first})
    return _pad_concat(list(items), padding_index)


def nested_truncate(value: Any, limit: int) -> Any:
    """Keep the first ``limit`` rows of every array or tensor (accelerate's ``gather_for_metrics`` cut of a last
    batch); ``value`` as it is when one of them has no rows to cut (a 0-d value), as accelerate leaves it."""
    try:
        return _truncated(value, limit)
    except (IndexError, TypeError):
        return value


def _truncated(value: Any, limit: int) -> Any:
    if isinstance(value, (list, tuple)):
        return type(value)(_truncated(v, limit) for v in value)
    if isinstance(value, Mapping):
        return type(value)({k: _truncated(v, limit) for k, v in value.items()})
    return value[:limit]


class Accumulator:
    """Per-batch numpy pieces, concatenated once when asked; with ``concat=False`` (``eval_do_concat_batches=False``)
    the list of per-batch pieces, as transformers returns it."""

    def __init__(self, padding_index: int = -100, concat: bool = True) -> None:
        self.padding_index = padding_index
        self.concat = concat
        self.pieces: list[Any] = []
        self.last_batch = 0  # the batch (counted from 1) that gave the last piece

    def add(self, value: Any, batch: int) -> None:
        self.pieces.append(nested_numpify(value))
        self.last_batch = batch

    def cut_last(self, rows: int, batch: int) -> None:
        """Keep the first ``rows`` rows of the piece of ``batch``, when it is the last piece."""
        if self.pieces and self.last_batch == batch:
            self.pieces[-1] = nested_truncate(self.pieces[-1], rows)

    def result(self) -> Any:
        if not self.pieces:
            return None
        if not self.concat:
            return list(self.pieces)
        return nested_concat(self.pieces, self.padding_index)


class Evaluator:
    """Runs ``prediction_step`` batch by batch and turns the pieces into an ``EvalLoopOutput``.

    With ``args.batch_eval_metrics``, ``compute_metrics(EvalPrediction, compute_result=...)`` sees every batch (its
    gathered tensors) and ``compute_result=True`` for the last one, whose result are the metrics, as in transformers;
    predictions are then not kept (except for ``predict``). The batch is scored when the next one arrives (or at the
    end), so the last batch is known without knowing the loader's length.
    """

    def __init__(
        self,
        facade: TrainerSurface,
        world: Any,
        description: str,
        prediction_loss_only: bool,
        ignore_keys: list[str] | None,
        compute_metrics: Any = None,
        *,
        batch_rows: int,
    ):
        self.facade = facade
        self.world = world  # hflight.run.distributed.World: gathering across processes
        self.compute_metrics = compute_metrics
        self.description = description
        self.prediction_loss_only = prediction_loss_only
        self.ignore_keys = ignore_keys
        concat = facade.args.eval_do_concat_batches
        self.losses, self.preds, self.labels, self.inputs = (Accumulator(concat=concat) for _ in range(4))
        self.observed = 0
        self.batches = 0  # the batches evaluated so far
        self.model: Any = None  # what prediction_step calls: the backend's evaluation model
        self.quantized: Any = None  # int8_eval: the model's int8 copy, called instead (hflight.run.eval_precision)
        self.batch_metrics = bool(facade.args.batch_eval_metrics)
        self.keep_outputs = not self.batch_metrics or description == "Prediction"
        self.pending: EvalPrediction | None = None  # batch_eval_metrics: the last batch, not scored yet
        self.pending_batch = 0  # the batch (counted from 1) ``pending`` comes from
        self.metrics: dict | None = None
        # Counted and cut as transformers' loop with accelerate's ``gather_for_metrics``: every batch's loss counts
        # ``batch_rows`` times (``eval_batch_size``, or a backend's combined batch: ``HFBackend.hf_evaluation_rows``),
        # whatever rows the batch holds (a preference batch's chosen and rejected rows, a sampler that repeats
        # prompts), and of what was gathered only the last batch of a prepared loader is cut,
        # to the samples of it that are not repeats evening it out (the loader's ``remainder``; ``loader``: the one
        # iterated). Nothing is cut to the dataset's length, nor to a count of losses: a plain torch loader (a
        # get_eval_dataloader override's, which transformers does not prepare) is not cut at all.
        # transformers' Seq2SeqTrainer sets ``gather_function = accelerator.gather`` ("we don't want to drop
        # samples"): then no loss is cut. Predictions, labels and inputs still are (transformers also keeps the
        # repeats that even out the processes' last batches; hflight returns each sample once, in dataset order).
        accelerator = getattr(facade, "accelerator", None)
        self.keep_all = accelerator is not None and getattr(facade, "gather_function", None) == accelerator.gather
        self.batch_rows = batch_rows
        self.loader: Any = None
        self.completed = False  # whether every batch of ``loader`` was evaluated

    def step(self, inputs: dict[str, Any]) -> None:
        facade = self.facade
        self.batches += 1
        batch_size = find_batch_size(inputs)
        if batch_size is not None:
            self.observed += batch_size
        model = self.model if self.quantized is None else self.quantized
        loss, logits, labels = facade.prediction_step(
            model, inputs, self.prediction_loss_only, ignore_keys=self.ignore_keys
        )
        gather = self.world.gather_as_objects if facade.args.eval_use_gather_object else self.world.gather
        if loss is not None:
            loss = gather(loss.repeat(self.batch_rows))
            self.losses.add(loss, self.batches)
        if "inputs" in facade.args.include_for_metrics and self.keep_outputs:
            main_input = getattr(facade.model, "main_input_name", "input_ids")
            self.inputs.add(gather(inputs[main_input], pad_dim=1), self.batches)
        if labels is not None:
            labels = self.world.pad_across_processes(labels)
        if logits is not None:
            logits = self.world.pad_across_processes(logits)
            if facade.preprocess_logits_for_metrics is not None:
                logits = facade.preprocess_logits_for_metrics(logits, labels)
            logits = gather(logits)
            if self.keep_outputs:
                self.preds.add(logits, self.batches)
        if labels is not None:
            labels = gather(labels)
            if self.keep_outputs:
                self.labels.add(labels, self.batches)
        dispatch(facade, "on_prediction_step")
        if self.batch_metrics and self.compute_metrics is not None and logits is not None and labels is not None:
            include = facade.args.include_for_metrics
            self._score_pending(last=False)
            self.pending_batch = self.batches
            self.pending = EvalPrediction(
                predictions=logits,
                label_ids=labels,
                losses=loss if "loss" in include else None,
                inputs=inputs if "inputs" in include else None,
            )

    def _cut_last_batch(self) -> None:
        """What accelerate's ``gather_for_metrics`` does to the last batch of a prepared loader that reached its end
        with a ``remainder`` (the samples of its last global batch that are not repeats evening it out): every value
        gathered from that batch keeps its first ``remainder`` rows (the loss too, repeated ``batch_rows`` times,
        unless ``keep_all``). Done once the loop is over, so that a loader read ahead (Lightning's fetcher)
        cannot be taken for one at its end a batch early. A backend's loader that reports a ``remainder`` without an
        ``end_of_dataloader`` (the IPU's, padding its last batch) is at its end once every batch was evaluated."""
        remainder = getattr(self.loader, "remainder", -1)
        if not getattr(self.loader, "end_of_dataloader", self.completed) or remainder <= 0:
            return
        for kept in (self.preds, self.labels, self.inputs, *(() if self.keep_all else (self.losses,))):
            kept.cut_last(remainder, self.batches)
        pending = self.pending
        if pending is not None and self.pending_batch == self.batches:  # batch_eval_metrics' last batch
            losses = pending.losses
            if losses is not None and not self.keep_all:
                losses = nested_truncate(losses, remainder)
            self.pending = EvalPrediction(
                predictions=nested_truncate(pending.predictions, remainder),
                label_ids=nested_truncate(pending.label_ids, remainder),
                losses=losses,
                inputs=pending.inputs,
            )

    def _score_pending(self, last: bool) -> None:
        if self.pending is not None:
            self.metrics = self.compute_metrics(self.pending, compute_result=last)
            self.pending = None

    def finish(self, num_samples: int | None, metric_key_prefix: str) -> EvalLoopOutput:
        facade = self.facade
        if not num_samples:
            num_samples = self.observed
        self._cut_last_batch()
        losses, preds, labels, inputs = (kept.result() for kept in (self.losses, self.preds, self.labels, self.inputs))

        if self.batch_metrics:
            self._score_pending(last=True)
            metrics = self.metrics
        elif self.compute_metrics is not None and preds is not None and labels is not None:
            extra = {
                "losses": losses if "loss" in facade.args.include_for_metrics else None,
                "inputs": inputs if "inputs" in facade.args.include_for_metrics else None,
            }
            metrics = self.compute_metrics(EvalPrediction(predictions=preds, label_ids=labels, **extra))
        else:
            metrics = {}
        metrics = denumpify_detensorize(metrics or {})
        if isinstance(losses, list):
            losses = np.concatenate(losses)
        if isinstance(losses, np.ndarray) and losses.size:
            finite = np.isfinite(losses)
            if facade.args.logging_nan_inf_filter and finite.any():
                losses = losses[finite]
            metrics[f"{metric_key_prefix}_loss"] = losses.mean().item()
        prefixed(metrics, metric_key_prefix)
        return EvalLoopOutput(predictions=preds, label_ids=labels, metrics=metrics, num_samples=num_samples)


def evaluates_in_process(lightning_trainer: Any) -> bool:
    """Whether an evaluation outside ``fit`` can run without Lightning's ``validate`` and give the same results and
    calls: one process on Lightning's own single-device strategy and accelerator (not a backend's), a precision
    plugin that does not convert the model or the inputs, and no Lightning callback or logger whose hooks
    ``validate`` would call."""
    from lightning.pytorch.accelerators import CPUAccelerator, CUDAAccelerator, MPSAccelerator
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision
    from lightning.pytorch.strategies import SingleDeviceStrategy

    strategy = lightning_trainer.strategy
    return (
        type(strategy) is SingleDeviceStrategy
        and type(strategy.accelerator) in (CPUAccelerator, CUDAAccelerator, MPSAccelerator)
        and type(lightning_trainer.precision_plugin) in (Precision, MixedPrecision, ForwardAutocast)
        and not lightning_trainer.callbacks
        and not lightning_trainer.loggers
    )


def _evaluate_in_process(evaluator: Evaluator, run: RunView, dataloader: Any) -> None:
    """What Lightning's ``validate`` does for :func:`evaluates_in_process`'s runs, without its loop: the model on the
    strategy's device and in eval mode (left in it, as transformers' ``evaluation_loop`` leaves it), batches moved to
    the device, each step under inference mode (``no_grad`` with a gloo process group, as Lightning) and the
    precision plugin's validation-step context, SIGTERM stopping the evaluation between batches."""
    trainer = run.lightning_trainer
    strategy, precision = trainer.strategy, trainer.precision_plugin
    device = strategy.root_device
    strategy.accelerator.setup_device(device)
    module = run.module.to(device)
    module.eval()
    gloo = torch.distributed.is_available() and torch.distributed.is_initialized()
    grad_off = torch.no_grad if gloo and torch.distributed.get_backend() == "gloo" else torch.inference_mode
    labels = evaluator.facade.label_names
    with grad_off(), sigterm_stops_between_batches("Evaluation") as stop_if_signalled:
        with run.backend.hf_evaluation_model(module.model, labels) as evaluator.model:
            for batch in dataloader:
                stop_if_signalled()
                if device.type != "cpu":  # on the CPU a batch is where it is used
                    batch = move_data_to_device(batch, device)
                with precision.val_step_context():
                    evaluator.step(batch)


def _evaluate_in_fit(evaluator: Evaluator, run: RunView, dataloader: Any) -> None:
    """Evaluate now, inside a running fit (Lightning has no public trigger for that), under the fit's precision. The
    model stays in eval mode, as transformers' ``evaluation_loop`` leaves it: what follows the evaluation (its log,
    ``on_evaluate``, a checkpoint) sees it so, as with transformers (TRL's trainers log their evaluation metrics by
    it), and the next training step puts it back in train mode."""
    backend, fit_trainer = run.backend, run.lightning_trainer
    model = run.module.model
    model.eval()
    with torch.no_grad(), fit_trainer.precision_plugin.val_step_context():
        with backend.hf_evaluation_model(model, evaluator.facade.label_names) as evaluator.model:
            evaluator.loader = backend.hf_prepare_loader(dataloader, training=False)
            for batch in evaluator.loader:
                evaluator.step(batch)


def _num_examples(facade: TrainerSurface, dataloader: Any) -> int | None:
    return facade.num_examples(dataloader) if loader_length(dataloader) is not None else None


def run_evaluation_loop(
    facade: TrainerSurface,
    run: RunView,
    dataloader: Any,
    description: str,
    prediction_loss_only: bool,
    ignore_keys: list[str] | None,
    metric_key_prefix: str,
    compute_metrics: Any = ...,
) -> EvalLoopOutput:
    """HF's ``evaluation_loop`` in ``run``: inside its running ``fit`` directly (a training run), otherwise as
    Lightning's ``validate`` (a run made for this evaluation).

    ``compute_metrics`` defaults to the facade's; pass ``None`` to collect predictions without scoring them (the
    QA trainer scores after post-processing)."""
    metrics_fn = facade.compute_metrics if compute_metrics is ... else compute_metrics
    args = facade.args
    eval_precision.prepare(args, run, facade.model)
    console.evaluation_started(description, _num_examples(facade, dataloader), args.eval_batch_size)
    batch_rows = run.backend.hf_evaluation_rows(args.eval_batch_size)  # what each batch's loss stands for
    evaluator = Evaluator(
        facade, run.world, description, prediction_loss_only, ignore_keys, metrics_fn, batch_rows=batch_rows
    )
    # a schedule-free optimizer evaluates its averaged parameters; the next training step switches it back
    set_optimizer_mode(facade.optimizer, training=False)
    facade.callback_handler.eval_dataloader = dataloader
    with run.evaluating(evaluator), run.evaluation_weights(), autocast_forward(run.module.model, run.lightning_trainer):
        with eval_precision.int8_evaluation_model(args, facade.model) as evaluator.quantized:
            _run_batches(evaluator, run, dataloader)
    if evaluator.keep_all:  # as transformers after its loop: gather_for_metrics again
        facade.gather_function = facade.accelerator.gather_for_metrics
    dataset = getattr(dataloader, "dataset", None)
    try:
        num_samples = len(dataset) if dataset is not None else None
    except TypeError:
        num_samples = None
    return evaluator.finish(num_samples, metric_key_prefix)


def _run_batches(evaluator: Evaluator, run: RunView, dataloader: Any) -> None:
    """Every batch through ``evaluator.step``: in the running fit, in this process, or through Lightning's
    ``validate``."""
    evaluator.loader = dataloader
    if run.fitting:
        _evaluate_in_fit(evaluator, run, dataloader)
    elif evaluates_in_process(run.lightning_trainer):
        _evaluate_in_process(evaluator, run, dataloader)
    else:
        data = EvaluationData(dataloader)
        with quiet_lightning(), sigterm_exits_non_zero("Evaluation"):
            # sharded once the processes are launched: this call may be the one that launches them
            run.lightning_trainer.validate(run.module, datamodule=data, verbose=False)
        # the loader Lightning iterated: this process's shard, as the strategy processed it (a backend's own)
        iterated = run.lightning_trainer.val_dataloaders
        dealt = data.dealt if data.dealt is not None else dataloader
        evaluator.loader = iterated if iterated is not None and not isinstance(iterated, (list, dict)) else dealt
        run.module.model.eval()  # Lightning restores the modes; transformers leaves the model in eval mode
    evaluator.completed = True


# ---- the bodies of Trainer.evaluate and Trainer.predict ----------------------------------------------------------
def evaluation_speed(args: Any, prefix: str, start_time: float, num_samples: int) -> dict[str, float]:
    """HF's speed metrics of an evaluation (``{prefix}_runtime``, ``_samples_per_second``, ``_steps_per_second``);
    a step is one global batch (``eval_batch_size`` on each of ``args.world_size`` processes)."""
    num_steps = math.ceil(num_samples / (args.eval_batch_size * args.world_size))
    return speed_metrics(prefix, start_time, num_samples=num_samples, num_steps=num_steps)


def evaluate(facade: TrainerSurface, eval_dataset: Any, ignore_keys: list[str] | None, prefix: str) -> dict[str, float]:
    """``Trainer.evaluate``: HF's metrics for ``eval_dataset`` (the facade's by default; a dict of datasets gives
    ``{prefix}_{name}_...`` keys), logged, then ``on_evaluate``. Every step goes through the facade's methods, so a
    subclass's ``get_eval_dataloader``/``evaluation_loop``/``log`` are used."""
    override = eval_dataset is not None
    eval_dataset = eval_dataset if override else facade.eval_dataset
    if isinstance(eval_dataset, dict):
        metrics: dict[str, float] = {}
        for name, dataset in eval_dataset.items():
            metrics.update(facade.evaluate(dataset if override else name, ignore_keys, f"{prefix}_{name}"))
        return metrics
    dataloader = facade.get_eval_dataloader(eval_dataset)
    start_time = time.time()
    output = facade.evaluation_loop(
        dataloader,
        description="Evaluation",
        prediction_loss_only=True if facade.compute_metrics is None else None,
        ignore_keys=ignore_keys,
        metric_key_prefix=prefix,
    )
    output.metrics.update(evaluation_speed(facade.args, prefix, start_time, output.num_samples))
    facade.log(output.metrics)
    dispatch(facade, "on_evaluate", output.metrics)
    return output.metrics


def predict(facade: TrainerSurface, test_dataset: Any, ignore_keys: list[str] | None, prefix: str) -> PredictionOutput:
    """``Trainer.predict``: predictions (and metrics, when the data has labels) for ``test_dataset``, then
    ``on_predict``."""
    dataloader = facade.get_test_dataloader(test_dataset)
    start_time = time.time()
    output = facade.evaluation_loop(
        dataloader, description="Prediction", ignore_keys=ignore_keys, metric_key_prefix=prefix
    )
    output.metrics.update(evaluation_speed(facade.args, prefix, start_time, output.num_samples))
    dispatch(facade, "on_predict", output.metrics)
    return PredictionOutput(predictions=output.predictions, label_ids=output.label_ids, metrics=output.metrics)


def evaluate_in_training(
    facade: TrainerSurface, trial: Any, ignore_keys: list[str] | None, skip_scheduler: bool = False
) -> dict[str, float]:
    """The body of ``Trainer._evaluate``: evaluate, report the objective to a hyperparameter search, and step a
    schedule that steps on a metric (``ReduceLROnPlateau``, ``GreedyLR``) on ``metric_for_best_model`` (unless
    ``skip_scheduler``)."""
    metrics = facade.evaluate(ignore_keys=ignore_keys)
    facade._report_to_hp_search(trial, facade.state.global_step, metrics)
    if steps_on_metrics(facade.lr_scheduler) and not skip_scheduler:
        facade.lr_scheduler.step(metrics[best_metric_key(facade.args.metric_for_best_model, metrics)])
    return metrics


def prefixed(metrics: dict[str, Any], prefix: str) -> dict[str, Any]:
    """``metrics`` with every key that lacks it given ``{prefix}_`` (in place, as transformers renames them)."""
    for key in list(metrics):
        if not key.startswith(f"{prefix}_"):
            metrics[f"{prefix}_{key}"] = metrics.pop(key)
    return metrics


def best_metric_key(name: str, metrics: dict[str, float]) -> str:
    """The key of ``metric_for_best_model`` (``name``, ``eval_``-prefixed as transformers does) in ``metrics``; a
    KeyError listing the metrics there are when it is not among them."""
    key = name if name.startswith("eval_") else f"eval_{name}"
    if key not in metrics:
        raise KeyError(
            f"The `metric_for_best_model` training argument is set to '{key}', which is not found in the evaluation "
            f"metrics. The available evaluation metrics are: {list(metrics.keys())}. Consider changing the "
            "`metric_for_best_model` via the TrainingArguments."
        )
    return key


def update_best_metric(args: Any, state: TrainerState, metrics: dict[str, float]) -> bool:
    """HF's ``_determine_best_metric``: track the best value and its step; True if this evaluation is the best."""
    if args.metric_for_best_model is None:
        return False
    value = metrics[best_metric_key(args.metric_for_best_model, metrics)]
    better = np.greater if args.greater_is_better else np.less
    if state.best_metric is None:
        state.best_metric = float("-inf") if args.greater_is_better else float("inf")
    if better(value, state.best_metric):
        state.best_metric = value
        if args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST):
            state.best_global_step = state.global_step
        return True
    return False
