"""Generation on IPU inference executables: optimum-graphcore's ``IPUGenerationMixin`` (its path without KV cache).

transformers' ``generate`` drives the search (generation config precedence, greedy, beams, sampling, EOS, length
limits: transformers' code and semantics); every forward pass it asks for runs on a ``poptorch.inferenceModel``:

* the **encoder** executable runs once per batch (``model.get_encoder()`` on the main input and attention mask);
* the **decoder** executable runs once per generated token. As in optimum-graphcore, its decoder input is padded to
  the generation's ``max_length`` (the length transformers' stopping criteria resolve, ``max_new_tokens`` included)
  and it takes the current position ``t`` as a tensor, so one executable serves every step of a generation; it
  returns the logits at position ``t`` only (optimum-graphcore's ``DecoderWrapper`` with its indexed LM head). The
  encoder's hidden states and attention mask are inputs of each step (optimum-graphcore's default; its encoder
  output buffers are an option that is not implemented here).

poptorch compiles an executable for the input shapes of its first call; another shape is an error. So each
executable is compiled once per static shape (batch x beams, source length, ``max_length``) and replaced, with one
new compilation, when a generation asks for another shape. The executables share the host model's weights: poptorch
uploads them when it compiles or attaches, and :meth:`IPUGeneration.begin` makes the next call of each executable
upload them again (``copyWeightsToDevice``), so an evaluation after training steps generates with the trained
weights. The executables use the ``IPUConfig``'s inference options (``inference_replication_factor``,
``inference_device_iterations``, ...); the step tensor has one entry per micro-batch, as optimum-graphcore builds it.

Written against poptorch's documented API and verified against the stand-in in ``tests/ipu``; never run on IPU
hardware. optimum-graphcore unwraps a model that a ``trainingModel`` wraps (``poptorch._impl``, private) before
compiling its generation executables; here the executables wrap the model as the evaluation's inference executable
does, which the stand-in accepts and real poptorch was not seen to.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutput, Seq2SeqLMOutput

__all__ = ["IPUGeneration", "check_generation_options"]

log = logging.getLogger(__name__)

#: optimum-graphcore's generation options of ``IPUConfig.inference_parallelize_kwargs`` and the value that leaves
#: them off; any other value (or key) raises, naming it: this backend has no pipelined generation models.
_PARALLELIZE_DEFAULTS: dict[str, Any] = {
    "use_cache": False,
    "use_encoder_output_buffer": False,
    "on_device_generation_steps": 0,
    "use_cond_encoder": False,
    "use_group_quantized_linears": False,
}


def check_generation_options(inference_parallelize_kwargs: dict[str, Any]) -> None:
    """Raise ``NotImplementedError`` naming each ``inference_parallelize_kwargs`` entry that would change how
    optimum-graphcore generates (KV cache, encoder output buffers, on-device generation, ...): none is implemented."""
    unsupported = {
        key: value
        for key, value in (inference_parallelize_kwargs or {}).items()
        if key not in _PARALLELIZE_DEFAULTS or value != _PARALLELIZE_DEFAULTS[key]
    }
    if unsupported:
        names = ", ".join(f"{key}={value!r}" for key, value in sorted(unsupported.items()))
        raise NotImplementedError(
            f"IPUConfig.inference_parallelize_kwargs: {names} not supported. hflight.ipu generates with the encoder "
            "and one decoder step as inference executables, without KV cache, encoder output buffers, on-device "
            "generation loops or quantized layers (optimum-graphcore's pipelined generation models)."
        )


class _EncoderStep(nn.Module):
    """The encoder executable's module: the encoder's last hidden state for the main input and attention mask."""

    def __init__(self, encoder: nn.Module, input_name: str) -> None:
        super().__init__()
        self.encoder = encoder
        self.input_name = input_name

    def forward(self, inputs: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        kwargs = {self.input_name: inputs, "attention_mask": attention_mask, "return_dict": True}
        return self.encoder(**kwargs).last_hidden_state


class _DecoderStep(nn.Module):
    """The decoder executable's module: one step over a decoder input of fixed length, returning the logits at
    position ``t`` only (``t`` holds one position per micro-batch)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        t: torch.Tensor,
        decoder_input_ids: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        outputs = self.model(
            decoder_input_ids=decoder_input_ids,
            encoder_outputs=BaseModelOutput(last_hidden_state=encoder_hidden_states),
            attention_mask=attention_mask,
            use_cache=False,
            return_dict=True,
        )
        return outputs.logits.index_select(1, t[:1])


