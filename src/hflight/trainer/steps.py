"""The per-batch work of transformers' Trainer, with its semantics: loss, training step, prediction step.

These are the bodies behind ``Trainer.compute_loss``, ``Trainer.training_step`` and ``Trainer.prediction_step``.
They stay on the facade as methods (subclasses such as PrimeQA's and HF's QA trainers override them); the
LightningModule calls those methods, never these functions directly.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.trainer_pt_utils import nested_detach
from transformers.trainer_utils import unwrap_peft_model

from hflight._util import model_tp_size
from hflight.arguments.optimizers import passes_learning_rate, set_optimizer_mode
from hflight.run.datamodule import loader_length
from hflight.run.plan import plan_training
from hflight.surface import TrainerSurface
from hflight.trainer import memory

logger = logging.getLogger(__name__)


def compute_loss(
    trainer: TrainerSurface,
    model: nn.Module,
    inputs: dict[str, Any],
    return_outputs: bool = False,
    num_items_in_batch: torch.Tensor | int | None = None,
    world_size: int = 1,
) -> torch.Tensor | tuple[torch.Tensor, Any]:
    """The model's own loss, or ``compute_loss_func``/label smoothing when configured (HF's rules); ``world_size``:
    the number of processes (the loss is scaled back up by it when label items are averaged across them)."""
    inputs = dict(inputs)
    labels = None
    if (trainer.label_smoother is not None or trainer.compute_loss_func is not None) and "labels" in inputs:
        labels = inputs.pop("labels")
    if trainer.model_accepts_loss_kwargs and num_items_in_batch is not None:
        inputs["num_items_in_batch"] = num_items_in_batch
    outputs = model(**inputs)

    if trainer.compute_loss_func is not None:
        loss = trainer.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
    elif labels is not None:
        shift = _model_name(trainer.accelerator.unwrap_model(model)) in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
        loss = trainer.label_smoother(outputs, labels, shift_labels=shift, num_items_in_batch=num_items_in_batch)
    else:
        if isinstance(outputs, dict) and "loss" not in outputs:
            raise ValueError(
                "The model did not return a loss from the inputs, only the following keys: "
                f"{','.join(outputs.keys())}. For reference, the inputs it received are {','.join(inputs.keys())}. "
                f"Make sure the batches carry the label columns the model needs ({', '.join(trainer.label_names)}) "
                "or pass a compute_loss_func."
            )
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
        if loss is None:
            raise ValueError(
                f"{type(model).__name__} returned loss=None: the batch has no labels "
                f"(expected {', '.join(trainer.label_names) or 'labels'}). Check label_names and the dataset columns."
            )

    if (
        trainer.args.average_tokens_across_devices
        and (trainer.model_accepts_loss_kwargs or trainer.compute_loss_func is not None)
        and num_items_in_batch is not None
    ):
        # num_items_in_batch was summed over all ranks; DDP averages gradients, so scale back up.
        loss = loss * world_size
    return (loss, outputs) if return_outputs else loss


def _model_name(model: nn.Module) -> str:
    """The model class name transformers matches against the causal-LM names (a PEFT model's base model's)."""
    return unwrap_peft_model(model)._get_name()


def training_step(
    trainer: TrainerSurface,
    model: nn.Module,
    inputs: dict[str, Any],
    num_items_in_batch: torch.Tensor | int | None,
    backward: Callable[..., None],
) -> torch.Tensor:
    """Forward, loss scaled for gradient accumulation as HF scales it, ``backward`` (Lightning's, which applies the
    precision plugin's scaling and the strategy's hooks)."""
    model.train()
    set_optimizer_mode(trainer.optimizer, training=True)  # a schedule-free optimizer trains its own sequence
    inputs = trainer._prepare_inputs(inputs)  # an override point at transformers' moment (Lightning moved the batch)
    with trainer.compute_loss_context_manager():  # transformers' override point, around the forward and the loss
        loss = trainer.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
    # "lomo"/"adalomo": the learning rate goes with the loss, for LOMO's fused backward (accelerate's, in transformers)
    kwargs = {"learning_rate": trainer._get_learning_rate()} if passes_learning_rate(trainer.args) else {}
    every = trainer.args.torch_empty_cache_steps
    if every is not None and trainer.state.global_step % every == 0:
        memory.empty_device_cache()
    if loss.dim() > 0:  # one loss per replica or device micro-batch (DataParallel, IPU output_mode="all")
        loss = loss.mean()
    if trainer.loss_is_scaled_for_ga is not None:
        already_scaled = trainer.loss_is_scaled_for_ga
    else:
        already_scaled = (
            trainer.model_accepts_loss_kwargs and num_items_in_batch is not None
        ) or trainer.compute_loss_func is not None
    if not already_scaled:
        loss = loss / trainer.current_gradient_accumulation_steps
    backward(loss, **kwargs)
    return loss.detach()


def prediction_step(
    trainer: TrainerSurface,
    model: nn.Module,
    inputs: dict[str, Any],
    prediction_loss_only: bool,
    ignore_keys: list[str] | None = None,
) -> tuple[torch.Tensor | None, Any, Any]:
    """(loss, logits, labels) of one evaluation batch, each optional, as HF returns them."""
    label_names = trainer.label_names
    has_labels = bool(label_names) and all(inputs.get(k) is not None for k in label_names)
    return_loss = inputs.get("return_loss")
    if return_loss is None:
        return_loss = trainer.can_return_loss
    loss_without_labels = not label_names and return_loss

    inputs = trainer._prepare_inputs(inputs)
    if ignore_keys is None:
        config = getattr(trainer.model, "config", None)
        ignore_keys = getattr(config, "keys_to_ignore_at_inference", ["past_key_values"]) if config else []

    labels = None
    if has_labels or loss_without_labels:
        labels = nested_detach(tuple(inputs.get(name) for name in label_names))
        labels = labels[0] if len(labels) == 1 else labels

    with torch.no_grad():
        if has_labels or loss_without_labels:
            num_items = trainer._get_num_items_in_batch([inputs], None)
            if trainer.args.use_liger_kernel and prediction_loss_only:  # Liger's loss without the logits
                inputs = {**inputs, "skip_logits": True}
            with trainer.compute_loss_context_manager():
                loss, outputs = trainer.compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items)
            loss = loss.detach().mean()
            if isinstance(outputs, dict):
                logits = tuple(v for k, v in outputs.items() if k not in [*ignore_keys, "loss"])
            else:
                logits = outputs[1:]
        else:
            loss = None
            with trainer.compute_loss_context_manager():
                outputs = model(**inputs)
            if isinstance(outputs, dict):
                logits = tuple(v for k, v in outputs.items() if k not in ignore_keys)
            else:
                logits = outputs

    if prediction_loss_only:
        return loss, None, None
    logits = nested_detach(logits)
    if len(logits) == 1:
        logits = logits[0]
    return loss, logits, labels


def count_items_in_cycle(
    trainer: TrainerSurface, batches: list[Any], backend: Any, world: Any, shifts_labels: bool = False
) -> torch.Tensor | None:
    """Label items (``labels != -100``) over an accumulation cycle, when the loss normalises by them (HF); summed
    over the processes of ``world`` with ``average_tokens_across_devices``. ``backend``: the running strategy's
    hooks (a backend that accumulates on its device does not normalise by host counts). ``shifts_labels``: the model's
    loss is a causal-LM loss, whose targets are ``labels[..., 1:]`` (transformers counts those, or the collator's
    ``shift_labels`` when a batch carries them)."""
    if not batches or "labels" not in batches[0]:
        return None
    if not (trainer.model_accepts_loss_kwargs or trainer.compute_loss_func is not None):
        return None
    if not backend.hf_counts_loss_items:
        return None
    try:
        count = sum(_counted_labels(batch, shifts_labels).ne(-100).sum() for batch in batches)
    except (TypeError, AttributeError):
        return None
    if trainer.args.average_tokens_across_devices and world.size > 1:
        count = world.reduce_sum(count.float())
    return count


def _counted_labels(batch: Any, shifts_labels: bool) -> torch.Tensor:
    if "shift_labels" in batch:
        return batch["shift_labels"]
    return batch["labels"][..., 1:] if shifts_labels else batch["labels"]


def flos_of_every_process(flos: float, world: Any, device: torch.device) -> float:
    """``store_flos``: the operations this process counted since the last call, summed over the processes when
    several train together (as transformers gathers them: float32 values, summed; every process, a tensor-parallel
    group's each counted, as transformers' ``distributed_broadcast_scalars``)."""
    if world.size <= 1:
        return flos
    return world.every_process(torch.tensor([flos], dtype=torch.float32, device=device)).sum().item()


def floating_point_ops(model: nn.Module, inputs: dict[str, Any], num_params: int) -> int:
    """transformers' estimate of a batch's training FLOPs: 6 x tokens x parameters (embeddings excluded)."""
    main_input = getattr(model, "main_input_name", "input_ids")
    if main_input in inputs and num_params:
        return 6 * inputs[main_input].numel() * num_params
    return 0


def initial_training_values(
    trainer: TrainerSurface, args: Any, dataloader: Any, backend: Any, batch_size: int
) -> tuple[int, int, int, int, int, int | None, int]:
    """The body of ``Trainer.set_initial_training_values``: transformers' run arithmetic (num_train_epochs,
    num_update_steps_per_epoch, num_examples, num_train_samples, total_train_batch_size, steps_in_epoch, max_steps)
    for ``dataloader``, planned as the run plans it: with the running ``backend``'s step geometry and the per-device
    ``batch_size`` of the run (what ``auto_find_batch_size`` settled on)."""
    length = loader_length(dataloader)
    num_examples = trainer.num_examples(dataloader) if length else None
    replicas = args.world_size // trainer.get_tp_size()  # the ranks of a tensor-parallel group share their batches
    geometry = backend.hf_geometry(args, replicas, batch_size)
    plan = plan_training(args, length, num_examples, replicas, geometry)
    return (
        plan.num_train_epochs,
        plan.num_update_steps_per_epoch,
        plan.num_examples,
        plan.num_train_samples,
        plan.total_train_batch_size,
        plan.steps_in_epoch,
        plan.max_steps,
    )


class StepsMixin:
    """transformers' per-batch ``Trainer`` methods (``compute_loss``, ``training_step``, ``prediction_step``) and
    step-level utilities, over the facade's public surface: the backward pass, the device and the number of processes
    come from ``self.accelerator`` (the run's), as in transformers.

    ``get_batch_samples`` is what the training loop calls once per accumulation cycle (``hflight.run.datamodule``), so a
    subclass's override takes effect there as in transformers. Mixed precision autocasts the model's forward only, as
    accelerate's (``hflight.run.autocast``), so, as in transformers, the autocast context managers are empty.
    Model, tensor, context and sequence parallelism are not hflight's (Lightning's FSDP/DeepSpeed strategies shard
    data-parallel replicas), so their sizes are 1.
    """

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        replicas = self.accelerator.num_processes // self.get_tp_size()  # transformers' scale under tensor parallelism
        return compute_loss(self, model, inputs, return_outputs, num_items_in_batch, replicas)

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        return training_step(self, model, inputs, num_items_in_batch, self.accelerator.backward)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        return prediction_step(self, model, inputs, prediction_loss_only, ignore_keys)

    def compute_loss_context_manager(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        autocast = self.autocast_smart_context_manager()
        if not isinstance(autocast, contextlib.nullcontext):
            stack.enter_context(autocast)
        return stack

    def autocast_smart_context_manager(self, cache_enabled: bool | None = True) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def get_batch_samples(
        self, epoch_iterator: Iterator, num_batches: int, device: torch.device | None
    ) -> tuple[list, torch.Tensor | int | None]:
        """Up to ``num_batches`` batches from ``epoch_iterator`` and the label items they hold (the loss normaliser,
        from ``_get_num_items_in_batch``)."""
        batch_samples = []
        for _ in range(num_batches):
            try:
                batch_samples.append(next(epoch_iterator))
            except StopIteration:
                break
        return batch_samples, self._get_num_items_in_batch(batch_samples, device)

    def get_tp_size(self) -> int:
        """The model's tensor-parallel size (transformers' ``_tp_size``, set by ``from_pretrained(tp_plan=...)``)."""
        return model_tp_size(self.model)

    def get_cp_size(self) -> int:
        return 1

    def get_sp_size(self) -> int:
        return 1

    def get_total_train_batch_size(self, args: Any) -> int:
        """Samples per optimizer step: batch x accumulation x data-parallel processes."""
        data_parallel = args.world_size // self.get_tp_size() // self.get_cp_size() // self.get_sp_size()
        return args.train_batch_size * args.gradient_accumulation_steps * data_parallel

    @staticmethod
    def num_tokens(train_dl: Any, max_steps: int | None = None) -> int:
        """Tokens (``input_ids`` elements) in ``train_dl``; with ``max_steps``, the first batch's tokens times it."""
        tokens = 0
        try:
            for batch in train_dl:
                count = batch["input_ids"].numel()
                if max_steps is not None:
                    return count * max_steps
                tokens += count
        except KeyError:
            logger.warning("Cannot get num_tokens from dataloader")
        return tokens
