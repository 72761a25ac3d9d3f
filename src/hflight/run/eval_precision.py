"""Reduced-precision evaluation outside ``train()``, and the CPU features each kind needs to be fast.

- ``bf16_full_eval`` / ``fp16_full_eval`` (transformers' fields) cast the model itself before an evaluation outside
  ``train()``, as transformers' ``evaluation_loop`` does (the model keeps that dtype afterwards). On a CPU without
  native instructions for the type (bfloat16: AVX512-BF16 or AMX-BF16; float16: AVX512-FP16 or AMX-FP16) the products
  are emulated, usually slower than float32: a warning says so, and the cast happens as in transformers.
- ``int8_eval`` (hflight's field) evaluates on a copy of the model whose linear layers (``torch.nn.Linear``, and
  transformers' ``Conv1D`` of GPT-2-style models, converted to ``Linear`` first) are quantized dynamically to int8
  (``torch.ao.quantization.quantize_dynamic``: int8 weights, each batch's activations quantized as they come); the
  model itself is untouched, and the copy is kept while the model's tensors do not change. It runs on the CPU, in
  one process, with Lightning's own single-device strategy, for ``evaluate()``/``predict()`` outside ``train()``, and
  is refused elsewhere. Without int8 dot-product instructions (AVX512-VNNI, AVX-VNNI or AMX-INT8) a warning says so
  and the evaluation runs the default float32 model. With AMX-INT8 the weights are packed for oneDNN's kernels.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch

#: the CPU flags (``/proc/cpuinfo``) that make each reduced precision fast: any one of them is enough
CPU_FEATURES: dict[str, tuple[str, ...]] = {
    "bfloat16": ("avx512_bf16", "amx_bf16"),
    "float16": ("avx512_fp16", "amx_fp16"),
    "int8": ("avx512_vnni", "avx_vnni", "amx_int8"),
}

_QUANTIZED: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, torch.nn.Module]] = weakref.WeakKeyDictionary()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The flags of this machine's CPU as Linux lists them (empty where there is no ``/proc/cpuinfo``)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def cpu_supports(kind: str) -> bool:
    """Whether this CPU has one of :data:`CPU_FEATURES` ``[kind]``."""
    return not cpu_flags().isdisjoint(CPU_FEATURES[kind])


def _lacks(kind: str) -> str:
    return f"this CPU has none of {', '.join(CPU_FEATURES[kind])} (/proc/cpuinfo flags)"


def prepare(args: Any, run: Any, model: torch.nn.Module) -> None:
    """Before an evaluation in ``run``: ``int8_eval`` refused where it cannot apply; outside ``train()``, the model
    cast for ``bf16_full_eval``/``fp16_full_eval``."""
    if getattr(args, "int8_eval", False):
        _refuse_int8(args, run)
    if not run.fitting:
        cast_for_full_eval(model, args, run.lightning_trainer.strategy.root_device)


def cast_for_full_eval(model: torch.nn.Module, args: Any, device: torch.device) -> None:
    """``fp16_full_eval``/``bf16_full_eval``: the model in half precision for an evaluation outside ``train()`` (as
    transformers, the model keeps that dtype afterwards); a warning where the CPU computes in that type slowly."""
    dtype = torch.float16 if args.fp16_full_eval else torch.bfloat16 if args.bf16_full_eval else None
    if dtype is None:
        return
    kind = str(dtype).removeprefix("torch.")
    if device.type == "cpu" and not cpu_supports(kind):
        field = "fp16_full_eval" if args.fp16_full_eval else "bf16_full_eval"
        warnings.warn(
            f"{field}: {_lacks(kind)}, so {kind} products are emulated and usually slower than float32; the model is "
            "cast as transformers casts it.",
            stacklevel=4,
        )
    model.to(dtype=dtype)


def refuse_int8_in_training(args: Any) -> None:
    """``int8_eval`` applies to ``evaluate()``/``predict()`` outside ``train()``: a training run that evaluates
    (``eval_strategy``) is refused before it starts."""
    if getattr(args, "int8_eval", False) and str(getattr(args.eval_strategy, "value", args.eval_strategy)) != "no":
        raise ValueError(
            f"int8_eval quantizes a copy of the model for evaluate()/predict() outside train(); the evaluations of "
            f"this training run (eval_strategy={args.eval_strategy!r}) run on the model being trained. Set "
            "eval_strategy='no' and call evaluate() after train(), or leave int8_eval off."
        )


def _refuse_int8(args: Any, run: Any) -> None:
    from lightning.pytorch.strategies import SingleDeviceStrategy

    strategy = run.lightning_trainer.strategy
    reason = None
    if run.fitting:
        reason = "this evaluation runs inside train(), on the model being trained"
    elif getattr(args, "predict_with_generate", False):
        reason = "predict_with_generate generates with the trainer's model (model.generate), not a quantized copy"
    elif args.bf16_full_eval or args.fp16_full_eval:
        reason = "bf16_full_eval/fp16_full_eval is set too: choose one reduced precision"
    elif type(strategy) is not SingleDeviceStrategy:
        reason = f"it runs in one process with Lightning's own single-device strategy, not {type(strategy).__name__}"
    elif strategy.root_device.type != "cpu":
        reason = f"torch's dynamic quantization runs on the CPU, and this evaluation runs on {strategy.root_device}"
    if reason is not None:
        raise ValueError(f"int8_eval cannot apply: {reason}. Leave int8_eval off for this evaluation.")


@contextlib.contextmanager
def int8_evaluation_model(args: Any, model: torch.nn.Module) -> Iterator[torch.nn.Module | None]:
    """With ``args.int8_eval`` (checked by :func:`prepare`): the model's int8 copy for this evaluation (None, with a
    warning, on a CPU without int8 dot-product instructions); otherwise None."""
    if not getattr(args, "int8_eval", False):
        yield None
        return
    if not cpu_supports("int8"):
        warnings.warn(f"int8_eval: {_lacks('int8')}; evaluating the float32 model instead.", stacklevel=5)
        yield None
        return
    yield quantized_copy(model)


def _tensors_key(model: torch.nn.Module) -> tuple:
    return tuple((id(t), t._version, t.data_ptr(), t.dtype) for t in model.state_dict(keep_vars=True).values())


def quantized_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` (in eval mode) with its linear layers dynamically quantized to int8; the same copy again
    while the model's parameters and buffers are the same tensors, unchanged."""
    key = _tensors_key(model)
    cached = _QUANTIZED.get(model)
    if cached is not None and cached[0] == key:
        return cached[1]
    quantize_dynamic = _quantize_dynamic()
    copied = copy.deepcopy(model).eval()
    _conv1d_to_linear(copied)
    engine = "onednn" if "amx_int8" in cpu_flags() and "onednn" in torch.backends.quantized.supported_engines else None
    with _quantized_engine(engine), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notices: nothing a user can act on
        quantized = quantize_dynamic(copied, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
    _QUANTIZED[model] = (key, quantized)
    return quantized


def _quantize_dynamic() -> Any:
    try:
        from torch.ao.quantization import quantize_dynamic
    except ImportError as error:  # a future torch without torch.ao.quantization
        raise ImportError(
            f"int8_eval needs torch.ao.quantization.quantize_dynamic, which torch {torch.__version__} does not have. "
            "Leave int8_eval off, or use bf16_full_eval."
        ) from error
    return quantize_dynamic


@contextlib.contextmanager
def _quantized_engine(engine: str | None) -> Iterator[None]:
    previous = torch.backends.quantized.engine
    if engine is not None:
        torch.backends.quantized.engine = engine
    try:
        yield
    finally:
        torch.backends.quantized.engine = previous


def _conv1d_to_linear(model: torch.nn.Module) -> None:
    """transformers' ``Conv1D`` (GPT-2's projections: ``x @ weight + bias``) as the equivalent ``torch.nn.Linear``,
    in place, so that quantization finds it."""
    from transformers.pytorch_utils import Conv1D

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is Conv1D:
                weight = child.weight.detach()
                linear = torch.nn.Linear(weight.shape[0], weight.shape[1], bias=child.bias is not None)
                linear = linear.to(device=weight.device, dtype=weight.dtype)
                with torch.no_grad():
                    linear.weight.copy_(weight.t())
                    if child.bias is not None:
                        linear.bias.copy_(child.bias)
                setattr(parent, name, linear)
