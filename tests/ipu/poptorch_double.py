"""A CPU test double of poptorch's Python API (Graphcore's PyTorch for IPUs), for hflight's IPU tests.

poptorch cannot be installed beside torch 2.13 (its last release needs torch 2.0.1), so hflight's IPU strategy is
verified against this module, which ``tests/ipu/conftest.py`` installs as ``sys.modules["poptorch"]`` (fresh per
test). It is never imported by product code and never shipped.

It follows poptorch 3.x's documented behaviour (``python/__init__.py``, ``options.py``, ``_poplar_executor.py``,
``optim.py``, ``_optimizer_attributes.py`` and the user guide): same names, signatures, defaults, asserts and error
texts, and the same *state model*, which is what catches mistakes in a strategy:

* An executable's weights, optimizer state and optimizer hyper-parameters live on the (simulated) device, apart
  from the host model: host parameters change only on ``copyWeightsToHost`` / ``detachFromDevice`` / ``destroy``;
  hyper-parameters reach the device only through ``setOptimizer`` (the constructor calls it once, as poptorch).
* One call runs ``deviceIterations`` optimizer steps, each over ``replicationFactor x gradientAccumulation``
  micro-batches cut from the combined batch; the gradients are reduced (Mean or Sum), unscaled by the loss scaling,
  clipped to ``max_grad_norm`` and applied with the optimizer's own update (torch's for SGD/Adam/AdamW/RMSprop).
* A simulated system holds a pool of IPUs; an executable holds its IPUs from compilation until it is detached or
  destroyed, so a second executable that cannot get enough IPUs fails as on hardware.
* Changing an optimizer value that was compiled as a constant fails as PopART's ``validReplacement`` does.

Deliberate differences from poptorch are marked ``DOUBLE:`` where they occur; TEST-ONLY additions (records that
tests read: ``Options.calls``, ``PoplarExecutor.calls`` / ``compile_count`` / ``set_optimizer_calls``, and the
``system`` pool) are marked ``TEST-ONLY``.
"""

from __future__ import annotations

import copy
import copyreg
import dataclasses
import enum
import functools
import inspect
import logging
import math
import numbers
import types
import weakref
from collections.abc import Iterable
from typing import Any

import torch

__version__ = "3.3.0+double"

logger = logging.getLogger("poptorch::python")

NO_EXECUTABLE_ERR = "Model has not been compiled or has been destroyed."


# ---- errors -----------------------------------------------------------------------------------------------------
class Error(Exception):
    """``poptorch.Error``: poptorch_core registers it as a subclass of ``Exception`` (not ``RuntimeError``)."""


class RecoverableError(Error):
    pass


class UnrecoverableError(Error):
    pass


def _error(msg: str, kind: str = "poptorch_py_error") -> Error:
    """Build an Error as poptorch's ``createPoptorchError`` does (``str()`` is ``"'<type>': <msg>"``)."""
    err = Error(f"'{kind}': {msg}")
    err.type = kind
    err.message = msg
    err.location = ""
    return err


def _backend_error(msg: str) -> Error:
    """An error raised by poptorch's C++ side (PopART / Poplar), as the Python caller sees it."""
    return _error(msg, kind="poptorch_cpp_error")


# ---- enums (poptorch.enums) ---------------------------------------------------------------------------------------
class MeanReductionStrategy(enum.IntEnum):
    Running = 0
    Post = 1
    PostAndLoss = 2


class DataLoaderMode(enum.IntEnum):
    Sync = 0
    Async = 1
    AsyncRebatched = 2


class OutputMode(enum.IntEnum):
    Final = 0
    EveryN = 1
    All = 2
    Sum = 3
    Default = 4


class ConnectionType(enum.IntEnum):
    Always = 0
    OnDemand = 1
    Never = 2


class ReductionType(enum.IntEnum):
    Sum = 0
    Mean = 1
    NoReduction = 2


class SyncPattern(enum.IntEnum):
    Full = 0
    SinglePipeline = 1
    ReplicaAndLadder = 2


class AutoStage(enum.IntEnum):
    SameAsIpu = 0
    AutoIncrement = 1


class CommGroupType(enum.IntEnum):
    All = 0
    Consecutive = 1
    Orthogonal = 2
    NoGrouping = 3


enums = types.ModuleType("poptorch.enums")
for _enum in (
    MeanReductionStrategy,
    DataLoaderMode,
    OutputMode,
    ConnectionType,
    ReductionType,
    SyncPattern,
    AutoStage,
    CommGroupType,
):
    _enum.__module__ = "poptorch.enums"
    setattr(enums, _enum.__name__, _enum)


# ---- TEST-ONLY: the simulated system and its IPU pool -----------------------------------------------------------
class _SimulatedSystem:
    """TEST-ONLY: the IPUs of the machine. Tests may set ``num_ipus`` and ``ipu_version`` (0 means no hardware)."""

    def __init__(self, num_ipus: int = 16, ipu_version: int = 2) -> None:
        self.num_ipus = num_ipus
        self.ipu_version = ipu_version
        self._held: dict[int, tuple[str, int]] = {}

    def held_ipus(self) -> int:
        return sum(n for _, n in self._held.values())

    def holders(self) -> list[str]:
        return [f"{name} ({n} IPUs)" for name, n in self._held.values()]

    def acquire(self, owner: PoplarExecutor, num_ipus: int) -> None:
        if self.ipu_version == 0 or self.num_ipus == 0:
            detail = (
                "\nNo IPU detected in the system. \nFor more information use the Graphcore command-line tool "
                "`gc-monitor`."
            )
        elif num_ipus > self.num_ipus:
            detail = f"\nNo device found on the system with {num_ipus} IPUs: the configuration needs changing"
        elif self.held_ipus() + num_ipus > self.num_ipus:
            # DOUBLE: poptorch says only "Failed to acquire N IPU(s)"; naming the holders helps a failing test.
            detail = (
                f" [poptorch double: {self.held_ipus()} of the {self.num_ipus} simulated IPUs are held by "
                f"{', '.join(self.holders())}]"
            )
        else:
            self._held[id(owner)] = (owner._describe(), num_ipus)
            return
        raise _backend_error(f"Failed to acquire {num_ipus} IPU(s){detail}")

    def release(self, owner: PoplarExecutor) -> None:
        self._held.pop(id(owner), None)


system = _SimulatedSystem()


def ipuHardwareIsAvailable(num_ipus: int = 1) -> bool:
    """Whether the (simulated) system has a device with ``num_ipus`` IPUs; free or not, as poptorch."""
    return system.ipu_version != 0 and num_ipus <= system.num_ipus


def ipuHardwareVersion() -> int:
    version = system.ipu_version
    assert version != 0, "No IPU hardware available on this system"
    return version


# ---- options ----------------------------------------------------------------------------------------------------
class _Recorder:
    """TEST-ONLY: the ordered record of the option setters a user called, shared by an Options and its parts."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.depth = 0
        self.enabled = False


def _recorded(dotted_name: str):
    """TEST-ONLY: append ``(dotted_name, args)`` to the shared record after a successful outermost setter call."""

    def decorate(setter):
        signature = inspect.signature(setter)

        @functools.wraps(setter)
        def wrapper(self, *args, **kwargs):
            recorder = self._recorder
            recorder.depth += 1
            try:
                result = setter(self, *args, **kwargs)
            finally:
                recorder.depth -= 1
            if recorder.enabled and recorder.depth == 0:
                bound = signature.bind(self, *args, **kwargs).arguments
                recorder.calls.append((dotted_name, tuple(v for k, v in bound.items() if k != "self")))
            return result

        return wrapper

    return decorate


class _OptionsDict:
    """poptorch's ``OptionsDict``: only declared keys can be set, with the declared type, and not once frozen."""

    def __init__(self, **default_values: Any) -> None:
        object.__setattr__(self, "_is_frozen", False)
        object.__setattr__(self, "_values", dict(default_values))

    def checkIsFrozen(self, option: str | None = None) -> None:
        if option != "_is_frozen" and self.__dict__.get("_is_frozen", False):
            raise AttributeError("Can't modify frozen Options")

    def set(self, **kwargs: Any) -> None:
        self.checkIsFrozen()
        for option, value in kwargs.items():
            assert self.exists(option), "Invalid option %s, valid options are %s" % (option, self._values.keys())
            assert isinstance(value, type(self._values[option])), "Unexpected type %s for option %s. Expected %s" % (
                type(value),
                option,
                type(self._values[option]),
            )
            self._values[option] = value

    def createOrSet(self, **kwargs: Any) -> None:
        self.checkIsFrozen()
        for option, value in kwargs.items():
            if option in self._values:
                self.set(**{option: value})
            else:
                self._values[option] = value

    def exists(self, option: str) -> bool:
        return option in self._values

    def deleteIfExists(self, option: str) -> None:
        if self.exists(option):
            del self._values[option]

    def _changeFreezeState(self, frozen: bool) -> None:
        object.__setattr__(self, "_is_frozen", frozen)
        for value in self.__dict__.values():
            if isinstance(value, (_OptionsDict, _PopartOptions)):
                value._changeFreezeState(frozen)

    def _freeze(self) -> None:
        self._changeFreezeState(True)

    def _unfreeze(self) -> None:
        self._changeFreezeState(False)

    def __deepcopy__(self, memo: dict) -> _OptionsDict:
        copied = self.__class__.__new__(self.__class__)
        memo[id(self)] = copied
        for key, value in self.__dict__.items():
            object.__setattr__(copied, key, False if key == "_is_frozen" else copy.deepcopy(value, memo))
        return copied

    def __setattr__(self, option: str, value: Any) -> None:
        self.checkIsFrozen(option)
        if option.startswith("_"):
            object.__setattr__(self, option, value)
        else:
            self.set(**{option: value})

    def __getattr__(self, option: str) -> Any:
        values = self.__dict__.get("_values")
        if option.startswith("_") or values is None or option not in values:
            raise AttributeError(f"Invalid attribute {option}.")
        return values[option]

    def update(self, other: dict) -> dict:
        assert not set(self._values).intersection(other), "Can't merge dictionaries, they have some keys in common"
        other.update(self._values)
        return other

    def toDict(self) -> dict:
        return self.update({})

    def __call__(self, option: str) -> Any:
        return getattr(self, option)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(" + ", ".join(f"{k}={v!r}" for k, v in self._values.items()) + ")"


class _PopartOptions:
    """``opts._Popart``: raw PopART session options (no key or type checks, as poptorch)."""

    def __init__(self, recorder: _Recorder) -> None:
        self._is_frozen = False
        self._recorder = recorder
        self.options: dict[str, Any] = {}
        self.set("instrumentWithHardwareCycleCounter", False)
        self.set("rearrangeAnchorsOnHost", False)

    def _changeFreezeState(self, frozen: bool) -> None:
        self._is_frozen = frozen

    def __deepcopy__(self, memo: dict) -> _PopartOptions:
        copied = _PopartOptions.__new__(_PopartOptions)
        memo[id(self)] = copied
        for key, value in self.__dict__.items():
            setattr(copied, key, False if key == "_is_frozen" else copy.deepcopy(value, memo))
        return copied

    def checkIsFrozen(self) -> None:
        if self._is_frozen:
            raise AttributeError("Can't modify frozen Options")

    @_recorded("_Popart.set")
    def set(self, key: str, value: Any) -> _PopartOptions:
        self.checkIsFrozen()
        self.options[key] = value
        return self

    @_recorded("_Popart.setEngineOptions")
    def setEngineOptions(self, engine_options: dict[str, str]) -> _PopartOptions:
        self.set("engineOptions", engine_options)
        return self

    @_recorded("_Popart.setPatterns")
    def setPatterns(self, patterns: dict[str, bool], level: int = 2) -> _PopartOptions:
        assert isinstance(level, int)
        assert isinstance(patterns, dict)
        self.set("patterns_level", level)
        self.set("patterns", patterns)
        return self

    def __repr__(self) -> str:
        return f"_PopartOptions({', '.join(f'{k}={v!r}' for k, v in self.options.items())})"


