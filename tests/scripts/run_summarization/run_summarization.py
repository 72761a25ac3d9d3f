"""Fine-tune a sequence-to-sequence model for summarization (or translation), written the way transformers'
examples/pytorch/summarization/run_summarization.py is: argument dataclasses parsed with HfArgumentParser together
with Seq2SeqTrainingArguments, checkpoint detection, tokenization with ``text_target``, DataCollatorForSeq2Seq,
``compute_metrics`` decoding generated tokens (ROUGE-style overlap scores and ``gen_len``), train / evaluate /
predict with generation, generated_predictions.txt and a model card.

The hub's ``evaluate.load("rouge")`` needs a download, so the ROUGE-1/2/L F-measures are computed here on words."""

import logging
import os
import sys
from dataclasses import dataclass, field

import datasets
import numpy as np
import transformers
from datasets import load_dataset
from transformers import (
    AutoConfig,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    HfArgumentParser,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint

# isort: split
# The trainer import, on a line of its own (the drop-in test swaps it for hflight's).
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "Path to a pretrained model or a model identifier."})
    config_name: str | None = field(default=None, metadata={"help": "Config name or path, if not the model's."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer name or path, if not the model's."})


@dataclass
class DataTrainingArguments:
    train_file: str | None = field(default=None, metadata={"help": "Training data (jsonlines or csv)."})
    validation_file: str | None = field(default=None, metadata={"help": "Evaluation data (jsonlines or csv)."})
    test_file: str | None = field(default=None, metadata={"help": "Prediction data (jsonlines or csv)."})
    text_column: str | None = field(default=None, metadata={"help": "Column of the full texts."})
    summary_column: str | None = field(default=None, metadata={"help": "Column of the summaries."})
    source_lang: str | None = field(default=None, metadata={"help": "Translation: the source language key."})
    target_lang: str | None = field(default=None, metadata={"help": "Translation: the target language key."})
    max_source_length: int = field(default=64, metadata={"help": "Longest input sequence after tokenization."})
    max_target_length: int = field(default=16, metadata={"help": "Longest target sequence for training."})
    val_max_target_length: int | None = field(default=None, metadata={"help": "Longest target for evaluation."})
    pad_to_max_length: bool = field(default=False, metadata={"help": "Pad every sample to the maximum length."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Truncate the training set."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Truncate the evaluation set."})
    max_predict_samples: int | None = field(default=None, metadata={"help": "Truncate the prediction set."})
    num_beams: int | None = field(default=None, metadata={"help": "Beams for evaluation and prediction."})
    ignore_pad_token_for_loss: bool = field(default=True, metadata={"help": "Ignore padded label tokens in the loss."})
    source_prefix: str | None = field(default="", metadata={"help": "A prefix added before every source text."})

    def __post_init__(self):
        if self.val_max_target_length is None:
            self.val_max_target_length = self.max_target_length


def _ngrams(words, n):
    return [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]


def _f_measure(overlap, predicted, reference):
    if overlap == 0 or predicted == 0 or reference == 0:
        return 0.0
    precision, recall = overlap / predicted, overlap / reference
    return 2 * precision * recall / (precision + recall)


def _lcs(a, b):
    table = [0] * (len(b) + 1)
    for x in a:
        previous = 0
        for j, y in enumerate(b, 1):
            current = table[j]
            table[j] = previous + 1 if x == y else max(table[j], table[j - 1])
            previous = current
    return table[-1]


def rouge_scores(predictions, references):
    """Mean ROUGE-1, ROUGE-2 and ROUGE-L F-measures over word sequences."""
    totals = {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    for prediction, reference in zip(predictions, references):
        p, r = prediction.split(), reference.split()
        for n in (1, 2):
            pn, rn = _ngrams(p, n), _ngrams(r, n)
            overlap = sum(min(pn.count(g), rn.count(g)) for g in set(pn))
            totals[f"rouge{n}"] += _f_measure(overlap, len(pn), len(rn))
        totals["rougeL"] += _f_measure(_lcs(p, r), len(p), len(r))
    return {k: v / max(len(predictions), 1) for k, v in totals.items()}


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, Seq2SeqTrainingArguments))
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
    for split, path in (("train", data_args.train_file), ("validation", data_args.validation_file),
                        ("test", data_args.test_file)):  # fmt: skip
        if path is not None:
            data_files[split] = path
            extension = path.split(".")[-1]
    raw_datasets = load_dataset("json" if extension == "jsonl" else extension, data_files=data_files)

    config = AutoConfig.from_pretrained(model_args.config_name or model_args.model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or model_args.model_name_or_path)
    model = AutoModelForSeq2SeqLM.from_pretrained(model_args.model_name_or_path, config=config)
    if len(tokenizer) > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(len(tokenizer))
    if model.config.decoder_start_token_id is None:
        raise ValueError("Make sure that `config.decoder_start_token_id` is correctly defined")

    prefix = data_args.source_prefix or ""
    split = "train" if training_args.do_train else "validation" if training_args.do_eval else "test"
    column_names = raw_datasets[split].column_names
    translation = data_args.source_lang is not None
    text_column = data_args.text_column or column_names[0]
    summary_column = data_args.summary_column or column_names[1]
    padding = "max_length" if data_args.pad_to_max_length else False

    def preprocess_function(examples, max_target_length):
        if translation:
            pairs = [(ex[data_args.source_lang], ex[data_args.target_lang]) for ex in examples["translation"]]
        else:
            pairs = list(zip(examples[text_column], examples[summary_column]))
        pairs = [(source, target) for source, target in pairs if source and target]
        inputs = [prefix + source for source, _ in pairs]
        model_inputs = tokenizer(inputs, max_length=data_args.max_source_length, padding=padding, truncation=True)
        labels = tokenizer(text_target=[target for _, target in pairs], max_length=max_target_length,
                           padding=padding, truncation=True)  # fmt: skip
        if padding == "max_length" and data_args.ignore_pad_token_for_loss:
            labels["input_ids"] = [
                [token if token != tokenizer.pad_token_id else -100 for token in label] for label in labels["input_ids"]
            ]
        model_inputs["labels"] = labels["input_ids"]
        return model_inputs

    def prepared(name, limit, max_target_length):
        dataset = raw_datasets[name]
        if limit is not None:
            dataset = dataset.select(range(min(len(dataset), limit)))
        with training_args.main_process_first(desc=f"{name} dataset map pre-processing"):
            return dataset.map(
                preprocess_function,
                batched=True,
                remove_columns=column_names,
                fn_kwargs={"max_target_length": max_target_length},
                desc=f"Running tokenizer on {name} dataset",
            )

    if training_args.do_train:
        train_dataset = prepared("train", data_args.max_train_samples, data_args.max_target_length)
    if training_args.do_eval:
        eval_dataset = prepared("validation", data_args.max_eval_samples, data_args.val_max_target_length)
    if training_args.do_predict:
        predict_dataset = prepared("test", data_args.max_predict_samples, data_args.val_max_target_length)

    label_pad_token_id = -100 if data_args.ignore_pad_token_for_loss else tokenizer.pad_token_id
    data_collator = DataCollatorForSeq2Seq(
        tokenizer,
        model=model,
        label_pad_token_id=label_pad_token_id,
        pad_to_multiple_of=8 if training_args.fp16 else None,
    )

    def compute_metrics(eval_preds):
        preds, labels = eval_preds
        if isinstance(preds, tuple):
            preds = preds[0]
        preds = np.where(preds != -100, preds, tokenizer.pad_token_id)
        decoded_preds = [p.strip() for p in tokenizer.batch_decode(preds, skip_special_tokens=True)]
        labels = np.where(labels != -100, labels, tokenizer.pad_token_id)
        decoded_labels = [label.strip() for label in tokenizer.batch_decode(labels, skip_special_tokens=True)]
        result = {k: round(v * 100, 4) for k, v in rouge_scores(decoded_preds, decoded_labels).items()}
        result["gen_len"] = np.mean([np.count_nonzero(pred != tokenizer.pad_token_id) for pred in preds])
        return result

    # Override the decoding parameters of Seq2SeqTrainer
    if training_args.generation_max_length is None:
        training_args.generation_max_length = data_args.val_max_target_length
    if data_args.num_beams is not None:
        training_args.generation_num_beams = data_args.num_beams

    trainer = Seq2SeqTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=data_collator,
        compute_metrics=compute_metrics if training_args.predict_with_generate else None,
    )

    if training_args.do_train:
        checkpoint = training_args.resume_from_checkpoint or last_checkpoint
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()
        metrics = train_result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        logger.info("*** Evaluate ***")
        metrics = trainer.evaluate(metric_key_prefix="eval")
        metrics["eval_samples"] = len(eval_dataset)
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)

    if training_args.do_predict:
        logger.info("*** Predict ***")
        predict_results = trainer.predict(predict_dataset, metric_key_prefix="predict")
        metrics = predict_results.metrics
        metrics["predict_samples"] = len(predict_dataset)
        trainer.log_metrics("predict", metrics)
        trainer.save_metrics("predict", metrics)
        if trainer.is_world_process_zero() and training_args.predict_with_generate:
            predictions = np.where(predict_results.predictions != -100, predict_results.predictions,
                                   tokenizer.pad_token_id)  # fmt: skip
            predictions = tokenizer.batch_decode(predictions, skip_special_tokens=True,
                                                 clean_up_tokenization_spaces=True)  # fmt: skip
            with open(os.path.join(training_args.output_dir, "generated_predictions.txt"), "w") as writer:
                writer.write("\n".join(prediction.strip() for prediction in predictions))

    tasks = "translation" if translation else "summarization"
    kwargs = {"finetuned_from": model_args.model_name_or_path, "tasks": tasks}
    trainer.create_model_card(**kwargs)


if __name__ == "__main__":
    main()
