"""``IPUConfig``: optimum-graphcore's IPU configuration (same fields, defaults, validation and ``ipu_config.json``).

optimum-graphcore's own class cannot be reused: it imports poptorch and popart at module level and pins
transformers 4.29. This one keeps its file format, so the IPU configs Graphcore published (``Graphcore/*-ipu`` on the
Hub) load unchanged, and builds ``poptorch.Options`` in optimum-graphcore's order (:meth:`IPUConfig.to_options`).
poptorch is imported only by ``to_options``.

Training and inference have separate values for the layout fields (``layers_per_ipu`` and
``inference_layers_per_ipu``, ...). :meth:`train` and :meth:`eval` choose which one the mode-dependent accessors
(``_layers_per_ipu``, ``_ipus_per_replica``, ``_matmul_proportion``, ...) read and write, as optimum-graphcore's
managed attributes do.

Example:
    >>> config = IPUConfig(replication_factor=2, gradient_accumulation_steps=8, device_iterations=4)
    >>> config.batch_size_factor(), config.batch_size_factor(for_inference=True)
    (64, 1)
    >>> config.eval()._ipus_per_replica
    1
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
import typing
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

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
_MODES = ("training", "inference")


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


def _describe(hint: Any) -> str:
    return getattr(hint, "__name__", None) if isinstance(hint, type) else str(hint).replace("typing.", "")


class _ModeField:
    """Reads and writes ``name`` in training mode and ``inference_name`` in inference mode."""

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
    controls. Values are checked on construction and on assignment: a wrong type or an out-of-range value raises a
    ``TypeError``/``ValueError`` naming the field, incoherent values an :class:`IncompatibleIPUConfigError`, and an
    unknown keyword an :class:`IncompatibleIPUConfigError` naming it.
    """

    CONFIG_NAME = IPU_CONFIG_NAME

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
        for key, reason in _DEPRECATED_KEYS.items():
            if kwargs.pop(key, None):
                warnings.warn(f"IPUConfig: the {key!r} parameter is deprecated: {reason}.", FutureWarning, stacklevel=2)
        for key in _METADATA_KEYS:
            kwargs.pop(key, None)
        unknown = sorted(set(kwargs) - set(_FIELDS))
        if unknown:
            raise IncompatibleIPUConfigError(
                "IPUConfig received unknown arguments: " + ", ".join(f"{k}={kwargs[k]!r}" for k in unknown)
            )
        values = {name: copy.deepcopy(kwargs.get(name, default)) for name, (_, default) in _FIELDS.items()}
        # Derived defaults, in optimum-graphcore's order.
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
        for name, value in values.items():
            setattr(self, name, value)
        self._validate_ipu_config()

    # ---- modes -------------------------------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        if value not in _MODES:
            raise ValueError(f"IPUConfig mode can only take values in {_MODES}, got {value!r}; use train() or eval().")
        object.__setattr__(self, "_mode", value)

    def train(self) -> IPUConfig:
        """Training mode: the mode-dependent accessors read the training fields. Returns ``self``."""
        self.mode = "training"
        return self

    def eval(self) -> IPUConfig:
        """Inference mode: the mode-dependent accessors read the ``inference_*`` fields. Returns ``self``."""
        self.mode = "inference"
        return self

    # ---- validation --------------------------------------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        if name in _FIELDS:
            _check_field(name, value)
        object.__setattr__(self, name, value)

    def _validate_ipu_config(self) -> IPUConfig:
        """Coherence of the fields in both modes (optimum-graphcore's checks); fills serialization defaults."""
        if self.replicated_tensor_sharding and self.replication_factor == 1:
            warnings.warn("IPUConfig: replicated_tensor_sharding is not used when replication_factor=1", stacklevel=3)
        previous = self.mode
        try:
            for mode in _MODES:
                self.mode = mode
                self._validate_mode()
        finally:
            self.mode = previous
        return self

    def _validate_mode(self) -> None:
        prefix = "inference_" if self.mode == "inference" else ""
        ipus = self._ipus_per_replica
        matmul = self._matmul_proportion
        if isinstance(matmul, list) and len(matmul) != ipus:
            raise IncompatibleIPUConfigError(
                f"{prefix}matmul_proportion={matmul} should use the same number of IPUs as "
                f"{prefix}ipus_per_replica={ipus}."
            )
        layers = self._layers_per_ipu
        if -1 not in layers and len(layers) != ipus:
            raise IncompatibleIPUConfigError(
                f"{prefix}layers_per_ipu={layers} should use the same number of IPUs as "
                f"{prefix}ipus_per_replica={ipus}."
            )
        for layer in ("embedding", "projection"):
            splits_name = f"{prefix}serialized_{layer}_splits_per_ipu"
            factor_name = f"{prefix}{layer}_serialization_factor"
            splits, factor = getattr(self, splits_name), getattr(self, factor_name)
            if not (splits or factor):
                setattr(self, factor_name, 1)
            if splits and factor:
                raise ValueError(
                    f"Only one of `{factor_name}` and `{splits_name}` should be used at once: `{factor_name}` "
                    f"serialises the {layer} layer on one IPU, `{splits_name}` splits it across the IPUs you choose."
                )
            if splits and len(splits) != ipus:
                raise ValueError(
                    f"{splits_name}={splits} should use the same number of IPUs as {prefix}ipus_per_replica={ipus}."
                )

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
        **kwargs: Any,
    ) -> IPUConfig:
        """Load ``ipu_config.json`` from a folder, a JSON file, or a Hub repository (e.g. ``Graphcore/bert-base-ipu``).

        ``kwargs`` override values of the loaded config, as in optimum-graphcore.
        """
        path = Path(pretrained_model_name_or_path)
        if path.is_dir():
            path = path / IPU_CONFIG_NAME
            if not path.is_file():
                raise FileNotFoundError(f"{pretrained_model_name_or_path} has no {IPU_CONFIG_NAME}.")
        elif not path.is_file():
            from huggingface_hub import hf_hub_download

            name = str(pretrained_model_name_or_path)
            path = Path(hf_hub_download(name, IPU_CONFIG_NAME, cache_dir=cache_dir, revision=revision, token=token))
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
                raise ValueError(f"IPUConfig override: {key!r} is not an IPUConfig field (in {update_str!r}).")
            setattr(self, key, _parse_override(key, text, getattr(self, key)))
        self._validate_ipu_config()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, IPUConfig) and self.to_dict() == other.to_dict()

    def __repr__(self) -> str:
        return f"{type(self).__name__} {self.to_json_string()}"


