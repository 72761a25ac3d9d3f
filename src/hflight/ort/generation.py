"""Generation through ONNX Runtime for encoder-decoder models (BART, T5, Marian, Pegasus, ...), checked against eager.

:class:`ORTSeq2SeqGenerator` exports three graphs with ``torch.onnx.export`` (the machinery of
``hflight.ort.session``: same exporters, tracer notes, eager attention while tracing, sessions and providers) on the
first batch it generates for:

- the **encoder** (``"encoder"``): ``input_ids``, ``attention_mask`` -> ``last_hidden_state``; dynamic batch and
  source length;
- the **decoder with the LM head** on the first tokens (``"decoder"``): ``decoder_input_ids``,
  ``encoder_hidden_states``, ``encoder_attention_mask`` -> ``logits`` and every layer's present self-attention and
  cross-attention keys and values; dynamic batch, target and source lengths;
- the **decoder with past key values** (``"decoder_past"``): the new tokens, the encoder states and mask and every
  layer's past keys and values -> ``logits`` and the self-attention keys and values with the new tokens; dynamic
  batch, new, past and source lengths.

Then transformers' own ``generate`` runs (``GenerationMixin.generate`` of the model's class: the generation config's
precedence, greedy and beam search, ``max_length``/``max_new_tokens``, EOS, logits processors, the cache and its
reordering between beams are transformers'), on a shallow copy of the model whose ``get_encoder()`` and ``forward``
are the sessions: no search loop of hflight's own, and the torch model is untouched. Its forward fills transformers'
dynamic cache (``EncoderDecoderCache`` of ``DynamicCache``) with the sessions' keys and values; with
``use_cache=False`` every step runs ``"decoder"`` on the whole prefix. Other caches (``cache_implementation``),
attentions or hidden states, batch tensors or decoder inputs the graphs do not take, and the dynamo exporter (it
fails on the decoder with a cache) raise, naming them.

Checked, not trusted: on the first batch after each export and on the first ``check_outputs`` batches of each input
shape (``"all"``: every batch; False: none) the eager model generates too, with the same arguments, and a different
token stops with ``ORTMismatchError`` naming the batch, the row and the first differing position
(:func:`hflight.ort.checks.check_tokens`). Tokens must be equal: an arg-max that a rounding difference flips is
reported, not hidden.
"""

from __future__ import annotations

import copy
import inspect
import logging
import os
import tempfile
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import BaseModelOutput, Seq2SeqLMOutput

from hflight.ort.checks import EAGER_ADVICE, check_tokens, report_tracer_warnings
from hflight.ort.session import (
    EXPORTERS,
    ExportedFrom,
    checks_per_shape,
    export_module,
    export_options,
    open_session,
)

log = logging.getLogger(__name__)

__all__ = ["ORTSeq2SeqGenerator", "UNSUPPORTED_GENERATION_KWARGS", "supports_generation"]

#: ``generate`` arguments the sessions cannot honour (the graphs return logits and keys and values only).
UNSUPPORTED_GENERATION_KWARGS = ("output_attentions", "output_hidden_states")
#: The batch tensors generation through the sessions takes (``labels`` are the targets; generate drops them).
_GENERATION_BATCH = ("input_ids", "attention_mask", "labels")
#: What the decoder sessions read from transformers' model inputs of a step; other non-None inputs raise.
_DECODER_INPUTS = ("decoder_input_ids", "encoder_outputs", "attention_mask", "past_key_values")
#: Step inputs the decoder sessions need not read (the new tokens are those decoder_input_ids holds; output_* are
#: refused separately; the logits of every new token are returned).
_IGNORED_STEP_INPUTS = ("use_cache", "return_dict", "cache_position", "output_attentions",
                        "output_hidden_states", "logits_to_keep")  # fmt: skip
_TRACE_TARGET_LENGTH = 3  # the decoder is traced on this many target tokens (1 could freeze a one-token branch)


