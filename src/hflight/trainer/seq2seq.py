"""``hflight.Seq2SeqTrainer``: transformers' ``Seq2SeqTrainer`` (summarization, translation, generative QA) on
hflight's Trainer.

With ``args.predict_with_generate`` every evaluation and prediction batch is generated with ``model.generate``
under transformers' rules: generation settings come from the ``**gen_kwargs`` of ``evaluate``/``predict`` (``None``
values dropped), else ``generation_max_length``/``generation_num_beams`` of the arguments, else the model's
``generation_config`` (which ``args.generation_config`` replaces at construction), else ``GenerationConfig``'s
defaults. Generated tokens and labels shorter than the generation config's ``max_length`` (or ``max_new_tokens + 1``)
are padded to it with the tokenizer's pad token (its EOS token without one, else the model config's pad token);
batches of different lengths are joined, within a process and across processes, padded with -100, in dataset order,
as in transformers' evaluation loop (``hflight.evaluation``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset
from transformers import Seq2SeqTrainer as HFSeq2SeqTrainer
from transformers.distributed.fsdp import is_fsdp_managed_module
from transformers.generation.configuration_utils import GenerationConfig
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
from transformers.trainer_utils import PredictionOutput

from hflight.arguments.seq2seq_args import Seq2SeqTrainingArguments, seq2seq_args
from hflight.trainer.facade import Trainer

__all__ = ["Seq2SeqTrainer", "generation_kwargs", "pad_to_length"]


def generation_kwargs(args: Any, gen_kwargs: dict[str, Any]) -> dict[str, Any]:
    """What ``evaluate``/``predict`` hand to generation: ``gen_kwargs``, with the arguments'
    ``generation_max_length`` when neither ``max_length`` nor ``max_new_tokens`` is given, and
    ``generation_num_beams`` when ``num_beams`` is not."""
    gen_kwargs = dict(gen_kwargs)
    max_length = getattr(args, "generation_max_length", None)
    if gen_kwargs.get("max_length") is None and gen_kwargs.get("max_new_tokens") is None and max_length is not None:
        gen_kwargs["max_length"] = max_length
    num_beams = getattr(args, "generation_num_beams", None)
    if gen_kwargs.get("num_beams") is None and num_beams is not None:
        gen_kwargs["num_beams"] = num_beams
    return gen_kwargs


def pad_to_length(tensor: torch.Tensor, length: int, pad_token_id: int) -> torch.Tensor:
    """``tensor`` (batch, seq) right-padded with ``pad_token_id`` to ``length`` columns."""
    padded = torch.full((tensor.shape[0], length), pad_token_id, dtype=tensor.dtype, device=tensor.device)
    padded[:, : tensor.shape[-1]] = tensor
    return padded


def _generation_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    """The batch without the decoder inputs the collator made from the labels (generation starts from scratch)."""
    labels, decoder_ids = inputs.get("labels"), inputs.get("decoder_input_ids")
    if labels is not None and decoder_ids is not None and labels.shape == decoder_ids.shape:
        return {k: v for k, v in inputs.items() if k not in ("decoder_input_ids", "decoder_attention_mask")}
    return dict(inputs)


def _target_length(gen_config: GenerationConfig, length: int) -> int | None:
    """The length a generated (or label) tensor of ``length`` columns is padded to, or None to keep it."""
    if length < gen_config.max_length:
        return gen_config.max_length
    if gen_config.max_new_tokens is not None and length < gen_config.max_new_tokens + 1:
        return gen_config.max_new_tokens + 1
    return None


class Seq2SeqTrainer(Trainer):
    """transformers' ``Seq2SeqTrainer`` on Lightning: hflight's ``Trainer`` plus generation in evaluation and
    prediction (``args.predict_with_generate``) and ``evaluate``/``predict`` taking ``**gen_kwargs``.

    ``args`` may be hflight's or transformers' ``Seq2SeqTrainingArguments`` (or any ``TrainingArguments``, whose
    Seq2Seq fields then take their defaults); the trainer keeps them as hflight's ``Seq2SeqTrainingArguments``.

    Example:
        >>> from hflight import Seq2SeqTrainer, Seq2SeqTrainingArguments  # doctest: +SKIP
        >>> args = Seq2SeqTrainingArguments("out", predict_with_generate=True)  # doctest: +SKIP
        >>> Seq2SeqTrainer(model, args, eval_dataset=ds, processing_class=tok).evaluate(num_beams=4)  # doctest: +SKIP
    """

    #: The arguments class the trainer converts other arguments to (the IPU trainer sets its own).
    arguments_class: type = Seq2SeqTrainingArguments

    def __init__(
        self,
        model: nn.Module | None = None,
        args: Seq2SeqTrainingArguments | None = None,
        data_collator: Callable | None = None,
        train_dataset: Any = None,
        eval_dataset: Dataset | dict[str, Dataset] | None = None,
        processing_class: Any = None,
        model_init: Callable[..., nn.Module] | None = None,
        compute_loss_func: Callable | None = None,
        compute_metrics: Callable[[Any], dict] | None = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, Any] = (None, None),
        preprocess_logits_for_metrics: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        *,
        tokenizer: Any = None,
    ) -> None:
        super().__init__(
            model=model,
            args=seq2seq_args(args, type(self).__name__, self.arguments_class),
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            model_init=model_init,
            compute_loss_func=compute_loss_func,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            tokenizer=tokenizer,
        )
        # args.generation_config, when given, replaces the model's (as in transformers).
        if self.args.generation_config is not None:
            self.model.generation_config = self.load_generation_config(self.args.generation_config)

    @staticmethod
    def load_generation_config(gen_config_arg: str | GenerationConfig) -> GenerationConfig:
        """A copy of ``gen_config_arg``, or the ``GenerationConfig`` a file, folder or model id names, validated
        strictly (transformers' errors, with its hint)."""
        return HFSeq2SeqTrainer.load_generation_config(gen_config_arg)

    def evaluate(
        self,
        eval_dataset: Dataset | dict[str, Dataset] | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
        **gen_kwargs: Any,
    ) -> dict[str, float]:
        """``Trainer.evaluate``; ``gen_kwargs`` (``max_length``, ``num_beams``, any ``generate`` argument) apply to
        the generation of this evaluation (see :func:`generation_kwargs`)."""
        self._gen_kwargs = generation_kwargs(self.args, gen_kwargs)
        self.gather_function = self.accelerator.gather  # transformers: no sample dropped (see hflight.evaluation)
        return super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    def predict(
        self,
        test_dataset: Dataset,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "test",
        **gen_kwargs: Any,
    ) -> PredictionOutput:
        """``Trainer.predict``; ``gen_kwargs`` as for :meth:`evaluate`. Generated predictions of different lengths
        are padded with -100."""
        self._gen_kwargs = generation_kwargs(self.args, gen_kwargs)
        self.gather_function = self.accelerator.gather
        return super().predict(test_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
        **gen_kwargs: Any,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """(loss, generated tokens, labels) with ``predict_with_generate``; otherwise ``Trainer.prediction_step``."""
        if not self.args.predict_with_generate or prediction_loss_only:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        has_labels = "labels" in inputs
        inputs = self._prepare_inputs(inputs)
        generated = self._generate_tokens(inputs, gen_kwargs)
        gen_config = self.model.generation_config
        target = _target_length(gen_config, generated.shape[-1])
        if target is not None:
            generated = self._pad_tensors_to_max_len(generated, target)
        loss = self._generation_loss(model, inputs) if has_labels else None
        if self.args.prediction_loss_only:
            return loss, None, None
        labels = inputs["labels"] if has_labels else None
        if labels is not None and (target := _target_length(gen_config, labels.shape[-1])) is not None:
            labels = self._pad_tensors_to_max_len(labels, target)
        return loss, generated, labels

    def _generate_tokens(self, inputs: dict[str, Any], gen_kwargs: dict[str, Any]) -> torch.Tensor:
        """``self.model.generate`` on one prepared batch: ``gen_kwargs`` if any, else those of the ``evaluate``/
        ``predict`` call (None values dropped); afterwards the model's generation config holds
        ``GenerationConfig``'s defaults for the settings it left unset (as in transformers)."""
        gen_kwargs = dict(gen_kwargs) if gen_kwargs else dict(getattr(self, "_gen_kwargs", {}))
        for name in ("num_beams", "max_length"):
            if name in gen_kwargs and gen_kwargs[name] is None:
                gen_kwargs.pop(name)
        gen_kwargs.setdefault("synced_gpus", is_deepspeed_zero3_enabled() or is_fsdp_managed_module(self.model))
        with self._generation_context():
            generated = self._generation_model().generate(**_generation_inputs(inputs), **gen_kwargs)
        gen_config = self.model.generation_config
        if gen_config._from_model_config:  # transformers: built from the model config once, not per batch
            gen_config._from_model_config = False
        gen_config.update(**gen_config._get_default_generation_params(), defaults_only=True)
        return generated

    def _generation_model(self) -> nn.Module:
        """The model whose ``generate`` runs: ``self.model`` (a backend's trainer may return one that runs its
        forward passes on the backend's device, sharing ``self.model``'s weights and generation config)."""
        return self.model

    def _generation_context(self) -> contextlib.AbstractContextManager:
        """FSDP-wrapped models generate with their full parameters (``summon_full_params``), as in transformers."""
        if torch.distributed.is_available():
            from torch.distributed.fsdp import FullyShardedDataParallel

            if isinstance(self.model, FullyShardedDataParallel):
                return FullyShardedDataParallel.summon_full_params(self.model)
        return contextlib.nullcontext()

    def _generation_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """The loss of a batch with labels, from the model's forward (label smoothing when configured)."""
        with torch.no_grad():
            with self.compute_loss_context_manager():
                outputs = model(**inputs)
            if self.label_smoother is not None:
                return self.label_smoother(outputs, inputs["labels"]).detach().mean()
            return (outputs["loss"] if isinstance(outputs, dict) else outputs[0]).detach().mean()

    def _pad_tensors_to_max_len(self, tensor: torch.Tensor, max_length: int) -> torch.Tensor:
        """transformers' padding of generated tokens and labels: the tokenizer's pad token (its EOS token when it has
        no pad token), else the model config's ``pad_token_id``."""
        tokenizer = self.processing_class
        if tokenizer is not None and hasattr(tokenizer, "pad_token_id"):
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        elif getattr(self.model.config, "pad_token_id", None) is not None:
            pad = self.model.config.pad_token_id
        else:
            raise ValueError("Pad_token_id must be set in the configuration of the model, in order to pad tensors")
        return pad_to_length(tensor, max_length, pad)
