"""The Hydra recipe of TRL's SFT with LoRA on hflight (issue 47, item 6): ``python train.py +experiment=sft_lora``
offline on CPU, with tiny sizes: synthetic prompt/completion pairs, a word-level tokenizer and a small Llama built
here, LoRA adapters trained through ``hflight.trl.SFTTrainer``; its checkpoints (the adapters, as transformers writes
them, in hflight's manifest) and curves; ``resume=<run folder>`` continuing it as the run uninterrupted; ``-m``
sweeping it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hflight.checkpoints.manifest import verify_checkpoint

pytest.importorskip("trl")
pytest.importorskip("peft")

REPO = Path(__file__).resolve().parents[1]
TINY = ["+experiment=sft_lora", "data.synthetic.num_train_articles=6", "data.synthetic.num_validation_articles=2",
        "data.synthetic.paragraphs_per_article=2", "model.config.hidden_size=32", "model.config.intermediate_size=64",
        "model.tokenizer_trainer.vocab_size=500", "args.per_device_train_batch_size=8", "args.logging_steps=2",
        "args.disable_tqdm=true", "cpu_threads=1"]  # fmt: skip


def _run(*overrides: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HYDRA_FULL_ERROR": "1"}  # fmt: skip
    command = [sys.executable, str(REPO / "train.py"), *overrides]
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        pytest.fail(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    return done


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """``python train.py +experiment=sft_lora`` as the docs show it, tiny sizes (its 2 epochs, a checkpoint each), run
    in an empty folder (its outputs go where the command puts them) and kept aside as ``uninterrupted/``; then cut back
    to what a run stopped in its second epoch leaves (the first epoch's checkpoint: the last one and the files of its
    end deleted), and ``resume=<run folder>`` continuing it."""
    root = tmp_path_factory.mktemp("sft_lora")
    _run(*TINY, cwd=root)
    (run,) = sorted(root.glob("outputs/sft_lora/runs/*"))
    shutil.copytree(run, root / "uninterrupted")
    *_, last = sorted(run.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    shutil.rmtree(last)
    for path in run.iterdir():
        if path.is_file() and path.suffix != ".log":
            path.unlink()
    _run(f"resume={run}", cwd=root)
    return run


def _comparable(history: list[dict]) -> list[dict]:
    """A log history less what a resumed process counts afresh in transformers and TRL too: the tokens TRL's
    SFTTrainer has seen (from 0 in each process), the mean training loss (over the process's own steps), timings."""
    afresh = ("num_tokens", "eval_num_tokens", "train_loss")
    return [{k: v for k, v in entry.items() if k not in afresh and not k.endswith(("runtime", "per_second"))}
            for entry in history]  # fmt: skip


@pytest.mark.subprocess
def test_the_recipe_trains_lora_adapters_and_checkpoints_them_as_transformers_writes_them(run_dir):
    state = json.loads((run_dir / "trainer_state.json").read_text())
    checkpoint = Path(state["best_model_checkpoint"])
    assert verify_checkpoint(checkpoint, full=True) is not None
    names = {p.name for p in checkpoint.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "optimizer.pt", "trainer_state.json"} <= names
    assert "model.safetensors" not in names
    config = json.loads((checkpoint / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and sorted(config["target_modules"]) == [
        "k_proj",
        "o_proj",
        "q_proj",
        "v_proj",
    ]
    assert {"adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in run_dir.iterdir()}  # save_model's
    results = json.loads((run_dir / "eval_results.json").read_text())
    assert {"eval_loss", "eval_mean_token_accuracy", "eval_entropy"} <= results.keys()
    assert (run_dir / "training_curves.png").stat().st_size > 5000


@pytest.mark.subprocess
def test_resume_continues_the_run_from_its_checkpoint_as_the_uninterrupted_run(run_dir):
    """Resumed from the first epoch's checkpoint, the second epoch is the uninterrupted run's, number for number: its
    first step's loss is that of the checkpoint's adapters (and modules_to_save: the embeddings, the output layer),
    the rest that of its optimizer, scheduler and RNG states; the evaluation, the best checkpoint and the last
    checkpoint's adapter file (byte for byte) the same; the first epoch's history is the checkpoint's, not repeated."""
    uninterrupted = run_dir.parents[3] / "uninterrupted"
    theirs, ours = (json.loads((folder / "trainer_state.json").read_text()) for folder in (uninterrupted, run_dir))
    assert ours["global_step"] == theirs["global_step"] > 0
    assert _comparable(ours["log_history"]) == _comparable(theirs["log_history"])
    steps = [e["step"] for e in ours["log_history"] if "loss" in e]
    assert steps == sorted(set(steps)) and steps[0] == 2 and steps[-1] == ours["global_step"]
    assert Path(ours["best_model_checkpoint"]).name == Path(theirs["best_model_checkpoint"]).name
    checkpoints = sorted(p.name for p in uninterrupted.glob("checkpoint-*"))
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == checkpoints and len(checkpoints) == 2
    last = f"checkpoint-{ours['global_step']}/adapter_model.safetensors"
    assert (run_dir / last).read_bytes() == (uninterrupted / last).read_bytes()


@pytest.mark.subprocess
def test_the_recipe_streams_its_pairs_and_resume_continues_the_stream_without_reading_it_again(tmp_path):
    """``data.streaming=true`` (issue 63): the training pairs as a ``datasets.IterableDataset``; a run stopped after
    its checkpoint-8 (cut back to it) and ``resume=<run folder>`` continue the stream from the checkpoint's data
    position (said at resume), to the uninterrupted run's adapters and losses."""
    stream = [*TINY, "data.streaming=true", "args.max_steps=12", "args.eval_strategy=steps", "args.eval_steps=4",
              "args.save_strategy=steps", "args.save_steps=4"]  # fmt: skip
    _run(*stream, cwd=tmp_path)
    (run,) = sorted(tmp_path.glob("outputs/sft_lora/runs/*"))
    shutil.copytree(run, tmp_path / "uninterrupted")
    shutil.rmtree(run / "checkpoint-12")
    for path in run.iterdir():
        if path.is_file() and path.suffix != ".log":
            path.unlink()
    assert (run / "checkpoint-8" / "data_position.pt").is_file()
    done = _run(f"resume={run}", "args.log_level=info", cwd=tmp_path)
    assert (
        f"Continuing training from {run / 'checkpoint-8'} at global step 8: the training data continues from its "
        "position" in done.stdout + done.stderr
    )
    theirs, ours = (
        json.loads((folder / "trainer_state.json").read_text()) for folder in (tmp_path / "uninterrupted", run)
    )
    assert _comparable(ours["log_history"]) == _comparable(theirs["log_history"])
    name = "adapter_model.safetensors"
    assert (run / name).read_bytes() == (tmp_path / "uninterrupted" / name).read_bytes()


def test_a_stream_of_pairs_needs_max_steps_and_says_how_many_steps_a_pass_makes():
    import datasets

    from hflight import TrainingArguments
    from hflight.sft.recipe import stream_of

    pairs = datasets.Dataset.from_dict({"prompt": ["a"] * 20, "completion": ["b"] * 20})
    args = TrainingArguments(output_dir="unused", per_device_train_batch_size=8, report_to="none")
    with pytest.raises(ValueError, match=r"set args.max_steps \(the 20 training pairs .* make 3 steps a pass"):
        stream_of(pairs, 8, args)
    args.max_steps = 5
    assert stream_of(pairs, 8, args).num_shards == 8


@pytest.mark.subprocess
def test_a_sweep_of_the_recipe(tmp_path):
    _run("-m", *TINY, "args.num_train_epochs=1", "args.learning_rate=1e-3,3e-3", cwd=tmp_path)
    (sweep,) = sorted(tmp_path.glob("outputs/sft_lora/multiruns/*"))
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit())
    assert len(jobs) == 2 and all((job / "eval_results.json").is_file() for job in jobs)
    rates = [json.loads((job / "trainer_state.json").read_text())["log_history"][0]["learning_rate"] for job in jobs]
    assert rates[0] != rates[1]
