"""The drop-in promise on a real client (issue 16): a QA fine-tuning script written the way transformers'
run_qa.py is written (tests/scripts/run_qa) runs twice, once as written and once with the single line
``from transformers import Trainer`` in trainer_qa.py changed to ``from hflight import Trainer``, and gives the same
metrics, the same logged numbers and the same files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from . import dropin
from .support import HFLIGHT_ONLY

SCRIPTS = Path(__file__).resolve().parent / "scripts" / "run_qa"
REPO_ROOT = Path(__file__).resolve().parents[1]
ORIGINAL_IMPORT = "from transformers import Trainer\n"
CHANGED_IMPORT = "from hflight import Trainer\n"

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]


@pytest.fixture(scope="module")
def qa_inputs(tmp_path_factory, factory) -> dict[str, Path]:
    """Synthetic SQuAD data as run_qa.py reads it, and a tiny BERT QA model (no dropout) with a locally trained
    tokenizer, saved with save_pretrained (run_qa.py loads it with from_pretrained)."""
    return factory.run_qa_inputs(tmp_path_factory.mktemp("run_qa_inputs"), dropout=0.0)


def _run(tmp_path: Path, name: str, inputs: dict[str, Path], change_import: bool) -> Path:
    folder = tmp_path / name
    shutil.copytree(SCRIPTS, folder)
    trainer_qa = folder / "trainer_qa.py"
    source = trainer_qa.read_text(encoding="utf-8")
    assert source.count(ORIGINAL_IMPORT) == 1
    if change_import:
        trainer_qa.write_text(source.replace(ORIGINAL_IMPORT, CHANGED_IMPORT), encoding="utf-8")
    out = folder / "out"
    command = [
        sys.executable, "run_qa.py",
        "--model_name_or_path", str(inputs["model"]),
        "--train_file", str(inputs["train"]), "--validation_file", str(inputs["validation"]),
        "--do_train", "--do_eval", "--output_dir", str(out),
        "--max_seq_length", "96", "--doc_stride", "32",
        "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "16",
        "--learning_rate", "3e-4", "--num_train_epochs", "2", "--warmup_steps", "0.1", "--weight_decay", "0.01",
        "--logging_steps", "1", "--save_steps", "10", "--save_total_limit", "2", "--eval_strategy", "epoch",
        "--train_sampling_strategy", "sequential", "--seed", "0", "--report_to", "none", "--disable_tqdm", "true",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    result = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    (folder / "console.txt").write_text(result.stdout + result.stderr, encoding="utf-8")
    assert result.returncode == 0, f"{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return folder


@pytest.fixture(scope="module")
def runs(qa_inputs, tmp_path_factory) -> dict[str, Path]:
    tmp_path = tmp_path_factory.mktemp("run_qa")
    return {
        "transformers": _run(tmp_path, "transformers", qa_inputs, change_import=False),
        "hflight": _run(tmp_path, "hflight", qa_inputs, change_import=True),
    }


def _json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def test_the_same_metrics(runs):
    theirs, ours = (_json(runs[k] / "out" / "eval_results.json") for k in ("transformers", "hflight"))
    assert set(ours) == set(theirs)
    timings = {"eval_runtime", "eval_samples_per_second", "eval_steps_per_second"}
    assert {k: v for k, v in ours.items() if k not in timings} == {k: v for k, v in theirs.items() if k not in timings}
    assert ours["eval_f1"] > 0 and ours["eval_samples"] == 66
    assert _json(runs["hflight"] / "out" / "eval_predictions.json") == _json(
        runs["transformers"] / "out" / "eval_predictions.json"
    )


def test_the_same_logged_numbers(runs):
    theirs, ours = (_json(runs[k] / "out" / "trainer_state.json")["log_history"] for k in ("transformers", "hflight"))
    steps = [e for e in theirs if "loss" in e]
    assert len(steps) > 10
    assert [e["step"] for e in ours if "loss" in e] == [e["step"] for e in steps]
    for a, b in zip(steps, (e for e in ours if "loss" in e)):
        for key in ("loss", "grad_norm", "learning_rate", "epoch"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
    evaluations = [[e for e in history if "eval_f1" in e] for history in (theirs, ours)]
    assert [e["eval_f1"] for e in evaluations[1]] == [e["eval_f1"] for e in evaluations[0]]


def _files(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


# hflight's own addition to every checkpoint folder (README "Checkpoints you can trust").


def test_the_same_files(runs):
    theirs, ours = (_files(runs[k] / "out") for k in ("transformers", "hflight"))
    assert {f for f in ours if f.rsplit("/", 1)[-1] not in HFLIGHT_ONLY} == theirs
    for name in ("config.json", "README.md"):
        assert (runs["hflight"] / "out" / name).read_text() == (runs["transformers"] / "out" / name).read_text()
    assert _json(runs["hflight"] / "out" / "config.json")["use_cache"] is False


def test_training_args_bin_is_transformers_and_loads_without_hflight(runs):
    """training_args.bin holds a transformers.TrainingArguments: a process where hflight cannot be imported loads it
    and finds the same arguments as transformers' own file."""
    code = (
        "import sys, json, torch; sys.modules['hflight'] = None\n"
        "out = {}\n"
        "for name in sys.argv[1:]:\n"
        "    args = torch.load(name, weights_only=False)\n"
        "    d = args.to_dict(); d.pop('output_dir'); d.pop('logging_dir', None)\n"
        "    out[name] = [type(args).__module__ + '.' + type(args).__name__, d]\n"
        "print(json.dumps(out, default=str))\n"
    )
    files = [str(runs[k] / "out" / "training_args.bin") for k in ("transformers", "hflight")]
    result = subprocess.run([sys.executable, "-c", code, *files], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": ""})  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout)
    (theirs_type, theirs), (ours_type, ours) = loaded[files[0]], loaded[files[1]]
    assert ours_type == theirs_type == "transformers.training_args.TrainingArguments"
    assert ours == theirs


def test_the_console_shows_transformers_info_lines(runs):
    console = (runs["hflight"] / "console.txt").read_text(encoding="utf-8")
    for line in ("***** Running training *****", "  Num examples = ", "  Total optimization steps = ",
                 "Saving model checkpoint to ", "Training completed.", "***** Running Evaluation *****",
                 "don't have a corresponding argument in `BertForQuestionAnswering.forward`"):  # fmt: skip
        assert line in console, line


def test_weights_optimizer_and_trainer_state_are_transformers_bit_for_bit(runs):
    assert dropin.assert_same_training_state({k: runs[k] / "out" for k in runs}) >= 4
