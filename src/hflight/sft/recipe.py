"""The ``sft`` task: a causal language model fine-tuned with TRL's ``SFTTrainer`` on hflight (``hflight.trl``),
through LoRA adapters unless ``task.peft`` is null.

- **Data** (``data`` group, :class:`hflight.config.SFTDataArguments`): prompt/completion pairs made from SQuAD-format
  files, ``data.train_file``/``data.validation_file``, else the files the ``data.synthetic`` node writes into the run
  folder (``hflight.qa.synthetic``'s biographies: nothing is downloaded); ``data.streaming=true`` trains on them as a
  stream (a ``datasets.IterableDataset``, bounded by ``args.max_steps``), which ``resume=`` continues from its
  checkpoint's data position. The prompt is the paragraph and the
  question ("... Question: Where was she born? Answer:"), the completion the first answer; unanswerable questions are
  left out. Each split is checked as the MRC recipe checks it (``hflight.qa.recipe.check_split``: the file named).
- **Tokenizer and model** (``model`` group): ``from_pretrained(model.model_name_or_path)``, else a word-level
  tokenizer trained on the training texts (``model.tokenizer_trainer``, :mod:`hflight.sft.tokenizer`) and a model
  built from the ``model.config`` node (a small Llama) with the tokenizer's vocabulary.
- **Trainer** (``task`` node): ``hflight.trl.SFTTrainer`` with an ``SFTConfig`` made of the run's arguments (``args``
  group) and TRL's own settings (``task.sft``: ``max_length``, ``packing``, ``completion_only_loss``, ...: a name
  SFTConfig lacks is refused), and the adapters of ``task.peft`` (``peft.LoraConfig``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from hflight.arguments.training_args import field_values
from hflight.config import ModelArguments, SFTDataArguments
from hflight.qa.data import load_squad_json
from hflight.qa.recipe import check_split, hub_kwargs, resuming_argument

log = logging.getLogger(__name__)

__all__ = ["SFTRecipe", "SFTRun", "prompt_completion", "stream_of"]


@dataclasses.dataclass
class SFTRun:
    """What :meth:`SFTRecipe.setup` built (``hflight.cli.app.TaskRun``)."""

    trainer: Any
    datasets: dict[str, Any]
    objects: dict[str, Any]
    lengths: dict[str, int] = dataclasses.field(default_factory=dict)  # the pairs of each split (a stream has no len)

    def num_samples(self, split: str) -> int:
        return self.lengths[split] if split in self.lengths else len(self.datasets[split])

    def predict(self, split: str) -> Any:
        raise ValueError("The sft task has no test split to predict on: leave args.do_predict false.")


def prompt_completion(examples: Any) -> Any:
    """SQuAD examples (``context, question, answers``) as prompt/completion pairs; unanswerable ones left out."""
    answered = examples.filter(lambda example: len(example["answers"]["text"]) > 0)
    return answered.map(
        lambda example: {
            "prompt": f"{example['context']} Question: {example['question']} Answer:",
            "completion": f" {example['answers']['text'][0]}",
        },
        remove_columns=answered.column_names,
    )


class SFTRecipe:
    """Causal-LM fine-tuning with TRL's SFT on hflight: data -> tokenizer -> model -> ``hflight.trl.SFTTrainer``.

    Args:
        trainer: a partial of the trainer class (``hflight.trl.SFTTrainer`` or a subclass). Default: that class.
        sft: ``trl.SFTConfig``'s own fields (those ``TrainingArguments`` lacks), beside the run's arguments.
        peft: the adapters' config (``peft.LoraConfig``); None trains the whole model.
    """

    def __init__(self, trainer: Callable[..., Any] | None = None, sft: dict[str, Any] | None = None,
                 peft: Any = None) -> None:  # fmt: skip
        if trainer is None:
            from hflight.trl import SFTTrainer as trainer
        self.trainer, self.peft = trainer, peft
        self.sft = OmegaConf.to_container(sft, resolve=True) if isinstance(sft, DictConfig) else dict(sft or {})

    def setup(self, cfg: DictConfig, args: Any, callbacks: list[Any]) -> SFTRun:
        """Load and check the data, build tokenizer, model and trainer.

        Raises:
            FileNotFoundError, ValueError: a data file missing or malformed, a split the run needs missing or empty
                (the message names the file); an ``sft`` setting ``SFTConfig`` does not have.
        """
        model_args: ModelArguments = OmegaConf.to_object(cfg.model)
        data_args: SFTDataArguments = OmegaConf.to_object(cfg.data)
        datasets = load_pairs(cfg.data, data_args, args)
        tokenizer = build_tokenizer(cfg.model, model_args, datasets["train"], args)
        lengths = {split: len(pairs) for split, pairs in datasets.items()}
        if data_args.streaming:
            datasets["train"] = stream_of(datasets["train"], data_args.streaming_shards, args)
        model = build_model(cfg.model, model_args, tokenizer)
        config = sft_config(args, self.sft)
        log.info(f"Instantiating trainer <{getattr(self.trainer, '__qualname__', self.trainer)}>")
        trainer = self.trainer(model=model, args=config, train_dataset=datasets.get("train"),
                               eval_dataset=datasets.get("validation"), processing_class=tokenizer,
                               callbacks=callbacks, peft_config=self.peft)  # fmt: skip
        objects = dict(model_args=model_args, data_args=data_args, tokenizer=tokenizer, model=trainer.model,
                       datasets=datasets, sft_config=config)  # fmt: skip
        return SFTRun(trainer=trainer, datasets=datasets, objects=objects, lengths=lengths)


def stream_of(pairs: Any, shards: int, args: Any) -> Any:
    """``data.streaming=true``: the training pairs as a ``datasets.IterableDataset`` of ``shards`` shards (from the
    same files), which has no length: the run is bounded by ``args.max_steps``.

    Raises:
        ValueError: ``args.max_steps`` unset, saying how many steps one pass over the pairs makes.
    """
    if args.max_steps is None or args.max_steps <= 0:
        per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
        raise ValueError(
            f"data.streaming=true trains on a stream, which has no length: set args.max_steps (the {len(pairs)} "
            f"training pairs in batches of {args.per_device_train_batch_size} x {args.gradient_accumulation_steps} "
            f"accumulated make {-(-len(pairs) // per_step)} steps a pass, on one process)."
        )
    return pairs.to_iterable_dataset(num_shards=max(1, min(shards, len(pairs))))


def sft_config(args: Any, settings: dict[str, Any]) -> Any:
    """``hflight.trl.SFTConfig`` of the run's arguments and TRL's ``settings``.

    Raises:
        ValueError: a setting that is no field of ``SFTConfig`` (or one of ``TrainingArguments``, set in ``args``).
    """
    from hflight.trl import SFTConfig

    ours = {f.name for f in dataclasses.fields(type(args)) if f.init}
    known = {f.name for f in dataclasses.fields(SFTConfig) if f.init}
    wrong = sorted(name for name in settings if name not in known or name in ours)
    if wrong:
        raise ValueError(
            f"task.sft: {wrong} are not trl.SFTConfig's own settings (TrainingArguments' go under args.*; "
            f"SFTConfig's are {sorted(known - ours)})."
        )
    return SFTConfig(**field_values(SFTConfig, args)[0], **settings)


def load_pairs(data_cfg: DictConfig, data_args: SFTDataArguments, args: Any) -> dict[str, Any]:
    """The ``train`` (and, with ``args.do_eval`` or an evaluation strategy, ``validation``) prompt/completion pairs."""
    files = {"train": data_args.train_file, "validation": data_args.validation_file}
    if not any(files.values()):
        if data_args.synthetic is None:
            raise ValueError("No data: set data.train_file and data.validation_file (SQuAD-format JSON), or a "
                             "data.synthetic generator (e.g. +experiment=sft_lora).")  # fmt: skip
        log.info(f"Instantiating synthetic data <{data_cfg.synthetic._target_}>")
        made = instantiate(data_cfg.synthetic, **resuming_argument(data_cfg.synthetic, args))
        files = dict(zip(("train", "validation"), map(str, made)))
    if files["train"] is None:
        raise ValueError("The sft task trains on data.train_file: set it.")
    limits = {"train": data_args.max_train_samples, "validation": data_args.max_eval_samples}
    pairs = {}
    for split, path in files.items():
        if path is None:
            continue
        examples = load_squad_json(path)
        if limits[split] is not None:
            examples = examples.select(range(min(limits[split], len(examples))))
        check_split(split, examples, f"data.{split}_file={path}")
        pairs[split] = prompt_completion(examples)
        if len(pairs[split]) == 0:
            raise ValueError(f"data.{split}_file={path}: no answered question to make a prompt/completion pair of.")
    if args.do_eval and "validation" not in pairs:
        raise ValueError("args.do_eval needs the validation split: set data.validation_file.")
    return pairs


def build_tokenizer(model_cfg: DictConfig, model_args: ModelArguments, train: Any, args: Any) -> Any:
    """``AutoTokenizer.from_pretrained`` of ``tokenizer_name``/``model_name_or_path``, else the ``tokenizer_trainer``
    node's, trained on the training pairs' texts (reused on resume, ``hflight.qa.made``)."""
    from transformers import AutoTokenizer

    name = model_args.tokenizer_name or model_args.model_name_or_path
    if name is None:
        if model_args.tokenizer_trainer is None:
            raise ValueError("model: set model.model_name_or_path, model.tokenizer_name or a model.tokenizer_trainer.")
        log.info(f"Instantiating tokenizer trainer <{model_cfg.tokenizer_trainer._target_}>")
        texts = [text for pair in train for text in (pair["prompt"], pair["completion"])]
        trained = instantiate(model_cfg.tokenizer_trainer, **resuming_argument(model_cfg.tokenizer_trainer, args))(
            texts
        )
        name = trained.name_or_path
    log.info(f"Instantiating tokenizer <AutoTokenizer.from_pretrained({name!r})>")
    return AutoTokenizer.from_pretrained(name, **hub_kwargs(model_args))


def build_model(model_cfg: DictConfig, model_args: ModelArguments, tokenizer: Any) -> Any:
    """``AutoModelForCausalLM.from_pretrained(model_name_or_path)``, or ``from_config`` of the ``config_name``
    config or the ``config`` node (the tokenizer's vocabulary size, its special tokens' ids)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hub = hub_kwargs(model_args)
    if model_args.model_name_or_path:
        log.info(f"Instantiating model <AutoModelForCausalLM.from_pretrained({model_args.model_name_or_path!r})>")
        return AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, **hub)
    ids = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    if model_args.config_name:
        config = AutoConfig.from_pretrained(model_args.config_name, **hub, **ids)
    elif model_args.config is not None:
        log.info(f"Instantiating model config <{model_cfg.config._target_}>")
        config = instantiate(model_cfg.config, **ids)
    else:
        raise ValueError("model: set model.model_name_or_path, model.config_name or a model.config node.")
    log.info(f"Instantiating model <AutoModelForCausalLM.from_config({type(config).__name__})>")
    return AutoModelForCausalLM.from_config(config, trust_remote_code=model_args.trust_remote_code)