def supports_generation(model: nn.Module) -> str | None:
    """Why ``model`` cannot generate through ONNX Runtime, or None when it can."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    if not getattr(config, "is_encoder_decoder", False):
        return f"{name} is not an encoder-decoder model (config.is_encoder_decoder is not True)"
    if not callable(getattr(model, "generate", None)) or not callable(getattr(model, "get_encoder", None)):
        return f"{name} has no transformers generate()/get_encoder()"
    if model.get_encoder() is model:
        return f"{name}.get_encoder() finds no encoder module"
    if getattr(model, "main_input_name", "input_ids") != "input_ids":
        return f"{name} reads {model.main_input_name!r}, not token ids (only text encoders are exported)"
    return None


class _EncoderGraph(nn.Module):
    """What the encoder session computes: the encoder's last hidden state."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.encoder = model.get_encoder()

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:  # *tensors: export_options' dynamo spelling
        input_ids, attention_mask = tensors
        return self.encoder(input_ids=input_ids, attention_mask=attention_mask, return_dict=True).last_hidden_state


class _DecoderGraph(nn.Module):
    """What a decoder session computes: the model's logits for decoder inputs and given encoder states, and the
    attention keys and values of every layer. Without past (``"decoder"``): the present self-attention and
    cross-attention keys and values; with past (``"decoder_past"``, inputs after the encoder mask: each layer's past
    self key, self value, cross key, cross value): the self-attention keys and values including the new tokens."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # ids, encoder states, mask, *past
        decoder_input_ids, encoder_hidden_states, encoder_attention_mask, *past = tensors
        layers = len(past) // 4
        cache = EncoderDecoderCache([tuple(past[4 * i : 4 * i + 4]) for i in range(layers)]) if past else None
        outputs = self.model(
            attention_mask=encoder_attention_mask,
            decoder_input_ids=decoder_input_ids,
            encoder_outputs=BaseModelOutput(last_hidden_state=encoder_hidden_states),
            past_key_values=cache,
            use_cache=True,
            return_dict=True,
        )
        present = outputs.past_key_values
        parts = [present.self_attention_cache] + ([] if past else [present.cross_attention_cache])
        states = [t for i in range(len(present)) for part in parts for t in _key_value(part, i)]
        return (outputs.logits, *states)


class _SessionEncoder:
    """``model.get_encoder()`` for transformers' generate: the encoder session, returning a ``BaseModelOutput``."""

    def __init__(self, generator: ORTSeq2SeqGenerator) -> None:
        self.generator = generator

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool = True,
    ) -> BaseModelOutput:
        _refuse_extra_outputs(output_attentions, output_hidden_states)
        mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
        feed = {"input_ids": input_ids, "attention_mask": mask}
        (hidden,) = self.generator.run("encoder", feed, input_ids.device)
        return BaseModelOutput(last_hidden_state=hidden)

    __call__ = forward


def _refuse_extra_outputs(output_attentions: Any, output_hidden_states: Any) -> None:
    if output_attentions or output_hidden_states:
        raise ValueError(
            "Generation through ONNX Runtime returns logits only: output_attentions and output_hidden_states are not "
            f"available. {EAGER_ADVICE}"
        )


