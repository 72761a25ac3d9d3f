"""Fine-tune a sequence-to-sequence model for translation, written the way transformers'
examples/pytorch/translation/run_translation.py is: argument dataclasses parsed with HfArgumentParser together with
Seq2SeqTrainingArguments, checkpoint detection, ``source_lang``/``target_lang`` over a ``translation`` column,
``forced_bos_token``, tokenization with ``text_target``, DataCollatorForSeq2Seq, ``compute_metrics`` decoding
generated tokens (BLEU and ``gen_len``), train / evaluate / predict with generation, generated_predictions.txt and a
model card.

The hub's ``evaluate.load("sacrebleu")`` needs a download (and sacrebleu is not installed), so corpus BLEU is computed
here on whitespace tokens."""

import logging
import math
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
    source_lang: str = field(default=None, metadata={"help": "Source language id for translation."})
    target_lang: str = field(default=None, metadata={"help": "Target language id for translation."})
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
    forced_bos_token: str | None = field(
        default=None, metadata={"help": "The token to force as the first generated token after decoder_start_token_id."}
    )

    def __post_init__(self):
        if self.source_lang is None or self.target_lang is None:
            raise ValueError("Need to specify the source language and the target language.")
        if self.val_max_target_length is None:
            self.val_max_target_length = self.max_target_length


def _ngram_counts(words, n):
    counts = {}
    for i in range(len(words) - n + 1):
        gram = tuple(words[i : i + n])
        counts[gram] = counts.get(gram, 0) + 1
    return counts


def corpus_bleu(predictions, references, max_order=4):
    """sacrebleu's corpus BLEU on whitespace tokens with its default "exp" smoothing, scaled to 0-100: clipped n-gram
    precisions for n = 1..4, their geometric mean, and the brevity penalty over the whole corpus."""
    matches, totals = [0] * max_order, [0] * max_order
    sys_len = ref_len = 0
    for prediction, reference in zip(predictions, references):
        p, r = prediction.split(), reference[0].split()
        sys_len, ref_len = sys_len + len(p), ref_len + len(r)
        for n in range(1, max_order + 1):
            pn, rn = _ngram_counts(p, n), _ngram_counts(r, n)
            matches[n - 1] += sum(min(c, rn.get(g, 0)) for g, c in pn.items())
            totals[n - 1] += max(len(p) - n + 1, 0)
    if sys_len == 0:
        return {"score": 0.0}
    precisions, smooth = [], 1.0
    for match, total in zip(matches, totals):
        if total == 0:
            return {"score": 0.0}
        if match == 0:
            smooth *= 2
            precisions.append(100.0 / (smooth * total))
        else:
            precisions.append(100.0 * match / total)
    brevity = 1.0 if sys_len > ref_len else math.exp(1 - ref_len / sys_len)
    score = brevity * math.exp(sum(math.log(p) for p in precisions) / max_order)
    return {"score": score}


def postprocess_text(preds, labels):
    preds = [pred.strip() for pred in preds]
    labels = [[label.strip()] for label in labels]
    return preds, labels


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

    # The example sets the target language code of multilingual tokenizers (mBART, M2M100, NLLB) as the token forced
    # first in generation; here any token of the tokenizer.
    if data_args.forced_bos_token is not None:
        model.generation_config.forced_bos_token_id = tokenizer.convert_tokens_to_ids(data_args.forced_bos_token)

    prefix = data_args.source_prefix or ""
    split = "train" if training_args.do_train else "validation" if training_args.do_eval else "test"
    column_names = raw_datasets[split].column_names
    source_lang, target_lang = data_args.source_lang, data_args.target_lang
    padding = "max_length" if data_args.pad_to_max_length else False

    def preprocess_function(examples, max_target_length):
        inputs = [prefix + ex[source_lang] for ex in examples["translation"]]
        targets = [ex[target_lang] for ex in examples["translation"]]
        model_inputs = tokenizer(inputs, max_length=data_args.max_source_length, padding=padding, truncation=True)
        labels = tokenizer(text_target=targets, max_length=max_target_length, padding=padding, truncation=True)
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
        # Replace -100s used for padding as we can't decode them
        preds = np.where(preds != -100, preds, tokenizer.pad_token_id)
        decoded_preds = tokenizer.batch_decode(preds, skip_special_tokens=True)
        labels = np.where(labels != -100, labels, tokenizer.pad_token_id)
        decoded_labels = tokenizer.batch_decode(labels, skip_special_tokens=True)
        decoded_preds, decoded_labels = postprocess_text(decoded_preds, decoded_labels)
        result = corpus_bleu(decoded_preds, decoded_labels)
        result = {"bleu": result["score"]}
        prediction_lens = [np.count_nonzero(pred != tokenizer.pad_token_id) for pred in preds]
        result["gen_len"] = np.mean(prediction_lens)
        result = {k: round(v, 4) for k, v in result.items()}
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

    kwargs = {"finetuned_from": model_args.model_name_or_path, "tasks": "translation"}
    languages = [lang for lang in [source_lang, target_lang] if lang is not None]
    if len(languages) > 0:
        kwargs["language"] = languages
    if training_args.push_to_hub:
        trainer.push_to_hub(**kwargs)
    else:
        trainer.create_model_card(**kwargs)


if __name__ == "__main__":
    main()
