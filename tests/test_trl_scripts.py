"""TRL's own example scripts with the one import changed (issue 47, item 5): ``trl/scripts/sft.py``, ``dpo.py``,
``reward.py`` and ``grpo.py`` as TRL installs them, read from the installed package (not copied into this project), run
as they are and with ``from hflight.trl import <Name>Trainer`` added after their ``from trl import ...`` line, on a
tiny GPT-2 saved with its tokenizer and on local data files (``--model_name_or_path`` and ``--dataset_name`` name
folders: nothing is downloaded). Each pair of runs gives the same log history, step for step (times apart), and the
same saved weights."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import transformers

from .tiny_lm import columns, conversations, gpt2, tokenizer

trl = pytest.importorskip("trl")

TIMES = ("_runtime", "_per_second", "step_time")
COMMON = ["--per_device_train_batch_size", "4", "--max_steps", "4", "--logging_steps", "1", "--save_steps", "4",
          "--learning_rate", "1e-3", "--seed", "0", "--report_to", "none", "--disable_tqdm", "true", "--bf16", "false",
          "--dataloader_pin_memory", "false"]  # fmt: skip
REWARD_MODULE = "def length(completions, **kwargs):\n    return [len(c.split()) / 10 for c in completions]\n"


def with_hflight(source: str, trainer: str) -> str:
    """The script with the one change: ``trainer`` imported from ``hflight.trl`` right after its ``from trl import``
    line (the only line that names it)."""
    pattern = re.compile(rf"^(?P<indent>[ \t]*)from trl import [^\n]*\b{trainer}\b[^\n]*\n", re.MULTILINE)
    changed, count = pattern.subn(lambda m: f"{m.group(0)}{m.group('indent')}from hflight.trl import {trainer}\n",
                                  source)  # fmt: skip
    assert count == 1, f"trl/scripts: {trainer} is imported {count} times, not once"
    return changed


def run_script(name: str, trainer: str, library: str, arguments: list[str], tmp_path: Path) -> Path:
    """TRL's ``scripts/<name>.py`` (changed for ``library`` "hflight"), parsed with TRL's own parser and run through its
    ``main`` in this process; returns its output folder."""
    source = (Path(trl.__file__).parent / "scripts" / f"{name}.py").read_text(encoding="utf-8")
    path = tmp_path / f"{name}_{library}.py"
    path.write_text(with_hflight(source, trainer) if library == "hflight" else source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(f"{name}_{library}", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / library
    parsed = script.make_parser().parse_args_and_config([*arguments, *COMMON, "--output_dir", str(out)],
                                                        fail_with_unknown_args=False)  # fmt: skip
    transformers.set_seed(0)  # a head the script adds (reward's score) is drawn from the same state in both runs
    script.main(*parsed)
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """A tiny GPT-2 and its tokenizer saved in a folder, and the data sets as local files, a folder each."""
    root = tmp_path_factory.mktemp("trl_scripts")
    gpt2().save_pretrained(root / "model")
    tokenizer().save_pretrained(root / "model")
    data = {"text": columns(32, text=(5, 20)), "conversations": conversations(32),
            "preference": columns(32, prompt=(3, 10), chosen=(3, 10), rejected=(3, 10)),
            "prompts": columns(32, prompt=(3, 8))}  # fmt: skip
    for name, dataset in data.items():
        (root / name).mkdir()
        dataset.to_json(root / name / "train.jsonl")
    (root / "lm_rewards.py").write_text(REWARD_MODULE, encoding="utf-8")
    return {name: root / name for name in ("model", *data)} | {"root": root}


SCRIPTS = {
    "sft": ("SFTTrainer", "text", []),
    "sft_conversations_lora": ("SFTTrainer", "conversations",
                               ["--use_peft", "--lora_r", "4", "--lora_target_modules", ".*c_attn"]),
    "dpo": ("DPOTrainer", "preference", []),
    "reward": ("RewardTrainer", "preference", []),
    "grpo": ("GRPOTrainer", "prompts", ["--reward_funcs", "lm_rewards.length", "--num_generations", "4",
                                        "--max_completion_length", "8"]),
}  # fmt: skip


@pytest.mark.parametrize("case", list(SCRIPTS))
def test_trl_s_script_with_the_one_import_changed_gives_trl_s_run(case, inputs, tmp_path, monkeypatch):
    trainer, data, extra = SCRIPTS[case]
    name = case.split("_")[0]
    monkeypatch.chdir(inputs["root"])  # grpo.py imports --reward_funcs modules from the working folder
    arguments = ["--model_name_or_path", str(inputs["model"]), "--dataset_name", str(inputs[data]), *extra]
    outs = {library: run_script(name, trainer, library, arguments, tmp_path) for library in ("trl", "hflight")}
    states = {library: json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
              for library, out in outs.items()}  # fmt: skip
    histories = {library: [{k: v for k, v in e.items() if not k.endswith(TIMES)} for e in state["log_history"]]
                 for library, state in states.items()}  # fmt: skip
    assert len([e for e in histories["hflight"] if "loss" in e]) == 4
    manifests = {library: (out / "checkpoint-4" / "checkpoint_manifest.json").is_file()
                 for library, out in outs.items()}  # fmt: skip
    assert manifests == {"trl": False, "hflight": True}  # the changed script ran on hflight
    assert histories["hflight"] == histories["trl"]
    weights = "adapter_model.safetensors" if "--use_peft" in extra else "model.safetensors"
    assert (outs["hflight"] / weights).read_bytes() == (outs["trl"] / weights).read_bytes()
