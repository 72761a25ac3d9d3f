"""``Seq2SeqTrainingArguments``: transformers' ``Seq2SeqTrainingArguments`` on hflight's ``TrainingArguments``.

The class subclasses both, so it has every field of transformers' (``sortish_sampler``, ``predict_with_generate``,
``generation_max_length``, ``generation_num_beams``, ``generation_config``) with transformers' types, defaults and
help, in transformers' positional order, followed by hflight's Lightning fields (``accelerator``, ``devices``,
``strategy``, ``num_nodes``). hflight's checks run around transformers' ``__post_init__`` as for
``TrainingArguments``; ``to_dict`` serialises a ``GenerationConfig`` as transformers does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import Seq2SeqTrainingArguments as HFSeq2SeqTrainingArguments
from transformers import TrainingArguments as HFTrainingArguments

from hflight.arguments.training_args import TrainingArguments, field_values

__all__ = ["Seq2SeqTrainingArguments", "seq2seq_args"]


@dataclasses.dataclass
class Seq2SeqTrainingArguments(TrainingArguments, HFSeq2SeqTrainingArguments):
    """transformers' ``Seq2SeqTrainingArguments`` with hflight's ``TrainingArguments`` behaviour (Lightning's
    ``accelerator``, ``devices``, ``strategy`` and ``num_nodes``; the same checks and differences).

    ``sortish_sampler`` is transformers' field and, as in transformers 5 (whose ``Seq2SeqTrainer`` never reads it),
    changes nothing; use ``train_sampling_strategy="group_by_length"`` to batch similar lengths together.
    """

    def to_transformers(self) -> HFSeq2SeqTrainingArguments:
        """These arguments as a plain ``transformers.Seq2SeqTrainingArguments`` (what ``training_args.bin`` holds):
        transformers' fields with their values, no ``__post_init__`` rerun."""
        plain = super().to_transformers()
        seq2seq = HFSeq2SeqTrainingArguments.__new__(HFSeq2SeqTrainingArguments)
        vars(seq2seq).update(vars(plain))
        for f in dataclasses.fields(HFSeq2SeqTrainingArguments):
            setattr(seq2seq, f.name, getattr(self, f.name))
        return seq2seq


def seq2seq_args(args: Any, owner: str = "Seq2SeqTrainer", cls: type = Seq2SeqTrainingArguments) -> Any:
    """``args`` as ``cls`` (hflight's ``Seq2SeqTrainingArguments`` or a subclass) for ``owner``: an instance as it
    is; None as the defaults with ``output_dir="tmp_trainer"`` (transformers' default folder); any other hflight or
    transformers ``TrainingArguments`` copied field by field (the Seq2Seq fields of a transformers
    ``Seq2SeqTrainingArguments`` included, the others at their defaults).

    Raises:
        TypeError: ``args`` is no ``TrainingArguments``.
        ValueError: a field hflight cannot honour is set (as for ``TrainingArguments``).
    """
    if isinstance(args, cls):
        return args
    if args is None:
        return cls(output_dir="tmp_trainer")
    if isinstance(args, HFTrainingArguments):
        values, _others = field_values(cls, args)
        return cls(**values)
    raise TypeError(f"{owner}: args must be {cls.__name__} or TrainingArguments, got {type(args).__name__}")
