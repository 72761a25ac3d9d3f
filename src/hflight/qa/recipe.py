"""The MRC recipe: what a run of ``python train.py +experiment=mrc`` builds, in HF ``run_qa.py``'s order.

The ``task`` config group targets :class:`MRCRecipe`; ``hflight.cli.train`` instantiates it and calls
:meth:`MRCRecipe.setup`, which loads the examples (from ``data.dataset_name``, the ``data.*_file`` paths or the
``data.synthetic`` generator), **checks them before anything is trained** (every split a run needs is present,
readable, non-empty and has the columns it needs; an error names the file), then builds the tokenizer, the model,
the windows and the :class:`~hflight.qa.trainer.MRCTrainer`. The entry point knows nothing about QA: it trains,
evaluates and predicts with what :class:`MRCRun` hands back.

Evaluation loss: the validation windows also carry ``start_positions``/``end_positions`` labelled exactly as
training windows are (the answer's tokens when the whole answer is inside the window, else the CLS token; an
unanswerable question, or one whose answers cannot be located in its context, is labelled CLS), so evaluation
reports ``eval_loss`` next to the SQuAD scores, during training too. The labels cost one more tokenization of the
validation set and change neither the logits nor the answers.

Example:
    >>> from hflight import cli, config  # doctest: +SKIP
    >>> metrics, objects = cli.train(config.compose(["+experiment=mrc"]))  # doctest: +SKIP
    >>> objects["examples"]["validation"], objects["features"]["validation"]  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from hflight.config import DataTrainingArguments, ModelArguments

__all__ = ["MRCRecipe", "MRCRun", "build_features", "build_model", "build_tokenizer", "load_examples"]

log = logging.getLogger(__name__)

# Loaders for data files other than SQuAD-format .json, by extension: the `datasets` builder to use.
_FILE_BUILDERS = {".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}

#: What each split is for (the argument that asks for it), and the columns its examples must have.
SPLIT_PURPOSE = {
    "train": "training (args.do_train)",
    "validation": "evaluation (args.do_eval)",
    "test": "prediction (args.do_predict)",
}
REQUIRED_COLUMNS = {
    "train": ("question", "context", "answers"),
    "validation": ("id", "question", "context", "answers"),
    "test": ("id", "question", "context"),
}
_MAX_SAMPLES_KEY = {"train": "max_train_samples", "validation": "max_eval_samples", "test": "max_predict_samples"}


@dataclass
class MRCRun:
    """What :meth:`MRCRecipe.setup` built: the trainer, and per split the examples and their windows.

    ``objects`` is what ``hflight.cli.train`` returns to a notebook besides the metrics.
    """

    trainer: Any
    examples: dict[str, Any]
    features: dict[str, Any]
    objects: dict[str, Any] = field(default_factory=dict)

    def num_samples(self, split: str) -> int:
        """Windows of ``split`` (what HF's run_qa reports as ``{train,eval,predict}_samples``)."""
        return len(self.features[split])

    def predict(self, split: str = "test") -> Any:
        """``MRCTrainer.predict`` on the windows of ``split``, scored against its examples."""
        return self.trainer.predict(self.features[split], self.examples[split])


class MRCRecipe:
    """Extractive QA: examples -> tokenizer -> model -> windows -> :class:`~hflight.qa.trainer.MRCTrainer`.

    Args:
        trainer: a partial of the trainer class (``MRCTrainer`` or a subclass), completed in :meth:`setup` with
            the model, arguments, datasets, tokenizer and callbacks. Default: ``MRCTrainer``.
        version_2_with_negative, n_best_size, max_answer_length, null_score_diff_threshold: post-processing and
            scoring settings handed to the trainer (the config interpolates them from ``data.*``).
    """

    def __init__(
        self,
        trainer: Callable[..., Any] | None = None,
        version_2_with_negative: bool = False,
        n_best_size: int = 20,
        max_answer_length: int = 30,
        null_score_diff_threshold: float = 0.0,
    ) -> None:
        if trainer is None:
            from hflight.qa.trainer import MRCTrainer

            trainer = MRCTrainer
        self.trainer = trainer
        self.settings = dict(
            version_2_with_negative=version_2_with_negative,
            n_best_size=n_best_size,
            max_answer_length=max_answer_length,
            null_score_diff_threshold=null_score_diff_threshold,
        )

    def setup(self, cfg: DictConfig, args: Any, callbacks: list[Any]) -> MRCRun:
        """Load and check the data, then build tokenizer, model, windows and trainer from ``cfg.model``/``cfg.data``.

        Raises:
            FileNotFoundError, PermissionError: a data file is missing or unreadable.
            ValueError: a split the run needs is missing, empty, or lacks a column, or no training question has a
                locatable answer (the message names the file); invalid model settings.
        """
        model_args: ModelArguments = OmegaConf.to_object(cfg.model)
        data_args: DataTrainingArguments = OmegaConf.to_object(cfg.data)
        examples = _load_splits(cfg.data, data_args, model_args, args)[0]
        tokenizer = build_tokenizer(cfg.model, model_args, examples.get("train"), args)
        model = build_model(cfg.model, model_args, tokenizer)
        features = build_features(examples, tokenizer, data_args, args)
        factory = self.trainer
        name = getattr(factory, "func", factory)
        log.info(f"Instantiating trainer <{name.__module__}.{name.__qualname__}>")
        trainer = factory(
            model=model,
            args=args,
            data_collator=_data_collator(tokenizer, data_args, args),
            train_dataset=features.get("train"),
            eval_dataset=features.get("validation"),
            eval_examples=examples.get("validation"),
            processing_class=tokenizer,
            callbacks=callbacks,
            **self.settings,
        )
        objects = dict(
            model_args=model_args,
            data_args=data_args,
            tokenizer=tokenizer,
            model=model,
            examples=examples,
            features=features,
        )
        return MRCRun(trainer=trainer, examples=examples, features=features, objects=objects)


# ---------------------------------------------------------------------------------------------------- data
def load_examples(
    data_cfg: DictConfig, data_args: DataTrainingArguments, model_args: ModelArguments, args: Any
) -> dict[str, Any]:
    """The examples (``id, title, context, question, answers``) per split: ``train``, ``validation``, ``test``.

    From ``data.dataset_name``, else from the ``data.*_file`` paths, else from the ``data.synthetic`` node (see
    ``hflight.config.DataTrainingArguments``). ``max_*_samples`` keep the first examples of a split. Every split is
    checked (:func:`check_split`) before this returns.
    """
    return _load_splits(data_cfg, data_args, model_args, args)[0]


def _load_splits(
    data_cfg: DictConfig, data_args: DataTrainingArguments, model_args: ModelArguments, args: Any
) -> tuple[dict[str, Any], dict[str, str]]:
    """(examples per split, where each split came from: the config key and path, for messages)."""
    if data_args.dataset_name:
        splits, sources = _load_hub_dataset(data_args, model_args)
    else:
        files = {"train": data_args.train_file, "validation": data_args.validation_file, "test": data_args.test_file}
        keys = {name: f"data.{name}_file={path}" for name, path in files.items() if path}
        if not data_args.has_real_data:
            if data_args.synthetic is None:
                raise ValueError(
                    "No data: set data.train_file and data.validation_file (SQuAD-format JSON), data.dataset_name, "
                    "or a data.synthetic generator (e.g. +experiment=mrc)."
                )
            log.info(f"Instantiating synthetic data <{data_cfg.synthetic._target_}>")
            train_file, validation_file = instantiate(data_cfg.synthetic, **resuming_argument(data_cfg.synthetic, args))
            files = {"train": str(train_file), "validation": str(validation_file), "test": None}
            keys = {name: f"synthetic {name} file {path}" for name, path in files.items() if path}
        splits = {name: _load_file(path, keys[name]) for name, path in files.items() if path}
        sources = keys

    needed = {"train": args.do_train, "validation": args.do_eval, "test": args.do_predict}
    missing = [name for name, wanted in needed.items() if wanted and name not in splits]
    if missing:
        keys = ", ".join(f"data.{m}_file" for m in missing)
        raise ValueError(f"args.do_train/do_eval/do_predict need the {', '.join(missing)} split(s): set {keys}.")
    for name, split in list(splits.items()):
        limit = getattr(data_args, _MAX_SAMPLES_KEY[name])
        if limit is not None:
            splits[name] = split.select(range(min(limit, len(split))))
        check_split(name, splits[name], sources[name], limit_key=_MAX_SAMPLES_KEY[name] if limit is not None else None)
    if "train" in splits:
        _check_trainable(splits["train"], sources["train"])
    return splits, sources


def _check_trainable(examples: Any, source: str) -> None:
    """Training needs a question that is unanswerable or has an answer at its ``answer_start``: the others get no
    training windows (``prepare_train_features`` skips them), so without one there would be nothing to train on."""
    for context, answers in zip(examples["context"], examples["answers"]):
        if not answers["text"] or _locatable(context, answers):
            return
    raise ValueError(
        f"{source}: nothing to train on: none of the {len(examples)} questions of the train split has an answer that "
        "can be located in its context (answer_start pointing at the answer text), and none is unanswerable."
    )


def check_split(name: str, examples: Any, source: str, limit_key: str | None = None) -> None:
    """Raise ``ValueError`` naming ``source`` unless split ``name`` has examples and the columns it needs.

    ``answers`` must be ``{"text": [...], "answer_start": [...]}`` per example (SQuAD's layout).
    """
    purpose = SPLIT_PURPOSE.get(name, name)
    if len(examples) == 0:
        after = f" after data.{limit_key}" if limit_key else ""
        raise ValueError(
            f"{source}: the {name} split has no questions{after} (0 examples); {purpose} needs at least one."
        )
    columns = list(getattr(examples, "column_names", None) or [])
    lacking = [c for c in REQUIRED_COLUMNS.get(name, ()) if c not in columns]
    if lacking:
        raise ValueError(
            f"{source}: the {name} split lacks the column(s) {', '.join(lacking)} that {purpose} needs "
            f"(it has: {', '.join(columns) or 'none'})."
        )
    if "answers" in columns:
        answers = getattr(examples, "features", {}).get("answers")
        layout = getattr(answers, "feature", answers)  # datasets' Sequence of a dict, or the dict itself
        if not (isinstance(layout, Mapping) and {"text", "answer_start"} <= set(layout)):
            raise ValueError(
                f"{source}: column 'answers' of the {name} split must hold {{'text': [...], 'answer_start': "
                f"[...]}} per question, got {answers}."
            )


def _load_hub_dataset(data_args: DataTrainingArguments, model_args: ModelArguments) -> tuple[dict, dict]:
    import datasets

    log.info(f"Loading dataset <{data_args.dataset_name}>")
    raw = datasets.load_dataset(
        data_args.dataset_name,
        data_args.dataset_config_name,
        cache_dir=model_args.cache_dir,
        token=model_args.token,
    )
    splits = {name: raw[name] for name in ("train", "validation", "test") if name in raw}
    config = f" ({data_args.dataset_config_name})" if data_args.dataset_config_name else ""
    return splits, {name: f"data.dataset_name={data_args.dataset_name}{config}" for name in splits}


def _load_file(path: str, source: str) -> Any:
    """A SQuAD-format .json file (validated by ``load_squad_json``), or a .jsonl/.csv/.parquet file of examples."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"{source}: no such file" + (" (it is a directory)" if file.is_dir() else ""))
    if not os.access(file, os.R_OK):
        raise PermissionError(f"{source}: the file is not readable (permission denied)")
    suffix = file.suffix.lower()
    if suffix == ".json":
        from hflight.qa.data import load_squad_json

        return load_squad_json(file)
    if suffix not in _FILE_BUILDERS:
        raise ValueError(
            f"{source}: unsupported data file: use SQuAD-format .json, or one of "
            f"{', '.join(_FILE_BUILDERS)} with id, title, context, question, answers columns."
        )
    import datasets

    try:
        return datasets.load_dataset(_FILE_BUILDERS[suffix], data_files=str(file), split="train")
    except Exception as err:  # noqa: BLE001 - datasets raises many kinds; the message must name the file
        raise ValueError(f"{source}: could not be read as {suffix[1:]} ({type(err).__name__}: {err})") from err


def build_features(
    examples: Mapping[str, Any], tokenizer: Any, data_args: DataTrainingArguments, args: Any
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
                fn, desc = functools.partial(labelled_eval_features, **window), f"Running tokenizer on {name} dataset"
            else:
                fn, desc = functools.partial(prepare_validation_features, **window), f"Running tokenizer on {name}"
            features[name] = split.map(fn, remove_columns=split.column_names, desc=desc, **mapping)
    if "train" in features and data_args.max_train_samples is not None:  # as run_qa.py: windows capped too
        features["train"] = features["train"].select(range(min(data_args.max_train_samples, len(features["train"]))))
    return features


def labelled_eval_features(examples: Mapping[str, list], **window: Any) -> dict[str, list]:
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


def _data_collator(tokenizer: Any, data_args: DataTrainingArguments, args: Any) -> Any:
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
def hub_kwargs(model_args: ModelArguments) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments of ``model_args`` (``revision`` wins over run_qa's ``model_revision``)."""
    return dict(
        cache_dir=model_args.cache_dir,
        revision=model_args.revision or model_args.model_revision,
        token=model_args.token,
        trust_remote_code=model_args.trust_remote_code,
    )


def resuming_argument(node: DictConfig, args: Any) -> dict[str, bool]:
    """``{"resuming": ...}`` for a maker of run-folder files (the synthetic data, the tokenizer trainer) that takes
    it (``hflight.qa.made``): whether this run continues from a checkpoint, whose data and vocabulary it must keep."""
    import inspect

    from hydra.utils import get_method

    resume = args.resume_from_checkpoint
    resuming = bool(resume) and str(resume).lower() != "false"
    try:
        takes = "resuming" in inspect.signature(get_method(node._target_)).parameters
    except (ValueError, TypeError, ImportError, AttributeError):  # noqa: B014 - hydra raises several kinds
        takes = False
    return {"resuming": resuming} if takes else {}


def build_tokenizer(model_cfg: DictConfig, model_args: ModelArguments, train_examples: Any, args: Any = None) -> Any:
    """``AutoTokenizer.from_pretrained`` of ``tokenizer_name`` / ``model_name_or_path``, or of the folder the
    ``tokenizer_trainer`` node saved a tokenizer trained on ``train_examples`` into (reused when it was trained
    there on the same texts; ``args``: the training arguments, whose ``resume_from_checkpoint`` makes another
    tokenizer there an error)."""
    from transformers import AutoTokenizer

    from hflight.qa.preprocess import check_tokenizer

    name = model_args.tokenizer_name or model_args.model_name_or_path
    if name is None:
        if model_args.tokenizer_trainer is None:
            raise ValueError("model: set model.model_name_or_path, model.tokenizer_name or a model.tokenizer_trainer.")
        if train_examples is None:
            raise ValueError("model.tokenizer_trainer trains on the training split: set data.train_file.")
        log.info(f"Instantiating tokenizer trainer <{model_cfg.tokenizer_trainer._target_}>")
        extra = resuming_argument(model_cfg.tokenizer_trainer, args) if args is not None else {}
        trained = instantiate(model_cfg.tokenizer_trainer, **extra)(_texts(train_examples))
        name = trained.name_or_path  # the folder it was saved into
    log.info(f"Instantiating tokenizer <AutoTokenizer.from_pretrained({name!r})>")
    tokenizer = AutoTokenizer.from_pretrained(name, **hub_kwargs(model_args))
    check_tokenizer(tokenizer)
    return tokenizer


def build_model(model_cfg: DictConfig, model_args: ModelArguments, tokenizer: Any) -> Any:
    """``AutoModelForQuestionAnswering.from_pretrained(model_name_or_path)``, or ``from_config`` of the
    ``config_name`` config or the ``config`` node (with the tokenizer's vocabulary size)."""
    from transformers import AutoConfig, AutoModelForQuestionAnswering

    hub = hub_kwargs(model_args)
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
