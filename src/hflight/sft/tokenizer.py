"""A word-level tokenizer for a causal language model built from scratch, trained on the run's texts.

Words and punctuation (``tokenizers``' ``Whitespace`` pre-tokenizer), the ``vocab_size`` most frequent of them
(special tokens included), lower-cased; ``<bos>``, ``<eos>`` and ``<pad>`` for a causal LM and TRL's SFT, which
appends the end-of-sequence token to each completion. Saved into ``output_dir`` and loaded back with
``AutoTokenizer.from_pretrained``, like any other tokenizer; reused as it is when the same texts and arguments made
it there (``hflight.qa.made``: a resumed run keeps the vocabulary its checkpoints were trained with).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from hflight.qa import made

SPECIAL = {"unk_token": "<unk>", "pad_token": "<pad>", "bos_token": "<bos>", "eos_token": "<eos>"}


def train_word_tokenizer(
    texts: Iterable[str],
    output_dir: str | os.PathLike,
    vocab_size: int = 2000,
    model_max_length: int = 512,
    resuming: bool = False,
) -> PreTrainedTokenizerFast:
    """Train the tokenizer on ``texts`` into ``output_dir`` and return it as ``AutoTokenizer`` loads it.

    Args:
        texts: the training texts (prompts and completions).
        output_dir: where ``save_pretrained`` writes it.
        vocab_size: the vocabulary's size, the four special tokens included.
        model_max_length: the ``model_max_length`` recorded in the tokenizer's config.
        resuming: the run continues from a checkpoint: a tokenizer trained in ``output_dir`` on other texts or with
            other arguments is an error (its model's vocabulary would not fit), not replaced.
    """
    texts = [text for text in texts if isinstance(text, str)]
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode("utf-8") + b"\0")
    recipe = dict(trainer="hflight.sft.tokenizer.train_word_tokenizer", vocab_size=vocab_size,
                  model_max_length=model_max_length, texts_sha256=digest.hexdigest())  # fmt: skip
    out = Path(output_dir)
    if made.reusable(out, recipe, ("tokenizer.json",), "a trained tokenizer", resuming):
        return AutoTokenizer.from_pretrained(str(out))
    words = Tokenizer(models.WordLevel(unk_token=SPECIAL["unk_token"]))
    words.normalizer = normalizers.Lowercase()
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    words.train_from_iterator(texts, trainers.WordLevelTrainer(vocab_size=vocab_size,
                                                                special_tokens=list(SPECIAL.values())))  # fmt: skip
    wrapped = PreTrainedTokenizerFast(tokenizer_object=words, model_max_length=model_max_length, **SPECIAL)
    out.mkdir(parents=True, exist_ok=True)
    made.save_in_place(out, wrapped.save_pretrained)
    made.write_record(out, recipe)
    return AutoTokenizer.from_pretrained(str(out))
