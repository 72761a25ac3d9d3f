"""``ORTSeq2SeqTrainer`` at the module path optimum's imports use (``optimum.onnxruntime.trainer_seq2seq`` becomes
``hflight.ort.trainer_seq2seq``): ``ORTTrainer`` (ORTModule training where onnxruntime-training is installed, ONNX
Runtime evaluation checked against PyTorch) with ``Seq2SeqTrainer``'s generation.

With ``predict_with_generate``, evaluation and prediction generate with ``model.generate`` in PyTorch, and the loss
comes from the PyTorch model, as in optimum's ``ORTSeq2SeqTrainer``. Generation through ONNX Runtime is not built:
``evaluate``/``predict(inference_with_ort=True)`` with ``predict_with_generate`` raise ``NotImplementedError``, as
optimum's did (see also ``ORTSeq2SeqTrainingArguments.ort_inference``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.trainer_utils import PredictionOutput

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

    def _check_generation_backend(self, inference_with_ort: bool | None) -> None:
        if inference_with_ort and self.args.predict_with_generate:
            raise NotImplementedError(
                "ORTSeq2SeqTrainer: generation through ONNX Runtime is not available (predict_with_generate "
                "generates in PyTorch). Remove `inference_with_ort` or `predict_with_generate`."
            )

    def evaluate(
        self,
        eval_dataset: Any = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
        inference_with_ort: bool | None = None,
        **gen_kwargs: Any,
    ) -> dict[str, float]:
        """``Seq2SeqTrainer.evaluate``; ``inference_with_ort`` as for ``ORTTrainer`` (not with generation)."""
        self._check_generation_backend(inference_with_ort)
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
        self._check_generation_backend(inference_with_ort)
        with self._inference_backend(inference_with_ort, "Predicting"):
            return Seq2SeqTrainer.predict(self, test_dataset, ignore_keys, metric_key_prefix, **gen_kwargs)
