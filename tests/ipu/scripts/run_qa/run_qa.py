"""Fine-tuning a model for extractive question answering on IPUs, written the way optimum-graphcore's
``examples/question-answering/run_qa.py`` is written: ``HfArgumentParser`` over the script's argument dataclasses and
``IPUTrainingArguments``, logging set up from the training arguments, ``IPUConfig.from_pretrained`` with the download
arguments the example passes (``use_auth_token`` included), resuming from the last checkpoint in the output folder, a
``QuestionAnsweringTrainer`` subclass of ``IPUTrainer`` (``trainer_qa.py``), post-processing into answers, result
files, and the example's ending: ``push_to_hub`` or ``create_model_card``.

Its imports of optimum.graphcore are changed to hflight.ipu (the one-line change a user makes). Window building and
answer post-processing come from ``hflight.qa`` (run_qa's and utils_qa's algorithms; the ``evaluate`` library's
``squad`` metric needs the Hub). tests/ipu/test_optimum_graphcore_run_qa.py runs it against the poptorch test double.
"""

import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Optional

import datasets
import transformers
from datasets import load_dataset
from trainer_qa import QuestionAnsweringTrainer
from transformers import (
    AutoConfig,
    AutoModelForQuestionAnswering,
    AutoTokenizer,
    DataCollatorWithPadding,
    EvalPrediction,
    HfArgumentParser,
    PreTrainedTokenizerFast,
    default_data_collator,
    set_seed,
)
from transformers.trainer_utils import get_last_checkpoint

from hflight.ipu import IPUConfig  # was: from optimum.graphcore import IPUConfig
from hflight.ipu import IPUTrainingArguments as TrainingArguments  # was: from optimum.graphcore import ...
from hflight.qa import postprocess_qa_predictions, prepare_train_features, prepare_validation_features, squad_metrics

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "Path to a pretrained model or a model id on the Hub."})
    config_name: Optional[str] = field(default=None, metadata={"help": "Config name or path, if not the model's."})
    tokenizer_name: Optional[str] = field(default=None, metadata={"help": "Tokenizer name or path, if not the model."})
    cache_dir: Optional[str] = field(default=None, metadata={"help": "Where to store downloaded models."})
    model_revision: str = field(default="main", metadata={"help": "The model version (branch, tag or commit)."})
    use_auth_token: bool = field(default=False, metadata={"help": "Use the token of `huggingface-cli login`."})


