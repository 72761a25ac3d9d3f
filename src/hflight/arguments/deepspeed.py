"""transformers' DeepSpeed config, resolved from the arguments before it reaches Lightning's ``DeepSpeedStrategy``.

A transformers-style config (a dict, a JSON file, JSON text or base64 JSON, as ``TrainingArguments.deepspeed`` takes
it) writes ``"auto"`` where the value should come from the arguments or the model. transformers' Trainer fills them
in two stages (``HfTrainerDeepSpeedConfig``): from the arguments alone (batch sizes, accumulation, clipping, the
optimizer's and scheduler's parameters, mixed precision, ``save_on_each_node``), and once the model and the number
of training steps are known (ZeRO bucket sizes from the model's hidden size, the scheduler's total and warmup
steps). A value that is not ``"auto"`` but differs from the argument is an error listing every mismatch, in
transformers' words. :class:`DeepSpeedConfigResolver` does the same here (written for hflight, checked against
transformers' own resolution by the tests); the run calls :meth:`~DeepSpeedConfigResolver.finalize` with the plan's
``max_steps`` before Lightning builds the DeepSpeed engine.
"""

from __future__ import annotations

import base64
import copy
import json
import os
from typing import Any

#: The ZeRO keys transformers derives from the model's hidden size.
HIDDEN_SIZE_KEYS = (
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
)


#: ZeRO's stages (0: none; 1: optimizer states; 2: and gradients; 3: and parameters)
ZERO_STAGES = (0, 1, 2, 3)


def load_deepspeed_config(value: Any) -> dict[str, Any]:
    """``args.deepspeed`` as a dict (a copy: the caller's dict is never filled in), checked: a file that cannot be
    read or is not JSON (the file and the position named), a value that is no config, a ZeRO stage out of range."""
    config = _read_config(value)
    if not isinstance(config, dict):
        raise ValueError(
            f"deepspeed config {describe_source(value)} must be a JSON object, got {type(config).__name__}"
        )
    zero = config.get("zero_optimization", {})
    stage = zero.get("stage", 0) if isinstance(zero, dict) else None
    if not isinstance(zero, dict) or stage not in ZERO_STAGES or isinstance(stage, bool):
        raise ValueError(
            f"deepspeed config {describe_source(value)}: zero_optimization.stage must be one of "
            f"{', '.join(map(str, ZERO_STAGES))}, got {stage if isinstance(zero, dict) else zero!r}"
        )
    return config


def describe_source(value: Any) -> str:
    return str(value) if isinstance(value, (str, os.PathLike)) and os.path.exists(value) else "(given inline)"


def _read_config(value: Any) -> Any:
    if isinstance(value, dict):
        return copy.deepcopy(value)
    if isinstance(value, (str, os.PathLike)) and os.path.exists(value):
        try:
            with open(value, encoding="utf-8") as handle:
                return json.load(handle)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"deepspeed config {value} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
            ) from exc
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"deepspeed config {value} cannot be read: {exc}") from exc
    try:
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return json.loads(base64.urlsafe_b64decode(value).decode("utf-8"))
    except (UnicodeDecodeError, AttributeError, TypeError, ValueError) as exc:
        raise ValueError(
            f"deepspeed: expected a path to an existing DeepSpeed config, a dict, or (base64) JSON text, got {value!r}"
        ) from exc


