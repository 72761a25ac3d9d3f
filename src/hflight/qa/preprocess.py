"""Turning SQuAD-style examples into model features (``run_qa.py`` semantics).

Both functions take a batch (dict of lists, as ``datasets.Dataset.map(batched=True)`` passes it) and
return a dict of lists with one row per *feature*: a long context is split into several overlapping
windows (``return_overflowing_tokens`` with ``stride=doc_stride``), so one example can give several
features. Bind the arguments with :func:`functools.partial`::

    train_features = train_examples.map(
        partial(prepare_train_features, tokenizer=tok, max_seq_length=384, doc_stride=128),
        batched=True, remove_columns=train_examples.column_names)

Semantics (as in HF's ``run_qa.py``):

* the question is ``lstrip``-ped; only the context is truncated (``"only_second"``; for a tokenizer
  that pads on the left the context comes first and ``"only_first"`` is used);
* training features get ``start_positions``/``end_positions``: the token span of the answer when it
  lies fully inside the window, otherwise (and for unanswerable questions) the index of the CLS token;
* validation features get ``example_id`` (the example's ``id``) and ``offset_mapping`` in which the
  offsets of every token that is not part of the context are ``None``.

Differences from ``run_qa.py``, all on inputs where it would produce wrong labels or crash:

* The answer used for training is the *first locatable* answer: ``answers["answer_start"][i] >= 0``
  and ``context[start:start + len(text)] == text`` (with data from :func:`hflight.qa.data.load_squad_json`
  and any clean SQuAD file that is always the first answer, as in ``run_qa.py``). Questions that have
  answers but no locatable one (``answer_start == -1``, see :mod:`hflight.qa.data`) get no training
  features; they are counted and logged at WARNING with their ids.
* Whitespace at the ends of an answer text is not part of the labelled span.
* The start-token search stops at the end of the context (``run_qa.py``'s loop can run into the
  trailing ``[SEP]``/padding when the answer starts in the window's last context token).
* A question so long that fewer than ``doc_stride + 1`` context tokens fit in a window raises a
  ``ValueError`` naming the question, instead of the tokenizer's Rust panic.
* A slow (Python) tokenizer raises ``TypeError``: offsets and overflow windows need a fast one.
"""

from __future__ import annotations

import logging
from bisect import bisect_left, bisect_right
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)

__all__ = [
    "prepare_train_features",
    "prepare_validation_features",
    "check_tokenizer",
    "effective_max_seq_length",
]

_MAX_IDS_IN_LOG = 5
_warned_clamp: set[tuple[str, int, int]] = set()


def check_tokenizer(tokenizer: Any) -> None:
    """Raise ``TypeError`` unless ``tokenizer`` is a fast (Rust ``tokenizers``-backed) tokenizer."""
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(
            f"QA preprocessing requires a fast tokenizer (one backed by the `tokenizers` library, "
            f"`tokenizer.is_fast == True`) for offset mappings and overflowing windows; got "
            f"{type(tokenizer).__name__}. Load it with AutoTokenizer.from_pretrained(...) (fast is the default) "
            f"or train one with hflight.qa.tokenizer.train_wordpiece_tokenizer."
        )


def effective_max_seq_length(tokenizer: Any, max_seq_length: int, doc_stride: int) -> int:
    """Validate the window settings; return ``max_seq_length`` clamped to the tokenizer's maximum.

    As in ``run_qa.py``, a ``max_seq_length`` above ``tokenizer.model_max_length`` logs a warning and
    the model maximum is used.
    """
    if isinstance(max_seq_length, bool) or not isinstance(max_seq_length, int) or max_seq_length <= 0:
        raise ValueError(f"max_seq_length must be a positive integer, got {max_seq_length!r}")
    if isinstance(doc_stride, bool) or not isinstance(doc_stride, int) or doc_stride < 0:
        raise ValueError(f"doc_stride must be a non-negative integer, got {doc_stride!r}")
    model_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(model_max, int) and 0 < model_max < max_seq_length:
        key = (str(getattr(tokenizer, "name_or_path", "")), max_seq_length, model_max)
        if key not in _warned_clamp:
            _warned_clamp.add(key)
            logger.warning(
                "max_seq_length=%d is larger than the model's maximum length (%d) for %s; using %d.",
                max_seq_length,
                model_max,
                key[0] or type(tokenizer).__name__,
                model_max,
            )
        max_seq_length = model_max
    n_special = tokenizer.num_special_tokens_to_add(pair=True)
    if doc_stride >= max_seq_length - n_special:
        raise ValueError(
            f"doc_stride ({doc_stride}) must be smaller than max_seq_length ({max_seq_length}) minus the "
            f"{n_special} special tokens and the question length: it is the overlap between consecutive "
            f"windows of the context. Use a smaller doc_stride (e.g. max_seq_length // 4) or a larger max_seq_length."
        )
    return max_seq_length


