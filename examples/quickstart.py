"""The quickstart: train and evaluate a small BERT with hflight, offline, on CPU, in about a minute.

    python examples/quickstart.py

The model is built from a config (no download); the task is synthetic sequence classification whose label is a
function of the tokens, so accuracy visibly rises from chance. The code is what a transformers.Trainer user
already writes, with one import changed.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import datasets
import numpy as np
from transformers import BertConfig, BertForSequenceClassification

from hflight import Trainer, TrainingArguments


def make_split(n: int, seed: int) -> datasets.Dataset:
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, 200, size=(n, 32))
    labels = (ids[:, 0] % 3).tolist()  # the label is carried by the first token
    return datasets.Dataset.from_dict(
        {"input_ids": ids.tolist(), "attention_mask": np.ones_like(ids).tolist(), "labels": labels}
    )


def accuracy(prediction):
    return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}


def main() -> None:
    config = BertConfig(
        vocab_size=200,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        num_labels=3,
    )
    args = TrainingArguments(
        output_dir="outputs/quickstart",
        per_device_train_batch_size=32,
        num_train_epochs=6,
        learning_rate=2e-3,
        warmup_steps=0.1,
        weight_decay=0.01,
        eval_strategy="epoch",
        logging_steps=20,
        save_strategy="no",
        report_to="none",
        seed=0,
    )
    trainer = Trainer(
        BertForSequenceClassification(config),
        args,
        train_dataset=make_split(1200, 0),
        eval_dataset=make_split(500, 1),
        compute_metrics=accuracy,
    )
    before = trainer.evaluate()["eval_accuracy"]
    train = trainer.train()
    metrics = trainer.evaluate()
    trainer.log_metrics("train", train.metrics)
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("all", {**train.metrics, **metrics})
    print(f"eval accuracy: {before:.3f} before training -> {metrics['eval_accuracy']:.3f} after")


if __name__ == "__main__":
    main()
