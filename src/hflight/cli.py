"""The Hydra entry point: compose -> instantiate -> the same ``MRCTrainer`` facade a notebook uses.

``python train.py +experiment=mrc`` and the console script ``hflight-train +experiment=mrc`` both end in
:func:`main`, which runs :func:`train` and returns ``cfg.optimized_metric`` for sweepers. :func:`train` builds
every object from the config, in HF ``run_qa.py``'s order: training arguments, examples, tokenizer, model,
features, callbacks, trainer; then trains, evaluates and predicts as ``args.do_train``/``do_eval``/``do_predict``
ask, writing ``train_results.json``, ``eval_results.json``, ``all_results.json``, ``trainer_state.json``, the model,
checkpoints and ``eval_predictions.json`` into ``args.output_dir`` (the Hydra run directory).

Evaluation loss: the validation windows also carry ``start_positions``/``end_positions`` labelled exactly as
training windows are (the answer's tokens when the whole answer is inside the window, else the CLS token; an
unanswerable question, or one whose answers cannot be located in its context, is labelled CLS), so evaluation
reports ``eval_loss`` next to the SQuAD scores, during training too. The labels cost one more tokenization of the
validation set and change neither the logits nor the answers.

Example:
    >>> from hflight import cli, config  # doctest: +SKIP
    >>> metrics, objects = cli.train(config.compose(["+experiment=mrc", "args.num_train_epochs=1"]))  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import traceback
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException, HydraException
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hflight.config import PRIMARY_CONFIG, VERSION_BASE, DataTrainingArguments, ModelArguments, find_config_dir
from hflight.interrupt import TrainingInterrupted, signal_name, terminate_on_signals
from hflight.training_args import TrainingArguments

__all__ = ["main", "run", "train"]

log = logging.getLogger(__name__)

#: File a failed job leaves in its run directory (the traceback).
ERROR_FILE = "error.txt"

# Loaders for data files other than SQuAD-format .json, by extension: the `datasets` builder to use.
_FILE_BUILDERS = {".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


# ---------------------------------------------------------------------------------------------------- entry points
def train(cfg: DictConfig) -> tuple[dict[str, float], dict[str, Any]]:
    """Build everything from ``cfg``, train, evaluate and predict; return ``(metrics, objects)``.

    ``metrics`` merges the ``train_*``, ``eval_*`` and ``predict_*`` results; ``objects`` holds what was built
    (``args``, ``model_args``, ``data_args``, ``tokenizer``, ``model``, ``callbacks``, ``trainer``, ``examples``,
    ``features``) for a notebook to keep working with.

    Raises:
        TypeError, ValueError: invalid training arguments (before anything else is built), missing data.
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    log.info(f"Instantiating training arguments <{TrainingArguments.__module__}.TrainingArguments>")
    args: TrainingArguments = OmegaConf.to_object(cfg.args)
    model_args: ModelArguments = OmegaConf.to_object(cfg.model)
    data_args: DataTrainingArguments = OmegaConf.to_object(cfg.data)

    from transformers import set_seed
    from transformers.trainer_pt_utils import metrics_format

    _set_cpu_threads(cfg.get("cpu_threads"))
    set_seed(args.seed)  # before the model is initialised, as run_qa.py
    examples = load_examples(cfg.data, data_args, model_args, args)
    tokenizer = build_tokenizer(cfg.model, model_args, examples.get("train"))
    model = build_model(cfg.model, model_args, tokenizer)
    features = build_features(examples, tokenizer, data_args, args)
    callbacks = instantiate_callbacks(cfg.get("callbacks"))

    log.info(f"Instantiating trainer <{cfg.task._target_}>")
    trainer = instantiate(cfg.task)(
        model=model,
        args=args,
        data_collator=_data_collator(tokenizer, data_args, args),
        train_dataset=features.get("train"),
        eval_dataset=features.get("validation"),
        eval_examples=examples.get("validation"),
        processing_class=tokenizer,
        callbacks=callbacks,
    )

    metrics: dict[str, float] = {}
    if args.do_train:
        log.info("Starting training")
        result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
        trainer.save_model()
        train_metrics = {**result.metrics, "train_samples": len(features["train"])}
        trainer.save_metrics("train", train_metrics)
        trainer.save_state()
        metrics.update(train_metrics)
    if args.do_eval:
        log.info("Starting evaluation")
        eval_metrics = {**trainer.evaluate(), "eval_samples": len(features["validation"])}
        trainer.save_metrics("eval", eval_metrics)
        metrics.update(eval_metrics)
    if args.do_predict:
        log.info("Starting prediction")
        output = trainer.predict(features["test"], examples["test"])
        predict_metrics = {**output.metrics, "predict_samples": len(features["test"])}
        trainer.save_metrics("predict", predict_metrics)
        metrics.update(predict_metrics)

    if metrics and trainer.is_world_process_zero():
        print(format_metrics_table(metrics_format(metrics), f"Final metrics ({args.output_dir})"))
    objects = dict(
        args=args,
        model_args=model_args,
        data_args=data_args,
        tokenizer=tokenizer,
        model=model,
        callbacks=callbacks,
        trainer=trainer,
        examples=examples,
        features=features,
    )
    return metrics, objects


