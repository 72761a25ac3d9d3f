"""The quickstart: train and evaluate a small BERT with hflight, offline, on CPU, in under a minute.

    python examples/quickstart.py

The model is built from a config (no download); the task is synthetic sequence classification whose label is the
first token modulo 3, so accuracy visibly rises from chance (about 0.33) to above 0.9. The code is what a
transformers.Trainer user already writes, with one import changed. README.md shows its core lines,
and the test suite checks that they are this file's and runs it.
"""

import datasets
import numpy as np
from transformers import BertConfig, BertForSequenceClassification

from hflight import Trainer, TrainingArguments  # was: from transformers import Trainer, TrainingArguments


def make_split(n: int, seed: int) -> datasets.Dataset:
    """``n`` random sequences of 16 tokens, labelled by their first token modulo 3."""
    ids = np.random.default_rng(seed).integers(5, 200, size=(n, 16))
    labels = (ids[:, 0] % 3).tolist()
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": np.ones_like(ids).tolist(),
                                       "labels": labels})  # fmt: skip


def accuracy(prediction) -> dict[str, float]:
    return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}


def main() -> None:
    config = BertConfig(vocab_size=200, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, num_labels=3)  # fmt: skip
    args = TrainingArguments(output_dir="outputs/quickstart", per_device_train_batch_size=32, num_train_epochs=3,
                             learning_rate=2e-3, warmup_steps=0.1, weight_decay=0.01, eval_strategy="epoch",
                             logging_steps=8, save_strategy="no", report_to="none", accelerator="auto",
                             devices="auto")  # fmt: skip
    trainer = Trainer(BertForSequenceClassification(config), args, train_dataset=make_split(512, 0),
                      eval_dataset=make_split(256, 1), compute_metrics=accuracy)  # fmt: skip
    before = trainer.evaluate()["eval_accuracy"]
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model()  # outputs/quickstart: model.safetensors and config.json, for from_pretrained
    print(f"eval accuracy: {before:.3f} before training -> {metrics['eval_accuracy']:.3f} after")


if __name__ == "__main__":
    main()
