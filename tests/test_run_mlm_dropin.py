"""run_mlm's number-for-number promise (issue 23): a masked-LM script written the way transformers' run_mlm.py is
(tests/scripts/run_mlm) runs once as written and once with ``from transformers import Trainer`` changed to hflight's,
with the default random sampling, dropout and gradient accumulation. DataCollatorForLanguageModeling draws its masks
from torch's global RNG at every collation, which dropout also draws from, so the numbers match only if batches are
collated in transformers' order (one batch ahead, as accelerate's loader reads): the same losses, gradient norms,
perplexity, accuracy and files."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from . import seq2seq_data

SCRIPTS = Path(__file__).resolve().parent / "scripts" / "run_mlm"
REPO_ROOT = Path(__file__).resolve().parents[1]
ORIGINAL_IMPORT = "from transformers import Trainer\n"
CHANGED_IMPORT = "from hflight import Trainer\n"
TIMINGS = ("_runtime", "_samples_per_second", "_steps_per_second")
HFLIGHT_ONLY = {"checkpoint_manifest.json"}

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]


def _inputs(root: Path) -> dict[str, Path]:
    """Text files of random word sentences and a tiny BERT masked LM (dropout 0.1) saved with its tokenizer."""
    import torch
    from transformers import BertConfig, BertForMaskedLM

    root.mkdir(parents=True)
    rng = random.Random(7)
    paths = {}
    for name, lines in (("train", 60), ("validation", 16)):
        text = "\n".join(" ".join(rng.choice(seq2seq_data.WORDS) for _ in range(rng.randint(5, 12)))
                         for _ in range(lines))  # fmt: skip
        paths[name] = root / f"{name}.txt"
        paths[name].write_text(text + "\n", encoding="utf-8")
    tokenizer = seq2seq_data.tokenizer(root / "tokenizer")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    paths["model"] = root / "model"
    BertForMaskedLM(config).save_pretrained(paths["model"])
    tokenizer.save_pretrained(paths["model"])
    return paths


def _run(folder: Path, inputs: dict[str, Path], change_import: bool) -> Path:
    shutil.copytree(SCRIPTS, folder)
    script = folder / "run_mlm.py"
    source = script.read_text(encoding="utf-8")
    assert source.count(ORIGINAL_IMPORT) == 1
    if change_import:
        script.write_text(source.replace(ORIGINAL_IMPORT, CHANGED_IMPORT), encoding="utf-8")
    command = [
        sys.executable, "run_mlm.py", "--model_name_or_path", str(inputs["model"]),
        "--train_file", str(inputs["train"]), "--validation_file", str(inputs["validation"]),
        "--max_seq_length", "16", "--mlm_probability", "0.3", "--do_train", "--do_eval",
        "--output_dir", str(folder / "out"), "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8",
        "--gradient_accumulation_steps", "2", "--learning_rate", "2e-3", "--num_train_epochs", "2",
        "--logging_steps", "1", "--eval_strategy", "epoch", "--save_steps", "8", "--save_total_limit", "1",
        "--seed", "0", "--report_to", "none", "--disable_tqdm", "true",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "src"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    result = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    (folder / "console.txt").write_text(result.stdout + result.stderr, encoding="utf-8")
    assert result.returncode == 0, f"{folder.name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return folder / "out"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("run_mlm")
    inputs = _inputs(root / "inputs")
    return {
        "transformers": _run(root / "transformers", inputs, change_import=False),
        "hflight": _run(root / "hflight", inputs, change_import=True),
    }


def _json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def test_the_same_logged_numbers_from_the_first_step(runs):
    theirs, ours = (_json(runs[k] / "trainer_state.json")["log_history"] for k in ("transformers", "hflight"))
    assert len(ours) == len(theirs) and sum("loss" in e for e in theirs) >= 10
    for a, b in zip(theirs, ours):
        assert set(a) == set(b)
        for key, value in a.items():
            if not key.endswith(TIMINGS):
                assert b[key] == pytest.approx(value, rel=1e-6, abs=1e-9), (a["step"], key, value, b[key])


def test_the_same_metrics_and_files(runs):
    for name in ("eval_results.json", "train_results.json"):
        theirs, ours = (_json(runs[k] / name) for k in ("transformers", "hflight"))
        assert set(ours) == set(theirs)
        for key, value in theirs.items():
            if not key.endswith(TIMINGS):
                assert ours[key] == pytest.approx(value, rel=1e-6), (name, key)
    assert "perplexity" in _json(runs["hflight"] / "eval_results.json")
    files = {k: {p.relative_to(runs[k]).as_posix() for p in runs[k].rglob("*") if p.is_file()} for k in runs}
    assert {f for f in files["hflight"] if f.rsplit("/", 1)[-1] not in HFLIGHT_ONLY} == files["transformers"]
    assert (runs["hflight"] / "README.md").read_text() == (runs["transformers"] / "README.md").read_text()
