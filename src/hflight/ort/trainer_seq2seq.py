"""``ORTSeq2SeqTrainer`` at the module path optimum's imports use (``optimum.onnxruntime.trainer_seq2seq`` becomes
``hflight.ort.trainer_seq2seq``): ``ORTTrainer`` (ORTModule training where onnxruntime-training is installed, ONNX
Runtime evaluation checked against PyTorch) with ``Seq2SeqTrainer``'s generation.

With ``predict_with_generate``, evaluation and prediction generate with transformers' ``generate``:

- in PyTorch (``model.generate``) when evaluating eagerly: ``ORTSeq2SeqTrainingArguments``' default with
  ``predict_with_generate`` (as optimum's ``ORTSeq2SeqTrainer`` did), ``ort_inference=False`` or
  ``inference_with_ort=False``;
- through ONNX Runtime with ``ort_inference=True`` or ``evaluate``/``predict(inference_with_ort=True)``: the encoder
  and the decoder (with and without past key values) are exported and run as sessions under transformers' own
  ``generate``, and the tokens are compared with eager generation on the batches the check covers
  (``hflight.ort.generation``); the loss of labelled batches comes from the exported model's logits
  (``hflight.ort.session``), checked against the model's own loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.trainer_utils import PredictionOutput

from hflight.ort.generation import ORTSeq2SeqGenerator
from hflight.ort.trainer import ORTTrainer
from hflight.ort.training_args_seq2seq import ORTSeq2SeqTrainingArguments
from hflight.trainer.seq2seq import Seq2SeqTrainer

__all__ = ["ORTSeq2SeqTrainer", "ORTSeq2SeqTrainingArguments"]


class ORTSeq2SeqTrainer(ORTTrainer, Seq2SeqTrainer):
    """optimum's ``ORTSeq2SeqTrainer``: ``ORTTrainer``'s constructor and training, ``Seq2SeqTrainer``'s evaluation."""

    arguments_class: type = ORTSeq2SeqTrainingArguments

    def __init__(
        self,
        model: nn.Module | None = None,
        args: ORTSeq2SeqTrainingArguments | None = None,
        data_collator: Callable | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        tokenizer: Any = None,
        model_init: Callable[..., nn.Module] | None = None,
        compute_metrics: Callable[[Any], dict] | None = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, Any] = (None, None),
        preprocess_logits_for_metrics: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__(
            model=model,
            args=ORTSeq2SeqTrainingArguments.from_args(args, "ORTSeq2SeqTrainer"),
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            tokenizer=tokenizer,
            model_init=model_init,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )

    def _generation_model(self) -> nn.Module | ORTSeq2SeqGenerator:
        """Evaluating through ONNX Runtime: the ORT strategy's generator (encoder and decoder sessions under
        transformers' ``generate``, checked against eager generation); else the model (``generate`` in PyTorch)."""
        if not self.ort_strategy.inference:
            return super()._generation_model()
        return self.ort_strategy.generator(self.model)

    def evaluate(
        self,
        eval_dataset: Any = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
        inference_with_ort: bool | None = None,
        **gen_kwargs: Any,
    ) -> dict[str, float]:
        """``Seq2SeqTrainer.evaluate``; ``inference_with_ort`` as for ``ORTTrainer`` (True with
        ``predict_with_generate``: generation through ONNX Runtime too)."""
        with self._inference_backend(inference_with_ort, "Evaluating"):
            return Seq2SeqTrainer.evaluate(self, eval_dataset, ignore_keys, metric_key_prefix, **gen_kwargs)

    def predict(
        self,
        test_dataset: Any,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "test",
        inference_with_ort: bool | None = None,
        **gen_kwargs: Any,
    ) -> PredictionOutput:
        """``Seq2SeqTrainer.predict``; ``inference_with_ort`` as for :meth:`evaluate`."""
        with self._inference_backend(inference_with_ort, "Predicting"):
            return Seq2SeqTrainer.predict(self, test_dataset, ignore_keys, metric_key_prefix, **gen_kwargs)
