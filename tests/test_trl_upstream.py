"""The harness that runs TRL's own unit tests against ``hflight.trl`` (``python -m tests.trl_upstream``, issue 47,
item 5; TRL's tests themselves are not part of this project): its stand-ins load offline through the hub names the
tests use, its one-import change rewrites what it must and nothing else, and its comparison reports a test that fails
only on hflight's side, on a TRL-style test file written here."""

from __future__ import annotations

import json
import textwrap

import pytest

from .trl_upstream import __main__ as harness
from .trl_upstream import compare

pytest.importorskip("trl")

TRL_STYLE_TESTS = """
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl import SFTConfig, SFTTrainer, get_peft_config
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling, gone_from_trl


def test_the_stand_ins_load_offline_through_the_hub_names():
    model = AutoModelForCausalLM.from_pretrained("trl-internal-testing/tiny-Qwen2ForCausalLM-2.5")
    tokenizer = AutoTokenizer.from_pretrained("trl-internal-testing/tiny-Qwen2ForCausalLM-2.5")
    assert type(model).__name__ == "Qwen2ForCausalLM" and type(tokenizer).__name__ == "Qwen2Tokenizer"
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert model.config.vocab_size == len(tokenizer) and model.config.eos_token_id == tokenizer.eos_token_id
    rows = load_dataset("trl-internal-testing/zen", "standard_language_modeling", split="train")
    assert rows.column_names == ["text"] and rows[0]["text"] == "Beautiful is better than ugly." and len(rows) == 17
    pairs = load_dataset("trl-internal-testing/zen", "conversational_preference")
    assert set(pairs) == {"train", "test"} and pairs["test"].column_names == ["prompt", "chosen", "rejected"]


def test_the_trainer_is_trl_s_own():
    assert SFTTrainer.__module__ == "trl.trainer.sft_trainer" and SFTConfig.__module__ == "trl.trainer.sft_config"


def test_a_model_not_built_fails_on_both_sides():
    AutoModelForCausalLM.from_pretrained("trl-internal-testing/tiny-NotBuiltForCausalLM")


def test_a_name_the_installed_trl_lacks_fails_on_both_sides():
    gone_from_trl()
"""


def test_with_hflight_changes_the_trainers_and_configs_only():
    source = textwrap.dedent("""\
        import trl
        from trl import (
            SFTConfig,
            get_peft_config,  # not a trainer
        )
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling


        def test_it():
            from trl import DPOTrainer as Trainer
            assert trl.SFTTrainer and trl.data_utils and "trl.SFTTrainer"
        """)
    changed, count = compare.with_hflight(source, compare.exported())
    assert count == 4 and changed == textwrap.dedent("""\
        import trl
        import hflight.trl  # the one import changed
        from trl import get_peft_config
        from hflight.trl import SFTConfig
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling


        def test_it():
            from hflight.trl import DPOTrainer as Trainer
            assert hflight.trl.SFTTrainer and trl.data_utils and "trl.SFTTrainer"
        """)


@pytest.mark.subprocess
@pytest.mark.slow
def test_the_harness_reports_what_fails_only_with_hflight(tmp_path):
    """The stand-ins built and loaded offline under the harness's environment (the hub cache, the data set plugin),
    both sides run by pytest, and the comparison: a test passing on TRL's side and failing on hflight's is listed."""
    trl_tests = tmp_path / "trl_tests"
    trl_tests.mkdir()
    (trl_tests / "__init__.py").write_text("")
    (trl_tests / "test_style.py").write_text(TRL_STYLE_TESTS)
    assert harness.main(["--trl-tests", str(trl_tests), "--out", str(tmp_path / "out"), "test_style.py"]) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    outcomes = {side: {test.split("::")[-1]: outcome for test, (outcome, _) in found.items()}
                for side, found in results["outcomes"].items()}  # fmt: skip
    assert outcomes == {
        "trl": {"test_the_stand_ins_load_offline_through_the_hub_names": "passed", "test_the_trainer_is_trl_s_own":
                "passed", "test_a_model_not_built_fails_on_both_sides": "failed",
                "test_a_name_the_installed_trl_lacks_fails_on_both_sides": "failed"},
        "hflight": {"test_the_stand_ins_load_offline_through_the_hub_names": "passed", "test_the_trainer_is_trl_s_own":
                    "failed", "test_a_model_not_built_fails_on_both_sides": "failed",
                    "test_a_name_the_installed_trl_lacks_fails_on_both_sides": "failed"},
    }  # fmt: skip
    assert results["pass_only_with_trl"] == ["test_style.py::test_the_trainer_is_trl_s_own"]
    assert results["counts"] == {"test_style.py": {"pass both": 1, "fail both": 2, "pass only with TRL": 1}}
    gone = results["outcomes"]["hflight"]["test_style.py::test_a_name_the_installed_trl_lacks_fails_on_both_sides"]
    assert "trl.trainer.sft_trainer.gone_from_trl is not in the installed TRL" in gone[1]
    report = (tmp_path / "out" / "results.md").read_text()
    assert "- `test_style.py::test_the_trainer_is_trl_s_own`" in report
