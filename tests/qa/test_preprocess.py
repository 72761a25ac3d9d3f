"""hflight.qa.tokenizer (local WordPiece) and hflight.qa.preprocess (run_qa.py feature functions)."""

from __future__ import annotations

import copy
import functools
import json
import logging

import pytest
from transformers import AutoTokenizer

from hflight.qa.data import load_squad_json
from hflight.qa.preprocess import prepare_train_features, prepare_validation_features
from hflight.qa.tokenizer import SPECIAL_TOKENS, squad_texts, train_wordpiece_tokenizer


# ---- tokenizer ------------------------------------------------------------------------------------------------
def test_tokenizer_trains_saves_and_reloads_as_a_fast_bert_tokenizer(tiny_wordpiece):
    folder = tiny_wordpiece.name_or_path
    again = AutoTokenizer.from_pretrained(folder)
    assert tiny_wordpiece.is_fast and again.is_fast
    assert type(again).__name__ == "BertTokenizer"  # transformers 5: BertTokenizer is the fast one
    assert [tiny_wordpiece.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert (tiny_wordpiece.pad_token, tiny_wordpiece.cls_token, tiny_wordpiece.sep_token) == ("[PAD]", "[CLS]", "[SEP]")
    assert tiny_wordpiece.model_max_length == 512 and tiny_wordpiece.padding_side == "right"
    assert len(tiny_wordpiece) == 800
    pair = again("Where was Anna born?", "Anna Novak was born in Lisbon.")
    tokens = again.convert_ids_to_tokens(pair["input_ids"])
    assert tokens[0] == "[CLS]" and tokens.count("[SEP]") == 2 and tokens[-1] == "[SEP]"
    assert "where" in tokens and "born" in tokens  # lowercased
    sep = tokens.index("[SEP]")
    assert pair["token_type_ids"] == [0] * (sep + 1) + [1] * (len(tokens) - sep - 1)
    assert pair == tiny_wordpiece("Where was Anna born?", "Anna Novak was born in Lisbon.")


def test_tokenizer_is_deterministic(tmp_path, synthetic_files):
    texts = list(squad_texts(*synthetic_files))
    first = train_wordpiece_tokenizer(texts, tmp_path / "a", vocab_size=700)
    second = train_wordpiece_tokenizer(iter(texts), tmp_path / "b", vocab_size=700)
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    assert (tmp_path / "a" / "vocab.txt").read_text() == (tmp_path / "b" / "vocab.txt").read_text()
    assert first.get_vocab() == second.get_vocab()


def test_cased_tokenizer_keeps_case(tmp_path, synthetic_files):
    cased = train_wordpiece_tokenizer(squad_texts(*synthetic_files), tmp_path, vocab_size=900, lowercase=False)
    tokens = cased.tokenize("Anna was born in Lisbon.")
    assert any(t[0].isupper() for t in tokens)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["do_lower_case"] is False


def test_tokenizer_rejects_non_strings(tmp_path):
    with pytest.raises(TypeError, match="text 1 is a int"):
        train_wordpiece_tokenizer(["a b c", 5], tmp_path)


def test_squad_texts_reads_files_and_dicts(synthetic_files):
    with open(synthetic_files[0], encoding="utf-8") as f:
        squad = json.load(f)
    from_file, from_dict = list(squad_texts(synthetic_files[0])), list(squad_texts(squad))
    assert from_file == from_dict
    paragraph = squad["data"][0]["paragraphs"][0]
    assert from_file[: 1 + len(paragraph["qas"])] == [paragraph["context"]] + [q["question"] for q in paragraph["qas"]]


# ---- helpers --------------------------------------------------------------------------------------------------
def featurize(dataset, function, tokenizer, **kwargs):
    return dataset.map(
        functools.partial(function, tokenizer=tokenizer, **kwargs),
        batched=True,
        remove_columns=dataset.column_names,
    )


def first_locatable(answers):
    for text, start in zip(answers["text"], answers["answer_start"]):
        if start >= 0 and text.strip():
            lead = len(text) - len(text.lstrip())
            return start + lead, start + lead + len(text.strip())
    return None


class RecordingTokenizer:
    """Delegates to a tokenizer and keeps (a shallow copy of) each windowed encoding it returns."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.encodings = []

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __call__(self, *args, **kwargs):
        out = self._tokenizer(*args, **kwargs)
        if kwargs.get("return_offsets_mapping"):
            self.encodings.append(copy.copy(out))  # the feature functions pop keys from ``out``
        return out


def check_round_trip(examples: dict, tokenizer, max_seq_length: int, doc_stride: int, exact: bool = False):
    """Check every training label against the offsets and sequence ids of its own window.

    Returns (#windows labelled with a span, #spans that are exactly the answer text, #features,
    ids of answerable examples that no window labels).
    """
    recorder = RecordingTokenizer(tokenizer)
    train = prepare_train_features(examples, recorder, max_seq_length, doc_stride)
    (enc,) = recorder.encodings
    assert train["input_ids"] == enc["input_ids"]
    contexts = examples["context"]
    # the examples that were tokenized: unanswerable ones and those with a locatable answer
    kept = [i for i, a in enumerate(examples["answers"]) if not a["text"] or first_locatable(a)]
    context_id = 1 if tokenizer.padding_side == "right" else 0
    labelled = exact_count = 0
    windows_with_answer: set[int] = set()
    for f, (start, end) in enumerate(zip(train["start_positions"], train["end_positions"])):
        i = kept[enc["overflow_to_sample_mapping"][f]]
        cls = enc["input_ids"][f].index(tokenizer.cls_token_id)
        span = first_locatable(examples["answers"][i])
        if span is None:  # unanswerable
            assert (start, end) == (cls, cls)
            continue
        seq = enc.sequence_ids(f)
        offsets = enc["offset_mapping"][f]
        first = seq.index(context_id)
        last = len(seq) - 1 - seq[::-1].index(context_id)
        if not (offsets[first][0] <= span[0] and offsets[last][1] >= span[1]):  # not fully in this window
            assert (start, end) == (cls, cls)
            continue
        labelled += 1
        windows_with_answer.add(i)
        assert first <= start <= end <= last
        # The labelled tokens are the minimal token cover of the answer's characters.
        assert offsets[start][0] <= span[0] < offsets[start][1] or offsets[start][0] == span[0]
        assert offsets[end][0] < span[1] <= offsets[end][1] or offsets[end][1] == span[1]
        covered = contexts[i][offsets[start][0] : offsets[end][1]]
        answer = contexts[i][span[0] : span[1]]
        assert answer in covered
        exact_count += covered == answer
        if exact:
            assert covered == answer
    answerable = {examples["id"][i] for i in kept if examples["answers"][i]["text"]}
    return labelled, exact_count, len(train["input_ids"]), answerable - {examples["id"][i] for i in windows_with_answer}


# ---- label round trip -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_seq_length, doc_stride", [(128, 32), (48, 16)])
def test_labels_round_trip_on_synthetic_data(synthetic_files, tiny_wordpiece, max_seq_length, doc_stride):
    examples = load_squad_json(synthetic_files[0])[:]
    labelled, exact, n_features, missing = check_round_trip(
        examples, tiny_wordpiece, max_seq_length, doc_stride, exact=True
    )
    assert not missing  # every answer lies fully inside at least one window
    assert labelled >= len(examples["id"])
    if max_seq_length == 48:
        assert n_features > 2 * len(examples["id"])  # long contexts overflow into several windows


def test_labels_round_trip_on_synthetic_v2_data(synthetic_v2_files, tiny_wordpiece):
    examples = load_squad_json(synthetic_v2_files[0])[:]
    labelled, _, _, missing = check_round_trip(examples, tiny_wordpiece, 64, 24, exact=True)
    assert not missing and labelled > 0


@pytest.mark.parametrize(
    "relative, n_examples, n_answerable",
    [("squad-v1.1/dev-v1.1.json", 10570, 10570), ("squad-v2.0-half/dev-v2.0-half.json", 6078, 2910)],
)
def test_labels_round_trip_on_real_data(shared_data, real_tokenizer, relative, n_examples, n_answerable):
    examples = load_squad_json(shared_data / relative)[:]
    assert len(examples["id"]) == n_examples
    labelled, exact, n_features, missing = check_round_trip(examples, real_tokenizer, 384, 128)
    assert not missing  # every answer of SQuAD dev fits in some 384-token window
    assert n_features >= n_examples and labelled >= n_answerable
    assert exact >= 0.99 * labelled  # the rest: answers that end inside a word piece (e.g. "1990" of "1990s")


def test_run_qa_edge_answer_in_the_last_context_token_of_a_window(tiny_wordpiece):
    """Every word of a long context is an answer once: windows end on answers too, labels stay in the context."""
    words = [f"w{i}" for i in range(40)]
    context = " ".join(words)
    starts = [len(" ".join(words[:i])) + (1 if i else 0) for i in range(len(words))]
    examples = {
        "id": [f"e{i}" for i in range(len(words))],
        "question": ["which one?"] * len(words),
        "context": [context] * len(words),
        "answers": [{"text": [w], "answer_start": [s]} for w, s in zip(words, starts)],
    }
    labelled, exact, _, missing = check_round_trip(examples, tiny_wordpiece, 24, 8, exact=True)
    assert not missing and labelled == exact >= len(words)


# ---- training features: exclusions, whitespace, unanswerable ----------------------------------------------------
def batch(*rows):
    return {
        "id": [r[0] for r in rows],
        "question": [r[1] for r in rows],
        "context": [r[2] for r in rows],
        "answers": [{"text": r[3], "answer_start": r[4]} for r in rows],
    }


CTX = "Anna Novak was born in Lisbon in 1950."


def test_unlocatable_answers_are_excluded_and_logged(tiny_wordpiece, caplog):
    examples = batch(
        ("ok", "Where was Anna born?", CTX, ["Lisbon"], [23]),
        ("lost", "When was Anna born?", CTX, ["1951"], [-1]),
        ("second", "When was Anna born?", CTX, ["nineteen", "1950"], [-1, 33]),
        ("wrong-start", "Who?", CTX, ["Anna"], [5]),  # not from load_squad_json: start does not point at the text
        ("none", "What?", CTX, [], []),
    )
    with caplog.at_level(logging.WARNING, logger="hflight.qa.preprocess"):
        features = prepare_train_features(examples, tiny_wordpiece, 64, 16)
    assert len(features["input_ids"]) == 3  # "lost" and "wrong-start" give no features
    messages = [r.getMessage() for r in caplog.records]
    assert (
        len(messages) == 1 and "2 question(s)" in messages[0] and "lost" in messages[0] and "wrong-start" in messages[0]
    )
    tokens = [tiny_wordpiece.convert_ids_to_tokens(ids) for ids in features["input_ids"]]
    s, e = features["start_positions"][0], features["end_positions"][0]
    assert "".join(t.removeprefix("##") for t in tokens[0][s : e + 1]) == "lisbon"
    s, e = features["start_positions"][1], features["end_positions"][1]  # the second answer is used
    assert "".join(t.removeprefix("##") for t in tokens[1][s : e + 1]) == "1950"
    assert features["start_positions"][2] == features["end_positions"][2] == 0  # unanswerable -> CLS


def test_a_batch_of_only_unlocatable_answers_gives_empty_columns(tiny_wordpiece):
    features = prepare_train_features(batch(("lost", "q?", CTX, ["zzz"], [-1])), tiny_wordpiece, 64, 16)
    assert set(features) >= {"input_ids", "attention_mask", "start_positions", "end_positions"}
    assert all(v == [] for v in features.values())


def test_answer_whitespace_is_not_labelled(tiny_wordpiece):
    features = prepare_train_features(batch(("ws", "Where?", CTX, [" Lisbon "], [22])), tiny_wordpiece, 64, 16)
    tokens = tiny_wordpiece.convert_ids_to_tokens(features["input_ids"][0])
    s, e = features["start_positions"][0], features["end_positions"][0]
    assert "".join(t.removeprefix("##") for t in tokens[s : e + 1]) == "lisbon"
    assert tokens[s - 1] == "in" and tokens[e + 1] == "in"


def test_question_is_lstripped_and_input_not_mutated(tiny_wordpiece):
    examples = batch(("a", "   Where was Anna born?", CTX, ["Lisbon"], [23]))
    features = prepare_train_features(examples, tiny_wordpiece, 64, 16)
    assert examples["question"] == ["   Where was Anna born?"]
    plain = prepare_train_features(batch(("a", "Where was Anna born?", CTX, ["Lisbon"], [23])), tiny_wordpiece, 64, 16)
    assert features == plain
    assert set(features) == {"input_ids", "token_type_ids", "attention_mask", "start_positions", "end_positions"}


# ---- validation features --------------------------------------------------------------------------------------
def test_validation_features_example_ids_offsets_and_windows(synthetic_files, tiny_wordpiece):
    examples = load_squad_json(synthetic_files[1])
    features = featurize(examples, prepare_validation_features, tiny_wordpiece, max_seq_length=48, doc_stride=16)
    assert features.column_names == ["input_ids", "token_type_ids", "attention_mask", "example_id", "offset_mapping"]
    ids = list(examples["id"])
    assert len(features) > 2 * len(ids)  # overflow windows
    assert set(features["example_id"]) == set(ids)
    # windows of one example are consecutive and in order of the examples
    order = [ids.index(e) for e in features["example_id"]]
    assert order == sorted(order)
    enc = tiny_wordpiece(
        [q.lstrip() for q in examples["question"]],
        list(examples["context"]),
        truncation="only_second",
        max_length=48,
        stride=16,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
        padding="max_length",
    )
    windows_by_example: dict[str, list[list[int]]] = {}
    for f in range(len(features)):
        row = features[f]
        assert len(row["input_ids"]) == 48
        assert row["example_id"] == ids[enc["overflow_to_sample_mapping"][f]]
        seq = enc.sequence_ids(f)
        for k, (offset, s) in enumerate(zip(row["offset_mapping"], seq)):
            if s == 1:
                assert tuple(offset) == tuple(enc["offset_mapping"][f][k])
            else:
                assert offset is None  # [CLS], question, [SEP], padding
        windows_by_example.setdefault(row["example_id"], []).append(
            [t for t, s in zip(row["input_ids"], seq) if s == 1]
        )
    # consecutive windows of a context overlap by doc_stride tokens
    overlapped = 0
    for windows in windows_by_example.values():
        for left, right in zip(windows, windows[1:]):
            assert left[-16:] == right[:16]
            overlapped += 1
    assert overlapped > 0


def test_dynamic_padding_leaves_windows_unpadded(synthetic_files, tiny_wordpiece):
    examples = load_squad_json(synthetic_files[0]).select(range(40))
    for function in (prepare_train_features, prepare_validation_features):
        padded = featurize(examples, function, tiny_wordpiece, max_seq_length=64, doc_stride=16)
        dynamic = featurize(
            examples, function, tiny_wordpiece, max_seq_length=64, doc_stride=16, pad_to_max_length=False
        )
        assert len(padded) == len(dynamic)
        assert all(len(ids) == 64 for ids in padded["input_ids"])
        lengths = [len(ids) for ids in dynamic["input_ids"]]
        assert max(lengths) <= 64 and min(lengths) < 64
        assert all(tiny_wordpiece.pad_token_id not in ids for ids in dynamic["input_ids"])
        for p, d in zip(padded, dynamic):
            n = len(d["input_ids"])
            assert p["input_ids"][:n] == d["input_ids"] and set(p["attention_mask"][n:]) <= {0}
            if function is prepare_train_features:
                assert (p["start_positions"], p["end_positions"]) == (d["start_positions"], d["end_positions"])


def test_left_padding_tokenizer_puts_the_context_first(synthetic_files, tiny_wordpiece, tmp_path):
    tiny_wordpiece.save_pretrained(tmp_path)
    left = AutoTokenizer.from_pretrained(tmp_path, padding_side="left")
    assert left.padding_side == "left"
    examples = load_squad_json(synthetic_files[0])[:]
    labelled, _, _, missing = check_round_trip(examples, left, 48, 16, exact=True)  # context is sequence 0 here
    assert not missing and labelled >= len(examples["id"])
    features = prepare_validation_features(examples, left, 48, 16)
    padded = 0
    for ids, offsets in zip(features["input_ids"], features["offset_mapping"]):
        cls, first_sep = ids.index(left.cls_token_id), ids.index(left.sep_token_id)
        assert set(ids[:cls]) <= {left.pad_token_id}  # padding on the left
        padded += cls > 0
        assert all(o is None for o in offsets[: cls + 1])
        assert all(o is not None for o in offsets[cls + 1 : first_sep])  # the context comes first ...
        assert all(o is None for o in offsets[first_sep:])  # ... and the question after it
    assert padded > 0


def test_no_answer_label_is_the_cls_token_else_the_bos_token_else_0(tiny_wordpiece, tmp_path):
    """Windows without the answer are labelled with the CLS token's index; a tokenizer that has no CLS token
    uses its BOS token's, and one with neither uses 0. Left padding moves the CLS token off index 0."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tiny_wordpiece.save_pretrained(tmp_path)
    with_cls = AutoTokenizer.from_pretrained(tmp_path, padding_side="left")

    def without_cls(**special):
        backend = Tokenizer.from_str(with_cls.backend_tokenizer.to_str())  # a copy: the fixture stays untouched
        return PreTrainedTokenizerFast(
            tokenizer_object=backend, pad_token="[PAD]", padding_side="left", model_max_length=512, **special
        )

    context = CTX + " She works as a baker." * 6 + " She plays the violin."
    examples = batch(
        ("violin", "What does Anna play?", context, ["violin"], [context.index("violin")]),
        ("none", "Where was Olga born?", context, [], []),
        ("short", "Where was Olga born?", CTX, [], []),  # one window, padded
    )
    reference = prepare_train_features(examples, with_cls, 32, 8)
    labels = list(zip(reference["start_positions"], reference["end_positions"]))
    cls = [ids.index(with_cls.cls_token_id) for ids in reference["input_ids"]]
    assert any(c > 0 and label == (c, c) for c, label in zip(cls, labels))  # a padded window without the answer
    assert any(label != (c, c) for c, label in zip(cls, labels))  # and the answer somewhere

    bos_only = without_cls(bos_token="[CLS]")
    assert bos_only.cls_token_id is None and bos_only.bos_token_id == with_cls.cls_token_id
    by_bos = prepare_train_features(examples, bos_only, 32, 8)
    assert by_bos["input_ids"] == reference["input_ids"]
    assert list(zip(by_bos["start_positions"], by_bos["end_positions"])) == labels

    neither = without_cls()
    assert neither.cls_token_id is None and neither.bos_token_id is None
    by_zero = prepare_train_features(examples, neither, 32, 8)
    assert by_zero["input_ids"] == reference["input_ids"]
    expected = [(0, 0) if label == (c, c) else label for c, label in zip(cls, labels)]
    assert list(zip(by_zero["start_positions"], by_zero["end_positions"])) == expected


# ---- argument checks ------------------------------------------------------------------------------------------
def test_slow_tokenizer_is_a_type_error(tiny_wordpiece):
    from transformers import BertTokenizerLegacy  # the Python ("slow") BERT tokenizer of transformers 5

    slow = BertTokenizerLegacy(f"{tiny_wordpiece.name_or_path}/vocab.txt")
    assert not slow.is_fast
    examples = batch(("a", "Where?", CTX, ["Lisbon"], [23]))
    for function in (prepare_train_features, prepare_validation_features):
        with pytest.raises(TypeError, match="requires a fast tokenizer"):
            function(examples, slow)
    with pytest.raises(TypeError, match="requires a fast tokenizer"):  # even when no example is trainable
        prepare_train_features(batch(("lost", "Where?", CTX, ["Rome"], [-1])), slow)


@pytest.mark.parametrize(
    "max_seq_length, doc_stride, message",
    [
        (32, 40, "doc_stride"),
        (32, 29, "doc_stride"),  # 32 - 3 special tokens = 29 tokens for question + context
        (0, 0, "max_seq_length must be a positive integer"),
        (64.0, 16, "max_seq_length must be a positive integer"),
        (64, -1, "doc_stride must be a non-negative integer"),
    ],
)
def test_window_settings_are_checked(tiny_wordpiece, max_seq_length, doc_stride, message):
    examples = batch(("a", "Where?", CTX, ["Lisbon"], [23]))
    for function in (prepare_train_features, prepare_validation_features):
        with pytest.raises(ValueError, match=message):
            function(examples, tiny_wordpiece, max_seq_length, doc_stride)


def test_question_too_long_for_the_stride_names_the_question(tiny_wordpiece):
    long_question = "where was anna born " * 5
    n = len(tiny_wordpiece(long_question, add_special_tokens=False)["input_ids"])
    room = 64 - 3 - n  # context tokens per window
    assert room > 0
    examples = batch(("fine", "Where?", CTX, ["Lisbon"], [23]), ("long-one", long_question, CTX, ["Lisbon"], [23]))
    message = rf"question id 'long-one' is {n} tokens long, which leaves {room} context tokens per window"
    with pytest.raises(ValueError, match=message):
        prepare_train_features(examples, tiny_wordpiece, 64, room)
    with pytest.raises(ValueError, match="long-one"):
        prepare_validation_features(examples, tiny_wordpiece, 64, room + 5)
    assert len(prepare_validation_features(examples, tiny_wordpiece, 64, room - 1)["input_ids"]) >= 2


def test_max_seq_length_above_the_model_maximum_is_clamped_with_a_warning(tiny_wordpiece, tmp_path, caplog):
    tiny_wordpiece.save_pretrained(tmp_path)
    short = AutoTokenizer.from_pretrained(tmp_path, model_max_length=40)
    with caplog.at_level(logging.WARNING, logger="hflight.qa.preprocess"):
        features = prepare_validation_features(batch(("a", "Where?", CTX * 5, ["Lisbon"], [23])), short, 384, 8)
    assert {len(ids) for ids in features["input_ids"]} == {40}
    assert any("larger than the model's maximum length (40)" in r.getMessage() for r in caplog.records)