def _check_question_lengths(
    tokenizer: Any, questions: Sequence[str], ids: Sequence[Any] | None, max_seq_length: int, doc_stride: int
) -> None:
    """Every window must hold more than ``doc_stride`` context tokens next to its question."""
    n_special = tokenizer.num_special_tokens_to_add(pair=True)
    limit = max_seq_length - n_special - doc_stride  # a question must have fewer tokens than this
    # Screen cheaply first: no tokenizer in use makes more than two tokens per UTF-8 byte, plus one
    # for a word-boundary marker, so only questions that could reach the limit are tokenized.
    suspects = [i for i, q in enumerate(questions) if 2 * len(q.encode("utf-8")) + 1 >= limit]
    if not suspects:
        return
    encoded = tokenizer(
        [questions[i] for i in suspects],
        add_special_tokens=False,
        return_attention_mask=False,
        return_token_type_ids=False,
    )["input_ids"]
    for i, ids_i in zip(suspects, encoded):
        n = len(ids_i)
        room = max_seq_length - n_special - n  # context tokens per window
        if room <= doc_stride:
            who = f"question id {ids[i]!r}" if ids is not None else f"question {i} of the batch"
            raise ValueError(
                f"{who} is {n} tokens long, which leaves {room} context tokens per window of "
                f"max_seq_length={max_seq_length}; the window overlap doc_stride={doc_stride} must be smaller "
                f"than that. Use a larger max_seq_length or a smaller doc_stride, or shorten the question "
                f"(question: {questions[i][:80]!r})."
            )


def _tokenize(
    questions: list[str],
    contexts: list[str],
    ids: Sequence[Any] | None,
    tokenizer: Any,
    max_seq_length: int,
    doc_stride: int,
    pad_to_max_length: bool,
):
    max_seq_length = effective_max_seq_length(tokenizer, max_seq_length, doc_stride)
    _check_question_lengths(tokenizer, questions, ids, max_seq_length, doc_stride)
    pad_on_right = tokenizer.padding_side == "right"
    return (
        tokenizer(
            questions if pad_on_right else contexts,
            contexts if pad_on_right else questions,
            truncation="only_second" if pad_on_right else "only_first",
            max_length=max_seq_length,
            stride=doc_stride,
            return_overflowing_tokens=True,
            return_offsets_mapping=True,
            padding="max_length" if pad_to_max_length else False,
        ),
        pad_on_right,
    )


def _empty_features(tokenizer: Any, extra: Sequence[str]) -> dict[str, list]:
    names = list(getattr(tokenizer, "model_input_names", None) or ["input_ids", "attention_mask"])
    return {name: [] for name in [*names, *extra]}


def _training_span(context: str, answers: Mapping[str, Sequence]) -> tuple[int, int] | None:
    """``(start_char, end_char)`` of the first locatable answer, whitespace trimmed; ``None`` if none."""
    for text, start in zip(answers["text"], answers["answer_start"]):
        if start is None or start < 0 or not context.startswith(text, start):
            continue
        core = text.strip()
        if not core:
            continue
        start += len(text) - len(text.lstrip())
        return start, start + len(core)
    return None


