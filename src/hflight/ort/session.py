"""A transformers model's logits as an ONNX graph in an ONNX Runtime session, called like the model.

:class:`ORTEvaluationModel` exports the model's logits with ``torch.onnx.export`` on the first batch it sees
(dynamic batch and sequence axes), opens an ``onnxruntime.InferenceSession`` on them and afterwards answers calls
``model(**batch)`` with the same output class the model returns. The loss is not part of the graph (exporting the QA
loss fails with both exporters: its ignore index depends on the dynamic sequence length); it is computed in torch
from the session's logits with transformers' own loss functions (for encoder-decoder LMs, their forward's
cross-entropy against the labels, the decoder inputs made from the labels when the batch has none), so ``eval_loss``
stays comparable; on the batches the check compares, it is compared with the eager model's own loss.

Exporters: ``"torchscript"`` (``dynamo=False``; about 1 s for MiniLM, and with eager attention during the export it
gives the fastest graph) or ``"dynamo"`` (``torch.export``; 7-13 s, and its SDPA graph ran about 2x slower).
``quantize="dynamic"`` runs the session on an int8 copy (``quantize_dynamic``, QInt8 weights, per channel).

The session is checked, not trusted (``hflight.ort.checks``): the eager model answers the traced batch of every
export and the first batch of each input shape not compared before too, and a difference beyond the tolerance stops
with an error naming the model and the largest difference (for ``quantize="dynamic"`` the float32 graph is the one
compared: int8 weights differ by design). The exporter's tracer warnings are reported once; an operator ONNX cannot
express gives one error naming it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import math
import os
import re
import tempfile
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers.loss.loss_utils import (
    ForCausalLMLoss,
    ForMaskedLMLoss,
    ForQuestionAnsweringLoss,
    ForSequenceClassificationLoss,
    ForTokenClassification,
)

from hflight.ort.checks import (
    EAGER_ADVICE,
    check_outputs,
    quiet_graph_dump,
    report_tracer_warnings,
    tracer_note,
    unsupported_operator,
)
from hflight.ort.runtime import require_onnxruntime

log = logging.getLogger(__name__)

EXPORTERS = ("torchscript", "dynamo")
QUANTIZATIONS = (None, "dynamic")
OPSETS = {"torchscript": 17, "dynamo": 18}  # the dynamo exporter implements opset 18 and later


def _qa_loss(model: nn.Module, outputs: Mapping[str, torch.Tensor], labels: Mapping[str, torch.Tensor]) -> Any:
    return ForQuestionAnsweringLoss(
        outputs["start_logits"], outputs["end_logits"], labels.get("start_positions"), labels.get("end_positions")
    )


def _sequence_loss(model: nn.Module, outputs: Mapping[str, torch.Tensor], labels: Mapping[str, torch.Tensor]) -> Any:
    return ForSequenceClassificationLoss(labels["labels"], outputs["logits"], model.config)


def _token_loss(model: nn.Module, outputs: Mapping[str, torch.Tensor], labels: Mapping[str, torch.Tensor]) -> Any:
    return ForTokenClassification(outputs["logits"], labels["labels"], model.config)


def _causal_lm_loss(model: nn.Module, outputs: Mapping[str, torch.Tensor], labels: Mapping[str, torch.Tensor]) -> Any:
    return ForCausalLMLoss(outputs["logits"], labels["labels"], model.config.vocab_size)


def _masked_lm_loss(model: nn.Module, outputs: Mapping[str, torch.Tensor], labels: Mapping[str, torch.Tensor]) -> Any:
    return ForMaskedLMLoss(outputs["logits"], labels["labels"], model.config.vocab_size)


def _seq2seq_lm_loss(model: nn.Module, outputs: Mapping[str, torch.Tensor], labels: Mapping[str, torch.Tensor]) -> Any:
    """What transformers' encoder-decoder LMs (BART, T5, Marian, Pegasus, ...) compute in their forward: the mean
    cross-entropy of the decoder's logits against the labels, position by position (no shift: the decoder inputs are
    the labels shifted right), -100 ignored."""
    if not getattr(model.config, "is_encoder_decoder", False):  # e.g. a vision-language LM: a causal loss
        raise NotImplementedError(
            f"ORT evaluation knows the ForConditionalGeneration loss of encoder-decoder models only; "
            f"{type(model).__name__} is not one (config.is_encoder_decoder is False). Evaluate it with eager PyTorch."
        )
    logits, target = outputs["logits"], labels["labels"].to(outputs["logits"].device)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100)


#: transformers' ``model.loss_type`` -> the loss from exported outputs and label tensors, as the model computes it.
LOSSES: dict[str, Callable[[nn.Module, Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]], Any]] = {
    "ForQuestionAnswering": _qa_loss,
    "ForSequenceClassification": _sequence_loss,
    "ForTokenClassification": _token_loss,
    "ForCausalLM": _causal_lm_loss,
    "ForMaskedLM": _masked_lm_loss,
    "ForConditionalGeneration": _seq2seq_lm_loss,
}


class _LogitsOnly(nn.Module):
    """The model as a function of positional input tensors returning its logits (what gets exported)."""

    def __init__(self, model: nn.Module, input_names: list[str], output_names: list[str]) -> None:
        super().__init__()
        self.model = model
        self.input_names = input_names
        self.output_names = output_names

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs = _call(self.model, dict(zip(self.input_names, tensors)))
        return tuple(outputs[name] for name in self.output_names)


def _call(model: nn.Module, inputs: dict[str, torch.Tensor]) -> Any:
    """``model(**inputs)``, asking transformers models for a ``ModelOutput`` (a mapping)."""
    if "return_dict" in inspect.signature(model.forward).parameters:
        inputs = {**inputs, "return_dict": True}
    return model(**inputs)


@contextlib.contextmanager
def _eager_attention(model: nn.Module, exporter: str) -> Iterator[None]:
    """Eager attention while the TorchScript exporter traces (it gives ORT the fastest graph); restored after."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if exporter != "torchscript" or current in (None, "eager") or not hasattr(model, "set_attn_implementation"):
        yield
        return
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(current)


