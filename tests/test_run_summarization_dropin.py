"""The drop-in promise for sequence-to-sequence scripts (issue 23): a summarization script written the way
transformers' run_summarization.py is (tests/scripts/run_summarization) runs twice, once as written and once with
its one line ``from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments`` changed to import them from
hflight, and gives the same metrics (ROUGE-style scores, ``gen_len``, losses), the same generated predictions, the
same logged numbers and the same files (``generation_config.json`` included). Training uses the default random
sampling, with dropout; evaluation generates with beam search every epoch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from . import dropin, seq2seq_data

ORIGINAL_IMPORT = "from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments\n"
CHANGED_IMPORT = "from hflight import Seq2SeqTrainer, Seq2SeqTrainingArguments\n"
TIMINGS, HFLIGHT_ONLY = dropin.TIMINGS, dropin.HFLIGHT_ONLY

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("run_summarization")
    inputs = seq2seq_data.summarization_inputs(root / "inputs")
    args = [
        "--model_name_or_path", str(inputs["model"]), "--train_file", str(inputs["train"]),
        "--validation_file", str(inputs["validation"]), "--test_file", str(inputs["test"]),
        "--do_train", "--do_eval", "--do_predict", "--predict_with_generate",
        "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "6",
        "--learning_rate", "1e-3", "--num_train_epochs", "2", "--logging_steps", "1",
        "--save_steps", "5", "--save_total_limit", "2", "--eval_strategy", "epoch",
        "--num_beams", "2", "--val_max_target_length", "10",
    ]  # fmt: skip
    # dropin.run uses one thread: generation is many tiny steps, and threads contending on a shared CPU slow it ~50x.
    return dropin.both(root, "run_summarization", ORIGINAL_IMPORT, CHANGED_IMPORT, args)


def _json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def _without_timings(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.endswith(TIMINGS)}


def test_the_same_metrics_and_predictions(runs):
    for name in ("eval_results.json", "predict_results.json", "train_results.json", "all_results.json"):
        theirs, ours = (_json(runs[k] / name) for k in ("transformers", "hflight"))
        assert set(ours) == set(theirs), name
        assert _without_timings(ours) == _without_timings(theirs), name
    metrics = _json(runs["hflight"] / "eval_results.json")
    assert {"eval_rouge1", "eval_rougeL", "eval_gen_len", "eval_loss"} <= set(metrics)
    predictions = (runs["hflight"] / "generated_predictions.txt").read_text(encoding="utf-8")
    assert predictions == (runs["transformers"] / "generated_predictions.txt").read_text(encoding="utf-8")
    assert len(set(predictions.splitlines())) > 5  # varied generations, not one repeated answer


def test_the_same_logged_numbers(runs):
    theirs, ours = (_json(runs[k] / "trainer_state.json")["log_history"] for k in ("transformers", "hflight"))
    assert len(ours) == len(theirs) and sum("loss" in e for e in theirs) == 12
    for a, b in zip(theirs, ours, strict=True):
        assert set(a) == set(b)
        for key in a:
            if key.endswith(TIMINGS):
                continue
            assert a[key] == b[key], (a["step"], key, a[key], b[key])


def _files(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def test_the_same_files(runs):
    theirs, ours = (_files(runs[k]) for k in ("transformers", "hflight"))
    assert {f for f in ours if f.rsplit("/", 1)[-1] not in HFLIGHT_ONLY} == theirs
    assert "generation_config.json" in theirs and "checkpoint-10/generation_config.json" in theirs
    for name in ("config.json", "generation_config.json", "README.md", "checkpoint-10/generation_config.json"):
        assert (runs["hflight"] / name).read_text() == (runs["transformers"] / name).read_text(), name


def test_training_args_bin_is_transformers_seq2seq_arguments(runs):
    code = (
        "import sys, json, torch; sys.modules['hflight'] = None\n"
        "out = []\n"
        "for name in sys.argv[1:]:\n"
        "    args = torch.load(name, weights_only=False)\n"
        "    d = args.to_dict(); d.pop('output_dir'); d.pop('logging_dir', None)\n"
        "    out.append([type(args).__module__ + '.' + type(args).__name__, d])\n"
        "print(json.dumps(out, default=str))\n"
    )
    files = [str(runs[k] / "training_args.bin") for k in ("transformers", "hflight")]
    result = subprocess.run([sys.executable, "-c", code, *files], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": ""})  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    (theirs_type, theirs), (ours_type, ours) = json.loads(result.stdout)
    assert ours_type == theirs_type == "transformers.training_args_seq2seq.Seq2SeqTrainingArguments"
    assert ours == theirs and ours["predict_with_generate"] is True and ours["generation_num_beams"] == 2


def test_weights_optimizer_and_trainer_state_are_transformers_bit_for_bit(runs):
    assert dropin.assert_same_training_state(runs) >= 4
