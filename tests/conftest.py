"""Shared fixtures: real public QA data from ../shared/data (skipped when absent)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """A run with ``cpu_threads`` set (the tests' tiny runs set 1) changes torch's threads for the whole process;
    each test starts with the session's, so results never depend on which tests ran before."""
    import torch

    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _signal_handlers_restored():
    """A library a test starts may install process-wide signal handlers and keep them (``ray.init`` sets SIGTERM to
    ``sys.exit(15)``); each test starts with the session's handlers, so a signal test never sees another test's."""
    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)
    handlers = {signum: signal.getsignal(signum) for signum in signals}
    yield
    for signum, handler in handlers.items():
        if signal.getsignal(signum) is not handler and handler is not None:
            signal.signal(signum, handler)


@pytest.fixture
def one_torch_thread():
    """Generation tests: many tiny steps, on a shared 2-core machine far faster on one thread than on two contending
    (``_torch_threads_restored`` puts the session's count back afterwards)."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The folder of real SQuAD-format data sets; skips the test when a fresh clone has none beside it."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real QA data not found at {SHARED_DATA} (only present beside the team's checkouts)")
    return SHARED_DATA


# ---- tiny models and data built locally (no downloads) --------------------------------------------------------
class Factory:
    """Builds tiny BERT models from configs and small random datasets, deterministically."""

    VOCAB = 100
    #: Arguments of short runs compared between transformers.Trainer and hflight.Trainer (one log entry per step).
    PAIR_ARGS = dict(
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        num_train_epochs=1,
        learning_rate=1e-3,
        logging_steps=1,
        train_sampling_strategy="sequential",
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
    )

    @staticmethod
    def pair_args(**overrides):
        """:attr:`PAIR_ARGS` with ``overrides``."""
        return {**Factory.PAIR_ARGS, **overrides}

    @staticmethod
    def config(dropout: float = 0.0, **overrides):
        from transformers import BertConfig

        values = dict(
            vocab_size=Factory.VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
            hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=dropout,
        )
        values.update(overrides)
        return BertConfig(**values)

    @staticmethod
    def qa_model(seed: int = 0, dropout: float = 0.0):
        import torch
        from transformers import BertForQuestionAnswering

        torch.manual_seed(seed)
        return BertForQuestionAnswering(Factory.config(dropout))

    @staticmethod
    def cls_model(seed: int = 0, num_labels: int = 3, dropout: float = 0.0):
        import torch
        from transformers import BertForSequenceClassification

        torch.manual_seed(seed)
        return BertForSequenceClassification(Factory.config(dropout, num_labels=num_labels))

    @staticmethod
    def qa_dataset(n: int = 40, length: int = 24, seed: int = 0, extra_columns: bool = False):
        import datasets
        import numpy as np

        rng = np.random.default_rng(seed)
        ids = rng.integers(5, Factory.VOCAB, size=(n, length))
        start = rng.integers(1, length - 4, size=n)
        end = start + rng.integers(0, 3, size=n)
        columns = {
            "input_ids": ids.tolist(),
            "attention_mask": np.ones((n, length), dtype=int).tolist(),
            "start_positions": start.tolist(),
            "end_positions": end.tolist(),
        }
        if extra_columns:
            columns["example_id"] = [f"q{i}" for i in range(n)]
        return datasets.Dataset.from_dict(columns)

    @staticmethod
    def cls_dataset(n: int = 48, length: int = 16, seed: int = 0, num_labels: int = 3):
        import datasets
        import numpy as np

        rng = np.random.default_rng(seed)
        ids = rng.integers(5, Factory.VOCAB, size=(n, length))
        labels = (ids[:, 0] % num_labels).tolist()  # learnable: the label is a function of the first token
        return datasets.Dataset.from_dict(
            {"input_ids": ids.tolist(), "attention_mask": np.ones((n, length), dtype=int).tolist(), "labels": labels}
        )

    @staticmethod
    def run_qa_inputs(root: Path, dropout: float) -> dict[str, Path]:
        """What a script written as run_qa.py reads: synthetic SQuAD train/validation files as flat records under
        "data" (``load_dataset("json", field="data")``), and a tiny BERT QA model saved with a locally trained
        tokenizer in ``root/"model"`` (loaded with ``from_pretrained``). Paths under "train", "validation", "model"."""
        import json

        import torch
        from transformers import BertForQuestionAnswering

        from hflight.qa import load_squad_json
        from hflight.qa.synthetic import generate_squad
        from hflight.qa.tokenizer import train_wordpiece_tokenizer

        train, validation = generate_squad(
            num_train_articles=8, num_validation_articles=3, paragraphs_per_article=3, seed=3
        )
        paths = {}
        for name, squad in (("train", train), ("validation", validation)):
            nested = root / f"{name}-squad.json"
            nested.write_text(json.dumps(squad), encoding="utf-8")
            paths[name] = root / f"{name}.json"
            paths[name].write_text(json.dumps({"data": load_squad_json(nested).to_list()}), encoding="utf-8")
        texts = [p["context"] for a in train["data"] for p in a["paragraphs"]]
        texts += [q["question"] for a in train["data"] for p in a["paragraphs"] for q in p["qas"]]
        tokenizer = train_wordpiece_tokenizer(texts, root / "tokenizer", vocab_size=600)
        torch.manual_seed(0)
        config = Factory.config(dropout, vocab_size=len(tokenizer), max_position_embeddings=128)
        paths["model"] = root / "model"
        BertForQuestionAnswering(config).save_pretrained(paths["model"])
        tokenizer.save_pretrained(paths["model"])
        return paths


@pytest.fixture(scope="session")  # a stateless class: module-scoped fixtures use it too
def factory() -> type[Factory]:
    return Factory