def state_snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter and buffer, to tell later whether the weights changed."""
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def same_weights(model: nn.Module, snapshot: Mapping[str, torch.Tensor]) -> bool:
    state = model.state_dict()
    return state.keys() == snapshot.keys() and all(torch.equal(state[k], snapshot[k]) for k in snapshot)


@dataclass(frozen=True)
class ExportedGraph:
    """What an export wrote: the graph's input and output names, the model's output class, the tracer's warnings
    (``"file:line: message"``) and the eager model's outputs on the traced batch (the first check's reference)."""

    path: str
    input_names: list[str]
    output_names: list[str]
    output_class: type
    tracer_warnings: tuple[str, ...] = ()
    eager_outputs: Mapping[str, torch.Tensor] = dataclasses.field(default_factory=dict)


def export_logits(
    model: nn.Module, batch: Mapping[str, Any], path: str, label_names: list[str], exporter: str = "torchscript"
) -> ExportedGraph:
    """Export ``model``'s logits (every tensor output but the loss) to ``path``, traced on ``batch``'s inputs (the
    tensors of ``batch`` that ``model.forward`` takes, labels excluded), with dynamic batch and sequence axes."""
    if exporter not in EXPORTERS:
        raise ValueError(f"ORT exporter must be one of {EXPORTERS}, got {exporter!r}")
    input_names = graph_input_names(model, batch, label_names)
    if not input_names:
        raise ValueError(
            f"ORT export: none of the batch keys {sorted(batch)} is an input of {type(model).__name__}.forward."
        )
    args = tuple(batch[name] for name in input_names)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():  # with the labels: the model's own loss is the check's reference for the ORT loss
            sample = _call(model, {**dict(zip(input_names, args)), **_label_inputs(model, batch, label_names)})
        if not isinstance(sample, Mapping):
            raise TypeError(f"ORT export: {type(model).__name__} must return a ModelOutput or a dict of tensors.")
        output_names = [k for k, v in sample.items() if k != "loss" and isinstance(v, torch.Tensor)]
        # each input's axis 1 its own dynamic length (an encoder-decoder's source and target lengths differ); an
        # output's axis 1 is dynamic, under a name of its own, when its length is one of the inputs'
        lengths = {t.shape[1] for t in args if t.dim() > 1}
        dynamic_axes: dict[str, dict[int, str]] = {}
        for name, value in [*zip(input_names, args), *((n, sample[n]) for n in output_names)]:
            varies = value.dim() > 1 and value.shape[1] in lengths
            dynamic_axes[name] = {0: "batch", 1: f"{name}_length"} if varies else {0: "batch"}
        wrapper = _LogitsOnly(model, input_names, output_names).eval()
        export = export_options(input_names, output_names, dynamic_axes, exporter)
        notes = export_module(wrapper, args, path, model, exporter, export)
    finally:
        model.train(was_training)
    eager = {name: sample[name] for name in output_names}
    if isinstance(sample.get("loss"), torch.Tensor):
        eager["loss"] = sample["loss"]
    return ExportedGraph(path, input_names, output_names, type(sample), tuple(notes), eager)


def graph_input_names(model: nn.Module, batch: Mapping[str, Any], label_names: list[str]) -> list[str]:
    """The tensors of ``batch`` that ``model.forward`` takes, labels excluded, in the signature's order: the inputs of
    the graph exported on ``batch``."""
    accepted = inspect.signature(model.forward).parameters
    return [
        name for name in accepted if name in batch and name not in label_names and isinstance(batch[name], torch.Tensor)
    ]


def _label_inputs(model: nn.Module, batch: Mapping[str, Any], label_names: list[str]) -> dict[str, torch.Tensor]:
    """The label tensors of ``batch`` that ``model.forward`` takes (so that the eager model computes its loss)."""
    accepted = inspect.signature(model.forward).parameters
    return {name: batch[name] for name in label_names if name in accepted and isinstance(batch.get(name), torch.Tensor)}


def with_decoder_inputs(model: nn.Module, batch: Mapping[str, Any]) -> Mapping[str, Any]:
    """``batch``, and for an encoder-decoder model given ``labels`` but no ``decoder_input_ids``, the decoder inputs
    its forward makes from the labels (``prepare_decoder_input_ids_from_labels``: the labels shifted right), so that
    they are an input of the graph rather than something the trace computes from the batch it saw."""
    config = getattr(model, "config", None)
    labels = batch.get("labels")
    if labels is None or "decoder_input_ids" in batch or not getattr(config, "is_encoder_decoder", False):
        return batch
    prepare = getattr(model, "prepare_decoder_input_ids_from_labels", None)
    if prepare is None:
        raise ValueError(
            f"ORT evaluation of {type(model).__name__} with labels: the batch has no decoder_input_ids and the model "
            "has no prepare_decoder_input_ids_from_labels to make them (give them in the batch, e.g. with "
            f"DataCollatorForSeq2Seq(tokenizer, model=model)). {EAGER_ADVICE}"
        )
    return {**batch, "decoder_input_ids": prepare(labels=labels)}


def export_options(
    input_names: list[str], output_names: list[str], dynamic_axes: dict[str, dict[int, str]], exporter: str
) -> dict[str, Any]:
    """``torch.onnx.export``'s keyword arguments for a graph of positional inputs ``input_names`` whose axes
    ``dynamic_axes`` names (input or output name -> {axis: name}) are dynamic, in the exporter's own spelling."""
    if exporter == "dynamo":  # torch.export's spelling of the same dynamic axes
        shapes = tuple({i: torch.export.Dim.DYNAMIC for i in dynamic_axes.get(name, {})} for name in input_names)
        axes: dict[str, Any] = {"dynamic_shapes": (shapes,), "external_data": False}  # one entry: *tensors
    else:
        axes = {"dynamic_axes": dynamic_axes}
    return dict(input_names=input_names, output_names=output_names, opset_version=OPSETS[exporter], **axes)


