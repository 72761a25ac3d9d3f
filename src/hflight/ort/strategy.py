"""``ORTStrategy``: ONNX Runtime for hflight's loop (``strategy="ort"``).

Evaluation and prediction (``inference=True``): at each evaluation the model's current weights (the averaged ones
when an ``EMACallback`` is attached: the facade swaps them in first) are exported to ONNX, only when they changed
since the last export, and the batches run in an ``onnxruntime.InferenceSession``; the torch module is untouched
and the loss is computed in torch from the session's logits (see ``hflight.ort.session``). The session's outputs are
compared with the eager model's on the traced batch of each export and on the first batch of each input shape not
compared before (``check_outputs``; ``hflight.ort.checks``). ``quantize="dynamic"`` evaluates an int8 copy of the graph.

Training (``training="auto"``): where ``onnxruntime.training`` is importable (the torch-2.6 environment of
``requirements/ortmodule.txt``), the fit runs the model through ``ORTModule``; the facade keeps the plain model, so
checkpoints have the usual keys and ``from_pretrained`` loads them. Elsewhere training runs in eager PyTorch and
the strategy says so once. ``training=True`` requires ORTModule, ``training=False`` never uses it.

One device (CPU, or one GPU with the CUDA execution provider); use DDP/FSDP strategies for several.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from typing_extensions import override

from hflight.ort.generation import ORTSeq2SeqGenerator
from hflight.ort.runtime import ortmodule_class, require_onnxruntime, require_ortmodule
from hflight.ort.session import EXPORTERS, QUANTIZATIONS, ORTEvaluationModel, checks_per_shape
from hflight.run.backend import HFBackend

log = logging.getLogger(__name__)

_TRAINING_MODES = (True, False, "auto")
# model -> {(exporter, quantize, providers, labels): session}: an export survives the Lightning trainers the facade
# creates per train()/evaluate() call, and is rebuilt only when the weights changed.
_SESSIONS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, ORTEvaluationModel]] = weakref.WeakKeyDictionary()
# model -> {(exporter, providers): generator}: the encoder/decoder sessions of generation, kept the same way
_GENERATORS: weakref.WeakKeyDictionary[nn.Module, dict[tuple, ORTSeq2SeqGenerator]] = weakref.WeakKeyDictionary()
_EAGER_TRAINING_NOTICE = [False]


class _ORTModuleTraining(nn.Module):
    """``ORTModule(model)`` whose outputs are cloned: ORTModule reuses its output buffers during backward, and the
    loop keeps the loss after backward."""

    def __init__(self, model: nn.Module, ortmodule_cls: type) -> None:
        super().__init__()
        self.wrapped = model
        self.ort_module = ortmodule_cls(model)

    def forward(self, *args: Any, **inputs: Any) -> Any:
        return _clone_tensors(self.ort_module(*args, **inputs))


def _clone_tensors(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):  # ModelOutput is an OrderedDict
        cloned = type(value)(**{k: _clone_tensors(v) for k, v in value.items()})
        return cloned
    if isinstance(value, (list, tuple)):
        return type(value)(_clone_tensors(v) for v in value)
    return value


def _attention_dropout(config: Any) -> float:
    return float(getattr(config, "attention_probs_dropout_prob", None) or getattr(config, "attention_dropout", 0) or 0)


class ORTStrategy(SingleDeviceStrategy, HFBackend):
    """ONNX Runtime evaluation (and ORTModule training where installed) on one device.

    Args:
        inference: evaluate and predict through an ONNX Runtime session (False: eager PyTorch).
        training: ``"auto"`` (ORTModule when ``onnxruntime.training`` imports), True (require it) or False.
        quantize: None, or ``"dynamic"`` for int8 dynamic quantization of the evaluation graph (per channel).
        exporter: ``"torchscript"`` (default) or ``"dynamo"``.
        providers: ONNX Runtime execution providers (default: CUDA when the model is on a GPU and ORT has it).
        device: the device (default: the accelerator's first; several devices need a DDP strategy).
        loss_module: ``model -> module`` that training runs instead of the model (``ORTTrainer``'s
            ``ModuleWithLoss``, whose forward computes the loss: ORTModule then exports the loss too).
        check_outputs: compare ONNX Runtime's outputs with eager PyTorch's after each export and on the first batch
            of each new input shape (see ``hflight.ort.checks``); a difference beyond the tolerance raises
            ``ORTMismatchError``. A number ``n``: the first ``n`` batches of each shape; ``"all"``: every batch.
    """

    strategy_name = "ort"

    def __init__(
        self,
        inference: bool = True,
        training: bool | str = "auto",
        quantize: str | None = None,
        exporter: str = "torchscript",
        providers: list[str] | None = None,
        device: str | torch.device | None = None,
        loss_module: Callable[[nn.Module], nn.Module] | None = None,
        check_outputs: bool | int | str = True,
        accelerator: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        super().__init__(
            device=device or "cpu",
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        if training not in _TRAINING_MODES:
            raise ValueError(f"ORTStrategy: training must be True, False or 'auto', got {training!r}")
        if exporter not in EXPORTERS:
            raise ValueError(f"ORTStrategy: exporter must be one of {EXPORTERS}, got {exporter!r}")
        if quantize not in QUANTIZATIONS:
            raise ValueError(f"ORTStrategy: quantize must be None or 'dynamic', got {quantize!r}")
        if not inference and training is False:
            raise ValueError("ORTStrategy(inference=False, training=False) would not use ONNX Runtime at all.")
        if inference:
            require_onnxruntime()
        self.inference = inference
        self.ortmodule = require_ortmodule() if training is True else ortmodule_class() if training == "auto" else None
        self.quantize = quantize
        self.exporter = exporter
        self.providers = providers
        self.loss_module = loss_module
        checks_per_shape(check_outputs)  # a bad value fails here, naming itself
        self.check_outputs = check_outputs
        self._device = torch.device(device) if device is not None else None
        self._training_model: _ORTModuleTraining | None = None

    @property
    @override
    def root_device(self) -> torch.device:
        """The device given, else the first device of the accelerator Lightning chose ("auto": a GPU if any)."""
        if self._device is not None or self.accelerator is None:
            return self._device or torch.device("cpu")
        accelerator = type(self.accelerator)
        return accelerator.get_parallel_devices(accelerator.parse_devices(1))[0]

    # ---- training ----------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self._announce_training()

    def _announce_training(self) -> None:
        if self.ortmodule is None and not _EAGER_TRAINING_NOTICE[0]:
            _EAGER_TRAINING_NOTICE[0] = True
            log.warning(
                "ORTStrategy: onnxruntime.training (ORTModule) is not installed here, so training runs in eager "
                "PyTorch; evaluation and prediction run through ONNX Runtime."
            )

    @override
    def hf_training_model(self, model: nn.Module) -> Callable[..., Any]:
        trained = self.loss_module(model) if self.loss_module is not None else model
        if self.ortmodule is None:
            return trained
        if self._training_model is None or self._training_model.wrapped is not trained:
            config = getattr(model, "config", None)
            if getattr(config, "_attn_implementation", None) == "sdpa" and _attention_dropout(config) > 0:
                # ORTModule cannot export SDPA with attention dropout; eager attention computes the same function.
                log.info("ORTStrategy: switching %s to eager attention for ORTModule.", type(model).__name__)
                model.set_attn_implementation("eager")
            self._training_model = _ORTModuleTraining(trained, self.ortmodule)
        return self._training_model

    # ---- evaluation --------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def inference_through_ort(self, enabled: bool) -> Iterator[None]:
        """Evaluate and predict through ONNX Runtime (True) or in eager PyTorch (False) inside this context."""
        if enabled:
            require_onnxruntime()
        previous, self.inference = self.inference, enabled
        try:
            yield
        finally:
            self.inference = previous

    @override
    @contextlib.contextmanager
    def hf_evaluation_model(self, model: nn.Module, label_names: list[str]) -> Iterator[Callable[..., Any]]:
        if not self.inference:
            yield model
            return
        sessions = _SESSIONS.setdefault(model, {})
        key = (self.exporter, self.quantize, tuple(self.providers or ()), tuple(label_names))
        session = sessions.get(key)
        if session is None:
            session = sessions[key] = ORTEvaluationModel(
                model, label_names, exporter=self.exporter, quantize=self.quantize, providers=self.providers
            )
        session.refresh()  # re-export on the first batch if training (or an average) changed the weights
        session.check_outputs = self.check_outputs
        yield session

    def generator(self, model: nn.Module) -> ORTSeq2SeqGenerator:
        """The ONNX Runtime generator of an encoder-decoder ``model`` (encoder and decoder sessions, re-exported when
        the weights changed, checked against eager generation as ``check_outputs`` says)."""
        require_onnxruntime()
        if self.quantize is not None:
            raise ValueError(
                f"Generation through ONNX Runtime runs the float32 graphs only: quantize={self.quantize!r} "
                "(ort_quantize) is not available with it. Set ort_quantize=None, or generate in eager PyTorch "
                "(inference_with_ort=False)."
            )
        generators = _GENERATORS.setdefault(model, {})
        key = (self.exporter, tuple(self.providers or ()))
        if key not in generators:
            generators[key] = ORTSeq2SeqGenerator(model, exporter=self.exporter, providers=self.providers)
        generator = generators[key]
        generator.refresh()
        generator.check_outputs = self.check_outputs
        return generator

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if cls.strategy_name not in strategy_registry:
            description = "ONNX Runtime evaluation, ORTModule training where installed (hflight)"
            strategy_registry.register(cls.strategy_name, cls, description=description)


def evaluation_sessions(model: nn.Module) -> list[ORTEvaluationModel]:
    """The ONNX Runtime evaluation sessions kept for ``model`` (to inspect export counts and timings)."""
    return list(_SESSIONS.get(model, {}).values())


def generators(model: nn.Module) -> list[ORTSeq2SeqGenerator]:
    """The ONNX Runtime generators kept for ``model`` (to inspect export, generation and check counts)."""
    return list(_GENERATORS.get(model, {}).values())
