"""ONNX Runtime never answers differently from eager PyTorch in silence (issue 17): outputs compared with eager after
every export, tracer warnings reported once, unexportable operators named."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from hflight import Trainer, TrainingArguments
from hflight.ort import ORTStrategy
from hflight.ort.checks import ORTExportError, ORTMismatchError, check_outputs
from hflight.ort.strategy import evaluation_sessions

pytest.importorskip("onnxruntime", reason="ONNX Runtime evaluation needs: pip install 'hflight[ort]'")

COMMON = dict(per_device_eval_batch_size=4, report_to="none", save_strategy="no", disable_tqdm=True, accelerator="cpu")


class BranchyModel(nn.Module):
    """Python control flow on tensor values: the tracer records the branch its batch takes, and nothing else."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(200, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.embed(input_ids).mean(dim=1)
        if input_ids.sum() > 1000:  # e.g. a long-input path
            hidden = hidden * 4 + 1
        return {"logits": self.head(hidden)}


class EighModel(nn.Module):
    """An operator ONNX cannot express (torch.linalg.eigh)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(200, 4)

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.embed(input_ids)
        return {"logits": torch.linalg.eigh(hidden.transpose(1, 2) @ hidden).eigenvalues}


class Rows(Dataset):
    """Batches of 4 rows: ``lengths[i]`` tokens of value ``values[i]`` for the i-th batch."""

    def __init__(self, lengths: list[int], values: list[int]) -> None:
        self.rows = [torch.full((n,), v) for n, v in zip(lengths, values) for _ in range(4)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i]}


def predict(model: nn.Module, dataset: Dataset, tmp_path, strategy="ort") -> np.ndarray:
    args = TrainingArguments(str(tmp_path / "out"), **COMMON, strategy=strategy)
    return Trainer(model, args).predict(dataset).predictions


def test_a_branch_the_trace_did_not_record_stops_with_the_largest_difference(tmp_path, caplog):
    """The first batch (sum 8 x 4 = 32) is traced down the short branch; the second batch (16 tokens of 100: sum
    1600) takes the other one in eager PyTorch. Unchecked, ORT returned the short branch's logits for it."""
    dataset = Rows(lengths=[8, 16], values=[4, 100])
    eager = predict(BranchyModel(), dataset, tmp_path, strategy="auto")
    unchecked = predict(BranchyModel(), dataset, tmp_path, strategy=ORTStrategy(check_outputs=False))
    np.testing.assert_allclose(unchecked[:4], eager[:4], atol=1e-5)
    assert np.abs(unchecked[4:] - eager[4:]).max() > 1  # the silent failure of issue 17
    with caplog.at_level(logging.WARNING, logger="hflight.ort.checks"):
        with pytest.raises(ORTMismatchError) as raised:
            predict(BranchyModel(), dataset, tmp_path)
    message = str(raised.value)
    largest = np.abs(unchecked[4:] - eager[4:]).max()
    assert "for BranchyModel: the largest difference in logits is" in message
    assert f"{largest:.4g}" in message and "{'input_ids': (4, 16)}" in message
    assert "ort_inference=False" in message and "inference_with_ort=False" in message
    (warning,) = [r.getMessage() for r in caplog.records if "tracer warning" in r.getMessage()]
    assert f"{__file__}:" in warning and "Converting a tensor to a Python boolean" in warning


def test_tracer_warnings_are_reported_once(tmp_path, caplog):
    class ReportedOnce(BranchyModel):  # a class of its own: reports are kept per model class and warning site
        pass

    model = ReportedOnce()
    dataset = Rows(lengths=[8], values=[4])
    with caplog.at_level(logging.WARNING, logger="hflight.ort.checks"):
        predict(model, dataset, tmp_path)
        with torch.no_grad():
            model.head.bias.add_(1.0)  # new weights: exported again, same warnings
        predict(model, dataset, tmp_path)
    (session,) = evaluation_sessions(model)
    assert session.export_count == 2
    (report,) = [r.getMessage() for r in caplog.records if "tracer warning" in r.getMessage()]
    assert report.startswith("Tracing ReportedOnce for ONNX Runtime gave 1 tracer warning(s)")