def run(cfg: DictConfig) -> float | None:
    """:func:`train`, then the value of ``cfg.optimized_metric`` (None when it is unset).

    A failure is recorded in ``error.txt`` (the traceback) in the run directory and reported once: a user error
    (bad configuration, data or checkpoint: ``ValueError``, ``TypeError``, ``KeyError``, ``OSError``, ...) as its
    message, anything else with its traceback. In a multirun the job then returns None, so that the other jobs still
    run and the sweep completes: Hydra's basic sweeper ignores return values, and the Optuna sweeper records a trial
    whose value is not a float as failed and goes on (it would crash on NaN: Optuna 2's ``Study.tell`` raises on it,
    also when marking the trial failed). A single run re-raises; on the command line (``python train.py``,
    ``hflight-train``) Hydra then prints a user error as one message, without a traceback
    (``HYDRA_FULL_ERROR=1`` shows it).

    SIGTERM and SIGINT stop training at the next step boundary with a checkpoint (``hflight.interrupt``) and, at any
    other time, at once; either way ``error.txt`` says so and the process exits with 128 + the signal number, in a
    multirun too.
    """
    try:
        with terminate_on_signals():
            metrics, _ = train(cfg)
            return optimized_value(metrics, cfg.get("optimized_metric"))
    except TrainingInterrupted as exc:
        where = _record_failure(cfg, f"{exc}\n")
        log.error(f"Run stopped by {signal_name(exc.signum)}; recorded in {where}")
        raise
    except Exception as exc:
        where = _record_failure(cfg, traceback.format_exc())
        user_error = isinstance(exc, USER_ERRORS)
        if _in_multirun():
            log.error(
                f"Job failed: {_describe(exc)} (traceback in {where}). The sweep goes on with the remaining jobs.",
                exc_info=None if user_error else exc,
            )
            return None
        log.error(f"Run failed; the traceback is in {where}")
        if user_error and _on_command_line() and not os.environ.get("HYDRA_FULL_ERROR"):
            raise RunFailed(_describe(exc)) from exc
        raise
    finally:
        _close_loggers()


def _config_path() -> str | None:
    try:
        return str(find_config_dir())
    except FileNotFoundError:
        return None  # a non-editable install: pass --config-dir (see hflight.config)


@hydra.main(version_base=VERSION_BASE, config_path=_config_path(), config_name=PRIMARY_CONFIG)
def main(cfg: DictConfig) -> float | None:
    """``hflight-train [overrides]`` on the command line; ``main(cfg)`` runs a composed config (see :func:`run`)."""
    return run(cfg)


