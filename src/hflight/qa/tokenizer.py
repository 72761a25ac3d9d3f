"""Training a small BERT-style WordPiece tokenizer offline (no hub downloads).

:func:`train_wordpiece_tokenizer` builds the same pipeline as BERT's uncased tokenizer with the
``tokenizers`` library (``BertNormalizer`` -> ``BertPreTokenizer`` -> ``WordPiece`` model ->
``[CLS] A [SEP] B [SEP]`` post-processor with token type ids, ``WordPiece`` decoder), trains it on
the given texts, saves it as a fast ``BertTokenizer`` (``BertTokenizerFast``) in ``output_dir`` and
returns it loaded back through ``transformers.AutoTokenizer.from_pretrained(output_dir)``, the path
every other component uses.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, BertTokenizerFast, PreTrainedTokenizerFast

from hflight.qa import made

__all__ = ["SPECIAL_TOKENS", "train_wordpiece_tokenizer", "squad_texts"]

#: BERT's special tokens, in the order they get ids 0..4.
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def train_wordpiece_tokenizer(
    texts: Iterable[str],
    output_dir: str | os.PathLike,
    vocab_size: int = 4000,
    lowercase: bool = True,
    min_frequency: int = 2,
    model_max_length: int = 512,
    resuming: bool = False,
) -> PreTrainedTokenizerFast:
    """Train a BERT-style WordPiece tokenizer and return it reloaded with ``AutoTokenizer``.

    Args:
        texts: training texts (e.g. :func:`squad_texts` of a SQuAD file: contexts and questions).
        output_dir: where ``save_pretrained`` writes it (``tokenizer.json``, ``tokenizer_config.json``, ...).
        vocab_size: target vocabulary size, special tokens and the initial alphabet included.
        lowercase: lowercase and strip accents (BERT *uncased*); ``False`` keeps case and accents.
        min_frequency: minimum pair frequency for a merge.
        model_max_length: the ``model_max_length`` recorded in the tokenizer config.
        resuming: the run continues from a checkpoint: a tokenizer trained in ``output_dir`` on other texts or
            with other arguments is an error (its model's vocabulary would not fit), not replaced.

    Returns:
        The fast tokenizer as loaded by ``AutoTokenizer.from_pretrained(output_dir)``. Same texts and
        arguments give the same vocabulary; a tokenizer this function trained in ``output_dir`` on the same texts
        with the same arguments is loaded as it is, not trained again (``hflight.qa.made``).
    """
    texts = list(_strings(texts))
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode("utf-8") + b"\0")
    recipe = dict(
        trainer="hflight.qa.tokenizer.train_wordpiece_tokenizer",
        vocab_size=vocab_size,
        lowercase=lowercase,
        min_frequency=min_frequency,
        model_max_length=model_max_length,
        texts_sha256=digest.hexdigest(),
    )
    out = Path(output_dir)
    if made.reusable(out, recipe, ("tokenizer.json", "vocab.txt"), "a trained tokenizer", resuming):
        return AutoTokenizer.from_pretrained(str(out))
    normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=lowercase, lowercase=lowercase
    )
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    vocab = _learn_vocabulary(texts, normalizer, pre_tokenizer, vocab_size, min_frequency)
    wrapped = _bert_tokenizer(_bert_pipeline(vocab, normalizer, pre_tokenizer), lowercase, model_max_length)
    out.mkdir(parents=True, exist_ok=True)
    _save_in_place(wrapped, vocab, out)
    made.write_record(out, recipe)
    return AutoTokenizer.from_pretrained(str(out))


def _learn_vocabulary(
    texts: list[str], normalizer: Any, pre_tokenizer: Any, vocab_size: int, min_frequency: int
) -> dict[str, int]:
    """Train WordPiece on ``texts``; the learnt vocabulary with canonical, reproducible ids."""
    # Determinism. The trainer numbers the continuation characters ("##x") in hash-map order, which
    # changes from run to run, and breaks ties between equally frequent merges by token id: so the
    # learnt vocabulary itself (not only its order) would vary. Numbering every continuation character
    # up front, in sorted order, makes the ids and hence the tie-breaks fixed. They are passed as
    # trainer "special tokens" only to get those ids first; the final tokenizer treats them as plain
    # vocabulary entries.
    continuation = [f"##{c}" for c in _word_characters(texts, normalizer, pre_tokenizer)]
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS) + continuation,
        continuing_subword_prefix="##",
        show_progress=False,
    )
    scratch = Tokenizer(models.WordPiece(unk_token="[UNK]", continuing_subword_prefix="##"))
    scratch.normalizer = normalizer
    scratch.pre_tokenizer = pre_tokenizer
    scratch.train_from_iterator(texts, trainer=trainer)
    trained = scratch.get_vocab()
    # Canonical ids: specials, then characters, then continuation characters, then longer pieces.
    rest = sorted(
        (t for t in trained if t not in SPECIAL_TOKENS),
        key=lambda t: (len(t[2:] if t.startswith("##") else t) > 1, t.startswith("##"), t),
    )
    return {t: i for i, t in enumerate(list(SPECIAL_TOKENS) + rest)}


def _bert_pipeline(vocab: dict[str, int], normalizer: Any, pre_tokenizer: Any) -> Tokenizer:
    """The ``tokenizers`` pipeline of BERT around ``vocab``: WordPiece model and decoder, special tokens, and the
    ``[CLS] A [SEP] B [SEP]`` post-processor with token type ids."""
    tok = Tokenizer(
        models.WordPiece(vocab=vocab, unk_token="[UNK]", continuing_subword_prefix="##", max_input_chars_per_word=100)
    )
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return tok


def _bert_tokenizer(tok: Tokenizer, lowercase: bool, model_max_length: int) -> BertTokenizerFast:
    """``tok`` as a transformers ``BertTokenizerFast`` (special tokens, casing, maximum length, right padding)."""
    return BertTokenizerFast(
        tokenizer_object=tok,
        do_lower_case=lowercase,
        strip_accents=lowercase,
        tokenize_chinese_chars=True,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=model_max_length,
        padding_side="right",
        truncation_side="right",
    )


def _save_in_place(wrapped: BertTokenizerFast, vocab: dict[str, int], out: Path) -> None:
    """``save_pretrained`` plus a ``vocab.txt`` into ``out``, each file appearing whole (``hflight.qa.made``)."""

    def save(staging: str) -> None:
        wrapped.save_pretrained(staging)
        # A WordPiece vocab.txt too, so a slow BERT tokenizer can be built from the same vocabulary.
        Path(staging, "vocab.txt").write_text(
            "".join(t + "\n" for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])), encoding="utf-8"
        )

    made.save_in_place(out, save)


def _word_characters(texts: list[str], normalizer: Any, pre_tokenizer: Any) -> list[str]:
    """The sorted characters that can occur inside a word after normalization and pre-tokenization."""
    raw = set().union(*map(set, texts)) if texts else set()
    chars: set[str] = set()
    for c in raw:
        chars.update(normalizer.normalize_str(c))
    # Characters that normalization and pre-tokenization always isolate (whitespace, punctuation,
    # CJK ideographs) never continue a word.
    return sorted(c for c in chars if len(pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(f"a{c}"))) == 1)


def _strings(texts: Iterable[str]) -> Iterator[str]:
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"train_wordpiece_tokenizer: text {i} is a {type(t).__name__}, not a str")
        yield t


def squad_texts(*sources: str | os.PathLike | Mapping[str, Any]) -> Iterator[str]:
    """The contexts (each once) and questions of SQuAD-format data, for tokenizer training.

    Each source is a path to a SQuAD JSON file or an already loaded ``{"data": [...]}`` dict
    (e.g. from :func:`hflight.qa.synthetic.generate_squad`).
    """
    for src in sources:
        if isinstance(src, Mapping):
            squad = src
        else:
            with open(src, encoding="utf-8") as f:
                squad = json.load(f)
        for article in squad["data"]:
            for para in article["paragraphs"]:
                yield para["context"]
                for qa in para["qas"]:
                    yield qa["question"]