@dataclasses.dataclass
class _Executable:
    runner: Any  # the poptorch.PoplarExecutor
    signature: tuple
    synced: bool = True  # whether the device holds the host weights of this evaluation


def _signature(inputs: tuple) -> tuple:
    """What poptorch compiles into an executable: each input's shape and dtype (other values as they are)."""
    return tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x for x in inputs)


class IPUGeneration:
    """The encoder and decoder-step inference executables of one model.

    Args:
        poptorch: the ``poptorch`` module.
        options: returns the ``poptorch.Options`` of an inference executable.
        micro_batches: micro-batches per call of an inference executable (inference replication factor x inference
            device iterations): the length of the step tensor.
    """

    def __init__(self, poptorch: Any, options: Callable[[], Any], micro_batches: int) -> None:
        self.poptorch = poptorch
        self.options = options
        self.micro_batches = micro_batches
        self.executables: dict[str, _Executable] = {}

    def begin(self) -> None:
        """A new evaluation: the host weights may have changed since the executables last received them."""
        for executable in self.executables.values():
            executable.synced = False

    def run(self, role: str, build: Callable[[], nn.Module], inputs: tuple) -> Any:
        """Run the ``role`` executable on ``inputs``; compile it (from ``build()``) for a new static shape."""
        signature = _signature(inputs)
        executable = self.executables.get(role)
        if executable is not None and executable.signature != signature:
            log.info("IPU generation: new %s input shapes %s; compiling a new executable.", role, signature)
            executable.runner.destroy()  # poptorch runs the shapes it compiled; another shape needs another one
            executable = None
        if executable is None:
            runner = self.poptorch.inferenceModel(build().eval(), options=self.options())
            executable = self.executables[role] = _Executable(runner, signature)
        elif not executable.synced and executable.runner.isCompiled():  # compiling uploads the weights anyway
            runner = executable.runner
            if runner.isAttachedToDevice():
                runner.copyWeightsToDevice()
            else:
                runner.attachToDevice()  # attaching uploads the host weights
        executable.synced = True
        return executable.runner(*inputs)

    def step_tensor(self, step: int) -> torch.Tensor:
        """The decoder's position input: ``step`` once per micro-batch."""
        return torch.full((self.micro_batches,), step, dtype=torch.int32)

    def detach(self) -> None:
        """Free the IPUs (the executables stay compiled)."""
        for executable in self.executables.values():
            runner = executable.runner
            if runner.isCompiled() and runner.isAttachedToDevice():
                runner.detachFromDevice()

    def destroy(self) -> None:
        for executable in self.executables.values():
            executable.runner.destroy()
        self.executables.clear()

    def model_for(self, model: nn.Module) -> nn.Module:
        """A view of ``model`` whose ``generate`` runs its forward passes on these executables: the same modules,
        weights, config and generation config (shared, not copied), a class that derives from the model's."""
        if not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
            raise NotImplementedError(
                f"IPUSeq2SeqTrainer generates on the IPU for encoder-decoder models; {type(model).__name__} is not "
                "one (its config has no is_encoder_decoder=True)."
            )
        cls = _view_class(type(model))
        view = cls.__new__(cls)
        view.__dict__.update(model.__dict__)
        view.__dict__.pop("forward", None)  # an instance-level forward would bypass the executables
        view.__dict__.update(_ipu_host=model, _ipu_generation=self, _ipu_decoder_length=None)
        return view


@functools.lru_cache(maxsize=16)  # bounded: a trainingModel gives the model a class of its own per run
def _view_class(base: type) -> type:
    def forward(self: _GenerationView, **kwargs: Any) -> Seq2SeqLMOutput:
        return self._ipu_decode(**kwargs)

    forward.__signature__ = inspect.signature(base.forward)  # transformers validates generate's kwargs by it
    namespace = {"__module__": __name__, "forward": forward}
    return type(f"IPUGeneration{base.__name__}", (_GenerationView, base), namespace)


