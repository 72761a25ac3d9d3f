"""hflight.qa.data: SQuAD v1.1/v2.0 JSON loading, validation, answer repair and the load report."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from hflight.qa.data import LoadReport, SquadFormatError, load_squad_json

CONTEXT = "Anna was born in Paris. Paris is big. She moved to Rome in 1990."
#          0         1         2         3         4         5         6
#          0123456789012345678901234567890123456789012345678901234567890123


def write(tmp_path: Path, squad, name: str = "squad.json") -> Path:
    path = tmp_path / name
    path.write_text(squad if isinstance(squad, str) else json.dumps(squad), encoding="utf-8")
    return path


def v1_squad() -> dict:
    return {
        "version": "1.1",
        "data": [
            {
                "title": "Anna",
                "paragraphs": [
                    {
                        "context": CONTEXT,
                        "qas": [
                            {
                                "id": "q1",
                                "question": "Where was Anna born?",
                                "answers": [
                                    {"text": "Paris", "answer_start": 17},
                                    {"text": "in Paris", "answer_start": 14},
                                ],
                            },
                            {
                                "id": "q2",
                                "question": "When did she move?",
                                "answers": [{"text": "1990", "answer_start": 59}],
                            },
                        ],
                    },
                    {
                        "context": "Bob is a cook.",
                        "qas": [
                            {"id": "q3", "question": "What is Bob?", "answers": [{"text": "a cook", "answer_start": 7}]}
                        ],
                    },
                ],
            },
            {
                "title": "Second",
                "paragraphs": [
                    {
                        "context": "Zed.",
                        "qas": [{"id": "q4", "question": "Who?", "answers": [{"text": "Zed", "answer_start": 0}]}],
                    }
                ],
            },
        ],
    }


def v2_squad() -> dict:
    return {
        "version": "v2.0",
        "data": [
            {
                "title": "Anna",
                "paragraphs": [
                    {
                        "context": CONTEXT,
                        "qas": [
                            {
                                "id": "a",
                                "question": "Where was Anna born?",
                                "is_impossible": False,
                                "answers": [{"text": "Paris", "answer_start": 17}],
                            },
                            {
                                "id": "b",
                                "question": "Where was Bob born?",
                                "is_impossible": True,
                                "answers": [],
                                "plausible_answers": [{"text": "Paris", "answer_start": 17}],
                            },
                            {
                                "id": "c",
                                "question": "When was Anna born?",
                                "is_impossible": True,
                                "plausible_answers": [{"text": "1990", "answer_start": 59}],
                            },
                        ],
                    }
                ],
            }
        ],
    }


# ---- round trips ----------------------------------------------------------------------------------------------
def test_v1_round_trip(tmp_path):
    ds, report = load_squad_json(write(tmp_path, v1_squad()), return_report=True)
    assert ds.column_names == ["id", "title", "context", "question", "answers"]
    assert ds["id"][:] == ["q1", "q2", "q3", "q4"]
    assert ds["title"][:] == ["Anna", "Anna", "Anna", "Second"]
    assert ds[0] == {
        "id": "q1",
        "title": "Anna",
        "context": CONTEXT,
        "question": "Where was Anna born?",
        "answers": {"text": ["Paris", "in Paris"], "answer_start": [17, 14]},
    }
    assert ds[2]["context"] == "Bob is a cook." and ds[2]["answers"] == {"text": ["a cook"], "answer_start": [7]}
    assert (report.num_articles, report.num_paragraphs, report.num_questions) == (2, 3, 4)
    assert (report.num_answerable, report.num_unanswerable, report.num_answers) == (4, 0, 5)
    assert report.clean and report.version == "1.1" and report.path == str(tmp_path / "squad.json")


def test_v2_round_trip_plausible_answers_are_not_answers(tmp_path):
    ds, report = load_squad_json(write(tmp_path, v2_squad()), return_report=True)
    assert ds["answers"][:] == [
        {"text": ["Paris"], "answer_start": [17]},
        {"text": [], "answer_start": []},
        {"text": [], "answer_start": []},  # is_impossible may omit the (empty) answers list
    ]
    assert (report.num_questions, report.num_answerable, report.num_unanswerable) == (3, 1, 2)
    assert report.clean


def test_impossible_question_with_answers_is_unanswerable_and_reported(tmp_path, caplog):
    squad = v2_squad()
    squad["data"][0]["paragraphs"][0]["qas"][1]["answers"] = [{"text": "Paris", "answer_start": 17}]
    with caplog.at_level(logging.INFO, logger="hflight.qa.data"):
        ds, report = load_squad_json(write(tmp_path, squad), return_report=True)
    assert ds[1]["answers"] == {"text": [], "answer_start": []}
    assert report.num_impossible_with_answers == 1 and report.impossible_with_answers_ids == ["b"]
    assert not report.clean
    assert any(r.levelno == logging.WARNING and "is_impossible" in r.getMessage() for r in caplog.records)


def test_missing_title_is_empty_and_extra_keys_are_ignored(tmp_path):
    squad = v1_squad()
    del squad["data"][1]["title"]
    squad["data"][1]["id"] = "article-id"  # CMRC-style extra keys
    squad["data"][1]["paragraphs"][0]["id"] = "paragraph-id"
    ds = load_squad_json(write(tmp_path, squad))
    assert ds[3]["title"] == ""


def test_empty_data_list_gives_an_empty_dataset(tmp_path):
    ds, report = load_squad_json(write(tmp_path, {"version": "1.1", "data": []}), return_report=True)
    assert len(ds) == 0 and ds.column_names == ["id", "title", "context", "question", "answers"]
    assert report.num_questions == 0


# ---- malformed input ------------------------------------------------------------------------------------------
def _qa(squad, article=0, paragraph=0, question=0):
    return squad["data"][article]["paragraphs"][paragraph]["qas"][question]


MALFORMED = [
    # (mutation, record, key)
    (lambda s: s.pop("data"), "top level", "'data'"),
    (lambda s: s.update(data={"a": 1}), "", "'data'"),
    (lambda s: s["data"].append("article"), "article 2", "must be an object"),
    (lambda s: s["data"][1].pop("paragraphs"), "article 1 ('Second')", "missing key 'paragraphs'"),
    (lambda s: s["data"][1].update(title=7), "article 1", "'title'"),
    (
        lambda s: s["data"][0]["paragraphs"][1].pop("context"),
        "article 0 ('Anna'), paragraph 1",
        "missing key 'context'",
    ),
    (lambda s: s["data"][0]["paragraphs"][1].update(context=None), "article 0 ('Anna'), paragraph 1", "'context'"),
    (lambda s: s["data"][0]["paragraphs"][0].pop("qas"), "article 0 ('Anna'), paragraph 0", "missing key 'qas'"),
    (lambda s: _qa(s, 0, 1).pop("id"), "article 0 ('Anna'), paragraph 1, question 0", "missing key 'id'"),
    (
        lambda s: _qa(s, 0, 1).update(id=3),
        "article 0 ('Anna'), paragraph 1, question 0",
        "wrong type (int) for key 'id'",
    ),
    (lambda s: _qa(s, 0, 0, 1).pop("question"), "paragraph 0, question id 'q2'", "missing key 'question'"),
    (lambda s: _qa(s, 0, 0, 1).update(question=["x"]), "question id 'q2'", "wrong type (list) for key 'question'"),
    (lambda s: _qa(s, 0, 0, 1).pop("answers"), "question id 'q2'", "missing key 'answers'"),
    (
        lambda s: _qa(s, 0, 0, 1).update(answers={"text": "1990"}),
        "question id 'q2'",
        "wrong type (dict) for key 'answers'",
    ),
    (lambda s: _qa(s, 0, 0, 1).update(answers=["1990"]), "question id 'q2', answer 0", "must be an object"),
    (lambda s: _qa(s, 0, 0, 0)["answers"][1].pop("text"), "question id 'q1', answer 1", "missing key 'text'"),
    (
        lambda s: _qa(s, 0, 0, 0)["answers"][1].update(text=5),
        "question id 'q1', answer 1",
        "wrong type (int) for key 'text'",
    ),
    (
        lambda s: _qa(s, 1, 0, 0)["answers"][0].pop("answer_start"),
        "article 1 ('Second'), paragraph 0, question id 'q4', answer 0",
        "missing key 'answer_start'",
    ),
    (
        lambda s: _qa(s, 1, 0, 0)["answers"][0].update(answer_start="0"),
        "question id 'q4', answer 0",
        "wrong type (str) for key 'answer_start'",
    ),
    (
        lambda s: _qa(s, 1, 0, 0)["answers"][0].update(answer_start=0.0),
        "question id 'q4', answer 0",
        "wrong type (float) for key 'answer_start'",
    ),
    (
        lambda s: _qa(s, 1, 0, 0)["answers"][0].update(answer_start=True),
        "question id 'q4', answer 0",
        "wrong type (bool) for key 'answer_start'",
    ),
    (lambda s: _qa(s, 1, 0, 0).update(is_impossible="no"), "question id 'q4'", "'is_impossible'"),
]


@pytest.mark.parametrize("mutate, record, key", MALFORMED)
def test_malformed_record_error_names_file_record_and_key(tmp_path, mutate, record, key):
    squad = v1_squad()
    mutate(squad)
    path = write(tmp_path, squad, "broken-record.json")
    with pytest.raises(SquadFormatError) as error:
        load_squad_json(path)
    message = str(error.value)
    assert isinstance(error.value, ValueError)
    assert message.startswith(str(path) + ":"), message
    if record != "top level":
        assert record in message, message
    assert key in message, message


@pytest.mark.parametrize("raw", [b"{not json", b"", b'{"data": [1, 2', b'{"data": ["\xff"]}'])
def test_malformed_json_names_the_file(tmp_path, raw):
    path = tmp_path / "broken.json"
    path.write_bytes(raw)  # the last one is not UTF-8
    with pytest.raises(SquadFormatError, match=re.escape(str(path)) + ": not valid JSON"):
        load_squad_json(path)


# A lone surrogate (a \\ud800-\\udfff escape without its pair) is valid JSON but not Unicode text: Arrow cannot
# store it, so it used to surface as a raw UnicodeEncodeError from datasets, naming neither file nor record.
SURROGATES = [
    (lambda s: s["data"][1].update(title="Se\ud800cond"), "article 1", "key 'title'"),
    (lambda s: s["data"][0]["paragraphs"][1].update(context="Bob \udfff cook."), "article 0 ('Anna'), paragraph 1",
     "key 'context'"),
    (lambda s: _qa(s, 0, 0, 1).update(question="When\ud83d?"), "question id 'q2'", "key 'question'"),
    (lambda s: _qa(s, 0, 1, 0).update(id="q\udc003"), "article 0 ('Anna'), paragraph 1, question 0", "key 'id'"),
    (lambda s: _qa(s, 1, 0, 0)["answers"][0].update(text="Z\udbffed"), "question id 'q4', answer 0", "key 'text'"),
]  # fmt: skip


@pytest.mark.parametrize("mutate, record, key", SURROGATES)
def test_lone_surrogate_names_file_record_and_key(tmp_path, mutate, record, key):
    squad = v1_squad()
    mutate(squad)
    path = write(tmp_path, json.dumps(squad), "surrogate.json")  # json.dumps escapes it as \\udXXX
    with pytest.raises(SquadFormatError) as error:
        load_squad_json(path)
    message = str(error.value)
    assert message.startswith(str(path) + ":") and record in message and key in message, message
    assert "lone surrogate" in message


def test_surrogate_pairs_are_fine(tmp_path):
    squad = v1_squad()
    _qa(squad, 1, 0, 0)["question"] = "Who \U0001f600?"  # json.dumps writes the pair \\ud83d\\ude00
    assert load_squad_json(write(tmp_path, json.dumps(squad)))["question"][3] == "Who \U0001f600?"


@pytest.mark.parametrize("where", ["top", "data"])
def test_deep_nesting_names_the_file(tmp_path, where):
    deep = "[" * 100_000 + "]" * 100_000
    path = tmp_path / "deep.json"
    path.write_text(deep if where == "top" else '{"data": ' + deep + "}", encoding="utf-8")
    with pytest.raises(SquadFormatError, match=re.escape(str(path)) + ": .*nested too deeply"):
        load_squad_json(path)


def test_an_integer_too_long_for_python_names_the_file_and_the_key(tmp_path):
    """Python refuses to parse integers of more than 4,300 digits (``sys.set_int_max_str_digits``); json.loads then
    raised a bare ValueError naming no file."""
    squad = v1_squad()
    _qa(squad, 0, 0, 0)["answers"][0]["answer_start"] = 7
    text = json.dumps(squad).replace('"answer_start": 7', '"answer_start": ' + "1" * 4301, 1)
    path = write(tmp_path, text, "huge.json")
    with pytest.raises(SquadFormatError) as error:
        load_squad_json(path)
    message = str(error.value)
    assert message.startswith(f"{path}: not valid SQuAD JSON: a number of 4,301 digits at byte "), message
    assert "(key 'answer_start')" in message and "limited to 4,300 digits" in message


def test_top_level_must_be_an_object(tmp_path):
    path = write(tmp_path, [1, 2])
    with pytest.raises(SquadFormatError, match="top level must be an object"):
        load_squad_json(path)


def test_missing_file_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_squad_json(tmp_path / "absent.json")


def test_duplicate_question_id_names_the_id_and_both_places(tmp_path):
    squad = v1_squad()
    _qa(squad, 1, 0, 0)["id"] = "q2"
    path = write(tmp_path, squad)
    with pytest.raises(SquadFormatError, match="duplicate question id 'q2'") as error:
        load_squad_json(path)
    message = str(error.value)
    assert str(path) in message
    assert "article 1 ('Second'), paragraph 0" in message and "article 0 ('Anna'), paragraph 0" in message


# ---- misaligned answers ---------------------------------------------------------------------------------------
def misaligned_squad() -> dict:
    qas = [
        # "Paris" occurs at 17 and 24: a start of 26 is nearest to 24, a start of 19 nearest to 17.
        {"id": "near-second", "question": "?", "answers": [{"text": "Paris", "answer_start": 26}]},
        {"id": "near-first", "question": "?", "answers": [{"text": "Paris", "answer_start": 19}]},
        {"id": "minus-one-found", "question": "?", "answers": [{"text": "Rome", "answer_start": -1}]},
        {"id": "past-the-end", "question": "?", "answers": [{"text": "1990", "answer_start": 500}]},
        {"id": "absent", "question": "?", "answers": [{"text": "London", "answer_start": 3}]},
        {
            "id": "mixed",
            "question": "?",
            "answers": [{"text": "Berlin", "answer_start": -1}, {"text": "Rome", "answer_start": 51}],
        },
        {"id": "blank", "question": "?", "answers": [{"text": "  ", "answer_start": 3}]},
        {"id": "fine", "question": "?", "answers": [{"text": "Anna", "answer_start": 0}]},
    ]
    return {"version": "1.1", "data": [{"title": "T", "paragraphs": [{"context": CONTEXT, "qas": qas}]}]}


def test_misaligned_answers_are_relocated_to_the_nearest_occurrence_or_kept_with_minus_one(tmp_path, caplog):
    path = write(tmp_path, misaligned_squad(), "misaligned.json")
    with caplog.at_level(logging.INFO, logger="hflight.qa.data"):
        ds, report = load_squad_json(path, return_report=True)
    starts = {row["id"]: row["answers"]["answer_start"] for row in ds}
    assert starts == {
        "near-second": [24],
        "near-first": [17],
        "minus-one-found": [51],
        "past-the-end": [59],
        "absent": [-1],
        "mixed": [-1, 51],
        "blank": [-1],
        "fine": [0],
    }
    for row in ds:  # every kept start points at its text
        for text, start in zip(row["answers"]["text"], row["answers"]["answer_start"]):
            assert start == -1 or CONTEXT[start : start + len(text)] == text
    assert len(ds) == 8  # nothing dropped
    assert report.num_answers_relocated == 4
    assert report.relocated_ids == ["near-second", "near-first", "minus-one-found", "past-the-end"]
    assert report.num_answers_unlocatable == 3
    assert report.unlocatable_ids == ["absent", "mixed", "blank"]
    assert report.num_questions_with_unlocatable_answers == 3
    assert report.num_questions_misaligned == 7
    assert report.excluded_from_training_ids == ["absent", "blank"]  # "mixed" still has a usable answer
    assert report.num_questions_excluded_from_training == 2
    assert not report.clean

    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "misaligned.json" in warnings[0]
    assert "near-second" in warnings[0] and "absent" in warnings[0]
    assert "excluded from training" in warnings[0]


def test_log_lists_only_the_first_few_ids(tmp_path, caplog):
    qas = [{"id": f"x{i}", "question": "?", "answers": [{"text": "Nowhere", "answer_start": 0}]} for i in range(12)]
    path = write(tmp_path, {"data": [{"title": "T", "paragraphs": [{"context": CONTEXT, "qas": qas}]}]})
    with caplog.at_level(logging.WARNING, logger="hflight.qa.data"):
        _, report = load_squad_json(path, return_report=True)
    message = caplog.records[-1].getMessage()
    assert "x0" in message and "x4" in message and "x5," not in message and "and 7 more" in message
    assert len(report.unlocatable_ids) == 12  # the report keeps all of them


def test_clean_file_logs_at_info(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="hflight.qa.data"):
        load_squad_json(write(tmp_path, v1_squad(), "clean.json"))
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "clean.json: 2 articles, 3 paragraphs, 4 questions" in caplog.records[0].getMessage()


def test_report_summary_and_counts():
    report = LoadReport(path="/x/y.json", num_questions=2, num_answerable=2, num_answers=2)
    assert report.summary().startswith("y.json: 0 articles")
    counts = report.as_dict()
    assert counts["num_questions"] == 2 and "relocated_ids" not in counts
    assert report.clean


def test_loading_is_repeatable(tmp_path):
    path = write(tmp_path, misaligned_squad())
    (first, report1), (second, report2) = (load_squad_json(path, return_report=True) for _ in range(2))
    assert first[:] == second[:] and report1 == report2


# ---- real data (../shared/data) --------------------------------------------------------------------------------
def test_real_squad_v1_dev(shared_data):
    ds, report = load_squad_json(shared_data / "squad-v1.1" / "dev-v1.1.json", return_report=True)
    assert (report.num_articles, report.num_paragraphs, report.num_questions) == (48, 2067, 10570)
    assert len(ds) == 10570 and len(set(ds["id"])) == 10570
    assert report.num_answerable == 10570 and report.num_answers == 34726
    assert report.clean and report.num_questions_excluded_from_training == 0
    first = ds[0]
    assert first["title"] == "Super_Bowl_50" and first["answers"]["text"][0] == "Denver Broncos"


def test_real_squad_v2_half(shared_data):
    ds, report = load_squad_json(shared_data / "squad-v2.0-half" / "dev-v2.0-half.json", return_report=True)
    assert (report.num_articles, report.num_paragraphs, report.num_questions) == (16, 646, 6078)
    assert (report.num_unanswerable, report.num_answerable) == (3168, 2910)
    assert sum(1 for a in ds["answers"] if not a["text"]) == 3168  # plausible_answers are not answers
    assert report.clean


def test_real_xquad_en(shared_data):
    ds, report = load_squad_json(shared_data / "xquad" / "xquad.en.json", return_report=True)
    assert (report.num_articles, report.num_paragraphs, len(ds)) == (48, 240, 1190)
    assert report.clean


def test_real_cmrc2018_misaligned_answers_are_reported(shared_data, caplog):
    path = shared_data / "cmrc2018" / "cmrc2018_dev.json"
    with caplog.at_level(logging.WARNING, logger="hflight.qa.data"):
        ds, report = load_squad_json(path, return_report=True)
    assert (report.num_articles, len(ds)) == (848, 3219)
    # The data README: 200 answers in 176 questions do not align with their context; 193 have
    # answer_start -1 (their text is not in the context) and 7 are off by 1-2 characters (re-located).
    assert report.num_answers_relocated + report.num_answers_unlocatable == 200
    assert report.num_questions_misaligned == 176
    assert report.num_answers_unlocatable == 193
    assert report.num_answers_relocated == 7
    assert report.relocated_ids == ["DEV_101_QUERY_3", "DEV_110_QUERY_2", "DEV_110_QUERY_3"]
    assert report.num_questions_excluded_from_training == 0  # each has at least one usable answer
    starts = [s for a in ds["answers"] for s in a["answer_start"]]
    assert starts.count(-1) == 193
    for row in ds:
        for text, start in zip(row["answers"]["text"], row["answers"]["answer_start"]):
            assert start == -1 or row["context"][start : start + len(text)] == text
    assert any("cmrc2018_dev.json" in r.getMessage() and "DEV_101_QUERY_3" in r.getMessage() for r in caplog.records)
