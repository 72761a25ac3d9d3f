"""``ORTSeq2SeqTrainingArguments`` at the module path optimum's imports use (``optimum.onnxruntime.
training_args_seq2seq`` becomes ``hflight.ort.training_args_seq2seq``): ``ORTTrainingArguments`` plus transformers'
Seq2Seq fields (``sortish_sampler``, ``predict_with_generate``, ``generation_max_length``, ``generation_num_beams``,
``generation_config``).

``ort_inference`` defaults to None: ONNX Runtime evaluation unless ``predict_with_generate`` is set, in which case
generation runs in PyTorch, as in optimum's ``ORTSeq2SeqTrainer``. ``ort_inference=True`` with
``predict_with_generate=True`` generates through ONNX Runtime (encoder and decoder sessions with past key values,
checked against eager generation; ``hflight.ort.generation``).
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
    through ONNX Runtime unless ``predict_with_generate`` (then generation runs in PyTorch; ``ort_inference=True``
    generates through ONNX Runtime)."""

    ort_inference: Optional[bool] = field(
        default=None,
        metadata={
            "help": "Evaluate and predict through ONNX Runtime (with predict_with_generate: generate through it too). "
            "None: yes, unless predict_with_generate (generation then runs in PyTorch)."
        },
    )

    def __post_init__(self) -> None:
        if self.ort_inference is None:
            self.ort_inference = not self.predict_with_generate
        super().__post_init__()