class DeepSpeedConfigResolver:
    """A DeepSpeed config with its ``"auto"`` values filled in from the arguments and the model, as transformers'
    ``HfTrainerDeepSpeedConfig`` fills them; ``config`` is the resolved dict."""

    def __init__(self, value: Any) -> None:
        self.config = load_deepspeed_config(value)
        self.source = describe_source(value)
        self.mismatches: list[str] = []

    # -- reading the config ------------------------------------------------------------------------------------------
    def _node(self, dotted: str) -> tuple[dict[str, Any] | None, str]:
        *parents, key = dotted.split(".")
        node: Any = self.config
        for name in parents:
            node = node.get(name)
            if node is None:
                return None, key
        return node, key

    def value(self, dotted: str, default: Any = None) -> Any:
        node, key = self._node(dotted)
        return default if node is None else node.get(key, default)

    def zero_stage(self) -> int:
        return self.value("zero_optimization.stage", -1)

    # -- filling it in ---------------------------------------------------------------------------------------------
    def fill(self, dotted: str, value: Any, hf_name: str | None = None, must_match: bool = True) -> None:
        """``"auto"`` at ``dotted`` becomes ``value``; another value that differs is a mismatch (``must_match``)."""
        node, key = self._node(dotted)
        if node is None:
            return
        if node.get(key) == "auto":
            node[key] = value
        elif must_match and node.get(key) is not None and node.get(key) != value:
            self.mismatches.append(f"- ds {dotted}={node.get(key)} vs hf {hf_name}={value}")

    def process(self, args: Any, auto_find_batch_size: bool = False) -> None:
        """The values the arguments alone decide; transformers' refusal of ``save_only_model`` with
        ``load_best_model_at_end`` (its ``Trainer.__init__``: the best checkpoint would hold no DeepSpeed state to
        load)."""
        if args.save_only_model and args.load_best_model_at_end:
            raise ValueError("DeepSpeed can't be used with `save_only_model` along with `load_best_model_at_end`.")
        batch, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
        strict = not auto_find_batch_size
        self.fill("train_micro_batch_size_per_gpu", batch, "per_device_train_batch_size", strict)
        self.fill("gradient_accumulation_steps", accumulation, "gradient_accumulation_steps")
        total = args.world_size * batch * accumulation
        self.fill("train_batch_size", total, "train_batch_size (calculated)", strict)
        self.fill("gradient_clipping", args.max_grad_norm, "max_grad_norm")
        self.fill("optimizer.params.lr", args.learning_rate, "learning_rate")
        self.fill("optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2")
        self.fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
        self.fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
        self.fill("scheduler.params.warmup_min_lr", 0, must_match=False)
        self.fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
        if args.save_on_each_node:  # DeepSpeed assumes shared storage unless told otherwise
            self.config.setdefault("checkpoint", {})["use_node_local_storage"] = True
        self.fill("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16|fp16_full_eval")
        self.fill("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16|bf16_full_eval")

    def plugin_defaults(self, args: Any) -> None:
        """What accelerate's DeepSpeed plugin adds to transformers' resolved config before the engine sees it: the
        mixed precision's section, the other one off, and no step logs on stdout."""
        mixed = "fp16" if args.fp16 else "bf16" if args.bf16 else None
        if mixed is not None:
            self.config.setdefault(mixed, {"enabled": True})
        for dtype in ("fp16", "bf16"):
            self.config.setdefault(dtype, {"enabled": False})
        self.config["steps_per_print"] = float("inf")

    def finalize(self, args: Any, model: Any, num_training_steps: int) -> dict[str, Any]:
        """The values that need the model (ZeRO buckets from its hidden size) and the run's length (the scheduler's
        steps); raises, listing them, when values given in the config contradict the arguments."""
        auto_keys = [key for key in HIDDEN_SIZE_KEYS if self.value(key) == "auto"]
        if auto_keys:
            hidden = _hidden_size(model)
            if hidden is None:
                raise ValueError(
                    "The model's config file has neither `hidden_size` nor `hidden_sizes` entry, therefore it's not "
                    "possible to automatically fill out the following `auto` entries in the DeepSpeed config file: "
                    f"{auto_keys}. You can fix that by replacing `auto` values for these keys with an integer value of "
                    "your choice."
                )
            self.fill("zero_optimization.reduce_bucket_size", hidden * hidden, must_match=False)
            if self.zero_stage() == 3:
                self.fill("zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden * hidden), must_match=False)
                self.fill("zero_optimization.stage3_param_persistence_threshold", 10 * hidden, must_match=False)
        self.fill("scheduler.params.total_num_steps", num_training_steps, "num_training_steps (calculated)")
        warmup = max(1, args.get_warmup_steps(num_training_steps))  # DeepSpeed rejects 0 warmup steps
        self.fill("scheduler.params.warmup_num_steps", warmup, "warmup_steps")
        if self.mismatches:
            raise ValueError(
                "Please correct the following DeepSpeed config values that mismatch TrainingArguments values:\n"
                + "\n".join(self.mismatches)
                + "\nThe easiest method is to set these DeepSpeed config values to 'auto'."
            )
        return self.config


def _hidden_size(model: Any) -> int | None:
    """The model config's hidden size (the largest of ``hidden_sizes``; a text config's for a multimodal model)."""
    config = getattr(model, "config", None)
    for source in (config, getattr(config, "text_config", None)):
        if source is None:
            continue
        if hasattr(source, "hidden_size"):
            return source.hidden_size
        if hasattr(source, "hidden_sizes"):
            return max(source.hidden_sizes)
    return None