# ---------------------------------------------------------------------------------------------------- data
def load_examples(
    data_cfg: DictConfig, data_args: DataTrainingArguments, model_args: ModelArguments, args: TrainingArguments
) -> dict[str, Any]:
    """The examples (``id, title, context, question, answers``) per split: ``train``, ``validation``, ``test``.

    From ``data.dataset_name``, else from the ``data.*_file`` paths, else from the ``data.synthetic`` node (see
    ``hflight.config.DataTrainingArguments``). ``max_*_samples`` keep the first examples of a split.
    """
    import datasets

    if data_args.dataset_name:
        log.info(f"Loading dataset <{data_args.dataset_name}>")
        raw = datasets.load_dataset(
            data_args.dataset_name,
            data_args.dataset_config_name,
            cache_dir=model_args.cache_dir,
            token=model_args.token,
        )
        splits = {name: raw[name] for name in ("train", "validation", "test") if name in raw}
    else:
        files = {"train": data_args.train_file, "validation": data_args.validation_file, "test": data_args.test_file}
        if not data_args.has_real_data:
            if data_args.synthetic is None:
                raise ValueError(
                    "No data: set data.train_file and data.validation_file (SQuAD-format JSON), data.dataset_name, "
                    "or a data.synthetic generator (e.g. +experiment=mrc)."
                )
            log.info(f"Instantiating synthetic data <{data_cfg.synthetic._target_}>")
            train_file, validation_file = instantiate(data_cfg.synthetic)
            files = {"train": str(train_file), "validation": str(validation_file), "test": None}
        splits = {name: _load_file(path) for name, path in files.items() if path}

    needed = {"train": args.do_train, "validation": args.do_eval, "test": args.do_predict}
    missing = [name for name, wanted in needed.items() if wanted and name not in splits]
    if missing:
        keys = ", ".join(f"data.{m}_file" for m in missing)
        raise ValueError(f"args.do_train/do_eval/do_predict need the {', '.join(missing)} split(s): set {keys}.")
    limits = {
        "train": data_args.max_train_samples,
        "validation": data_args.max_eval_samples,
        "test": data_args.max_predict_samples,
    }
    for name, limit in limits.items():
        if limit is not None and name in splits:
            splits[name] = splits[name].select(range(min(limit, len(splits[name]))))
    return splits


def _load_file(path: str) -> Any:
    suffix = Path(path).suffix.lower()
    if suffix == ".json":
        from hflight.qa.data import load_squad_json

        return load_squad_json(path)
    if suffix not in _FILE_BUILDERS:
        raise ValueError(
            f"Unsupported data file {path!r}: use SQuAD-format .json, or one of "
            f"{', '.join(_FILE_BUILDERS)} with id, title, context, question, answers columns."
        )
    import datasets

    return datasets.load_dataset(_FILE_BUILDERS[suffix], data_files=path, split="train")


def build_features(
    examples: Mapping[str, Any], tokenizer: Any, data_args: DataTrainingArguments, args: TrainingArguments
) -> dict[str, Any]:
    """Windows per split: labelled training windows, and evaluation windows (with ``example_id`` and
    ``offset_mapping`` for post-processing, and labels for ``eval_loss`` where the examples have answers)."""
    from hflight.qa.preprocess import prepare_train_features, prepare_validation_features

    window = dict(
        tokenizer=tokenizer,
        max_seq_length=data_args.max_seq_length,
        doc_stride=data_args.doc_stride,
        pad_to_max_length=data_args.pad_to_max_length,
    )
    mapping = dict(
        batched=True, num_proc=data_args.preprocessing_num_workers, load_from_cache_file=not data_args.overwrite_cache
    )
    features: dict[str, Any] = {}
    with args.main_process_first(desc="dataset map pre-processing"):
        for name, split in examples.items():
            if name == "train":
                fn, desc = functools.partial(prepare_train_features, **window), "Running tokenizer on train dataset"
            elif "answers" in split.column_names:
                fn, desc = functools.partial(_labelled_eval_features, **window), f"Running tokenizer on {name} dataset"
            else:
                fn, desc = functools.partial(prepare_validation_features, **window), f"Running tokenizer on {name}"
            features[name] = split.map(fn, remove_columns=split.column_names, desc=desc, **mapping)
    if "train" in features and data_args.max_train_samples is not None:  # as run_qa.py: windows capped too
        features["train"] = features["train"].select(range(min(data_args.max_train_samples, len(features["train"]))))
    return features