class _PrecisionOptions(_OptionsDict):
    def __init__(self, popart: _PopartOptions, recorder: _Recorder) -> None:
        super().__init__()
        self._popart_options = popart
        self._recorder = recorder

    @_recorded("Precision.enableFloatingPointExceptions")
    def enableFloatingPointExceptions(self, enabled: bool) -> _PrecisionOptions:
        assert isinstance(enabled, bool), "enableFloatingPointExceptions needs to be set to a bool"
        self._popart_options.set("enableFloatingPointChecks", enabled)
        return self

    @_recorded("Precision.enableStochasticRounding")
    def enableStochasticRounding(self, enabled: bool) -> _PrecisionOptions:
        self._popart_options.set("enableStochasticRounding", enabled)
        return self

    @_recorded("Precision.setPartialsType")
    def setPartialsType(self, dtype: torch.dtype) -> _PrecisionOptions:
        if dtype in (torch.float, torch.float32):
            type_str = "float"
        elif dtype in (torch.half, torch.float16):
            type_str = "half"
        else:
            # (poptorch's message lacks the space between "either" and "torch.float")
            raise ValueError("parameter to setPartialsType should be eithertorch.float or torch.half")
        self._popart_options.set("partialsTypeMatMuls", type_str)
        self._popart_options.set("convolutionOptions", {"partialsType": type_str})
        return self


class _TrainingOptions(_OptionsDict):
    def __init__(self, popart: _PopartOptions, recorder: _Recorder) -> None:
        super().__init__(
            gradient_accumulation=1,
            accumulation_and_replication_reduction_type=ReductionType.Mean,
            meanAccumulationAndReplicationReductionStrategy=MeanReductionStrategy.Post,
        )
        self._popart_options = popart
        self._recorder = recorder

    @_recorded("Training.gradientAccumulation")
    def gradientAccumulation(self, gradient_accumulation: int) -> _TrainingOptions:
        self.set(gradient_accumulation=gradient_accumulation)
        return self

    @_recorded("Training.accumulationAndReplicationReductionType")
    def accumulationAndReplicationReductionType(self, reduction_type: ReductionType) -> _TrainingOptions:
        if not isinstance(reduction_type, ReductionType) or reduction_type == ReductionType.NoReduction:
            raise ValueError(
                "accumulationAndReplicationReductionType must be set to "
                "poptorch.ReductionType.Mean or poptorch.ReductionType.Sum"
            )
        self.set(accumulation_and_replication_reduction_type=reduction_type)
        return self

    @_recorded("Training.setMeanAccumulationAndReplicationReductionStrategy")
    def setMeanAccumulationAndReplicationReductionStrategy(
        self, mean_reduction_strategy: MeanReductionStrategy
    ) -> _TrainingOptions:
        self.set(meanAccumulationAndReplicationReductionStrategy=mean_reduction_strategy)
        return self

    @_recorded("Training.setAutomaticLossScaling")
    def setAutomaticLossScaling(self, enabled: bool) -> _TrainingOptions:
        self._popart_options.set("automaticLossScalingSettings.enabled", enabled)
        return self

    @_recorded("Training.setConvolutionDithering")
    def setConvolutionDithering(self, enabled: bool) -> _TrainingOptions:
        self._popart_options.set("convolutionOptions", {"enableConvDithering": enabled})
        return self


class _DistributedOptions(_OptionsDict):
    """DOUBLE: poptorch reads OMPI_COMM_WORLD_SIZE / _RANK at construction; the double starts at one process."""

    def __init__(self, recorder: _Recorder) -> None:
        super().__init__(num_distributed_processes=1, distributed_process_id=0, ipuof_configs={})
        self._recorder = recorder

    @_recorded("Distributed.disable")
    def disable(self) -> _DistributedOptions:
        self.set(num_distributed_processes=1, distributed_process_id=0)
        return self

    @_recorded("Distributed.configureProcessId")
    def configureProcessId(self, process_id: int, num_processes: int) -> _DistributedOptions:
        self.set(distributed_process_id=process_id)
        self.set(num_distributed_processes=num_processes)
        return self

    @property
    def processId(self) -> int:
        return self.distributed_process_id

    @property
    def numProcesses(self) -> int:
        return self.num_distributed_processes


class TensorLocationSettings(_OptionsDict):
    """Where a class of tensors is stored (built by the user, passed to ``opts.TensorLocations``)."""

    def minElementsForOffChip(self, min_elements: int) -> TensorLocationSettings:
        assert isinstance(min_elements, int)
        self.createOrSet(minElementsForOffChip=min_elements)
        return self

    def minElementsForReplicatedTensorSharding(self, min_elements: int) -> TensorLocationSettings:
        assert isinstance(min_elements, int)
        self.createOrSet(minElementsForReplicatedTensorSharding=min_elements)
        return self

    def useOnChipStorage(self, use: bool = True) -> TensorLocationSettings:
        if use is None:
            self.deleteIfExists("onChip")
        else:
            assert isinstance(use, bool)
            self.createOrSet(onChip=int(use))
        return self

    def useReplicatedTensorSharding(self, use: bool = True) -> TensorLocationSettings:
        assert isinstance(use, bool)
        self.createOrSet(useReplicatedTensorSharding=int(use))
        return self

    def useIOTilesToLoad(self, use: bool = True) -> TensorLocationSettings:
        assert isinstance(use, bool)
        self.createOrSet(useIOTilesToLoad=int(use))
        return self

    def useIOTilesToStore(self, use: bool = True) -> TensorLocationSettings:
        assert isinstance(use, bool)
        self.createOrSet(useIOTilesToStore=int(use))
        return self


class _TensorLocationOptions(_OptionsDict):
    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self._recorder = recorder

    @_recorded("TensorLocations.numIOTiles")
    def numIOTiles(self, num_tiles: int) -> _TensorLocationOptions:
        assert isinstance(num_tiles, int)
        err_msg = "numIOTiles must be an even number between 32 and 192."
        assert 32 <= num_tiles <= 192 and num_tiles % 2 == 0, err_msg
        self.createOrSet(numIOTiles=num_tiles)
        return self

    def _set_location(self, key: str, location: TensorLocationSettings) -> _TensorLocationOptions:
        assert isinstance(location, TensorLocationSettings)
        self.createOrSet(**{key: location.toDict()})
        return self

    @_recorded("TensorLocations.setActivationLocation")
    def setActivationLocation(self, location: TensorLocationSettings) -> _TensorLocationOptions:
        return self._set_location("location_activation", location)

    @_recorded("TensorLocations.setWeightLocation")
    def setWeightLocation(self, location: TensorLocationSettings) -> _TensorLocationOptions:
        return self._set_location("location_weight", location)

    @_recorded("TensorLocations.setOptimizerLocation")
    def setOptimizerLocation(self, location: TensorLocationSettings) -> _TensorLocationOptions:
        return self._set_location("location_optimizer", location)

    @_recorded("TensorLocations.setAccumulatorLocation")
    def setAccumulatorLocation(self, location: TensorLocationSettings) -> _TensorLocationOptions:
        return self._set_location("location_accumulator", location)


class Stage:
    """A pipeline/shard stage made of Blocks, optionally pinned to an IPU."""

    def __init__(self, *block_ids: str) -> None:
        assert all(isinstance(b, str) for b in block_ids), f"Block IDs are supposed to be strings but got {block_ids}"
        self._blocks = block_ids
        self._stage_id = -1
        self._ipu: int | None = None

    @property
    def blocks(self) -> tuple[str, ...]:
        return self._blocks

    def ipu(self, ipu: int) -> Stage:
        assert isinstance(ipu, int)
        self._ipu = ipu
        return self


class _IExecutionStrategy:
    def __init__(self, block_map: dict[str, Stage]) -> None:
        self._block_map = block_map

    def stage(self, block_id: str) -> Stage:
        assert block_id in self._block_map, f"Unknown block {block_id}"
        return self._block_map[block_id]

    def _ipus_per_replica(self) -> int:
        """DOUBLE: poptorch counts the IPUs the traced Blocks use; the double counts explicitly listed stages."""
        if not self._block_map:
            return 1
        return len({s._ipu if s._ipu is not None else s._stage_id for s in self._block_map.values()})

    def backendOptions(self) -> dict[str, Any]:
        return {}


class PipelinedExecution(_IExecutionStrategy):
    def __init__(self, *args: Any) -> None:
        block_map: dict[str, Stage] = {}
        self._auto_stage = AutoStage.SameAsIpu
        if len(args) == 1 and isinstance(args[0], AutoStage):
            self._auto_stage = args[0]
        else:
            for stage_id, arg in enumerate(args):
                if isinstance(arg, Stage):
                    stage = arg
                elif isinstance(arg, str):
                    stage = Stage(arg)
                else:
                    assert all(isinstance(elt, str) for elt in arg)
                    stage = Stage(*arg)
                stage._stage_id = stage_id
                for block in stage.blocks:
                    assert block not in block_map, f"{block} associated with more than one stage"
                    block_map[block] = stage
        super().__init__(block_map)

    def backendOptions(self) -> dict[str, Any]:
        return {"execution_mode": 0}


class ShardedExecution(PipelinedExecution):
    def backendOptions(self) -> dict[str, Any]:
        return {"execution_mode": 1}