class _EncoderRunner:
    """What the view's ``get_encoder()`` returns: the encoder's signature, run on the encoder executable."""

    def __init__(self, view: _GenerationView, encoder: nn.Module) -> None:
        self.view, self.encoder = view, encoder

        def forward(**kwargs: Any) -> BaseModelOutput:
            return self.view._ipu_encode(self.encoder, kwargs)

        forward.__signature__ = inspect.signature(encoder.forward)  # transformers filters encoder kwargs by it
        self.forward = forward

    def __call__(self, **kwargs: Any) -> BaseModelOutput:
        return self.forward(**kwargs)


def _unsupported(kwargs: dict[str, Any], allowed: tuple[str, ...]) -> list[str]:
    """The names of ``kwargs`` outside ``allowed`` whose values would matter (not None or False)."""
    return sorted(k for k, v in kwargs.items() if k not in allowed and v is not None and v is not False)


class _GenerationView:
    """Mixed in before the model's class: the forward passes of ``generate`` run on the IPU executables."""

    _ipu_host: nn.Module
    _ipu_generation: IPUGeneration
    _ipu_decoder_length: int | None

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("use_cache") is True:
            raise NotImplementedError(
                "generate(use_cache=True): the IPU decoder executable runs without KV cache (the decoder input "
                "padded to max_length, as optimum-graphcore does without use_cache)."
            )
        kwargs["use_cache"] = False
        return super().generate(*args, **kwargs)

    def get_encoder(self, modality: str | None = None) -> Any:
        encoder = super().get_encoder(modality)
        return encoder if modality is not None else _EncoderRunner(self, encoder)

    def _get_stopping_criteria(self, *args: Any, **kwargs: Any) -> Any:
        # transformers resolves the generation's max_length (max_new_tokens included) for its stopping criteria; the
        # decoder executable's static length is that one, as optimum-graphcore pads to stopping_criteria.max_length.
        criteria = super()._get_stopping_criteria(*args, **kwargs)
        if criteria.max_length is None:
            raise ValueError("IPU generation needs a max_length (or max_new_tokens): the decoder has a fixed length.")
        self.__dict__["_ipu_decoder_length"] = criteria.max_length
        return criteria

    def _ipu_encode(self, encoder: nn.Module, kwargs: dict[str, Any]) -> BaseModelOutput:
        name = self.main_input_name
        # labels reach an encoder whose forward takes **kwargs (transformers passes it what its signature allows);
        # no encoder reads them
        unsupported = _unsupported(kwargs, (name, "attention_mask", "return_dict", "labels"))
        if unsupported:
            raise NotImplementedError(f"IPU generation: the encoder executable does not take {', '.join(unsupported)}.")
        inputs = (kwargs[name], kwargs.get("attention_mask"))
        hidden = self._ipu_generation.run("encoder", lambda: _EncoderStep(encoder, name), inputs)
        return BaseModelOutput(last_hidden_state=hidden)

    def _ipu_decode(
        self,
        decoder_input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        encoder_outputs: Any = None,
        **kwargs: Any,
    ) -> Seq2SeqLMOutput:
        unsupported = _unsupported(kwargs, ("use_cache", "return_dict"))
        if unsupported or decoder_input_ids is None or encoder_outputs is None:
            raise NotImplementedError(
                "IPU generation: the decoder executable takes decoder_input_ids, the encoder outputs and the "
                f"attention mask; got {', '.join(unsupported) or 'no decoder_input_ids or encoder outputs'}."
            )
        length, step = self._ipu_decoder_length, decoder_input_ids.shape[1] - 1
        if length is None or step >= length:
            raise RuntimeError(f"IPU generation: decoder step {step} is outside the static length {length}.")
        pad = self.config.pad_token_id if self.config.pad_token_id is not None else 0
        padded = nn.functional.pad(decoder_input_ids, (0, length - decoder_input_ids.shape[1]), value=pad)
        hidden = encoder_outputs[0]
        generation = self._ipu_generation
        inputs = (generation.step_tensor(step), padded, hidden, attention_mask)
        logits = generation.run("decoder", lambda: _DecoderStep(self._ipu_host), inputs)
        return Seq2SeqLMOutput(logits=logits)