def _labelled_eval_features(examples: Mapping[str, list], **window: Any) -> dict[str, list]:
    """Evaluation windows plus the training labels of the same windows (for ``eval_loss``)."""
    from hflight.qa.preprocess import prepare_train_features, prepare_validation_features

    features = prepare_validation_features(examples, **window)
    # Questions whose answers cannot be located get no training windows; label them like unanswerable ones (CLS)
    # so that both calls window exactly the same examples.
    answers = [
        a if _locatable(c, a) else {"text": [], "answer_start": []}
        for c, a in zip(examples["context"], examples["answers"])
    ]
    labels = prepare_train_features({**examples, "answers": answers}, **window)
    if labels["input_ids"] != features["input_ids"]:
        raise RuntimeError("evaluation windows and their labelled copies differ; cannot compute eval_loss")
    features["start_positions"] = labels["start_positions"]
    features["end_positions"] = labels["end_positions"]
    return features


def _locatable(context: str, answers: Mapping[str, list]) -> bool:
    """Whether at least one answer text sits at its ``answer_start`` (always true for clean SQuAD files)."""
    return any(
        start is not None and start >= 0 and text.strip() and context.startswith(text, start)
        for text, start in zip(answers["text"], answers["answer_start"])
    )


def _set_cpu_threads(threads: Any) -> None:
    if threads is None:
        return
    import torch

    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"cpu_threads must be a positive integer or null, got {threads!r}")
    torch.set_num_threads(threads)


def _data_collator(tokenizer: Any, data_args: DataTrainingArguments, args: TrainingArguments) -> Any:
    from transformers import DataCollatorWithPadding, default_data_collator

    if data_args.pad_to_max_length:
        return default_data_collator
    return DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8 if args.fp16 or args.bf16 else None)


def _texts(examples: Any) -> Iterator[str]:
    """Each distinct context once, and every question: what a tokenizer is trained on."""
    seen: set[str] = set()
    for context, question in zip(examples["context"], examples["question"]):
        if context not in seen:
            seen.add(context)
            yield context
        yield question


# ---------------------------------------------------------------------------------------------------- model
def _hub_kwargs(model_args: ModelArguments) -> dict[str, Any]:
    return dict(
        cache_dir=model_args.cache_dir,
        revision=model_args.revision or model_args.model_revision,
        token=model_args.token,
        trust_remote_code=model_args.trust_remote_code,
    )


def build_tokenizer(model_cfg: DictConfig, model_args: ModelArguments, train_examples: Any) -> Any:
    """``AutoTokenizer.from_pretrained`` of ``tokenizer_name`` / ``model_name_or_path``, or of the folder the
    ``tokenizer_trainer`` node saved a tokenizer trained on ``train_examples`` into."""
    from transformers import AutoTokenizer

    from hflight.qa.preprocess import check_tokenizer

    name = model_args.tokenizer_name or model_args.model_name_or_path
    if name is None:
        if model_args.tokenizer_trainer is None:
            raise ValueError("model: set model.model_name_or_path, model.tokenizer_name or a model.tokenizer_trainer.")
        if train_examples is None:
            raise ValueError("model.tokenizer_trainer trains on the training split: set data.train_file.")
        log.info(f"Instantiating tokenizer trainer <{model_cfg.tokenizer_trainer._target_}>")
        trained = instantiate(model_cfg.tokenizer_trainer)(_texts(train_examples))
        name = trained.name_or_path  # the folder it was saved into
    log.info(f"Instantiating tokenizer <AutoTokenizer.from_pretrained({name!r})>")
    tokenizer = AutoTokenizer.from_pretrained(name, **_hub_kwargs(model_args))
    check_tokenizer(tokenizer)
    return tokenizer


def build_model(model_cfg: DictConfig, model_args: ModelArguments, tokenizer: Any) -> Any:
    """``AutoModelForQuestionAnswering.from_pretrained(model_name_or_path)``, or ``from_config`` of the
    ``config_name`` config or the ``config`` node (with the tokenizer's vocabulary size)."""
    from transformers import AutoConfig, AutoModelForQuestionAnswering

    hub = _hub_kwargs(model_args)
    path = model_args.model_name_or_path
    if path:
        config = AutoConfig.from_pretrained(model_args.config_name or path, **hub)
        log.info(f"Instantiating model <AutoModelForQuestionAnswering.from_pretrained({path!r})>")
        return AutoModelForQuestionAnswering.from_pretrained(path, config=config, **hub)
    if model_args.config_name:
        config = AutoConfig.from_pretrained(model_args.config_name, **hub)
    elif model_args.config is not None:
        log.info(f"Instantiating model config <{model_cfg.config._target_}>")
        config = instantiate(model_cfg.config, vocab_size=len(tokenizer))
    else:
        raise ValueError("model: set model.model_name_or_path, model.config_name or a model.config node.")
    log.info(f"Instantiating model <AutoModelForQuestionAnswering.from_config({type(config).__name__})>")
    model = AutoModelForQuestionAnswering.from_config(config, trust_remote_code=model_args.trust_remote_code)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
    return model


