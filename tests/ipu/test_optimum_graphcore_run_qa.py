"""An optimum-graphcore user's script through hflight.ipu (issue 16): a QA fine-tuning script written the way
optimum-graphcore's examples/question-answering/run_qa.py is written (tests/ipu/scripts/run_qa, its optimum.graphcore
imports changed to hflight.ipu) runs in a child process against the poptorch test double, with an ``ipu_config.json``
beside the model as Graphcore publishes them. The simulated device must receive what that file asks for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "scripts" / "run_qa" / "run_qa.py"
RUNNER = HERE / "double_runner.py"
REPO_ROOT = HERE.parents[1]

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

# As Graphcore publishes them (optimum's version stamp, a key of a model config that optimum-graphcore ignores).
IPU_CONFIG = {
    "replication_factor": 2,
    "inference_replication_factor": 1,
    "gradient_accumulation_steps": 4,
    "device_iterations": 2,
    "inference_device_iterations": 3,
    "layers_per_ipu": [-1],
    "ipus_per_replica": 1,
    "output_mode": "final",
    "optimizer_state_offchip": True,
    "executable_cache_dir": "./exe_cache",
    "embedding_serialization_factor": 1,
    "seed": 42,
    "optimum_version": "1.6.1",
    "return_dict": True,
}
MICRO_TRAIN, MICRO_EVAL, SEED = 2, 2, 7


@pytest.fixture(scope="module")
def run(tmp_path_factory, factory) -> dict[str, Path]:
    """The script run once: its inputs (synthetic SQuAD as the script reads it, a tiny BERT saved with its tokenizer
    and ipu_config.json), its output folder, its console and the device record."""
    root = tmp_path_factory.mktemp("ipu_run_qa")
    paths = factory.run_qa_inputs(root, dropout=0.1)
    model_dir = paths["model"]
    (model_dir / "ipu_config.json").write_text(json.dumps(IPU_CONFIG), encoding="utf-8")
    out, record = root / "out", root / "device.json"
    command = [
        sys.executable, str(RUNNER), str(record), str(SCRIPT),
        "--model_name_or_path", str(model_dir), "--train_file", str(paths["train"]),
        "--validation_file", str(paths["validation"]), "--do_train", "--do_eval", "--output_dir", str(out),
        "--max_seq_length", "96", "--doc_stride", "32", "--num_train_epochs", "1",
        "--per_device_train_batch_size", str(MICRO_TRAIN), "--per_device_eval_batch_size", str(MICRO_EVAL),
        "--learning_rate", "1e-4", "--loss_scaling", "16", "--pad_on_batch_axis", "--logging_steps", "1",
        "--seed", str(SEED), "--report_to", "none", "--disable_tqdm", "true", "--dataloader_drop_last",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    (root / "console.txt").write_text(result.stdout + result.stderr, encoding="utf-8")
    return {"root": root, "out": out, "record": record, "returncode": result.returncode,
            "console": result.stdout[-3000:] + result.stderr[-5000:]}  # fmt: skip


def _executors(run: dict) -> tuple[dict, list[dict]]:
    assert run["record"].is_file(), run["console"]
    record = json.loads(run["record"].read_text())
    training = [e for e in record if e["training"]]
    inference = [e for e in record if not e["training"] and e["calls"]]
    assert len(training) == 1 and training[0]["calls"], run["console"]
    assert inference, run["console"]
    return training[0], inference


def test_the_training_executable_gets_what_ipu_config_json_asks_for(run):
    training, _ = _executors(run)
    assert training["replication_factor"] == IPU_CONFIG["replication_factor"]
    assert training["gradient_accumulation"] == IPU_CONFIG["gradient_accumulation_steps"]
    assert training["device_iterations"] == IPU_CONFIG["device_iterations"]
    assert training["random_seed"] == SEED  # optimum-graphcore sets the config's seed from the training arguments
    calls = dict((name, args) for name, args in training["option_calls"])
    assert calls["enableExecutableCaching"] == [repr(IPU_CONFIG["executable_cache_dir"])]
    per_call = IPU_CONFIG["replication_factor"] * IPU_CONFIG["gradient_accumulation_steps"]
    per_call *= IPU_CONFIG["device_iterations"]
    for call in training["calls"]:  # every call: one combined batch, device_iterations optimizer steps
        assert call["input_shapes"]["input_ids"] == [MICRO_TRAIN * per_call, 96]
        assert call["micro_batches"] == per_call and call["steps"] == IPU_CONFIG["device_iterations"]


def test_evaluation_gets_the_inference_values_and_every_window(run):
    _, inference = _executors(run)
    combined = MICRO_EVAL * IPU_CONFIG["inference_replication_factor"] * IPU_CONFIG["inference_device_iterations"]
    for executor in inference:
        assert executor["replication_factor"] == IPU_CONFIG["inference_replication_factor"]
        assert executor["device_iterations"] == IPU_CONFIG["inference_device_iterations"]
        assert executor["gradient_accumulation"] == 1
        assert {tuple(c["input_shapes"]["input_ids"]) for c in executor["calls"]} == {(combined, 96)}  # padded
    results = json.loads((run["out"] / "eval_results.json").read_text())
    assert {"eval_exact_match", "eval_f1"} <= set(results)
    predictions = json.loads((run["out"] / "eval_predictions.json").read_text())
    questions = json.loads((run["root"] / "validation.json").read_text())["data"]
    assert len(predictions) == len(questions)  # pad_on_batch_axis: every window scored once, no question lost


def test_the_saved_ipu_config_is_the_one_used(run):
    saved = json.loads((run["out"] / "ipu_config.json").read_text())
    expected = {k: v for k, v in IPU_CONFIG.items() if k not in ("optimum_version", "return_dict")}
    assert {k: saved[k] for k in expected} == {**expected, "seed": SEED}
    assert "return_dict" not in saved


def test_the_script_runs_to_its_end(run):
    """Needs the rebuilt hflight.TrainingArguments (push_to_hub and the other hub fields) and Trainer's
    create_model_card: the script ends with ``if training_args.push_to_hub: ... else: trainer.create_model_card()``."""
    assert run["returncode"] == 0, run["console"]
    assert (run["out"] / "README.md").is_file()
