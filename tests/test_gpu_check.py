"""benchmarks/gpu_check.py (issue 56, item 5) without a GPU: its code on the CPU at tiny sizes (``--cpu-smoke``), in
this process. The parity machinery (hflight's and transformers' runs of GPT-2, step logs and weights compared), the
device row, the timed rows and the checkpoint stall of the three writers run for real; the main job is a stand-in that
writes its results file where ``hydra.run.dir`` says (the real one takes minutes on a CPU: the script's own path was
run by hand with ``--cpu-smoke``); a parity row that crashes fails the script, any other row's crash does not."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: the main job's stand-in: the F1 it writes says which run it was (bf16 on the CPU: args.bf16=true)
MAIN_JOB = """import json, sys
folder = next(arg.split("=", 1)[1] for arg in sys.argv if arg.startswith("hydra.run.dir="))
if "args.max_steps=2" not in sys.argv:
    sys.exit("the smoke's sizes were not passed")
f1 = 90.5 if "args.bf16=true" in sys.argv else 80.25
json.dump({"eval_f1": f1, "eval_exact_match": 70.0}, open(folder + "/eval_results.json", "w"))
"""


@pytest.fixture
def gpu_check(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    job = tmp_path / "main_job.py"
    job.write_text(MAIN_JOB, "utf-8")
    monkeypatch.setattr(module, "MAIN_JOB", [sys.executable, str(job)])
    return module


def _run(gpu_check, tmp_path, capsys, *argv: str) -> tuple[int, str, dict]:
    report = tmp_path / "table.txt"
    code = gpu_check.main(["--cpu-smoke", "--dir", str(tmp_path), "--report", str(report), *argv])
    out = capsys.readouterr().out
    rows = {row["name"]: row for row in json.loads(report.with_suffix(".json").read_text("utf-8"))}
    assert report.read_text("utf-8") in out  # the table printed is the one written
    return code, out, rows


def test_the_cpu_smoke_runs_every_kind_of_row(gpu_check, tmp_path, capsys):
    code, out, rows = _run(gpu_check, tmp_path, capsys, "--only", "mrc,fp32,perf,checkpoint")
    assert code == 0, out
    assert "GPU check on CPU (--cpu-smoke" in out and "every parity row passed" in out
    # one table: a header line, then a line per row
    assert re.search(r"^row +hflight +transformers +diff / ratio +target +verdict$", out, re.M), out
    fp32 = rows["parity fp32"]
    assert (fp32["verdict"], fp32["diff"], fp32["decides"]) == ("PASS", "identical", True), out
    assert fp32["hflight"] == fp32["transformers"] and fp32["hflight"].startswith("loss "), out
    device = rows["model device after train()"]
    assert (device["hflight"], device["target"], device["verdict"]) == ("cpu", "cpu", "PASS"), out
    assert rows["main job F1, trainer=default"]["hflight"] == "80.25"
    assert rows["main job F1, trainer=gpu_bf16"]["hflight"] == "90.50"
    assert rows["peak GPU memory, GPT-2 train"]["verdict"] == "SKIP"
    for name in ("train step (best of 3)", "evaluate() (best of 3)"):
        assert re.fullmatch(r"\d+\.\d{3}x", rows[name]["diff"]), rows[name]
    for kind, target in (("sync", "<= 1.1x"), ("save_async", "<= 0.15x")):
        row = rows[f"checkpoint stall, {kind}"]
        assert row["target"] == target and re.fullmatch(r"-?\d+\.\d{3} s", row["hflight"]), row
        # (on a busy CPU transformers' stall may measure <= 0: no ratio then)
        assert (row["verdict"] in ("met", "NOT MET") and re.fullmatch(r"-?\d+\.\d{3}x", row["diff"])) or (
            row["verdict"] == row["diff"] == "-"
        ), row
        assert len(re.findall(r"-?\d+\.\d{3}", row["note"].split(";")[0])) == 2, row  # its two mid-run checkpoints
    assert set(rows) == set(gpu_check.LABELS["fp32"] + gpu_check.LABELS["mrc"] + gpu_check.LABELS["perf"]
                            + gpu_check.LABELS["checkpoint"])  # fmt: skip


def test_a_crashed_parity_row_fails_the_script_and_the_table_is_printed(gpu_check, tmp_path, capsys, monkeypatch):
    def crash(check, name):
        raise RuntimeError("first line\nthe last line says why")

    monkeypatch.setitem(gpu_check.RUNNERS, "bf16", crash)
    monkeypatch.setitem(gpu_check.RUNNERS, "perf", crash)
    monkeypatch.setattr(gpu_check, "MAIN_JOB", [sys.executable, "-c", "import sys; sys.exit('no data')"])
    code, out, rows = _run(gpu_check, tmp_path, capsys, "--only", "mrc,bf16,fp16,perf")
    assert code == 1 and "parity failed: parity bf16" in out, out
    assert rows["parity bf16"]["verdict"] == "FAIL" and rows["parity bf16"]["note"] == "the last line says why"
    assert rows["parity fp16 (default optim)"]["verdict"] == "SKIP"  # needs CUDA
    # the other rows' crashes are reported and decide nothing
    assert {rows[label]["verdict"] for label in gpu_check.LABELS["perf"]} == {"ERROR"}
    assert rows["main job F1, trainer=default"]["note"] == "exit status 1: no data"


def test_without_cuda_nothing_runs(gpu_check, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # the script keeps to one device
    assert gpu_check.main(["--only", "fp32"]) == 0
    assert capsys.readouterr().out.startswith("no CUDA device: nothing run")


def test_parity_compares_every_step_and_the_weights(gpu_check):
    import torch

    def run(losses, weight):
        return {"logs": [{"step": i + 1, "loss": v, "grad_norm": 1.0} for i, v in enumerate(losses)],
                "weights": {"w": torch.tensor([weight])}}  # fmt: skip

    same = gpu_check.compare_runs(run([2.0, 1.0], 0.5), run([2.0, 1.0], 0.5), 1e-6)
    assert same["passed"] and same["identical"]
    assert gpu_check.compare_runs(run([2.0, float("nan")], 0.5), run([2.0, float("nan")], 0.5), 0)["passed"]
    loss = gpu_check.compare_runs(run([2.0, 1.00001], 0.5), run([2.0, 1.0], 0.5), 1e-6)
    assert not loss["passed"] and loss["worst"]["loss"] == pytest.approx(1e-5, rel=1e-3)
    assert not gpu_check.compare_runs(run([2.0, 1.0], 0.5 + 1e-5), run([2.0, 1.0], 0.5), 1e-6)["passed"]
    assert not gpu_check.compare_runs(run([2.0], 0.5), run([2.0, 1.0], 0.5), 1e-6)["passed"]  # a step missing
    logged_more = run([2.0], 0.5)
    logged_more["logs"][0]["num_tokens"] = 32.0  # a value one run logs and the other does not
    assert not gpu_check.compare_runs(logged_more, run([2.0], 0.5), 1e-6)["passed"]