def instantiate_callbacks(callbacks_cfg: DictConfig | None) -> list[Any]:
    """One callback per ``_target_`` node of the ``callbacks`` group (HF TrainerCallbacks or Lightning Callbacks)."""
    callbacks: list[Any] = []
    if not callbacks_cfg:
        return callbacks
    if not isinstance(callbacks_cfg, DictConfig):
        raise TypeError("callbacks must be a mapping of name -> _target_ node")
    for name, node in callbacks_cfg.items():
        if isinstance(node, DictConfig) and "_target_" in node:
            log.info(f"Instantiating callback <{node._target_}>")
            callbacks.append(instantiate(node))
        elif node is not None:
            raise TypeError(f"callbacks.{name} must be a node with a _target_ (or null to disable it)")
    return callbacks


# ---------------------------------------------------------------------------------------------------- reporting
def optimized_value(metrics: Mapping[str, float], name: str | None) -> float | None:
    """``metrics[name]`` as a float (None for no name); an unknown name raises, listing the available ones."""
    if not name:
        return None
    if name not in metrics:
        raise KeyError(f"optimized_metric={name!r} is not among the final metrics: {', '.join(sorted(metrics))}")
    return float(metrics[name])


def format_metrics_table(metrics: Mapping[str, Any], title: str) -> str:
    """A boxed two-column table of ``metrics`` under ``title``."""
    rows = [(str(k), str(v)) for k, v in metrics.items()]
    kw = max(len("metric"), *(len(k) for k, _ in rows))
    vw = max(len("value"), *(len(v) for _, v in rows))
    rule = f"+-{'-' * kw}-+-{'-' * vw}-+"
    lines = [title, rule, f"| {'metric':<{kw}} | {'value':>{vw}} |", rule]
    lines += [f"| {k:<{kw}} | {v:>{vw}} |" for k, v in rows]
    lines.append(rule)
    return "\n".join(lines)


def _in_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _run_dir(cfg: DictConfig) -> Path:
    for get in (lambda: cfg.paths.output_dir, lambda: HydraConfig.get().runtime.output_dir):
        try:
            value = get()
        except Exception:  # noqa: BLE001 - an unresolvable config must not hide the original error
            continue
        if value:
            return Path(value)
    return Path.cwd()


#: Failures caused by the configuration, the data or a checkpoint (reported by their message, not a traceback).
USER_ERRORS = (ValueError, TypeError, KeyError, OSError, ImportError, OmegaConfBaseException, HydraException)


class RunFailed(CompactHydraException):
    """A user error of a command-line run, re-raised for Hydra to print as one message (no traceback)."""


def _record_failure(cfg: DictConfig, text: str) -> Path:
    path = _run_dir(cfg) / ERROR_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        log.error(f"Could not write {path}: {exc}")
    return path


def _describe(exc: BaseException) -> str:
    """``Type: message`` (a KeyError's message without the quotes ``str`` adds)."""
    message = exc.args[0] if isinstance(exc, KeyError) and len(exc.args) == 1 else exc
    return f"{type(exc).__name__}: {message}"


def _on_command_line() -> bool:
    """Whether this runs as a job of Hydra's command line (``@hydra.main``), which prints what the job raises;
    ``hflight.config.compose`` (notebooks, tests) leaves Hydra uninitialised."""
    from hydra.core.global_hydra import GlobalHydra

    return GlobalHydra.instance().is_initialized()


def _close_loggers() -> None:
    """Finish an active wandb run, so that the next job of a sweep starts its own."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish()