def prepare_train_features(
    examples: Mapping[str, Sequence],
    tokenizer: Any,
    max_seq_length: int = 384,
    doc_stride: int = 128,
    pad_to_max_length: bool = True,
    *,
    question_column: str = "question",
    context_column: str = "context",
    answer_column: str = "answers",
) -> dict[str, list]:
    """Training features with ``start_positions``/``end_positions`` labels for a batch of examples.

    Args:
        examples: a batch (dict of lists) with ``question``, ``context``, ``answers``
            (``{"text": [...], "answer_start": [...]}``) and, for messages, ``id``.
        tokenizer: a fast tokenizer.
        max_seq_length: tokens per window (question + context + special tokens).
        doc_stride: overlap in tokens between consecutive windows of a long context.
        pad_to_max_length: pad every window to ``max_seq_length``; ``False`` leaves padding to the
            data collator (dynamic padding).

    Returns:
        ``input_ids``, ``attention_mask`` (and ``token_type_ids`` if the tokenizer makes them),
        ``start_positions``, ``end_positions``: one row per window.
    """
    check_tokenizer(tokenizer)
    ids = examples["id"] if "id" in examples else None
    questions_in = examples[question_column]
    contexts_in = examples[context_column]
    answers_in = examples[answer_column]

    kept = _training_examples(questions_in, contexts_in, answers_in, ids)
    if kept.excluded:
        _log_excluded(kept.excluded, len(questions_in))
    if not kept.questions:
        return _empty_features(tokenizer, ["start_positions", "end_positions"])

    enc, pad_on_right = _tokenize(
        kept.questions,
        kept.contexts,
        kept.ids if ids is not None else None,
        tokenizer,
        max_seq_length,
        doc_stride,
        pad_to_max_length,
    )
    sample_mapping = enc.pop("overflow_to_sample_mapping")
    offset_mapping = enc.pop("offset_mapping")
    start_positions, end_positions = _label_windows(
        enc, offset_mapping, sample_mapping, kept.spans, 1 if pad_on_right else 0, tokenizer
    )
    features = dict(enc)
    features["start_positions"] = start_positions
    features["end_positions"] = end_positions
    return features


class _TrainingExamples(NamedTuple):
    """The examples of a batch that get training features, and the ids of those that do not."""

    questions: list[str]  # ``lstrip``-ped
    contexts: list[str]
    spans: list[tuple[int, int] | None]  # answer character span; ``None``: unanswerable
    ids: list[Any]  # empty when the batch has no ``id`` column
    excluded: list[str]  # ids (or ``#<index in batch>``) of questions whose answers cannot be located


def _training_examples(
    questions_in: Sequence[str],
    contexts_in: Sequence[str],
    answers_in: Sequence[Mapping[str, Sequence]],
    ids: Sequence[Any] | None,
) -> _TrainingExamples:
    """Keep unanswerable questions and those with a locatable answer; set aside the rest."""
    kept = _TrainingExamples([], [], [], [], [])
    for i, (question, context, answers) in enumerate(zip(questions_in, contexts_in, answers_in)):
        if len(answers["text"]) == 0:
            span = None  # unanswerable: labelled with the CLS index
        else:
            span = _training_span(context, answers)
            if span is None:
                kept.excluded.append(str(ids[i]) if ids is not None else f"#{i}")
                continue
        kept.questions.append(question.lstrip())
        kept.contexts.append(context)
        kept.spans.append(span)
        if ids is not None:
            kept.ids.append(ids[i])
    return kept


def _log_excluded(excluded: list[str], batch_size: int) -> None:
    """Warn about the questions left out of training, naming the first few."""
    shown = ", ".join(excluded[:_MAX_IDS_IN_LOG]) + (
        f", ... and {len(excluded) - _MAX_IDS_IN_LOG} more" if len(excluded) > _MAX_IDS_IN_LOG else ""
    )
    logger.warning(
        "prepare_train_features: %d question(s) in this batch of %d excluded from training because none of "
        "their answers could be located in the context (answer_start == -1 or not pointing at the text): %s",
        len(excluded),
        batch_size,
        shown,
    )