def test_every_new_input_shape_is_checked_once(factory, tmp_path):
    """Dynamic padding: each new sequence length gets one eager comparison, the traced batch reuses the export's eager
    outputs; after a re-export (new weights) only the traced batch is compared again: a branch on shapes is the same
    in every export, so known lengths are not compared again."""
    model = factory.cls_model()
    dataset = Rows(lengths=[8, 12, 8, 12, 20], values=[5, 6, 7, 8, 9])
    ort = predict(model, dataset, tmp_path)
    eager = predict(model, dataset, tmp_path, strategy="auto")
    np.testing.assert_allclose(ort, eager, atol=1e-4)
    (session,) = evaluation_sessions(model)
    assert (session.export_count, session.check_count) == (1, 3)
    predict(model, dataset, tmp_path)
    assert session.check_count == 3  # same export, shapes already compared
    with torch.no_grad():
        model.classifier.bias.add_(0.5)
    predict(model, dataset, tmp_path)
    assert (session.export_count, session.check_count) == (2, 4)
    predict(model, Rows(lengths=[16], values=[5]), tmp_path)
    assert session.check_count == 5


def test_quantized_sessions_check_their_float32_graph(factory, tmp_path):
    """int8 weights differ from eager by design; the graph that was traced is the float32 one, and it is checked."""
    model = factory.cls_model()
    predict(model, Rows(lengths=[8, 12], values=[5, 6]), tmp_path, strategy=ORTStrategy(quantize="dynamic"))
    (session,) = evaluation_sessions(model)
    assert session.check_count == 2 and session._reference is not session.session


def test_an_operator_onnx_cannot_express_is_named_once(tmp_path, monkeypatch):
    dumped = []  # torch's ONNX log, which prints the whole graph to stderr when an export fails
    monkeypatch.setattr(torch._C, "_jit_onnx_log", lambda *args: dumped.append(args))
    with pytest.raises(ORTExportError) as raised:
        predict(EighModel(), Rows(lengths=[6], values=[3]), tmp_path)
    message = str(raised.value)
    assert message.startswith("EighModel cannot be evaluated through ONNX Runtime: it uses the operator aten::linalg_")
    assert "ORTStrategy(inference=False) or strategy='auto'" in message
    assert dumped == []  # no "Torch IR graph at exception: ..." dump before the one message


def test_the_tolerance_scales_with_the_output():
    eager = {"logits": torch.tensor([[20.0, -3.0, 0.0]])}
    shapes = {"input_ids": (1, 4)}
    assert check_outputs("M", eager, {"logits": eager["logits"] + 1.9e-3}, shapes) == pytest.approx(1.9e-3, rel=1e-2)
    with pytest.raises(ORTMismatchError, match="largest difference in logits is 0.01"):
        check_outputs("M", eager, {"logits": eager["logits"] + torch.tensor([[0.0, 0.0, 0.01]])}, shapes)
    nan = {"logits": torch.tensor([[float("nan"), 1.0]])}
    assert check_outputs("M", nan, {"logits": nan["logits"].clone()}, shapes) == 0.0  # NaN where eager has NaN
    with pytest.raises(ORTMismatchError):
        check_outputs("M", {"logits": torch.tensor([[0.5, 1.0]])}, nan, shapes)


def test_check_outputs_all_catches_a_value_branch_at_a_shape_already_compared(tmp_path):
    """Three batches of one shape: the first (traced, sum 32) and second (sum 64) take the short branch, the third
    (sum 4800) the other one in eager PyTorch. Comparing the first batch of each shape (the default) cannot see it;
    check_outputs="all" (or 3 batches per shape) stops on it. Its cost: one eager forward per compared batch."""
    dataset = Rows(lengths=[8, 8, 8], values=[4, 8, 150])
    eager = predict(BranchyModel(), dataset, tmp_path, strategy="auto")
    default = predict(BranchyModel(), dataset, tmp_path)  # first batch of the shape only: passes, silently wrong
    assert np.abs(default[8:] - eager[8:]).max() > 1
    for every in ("all", 3):
        with pytest.raises(ORTMismatchError, match="for BranchyModel: the largest difference in logits"):
            predict(BranchyModel(), dataset, tmp_path, strategy=ORTStrategy(check_outputs=every))
    model = BranchyModel()
    predict(model, Rows(lengths=[8, 8, 8], values=[4, 5, 6]), tmp_path, strategy=ORTStrategy(check_outputs=2))
    (session,) = evaluation_sessions(model)
    assert session.check_count == 2  # the traced batch, then one more of that shape
    with pytest.raises(ValueError, match="check_outputs must be"):
        ORTStrategy(check_outputs="some")
