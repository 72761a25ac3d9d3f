"""Data and model shared by the job scripts in this folder (imported as a sibling module when they run)."""

import datasets
import numpy as np
import torch
from transformers import BertConfig, BertForQuestionAnswering


def qa_windows(n: int, seed: int, length: int, max_start: int) -> datasets.Dataset:
    """``n`` random token windows with answer spans ``[start, start + 2]``, ``start < max_start``."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, 100, size=(n, length))
    start = rng.integers(1, max_start, size=n)
    return datasets.Dataset.from_dict(
        {
            "input_ids": ids.tolist(),
            "attention_mask": np.ones_like(ids).tolist(),
            "start_positions": start.tolist(),
            "end_positions": (start + 2).tolist(),
        }
    )


def tiny_bert_qa(seed: int, hidden: int, layers: int, dropout: float, max_positions: int) -> BertForQuestionAnswering:
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=100,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=hidden * 2,
        max_position_embeddings=max_positions,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    return BertForQuestionAnswering(config)