def _label_windows(
    enc: Any,
    offset_mapping: Sequence[Sequence[Sequence[int]]],
    sample_mapping: Sequence[int],
    spans: Sequence[tuple[int, int] | None],
    context_seq: int,
    tokenizer: Any,
) -> tuple[list[int], list[int]]:
    """``(start_positions, end_positions)``: per window the answer's token span, or the CLS index twice."""
    cls_id = tokenizer.cls_token_id
    bos_id = tokenizer.bos_token_id
    start_positions: list[int] = []
    end_positions: list[int] = []
    all_input_ids = enc["input_ids"]
    for i, offsets in enumerate(offset_mapping):
        cls_index = _cls_index(all_input_ids[i], cls_id, bos_id)
        span = spans[sample_mapping[i]]
        if span is None:
            start_positions.append(cls_index)
            end_positions.append(cls_index)
            continue
        start, end = _answer_tokens(offsets, enc.sequence_ids(i), context_seq, span, cls_index)
        start_positions.append(start)
        end_positions.append(end)
    return start_positions, end_positions


def _cls_index(input_ids: list[int], cls_id: int | None, bos_id: int | None) -> int:
    """Where a window's CLS token is (else its BOS token, else 0): the label of "no answer here"."""
    if cls_id is not None and cls_id in input_ids:
        return input_ids.index(cls_id)
    if bos_id is not None and bos_id in input_ids:
        return input_ids.index(bos_id)
    return 0


def _answer_tokens(
    offsets: Sequence[Sequence[int]],
    seq_ids: list[int | None],
    context_seq: int,
    span: tuple[int, int],
    cls_index: int,
) -> tuple[int, int]:
    """The first and last token of the answer ``span`` in one window; ``cls_index`` twice if it is not all inside."""
    start_char, end_char = span
    ctx_start = seq_ids.index(context_seq)
    ctx_end = len(seq_ids) - 1 - seq_ids[::-1].index(context_seq)
    if not (offsets[ctx_start][0] <= start_char and offsets[ctx_end][1] >= end_char):
        # The answer is not fully inside this window.
        return cls_index, cls_index
    # Last context token starting at or before the answer start; first one ending at or after its end.
    return (
        bisect_right(offsets, start_char, ctx_start, ctx_end + 1, key=_first) - 1,
        bisect_left(offsets, end_char, ctx_start, ctx_end + 1, key=_second),
    )


def _first(pair: Sequence[int]) -> int:
    return pair[0]


def _second(pair: Sequence[int]) -> int:
    return pair[1]


def prepare_validation_features(
    examples: Mapping[str, Sequence],
    tokenizer: Any,
    max_seq_length: int = 384,
    doc_stride: int = 128,
    pad_to_max_length: bool = True,
    *,
    question_column: str = "question",
    context_column: str = "context",
    id_column: str = "id",
) -> dict[str, list]:
    """Evaluation features for a batch of examples, for post-processing predictions back to text.

    Returns ``input_ids``, ``attention_mask`` (and ``token_type_ids`` if the tokenizer makes them),
    ``example_id`` (the ``id`` of the example each window comes from) and ``offset_mapping``
    (character offsets into the context; ``None`` for tokens outside the context: question,
    special tokens, padding). One row per window; every example gives at least one.
    """
    check_tokenizer(tokenizer)
    ids = examples[id_column]
    questions = [q.lstrip() for q in examples[question_column]]
    contexts = list(examples[context_column])
    if not questions:
        return _empty_features(tokenizer, ["example_id", "offset_mapping"])
    enc, pad_on_right = _tokenize(questions, contexts, ids, tokenizer, max_seq_length, doc_stride, pad_to_max_length)
    sample_mapping = enc.pop("overflow_to_sample_mapping")
    offset_mapping = enc.pop("offset_mapping")
    context_seq = 1 if pad_on_right else 0
    example_ids = []
    masked_offsets = []
    for i, offsets in enumerate(offset_mapping):
        seq_ids = enc.sequence_ids(i)
        example_ids.append(ids[sample_mapping[i]])
        masked_offsets.append([o if s == context_seq else None for o, s in zip(offsets, seq_ids)])
    features = dict(enc)
    features["example_id"] = example_ids
    features["offset_mapping"] = masked_offsets
    return features
