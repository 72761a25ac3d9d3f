"""Several processes as transformers users launch them (issue 35, item 0): the example script ``run_glue`` of the
drop-in tests runs under a plain ``torchrun --standalone --nproc_per_node=2``, nothing named (no strategy, no
devices), once as written and once with the trainer import changed to hflight's (``run_clm`` over two processes,
with gradient accumulation: tests/test_sharded_dropin.py under torchrun and tests/test_accelerate_launch.py's ZeRO-3
launch; that ``accelerate launch --config_file ddp.yaml`` leaves plain torchrun's arguments: that module's unit test).
transformers'
Trainer trains data-parallel over both processes (on a machine without GPUs only with ``--use_cpu``: accelerate
starts its CPU data parallelism for ``use_cpu`` alone, and without it each process trains alone and warns); hflight
does with or without it: the same losses, gradient norms, learning rates, metrics, predictions, files, and weights,
optimizer, scheduler and every rank's RNG state bit for bit.

Before hflight spanned the launched processes, each rank trained a one-process copy of the run on all the data
(the losses of a one-process run, not transformers'), and rank 1 crashed writing into a checkpoint folder rank 0
had not made ("Parent directory .../.tmp-checkpoint-N does not exist"). The last test asks for one device under
torchrun's variables of a two-process launch: refused before training, naming both sizes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import hflight
from hflight.run.launch_check import WorldMismatchError

from . import dropin, launch

GLUE_ARGS = [
    "--do_train", "--do_eval", "--do_predict", "--max_seq_length", "24", "--pad_to_max_length", "false",
    "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4",
    "--learning_rate", "2e-3", "--num_train_epochs", "2", "--logging_steps", "1",
    "--eval_strategy", "epoch", "--save_steps", "5", "--save_total_limit", "1",
]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """Both torchrun jobs at once (two processes each, one thread per process). run_clm over two processes is
    tests/test_sharded_dropin.py's (FSDP2 under torchrun) and tests/test_accelerate_launch.py's (ZeRO-3 under
    ``accelerate launch``); ``accelerate launch --config_file ddp.yaml`` gives plain torchrun's arguments
    (test_accelerate_launch.py::test_the_ddp_config_file_leaves_the_arguments_those_of_plain_torchrun)."""
    root = tmp_path_factory.mktemp("torchrun_dropin")
    glue_in = dropin.glue_inputs(root / "glue_inputs")
    glue_args = ["--model_name_or_path", str(glue_in["model"]), "--train_file", str(glue_in["train"]),
                 "--validation_file", str(glue_in["validation"]), "--test_file", str(glue_in["test"]),
                 *GLUE_ARGS]  # fmt: skip
    # run_glue: hflight's without --use_cpu, as a user of a machine without GPUs writes it; transformers' with it,
    # since without it accelerate does not start data parallelism on the CPU and each process trains alone
    jobs = {
        (example, library): dropin.Job(
            root / example / library,
            example,
            dropin.ORIGINAL_IMPORT,
            None if library == "transformers" else dropin.CHANGED_IMPORT,
            [*args, *(["--use_cpu"] if library == "transformers" else [])],
            launcher=dropin.TORCHRUN_2,
        )  # fmt: skip
        for example, args in (("run_glue", glue_args),)
        for library in ("transformers", "hflight")
    }
    outs: dict[str, dict[str, Path]] = {"run_glue": {}}
    for (example, library), job in jobs.items():
        outs[example][library] = job.out()
    return outs


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("example", ["run_glue"])
def test_the_same_metrics_and_logged_numbers_as_transformers_ddp(runs, example):
    """The metrics and every logged loss, gradient norm and learning rate are transformers'. Also the proof of
    ``average_tokens_across_devices`` (transformers' default; the BERT's forward takes ``**kwargs``): the label count
    summed over the processes and the loss scaled by their number, as transformers does (without either, these numbers
    differ; with gradient accumulation: run_clm in tests/test_sharded_dropin.py and test_accelerate_launch.py's ZeRO-3
    launch)."""
    both = runs[example]
    dropin.assert_same_results(both, ("eval_results.json", "train_results.json", "all_results.json"))
    dropin.assert_same_log_history(both, min_losses=5)


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("example", ["run_glue"])
def test_the_same_files_weights_optimizer_and_rank_states(runs, example):
    both = runs[example]
    dropin.assert_same_files(both)
    assert dropin.assert_same_training_state(both) >= 6
    checkpoints = sorted(both["hflight"].glob("checkpoint-*"))
    assert checkpoints
    for folder in checkpoints:  # one RNG file per process, as transformers writes them
        assert sorted(p.name for p in folder.glob("rng_state*")) == ["rng_state_0.pth", "rng_state_1.pth"]
        manifest = json.loads((folder / "checkpoint_manifest.json").read_text())
        assert (manifest["run"]["world_size"], manifest["run"]["num_nodes"]) == (2, 1)


@pytest.mark.subprocess
@pytest.mark.slow
def test_the_same_predictions_under_torchrun(runs):
    both = runs["run_glue"]
    ours, theirs = ((both[k] / "predict_results.txt").read_text(encoding="utf-8") for k in ("hflight", "transformers"))
    assert ours == theirs and len(ours.splitlines()) == 17


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)

    def forward(self, x, labels=None):
        return {"loss": ((self.linear(x).squeeze(-1) - labels) ** 2).mean()}


def test_a_strategy_that_does_not_span_the_launched_processes_is_refused(tmp_path, monkeypatch):
    """``devices=1`` under ``torchrun --nproc_per_node=2`` (rank 0's variables, as torchrun sets them; the check reads
    them when the run starts, before any process group: this process is rank 0 of such a launch): two processes
    launched, a strategy of one: refused before any step, naming both sizes and what to set (never two copies of a
    one-process run). That hflight sees torchrun's real launch as 2 processes is the run_glue jobs' above (their
    checkpoints' ``world_size``)."""
    torchrun_2 = {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0",
                  "LOCAL_RANK": "0", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": str(launch.free_port())}  # fmt: skip
    for name, value in torchrun_2.items():
        monkeypatch.setenv(name, value)
    data = [{"x": torch.ones(2), "labels": torch.tensor(1.0)}] * 8
    args = hflight.TrainingArguments(output_dir=str(tmp_path / "out"), devices=1, report_to="none", use_cpu=True)
    trainer = hflight.Trainer(_Tiny(), args, train_dataset=data)
    with pytest.raises(WorldMismatchError) as refused:
        trainer.train()
    message = str(refused.value)
    assert "2 processes were launched (torchelastic: WORLD_SIZE=2, LOCAL_WORLD_SIZE=2)" in message, message
    assert "SingleDeviceStrategy spans 1 (devices=1, num_nodes=1" in message
    assert trainer.state.global_step == 0 and not list(tmp_path.glob("out/checkpoint-*"))