def export_module(
    wrapper: nn.Module, args: tuple, path: str, model: nn.Module, exporter: str, options: dict[str, Any]
) -> list[str]:
    """Export ``wrapper`` (a function of ``model``) traced on ``args``, with eager attention for the TorchScript
    exporter; returns the tracer's notes (see :func:`_export`)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), _eager_attention(model, exporter):
            return _export(wrapper.eval(), args, path, type(model).__name__, exporter, options)
    finally:
        model.train(was_training)


def _export(
    wrapper: nn.Module, args: tuple, path: str, model_name: str, exporter: str, options: dict[str, Any]
) -> list[str]:
    """``torch.onnx.export``, keeping its tracer warnings (returned as notes; every other warning is re-emitted,
    except the exporter's notes on how it lowers ``aten::index``) and turning an operator ONNX cannot express into
    one error."""
    with warnings.catch_warnings(record=True) as caught, quiet_graph_dump():
        warnings.simplefilter("always", torch.jit.TracerWarning)
        try:
            torch.onnx.export(wrapper, args, path, dynamo=exporter == "dynamo", **options)
        except Exception as exc:
            error = unsupported_operator(exc, model_name, exporter, options["opset_version"])
            if error is None:
                raise
            raise error from exc
    notes = []
    for warning in caught:
        if issubclass(warning.category, torch.jit.TracerWarning):
            notes.append(tracer_note(warning))
        elif not re.search(r"aten::index", str(warning.message)):
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return notes


def open_session(
    path: str, device: torch.device, providers: list[str] | None = None, intra_op_threads: int | None = None
) -> Any:
    """An ``onnxruntime.InferenceSession`` on ``path``: all graph optimisations, ``intra_op_threads`` (default
    torch's), ``providers`` (default: CUDA when ``device`` is a GPU and ORT has it, else CPU)."""
    ort = require_onnxruntime()
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads or torch.get_num_threads()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if providers is None:
        providers = ["CPUExecutionProvider"]
        if device.type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers():
            providers = ["CUDAExecutionProvider", *providers]
    return ort.InferenceSession(path, sess_options=options, providers=providers)


def checks_per_shape(check_outputs: bool | int | str) -> float:
    """How many batches of each input shape ``check_outputs`` compares with eager PyTorch (True: the first)."""
    if check_outputs == "all":
        return math.inf
    if isinstance(check_outputs, bool) or (isinstance(check_outputs, int) and check_outputs >= 0):
        return int(check_outputs)
    raise ValueError(
        f"ORT check_outputs must be True, False, a number of batches per shape or 'all', got {check_outputs!r}"
    )


class ExportedFrom:
    """What an ONNX export remembers of its torch model: a weak reference to it, and its weights when exported (to
    tell whether they changed since)."""

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)
        self._snapshot: dict[str, torch.Tensor] | None = None

    @property
    def model(self) -> nn.Module:
        model = self._model()
        if model is None:
            raise RuntimeError(f"{type(self).__name__}: the torch model it exports was garbage-collected.")
        return model

    def remember_weights(self) -> None:
        self._snapshot = state_snapshot(self.model)

    def weights_changed(self) -> bool:
        """Whether the model's weights differ from those of the last export (False before any export)."""
        return self._snapshot is not None and not same_weights(self.model, self._snapshot)


class ORTEvaluationModel(ExportedFrom):
    """``model(**batch)`` answered by an ONNX Runtime session on the model's exported logits.

    Args:
        model: the torch model (a transformers model, or any module returning a mapping of tensors).
        label_names: batch keys that are labels (not graph inputs; used for the loss).
        exporter: ``"torchscript"`` or ``"dynamo"``.
        quantize: None, or ``"dynamic"`` for int8 weights (QInt8, per channel).
        providers: ONNX Runtime execution providers; default CUDA when the model is on a GPU and ORT has it, else CPU.
        intra_op_threads: ORT's intra-op threads; default ``torch.get_num_threads()``.
        export_dir: where the ``.onnx`` files go (default: a temporary directory removed with this object).
        check_outputs: compare the session's outputs with the eager model's on the traced batch of every export (free:
            the export ran the model on it) and on the first batch of each input shape not compared before (one eager
            forward each), and raise ``ORTMismatchError`` on a difference beyond ``hflight.ort.checks.TOLERANCES``.
            An int ``n`` compares the first ``n`` batches of each shape, ``"all"`` every batch (a branch on tensor
            values at a shape already compared is caught only then; each compared batch costs one eager forward).
    """

    def __init__(
        self,
        model: nn.Module,
        label_names: list[str],
        exporter: str = "torchscript",
        quantize: str | None = None,
        providers: list[str] | None = None,
        intra_op_threads: int | None = None,
        export_dir: str | None = None,
        check_outputs: bool | int | str = True,
    ) -> None:
        if exporter not in EXPORTERS:
            raise ValueError(f"ORT exporter must be one of {EXPORTERS}, got {exporter!r}")
        if quantize not in QUANTIZATIONS:
            raise ValueError(f"ORT quantize must be one of {QUANTIZATIONS}, got {quantize!r}")
        self.ort = require_onnxruntime()
        # weak: the strategy caches sessions per model in a WeakKeyDictionary, which a strong reference would pin
        super().__init__(model)
        self.label_names = list(label_names)
        self.exporter = exporter
        self.quantize = quantize
        self.providers = providers
        self.intra_op_threads = intra_op_threads
        self._tmp = None if export_dir is not None else tempfile.TemporaryDirectory(prefix="hflight-ort-")
        self.export_dir = export_dir if export_dir is not None else self._tmp.name
        self.session: Any = None
        self.input_names: list[str] = []
        self.output_names: list[str] = []
        self.output_class: type | None = None
        self.export_count = 0
        self.export_seconds = 0.0
        self.check_outputs = check_outputs
        self.check_count = 0  # batches compared with eager since this object was built
        self.check_seconds = 0.0
        self.largest_difference = 0.0  # the largest |ORT - eager| those comparisons found
        # input shapes (batch axis aside) already compared: a branch on shapes is the same in every export, so a shape
        # is compared once per model; the traced batch is compared after every export
        self._checked: dict[tuple, int] = {}  # input shape -> batches of it compared
        self._reference: Any = None  # what the check compares: the session, or the float32 graph's when quantized
        self._export_outputs: Mapping[str, torch.Tensor] = {}

    # ---- export ------------------------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Forget the session if the model's weights changed since it was exported (the next call re-exports)."""
        if self.weights_changed():
            self.session = None

    def export(self, batch: Mapping[str, Any]) -> None:
        """Export the model's logits on ``batch``'s inputs and open a session on them."""
        start = time.perf_counter()
        path = os.path.join(self.export_dir, f"model-{self.export_count}.onnx")
        graph = export_logits(self.model, batch, path, self.label_names, self.exporter)
        report_tracer_warnings(type(self.model).__name__, list(graph.tracer_warnings))
        self.input_names, self.output_names = graph.input_names, graph.output_names
        self.output_class = graph.output_class
        device = batch[self.input_names[0]].device
        self.session = self._reference = self._open(path, device)
        if self.quantize == "dynamic":
            self.session = self._open(self._quantized(path), device)
        self._export_outputs = graph.eager_outputs
        self.remember_weights()
        self.export_count += 1
        self.export_seconds += time.perf_counter() - start
        log.info(
            "Exported %s to ONNX (%s exporter%s) in %.1f s",
            type(self.model).__name__,
            self.exporter,
            ", int8" if self.quantize else "",
            time.perf_counter() - start,
        )

    def _quantized(self, path: str) -> str:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        target = path.replace(".onnx", ".int8.onnx")
        quantize_dynamic(path, target, weight_type=QuantType.QInt8, per_channel=True)
        return target

    def _open(self, path: str, device: torch.device) -> Any:
        return open_session(path, device, self.providers, self.intra_op_threads)

    # ---- calls -------------------------------------------------------------------------------------------------
    def __call__(self, **batch: Any) -> Any:
        batch = dict(with_decoder_inputs(self.model, batch))
        if self.session is not None and graph_input_names(self.model, batch, self.label_names) != self.input_names:
            self.session = None  # the batch has other inputs than the graph (say, decoder inputs): export again
        if self.session is None:
            self.export(batch)
        missing = [name for name in self.input_names if name not in batch]
        if missing:
            raise ValueError(f"ORT evaluation: the batch lacks {missing}, inputs of the exported graph.")
        feed = {name: batch[name].detach().cpu().numpy() for name in self.input_names}
        device = batch[self.input_names[0]].device
        outputs = self._run(self.session, feed, device)
        labels = {name: batch[name] for name in self.label_names if batch.get(name) is not None}
        loss = self._loss(outputs, labels) if labels else None
        if self.check_outputs:
            self._check(batch, feed, outputs, loss, device)
        return self.output_class(loss=loss, **outputs) if loss is not None else self.output_class(**outputs)

    def _run(self, session: Any, feed: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
        results = session.run(self.output_names, feed)
        return {name: torch.from_numpy(np.asarray(out)).to(device) for name, out in zip(self.output_names, results)}

    def _check(
        self,
        batch: Mapping[str, Any],
        feed: dict[str, np.ndarray],
        outputs: dict[str, torch.Tensor],
        loss: torch.Tensor | None,
        device: Any,
    ) -> None:
        """Compare with the eager model on the traced batch of every export (its eager outputs come from the export
        itself) and on the first batch of each input shape not compared before; the loss computed from the session's
        outputs is compared with the model's own (eager, on the same batch with its labels)."""
        shapes = tuple(feed[name].shape[1:] for name in self.input_names)
        if self._checked.get(shapes, 0) >= checks_per_shape(self.check_outputs) and not self._export_outputs:
            return
        start = time.perf_counter()
        eager = self._export_outputs
        if not eager:
            inputs = {name: batch[name] for name in self.input_names}
            with torch.no_grad():
                result = _call(self.model, {**inputs, **_label_inputs(self.model, batch, self.label_names)})
            eager = {name: result[name] for name in self.output_names}
            if isinstance(result.get("loss"), torch.Tensor):
                eager["loss"] = result["loss"]
        self._export_outputs = {}
        checked = outputs if self._reference is self.session else self._run(self._reference, feed, device)
        if loss is not None and "loss" in eager and self._reference is self.session:  # int8 losses differ by design
            checked = {**checked, "loss": loss}
        described = {name: tuple(feed[name].shape) for name in self.input_names}
        difference = check_outputs(type(self.model).__name__, eager, checked, described)
        self.largest_difference = max(self.largest_difference, difference)
        self._checked[shapes] = self._checked.get(shapes, 0) + 1
        self.check_count += 1
        self.check_seconds += time.perf_counter() - start

    def _loss(self, outputs: Mapping[str, torch.Tensor], labels: Mapping[str, torch.Tensor]) -> torch.Tensor:
        loss_type = getattr(self.model, "loss_type", None)
        if loss_type is None and getattr(getattr(self.model, "config", None), "is_encoder_decoder", False):
            loss_type = "ForConditionalGeneration"  # MarianMTModel & co: no "For..." in the class name, the same loss
        compute = LOSSES.get(loss_type)
        if compute is None:
            raise NotImplementedError(
                f"ORT evaluation computes the loss in torch from the exported logits and knows the losses of "
                f"{', '.join(LOSSES)}; {type(self.model).__name__} (loss_type={loss_type!r}) is not one of them. "
                "Evaluate it without labels (prediction_loss_only=False and no label columns) or with eager PyTorch."
            )
        return compute(self.model, outputs, labels)

    def close(self) -> None:
        self.session = self._reference = None
        if self._tmp is not None:
            self._tmp.cleanup()
