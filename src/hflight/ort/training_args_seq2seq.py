"""``ORTSeq2SeqTrainingArguments`` at the module path optimum's imports use (``optimum.onnxruntime.
training_args_seq2seq`` becomes ``hflight.ort.training_args_seq2seq``): ``ORTTrainingArguments`` plus transformers'
Seq2Seq fields (``sortish_sampler``, ``predict_with_generate``, ``generation_max_length``, ``generation_num_beams``,
``generation_config``).

Generation runs in PyTorch (as in optimum's ``ORTSeq2SeqTrainer``): hflight has no ONNX Runtime generation
(encoder/decoder sessions). So ``ort_inference`` defaults to None, meaning ONNX Runtime evaluation unless
``predict_with_generate`` is set; asking for both ``ort_inference=True`` and ``predict_with_generate=True`` is an
error that names them, rather than a silent PyTorch evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hflight.arguments.seq2seq_args import Seq2SeqTrainingArguments
from hflight.ort.training_args import ORTTrainingArguments

__all__ = ["ORTSeq2SeqTrainingArguments"]

# ruff: noqa: UP045 - dataclass field types stay parser-friendly (HfArgumentParser, OmegaConf)


@dataclass
class ORTSeq2SeqTrainingArguments(ORTTrainingArguments, Seq2SeqTrainingArguments):
    """``ORTTrainingArguments`` with transformers' Seq2Seq fields; ``ort_inference=None`` (the default) evaluates
    through ONNX Runtime unless ``predict_with_generate`` (generation runs in PyTorch)."""

    ort_inference: Optional[bool] = field(
        default=None,
        metadata={
            "help": "Evaluate and predict through ONNX Runtime. None: yes, unless predict_with_generate (generation "
            "runs in PyTorch; ONNX Runtime generation is not available)."
        },
    )

    def __post_init__(self) -> None:
        if self.ort_inference is None:
            self.ort_inference = not self.predict_with_generate
        elif self.ort_inference and self.predict_with_generate:
            raise ValueError(
                "ORTSeq2SeqTrainingArguments: ort_inference=True with predict_with_generate=True asks for generation "
                "through ONNX Runtime, which hflight does not have (generation runs in PyTorch): leave ort_inference "
                "unset or set it to False."
            )
        super().__post_init__()
