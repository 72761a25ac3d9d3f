"""run_mlm's number-for-number promise (issue 23): a masked-LM script written the way transformers' run_mlm.py is
(tests/scripts/run_mlm) runs once as written and once with ``from transformers import Trainer`` changed to hflight's,
with the default random sampling, dropout and gradient accumulation. DataCollatorForLanguageModeling draws its masks
from torch's global RNG at every collation, which dropout also draws from, so the numbers match only if batches are
collated in transformers' order (one batch ahead, as accelerate's loader reads): the same losses, gradient norms,
perplexity, accuracy and files."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from . import dropin, seq2seq_data

ORIGINAL_IMPORT = "from transformers import Trainer\n"
CHANGED_IMPORT = "from hflight import Trainer\n"
TIMINGS, HFLIGHT_ONLY = dropin.TIMINGS, dropin.HFLIGHT_ONLY

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


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("run_mlm")
    inputs = _inputs(root / "inputs")
    args = [
        "--model_name_or_path", str(inputs["model"]),
        "--train_file", str(inputs["train"]), "--validation_file", str(inputs["validation"]),
        "--max_seq_length", "16", "--mlm_probability", "0.3", "--do_train", "--do_eval",
        "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8",
        "--gradient_accumulation_steps", "2", "--learning_rate", "2e-3", "--num_train_epochs", "2",
        "--logging_steps", "1", "--eval_strategy", "epoch", "--save_steps", "8", "--save_total_limit", "1",
    ]  # fmt: skip
    return dropin.both(root, "run_mlm", ORIGINAL_IMPORT, CHANGED_IMPORT, args)


def _json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def test_the_same_logged_numbers_from_the_first_step(runs):
    theirs, ours = (_json(runs[k] / "trainer_state.json")["log_history"] for k in ("transformers", "hflight"))
    assert len(ours) == len(theirs) and sum("loss" in e for e in theirs) >= 10
    for a, b in zip(theirs, ours):
        assert set(a) == set(b)
        for key, value in a.items():
            if not key.endswith(TIMINGS):
                assert b[key] == pytest.approx(value, rel=0, abs=0), (a["step"], key, value, b[key])


def test_the_same_metrics_and_files(runs):
    for name in ("eval_results.json", "train_results.json"):
        theirs, ours = (_json(runs[k] / name) for k in ("transformers", "hflight"))
        assert set(ours) == set(theirs)
        for key, value in theirs.items():
            if not key.endswith(TIMINGS):
                assert ours[key] == pytest.approx(value, rel=0, abs=0), (name, key)
    assert "perplexity" in _json(runs["hflight"] / "eval_results.json")
    files = {k: {p.relative_to(runs[k]).as_posix() for p in runs[k].rglob("*") if p.is_file()} for k in runs}
    assert {f for f in files["hflight"] if f.rsplit("/", 1)[-1] not in HFLIGHT_ONLY} == files["transformers"]
    assert (runs["hflight"] / "README.md").read_text() == (runs["transformers"] / "README.md").read_text()


def test_weights_optimizer_and_trainer_state_are_transformers_bit_for_bit(runs):
    assert dropin.assert_same_training_state(runs) >= 4
