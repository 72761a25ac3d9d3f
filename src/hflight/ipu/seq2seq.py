"""``IPUSeq2SeqTrainer`` and ``IPUSeq2SeqTrainingArguments``: optimum-graphcore's sequence-to-sequence trainer.

As optimum-graphcore documents it, the trainer behaves exactly as ``IPUTrainer`` (same constructor: ``ipu_config``,
``eval_data_collator``, ``tokenizer``, ...) with ``IPUSeq2SeqTrainingArguments`` (the IPU fields plus
``predict_with_generate``, ``generation_max_length``, ``generation_num_beams``, ``generation_config``,
``sortish_sampler``), and ``evaluate``/``predict`` take ``**gen_kwargs``. Evaluation and prediction are
``hflight.Seq2SeqTrainer``'s: the loss comes from the inference executable; with ``predict_with_generate`` the
tokens are generated as optimum-graphcore generates them without KV cache: transformers' ``generate`` drives the
search (generation config precedence, beams, EOS, ``max_length``/``max_new_tokens``) and every forward pass runs on
a ``poptorch.inferenceModel`` sharing the trained weights: the encoder once per batch, one decoder step per token,
its input padded to the generation's ``max_length`` so that one executable, compiled once per static shape, serves
every step (:mod:`hflight.ipu.generation`). optimum-graphcore's other generation options
(``inference_parallelize_kwargs``: KV cache, encoder output buffers, on-device generation; ``generate(use_cache=True)``)
raise, naming themselves. Verified against the poptorch stand-in in ``tests/ipu``, never on IPU hardware (see
docs/backends.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hflight.arguments.seq2seq_args import Seq2SeqTrainingArguments
from hflight.ipu.config import IPUConfig
from hflight.ipu.trainer import IPUTrainer, IPUTrainingArguments
from hflight.trainer.seq2seq import Seq2SeqTrainer

__all__ = ["IPUSeq2SeqTrainer", "IPUSeq2SeqTrainingArguments"]


@dataclass
class IPUSeq2SeqTrainingArguments(IPUTrainingArguments, Seq2SeqTrainingArguments):
    """``IPUTrainingArguments`` with transformers' Seq2Seq fields (``sortish_sampler``, ``predict_with_generate``,
    ``generation_max_length``, ``generation_num_beams``, ``generation_config``)."""


class IPUSeq2SeqTrainer(IPUTrainer, Seq2SeqTrainer):
    """optimum-graphcore's ``IPUSeq2SeqTrainer``: ``IPUTrainer`` with ``Seq2SeqTrainer``'s generation."""

    arguments_class: type = IPUSeq2SeqTrainingArguments

    def __init__(
        self,
        model: nn.Module | None = None,
        ipu_config: IPUConfig | None = None,
        args: IPUSeq2SeqTrainingArguments | None = None,
        data_collator: Callable | None = None,
        eval_data_collator: Callable | None = None,
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
            ipu_config=ipu_config,
            args=IPUSeq2SeqTrainingArguments.from_args(args, "IPUSeq2SeqTrainer"),
            data_collator=data_collator,
            eval_data_collator=eval_data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            tokenizer=tokenizer,
            model_init=model_init,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )

    def evaluate(
        self,
        eval_dataset: Any = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
        **gen_kwargs,
    ) -> dict[str, float]:
        if self.args.compile_only:
            return IPUTrainer.evaluate(self, eval_dataset, ignore_keys, metric_key_prefix)
        return Seq2SeqTrainer.evaluate(self, eval_dataset, ignore_keys, metric_key_prefix, **gen_kwargs)

    def _generation_model(self) -> nn.Module:
        # the encoder and each decoder step run on IPU inference executables; transformers' generate drives them
        return self.ipu_strategy.generation_model(self.model)
