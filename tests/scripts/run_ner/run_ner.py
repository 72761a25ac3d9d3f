"""Fine-tune a model for token classification (NER), written the way transformers'
examples/pytorch/token-classification/run_ner.py is: argument dataclasses parsed with HfArgumentParser, checkpoint
detection, a label list read from the data, words tokenized with ``is_split_into_words`` and labels aligned to the
first sub-token (``label_all_tokens``), DataCollatorForTokenClassification, a seqeval-style ``compute_metrics``
(entity precision, recall, F1 and token accuracy), train / evaluate / predict, predictions.txt and a model card.

The hub's ``evaluate.load("seqeval")`` needs a download (and seqeval), so the entity scores are computed here."""

import logging
import os
import sys
from dataclasses import dataclass, field

import datasets
import numpy as np
import transformers
from datasets import ClassLabel, load_dataset
from transformers import (
    AutoConfig,
    AutoModelForTokenClassification,
    AutoTokenizer,
    DataCollatorForTokenClassification,
    HfArgumentParser,
    TrainingArguments,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint

# isort: split
# The trainer import, on a line of its own (the drop-in test swaps it for hflight's).
from transformers import Trainer

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "Path to a pretrained model or a model identifier."})
    config_name: str | None = field(default=None, metadata={"help": "Config name or path, if not the model's."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer name or path, if not the model's."})


@dataclass
class DataTrainingArguments:
    task_name: str | None = field(default="ner", metadata={"help": "The name of the task (ner, pos...)."})
    train_file: str | None = field(default=None, metadata={"help": "Training data (csv or json)."})
    validation_file: str | None = field(default=None, metadata={"help": "Evaluation data (csv or json)."})
    test_file: str | None = field(default=None, metadata={"help": "Prediction data (csv or json)."})
    text_column_name: str | None = field(default=None, metadata={"help": "Column of the words."})
    label_column_name: str | None = field(default=None, metadata={"help": "Column of the labels."})
    max_seq_length: int | None = field(default=None, metadata={"help": "Longest input sequence after tokenization."})
    pad_to_max_length: bool = field(default=False, metadata={"help": "Pad every sample to `max_seq_length`."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Truncate the training set."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Truncate the evaluation set."})
    max_predict_samples: int | None = field(default=None, metadata={"help": "Truncate the prediction set."})
    label_all_tokens: bool = field(default=False, metadata={"help": "Label all sub-tokens, not only the first."})
    return_entity_level_metrics: bool = field(default=False, metadata={"help": "Return per-entity metrics too."})


def _entities(tags):
    """(type, start, end) spans of IOB2 tags, as seqeval reads them (an I- without a B- starts an entity)."""
    spans, start, kind = set(), None, None
    for i, tag in enumerate(list(tags) + ["O"]):
        prefix, _, name = tag.partition("-")
        if start is not None and (prefix != "I" or name != kind):
            spans.add((kind, start, i))
            start = None
        if prefix == "B" or (prefix == "I" and start is None):
            start, kind = i, name
    return spans


def seqeval_scores(predictions, references):
    predicted = set().union(*({(n, *s) for s in _entities(p)} for n, p in enumerate(predictions)))
    true = set().union(*({(n, *s) for s in _entities(r)} for n, r in enumerate(references)))
    correct = len(predicted & true)
    precision = correct / len(predicted) if predicted else 0.0
    recall = correct / len(true) if true else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    tokens = [(p, r) for ps, rs in zip(predictions, references) for p, r in zip(ps, rs)]
    accuracy = sum(p == r for p, r in tokens) / len(tokens)
    return {"overall_precision": precision, "overall_recall": recall, "overall_f1": f1, "overall_accuracy": accuracy}


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses()

    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        handlers=[logging.StreamHandler(sys.stdout)],
    )
    if training_args.should_log:
        transformers.utils.logging.set_verbosity_info()
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.enable_default_handler()
    transformers.utils.logging.enable_explicit_format()
    logger.info(f"Training/evaluation parameters {training_args}")

    last_checkpoint = None
    if os.path.isdir(training_args.output_dir) and training_args.do_train:
        last_checkpoint = get_last_checkpoint(training_args.output_dir)
        if last_checkpoint is not None and training_args.resume_from_checkpoint is None:
            logger.info(f"Checkpoint detected, resuming training at {last_checkpoint}.")

    set_seed(training_args.seed)

    data_files = {}
    if data_args.train_file is not None:
        data_files["train"] = data_args.train_file
        extension = data_args.train_file.split(".")[-1]
    if data_args.validation_file is not None:
        data_files["validation"] = data_args.validation_file
        extension = data_args.validation_file.split(".")[-1]
    if data_args.test_file is not None:
        data_files["test"] = data_args.test_file
        extension = data_args.test_file.split(".")[-1]
    raw_datasets = load_dataset(extension, data_files=data_files)

    if training_args.do_train:
        column_names = raw_datasets["train"].column_names
        features = raw_datasets["train"].features
    else:
        column_names = raw_datasets["validation"].column_names
        features = raw_datasets["validation"].features

    text_column_name = data_args.text_column_name or ("tokens" if "tokens" in column_names else column_names[0])
    if data_args.label_column_name is not None:
        label_column_name = data_args.label_column_name
    elif f"{data_args.task_name}_tags" in column_names:
        label_column_name = f"{data_args.task_name}_tags"
    else:
        label_column_name = column_names[1]

    # In the event the labels are not a `Sequence[ClassLabel]`, we will need to go through the dataset to get the
    # unique labels.
    def get_label_list(labels):
        unique_labels = set()
        for label in labels:
            unique_labels = unique_labels | set(label)
        label_list = list(unique_labels)
        label_list.sort()
        return label_list

    labels_are_int = isinstance(features[label_column_name].feature, ClassLabel)
    if labels_are_int:
        label_list = features[label_column_name].feature.names
        label_to_id = {i: i for i in range(len(label_list))}
    else:
        label_list = get_label_list(raw_datasets["train"][label_column_name])
        label_to_id = {lab: i for i, lab in enumerate(label_list)}
    num_labels = len(label_list)

    config = AutoConfig.from_pretrained(
        model_args.config_name or model_args.model_name_or_path,
        num_labels=num_labels,
        finetuning_task=data_args.task_name,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path)
    model = AutoModelForTokenClassification.from_pretrained(model_args.model_name_or_path, config=config)

    model.config.label2id = {lab: i for i, lab in enumerate(label_list)}
    model.config.id2label = dict(enumerate(label_list))

    # Map that sends B-Xxx label to its I-Xxx counterpart
    b_to_i_label = []
    for idx, label in enumerate(label_list):
        if label.startswith("B-") and label.replace("B-", "I-") in label_list:
            b_to_i_label.append(label_list.index(label.replace("B-", "I-")))
        else:
            b_to_i_label.append(idx)

    padding = "max_length" if data_args.pad_to_max_length else False

    def tokenize_and_align_labels(examples):
        tokenized_inputs = tokenizer(
            examples[text_column_name],
            padding=padding,
            truncation=True,
            max_length=data_args.max_seq_length,
            # We use this argument because the texts in our dataset are lists of words (with a label for each word).
            is_split_into_words=True,
        )
        labels = []
        for i, label in enumerate(examples[label_column_name]):
            word_ids = tokenized_inputs.word_ids(batch_index=i)
            previous_word_idx = None
            label_ids = []
            for word_idx in word_ids:
                # Special tokens have a word id that is None. We set the label to -100 so they are automatically
                # ignored in the loss function.
                if word_idx is None:
                    label_ids.append(-100)
                # We set the label for the first token of each word.
                elif word_idx != previous_word_idx:
                    label_ids.append(label_to_id[label[word_idx]])
                # For the other tokens in a word, we set the label to either the current label or -100, depending on
                # the label_all_tokens flag.
                elif data_args.label_all_tokens:
                    label_ids.append(b_to_i_label[label_to_id[label[word_idx]]])
                else:
                    label_ids.append(-100)
                previous_word_idx = word_idx
            labels.append(label_ids)
        tokenized_inputs["labels"] = labels
        return tokenized_inputs

    def prepared(name, limit):
        dataset = raw_datasets[name]
        if limit is not None:
            dataset = dataset.select(range(min(len(dataset), limit)))
        with training_args.main_process_first(desc=f"{name} dataset map pre-processing"):
            return dataset.map(tokenize_and_align_labels, batched=True, desc=f"Running tokenizer on {name} dataset")

    if training_args.do_train:
        train_dataset = prepared("train", data_args.max_train_samples)
    if training_args.do_eval:
        eval_dataset = prepared("validation", data_args.max_eval_samples)
    if training_args.do_predict:
        predict_dataset = prepared("test", data_args.max_predict_samples)

    data_collator = DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=8 if training_args.fp16 else None)

    def compute_metrics(p):
        predictions, labels = p
        predictions = np.argmax(predictions, axis=2)
        # Remove ignored index (special tokens)
        true_predictions = [
            [label_list[p] for (p, lab) in zip(prediction, label) if lab != -100]
            for prediction, label in zip(predictions, labels)
        ]
        true_labels = [
            [label_list[lab] for (p, lab) in zip(prediction, label) if lab != -100]
            for prediction, label in zip(predictions, labels)
        ]
        results = seqeval_scores(true_predictions, true_labels)
        return {
            "precision": results["overall_precision"],
            "recall": results["overall_recall"],
            "f1": results["overall_f1"],
            "accuracy": results["overall_accuracy"],
        }

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=data_collator,
        compute_metrics=compute_metrics,
    )

    if training_args.do_train:
        checkpoint = None
        if training_args.resume_from_checkpoint is not None:
            checkpoint = training_args.resume_from_checkpoint
        elif last_checkpoint is not None:
            checkpoint = last_checkpoint
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        metrics = train_result.metrics
        trainer.save_model()  # Saves the tokenizer too for easy upload
        metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        logger.info("*** Evaluate ***")
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(eval_dataset)
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)

    if training_args.do_predict:
        logger.info("*** Predict ***")
        predictions, labels, metrics = trainer.predict(predict_dataset, metric_key_prefix="predict")
        predictions = np.argmax(predictions, axis=2)
        # Remove ignored index (special tokens)
        true_predictions = [
            [label_list[p] for (p, lab) in zip(prediction, label) if lab != -100]
            for prediction, label in zip(predictions, labels)
        ]
        trainer.log_metrics("predict", metrics)
        trainer.save_metrics("predict", metrics)
        # Save predictions
        output_predictions_file = os.path.join(training_args.output_dir, "predictions.txt")
        if trainer.is_world_process_zero():
            with open(output_predictions_file, "w") as writer:
                for prediction in true_predictions:
                    writer.write(" ".join(prediction) + "\n")

    kwargs = {"finetuned_from": model_args.model_name_or_path, "tasks": "token-classification"}
    if training_args.push_to_hub:
        trainer.push_to_hub(**kwargs)
    else:
        trainer.create_model_card(**kwargs)


if __name__ == "__main__":
    main()
