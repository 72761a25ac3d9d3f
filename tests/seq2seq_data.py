"""Tiny sequence-to-sequence inputs built locally (no downloads): a word-level "summarization" task, a WordPiece
tokenizer trained on it, and a tiny BART model saved with ``save_pretrained`` (its ``generation_config.json``
included), as transformers' run_summarization/run_translation scripts read them."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec "
    "romeo sierra tango uniform victor whiskey xray yankee zulu red green blue black white orange purple"
).split()


def summarization_records(n: int, seed: int) -> list[dict[str, str]]:
    """``n`` records ``{"text", "summary"}``: 4-11 random words, summarised by the first three of them reversed
    (learnable, and of varying lengths, so generated batches differ in length)."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 11))]
        summary = list(reversed(words[: rng.randint(1, 3)]))
        records.append({"text": " ".join(words), "summary": " ".join(summary)})
    return records


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def tokenizer(root: Path):
    """A BERT-style WordPiece tokenizer over :data:`WORDS` ([PAD]=0, [CLS]=2, [SEP]=3), saved in ``root``."""
    from hflight.qa.tokenizer import train_wordpiece_tokenizer

    return train_wordpiece_tokenizer([" ".join(WORDS)] * 3, root, vocab_size=400, min_frequency=1)


def bart_model(vocab_size: int, dropout: float = 0.1, seed: int = 0):
    """A tiny BART (d_model 32, one encoder and one decoder layer) with the tokenizer's special tokens; weights drawn
    wide (``init_std`` 0.3) so that even untrained it generates varied sequences of varied lengths."""
    import torch
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=vocab_size,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        dropout=dropout,
        attention_dropout=dropout,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
        decoder_start_token_id=3,
        forced_eos_token_id=3,
        init_std=0.3,
    )
    torch.manual_seed(seed)
    return BartForConditionalGeneration(config)


def summarization_inputs(root: Path, n_train: int = 48, n_eval: int = 20, dropout: float = 0.1) -> dict[str, Path]:
    """Train/validation/test JSON-lines files and a saved model folder (model + tokenizer) under ``root``; paths
    under "train", "validation", "test", "model"."""
    root.mkdir(parents=True, exist_ok=True)
    paths = {
        "train": write_jsonl(root / "train.json", summarization_records(n_train, seed=1)),
        "validation": write_jsonl(root / "validation.json", summarization_records(n_eval, seed=2)),
        "test": write_jsonl(root / "test.json", summarization_records(n_eval, seed=3)),
        "model": root / "model",
    }
    tok = tokenizer(root / "tokenizer")
    bart_model(len(tok), dropout).save_pretrained(paths["model"])
    tok.save_pretrained(paths["model"])
    return paths


def clm_inputs(root: Path, validation_lines: int = 16) -> dict[str, Path]:
    """What run_clm.py reads: text files of random word sentences and a tiny GPT-2 (dropout 0.1) saved with the
    WordPiece tokenizer (run by tests/dropin.py's users and benchmarks/eval_load.py)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    root.mkdir(parents=True)
    rng = random.Random(11)
    paths = {}
    for name, lines in (("train", 50), ("validation", validation_lines)):
        text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10)))
                         for _ in range(lines))  # fmt: skip
        paths[name] = root / f"{name}.txt"
        paths[name].write_text(text + "\n", encoding="utf-8")
    made = tokenizer(root / "tokenizer")
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(made), n_embd=32, n_layer=2, n_head=2, n_positions=64,
                        bos_token_id=2, eos_token_id=3, pad_token_id=0)  # fmt: skip
    paths["model"] = root / "model"
    GPT2LMHeadModel(config).save_pretrained(paths["model"])
    made.save_pretrained(paths["model"])
    return paths