class Options(_OptionsDict):
    """All the options controlling how a model is compiled and executed (poptorch's defaults)."""

    def __init__(self) -> None:
        recorder = _Recorder()
        object.__setattr__(self, "_recorder", recorder)
        self._popart = _PopartOptions(recorder)
        self._graphProcessing = _PrecisionOptions(self._popart, recorder)
        self._training = _TrainingOptions(self._popart, recorder)
        self._distributed = _DistributedOptions(recorder)
        self._tensor_locations = _TensorLocationOptions(recorder)
        self._execution_strategy: _IExecutionStrategy = PipelinedExecution()
        self._relax_optimizer_checks = False
        self._show_compilation_progress_bar = True
        values = dict(
            replication_factor=1,
            input_group_size=1,
            input_cgt=CommGroupType.Consecutive,
            broadcast_buffers=True,
            device_iterations=1,
            log_dir=".",
            max_repeat_logs=4,
            auto_round_num_ipus=False,
            anchored_tensors={},
            output_mode=OutputMode.Default.value,
            output_return_period=1,
            connection_type=ConnectionType.Always.value,
            sync_pattern=SyncPattern.Full.value,
            available_memory_proportion={},
        )
        object.__setattr__(self, "_is_frozen", False)
        object.__setattr__(self, "_values", values)
        recorder.enabled = True

    # -- TEST-ONLY ----------------------------------------------------------------------------------------------
    @property
    def calls(self) -> list[tuple[str, tuple]]:
        """TEST-ONLY: every setter the user called on these options, in order, as ``(dotted_name, args)``."""
        return self._recorder.calls

    # -- categories ---------------------------------------------------------------------------------------------
    @property
    def TensorLocations(self) -> _TensorLocationOptions:
        return self._tensor_locations

    @property
    def Distributed(self) -> _DistributedOptions:
        return self._distributed

    @property
    def Precision(self) -> _PrecisionOptions:
        return self._graphProcessing

    @property
    def Training(self) -> _TrainingOptions:
        return self._training

    @property
    def _Popart(self) -> _PopartOptions:
        return self._popart

    # -- setters ------------------------------------------------------------------------------------------------
    @_recorded("relaxOptimizerAttributesChecks")
    def relaxOptimizerAttributesChecks(self, relax: bool = True) -> Options:
        self._relax_optimizer_checks = relax
        return self

    @_recorded("showCompilationProgressBar")
    def showCompilationProgressBar(self, show: bool = True) -> Options:
        self._show_compilation_progress_bar = show
        return self

    @_recorded("autoRoundNumIPUs")
    def autoRoundNumIPUs(self, auto_round_num_ipus: bool = True) -> Options:
        self.set(auto_round_num_ipus=auto_round_num_ipus)
        return self

    @_recorded("deviceIterations")
    def deviceIterations(self, device_iterations: int) -> Options:
        self.set(device_iterations=device_iterations)
        return self

    @_recorded("setExecutionStrategy")
    def setExecutionStrategy(self, strategy: _IExecutionStrategy) -> Options:
        assert isinstance(strategy, _IExecutionStrategy)
        self._execution_strategy = strategy
        return self

    @_recorded("setAvailableMemoryProportion")
    def setAvailableMemoryProportion(self, available_memory_proportion: dict[str, float]) -> Options:
        actual_memory = {}
        for key, mem in available_memory_proportion.items():
            assert key.startswith("IPU"), (
                "Available memory proportions are expected"
                ' to be in a dictionary of {"IPU0": 0.5}'
                " where the 0 in IPU is the index of the"
                " IPU. Invalid key: %s" % key
            )
            actual_memory[int(key[3:])] = mem
        self.createOrSet(available_memory_proportion=actual_memory)
        return self

    @_recorded("replicationFactor")
    def replicationFactor(self, replication_factor: int) -> Options:
        self.set(replication_factor=replication_factor)
        return self

    @_recorded("logDir")
    def logDir(self, log_dir: str) -> Options:
        self.set(log_dir=log_dir)
        return self

    @_recorded("modelName")
    def modelName(self, name: str) -> Options:
        self.createOrSet(model_name=name)
        return self

    @_recorded("enableExecutableCaching")
    def enableExecutableCaching(self, path: str | None) -> Options:
        if path is None:
            self._Popart.set("enableEngineCaching", False)
        else:
            self._Popart.set("cachePath", path)
            self._Popart.set("enableEngineCaching", True)
        return self

    @_recorded("useIpuModel")
    def useIpuModel(self, use_model: bool) -> Options:
        self.createOrSet(use_model=use_model)
        return self

    @_recorded("connectionType")
    def connectionType(self, connection_type: ConnectionType) -> Options:
        assert isinstance(connection_type, ConnectionType)
        self.set(connection_type=connection_type.value)
        return self

    @_recorded("syncPattern")
    def syncPattern(self, sync_pattern: SyncPattern) -> Options:
        assert isinstance(sync_pattern, SyncPattern)
        self.set(sync_pattern=sync_pattern.value)
        return self

    @_recorded("useIpuId")
    def useIpuId(self, ipu_id: int) -> Options:
        assert isinstance(ipu_id, int)
        self.createOrSet(ipu_id=ipu_id)
        return self

    @_recorded("useOfflineIpuTarget")
    def useOfflineIpuTarget(self, ipu_version: int = 2) -> Options:
        self.connectionType(ConnectionType.Never)
        self.createOrSet(ipu_version=ipu_version)
        return self

    @_recorded("outputMode")
    def outputMode(self, output_mode: OutputMode, output_return_period: int | None = None) -> Options:
        assert isinstance(output_mode, OutputMode)
        if output_mode == OutputMode.EveryN:
            assert output_return_period and output_return_period > 0, (
                "EveryN anchor must have output_return_period set to valid positive integer"
            )
        elif output_return_period:
            logger.info("Anchor return period argument ignored with output_mode set to %s", output_mode)
        self.set(output_mode=output_mode.value, output_return_period=output_return_period or 1)
        return self

    def defaultOutputMode(self) -> bool:
        return self.output_mode == OutputMode.Default

    @_recorded("randomSeed")
    def randomSeed(self, random_seed: int) -> Options:
        assert isinstance(random_seed, int)
        torch.manual_seed(random_seed)
        self.createOrSet(random_seed=random_seed)
        return self

    @_recorded("enableStableNorm")
    def enableStableNorm(self, enabled: bool) -> Options:
        self._Popart.set("enableStableNorm", enabled)
        return self

    @_recorded("enableSyntheticData")
    def enableSyntheticData(self, enabled: bool) -> Options:
        self._Popart.set("syntheticDataMode", 2 if enabled else 0)
        return self

    @_recorded("logCycleCount")
    def logCycleCount(self, log_cycle_count: bool) -> Options:
        self._Popart.set("instrumentWithHardwareCycleCounter", log_cycle_count)
        return self

    def toDict(self) -> dict[str, Any]:
        assert not self.defaultOutputMode(), "An output mode must be picked before serialisation"
        out = self._execution_strategy.backendOptions()
        out.update(self._popart.options)
        out = self.update(out)
        out = self._training.update(out)
        out = self._distributed.update(out)
        out = self._tensor_locations.update(out)
        return out

    def clone(self) -> Options:
        return copy.deepcopy(self)

    def __repr__(self) -> str:
        parts = [f"{k}={v!r}" for k, v in self._values.items()]
        parts += [f"Training={self._training!r}", f"_Popart={self._popart!r}"]
        return f"Options({', '.join(parts)})"


# ---- DataLoader ---------------------------------------------------------------------------------------------------
def _flatten_tensors(structure: Any) -> list[torch.Tensor]:
    """The tensors of a nested dict/list/tuple structure, in poptorch's order (dict values in key order)."""
    if isinstance(structure, torch.Tensor):
        return [structure]
    if isinstance(structure, dict):
        return [t for k in structure.keys() for t in _flatten_tensors(structure[k])]
    if isinstance(structure, (list, tuple)):
        return [t for x in structure for t in _flatten_tensors(x)]
    return []


