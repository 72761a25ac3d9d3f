"""``IPUConfig``: optimum-graphcore's IPU configuration (same fields, defaults, validation and ``ipu_config.json``).

optimum-graphcore's own class cannot be reused: it imports poptorch and popart at module level and pins
transformers 4.29. This one keeps its file format, so the IPU configs Graphcore published (``Graphcore/*-ipu`` on the
Hub) load unchanged, and builds ``poptorch.Options`` in optimum-graphcore's order (:meth:`IPUConfig.to_options`).
poptorch is imported only by ``to_options``.

Training and inference have separate values for the layout fields (``layers_per_ipu`` and
``inference_layers_per_ipu``, ...). :meth:`train` and :meth:`eval` choose which one the mode-dependent accessors
(``_layers_per_ipu``, ``_ipus_per_replica``, ``_matmul_proportion``, ...) read and write, as optimum-graphcore's
managed attributes do; ``IPUConfig.modes`` lists the modes (a subclass may list its own) and coherence is checked in
each of them. Validation errors carry optimum-graphcore's wording, so code that matches on them keeps working. Keys of
a transformers model config found in ``ipu_config.json`` or passed as keywords (``return_dict``, ``architectures``,
...) are ignored, as optimum-graphcore ignores them; any other unknown key raises.

Example:
    >>> config = IPUConfig(replication_factor=2, gradient_accumulation_steps=8, device_iterations=4)
    >>> config.batch_size_factor(), config.batch_size_factor(for_inference=True)
    (64, 1)
    >>> config.eval()._ipus_per_replica
    1
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import os
import tempfile
import typing
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Union

log = logging.getLogger(__name__)

__all__ = ["IPU_CONFIG_NAME", "IPUConfig", "IncompatibleIPUConfigError"]

IPU_CONFIG_NAME = "ipu_config.json"

# PopART enum values that optimum-graphcore passes as ints (popart.AccumulateOuterFragmentSchedule and
# popart.SubgraphCopyingStrategy); spelt out so that building options does not need the popart module.
_OVERLAP_MEMORY_OPTIMIZED = 3
_SUBGRAPH_COPYING_JUST_IN_TIME = 1

# ruff: noqa: UP006, UP007 - the field types below are read at run time by the validator


class IncompatibleIPUConfigError(ValueError):
    """IPUConfig values that are invalid or incompatible with each other (optimum-graphcore's name)."""


# Field -> (type, default). Defaults are optimum-graphcore's; None means "derived" (see __init__).
_FIELDS: Dict[str, tuple] = {
    "replication_factor": (int, 1),
    "inference_replication_factor": (int, 1),
    "gradient_accumulation_steps": (int, 1),
    "layers_per_ipu": (List[int], [-1]),
    "inference_layers_per_ipu": (Optional[List[int]], None),
    "ipus_per_replica": (Optional[int], None),
    "inference_ipus_per_replica": (Optional[int], None),
    "optimizer_state_offchip": (bool, False),
    "replicated_tensor_sharding": (bool, False),
    "matmul_proportion": (Union[float, List[float]], 0.2),
    "inference_matmul_proportion": (Optional[Union[float, List[float]]], None),
    "enable_half_partials": (bool, True),
    "embedding_serialization_factor": (Optional[int], None),
    "inference_embedding_serialization_factor": (Optional[int], None),
    "serialized_embedding_splits_per_ipu": (Optional[List[int]], None),
    "inference_serialized_embedding_splits_per_ipu": (Optional[List[int]], None),
    "projection_serialization_factor": (Optional[int], None),
    "inference_projection_serialization_factor": (Optional[int], None),
    "serialized_projection_splits_per_ipu": (Optional[List[int]], None),
    "inference_serialized_projection_splits_per_ipu": (Optional[List[int]], None),
    "recompute_checkpoint_every_layer": (bool, False),
    "device_iterations": (int, 1),
    "inference_device_iterations": (int, 1),
    "output_mode": (str, "final"),
    "seed": (Optional[int], None),
    "auto_loss_scaling": (bool, False),
    "executable_cache_dir": (str, ""),
    "explicit_ir_inference": (bool, False),
    "parallelize_kwargs": (Optional[Dict[str, Any]], None),
    "inference_parallelize_kwargs": (Optional[Dict[str, Any]], None),
    "execute_encoder_on_cpu_for_generation": (bool, False),
}

# Lower bounds (optimum-graphcore's `_contents_geq_value_validator`): scalars and every list element.
_FLOORS: Dict[str, float] = {
    "layers_per_ipu": -1,
    "inference_layers_per_ipu": -1,
    "matmul_proportion": 0,
    "inference_matmul_proportion": 0,
    "replication_factor": 1,
    "inference_replication_factor": 1,
    "gradient_accumulation_steps": 1,
    "ipus_per_replica": 1,
    "inference_ipus_per_replica": 1,
    "embedding_serialization_factor": 1,
    "inference_embedding_serialization_factor": 1,
    "projection_serialization_factor": 1,
    "inference_projection_serialization_factor": 1,
    "device_iterations": 1,
    "inference_device_iterations": 1,
}

_OUTPUT_MODES = ("all", "sum", "final", "default")
_REPLICATION_FIELDS = ("replication_factor", "inference_replication_factor")
_SPLIT_FIELDS = tuple(
    f"{prefix}serialized_{layer}_splits_per_ipu"
    for prefix in ("", "inference_")
    for layer in ("embedding", "projection")
)
# Keys optimum-graphcore accepted with a deprecation warning.
_DEPRECATED_KEYS = {
    "sharded_execution_for_inference": "sharded execution is always used during inference",
    "enable_half_first_order_momentum": "it has no effect",
}
# Keys optimum's BaseConfig writes into ipu_config.json besides the fields: read and ignored.
_METADATA_KEYS = ("optimum_version", "transformers_version")
# optimum-graphcore ignores every key of a transformers model config (its IPUConfig derives from PretrainedConfig):
# the keys of transformers 4.29's PretrainedConfig().to_dict(), the version optimum-graphcore wrote its files with;
# the installed transformers' keys are added at run time (see _model_config_keys).
_TRANSFORMERS_4_29_CONFIG_KEYS = frozenset(
    """return_dict output_hidden_states output_attentions torchscript torch_dtype use_bfloat16 tf_legacy_loss
    pruned_heads tie_word_embeddings is_encoder_decoder is_decoder cross_attention_hidden_size add_cross_attention
    tie_encoder_decoder max_length min_length do_sample early_stopping num_beams num_beam_groups diversity_penalty
    temperature top_k top_p typical_p repetition_penalty length_penalty no_repeat_ngram_size
    encoder_no_repeat_ngram_size bad_words_ids num_return_sequences chunk_size_feed_forward output_scores
    return_dict_in_generate forced_bos_token_id forced_eos_token_id remove_invalid_values
    exponential_decay_length_penalty suppress_tokens begin_suppress_tokens architectures finetuning_task id2label
    label2id tokenizer_class prefix bos_token_id pad_token_id eos_token_id sep_token_id decoder_start_token_id
    task_specific_params problem_type _name_or_path""".split()
)


@functools.lru_cache(maxsize=1)
def _model_config_keys() -> frozenset[str]:
    from transformers import PretrainedConfig

    return _TRANSFORMERS_4_29_CONFIG_KEYS | frozenset(PretrainedConfig().to_dict())


def _type_ok(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Union:
        return any(_type_ok(value, arg) for arg in args)
    if hint is type(None):
        return value is None
    if origin in (list, List):
        return isinstance(value, list) and all(_type_ok(v, args[0]) for v in value)
    if origin in (dict, Dict):
        return isinstance(value, dict) and all(isinstance(k, str) for k in value)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


class _ModeField:
    """Reads and writes ``name`` in inference mode as ``inference_name``, and as ``name`` in every other mode (the
    semantics of optimum-graphcore's ``ManagedAttribute``)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def _target(self, obj: IPUConfig) -> str:
        return f"inference_{self.name}" if obj.mode == "inference" else self.name

    def __get__(self, obj: IPUConfig | None, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(obj, self._target(obj))

    def __set__(self, obj: IPUConfig, value: Any) -> None:
        setattr(obj, self._target(obj), value)


class IPUConfig:
    """The IPU configuration of optimum-graphcore: batching, pipelining, memory and precision settings.

    Every field of optimum-graphcore's ``IPUConfig`` with its default; see its documentation for what each
    controls. Values are checked on construction and on assignment with optimum-graphcore's rules and messages: a
    wrong type raises ``TypeError``, an out-of-range value ``ValueError``, incoherent values and unknown keywords an
    :class:`IncompatibleIPUConfigError`; keys of a transformers model config are ignored.
    """

    CONFIG_NAME = IPU_CONFIG_NAME
    #: The modes of the mode-dependent accessors; coherence is validated in each (a subclass may add its own).
    modes: tuple[str, ...] = ("training", "inference")

    _layers_per_ipu = _ModeField("layers_per_ipu")
    _ipus_per_replica = _ModeField("ipus_per_replica")
    _matmul_proportion = _ModeField("matmul_proportion")
    _embedding_serialization_factor = _ModeField("embedding_serialization_factor")
    _serialized_embedding_splits_per_ipu = _ModeField("serialized_embedding_splits_per_ipu")
    _projection_serialization_factor = _ModeField("projection_serialization_factor")
    _serialized_projection_splits_per_ipu = _ModeField("serialized_projection_splits_per_ipu")
    _parallelize_kwargs = _ModeField("parallelize_kwargs")

    def __init__(self, **kwargs: Any) -> None:
        object.__setattr__(self, "_mode", "training")
        kwargs = _known_arguments(kwargs)
        for name in _REPLICATION_FIELDS:
            value = kwargs.get(name, 1)
            if not isinstance(value, int):
                raise ValueError(f"{name} must be of type `int`. You provided: {name}={value}, {type(value)}.")
        values = {name: copy.deepcopy(kwargs.get(name, default)) for name, (_, default) in _FIELDS.items()}
        for name, value in values.items():  # as given, before anything is derived from them
            _check_field(name, value)
        for name, value in _derived_defaults(values).items():
            setattr(self, name, value)
        self._validate_ipu_config()

    # ---- modes -------------------------------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        if value not in self.modes:
            raise ValueError(
                f"`IPUConfig` mode can only take values in {self.modes}. You provided: {value=}. Use the `train` and "
                "`eval` methods instead to avoid error."
            )
        object.__setattr__(self, "_mode", value)

    def train(self) -> IPUConfig:
        """Training mode: the mode-dependent accessors read the training fields. Returns ``self``."""
        self.mode = "training"
        return self

    def eval(self) -> IPUConfig:
        """Inference mode: the mode-dependent accessors read the ``inference_*`` fields. Returns ``self``."""
        self.mode = "inference"
        return self

    def _get_managed_attr_mode_name(self, attr: str) -> str:
        """The field a mode-dependent accessor of ``attr`` reaches in the current mode (optimum-graphcore's helper:
        ``attr`` in training mode, ``inference_<attr>`` in the others; ``attr`` itself when it has no variant)."""
        if attr in _FIELDS and f"inference_{attr}" in _FIELDS:
            return attr if self.mode == "training" else f"inference_{attr}"
        return attr

    # ---- validation --------------------------------------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        if name in _FIELDS:
            _check_field(name, value)
        object.__setattr__(self, name, value)

    def _validate_ipu_config(self) -> IPUConfig:
        """Coherence of the fields in every mode (optimum-graphcore's checks); fills serialization defaults."""
        if self.replicated_tensor_sharding and self.replication_factor == 1:
            log.warning("`replicated_tensor_sharding` is not used when `replication_factor=1`")
        previous = self.mode
        try:
            for mode in self.modes:
                self.mode = mode
                self._validate_mode()
        finally:
            self.mode = previous
        return self

    def _validate_mode(self) -> None:
        ipus_name = self._get_managed_attr_mode_name("ipus_per_replica")
        ipus = self._ipus_per_replica
        for attr, value in (("matmul_proportion", self._matmul_proportion), ("layers_per_ipu", self._layers_per_ipu)):
            wildcard = attr == "layers_per_ipu" and -1 in value  # model.parallelize resolves wildcards
            if isinstance(value, list) and not wildcard and len(value) != ipus:
                raise IncompatibleIPUConfigError(
                    f"{self._get_managed_attr_mode_name(attr)}={value} should use the same number of IPUs as "
                    f"{ipus_name}={ipus}."
                )
        for layer in ("embedding", "projection"):
            self._validate_serialization(layer, ipus_name, ipus)

    def _validate_serialization(self, layer: str, ipus_name: str, ipus: int) -> None:
        splits_name = self._get_managed_attr_mode_name(f"serialized_{layer}_splits_per_ipu")
        factor_name = self._get_managed_attr_mode_name(f"{layer}_serialization_factor")
        splits, factor = getattr(self, splits_name), getattr(self, factor_name)
        if not (splits or factor):
            setattr(self, factor_name, 1)
        if splits and factor:
            raise ValueError(
                f"Only one of `{factor_name}` and `{splits_name}` should be used at once. `{factor_name}` should be "
                f"used when you want your {layer} layer serialised on the same IPU (which IPU depends on the model). "
                f"`{splits_name}` should be used when you want your {layer} layer to be split across multiple IPUs "
                "of your choice (or to choose which single IPU the layer is serialised on)."
            )
        if splits and len(splits) != ipus:
            raise ValueError(f"{splits_name}={splits} should use the same number of IPUs as {ipus_name}={ipus}.")

    # ---- batching ----------------------------------------------------------------------------------------------
    def batch_size_factor(self, for_inference: bool = False) -> int:
        """Micro-batch size x this = the combined batch one call of the device consumes."""
        if for_inference:
            return self.inference_replication_factor * self.inference_device_iterations
        return self.replication_factor * self.gradient_accumulation_steps * self.device_iterations

    # ---- poptorch options --------------------------------------------------------------------------------------
    def to_options(self, for_inference: bool = False, compile_only: bool = False) -> Any:
        """``poptorch.Options`` for training or inference, built in optimum-graphcore's order.

        ``compile_only`` targets an offline IPU (no hardware needed; the executable can only be compiled).
        """
        from hflight.ipu.runtime import require_poptorch

        poptorch = require_poptorch()
        if not compile_only and poptorch.ipuHardwareVersion() not in (2, 21):
            raise RuntimeError("This requires an IPU Mk2 system to run (poptorch.ipuHardwareVersion() is not 2 or 21).")
        if self.execute_encoder_on_cpu_for_generation:
            raise NotImplementedError("execute_encoder_on_cpu_for_generation is not supported.")
        previous = self.mode
        self.eval() if for_inference else self.train()
        try:
            return self._build_options(poptorch, for_inference, compile_only)
        finally:
            self.mode = previous

    def _build_options(self, poptorch: Any, for_inference: bool, compile_only: bool) -> Any:
        opts = poptorch.Options()
        opts.autoRoundNumIPUs(True)
        opts.replicationFactor(self.inference_replication_factor if for_inference else self.replication_factor)
        opts.deviceIterations(self.inference_device_iterations if for_inference else self.device_iterations)
        if not for_inference:
            opts.Training.gradientAccumulation(self.gradient_accumulation_steps)
            opts.Training.accumulationAndReplicationReductionType(poptorch.ReductionType.Mean)
        if self.auto_loss_scaling and not for_inference:
            opts.Training.setAutomaticLossScaling(True)
        output_modes = {
            "all": poptorch.OutputMode.All,
            "sum": poptorch.OutputMode.Sum,
            "final": poptorch.OutputMode.Final,
            "default": poptorch.OutputMode.Default,
        }
        opts.outputMode(poptorch.OutputMode.All if for_inference else output_modes[self.output_mode])
        if self.seed:
            opts.randomSeed(self.seed)
        replicas = self.inference_replication_factor if for_inference else self.replication_factor
        opts.TensorLocations.setOptimizerLocation(
            poptorch.TensorLocationSettings()
            .useOnChipStorage(not self.optimizer_state_offchip)
            .useReplicatedTensorSharding(self.replicated_tensor_sharding and replicas > 1)
        )
        execution = poptorch.ShardedExecution if for_inference else poptorch.PipelinedExecution
        opts.setExecutionStrategy(execution(poptorch.AutoStage.AutoIncrement))
        if compile_only:
            opts.useOfflineIpuTarget()
        matmul = self._matmul_proportion
        if not isinstance(matmul, list):
            matmul = [matmul] * self._ipus_per_replica
        opts.setAvailableMemoryProportion({f"IPU{i}": matmul[i] for i in range(self._ipus_per_replica)})
        if self.executable_cache_dir and self.executable_cache_dir != "disabled":
            opts.enableExecutableCaching(self.executable_cache_dir)
        with tempfile.NamedTemporaryFile() as initializers:
            opts._Popart.set("saveInitializersToFile", initializers.name)
        opts.Precision.enableStochasticRounding(not for_inference)
        if self.enable_half_partials:
            import torch

            opts.Precision.setPartialsType(torch.float16)
        opts._Popart.set("disableGradAccumulationTensorStreams", True)
        opts._Popart.set("accumulateOuterFragmentSettings.schedule", _OVERLAP_MEMORY_OPTIMIZED)
        opts._Popart.set("accumulateOuterFragmentSettings.excludedVirtualGraphs", ["0"])
        opts._Popart.set("outlineThreshold", 10.0)
        opts._Popart.set("subgraphCopyingStrategy", _SUBGRAPH_COPYING_JUST_IN_TIME)
        opts._Popart.set("scheduleNonWeightUpdateGradientConsumersEarly", True)
        opts._Popart.setPatterns(
            {"TiedGather": True, "TiedGatherAccumulate": True, "UpdateInplacePrioritiesForIpu": True}
        )
        if for_inference and self.explicit_ir_inference:
            opts._Popart.set("enableExplicitIR", True)
        opts._Popart.set("engineOptions", {"opt.useAutoloader": "true", "target.syncReplicasIndependently": "true"})
        return opts

    # ---- (de)serialisation -------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field (the mode is not part of a configuration)."""
        return {name: copy.deepcopy(getattr(self, name)) for name in _FIELDS}

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> IPUConfig:
        """A config from a dict as ``ipu_config.json`` holds it; ``kwargs`` override its values."""
        if not isinstance(config_dict, dict):
            raise TypeError(f"IPUConfig.from_dict expects a dict, got {type(config_dict).__name__}")
        return cls(**{**config_dict, **kwargs})

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def to_json_file(self, json_file_path: str | os.PathLike) -> None:
        Path(json_file_path).write_text(self.to_json_string(), encoding="utf-8")

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Write ``ipu_config.json`` into ``save_directory`` (created if needed)."""
        if os.path.isfile(save_directory):
            raise ValueError(f"IPUConfig.save_pretrained: {save_directory} is a file, expected a directory.")
        os.makedirs(save_directory, exist_ok=True)
        self.to_json_file(os.path.join(save_directory, IPU_CONFIG_NAME))

    @classmethod
    def from_json_file(cls, json_file: str | os.PathLike, **kwargs: Any) -> IPUConfig:
        path = Path(json_file)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from exc
        try:
            return cls.from_dict(data, **kwargs)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{path}: {exc}") from exc

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike,
        cache_dir: str | None = None,
        revision: str | None = None,
        token: str | bool | None = None,
        use_auth_token: str | bool | None = None,
        force_download: bool = False,
        local_files_only: bool = False,
        subfolder: str = "",
        **kwargs: Any,
    ) -> IPUConfig:
        """Load ``ipu_config.json`` from a folder, a JSON file, or a Hub repository (e.g. ``Graphcore/bert-base-ipu``).

        The download arguments are ``huggingface_hub``'s; ``use_auth_token`` is the older name of ``token`` that
        optimum-graphcore's scripts pass. ``kwargs`` override values of the loaded config, as in optimum-graphcore.
        """
        path = Path(pretrained_model_name_or_path) / subfolder
        if path.is_dir():
            path = path / IPU_CONFIG_NAME
            if not path.is_file():
                raise FileNotFoundError(f"{pretrained_model_name_or_path} has no {IPU_CONFIG_NAME}.")
        elif not path.is_file():
            from huggingface_hub import hf_hub_download

            path = Path(
                hf_hub_download(
                    str(pretrained_model_name_or_path),
                    IPU_CONFIG_NAME,
                    subfolder=subfolder or None,
                    cache_dir=cache_dir,
                    revision=revision,
                    token=token if token is not None else use_auth_token,
                    force_download=force_download,
                    local_files_only=local_files_only,
                )
            )
        return cls.from_json_file(path, **kwargs)

    def update_from_string(self, update_str: str) -> None:
        """Apply ``"k=v,k=v"`` overrides (optimum-graphcore's ``ipu_config_overrides`` format).

        ints, floats and strings as they are; booleans as ``true``/``false``; lists as ``[a b c]``. Every key must
        be a field.
        """
        for item in filter(None, (part.strip() for part in update_str.split(","))):
            key, sep, text = item.partition("=")
            if not sep:
                raise ValueError(f"IPUConfig override {item!r} is not of the form key=value (in {update_str!r}).")
            if key not in _FIELDS:
                raise ValueError(f"Key {key} isn't in the original config dict")
            setattr(self, key, _parse_override(key, text, getattr(self, key)))
        self._validate_ipu_config()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, IPUConfig) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"{type(self).__name__} {self.to_json_string()}"


def _known_arguments(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The field values among constructor keywords: deprecated keys warned about and dropped, optimum's metadata
    and the keys of a transformers model config dropped (optimum-graphcore ignores them), any other unknown key an
    error naming it."""
    kwargs = dict(kwargs)
    for key, reason in _DEPRECATED_KEYS.items():
        if kwargs.pop(key, None):
            warnings.warn(f"The {key!r} parameter is deprecated: {reason}.", FutureWarning, stacklevel=3)
    ignored = sorted(key for key in kwargs if key not in _FIELDS and key in _model_config_keys())
    if ignored:
        log.info("IPUConfig: ignoring keys of a transformers model config: %s", ", ".join(ignored))
    unknown = [key for key in kwargs if key not in _FIELDS and key not in _METADATA_KEYS and key not in ignored]
    if unknown:
        raise IncompatibleIPUConfigError(
            "IPUConfig received unknown arguments:\n" + "\n".join(f"  {k}={kwargs[k]}" for k in unknown)
        )
    return {key: value for key, value in kwargs.items() if key in _FIELDS}


def _derived_defaults(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with the inference fields left unset derived from the training ones, in optimum-graphcore's
    order."""
    values["inference_layers_per_ipu"] = values["inference_layers_per_ipu"] or values["layers_per_ipu"]
    ipus = values["ipus_per_replica"] or len(values["layers_per_ipu"])
    values["ipus_per_replica"] = ipus
    fallback_ipus = ipus
    if fallback_ipus == len(values["layers_per_ipu"]) or values["inference_layers_per_ipu"] != [-1]:
        fallback_ipus = len(values["inference_layers_per_ipu"])
    values["inference_ipus_per_replica"] = values["inference_ipus_per_replica"] or fallback_ipus
    fallback_matmul = values["matmul_proportion"]
    if isinstance(fallback_matmul, list) and len(fallback_matmul) != values["inference_ipus_per_replica"]:
        fallback_matmul = 0.2
    values["inference_matmul_proportion"] = values["inference_matmul_proportion"] or fallback_matmul
    values["parallelize_kwargs"] = values["parallelize_kwargs"] or {}
    values["inference_parallelize_kwargs"] = values["inference_parallelize_kwargs"] or {}
    return values


def _at_least(floor: float) -> Callable[[str, Any], None]:
    """optimum-graphcore's ``_contents_geq_value_validator``: a scalar, or every element of a list, >= ``floor``."""

    def check(name: str, value: Any) -> None:
        if value is None:
            return
        if isinstance(value, list):
            if not all(item >= floor for item in value):
                raise ValueError(
                    f"`IPUConfig` attribute `{name}` must have all elements >= {floor}. You provided {value=}"
                )
        elif not value >= floor:
            raise ValueError(f"`IPUConfig` attribute `{name}` must be >= {floor}. You provided {value=}")

    return check


def _output_mode_ok(name: str, value: Any) -> None:
    if value not in _OUTPUT_MODES:
        raise ValueError(
            f"`IPUConfig` attribute `output_mode` can only take values in {_OUTPUT_MODES}. You provided: {value=}"
        )


def _splits_ok(name: str, value: Any) -> None:
    """Serialized-layer splits: no negative entry, at least one split, splits on consecutive IPUs."""
    if value is None:
        return
    _at_least(0)(name, value)
    if sum(value) < 1:
        raise ValueError(f"`IPUConfig` attribute `{name}={value}` must have atleast 1 split on 1 IPU.")
    for i, splits in enumerate(value[:-1]):
        if splits and value[i + 1] == 0 and sum(value[i + 1 :]) != 0:
            raise ValueError(f"`IPUConfig` attribute `{name}={value}` must have its splits on consecutive IPUs.")


#: Field -> its value checks beyond the type (optimum-graphcore's ``attribute_validators``).
_VALIDATORS: Dict[str, Callable[[str, Any], None]] = {
    **{name: _at_least(floor) for name, floor in _FLOORS.items()},
    **{name: _splits_ok for name in _SPLIT_FIELDS},
    "output_mode": _output_mode_ok,
}


def _check_field(name: str, value: Any) -> None:
    hint = _FIELDS[name][0]
    if not _type_ok(value, hint):
        raise TypeError(
            f"Setting `IPUConfig` attribute: {name}, type: {hint} with {value=}, type: {type(value)} is invalid."
        )
    validator = _VALIDATORS.get(name)
    if validator is not None:
        validator(name, value)


def _parse_override(key: str, text: str, current: Any) -> Any:
    if text.startswith("[") or current is None:  # a list ("[a b c]"), or an unset optional field: read it as JSON
        try:
            return json.loads(text.replace(" ", ",") if text.startswith("[") else text)
        except ValueError as exc:
            if text.startswith("["):
                raise ValueError(f"IPUConfig override {key}={text!r}: expected a list such as [1 2 3].") from exc
            return text
    if isinstance(current, bool):
        lowered = text.lower()
        if lowered in ("true", "1", "y", "yes"):
            return True
        if lowered in ("false", "0", "n", "no"):
            return False
        raise ValueError(f"Can't derive true or false from {text} (key {key})")
    try:
        if isinstance(current, int):
            return int(text)
        if isinstance(current, float):
            return float(text)
        if isinstance(current, list):
            return json.loads(text.replace(" ", ","))
    except ValueError as exc:
        raise ValueError(f"IPUConfig override {key}={text!r}: {exc}") from exc
    if isinstance(current, str):
        return text
    raise ValueError(
        f"You can only update int, float, bool, list or string values in the config, got {text} for key {key}"
    )
