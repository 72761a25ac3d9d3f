"""Shared fixtures: real public QA data from ../shared/data (skipped when absent)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The folder of real SQuAD-format data sets; skips the test when a fresh clone has none beside it."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real QA data not found at {SHARED_DATA} (only present beside the team's checkouts)")
    return SHARED_DATA