def _rebuild(structure: Any, tensors: Iterable[torch.Tensor]) -> Any:
    """``structure`` with its tensors replaced, in order, by ``tensors`` (non-tensor leaves are kept)."""
    it = iter(tensors)

    def rebuild(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return next(it)
        if isinstance(x, dict):
            return type(x)({k: rebuild(x[k]) for k in x.keys()})
        if isinstance(x, (list, tuple)):
            if hasattr(x, "_asdict") and hasattr(x, "_fields"):
                return type(x)(*(rebuild(e) for e in x))
            return type(x)(rebuild(e) for e in x)
        return x

    return rebuild(structure)


def _combined_batches(batches: Iterable[Any], count: int, drop_last: bool):
    """Concatenate ``count`` consecutive batches along dim 0 (poptorch's combined_batch_generator)."""
    pending: list[Any] = []
    for batch in batches:
        pending.append(batch)
        if len(pending) == count:
            yield _rebuild(pending[-1], _concat_flat([_flatten_tensors(b) for b in pending]))
            pending = []
    if pending and not drop_last:
        yield _rebuild(pending[-1], _concat_flat([_flatten_tensors(b) for b in pending]))


def _concat_flat(flat_batches: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [torch.cat([b[i] for b in flat_batches]) for i in range(len(flat_batches[0]))]


class DataLoader(torch.utils.data.DataLoader):
    """torch's DataLoader whose batches hold one model call's worth of data: the combined batch
    ``batch_size x deviceIterations x (replicationFactor / input_group_size) x gradientAccumulation``.

    DOUBLE: ``mode=Async`` / ``AsyncRebatched`` load synchronously (same batches, no worker process), and
    multi-process (``Distributed``) partitioning is not simulated: it is refused with an Error.
    """

    def __init__(
        self,
        options: Options,
        dataset: torch.utils.data.Dataset,
        batch_size: int = 1,
        shuffle: bool | None = None,
        num_workers: int = 0,
        drop_last: bool = True,
        persistent_workers: bool | None = None,
        auto_distributed_partitioning: bool = True,
        mode: DataLoaderMode = DataLoaderMode.Sync,
        async_options: dict[str, Any] | None = None,
        rebatched_worker_size: int | None = None,
        batch_sampler: Any = None,
        **kwargs: Any,
    ) -> None:
        self._is_user_batch_sampler_set = batch_sampler is not None
        if self._is_user_batch_sampler_set:
            if batch_size != 1 or shuffle:
                raise _error("`batch_sampler` option is mutually exclusive with batch_size, shuffle.")
            if options.Distributed.numProcesses > 1 and auto_distributed_partitioning:
                raise _error("`batch_sampler` option is mutually exclusive with auto_distributed_partitioning=True.")
            if hasattr(batch_sampler, "batch_size"):
                batch_size = batch_sampler.batch_size
            self.batch_sampler_drop_last = drop_last
            drop_last = None
        elif shuffle is None:
            shuffle = False

        assert isinstance(options, Options)
        options._freeze()
        if options.Distributed.numProcesses > 1:
            raise _error("poptorch double: multi-process (Distributed) data partitioning is not simulated")
        if persistent_workers is None:
            persistent_workers = num_workers > 0

        self._options = options
        if batch_size is None:
            self._combined_batch_size = None
            self._num_batches_to_combine = None
        else:
            input_group_count = options.replication_factor // options.input_group_size
            self._num_batches_to_combine = (
                options.device_iterations * input_group_count * options.Training.gradient_accumulation
            )
            self._combined_batch_size = batch_size * self._num_batches_to_combine

        self._is_iterable = isinstance(dataset, torch.utils.data.IterableDataset)
        if self._is_iterable:
            if num_workers > 1 and "worker_init_fn" not in kwargs:
                logger.warning(
                    "IterableDataset used with num_workers=%d but no worker_init_fn specified: as a result the "
                    "DataLoader will return %d times each element in the dataset (See "
                    "torch.utils.data.IterableDataset's documentation for more information)",
                    num_workers,
                    num_workers,
                )
        elif not (drop_last or self._is_user_batch_sampler_set):
            num_elts = len(dataset)
            if self._combined_batch_size is not None and num_elts % self._combined_batch_size != 0:
                logger.warning(
                    "The number of elements in the dataset (%d) is not divisible by the number of elements "
                    "processed per step (%d) and drop_last=False. The last tensor will have a batch size of %d. "
                    "To avoid having to handle this special case switch to drop_last=True",
                    num_elts,
                    self._combined_batch_size,
                    num_elts % self._combined_batch_size,
                )

        if mode in (DataLoaderMode.Async, DataLoaderMode.AsyncRebatched):
            assert "rebatched_size" not in (async_options or {}), (
                "You cannot use DataLoaderMode.AsyncRebatched and manually specify the rebatched_size in async_options"
            )
            if mode == DataLoaderMode.AsyncRebatched and rebatched_worker_size is not None:
                assert rebatched_worker_size <= self._combined_batch_size, (
                    f"The rebatched_worker_size ({rebatched_worker_size}) must be <= to the combined batch size "
                    f"({self._combined_batch_size})"
                )

        dataset_batch_size = 1 if self._is_user_batch_sampler_set else self._combined_batch_size
        super().__init__(
            dataset,
            batch_size=dataset_batch_size,
            shuffle=shuffle,
            batch_sampler=batch_sampler,
            num_workers=num_workers,
            drop_last=drop_last,
            persistent_workers=persistent_workers,
            **kwargs,
        )

    @property
    def combinedBatchSize(self) -> int | None:
        return self._combined_batch_size

    @property
    def options(self) -> Options:
        return self._options

    def terminate(self) -> None:
        """Kills the async worker in poptorch; the double has none."""

    def __iter__(self):
        if self._is_user_batch_sampler_set and self._num_batches_to_combine != 1:
            return _combined_batches(super().__iter__(), self._num_batches_to_combine, self.batch_sampler_drop_last)
        return super().__iter__()


# ---- optimizers (poptorch.optim) ----------------------------------------------------------------------------------
class VariableAttributes:
    """Which optimizer attributes are variable (changeable by setOptimizer after compilation) or constant."""

    def __init__(self, variable_attributes: list[str], allowed_attributes: list[str]) -> None:
        self._variable_attributes = list(variable_attributes)
        self._allowed_attributes = list(allowed_attributes)

    def isConstant(self, attr: str) -> bool:
        return attr not in self._variable_attributes

    def markAsConstant(self, attr: str) -> None:
        assert attr in self._allowed_attributes, f"Unknown attribute {attr}, allowed values: {self._allowed_attributes}"
        self._variable_attributes = [a for a in self._variable_attributes if a != attr]

    def markAsVariable(self, attr: str) -> None:
        assert attr in self._allowed_attributes, f"Unknown attribute {attr}, allowed values: {self._allowed_attributes}"
        self._variable_attributes.append(attr)


_ACCUM_TYPES = (torch.float16, torch.float32)
_ACCUM_TYPE_ERROR = "Accumulation types must be either torch.float32 or torch.float16"


def _split_constructor_args(all_args: dict[str, Any], child_only: list[str]) -> tuple[dict[str, Any], list[str]]:
    """poptorch's ``_parseArgs``: arguments passed explicitly (not None) are variable; parent ones go to torch."""
    args = {k: v for k, v in all_args.items() if k not in ("self", "__class__")}
    variables = [k for k, v in args.items() if v is not None]
    parent_args = {k: v for k, v in args.items() if k in variables and k not in child_only}
    return parent_args, variables


class Optimizer:
    """The base of poptorch's optimizers: keeps the IPU state dict (``ipu_state`` / ``ipu_param``)."""

    _child_vars = ["loss_scaling"]
    _child_only: list[str] = []
    _group_vars: list[str] = []

    def __init__(self) -> None:
        self._state_dict = {"ipu_state": None, "ipu_param": None}
        self.ipu_state_is_dirty = False
        self.host_state_is_dirty = False

    def state_dict(self) -> dict[str, Any]:
        return self.get_state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.optim.Optimizer.load_state_dict(self, state)
        self.set_state_dict(state)

    def get_state_dict(self) -> dict[str, Any]:
        return {**self._state_dict, **torch.optim.Optimizer.state_dict(self)}

    def set_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            raise RuntimeError("Cannot load optimizer state dictionary because it is empty.")
        if not ("ipu_state" in state and "ipu_param" in state):
            raise RuntimeError("Only IPU optimizer states can be loaded onto the IPU.")
        self._state_dict = state
        self.ipu_state_is_dirty = True
        self.host_state_is_dirty = False

    def has_state(self) -> bool:
        return self._state_dict.get("ipu_state") is not None and self._state_dict.get("ipu_param") is not None

    def __getstate__(self) -> dict[str, Any]:
        state = torch.optim.Optimizer.__getstate__(self)
        for attr in ["variable_attrs"] + [a for a in type(self)._child_only if a not in type(self)._group_vars]:
            state[attr] = getattr(self, attr)
        state["_state_dict"] = self._state_dict
        state["ipu_state_is_dirty"] = self.has_state()
        state["host_state_is_dirty"] = False
        return state

    def _check_accum_types(self, *dtypes: torch.dtype) -> None:
        for dtype in dtypes:
            assert dtype in _ACCUM_TYPES, _ACCUM_TYPE_ERROR


class SGD(Optimizer, torch.optim.SGD):
    """Stochastic gradient descent with optional momentum, loss scaling and velocity scaling."""

    _child_only = [
        "loss_scaling",
        "velocity_scaling",
        "use_combined_accum",
        "accum_type",
        "velocity_accum_type",
        "max_grad_norm",
    ]
    _group_vars = ["lr", "momentum", "dampening", "weight_decay", "nesterov", "velocity_scaling"]

    def __init__(
        self,
        params: Iterable,
        lr: float,
        momentum: float | None = None,
        dampening: float | None = None,
        weight_decay: float | None = None,
        nesterov: bool | None = None,
        maximize: bool | None = None,
        foreach: bool | None = None,
        differentiable: bool | None = None,
        loss_scaling: float | None = None,
        velocity_scaling: float | None = None,
        use_combined_accum: bool | None = None,
        accum_type: torch.dtype | None = None,
        velocity_accum_type: torch.dtype | None = None,
        max_grad_norm: float | None = None,
    ) -> None:
        parent_args, variables = _split_constructor_args(locals(), optim.SGD._child_only)
        optim.Optimizer.__init__(self)
        torch.optim.SGD.__init__(self, **parent_args)
        self.use_combined_accum = False if use_combined_accum is None else use_combined_accum
        self.loss_scaling = 1.0 if loss_scaling is None else loss_scaling
        if velocity_scaling is None:
            velocity_scaling = 1.0
        elif not self.use_combined_accum:
            logger.warning(
                "velocity_scaling value ignored when using the separate variant (use_combined_accum=False). "
                "In future, this will lead to an error. Please update your code."
            )
        if self.use_combined_accum:
            self.defaults["velocity_scaling"] = velocity_scaling
            for group in self.param_groups:
                group.setdefault("velocity_scaling", velocity_scaling)
        self.accum_type = torch.float32 if accum_type is None else accum_type
        self.velocity_accum_type = torch.float32 if velocity_accum_type is None else velocity_accum_type
        self._check_accum_types(self.accum_type, self.velocity_accum_type)
        self.max_grad_norm = float("Inf") if max_grad_norm is None else max_grad_norm
        self.variable_attrs = optim.VariableAttributes(variables, list(self.defaults) + optim.SGD._child_vars)


class Adam(Optimizer, torch.optim.Adam):
    """Adam (matches torch.optim.Adam) with optional loss scaling. AMSGrad is not supported."""

    _child_only = [
        "loss_scaling",
        "accum_type",
        "first_order_momentum_accum_type",
        "second_order_momentum_accum_type",
        "max_grad_norm",
    ]
    _group_vars = ["lr", "betas", "eps", "weight_decay", "amsgrad"]

    def __init__(
        self,
        params: Iterable,
        lr: float | None = None,
        betas: tuple[float, float] | None = None,
        eps: float | None = None,
        weight_decay: float | None = None,
        amsgrad: bool | None = None,
        foreach: bool | None = None,
        maximize: bool | None = None,
        capturable: bool | None = None,
        differentiable: bool | None = None,
        fused: bool | None = None,
        loss_scaling: float | None = None,
        accum_type: torch.dtype | None = None,
        first_order_momentum_accum_type: torch.dtype | None = None,
        second_order_momentum_accum_type: torch.dtype | None = None,
        max_grad_norm: float | None = None,
    ) -> None:
        parent_args, variables = _split_constructor_args(locals(), optim.Adam._child_only)
        optim.Optimizer.__init__(self)
        torch.optim.Adam.__init__(self, **parent_args)
        _init_adam_family(
            self, loss_scaling, accum_type, first_order_momentum_accum_type, second_order_momentum_accum_type
        )
        self.max_grad_norm = float("Inf") if max_grad_norm is None else max_grad_norm
        self.variable_attrs = optim.VariableAttributes(variables, list(self.defaults) + optim.Adam._child_vars)


class AdamW(Optimizer, torch.optim.AdamW):
    """AdamW (matches torch.optim.AdamW when ``bias_correction=True``) with optional loss scaling."""

    _child_only = [
        "loss_scaling",
        "bias_correction",
        "accum_type",
        "first_order_momentum_accum_type",
        "second_order_momentum_accum_type",
        "max_grad_norm",
    ]
    _group_vars = ["lr", "betas", "weight_decay", "eps", "amsgrad"]

    def __init__(
        self,
        params: Iterable,
        lr: float | None = None,
        betas: tuple[float, float] | None = None,
        eps: float | None = None,
        weight_decay: float | None = None,
        amsgrad: bool | None = None,
        maximize: bool | None = None,
        foreach: bool | None = None,
        capturable: bool | None = None,
        differentiable: bool | None = None,
        fused: bool | None = None,
        loss_scaling: float | None = None,
        bias_correction: bool | None = None,
        accum_type: torch.dtype | None = None,
        first_order_momentum_accum_type: torch.dtype | None = None,
        second_order_momentum_accum_type: torch.dtype | None = None,
        max_grad_norm: float | None = None,
    ) -> None:
        parent_args, variables = _split_constructor_args(locals(), optim.AdamW._child_only)
        optim.Optimizer.__init__(self)
        torch.optim.AdamW.__init__(self, **parent_args)
        _init_adam_family(
            self, loss_scaling, accum_type, first_order_momentum_accum_type, second_order_momentum_accum_type
        )
        self.bias_correction = True if bias_correction is None else bias_correction
        self.max_grad_norm = float("Inf") if max_grad_norm is None else max_grad_norm
        self.variable_attrs = optim.VariableAttributes(variables, list(self.defaults) + optim.AdamW._child_vars)


class RMSprop(Optimizer, torch.optim.RMSprop):
    """RMSprop (matches torch.optim.RMSprop) with optional loss scaling."""

    _child_only = [
        "loss_scaling",
        "accum_type",
        "first_order_momentum_accum_type",
        "second_order_momentum_accum_type",
        "use_tf_variant",
    ]
    _group_vars = ["lr", "momentum", "weight_decay", "alpha", "eps", "centered"]

    def __init__(
        self,
        params: Iterable,
        lr: float | None = None,
        alpha: float | None = None,
        eps: float | None = None,
        weight_decay: float | None = None,
        momentum: float | None = None,
        centered: bool | None = None,
        foreach: bool | None = None,
        maximize: bool | None = None,
        differentiable: bool | None = None,
        loss_scaling: float | None = None,
        accum_type: torch.dtype | None = None,
        first_order_momentum_accum_type: torch.dtype | None = None,
        second_order_momentum_accum_type: torch.dtype | None = None,
        use_tf_variant: bool | None = None,
    ) -> None:
        parent_args, variables = _split_constructor_args(locals(), optim.RMSprop._child_only)
        optim.Optimizer.__init__(self)
        torch.optim.RMSprop.__init__(self, **parent_args)
        _init_adam_family(
            self, loss_scaling, accum_type, first_order_momentum_accum_type, second_order_momentum_accum_type
        )
        self.use_tf_variant = False if use_tf_variant is None else use_tf_variant
        self.variable_attrs = optim.VariableAttributes(variables, list(self.defaults) + optim.RMSprop._child_vars)


def _init_adam_family(opt: Any, loss_scaling, accum_type, first_order, second_order) -> None:
    opt.loss_scaling = 1.0 if loss_scaling is None else loss_scaling
    opt.accum_type = torch.float32 if accum_type is None else accum_type
    opt.first_order_momentum_accum_type = torch.float32 if first_order is None else first_order
    opt.second_order_momentum_accum_type = torch.float32 if second_order is None else second_order
    opt._check_accum_types(opt.accum_type, opt.first_order_momentum_accum_type, opt.second_order_momentum_accum_type)


def _moments(p: torch.Tensor, state: dict[str, Any], dtypes: tuple[torch.dtype, torch.dtype]) -> None:
    """Adam-family moments, held in the optimizer's first/second order accumulation dtypes as PopART holds them
    (a float16 model with float32 second moments: eps=1e-8 would underflow to 0 in float16)."""
    if not state:
        state["step"] = 0
        state["exp_avg"] = torch.zeros_like(p, dtype=dtypes[0], memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtypes[1], memory_format=torch.preserve_format)


def _lamb_step(
    optimizer: torch.optim.Optimizer, bias_correction: bool, dtypes: tuple[torch.dtype, torch.dtype]
) -> None:
    """One LAMB update (biased or bias-corrected), trust ratio ``min(|w|, max_weight_norm) / |update|``."""
    for group in optimizer.param_groups:
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            grad = p.grad.detach().float()
            state = optimizer.state[p]
            _moments(p, state, dtypes)
            state["step"] += 1
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            exp_avg.mul_(beta1).add_(grad.to(exp_avg.dtype), alpha=1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            correction1 = 1 - beta1 ** state["step"] if bias_correction else 1.0
            correction2 = 1 - beta2 ** state["step"] if bias_correction else 1.0
            denominator = (exp_avg_sq.float().sqrt() / math.sqrt(correction2)).add_(group["eps"])
            update = (exp_avg.float() / correction1) / denominator + group["weight_decay"] * p.detach().float()
            weight_norm = p.detach().float().norm().clamp(max=group["max_weight_norm"])
            update_norm = update.norm()
            trust = 1.0 if weight_norm == 0 or update_norm == 0 else float(weight_norm / update_norm)
            with torch.no_grad():
                p.add_(update.to(p.dtype), alpha=-group["lr"] * trust)


class LAMB(Optimizer, torch.optim.Optimizer):
    """Layer-wise Adaptive Moments (LAMB); the scaling function is ``min(|w|, max_weight_norm)``."""

    _child_only = [
        "loss_scaling",
        "bias_correction",
        "accum_type",
        "first_order_momentum_accum_type",
        "second_order_momentum_accum_type",
    ]
    _group_vars = ["lr", "weight_decay", "betas", "eps", "max_weight_norm"]

    def __init__(
        self,
        params: Iterable,
        lr: float | None = None,
        betas: tuple[float, float] | None = None,
        eps: float | None = None,
        weight_decay: float | None = None,
        bias_correction: bool | None = None,
        loss_scaling: float | None = None,
        max_weight_norm: float | None = None,
        accum_type: torch.dtype | None = None,
        first_order_momentum_accum_type: torch.dtype | None = None,
        second_order_momentum_accum_type: torch.dtype | None = None,
    ) -> None:
        _, variables = _split_constructor_args(locals(), [])
        defaults = dict(
            lr=1e-3 if lr is None else lr,
            betas=(0.9, 0.999) if betas is None else betas,
            eps=1e-8 if eps is None else eps,
            weight_decay=1e-2 if weight_decay is None else weight_decay,
            max_weight_norm=65500.0 if max_weight_norm is None else max_weight_norm,
        )
        optim.Optimizer.__init__(self)
        torch.optim.Optimizer.__init__(self, params, defaults)
        _init_adam_family(
            self, loss_scaling, accum_type, first_order_momentum_accum_type, second_order_momentum_accum_type
        )
        self.bias_correction = True if bias_correction is None else bias_correction
        self.max_weight_norm = defaults["max_weight_norm"]
        self.variable_attrs = optim.VariableAttributes(variables, list(self.defaults) + optim.LAMB._child_vars)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        dtypes = (self.first_order_momentum_accum_type, self.second_order_momentum_accum_type)
        _lamb_step(self, self.bias_correction, dtypes)
        return loss


optim = types.ModuleType("poptorch.optim")
for _cls in (VariableAttributes, Optimizer, SGD, Adam, AdamW, RMSprop, LAMB):
    _cls.__module__ = "poptorch.optim"
    setattr(optim, _cls.__name__, _cls)
# poptorch exposes these only as poptorch.optim.*; internal code reaches them through ``optim``.
del VariableAttributes, Optimizer, SGD, Adam, AdamW, RMSprop, LAMB


# ---- optimizer → device description (poptorch's _optimizer_attributes, PopART's validReplacement) ----------------
_FAMILY_OF_KIND = {
    "SGD1": "SGD",
    "SGD2": "SGD",
    "ADAM": "ADAM",
    "ADAMW": "ADAMW",
    "ADAMW_NO_BIAS": "ADAMW",
    "RMSPROP": "RMSPROP",
    "RMSPROP_CENTERED": "RMSPROP",
    "LAMB": "LAMB",
    "LAMB_NO_BIAS": "LAMB",
}


def _optimizer_kind(optimizer: torch.optim.Optimizer) -> str | None:
    # DOUBLE: torch >= 2.2 makes AdamW a subclass of Adam, so AdamW is tested first (poptorch tests Adam first).
    if isinstance(optimizer, torch.optim.SGD):
        return "SGD1" if getattr(optimizer, "use_combined_accum", False) else "SGD2"
    if isinstance(optimizer, torch.optim.AdamW):
        if isinstance(optimizer, optim.AdamW) and not getattr(optimizer, "bias_correction", True):
            return "ADAMW_NO_BIAS"
        return "ADAMW"
    if isinstance(optimizer, torch.optim.Adam):
        return "ADAM"
    if isinstance(optimizer, torch.optim.RMSprop):
        centered = optimizer.param_groups[0]["centered"]
        for i, group in enumerate(optimizer.param_groups):
            assert group["centered"] == centered, (
                "All parameter groups must have the same value for the 'centered' attribute "
                f"(Group 0: {centered} / Group {i}: {group['centered']})"
            )
        return "RMSPROP_CENTERED" if centered else "RMSPROP"
    if isinstance(optimizer, optim.LAMB):
        return "LAMB" if optimizer.bias_correction else "LAMB_NO_BIAS"
    return None


_POPTORCH_CLASS_OF_FAMILY = {
    "SGD": "SGD",
    "ADAM": "Adam",
    "ADAMW": "AdamW",
    "RMSPROP": "RMSprop",
    "LAMB": "LAMB",
}
_ATTR_DEFAULTS = {
    "accum_type": torch.float32,
    "velocity_accum_type": torch.float32,
    "first_order_momentum_accum_type": torch.float32,
    "second_order_momentum_accum_type": torch.float32,
    "use_tf_variant": False,
    "max_grad_norm": float("Inf"),
}
_IGNORED_ATTRS = ("bias_correction", "use_combined_accum", "velocity_scaling", "loss_scaling")


def _always(_value: Any) -> bool:
    return True


def _never(_value: Any) -> bool:
    return False


def _equals(reference: float):
    return lambda value: value == reference


def _optimizer_to_device_dict(optimizer: torch.optim.Optimizer, options: Options) -> dict[str, Any]:
    """What poptorch sends to the device for an optimizer: its type, fixed attributes, and each variable as
    ``(value, is_const)`` for the defaults, each group and the loss scaling (poptorch's convertOptimizerToDict)."""
    kind = _optimizer_kind(optimizer)
    assert kind is not None, "Unsupported optimizer type. Types supported %s" % ", ".join(_FAMILY_OF_KIND)
    family = _FAMILY_OF_KIND[kind]
    poptorch_class = getattr(optim, _POPTORCH_CLASS_OF_FAMILY[family])
    variable_attrs = getattr(optimizer, "variable_attrs", None)
    auto_loss_scaling = options._Popart.options.get("automaticLossScalingSettings.enabled", False)
    if variable_attrs is not None and auto_loss_scaling:
        variable_attrs.markAsVariable("loss_scaling")

    def pair(name: str, value: Any, const_rule) -> tuple[Any, bool]:
        assert isinstance(value, numbers.Number), f"Expected a number for {name} but got {value} instead"
        is_const = variable_attrs.isConstant(name) if variable_attrs is not None else const_rule(value)
        return (value, is_const)

    const_rules = {
        "lr": _never,
        "weight_decay": _equals(1e-2 if family == "ADAMW" else 0.0),
        "momentum": _equals(0.0),
        "velocity_scaling": _equals(1.0),
        "dampening": _equals(0.0),
        "eps": _equals(1e-08),
        "max_weight_norm": _equals(65500.0),
        "alpha": _always,
        "nesterov": _always,
    }

    def read_group(group: dict[str, Any]) -> dict[str, tuple[Any, bool]]:
        out = {}
        for name in poptorch_class._group_vars:
            if name == "amsgrad":
                if group["amsgrad"]:
                    raise ValueError("Only non-amsgrad Adam/AdamW optimizers are supported.")
                continue
            if name == "centered":
                continue
            value = group.get(name, 1.0 if name == "velocity_scaling" else None)
            assert value is not None, f"Mandatory attribute {name} not found in optimizer group"
            if name == "betas":
                assert isinstance(value, tuple) and len(value) == 2, f"Expected a pair for betas but got {value}"
                (beta1, is_const), (beta2, _) = pair("betas[0]", value[0], _always), pair("betas[1]", value[1], _always)
                if variable_attrs is not None:
                    is_const = variable_attrs.isConstant("betas")
                out["beta1"], out["beta2"] = (beta1, is_const), (beta2, is_const)
                continue
            out[name] = pair(name, value, const_rules[name])
        return out

    attrs = {}
    for name in poptorch_class._child_only:
        if name in poptorch_class._group_vars or name in _IGNORED_ATTRS:
            continue
        value = getattr(optimizer, name, _ATTR_DEFAULTS[name])
        if name.endswith("accum_type") and value not in _ACCUM_TYPES:
            raise ValueError(f"{name} must be set to either torch.float16 or torch.float32 not {value}")
        attrs[name] = value
    loss_scaling = getattr(optimizer, "loss_scaling", 1.0)
    return {
        "type": kind,
        "attrs": attrs,
        "loss_scaling": pair("loss_scaling", loss_scaling, lambda v: v == 1.0 and not auto_loss_scaling),
        "defaults": read_group(optimizer.defaults),
        "groups": [read_group(g) for g in optimizer.param_groups],
    }


def _replacement_problem(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """Why PopART would refuse ``new`` as a replacement for the compiled ``old`` optimizer (None if valid)."""
    if old["type"] != new["type"]:
        return f"the optimizer type changed from {old['type']} to {new['type']}"
    for name, value in old["attrs"].items():
        if new["attrs"][name] != value:
            return f"{name} is fixed at compilation ({value}) and cannot change to {new['attrs'][name]}"
    if len(old["groups"]) != len(new["groups"]):
        return f"the number of parameter groups changed from {len(old['groups'])} to {len(new['groups'])}"
    places = [("loss_scaling", {"loss_scaling": old["loss_scaling"]}, {"loss_scaling": new["loss_scaling"]})]
    places.append(("the defaults", old["defaults"], new["defaults"]))
    places += [(f"group {i}", o, n) for i, (o, n) in enumerate(zip(old["groups"], new["groups"]))]
    for where, old_vars, new_vars in places:
        for name, (old_value, old_const) in old_vars.items():
            new_value, new_const = new_vars[name]
            if old_const != new_const:
                return f"{name} of {where} changed from {'constant' if old_const else 'variable'} to " + (
                    "constant" if new_const else "variable"
                )
            if old_const and old_value != new_value:
                attr = "betas" if name in ("beta1", "beta2") else name
                return (
                    f"{name} of {where} was compiled as a constant ({old_value}) and cannot change to {new_value} "
                    "(pass it explicitly to the optimizer's constructor or call "
                    f"optimizer.variable_attrs.markAsVariable('{attr}') before compiling)"
                )
    return None


def _hyperparameters(device_vars: dict[str, tuple[Any, bool]]) -> dict[str, Any]:
    """The torch param-group values for one group of the device dict."""
    values = {name: value for name, (value, _) in device_vars.items() if name not in ("beta1", "beta2")}
    if "beta1" in device_vars:
        values["betas"] = (device_vars["beta1"][0], device_vars["beta2"][0])
    values.pop("velocity_scaling", None)
    return values


class _DeviceLAMB(torch.optim.Optimizer):
    def __init__(
        self, groups: list[dict[str, Any]], bias_correction: bool, dtypes: tuple[torch.dtype, torch.dtype]
    ) -> None:
        super().__init__(
            groups, dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, max_weight_norm=65500.0)
        )
        self.bias_correction = bias_correction
        self.moment_dtypes = dtypes

    @torch.no_grad()
    def step(self, closure=None):
        _lamb_step(self, self.bias_correction, self.moment_dtypes)


class _DeviceAdamWNoBias(torch.optim.Optimizer):
    """AdamW without bias correction (poptorch's ``AdamW(bias_correction=False)``), its moments in the optimizer's
    accumulation dtypes."""

    def __init__(self, groups: list[dict[str, Any]], dtypes: tuple[torch.dtype, torch.dtype]) -> None:
        super().__init__(groups, dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2))
        self.moment_dtypes = dtypes

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                _moments(p, state, self.moment_dtypes)
                state["step"] += 1
                grad = p.grad.float()
                p.mul_(1 - group["lr"] * group["weight_decay"])
                state["exp_avg"].lerp_(grad.to(state["exp_avg"].dtype), 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                update = state["exp_avg"].float() / state["exp_avg_sq"].float().sqrt().add_(group["eps"])
                p.add_(update.to(p.dtype), alpha=-group["lr"])


def _make_device_optimizer(kind: str, groups: list[dict[str, Any]], attrs: dict[str, Any]) -> torch.optim.Optimizer:
    family = _FAMILY_OF_KIND[kind]
    if family == "SGD":
        return torch.optim.SGD(groups)
    if kind == "ADAMW":
        return torch.optim.AdamW(groups)
    moments = tuple(attrs.get(f"{o}_order_momentum_accum_type", torch.float32) for o in ("first", "second"))
    if kind == "ADAMW_NO_BIAS":
        return _DeviceAdamWNoBias(groups, moments)
    if family == "ADAM":
        return torch.optim.Adam(groups)
    if family == "RMSPROP":
        return torch.optim.RMSprop(groups, centered=kind == "RMSPROP_CENTERED")
    return _DeviceLAMB(groups, bias_correction=kind == "LAMB", dtypes=moments)


# ---- model wrapping ---------------------------------------------------------------------------------------------
_wrapper_types: list[type] = []


def _is_wrapped(obj: Any) -> bool:
    return isinstance(obj, tuple(_wrapper_types))


def _unwrapped_class(obj: Any) -> type:
    cls = type(obj)
    return cls.__bases__[0] if cls in _wrapper_types else cls


def _identity(obj: Any) -> Any:
    return obj


def _pickle_unwrapped(obj: Any):
    """Pickling a wrapped model stores the plain model (as poptorch, whose wrapper types do not outlive a run)."""
    wrapper = type(obj)
    obj.__class__ = wrapper.__bases__[0]
    try:
        plain = copy.copy(obj)
    finally:
        obj.__class__ = wrapper
    return _identity, (plain,)


def _copy_as(obj: Any, deep: bool, memo: dict | None = None) -> Any:
    """A copy of a wrapped object that stays wrapped (poptorch keeps the wrapper on copy.copy/deepcopy)."""
    wrapper = type(obj)
    obj.__class__ = wrapper.__bases__[0]
    try:
        other = copy.deepcopy(obj, memo) if deep else copy.copy(obj)
    finally:
        obj.__class__ = wrapper
    other.__class__ = wrapper
    return other


def _device_copy(model: torch.nn.Module) -> torch.nn.Module:
    """An independent copy of a (possibly wrapped) model: the weights the simulated device holds."""
    cls = type(model)
    model.__class__ = _unwrapped_class(model)
    try:
        device_model = copy.deepcopy(model)
    finally:
        model.__class__ = cls
    for p in device_model.parameters():
        p.grad = None
    return device_model


# ---- inputs -----------------------------------------------------------------------------------------------------
_INPUT_MISMATCH_END = (
    "\nThis error occurred because the inputs passed at runtime don't match the inputs used to compile the model.\n"
    "To recompile the model for the new inputs create a new inferenceModel / trainingModel wrapper or call "
    "destroy() on the curent one and try again."
)


@dataclasses.dataclass
class _Inputs:
    """A call's arguments bound to the model's signature, as poptorch's ArgsParser orders them."""

    args: list[tuple[str, Any]]
    kwargs: dict[str, Any]

    def map(self, fn) -> _Inputs:
        return _Inputs(
            [(n, _map_tensors(v, fn)) for n, v in self.args], {k: _map_tensors(v, fn) for k, v in self.kwargs.items()}
        )

    def tensors(self) -> list[torch.Tensor]:
        return _flatten_tensors([v for _, v in self.args]) + _flatten_tensors(self.kwargs)

    def validate_against(self, compiled: _Inputs) -> None:
        if len(self.args) != len(compiled.args):
            raise _error(
                f"Number of positional arguments mismatch: expected {len(compiled.args)} arguments but got "
                f"{len(self.args)}.{_INPUT_MISMATCH_END}"
            )
        for (name, expected), (_, given) in zip(compiled.args, self.args):
            _validate_input(name, expected, given)
        _validate_input("named arguments", compiled.kwargs, self.kwargs, named=True)


def _map_tensors(value: Any, fn) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return type(value)({k: _map_tensors(v, fn) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        if hasattr(value, "_asdict") and hasattr(value, "_fields"):
            return type(value)(*(_map_tensors(v, fn) for v in value))
        return type(value)(_map_tensors(v, fn) for v in value)
    return value


def _validate_input(name: str, compiled: Any, given: Any, named: bool = False) -> None:
    if type(compiled) is not type(given):
        raise _error(f"Type mismatch for {name}: expected {type(compiled)} but got {type(given)}.{_INPUT_MISMATCH_END}")
    if isinstance(compiled, tuple):
        if len(compiled) != len(given):
            raise _error(
                f"Length mismatch for {name}: expected {len(compiled)} elements but got {len(given)}."
                f"{_INPUT_MISMATCH_END}"
            )
        for i, (c, g) in enumerate(zip(compiled, given)):
            _validate_input(f"{name}[{i}]", c, g)
    elif isinstance(compiled, dict):
        expected, provided = set(compiled), set(given)
        if expected != provided:
            details = []
            if provided - expected:
                details.append("Unexpected arguments: " + ", ".join(sorted(provided - expected)))
            if expected - provided:
                details.append("Missing arguments: " + ", ".join(sorted(expected - provided)))
            raise _error(f"Keys mismatch for {name}: {'. '.join(details)}.{_INPUT_MISMATCH_END}")
        for key, value in compiled.items():
            _validate_input(key if named else f"{name}[{key}]", value, given[key])
    elif isinstance(compiled, torch.Tensor):
        if compiled.dtype != given.dtype:
            raise _error(
                f"Data type mismatch for {name}: expected {compiled.dtype} but got {given.dtype}.{_INPUT_MISMATCH_END}"
            )
        if compiled.shape != given.shape:
            raise _error(
                f"Shape mismatch for {name}: expected {compiled.shape} but got {given.shape}.{_INPUT_MISMATCH_END}"
            )
    elif isinstance(compiled, list):
        compiled_tensors, given_tensors = _flatten_tensors(compiled), _flatten_tensors(given)
        if compiled_tensors:
            _validate_input(name, tuple(compiled_tensors), tuple(given_tensors))
        elif compiled != given:
            raise _error(f"Value mismatch for {name}: expected {compiled} but got {given}.{_INPUT_MISMATCH_END}")
    elif compiled != given:
        raise _error(f"Value mismatch for {name}: expected {compiled} but got {given}.{_INPUT_MISMATCH_END}")


class _ArgsParser:
    """Binds a call's arguments to ``model.forward``'s signature (poptorch's ArgsParser)."""

    def __init__(self, model: Any) -> None:
        if isinstance(model, torch.nn.Module):
            signature = inspect.signature(model.forward)
        elif callable(model):
            signature = inspect.signature(model)
        else:
            raise TypeError("Expected a torch.nn.Module or a callable")
        self._params = list(signature.parameters.values())
        self._names = [p.name for p in self._params]
        variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        self._has_variadic = any(p.kind in variadic for p in self._params)

    def __call__(self, args: tuple, kwargs: dict[str, Any]) -> _Inputs:
        assert self._has_variadic or len(args) + len(kwargs) <= len(self._names), (
            "Too many arguments provided: expected %s (%d) but got %d"
            % (self._names, len(self._names), len(args) + len(kwargs))
        )
        if not self._has_variadic:
            for k in kwargs:
                assert k in self._names, f"{k} is not a valid parameter.Allowed values are {self._names}"
        bound, named = [], {}
        after_var_positional = False
        args = list(args)
        for i, param in enumerate(self._params):
            name = param.name
            if param.kind is inspect.Parameter.VAR_KEYWORD:
                for k, v in kwargs.items():
                    if k not in self._names[:i]:
                        named[k] = v
            elif param.kind is inspect.Parameter.VAR_POSITIONAL:
                after_var_positional = True
                bound += [(f"*{name}[{idx}]", a) for idx, a in enumerate(args[i:])]
                args = []
            elif i < len(args):
                assert name not in kwargs, "Parameter %s was passed more than once" % name
                bound.append((name, args[i]))
            else:
                if name in kwargs:
                    value = kwargs[name]
                elif param.default is not inspect.Parameter.empty:
                    value = param.default
                else:
                    raise _error(f"Mandatory parameter {name} missing")
                # DOUBLE: poptorch passes keyword-only parameters positionally (which breaks); the double names them.
                if after_var_positional or param.kind is inspect.Parameter.KEYWORD_ONLY:
                    named[name] = value
                else:
                    bound.append((name, value))
        return _Inputs(bound, named)


# ---- outputs ------------------------------------------------------------------------------------------------------
def _find_loss(output: Any) -> torch.Tensor:
    """The loss among a training model's outputs: an ``identity_loss``, else the ``loss`` entry of a dict or
    ModelOutput, else the only 0-dim tensor of a tuple/list (DOUBLE: poptorch finds the loss ops in the graph)."""
    marked = [t for t in _flatten_tensors(output) if getattr(t, "_poptorch_identity_loss", False)]
    if marked:
        candidates = marked
    elif isinstance(output, torch.Tensor):
        candidates = [output] if output.dim() == 0 else []
    elif isinstance(output, dict):
        if isinstance(output.get("loss"), torch.Tensor):
            return output["loss"]
        candidates = [v for v in output.values() if isinstance(v, torch.Tensor) and v.dim() == 0]
    elif isinstance(output, (list, tuple)):
        candidates = [v for v in output if isinstance(v, torch.Tensor) and v.dim() == 0]
    else:
        candidates = []
    if not candidates:
        raise _backend_error("Couldn't find a loss in graph!")
    if len(candidates) > 1:
        raise _backend_error(
            "Multiple independent losses found in graph. Graph must have one final loss. "
            "Wrap final graph loss in poptorch.identity_loss."
        )
    return candidates[0]


def identity_loss(x: torch.Tensor, reduction: str) -> torch.Tensor:
    """Marks ``x`` (reduced by ``reduction``: "sum", "mean" or "none") as the model's loss."""
    reductions = {"sum": torch.sum, "mean": torch.mean, "none": lambda t: t}
    assert reduction in reductions, 'reduction argument must be "sum", "mean" or "none"'
    loss = reductions[reduction](x)
    loss._poptorch_identity_loss = True
    return loss


def _host_dtype(t: torch.Tensor) -> torch.Tensor:
    """The IPU has no 64-bit types: poptorch returns int64 outputs as int32 and float64 ones as float32."""
    if t.dtype == torch.long:
        return t.int()
    if t.dtype == torch.double:
        return t.float()
    return t


def _combine(micro_outputs: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Join the selected micro-batch outputs: one is returned as is, several are concatenated along dim 0
    (0-dim values stacked), as PopART's anchors prepend their [iterations, accumulation, replica] dims."""
    if len(micro_outputs) == 1:
        return micro_outputs[0]
    joined = []
    for i in range(len(micro_outputs[0])):
        parts = [m[i] for m in micro_outputs]
        joined.append(torch.stack(parts) if parts[0].dim() == 0 else torch.cat(parts))
    return joined


def _select_outputs(
    per_micro: list[list[torch.Tensor]], mode: int, period: int, iterations: int, replicas: int
) -> list[torch.Tensor]:
    """Outputs of one call for an output mode. ``per_micro`` is ordered [iteration][accumulation][replica]."""
    per_iteration = len(per_micro) // iterations
    if mode == OutputMode.All:
        return _combine(per_micro)
    if mode == OutputMode.Final:
        return _combine(per_micro[-replicas:])
    if mode == OutputMode.EveryN:
        kept = [
            m
            for d in range(iterations)
            if (d + 1) % period == 0
            for m in per_micro[d * per_iteration : (d + 1) * per_iteration]
        ]
        return _combine(kept)
    assert mode == OutputMode.Sum, f"Unexpected output mode {mode}"
    sums = []
    for r in range(replicas):
        of_replica = per_micro[r::replicas]
        sums.append([torch.stack([m[i] for m in of_replica]).sum(dim=0) for i in range(len(per_micro[0]))])
    return _combine(sums)


def _backward_error() -> None:
    raise _error(
        "backward() cannot be called explicitly on outputs of a PopTorch model. If you're using a trainingModel, "
        "the backwards pass is performed automatically when invoking the model. If you're using an "
        "inferenceModel, you should use a trainingModel instead."
    )


# ---- the executor -----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class ExecutorCall:
    """TEST-ONLY: one call of a PoplarExecutor."""

    training: bool
    input_shapes: dict[str, tuple[int, ...]]
    micro_batches: int
    optimizer_steps: int
    lrs: list[list[float]]  # the device's learning rate of each group, at each optimizer step


@dataclasses.dataclass
class _Executable:
    """What the simulated device holds for a compiled model."""

    model: torch.nn.Module
    inputs: _Inputs
    output_structure: Any
    num_ipus: int
    rng_state: torch.Tensor
    optimizer: torch.optim.Optimizer | None = None
    group_names: list[list[str]] = dataclasses.field(default_factory=list)
    optimizer_dict: dict[str, Any] | None = None


class PoplarExecutor:
    """The wrapper ``trainingModel`` / ``inferenceModel`` return; calling it runs the compiled model."""

    def __init__(
        self,
        model: torch.nn.Module,
        options: Options | None,
        training: bool,
        poptorch_version: str,
        optimizer: torch.optim.Optimizer | None = None,
        user_model: torch.nn.Module | None = None,
    ) -> None:
        if options:
            if not isinstance(options, Options):
                raise _error(f"Invalid type: 'options' is of type {type(options)} (Expected poptorch.Options)")
            options._freeze()
            options = options.clone()
        else:
            options = Options()
        options._recorder.enabled = False  # the wrapper's own settings are not the user's calls
        self._user_model = user_model or model
        self._model = model
        self._training = training
        self._host_weights_version = 0
        self._executable: _Executable | None = None
        self._is_attached = False
        self._dirty_host_weights = False
        self._optimizer: torch.optim.Optimizer | None = None
        self._dict_optimizer: dict[str, Any] = {}
        self._ipu_optimizer_is_dirty = False
        self._args_parser = _ArgsParser(model)
        self._top_level_training = self._user_model.training
        # TEST-ONLY records
        self.compile_count = 0
        self.calls: list[ExecutorCall] = []
        self.set_optimizer_calls: list[list[float]] = []

        if training:
            if options.defaultOutputMode():
                options.outputMode(OutputMode.Final)
            if not optimizer:
                optimizer = optim.SGD(self._user_model.parameters(), lr=0.01)
        else:
            if options.defaultOutputMode():
                options.outputMode(OutputMode.All)
            if options.Training.gradient_accumulation != 1:
                err_msg = (
                    "You must set poptorch.Options().Training.gradientAccumulation to 1 or leave it as its default "
                    "value (1) when running a poptorch.inferenceModel()."
                )
                strategy = options._execution_strategy
                if isinstance(strategy, PipelinedExecution) and not isinstance(strategy, ShardedExecution):
                    err_msg += (
                        " Use poptorch.Options().deviceIterations to process a sufficient number of batches each "
                        "run for pipelined execution instead."
                    )
                raise _error(err_msg)
            assert not optimizer, "Optimizer should be None for inference"
        self._options = options
        if optimizer:
            self._set_optimizer(optimizer, record=False)
        self._options._freeze()
        if training:
            self._wrap_user_model()

    # -- wrapping -------------------------------------------------------------------------------------------------
    def _wrap_user_model(self) -> None:
        parent = weakref.ref(self)
        base = type(self._user_model)

        class PoptorchModel(base):
            @property
            def _host_weights_version(self):
                executor = parent()
                return None if executor is None else executor._host_weights_version

            def copyWeightsToHostIfNeeded(self) -> bool:
                executor = parent()
                return False if executor is None else executor.copyWeightsToHostIfNeeded()

            def destroy(self) -> None:
                executor = parent()
                if executor is not None:
                    executor.destroy()

            def __copy__(self):
                return _copy_as(self, deep=False)

            def __deepcopy__(self, memo):
                return _copy_as(self, deep=True, memo=memo)

        PoptorchModel.__name__ = PoptorchModel.__qualname__ = f"Poptorch{base.__name__}"
        _wrapper_types.append(PoptorchModel)
        copyreg.pickle(PoptorchModel, _pickle_unwrapped)
        self._user_model.__class__ = PoptorchModel

    def _describe(self) -> str:
        kind = "trainingModel" if self._training else "inferenceModel"
        return f"{kind}({_unwrapped_class(self._user_model).__name__})"

    # -- attribute access as poptorch: anything else is the wrapped model's ---------------------------------------
    def __getattr__(self, attr: str) -> Any:
        user_model = self.__dict__.get("_user_model")
        if user_model is None:
            raise AttributeError(attr)
        return getattr(user_model, attr)

    def __repr__(self) -> str:
        return f"PoplarExecutor({self._describe()})"

    @property
    def model(self) -> torch.nn.Module:
        return self._user_model

    @property
    def options(self) -> Options:
        return self._options

    # -- compilation ----------------------------------------------------------------------------------------------
    def isCompiled(self) -> bool:
        return self._executable is not None

    def isAttachedToDevice(self) -> bool:
        return self.isCompiled() and self._is_attached

    def compile(self, *args: Any, **kwargs: Any) -> None:
        inputs = self._args_parser(args, kwargs)
        if self._executable is not None:
            logger.warning("Call to compile() ignored: the executable is already compiled")
        else:
            self._compile(inputs)

    def _micro_batches_per_call(self) -> int:
        opts = self._options
        input_group_count = opts.replication_factor // opts.input_group_size
        return opts.device_iterations * input_group_count * opts.Training.gradient_accumulation

    def _check_batch_dimension(self, inputs: _Inputs) -> None:
        opts = self._options
        extra = self._micro_batches_per_call()
        for tensor in inputs.tensors():
            b_size = 1 if not tensor.size() else tensor.size()[0]
            assert b_size % extra == 0, (
                "Invalid batch dimension: In the input %s, the batch dimension (%d) must be a multiple of "
                "Options.deviceIterations(%d) * (Options.replicationFactor(%d) / "
                "Options.inputReplicaGrouping.input_group_size(%d)) * "
                "Options.Training.gradientAccumulation(%d) = %d because it is used to calculate the batch size "
                "which will be executed on the device in any given iteration. For a full explanation see the "
                "batching semantics page of the documentation."
            ) % (
                tensor.shape,
                b_size,
                opts.device_iterations,
                opts.replication_factor,
                opts.input_group_size,
                opts.Training.gradient_accumulation,
                extra,
            )

    def _num_ipus(self) -> int:
        num_ipus = self._options.replication_factor * self._options._execution_strategy._ipus_per_replica()
        rounded = 1
        while rounded < num_ipus:
            rounded *= 2
        if rounded != num_ipus:
            common = ", because PopTorch must reserve a power of 2 or maximum of 64 IPUs per process"
            if not self._options.auto_round_num_ipus:
                raise _backend_error(
                    f"The model specifies the use of {num_ipus} IPUs, however PopTorch must reserve a minimum of "
                    f"{rounded} in order to allow the model to run{common}. Please reconfigure your model to use a "
                    "different number of IPUs or set poptorch.Options().autoRoundNumIPUs(True)."
                )
            logger.warning(
                "Reserving %d IPUs when the model specifices the use of only %d%s. %d will be reserved but not used.",
                rounded,
                num_ipus,
                common,
                rounded - num_ipus,
            )
        if rounded > 64:
            raise _backend_error(f"Too many IPUs requested ({rounded}): a single process can use at most 64")
        return rounded

    def _compile(self, inputs: _Inputs) -> None:
        if any(t.requires_grad for t in inputs.tensors()):
            logger.warning(
                "Input tensor has requires_grad=True set. This tensor will be detached because backward pass via "
                "inputs is not supported."
            )
        inputs = inputs.map(lambda t: t.detach())
        self._check_batch_dimension(inputs)
        num_ipus = self._num_ipus()
        offline = self._options.connection_type == ConnectionType.Never
        device_model = _device_copy(self._user_model)
        device_model.train(self._top_level_training)
        seed = self._options.random_seed if self._options.exists("random_seed") else torch.initial_seed()
        # DOUBLE: without randomSeed the IPU draws a random seed; the double derives one from torch's, for
        # reproducible tests, without consuming the host's random stream.
        executable = _Executable(
            model=device_model,
            inputs=inputs,
            output_structure=None,
            num_ipus=num_ipus,
            rng_state=torch.Generator().manual_seed(seed).get_state(),
        )
        if self._training:
            self._build_device_optimizer(executable)
        executable.output_structure = self._trace(executable, inputs)
        if not offline:
            system.acquire(self, num_ipus)
        self._executable = executable
        self.compile_count += 1
        self._is_attached = not offline
        if self._is_attached:
            self._on_device_attach()

    def _build_device_optimizer(self, executable: _Executable) -> None:
        name_of = {id(p): n for n, p in self._user_model.named_parameters()}
        device_params = dict(executable.model.named_parameters())
        groups, covered = [], set()
        for i, group in enumerate(self._optimizer.param_groups):
            names = []
            for p in group["params"]:
                if id(p) not in name_of:
                    raise _error(
                        f"The optimizer's group {i} holds a tensor of shape {tuple(p.shape)} that is not a "
                        "parameter of the wrapped model"
                    )
                names.append(name_of[id(p)])
            covered.update(names)
            executable.group_names.append(names)
            groups.append(
                {"params": [device_params[n] for n in names], **_hyperparameters(self._dict_optimizer["groups"][i])}
            )
        # PopART updates every trainable weight: those in no group get the optimizer's defaults.
        leftover = [n for n, p in device_params.items() if n not in covered and p.requires_grad]
        if leftover:
            executable.group_names.append(leftover)
            groups.append(
                {"params": [device_params[n] for n in leftover], **_hyperparameters(self._dict_optimizer["defaults"])}
            )
        if self._dict_optimizer["type"] in ("RMSPROP", "RMSPROP_CENTERED") and self._dict_optimizer["attrs"].get(
            "use_tf_variant"
        ):
            raise _error("poptorch double: RMSprop(use_tf_variant=True) is not simulated")
        executable.optimizer = _make_device_optimizer(
            self._dict_optimizer["type"], groups, self._dict_optimizer["attrs"]
        )
        executable.optimizer_dict = self._dict_optimizer

    def _trace(self, executable: _Executable, inputs: _Inputs) -> Any:
        """Run the model once on one micro-batch without changing any state, as poptorch traces it at compile time:
        model errors and a missing loss surface here, and the output structure is fixed."""
        model = executable.model
        buffers = {n: b.clone() for n, b in model.named_buffers()}
        micro = self._split(inputs, self._micro_batches_per_call())[0]
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(executable.rng_state)
            with torch.set_grad_enabled(self._training):
                output = self._run_model(model, micro)
                if self._training:
                    _find_loss(output)
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                buffer.copy_(buffers[name])
        for p in model.parameters():
            p.grad = None
        return output

    # -- device attachment ------------------------------------------------------------------------------------------
    def attachToDevice(self) -> None:
        if not self.isCompiled():
            raise _error(NO_EXECUTABLE_ERR)
        assert self._options.connection_type != ConnectionType.Never, (
            "Trying to attach to an offline device (ConnectionType.Never)"
        )
        if self._is_attached:
            raise _error("Device is already attached")
        system.acquire(self, self._executable.num_ipus)
        self._is_attached = True
        self._on_device_attach()

    def detachFromDevice(self) -> None:
        if not self.isCompiled():
            raise _error(NO_EXECUTABLE_ERR)
        if not self._is_attached:
            raise _error("Device is not attached")
        if self._training:
            self.copyWeightsToHostIfNeeded()
            self._read_optim_state_dict_if_needed()
        system.release(self)
        self._is_attached = False

    def _on_device_attach(self) -> None:
        self.copyWeightsToDevice()
        if self._optimizer:
            self._update_optimizer_if_needed()
        if isinstance(self._optimizer, optim.Optimizer):
            if self._optimizer.has_state():
                self._optimizer.ipu_state_is_dirty = True
                self._write_optim_state_dict_if_needed()
            else:
                self._optimizer.host_state_is_dirty = True
                self._optimizer.ipu_state_is_dirty = False

    def destroy(self) -> None:
        if not self.isCompiled():
            return
        if self._training:
            self.copyWeightsToHostIfNeeded()
            self._optimizer.state_dict()
        system.release(self)
        self._executable = None
        self._is_attached = False
        if not self._training:
            return
        if not _is_wrapped(self._user_model):
            raise _error("model was never wrapped")
        self._user_model.__class__ = _unwrapped_class(self._user_model)

    def __del__(self) -> None:
        # The C++ executable releases its device when it is garbage collected.
        try:
            system.release(self)
        except Exception:  # the module may already be torn down at interpreter exit
            pass

    # -- weights --------------------------------------------------------------------------------------------------
    def _weights(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {**dict(model.named_parameters()), **dict(model.named_buffers())}

    def copyWeightsToHostIfNeeded(self) -> bool:
        if self._dirty_host_weights:
            self.copyWeightsToHost()
            return True
        return False

    def copyWeightsToHost(self) -> None:
        if not self.isCompiled():
            raise _error(NO_EXECUTABLE_ERR)
        self._dirty_host_weights = False
        device = self._weights(self._executable.model)
        with torch.no_grad():
            for name, host in self._weights(self._model).items():
                host.copy_(device[name])
        self._host_weights_version += 1

    def copyWeightsToDevice(self) -> None:
        if not self.isCompiled():
            raise _error(NO_EXECUTABLE_ERR)
        self._dirty_host_weights = False
        if self._optimizer:
            self._optimizer.state_dict()
        device = self._weights(self._executable.model)
        with torch.no_grad():
            for name, host in self._weights(self._model).items():
                device[name].copy_(host)

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True):
        out = self._user_model.load_state_dict(state_dict, strict)
        if self.isAttachedToDevice():
            self.copyWeightsToDevice()
        return out

    # -- optimizer ------------------------------------------------------------------------------------------------
    def setOptimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self._set_optimizer(optimizer, record=True)

    def _set_optimizer(self, optimizer: torch.optim.Optimizer, record: bool) -> None:
        if record:
            # TEST-ONLY; the call trainingModel makes internally is not recorded.
            self.set_optimizer_calls.append([group["lr"] for group in optimizer.param_groups])
        if self.isCompiled() and optimizer is not self._optimizer:
            if isinstance(self._optimizer, optim.Optimizer):
                self._read_optim_state_dict_if_needed()
                self._optimizer.state_dict = self._optimizer.get_state_dict
            if isinstance(optimizer, optim.Optimizer):
                optimizer.ipu_state_is_dirty = True
        if isinstance(optimizer, optim.Optimizer):
            optimizer.state_dict = types.MethodType(PoplarExecutor._get_optim_state_dict, self)
        self._optimizer = optimizer
        dict_optimizer = _optimizer_to_device_dict(optimizer, self._options)
        if dict_optimizer != self._dict_optimizer:
            self._dict_optimizer = dict_optimizer
            self._ipu_optimizer_is_dirty = True
        if self.isAttachedToDevice():
            self._update_optimizer_if_needed()
            self._write_optim_state_dict_if_needed()

    def _update_optimizer_if_needed(self) -> None:
        if not self.isCompiled():
            raise _error(NO_EXECUTABLE_ERR)
        if not self._ipu_optimizer_is_dirty:
            return
        executable = self._executable
        problem = _replacement_problem(executable.optimizer_dict, self._dict_optimizer)
        if problem is not None:
            kind = self._dict_optimizer["type"]
            raise _backend_error(
                f"This Optimizer of type {kind} is not a valid replacement for optimizer of type "
                f"{executable.optimizer_dict['type']}: {problem}"
            )
        hyper = [_hyperparameters(g) for g in self._dict_optimizer["groups"]]
        if len(executable.optimizer.param_groups) > len(hyper):
            hyper.append(_hyperparameters(self._dict_optimizer["defaults"]))
        for group, values in zip(executable.optimizer.param_groups, hyper):
            group.update(values)
        executable.optimizer_dict = self._dict_optimizer
        self._ipu_optimizer_is_dirty = False

    def _loss_scaling(self) -> float:
        return float(self._executable.optimizer_dict["loss_scaling"][0])

    def _max_grad_norm(self) -> float:
        return float(self._executable.optimizer_dict["attrs"].get("max_grad_norm", float("Inf")))

    def _get_optim_state_dict(self) -> dict[str, Any]:
        self._read_optim_state_dict_if_needed()
        return self._optimizer.get_state_dict()

    def _read_optim_state_dict_if_needed(self) -> None:
        if not isinstance(self._optimizer, optim.Optimizer):
            return
        if self._optimizer.host_state_is_dirty:
            if not self.isCompiled():
                raise _error(NO_EXECUTABLE_ERR)
            assert not self._ipu_optimizer_is_dirty, "Both host and ipu states cannot be dirty at the same time."
            self._optimizer.set_state_dict(
                {**self._export_optimizer_state(), **torch.optim.Optimizer.state_dict(self._optimizer)}
            )
            self._optimizer.ipu_state_is_dirty = False

    def _write_optim_state_dict_if_needed(self) -> None:
        if not self.isCompiled():
            raise _error(NO_EXECUTABLE_ERR)
        if isinstance(self._optimizer, optim.Optimizer) and self._optimizer.ipu_state_is_dirty:
            assert not self._optimizer.host_state_is_dirty, "Both host and ipu states cannot be dirty at the same time."
            if self._optimizer.has_state():
                self.copyWeightsToHostIfNeeded()
                self._import_optimizer_state(self._optimizer.get_state_dict()["ipu_state"])
            self._optimizer.ipu_state_is_dirty = False

    def _export_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The device optimizer state as poptorch returns it: ``ipu_state`` (per-weight tensors, named
        ``<state>___<weight>``; DOUBLE: PopART's own tensor names differ) and ``ipu_param`` (hyper-parameters)."""
        device_optimizer = self._executable.optimizer
        ipu_state, ipu_param = {}, {}
        for i, (names, group) in enumerate(zip(self._executable.group_names, device_optimizer.param_groups)):
            for name, p in zip(names, group["params"]):
                for key, value in device_optimizer.state.get(p, {}).items():
                    ipu_state[f"{key}___{name}"] = (
                        value.detach().clone() if torch.is_tensor(value) else torch.tensor(value)
                    )
            for key, value in group.items():
                if key == "betas":
                    ipu_param[f"beta1___group{i}"] = torch.tensor(float(value[0]))
                    ipu_param[f"beta2___group{i}"] = torch.tensor(float(value[1]))
                elif key in ("lr", "weight_decay", "eps", "momentum", "dampening", "alpha", "max_weight_norm"):
                    ipu_param[f"{key}___group{i}"] = torch.tensor(float(value))
        ipu_param["lossScaling"] = torch.tensor(self._loss_scaling())
        return {"ipu_state": ipu_state, "ipu_param": ipu_param}

    def _import_optimizer_state(self, ipu_state: dict[str, torch.Tensor]) -> None:
        """Write an ``ipu_state`` onto the device optimizer. DOUBLE: ``ipu_param`` is not written back; the
        hyper-parameters stay those of the last setOptimizer."""
        device_optimizer = self._executable.optimizer
        params = {
            n: p
            for names, g in zip(self._executable.group_names, device_optimizer.param_groups)
            for n, p in zip(names, g["params"])
        }
        state: dict[torch.Tensor, dict[str, Any]] = {}
        for full_name, value in ipu_state.items():
            key, _, name = full_name.partition("___")
            if name not in params:
                raise _error(f"Optimizer state {full_name!r} names no trainable weight of this model")
            state.setdefault(params[name], {})[key] = value.detach().clone()
        device_optimizer.state.clear()
        device_optimizer.state.update(state)

    # -- running ----------------------------------------------------------------------------------------------------
    @staticmethod
    def _run_model(model: torch.nn.Module, inputs: _Inputs) -> Any:
        positional = [v for _, v in inputs.args]
        return model(*positional, **inputs.kwargs)

    @staticmethod
    def _split(inputs: _Inputs, count: int) -> list[_Inputs]:
        """Cut every batched tensor into ``count`` contiguous, equal micro-batches (0-dim tensors are shared)."""

        def piece(k: int):
            def cut(t: torch.Tensor) -> torch.Tensor:
                if t.dim() == 0:
                    return t
                size = t.shape[0] // count
                return t[k * size : (k + 1) * size]

            return cut

        return [inputs.map(piece(k)) for k in range(count)]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        assert self._options.connection_type != ConnectionType.Never, (
            "Trying to run a model on an offline device (ConnectionType.Never): use model.compile(inputs) instead of"
            " model(inputs)"
        )
        inputs = self._args_parser(args, kwargs)
        if not self.isCompiled():
            self._compile(inputs)
        if not self._is_attached:
            self.attachToDevice()
        if not self._training:
            # An inference model of a model that a training model wraps re-reads the host weights when that training
            # model has copied new ones to the host. DOUBLE: poptorch first copies the training model's weights to
            # the host implicitly; the double does not, so the host copy is explicit.
            training_version = getattr(self._user_model, "_host_weights_version", None)
            if training_version is not None and training_version != self._host_weights_version:
                self.copyWeightsToDevice()
                self._host_weights_version = training_version
        inputs.validate_against(self._executable.inputs)
        self._write_optim_state_dict_if_needed()
        inputs = inputs.map(lambda t: t.detach())
        executable = self._executable
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(executable.rng_state)
            if self._training:
                per_micro, lrs = self._train(inputs)
            else:
                per_micro, lrs = self._infer(inputs), []
            executable.rng_state = torch.get_rng_state()
        if self._training:
            self._dirty_host_weights = True
            if isinstance(self._optimizer, optim.Optimizer):
                self._optimizer.host_state_is_dirty = True
        opts = self._options
        self.calls.append(
            ExecutorCall(
                training=self._training,
                input_shapes={
                    n: tuple(v.shape) for n, v in inputs.args + list(inputs.kwargs.items()) if torch.is_tensor(v)
                },
                micro_batches=len(per_micro),
                optimizer_steps=len(lrs),
                lrs=lrs,
            )
        )
        outputs = _select_outputs(
            per_micro,
            opts.output_mode,
            opts.output_return_period,
            opts.device_iterations,
            opts.replication_factor // opts.input_group_size,
        )
        for tensor in outputs:
            tensor.backward = _backward_error
        return _rebuild(executable.output_structure, outputs)

    def _infer(self, inputs: _Inputs) -> list[list[torch.Tensor]]:
        model = self._executable.model
        with torch.no_grad():
            return [
                [_host_dtype(t) for t in _flatten_tensors(self._run_model(model, micro))]
                for micro in self._split(inputs, self._micro_batches_per_call())
            ]

    def _train(self, inputs: _Inputs) -> tuple[list[list[torch.Tensor]], list[list[float]]]:
        """``deviceIterations`` optimizer steps, each over ``replicas x accumulation`` micro-batches: the gradients
        are summed, divided by the micro-batch count under ReductionType.Mean, unscaled, clipped, applied."""
        opts = self._options
        executable = self._executable
        model, device_optimizer = executable.model, executable.optimizer
        iterations = opts.device_iterations
        micro_per_step = self._micro_batches_per_call() // iterations
        mean = opts.Training.accumulation_and_replication_reduction_type == ReductionType.Mean
        loss_scaling = self._loss_scaling()
        max_grad_norm = self._max_grad_norm()
        micro_batches = self._split(inputs, self._micro_batches_per_call())
        per_micro, lrs = [], []
        for step in range(iterations):
            device_optimizer.zero_grad(set_to_none=True)
            for micro in micro_batches[step * micro_per_step : (step + 1) * micro_per_step]:
                output = self._run_model(model, micro)
                loss = _find_loss(output)
                (loss.sum() * loss_scaling).backward()
                per_micro.append([_host_dtype(t.detach()) for t in _flatten_tensors(output)])
            divisor = loss_scaling * (micro_per_step if mean else 1)
            params = [p for p in model.parameters() if p.grad is not None]
            with torch.no_grad():
                for p in params:
                    p.grad.div_(divisor)
            if math.isfinite(max_grad_norm):
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            lrs.append([float(group["lr"]) for group in device_optimizer.param_groups])
            device_optimizer.step()
        device_optimizer.zero_grad(set_to_none=True)
        return per_micro, lrs


# ---- wrapping functions -------------------------------------------------------------------------------------------
def trainingModel(
    model: torch.nn.Module | PoplarExecutor,
    options: Options | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> PoplarExecutor:
    """Wrap ``model`` for training on the IPU (poptorch's default optimizer: ``poptorch.optim.SGD(lr=0.01)``)."""
    if isinstance(model, PoplarExecutor):
        model = model._user_model
    if _is_wrapped(model):
        raise RuntimeError(
            "Model has already been wrapped in 'poptorch.trainingModel'. Call model.destroy() on the model to "
            "unwrap before wrapping again."
        )
    return PoplarExecutor(
        model=copy.copy(model),
        options=options,
        training=True,
        optimizer=optimizer,
        user_model=model,
        poptorch_version=__version__,
    )


def inferenceModel(model: torch.nn.Module | PoplarExecutor, options: Options | None = None) -> PoplarExecutor:
    """Wrap ``model`` for inference on the IPU (outputs default to OutputMode.All)."""
    if isinstance(model, PoplarExecutor):
        model = model._user_model
    return PoplarExecutor(model=copy.copy(model), options=options, training=False, poptorch_version=__version__)
