"""ONNX Runtime evaluation is checked, not trusted: what can make an exported graph answer differently from the model,
and how hflight says so.

- **Outputs compared with eager PyTorch.** The TorchScript exporter records one run of the model: Python control flow
  on tensor values (``if input_ids.sum() > 1000:``), or on shapes, is frozen into the branch that run took.
  :class:`~hflight.ort.session.ORTEvaluationModel` compares the session with the eager model on the traced batch of
  every export and on the first batch of each input shape (sequence length) it has not compared before: a branch on
  shapes is the same in every export of a model, so a shape is compared once, not once per export.
  :func:`check_outputs` raises :class:`ORTMismatchError`, naming the model, the output and the largest difference,
  when any value differs by more than :data:`TOLERANCES` allow.
- **Tracer warnings kept.** The exporter's ``TracerWarning``s name the lines where the trace may be incomplete; they
  are reported once per model class and warning site (:func:`report_tracer_warnings`), not silenced.
- **Operators ONNX cannot express** (``torch.linalg.eigh``, ...) give one :class:`ORTExportError` naming the
  operator and saying how to evaluate eagerly (:func:`unsupported_operator`), instead of torch's graph dump.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hflight._util import exception_chain

log = logging.getLogger(__name__)

__all__ = [
    "EAGER_ADVICE",
    "ORTExportError",
    "ORTMismatchError",
    "TOLERANCES",
    "Tolerance",
    "check_outputs",
    "check_tokens",
    "quiet_graph_dump",
    "report_tracer_warnings",
    "unsupported_operator",
]

#: How to evaluate without ONNX Runtime, for every error of this module.
EAGER_ADVICE = (
    "Evaluate in eager PyTorch instead: ORTTrainingArguments(ort_inference=False) or "
    "trainer.evaluate(inference_with_ort=False) with ORTTrainer; ORTStrategy(inference=False) or strategy='auto' "
    "with hflight.Trainer."
)


class ORTMismatchError(ValueError):
    """ONNX Runtime's outputs differ from eager PyTorch's on a real batch by more than the tolerance."""


class ORTExportError(ValueError):
    """The model cannot be exported to ONNX (an operator ONNX cannot express)."""


@dataclass(frozen=True)
class Tolerance:
    """``|ort - eager| <= atol * max(1, max|eager|) + rtol * |eager|``, elementwise: an absolute term that follows the
    scale of the whole output (rounding grows with the magnitudes inside the model) plus a relative one."""

    atol: float
    rtol: float

    def allowed(self, eager: np.ndarray) -> np.ndarray:
        finite = np.abs(eager[np.isfinite(eager)])
        scale = max(1.0, float(finite.max())) if finite.size else 1.0
        return self.atol * scale + self.rtol * np.abs(eager)


#: The eager output's dtype -> the tolerance of the check. float32: exported graphs differed from eager by at most
#: 7e-6 on real MiniLM SQuAD windows (ORT's fused kernels reorder sums); a branch the trace did not record differs by
#: whole units.
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(atol=1e-4, rtol=1e-3),
    torch.float64: Tolerance(atol=1e-6, rtol=1e-6),
    torch.float16: Tolerance(atol=1e-2, rtol=1e-2),
    torch.bfloat16: Tolerance(atol=5e-2, rtol=5e-2),
}


def check_outputs(
    model_name: str, eager: Mapping[str, torch.Tensor], ort: Mapping[str, torch.Tensor], shapes: dict[str, tuple]
) -> float:
    """Raise :class:`ORTMismatchError` unless every ``ort`` output matches ``eager``'s within :data:`TOLERANCES`;
    returns the largest absolute difference (``shapes``: the batch's input shapes, for the message)."""
    largest, where = 0.0, None
    for name, ort_value in ort.items():
        reference = eager[name].detach()
        tolerance = TOLERANCES.get(reference.dtype, TOLERANCES[torch.float32])
        expected = reference.float().cpu().numpy()
        actual = ort_value.detach().float().cpu().numpy()
        if expected.shape != actual.shape:
            raise ORTMismatchError(
                f"ONNX Runtime's {name} for {model_name} has shape {actual.shape}, eager PyTorch's {expected.shape} "
                f"(inputs {shapes}). {EAGER_ADVICE}"
            )
        same_nan = np.isnan(expected) == np.isnan(actual)
        difference = np.abs(np.nan_to_num(actual - expected, nan=0.0, posinf=np.inf, neginf=np.inf))
        difference = np.where(same_nan, difference, np.inf)
        exceeded = difference > tolerance.allowed(expected)
        worst = float(difference.max()) if difference.size else 0.0
        if exceeded.any():
            raise ORTMismatchError(
                f"ONNX Runtime answers differently from eager PyTorch for {model_name}: the largest difference in "
                f"{name} is {worst:.4g} ({int(exceeded.sum())} of {exceeded.size} values beyond the tolerance "
                f"{tolerance.atol:g} x max(1, max|eager|) + {tolerance.rtol:g} x |eager|) on a batch with inputs "
                f"{shapes}. The exported graph computes something else than the model: typically Python control "
                f"flow on tensor values or shapes that the exporter recorded for one branch only (see its tracer "
                f"warnings). {EAGER_ADVICE}"
            )
        if worst > largest:
            largest, where = worst, name
    log.debug("ORT check of %s on %s: largest difference %.3g (%s)", model_name, shapes, largest, where)
    return largest


def check_tokens(model_name: str, eager: torch.Tensor, ort: torch.Tensor, batch: int, shapes: dict[str, tuple]) -> None:
    """Raise :class:`ORTMismatchError` unless the token ids generated through ONNX Runtime equal eager generation's,
    naming the generate call (``batch``, counted from 1), the row and the first differing position."""
    expected, actual = eager.detach().cpu(), ort.detach().cpu()
    for row in range(max(len(expected), len(actual))):
        if row >= len(expected) or row >= len(actual):
            raise ORTMismatchError(
                f"ONNX Runtime generated {len(actual)} sequences for {model_name}, eager PyTorch {len(expected)}, on "
                f"batch {batch} (inputs {shapes}). {EAGER_ADVICE}"
            )
        ours, theirs = actual[row].tolist(), expected[row].tolist()
        if ours == theirs:
            continue
        position = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        raise ORTMismatchError(
            f"ONNX Runtime generates other tokens than eager PyTorch for {model_name}: batch {batch} (inputs "
            f"{shapes}), row {row}, first difference at position {position}: ONNX Runtime {_token(ours, position)}, "
            f"eager {_token(theirs, position)} ({len(ours)} and {len(theirs)} tokens). The exported encoder or "
            f"decoder computes something else than the model (see the exporter's tracer warnings). {EAGER_ADVICE}"
        )


def _token(tokens: list[int], position: int) -> int | str:
    return tokens[position] if position < len(tokens) else "(end)"


# ---- tracer warnings --------------------------------------------------------------------------------------------
_REPORTED: set[tuple[str, str]] = set()


def report_tracer_warnings(model_name: str, notes: list[str]) -> None:
    """Log the exporter's tracer warnings (``"file:line: message"``) once per model class and site."""
    fresh = [note for note in dict.fromkeys(notes) if (model_name, note) not in _REPORTED]
    if not fresh:
        return
    _REPORTED.update((model_name, note) for note in fresh)
    lines = "\n".join(f"  {note}" for note in fresh)
    log.warning(
        "Tracing %s for ONNX Runtime gave %d tracer warning(s): Python values the graph holds as constants, so it may "
        "follow one branch only. hflight compares ONNX Runtime's outputs with eager PyTorch's on the first batch of "
        "every input shape and stops on a difference.\n%s",
        model_name,
        len(fresh),
        lines,
    )


def tracer_note(warning: warnings.WarningMessage) -> str:
    """``"file:line: first line of the message"`` of a recorded warning."""
    message = str(warning.message).strip().splitlines()[0]
    return f"{warning.filename}:{warning.lineno}: {message}"


# ---- operators ONNX cannot express ----------------------------------------------------------------------------------
_OPERATOR_PATTERNS = (
    re.compile(r"Exporting the operator '([^']+)' to ONNX opset version (\d+) is not supported"),  # TorchScript
    re.compile(r"No ONNX function found for <OpOverload\(op='([^']+)'"),  # dynamo
)


def unsupported_operator(error: BaseException, model_name: str, exporter: str, opset: int) -> ORTExportError | None:
    """The one error to raise for an export that failed on an operator ONNX cannot express, or None when ``error``
    is something else."""
    text = "\n".join(str(e) for e in exception_chain(error))
    for pattern in _OPERATOR_PATTERNS:
        match = pattern.search(text)
        if match:
            operator = match.group(1)
            return ORTExportError(
                f"{model_name} cannot be evaluated through ONNX Runtime: it uses the operator {operator}, which the "
                f"{exporter} exporter cannot express in ONNX (opset {opset}). {EAGER_ADVICE}"
            )
    return None


@contextlib.contextmanager
def quiet_graph_dump() -> Iterator[None]:
    """Keep the TorchScript exporter's "Torch IR graph at exception" dump off stderr (torch 2.13 turns its ONNX log
    on for every export); the failure itself still raises."""
    c_module: Any = torch._C
    original = getattr(c_module, "_jit_onnx_log", None)
    if original is None:
        yield
        return
    c_module._jit_onnx_log = lambda *args: None
    try:
        yield
    finally:
        c_module._jit_onnx_log = original