@dataclass
class DataTrainingArguments:
    dataset_name: Optional[str] = field(default=None, metadata={"help": "A dataset of the datasets library."})
    train_file: Optional[str] = field(default=None, metadata={"help": "Training data (a json file)."})
    validation_file: Optional[str] = field(default=None, metadata={"help": "Evaluation data (a json file)."})
    test_file: Optional[str] = field(default=None, metadata={"help": "Prediction data (a json file)."})
    max_seq_length: int = field(default=384, metadata={"help": "Maximum tokens of a window."})
    pad_to_max_length: bool = field(default=True, metadata={"help": "Pad every window to max_seq_length."})
    doc_stride: int = field(default=128, metadata={"help": "Overlap between the windows of a long context."})
    n_best_size: int = field(default=20, metadata={"help": "Candidate answers kept per question."})
    max_answer_length: int = field(default=30, metadata={"help": "Longest answer, in tokens."})
    version_2_with_negative: bool = field(default=False, metadata={"help": "Some questions have no answer."})
    null_score_diff_threshold: float = field(default=0.0, metadata={"help": "Threshold to predict no answer."})
    max_train_samples: Optional[int] = field(default=None, metadata={"help": "Truncate the training set."})
    max_eval_samples: Optional[int] = field(default=None, metadata={"help": "Truncate the evaluation set."})


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        model_args, data_args, training_args = parser.parse_json_file(json_file=os.path.abspath(sys.argv[1]))
    else:
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
    if os.path.isdir(training_args.output_dir) and training_args.do_train and not training_args.overwrite_output_dir:
        last_checkpoint = get_last_checkpoint(training_args.output_dir)
        if last_checkpoint is None and len(os.listdir(training_args.output_dir)) > 0:
            raise ValueError(
                f"Output directory ({training_args.output_dir}) already exists and is not empty. "
                "Use --overwrite_output_dir to overcome."
            )
        elif last_checkpoint is not None and training_args.resume_from_checkpoint is None:
            logger.info(f"Checkpoint detected, resuming training at {last_checkpoint}.")

    set_seed(training_args.seed)

    data_files = {"train": data_args.train_file, "validation": data_args.validation_file}
    if data_args.test_file is not None:
        data_files["test"] = data_args.test_file
    raw_datasets = load_dataset("json", data_files=data_files, field="data", cache_dir=model_args.cache_dir)

    config = AutoConfig.from_pretrained(
        model_args.config_name if model_args.config_name else model_args.model_name_or_path,
        cache_dir=model_args.cache_dir,
        revision=model_args.model_revision,
    )
    ipu_config = IPUConfig.from_pretrained(
        training_args.ipu_config_name if training_args.ipu_config_name else model_args.model_name_or_path,
        cache_dir=model_args.cache_dir,
        revision=model_args.model_revision,
        use_auth_token=True if model_args.use_auth_token else None,
    )
    tokenizer = AutoTokenizer.from_pretrained(
        model_args.tokenizer_name if model_args.tokenizer_name else model_args.model_name_or_path,
        cache_dir=model_args.cache_dir,
        use_fast=True,
        revision=model_args.model_revision,
    )
    model = AutoModelForQuestionAnswering.from_pretrained(
        model_args.model_name_or_path, config=config, cache_dir=model_args.cache_dir, revision=model_args.model_revision
    )
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ValueError("This example script only works for models that have a fast tokenizer.")

    max_seq_length = min(data_args.max_seq_length, tokenizer.model_max_length)
    window = dict(
        tokenizer=tokenizer,
        max_seq_length=max_seq_length,
        doc_stride=data_args.doc_stride,
        pad_to_max_length=data_args.pad_to_max_length,
    )
    train_dataset = eval_examples = eval_dataset = predict_examples = predict_dataset = None
    if training_args.do_train:
        train_dataset = raw_datasets["train"]
        if data_args.max_train_samples is not None:
            train_dataset = train_dataset.select(range(min(len(train_dataset), data_args.max_train_samples)))
        with training_args.main_process_first(desc="train dataset map pre-processing"):
            train_dataset = train_dataset.map(
                prepare_train_features, fn_kwargs=window, batched=True, remove_columns=train_dataset.column_names
            )
    if training_args.do_eval:
        eval_examples = raw_datasets["validation"]
        if data_args.max_eval_samples is not None:
            eval_examples = eval_examples.select(range(min(len(eval_examples), data_args.max_eval_samples)))
        with training_args.main_process_first(desc="validation dataset map pre-processing"):
            eval_dataset = eval_examples.map(
                prepare_validation_features, fn_kwargs=window, batched=True, remove_columns=eval_examples.column_names
            )
    if training_args.do_predict:
        predict_examples = raw_datasets["test"]
        predict_dataset = predict_examples.map(
            prepare_validation_features, fn_kwargs=window, batched=True, remove_columns=predict_examples.column_names
        )

    data_collator = (
        default_data_collator
        if data_args.pad_to_max_length
        else DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8 if training_args.fp16 else None)
    )

    def post_processing_function(examples, features, predictions, stage="eval"):
        answers = postprocess_qa_predictions(
            examples=examples,
            features=features,
            predictions=predictions,
            version_2_with_negative=data_args.version_2_with_negative,
            n_best_size=data_args.n_best_size,
            max_answer_length=data_args.max_answer_length,
            null_score_diff_threshold=data_args.null_score_diff_threshold,
            output_dir=training_args.output_dir,
            prefix=stage,
        )
        formatted = [{"id": str(k), "prediction_text": v} for k, v in answers.items()]
        references = [{"id": str(ex["id"]), "answers": ex["answers"]} for ex in examples]
        return EvalPrediction(predictions=formatted, label_ids=references)

    def compute_metrics(p: EvalPrediction):
        return squad_metrics(p.predictions, p.label_ids, data_args.version_2_with_negative)

    trainer = QuestionAnsweringTrainer(
        model=model,
        ipu_config=ipu_config,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        eval_examples=eval_examples if training_args.do_eval else None,
        tokenizer=tokenizer,
        data_collator=data_collator,
        post_process_function=post_processing_function,
        compute_metrics=compute_metrics,
    )

    if training_args.do_train:
        checkpoint = None
        if training_args.resume_from_checkpoint is not None:
            checkpoint = training_args.resume_from_checkpoint
        elif last_checkpoint is not None:
            checkpoint = last_checkpoint
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()  # Saves the tokenizer too for easy upload
        metrics = train_result.metrics
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
        results = trainer.predict(predict_dataset, predict_examples)
        metrics = results.metrics
        metrics["predict_samples"] = len(predict_dataset)
        trainer.log_metrics("predict", metrics)
        trainer.save_metrics("predict", metrics)

    kwargs = {"finetuned_from": model_args.model_name_or_path, "tasks": "question-answering"}
    if data_args.dataset_name is not None:
        kwargs["dataset_tags"] = data_args.dataset_name
        kwargs["dataset"] = data_args.dataset_name

    if training_args.push_to_hub:
        trainer.push_to_hub(**kwargs)
    else:
        trainer.create_model_card(**kwargs)


if __name__ == "__main__":
    main()