class ORTSeq2SeqGenerator(ExportedFrom):
    """``model.generate`` with the encoder and the decoder run by ONNX Runtime sessions, checked against eager.

    Args:
        model: a transformers encoder-decoder model (see :func:`supports_generation`).
        exporter: ``"torchscript"`` (the only one that exports the decoder with a cache; ``"dynamo"`` raises).
        providers, intra_op_threads: as for :class:`hflight.ort.session.ORTEvaluationModel`.
        check_outputs: True (the first batch after each export and of each input shape), an int ``n`` (the first
            ``n`` batches of each input shape), ``"all"`` or False: the batches the eager model also generates, to
            compare tokens.
    """

    def __init__(
        self,
        model: nn.Module,
        exporter: str = "torchscript",
        providers: list[str] | None = None,
        intra_op_threads: int | None = None,
        check_outputs: bool | int | str = True,
    ) -> None:
        reason = supports_generation(model)
        if reason is not None:
            raise ValueError(f"Generation through ONNX Runtime is not available: {reason}. {EAGER_ADVICE}")
        if exporter not in EXPORTERS:
            raise ValueError(f"ORT exporter must be one of {EXPORTERS}, got {exporter!r}")
        if exporter != "torchscript":  # torch.export fails on the decoder with a cache (SDPA's is_causal, a SymBool)
            raise ValueError(
                f"Generation through ONNX Runtime exports with the TorchScript exporter only: exporter={exporter!r} "
                f"(ort_exporter) is not available for it. Use ort_exporter='torchscript'. {EAGER_ADVICE}"
            )
        checks_per_shape(check_outputs)
        super().__init__(model)
        self.exporter = exporter
        self.providers = providers
        self.intra_op_threads = intra_op_threads
        self.check_outputs = check_outputs
        self.sessions: dict[str, Any] = {}
        self.export_count = 0
        self.export_seconds = 0.0
        self.generate_count = 0  # generate calls since this object was built
        self.check_count = 0  # of them, compared with eager generation
        self.check_seconds = 0.0
        self.session_calls = {"encoder": 0, "decoder": 0, "decoder_past": 0}
        self._checked: dict[tuple, int] = {}  # input shape (batch axis aside) -> batches of it compared
        self._fresh_export = False  # the next batch is compared: the first after an export
        self._tmp = tempfile.TemporaryDirectory(prefix="hflight-ort-generate-")

    # ---- export ------------------------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Forget the sessions if the model's weights changed since they were exported (the next batch re-exports)."""
        if self.weights_changed():
            self.sessions = {}

    def export(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """Export the encoder and the decoder, traced on this batch (and :data:`_TRACE_TARGET_LENGTH` target
        tokens), and open a session on each."""
        start = time.perf_counter()
        model = self.model
        with torch.no_grad():
            hidden = _EncoderGraph(model).eval()(input_ids, attention_mask)
        graphs = _graph_specs(model, input_ids, attention_mask, hidden)
        sessions, notes = {}, []
        for part, (wrapper, inputs, axes, outputs) in graphs.items():
            path = os.path.join(self._tmp.name, f"{part}-{self.export_count}.onnx")
            options = export_options(list(inputs), outputs, axes, self.exporter)
            notes += export_module(wrapper, tuple(inputs.values()), path, model, self.exporter, options)
            sessions[part] = open_session(path, input_ids.device, self.providers, self.intra_op_threads)
        report_tracer_warnings(type(model).__name__, notes)
        self.sessions = sessions
        self.remember_weights()
        self._fresh_export = True
        self.export_count += 1
        self.export_seconds += time.perf_counter() - start
        log.info(
            "Exported %s's encoder and decoder to ONNX in %.1f s", type(model).__name__, time.perf_counter() - start
        )

    def run(self, part: str, feed: Mapping[str, torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        """One call of the ``"encoder"`` or ``"decoder"`` session."""
        arrays = {name: value.detach().cpu().numpy() for name, value in feed.items()}
        self.session_calls[part] += 1
        return [torch.from_numpy(np.asarray(out)).to(device) for out in self.sessions[part].run(None, arrays)]

    # ---- generation --------------------------------------------------------------------------------------------
    def generate(self, **kwargs: Any) -> Any:
        """``model.generate(**kwargs)`` through the sessions (exported on the first call, and again after the weights
        changed): the batch's tensors (``input_ids``, ``attention_mask``; ``labels`` unused, as by generate) and
        transformers' generation arguments. Compared with eager generation on the batches the check covers."""
        inputs = {name: value for name, value in kwargs.items() if isinstance(value, torch.Tensor)}
        gen_kwargs = {name: value for name, value in kwargs.items() if name not in inputs}
        explicit = [name for name in UNSUPPORTED_GENERATION_KWARGS if gen_kwargs.get(name)]
        if explicit:
            raise ValueError(
                f"Generation through ONNX Runtime cannot honour {explicit}: its decoder graphs return logits and "
                f"attention keys and values only. {EAGER_ADVICE}"
            )
        input_ids = inputs.get("input_ids")
        others = [k for k, v in inputs.items() if k not in _GENERATION_BATCH and isinstance(v, torch.Tensor)]
        if not isinstance(input_ids, torch.Tensor) or others:
            raise ValueError(
                f"Generation through ONNX Runtime takes input_ids, attention_mask (and labels, unused); the batch has "
                f"{sorted(inputs)}. {EAGER_ADVICE}"
            )
        if not self.sessions:
            mask = inputs.get("attention_mask")
            self.export(input_ids, mask if mask is not None else torch.ones_like(input_ids))
        self.generate_count += 1
        generated = self._session_model().generate(**inputs, **gen_kwargs)
        shape = tuple(input_ids.shape[1:])
        due = self._fresh_export or self._checked.get(shape, 0) < checks_per_shape(self.check_outputs)
        if self.check_outputs and due:
            self._check(inputs, gen_kwargs, generated, shape)
        self._fresh_export = False
        return generated

    def _check(self, inputs: Mapping[str, Any], gen_kwargs: Mapping[str, Any], generated: Any, shape: tuple) -> None:
        start = time.perf_counter()
        with torch.no_grad():
            eager = self.model.generate(**inputs, **gen_kwargs)
        described = {name: tuple(v.shape) for name, v in inputs.items() if isinstance(v, torch.Tensor)}
        check_tokens(type(self.model).__name__, _sequences(eager), _sequences(generated), self.generate_count,
                     described)  # fmt: skip
        self._checked[shape] = self._checked.get(shape, 0) + 1
        self.check_count += 1
        self.check_seconds += time.perf_counter() - start

    def _session_model(self) -> nn.Module:
        """A shallow copy of the model (same modules, parameters and generation config) whose encoder and forward
        are the sessions: transformers' generate runs on it unchanged."""
        proxy = copy.copy(self.model)
        encoder = _SessionEncoder(self)
        proxy.get_encoder = lambda *args, **kwargs: encoder

        def forward(**step: Any) -> Seq2SeqLMOutput:
            return self._decoder_step(**step)

        forward.__signature__ = inspect.signature(self.model.forward)  # type: ignore[attr-defined] - generate reads it
        proxy.forward = forward
        return proxy

    def _decoder_step(self, **step: Any) -> Seq2SeqLMOutput:
        """One step of transformers' generation loop: the decoder session on the whole prefix (no cache)."""
        unknown = [
            name for name, value in step.items()
            if name not in _DECODER_INPUTS and name not in _IGNORED_STEP_INPUTS and value is not None
        ]  # fmt: skip
        if unknown:
            raise ValueError(
                f"Generation through ONNX Runtime got model inputs its decoder graph does not take: {sorted(unknown)} "
                f"(its inputs: decoder_input_ids, the encoder's states and attention mask). {EAGER_ADVICE}"
            )
        _refuse_extra_outputs(step.get("output_attentions"), step.get("output_hidden_states"))
        decoder_ids, hidden = step["decoder_input_ids"], step["encoder_outputs"]["last_hidden_state"]
        mask = step.get("attention_mask")
        mask = mask if mask is not None else torch.ones(hidden.shape[:2], dtype=torch.long, device=hidden.device)
        feed = {"decoder_input_ids": decoder_ids, "encoder_hidden_states": hidden, "encoder_attention_mask": mask}
        cache = _dynamic_cache(step.get("past_key_values"))
        if cache is None or cache.get_seq_length() == 0:  # the whole prefix; its keys and values start the cache
            logits, *states = self.run("decoder", feed, decoder_ids.device)
            for i in range(len(states) // 4 if cache is not None else 0):
                cache.self_attention_cache.update(states[4 * i], states[4 * i + 1], i)
                cache.cross_attention_cache.update(states[4 * i + 2], states[4 * i + 3], i)
                cache.is_updated[i] = True
            return Seq2SeqLMOutput(logits=logits, past_key_values=cache)
        for i in range(len(cache)):  # the new tokens only, after the cached keys and values
            for part, kind in ((cache.self_attention_cache, "self"), (cache.cross_attention_cache, "cross")):
                feed[f"past_{kind}_key_{i}"], feed[f"past_{kind}_value_{i}"] = _key_value(part, i)
        logits, *states = self.run("decoder_past", feed, decoder_ids.device)
        new = decoder_ids.shape[1]
        for i in range(len(cache)):
            cache.self_attention_cache.update(states[2 * i][:, :, -new:], states[2 * i + 1][:, :, -new:], i)
        return Seq2SeqLMOutput(logits=logits, past_key_values=cache)

    def close(self) -> None:
        self.sessions = {}
        self._tmp.cleanup()


def _graph_specs(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, hidden: torch.Tensor
) -> dict[str, tuple[nn.Module, dict[str, torch.Tensor], dict[str, dict[int, str]], list[str]]]:
    """part -> (module to export, its traced inputs, dynamic axes, output names), for the encoder and the decoder
    (traced on :data:`_TRACE_TARGET_LENGTH` decoder-start tokens)."""
    start_id = getattr(model.config, "decoder_start_token_id", None)
    start_id = start_id if start_id is not None else 0
    decoder_ids = torch.full((input_ids.shape[0], _TRACE_TARGET_LENGTH), start_id, device=input_ids.device)
    source = {0: "batch", 1: "source"}
    encoder_inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    decoder_inputs = {
        "decoder_input_ids": decoder_ids,
        "encoder_hidden_states": hidden,
        "encoder_attention_mask": attention_mask,
    }
    encoder_axes = {"input_ids": source, "attention_mask": source, "last_hidden_state": source}
    target = {0: "batch", 1: "target"}
    decoder_axes = {
        "decoder_input_ids": target,
        "encoder_hidden_states": source,
        "encoder_attention_mask": source,
        "logits": target,
    }
    decoder = _DecoderGraph(model).eval()
    with torch.no_grad():
        _, *states = decoder(*decoder_inputs.values())
    layers = len(states) // 4
    kinds = ("self_key", "self_value", "cross_key", "cross_value")
    present = [f"present_{kind}_{i}" for i in range(layers) for kind in kinds]
    past = [f"past_{kind}_{i}" for i in range(layers) for kind in kinds]
    lengths = {"self": "target", "cross": "source"}
    decoder_axes.update({name: {0: "batch", 2: lengths[name.split("_")[1]]} for name in present})
    step_inputs = {**decoder_inputs, "decoder_input_ids": decoder_ids[:, :1], **dict(zip(past, states))}
    step_outputs = ["logits", *(name for name in present if "_self_" in name)]
    step_axes = {name: axes for name, axes in decoder_axes.items() if name in step_inputs or name in step_outputs}
    step_axes.update({name: {0: "batch", 2: f"{lengths[name.split('_')[1]]}_past"} for name in past})
    step_axes.update({name: {0: "batch", 2: "target_total"} for name in step_outputs[1:]})
    return {
        "encoder": (_EncoderGraph(model), encoder_inputs, encoder_axes, ["last_hidden_state"]),
        "decoder": (decoder, decoder_inputs, decoder_axes, ["logits", *present]),
        "decoder_past": (decoder, step_inputs, step_axes, step_outputs),
    }


def _sequences(generated: Any) -> torch.Tensor:
    """The token ids of what ``generate`` returned (a tensor, or a ``GenerateOutput`` with ``sequences``)."""
    return generated if isinstance(generated, torch.Tensor) else generated["sequences"]


def _key_value(cache: DynamicCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    return cache.layers[layer].keys, cache.layers[layer].values


def _dynamic_cache(cache: Any) -> EncoderDecoderCache | None:
    """The cache transformers' generate keeps (None when ``use_cache=False``); the sessions fill dynamic caches
    only."""
    if cache is None:
        return None
    dynamic = isinstance(cache, EncoderDecoderCache) and all(
        isinstance(part, DynamicCache) for part in (cache.self_attention_cache, cache.cross_attention_cache)
    )
    if not dynamic:
        raise ValueError(
            f"Generation through ONNX Runtime keeps its keys and values in transformers' dynamic cache "
            f"(EncoderDecoderCache of DynamicCache); got {type(cache).__name__} (cache_implementation). {EAGER_ADVICE}"
        )
    return cache
