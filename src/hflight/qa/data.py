"""Loading SQuAD-format JSON (v1.1 and v2.0) into a validated :class:`datasets.Dataset`.

The returned dataset has the column layout of HF's ``squad``/``squad_v2`` datasets, which is what
``run_qa.py``-style preprocessing expects::

    id: str, title: str, context: str, question: str,
    answers: {"text": [str, ...], "answer_start": [int, ...]}

Rules applied while loading (nothing is dropped silently; everything is counted in a :class:`LoadReport`):

* Every record is validated. Malformed JSON, a missing ``data`` list, or a record with a missing or
  wrong-typed field raises :class:`SquadFormatError` (a ``ValueError``) whose message names the file,
  the record (article index and title, paragraph index, question id) and the offending key.
* Duplicate question ids raise :class:`SquadFormatError` naming the id and both places it occurs.
* SQuAD 2.0: ``is_impossible: true`` gives empty answer lists (the question is unanswerable);
  ``plausible_answers`` are never answers.
* An answer whose ``answer_start`` does not point at its text is *re-located*: if the text occurs in
  the context, the occurrence nearest to the given start is used. Otherwise (or if the text is empty)
  the answer is kept with ``answer_start = -1``: evaluation still scores against its text, but
  training must not use it (:func:`hflight.qa.preprocess.prepare_train_features` skips such answers).
* A question that has answers but none of them locatable is *excluded from training* (it is kept in
  the dataset for evaluation).

Use ``load_squad_json(path, return_report=True)`` to get ``(dataset, report)``; the report is also
logged (INFO when clean, WARNING when answers were re-located or could not be located).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets

logger = logging.getLogger(__name__)

__all__ = ["SquadFormatError", "LoadReport", "load_squad_json", "squad_features"]

# ``datasets.List`` (datasets>=4) replaced ``Sequence`` for plain lists.
_List = getattr(datasets, "List", None) or datasets.Sequence

#: How many offending ids a log message lists.
_MAX_IDS_IN_LOG = 5


class SquadFormatError(ValueError):
    """A SQuAD JSON file is malformed; the message names the file, the record and the key."""


def squad_features() -> datasets.Features:
    """The :class:`datasets.Features` of a loaded SQuAD dataset (same layout as HF's ``squad``)."""
    return datasets.Features(
        {
            "id": datasets.Value("string"),
            "title": datasets.Value("string"),
            "context": datasets.Value("string"),
            "question": datasets.Value("string"),
            "answers": {
                "text": _List(datasets.Value("string")),
                "answer_start": _List(datasets.Value("int32")),
            },
        }
    )


@dataclass
class LoadReport:
    """What :func:`load_squad_json` found in one file.

    Counts:
        num_articles, num_paragraphs, num_questions: sizes of the file.
        num_answerable / num_unanswerable: questions with at least one answer / with none
            (``is_impossible: true`` or an empty ``answers`` list).
        num_answers: answers kept over all questions.
        num_questions_misaligned: questions with at least one answer whose ``answer_start`` did not
            point at its text (re-located or unlocatable).
        num_answers_relocated: answers whose ``answer_start`` was wrong but whose text was found in
            the context (the nearest occurrence was used).
        num_answers_unlocatable: answers kept with ``answer_start = -1`` (text not in the context, or empty).
        num_questions_with_unlocatable_answers: questions with at least one unlocatable answer.
        num_questions_excluded_from_training: answerable questions with *no* locatable answer; training
            features are not built for them (they stay in the dataset for evaluation).
        num_impossible_with_answers: ``is_impossible: true`` questions that nevertheless listed answers
            (those answers are ignored, as the question is unanswerable).

    Id lists (complete, in file order): ``relocated_ids``, ``unlocatable_ids`` (questions with at least
    one unlocatable answer), ``excluded_from_training_ids``, ``impossible_with_answers_ids``.
    """

    path: str
    version: str | None = None
    num_articles: int = 0
    num_paragraphs: int = 0
    num_questions: int = 0
    num_answerable: int = 0
    num_unanswerable: int = 0
    num_answers: int = 0
    num_questions_misaligned: int = 0
    num_answers_relocated: int = 0
    num_answers_unlocatable: int = 0
    num_questions_with_unlocatable_answers: int = 0
    num_questions_excluded_from_training: int = 0
    num_impossible_with_answers: int = 0
    relocated_ids: list[str] = field(default_factory=list)
    unlocatable_ids: list[str] = field(default_factory=list)
    excluded_from_training_ids: list[str] = field(default_factory=list)
    impossible_with_answers_ids: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        """True when every answer pointed at its text and nothing needed attention."""
        return not (self.num_answers_relocated or self.num_answers_unlocatable or self.num_impossible_with_answers)

    def summary(self) -> str:
        """A one-paragraph human-readable summary (what gets logged)."""
        name = os.path.basename(self.path)
        parts = [
            f"{name}: {self.num_articles} articles, {self.num_paragraphs} paragraphs, "
            f"{self.num_questions} questions ({self.num_answerable} answerable, "
            f"{self.num_unanswerable} unanswerable), {self.num_answers} answers"
        ]
        if self.num_questions_misaligned:
            parts.append(
                f"{self.num_answers_relocated + self.num_answers_unlocatable} answer(s) in "
                f"{self.num_questions_misaligned} question(s) do not align with their context"
            )
        if self.num_answers_relocated:
            parts.append(
                f"{self.num_answers_relocated} answer(s) re-located to where their text occurs in the context "
                f"(questions {_first_ids(self.relocated_ids)})"
            )
        if self.num_answers_unlocatable:
            parts.append(
                f"{self.num_answers_unlocatable} answer(s) in {self.num_questions_with_unlocatable_answers} "
                f"question(s) not found in their context, kept with answer_start=-1 for evaluation only "
                f"(questions {_first_ids(self.unlocatable_ids)})"
            )
        if self.num_questions_excluded_from_training:
            parts.append(
                f"{self.num_questions_excluded_from_training} question(s) have no locatable answer and are "
                f"excluded from training (questions {_first_ids(self.excluded_from_training_ids)})"
            )
        if self.num_impossible_with_answers:
            parts.append(
                f"{self.num_impossible_with_answers} is_impossible question(s) listed answers, which were ignored "
                f"(questions {_first_ids(self.impossible_with_answers_ids)})"
            )
        return "; ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        """The counts only (no id lists), e.g. for logging to an experiment tracker."""
        return {k: v for k, v in self.__dict__.items() if not isinstance(v, list)}


def _first_ids(ids: list[str]) -> str:
    shown = ", ".join(ids[:_MAX_IDS_IN_LOG])
    more = len(ids) - _MAX_IDS_IN_LOG
    return shown + (f", ... and {more} more" if more > 0 else "")


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _bad_key(record: dict, key: str, value: Any, where: str, must_be: str) -> SquadFormatError:
    """The error for ``record[key]`` missing or of the wrong type, e.g. "...: missing key 'qas' (must be a list)"."""
    what = "missing key" if key not in record else f"wrong type ({_type_name(value)}) for key"
    return SquadFormatError(f"{where}: {what} '{key}' (must be {must_be})")


def _locate(context: str, text: str, start: int) -> int:
    """The start of the occurrence of ``text`` in ``context`` nearest to ``start``; -1 if none."""
    first = context.find(text)
    if first < 0:
        return -1
    best, best_dist = first, abs(first - start)
    pos = context.find(text, first + 1)
    while pos >= 0:
        dist = abs(pos - start)
        if dist < best_dist:  # strictly nearer; ties keep the earlier occurrence
            best, best_dist = pos, dist
        elif pos > start:  # occurrences only get farther from here on
            break
        pos = context.find(text, pos + 1)
    return best


def load_squad_json(path: str | os.PathLike, return_report: bool = False):
    """Load a SQuAD v1.1 / v2.0 JSON file into a validated :class:`datasets.Dataset`.

    Args:
        path: the JSON file (``{"version": ..., "data": [{"title", "paragraphs": [{"context", "qas"}]}]}``).
        return_report: also return the :class:`LoadReport`.

    Returns:
        The dataset (columns ``id, title, context, question, answers``), or ``(dataset, report)``
        when ``return_report`` is true.

    Raises:
        FileNotFoundError: the file does not exist.
        SquadFormatError: malformed JSON (also: nested too deeply to parse), a missing/wrong-typed field, a
            string that is not valid Unicode (a lone surrogate such as ``"\\ud800"``), or duplicate question ids.
    """
    name = str(path)
    top = _read_json(Path(path), name)
    articles = _articles(top, name)
    version = top.get("version")
    report = LoadReport(path=name, version=None if version is None else str(version))
    rows: dict[str, list] = {"id": [], "title": [], "context": [], "question": [], "answers": []}
    seen: dict[str, str] = {}
    for a_idx, article in enumerate(articles):
        title, paragraphs, where_a = _article_fields(article, name, f"article {a_idx}")
        report.num_articles += 1
        for p_idx, para in enumerate(paragraphs):
            where_p = f"{where_a}, paragraph {p_idx}"
            context, qas = _paragraph_fields(para, name, where_p)
            report.num_paragraphs += 1
            for q_idx, qa in enumerate(qas):
                qid, question, texts, starts = _question_fields(qa, name, where_p, q_idx, seen)
                if qa.get("is_impossible") and texts:
                    # ``plausible_answers`` (SQuAD 2.0) are ignored anyway: they are not answers.
                    report.num_impossible_with_answers += 1
                    report.impossible_with_answers_ids.append(qid)
                    texts, starts = [], []
                relocated, unlocatable = _align_answers(context, texts, starts)
                _count_question(report, qid, len(texts), relocated, unlocatable)
                for column, value in zip(
                    rows, (qid, title, context, question, {"text": texts, "answer_start": starts})
                ):
                    rows[column].append(value)

    dataset = datasets.Dataset.from_dict(rows, features=squad_features())
    logger.log(logging.INFO if report.clean else logging.WARNING, "%s", report.summary())
    if return_report:
        return dataset, report
    return dataset


def _read_json(path: Path, name: str) -> Any:
    """The parsed file; malformed or too deeply nested JSON raises :class:`SquadFormatError` naming the file."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SquadFormatError(f"{name}: not valid JSON ({e})") from e
    except ValueError as e:  # Python's limit on integer digits (4,300 by default), e.g. a crafted answer_start
        raise SquadFormatError(f"{name}: not valid SQuAD JSON: {_huge_number(raw, e)}") from None
    except RecursionError:
        raise SquadFormatError(
            f"{name}: not valid SQuAD JSON: nested too deeply to parse (a SQuAD file is 6 levels deep: "
            "data, article, paragraphs, paragraph, qas, answers)"
        ) from None


def _huge_number(raw: bytes, error: ValueError) -> str:
    """Where the integer too long to parse is (the byte offset and the key before it), for the message."""
    match = re.search(rb"\d{%d,}" % (sys.get_int_max_str_digits() + 1), raw) if sys.get_int_max_str_digits() else None
    if match is None:
        return str(error)
    key = re.findall(rb'"([^"\\]{1,64})"\s*:\s*$', raw[max(0, match.start() - 200) : match.start()])
    where = f" (key {key[-1].decode('utf-8', 'replace')!r})" if key else ""
    return (
        f"a number of {match.end() - match.start():,} digits at byte {match.start()}{where}; integers are limited to "
        f"{sys.get_int_max_str_digits():,} digits"
    )


def _articles(top: Any, name: str) -> list:
    if not isinstance(top, dict):
        raise SquadFormatError(f"{name}: the top level must be an object with a 'data' list, got {_type_name(top)}")
    if "data" not in top:
        raise SquadFormatError(f"{name}: missing key 'data' (the list of articles) at the top level")
    articles = top["data"]
    if not isinstance(articles, list):
        raise SquadFormatError(f"{name}: key 'data' must be a list of articles, got {_type_name(articles)}")
    return articles


def _text(value: str, where: str, key: str) -> str:
    """``value`` if it can be stored as UTF-8; a lone surrogate (JSON ``"\\ud800"``) raises SquadFormatError."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise SquadFormatError(
                f"{where}: key '{key}' is not valid Unicode text: a lone surrogate {value[e.start]!r} at character "
                f"{e.start} (an unpaired \\ud800-\\udfff escape in the JSON)"
            ) from None
    return value


def _record(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise SquadFormatError(f"{where}: must be an object, got {_type_name(value)}")
    return value


def _string(record: dict, key: str, where: str) -> str:
    """``record[key]``, which must be a string of valid Unicode text."""
    value = record.get(key)
    if not isinstance(value, str):
        raise _bad_key(record, key, value, where, "a string")
    return _text(value, where, key)


def _list(record: dict, key: str, where: str) -> list:
    value = record.get(key)
    if not isinstance(value, list):
        raise _bad_key(record, key, value, where, "a list")
    return value


def _article_fields(article: Any, name: str, where: str) -> tuple[str, list, str]:
    """(title, paragraphs, where) of one article; the returned ``where`` names it by index and title."""
    article = _record(article, f"{name}: {where}")
    title = article.get("title", "")
    if title is None:
        title = ""
    if not isinstance(title, str):
        raise SquadFormatError(f"{name}: {where}: key 'title' must be a string, got {_type_name(title)}")
    title = _text(title, f"{name}: {where}", "title")
    where = f"{where} ({title!r})" if title else where
    return title, _list(article, "paragraphs", f"{name}: {where}"), where


def _paragraph_fields(para: Any, name: str, where: str) -> tuple[str, list]:
    """(context, qas) of one paragraph."""
    para = _record(para, f"{name}: {where}")
    return _string(para, "context", f"{name}: {where}"), _list(para, "qas", f"{name}: {where}")


def _question_fields(
    qa: Any, name: str, where_p: str, q_idx: int, seen: dict[str, str]
) -> tuple[str, str, list[str], list[int]]:
    """(id, question, answer texts, answer starts) of one question; ``seen`` maps ids to where they occurred."""
    qa = _record(qa, f"{name}: {where_p}, question {q_idx}")
    qid = _string(qa, "id", f"{name}: {where_p}, question {q_idx}")
    place = f"{where_p}, question id {qid!r}"
    if qid in seen:
        raise SquadFormatError(f"{name}: duplicate question id {qid!r}: at {place} and earlier at {seen[qid]}")
    seen[qid] = place
    where = f"{name}: {place}"
    question = _string(qa, "question", where)
    impossible = qa.get("is_impossible", False)
    if impossible is not None and not isinstance(impossible, bool):
        raise SquadFormatError(f"{where}: key 'is_impossible' must be true/false, got {_type_name(impossible)}")
    if qa.get("answers") is None and impossible:
        return qid, question, [], []  # v2 files may omit the (empty) list for unanswerable questions
    texts: list[str] = []
    starts: list[int] = []
    for ans_idx, ans in enumerate(_list(qa, "answers", where)):
        where_ans = f"{where}, answer {ans_idx}"
        ans = _record(ans, where_ans)
        texts.append(_string(ans, "text", where_ans))
        start = ans.get("answer_start")
        if isinstance(start, bool) or not isinstance(start, int):
            raise _bad_key(ans, "answer_start", start, where_ans, "an integer")
        starts.append(start)
    return qid, question, texts, starts


def _align_answers(context: str, texts: list[str], starts: list[int]) -> tuple[int, int]:
    """Re-locate misaligned answers in place (``starts`` updated; -1 when not found); (relocated, unlocatable)."""
    relocated = unlocatable = 0
    for i, (text, start) in enumerate(zip(texts, starts)):
        if not text.strip():
            new = -1
        elif 0 <= start and context.startswith(text, start):
            continue
        else:
            new = _locate(context, text, start)
        if new >= 0:
            relocated += 1
        else:
            unlocatable += 1
        starts[i] = new
    return relocated, unlocatable


def _count_question(report: LoadReport, qid: str, n_answers: int, relocated: int, unlocatable: int) -> None:
    """Add one question to the report."""
    if relocated or unlocatable:
        report.num_questions_misaligned += 1
    if relocated:
        report.num_answers_relocated += relocated
        report.relocated_ids.append(qid)
    if unlocatable:
        report.num_answers_unlocatable += unlocatable
        report.num_questions_with_unlocatable_answers += 1
        report.unlocatable_ids.append(qid)
        if unlocatable == n_answers:
            report.num_questions_excluded_from_training += 1
            report.excluded_from_training_ids.append(qid)
    report.num_questions += 1
    report.num_answers += n_answers
    if n_answers:
        report.num_answerable += 1
    else:
        report.num_unanswerable += 1