def _check_field(name: str, value: Any) -> None:
    hint = _FIELDS[name][0]
    if not _type_ok(value, hint):
        raise TypeError(f"IPUConfig.{name} must be {_describe(hint)}, got {value!r} ({type(value).__name__}).")
    floor = _FLOORS.get(name)
    if floor is not None and value is not None:
        items = value if isinstance(value, list) else [value]
        if any(item < floor for item in items):
            raise ValueError(f"IPUConfig.{name} must be >= {floor} (every element for a list), got {value!r}.")
    if name == "output_mode" and value not in _OUTPUT_MODES:
        raise ValueError(f"IPUConfig.output_mode must be one of {_OUTPUT_MODES}, got {value!r}.")
    if name in _SPLIT_FIELDS and value is not None:
        if sum(value) < 1:
            raise ValueError(f"IPUConfig.{name}={value} must have at least 1 split on 1 IPU.")
        for i, splits in enumerate(value[:-1]):
            if splits and value[i + 1] == 0 and sum(value[i + 1 :]) != 0:
                raise ValueError(f"IPUConfig.{name}={value} must have its splits on consecutive IPUs.")


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
        raise ValueError(f"IPUConfig override {key}={text!r}: expected true or false.")
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
        f"IPUConfig override {key}={text!r}: only int, float, bool, list or string fields can be overridden "
        f"(current value {current!r})."
    )
