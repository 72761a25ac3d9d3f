"""FSDP2 as transformers runs it (issue 35, items 1 and 3): transformers' run_clm.py under ``torchrun
--nproc_per_node=2`` with ``--fsdp "full_shard auto_wrap" --fsdp_config`` (``version`` 2, ``GPT2Block`` wrapped), once
as written with transformers' Trainer and once with the import changed to hflight's, compared number for number.

transformers' own FSDP route does not run on a machine without GPUs: accelerate 1.15 starts FSDP for GPU-like devices
only and, given ``--use_cpu``, trains with DDP instead (its checkpoints then hold ``optimizer.pt``, not FSDP's files).
The transformers side therefore runs with a test stand-in on ``PYTHONPATH`` (``tests/fsdp_standin``): accelerate gives
the CPU run the state it gives a GPU run, and everything else is accelerate's and transformers' code, the script
unchanged. With ``SHARDED_STATE_DICT`` both trainers write ``pytorch_model_fsdp_0/`` and ``optimizer_0/``; the logged
losses, gradient norms, learning rates, metrics, and the shards, scheduler, RNG and trainer states of every checkpoint
are the same bit for bit. Both trainers then resume transformers' ``checkpoint-5`` on one process (``torchrun
--nproc_per_node=1``: FSDP on one rank, which the stand-in gives transformers' side as accelerate gives it to one GPU)
and train the same. (Each trainer continuing the other's checkpoint on 2 processes is not run here: the two trainers'
checkpoints are the same bit for bit, hflight continues transformers' one here, and the crossed 2-process continuation
under FSDP2 is tests/test_finetune_torchrun.py's LoRA one; a 2-process sharded run restarted from its own checkpoint
ends as the uninterrupted run in tests/test_sharding.py.)
(With ``FULL_STATE_DICT`` transformers' own save fails on the CPU inside accelerate's state-dict gathering: hflight's
FULL run, written with save_async, is compared with its sharded one, the same training in the other checkpoint form, by
tests/test_sharding.py::test_full_state_dict_trains_as_the_sharded_run_and_writes_its_shards_whole; an hflight field
on a script's command line is HfArgumentParser's: tests/test_training_args.py::test_hf_argument_parser_round_trip.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from . import dropin, launch

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]

STANDIN = Path(__file__).parent / "fsdp_standin"
ARGS = [
    "--block_size", "16", "--do_train", "--do_eval", "--use_cpu",
    "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "4", "--gradient_accumulation_steps", "2",
    "--learning_rate", "2e-3", "--num_train_epochs", "2", "--logging_steps", "1",
    "--eval_strategy", "epoch", "--save_steps", "5", "--fsdp", "full_shard auto_wrap",
]  # fmt: skip
FSDP_CONFIG = '{"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"], "state_dict_type": "%s"}'


#: torchrun with one process: FSDP on one rank (transformers' Trainer refuses fsdp without a launcher)
TORCHRUN_1 = launch.torchrun(1)


def _job(folder: Path, library: str, args: list[str], launcher: list[str] = dropin.TORCHRUN_2) -> dropin.Job:
    changed = None if library == "transformers" else dropin.CHANGED_IMPORT
    path = [STANDIN] if library == "transformers" else []
    return dropin.Job(folder, "run_clm", dropin.ORIGINAL_IMPORT, changed, args, launcher=launcher, path=path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sharded_dropin")
    inputs = dropin.clm_inputs(root / "inputs")
    base = ["--model_name_or_path", str(inputs["model"]), "--train_file", str(inputs["train"]),
            "--validation_file", str(inputs["validation"]), *ARGS]  # fmt: skip
    sharded = [*base, "--fsdp_config", FSDP_CONFIG % "SHARDED_STATE_DICT"]
    first = {"transformers": _job(root / "transformers", "transformers", sharded),
             "hflight": _job(root / "hflight", "hflight", sharded)}  # fmt: skip
    outs = {name: job.out() for name, job in first.items()}
    # both trainers continue transformers' 2-process checkpoint-5 on one process
    resumed = [*sharded, "--resume_from_checkpoint", str(outs["transformers"] / "checkpoint-5")]
    on_one = {f"{library}_on_1": _job(root / f"{library}_on_1", library, resumed, launcher=TORCHRUN_1)
              for library in ("transformers", "hflight")}  # fmt: skip
    outs.update({name: job.out() for name, job in on_one.items()})
    return outs


def _pair(runs: dict[str, Path], transformers: str, hflight: str) -> dict[str, Path]:
    return {"transformers": runs[transformers], "hflight": runs[hflight]}


def test_transformers_really_ran_fsdp2(runs):
    """The stand-in made accelerate shard (no DDP wrapper, FSDP's checkpoint files); without it the same command
    trains with DDP (as transformers' side of tests/test_torchrun_dropin.py does with --use_cpu)."""
    console = (runs["transformers"].parent / "console.txt").read_text()
    assert "find_unused_parameters=True was specified in DDP constructor" not in console
    checkpoint = runs["transformers"] / "checkpoint-5"
    assert {p.name for p in checkpoint.iterdir()} >= {"pytorch_model_fsdp_0", "optimizer_0"}
    assert not (checkpoint / "optimizer.pt").exists()


def test_hflight_fsdp2_logs_and_writes_transformers_fsdp2_bit_for_bit(runs):
    both = _pair(runs, "transformers", "hflight")
    dropin.assert_same_results(both, ("eval_results.json", "train_results.json", "all_results.json"))
    dropin.assert_same_log_history(both, min_losses=8)  # gradient norms included: both sum them over the shards
    for step in (5, 8):
        ours = {p.relative_to(both["hflight"]).as_posix() for p in (both["hflight"] / f"checkpoint-{step}").rglob("*")
                if p.is_file()}  # fmt: skip
        theirs = {p.relative_to(both["transformers"]).as_posix()
                  for p in (both["transformers"] / f"checkpoint-{step}").rglob("*") if p.is_file()}  # fmt: skip
        assert ours - theirs == {f"checkpoint-{step}/{name}" for name in dropin.HFLIGHT_ONLY} and theirs <= ours
    # 4 distributed folders; scheduler, 2 RNG files and trainer state per checkpoint; the final trainer state
    assert dropin.assert_same_training_state(both) == 4 + 2 * 4 + 1
    # at the end transformers' save_model writes nothing for SHARDED_STATE_DICT; hflight's gathers the whole model,
    # which is the last checkpoint's, for from_pretrained
    assert not (both["transformers"] / "model.safetensors").exists()
    from safetensors.torch import load_file

    final = load_file(both["hflight"] / "model.safetensors")
    shards = dropin.distributed_checkpoint(both["transformers"] / "checkpoint-8" / "pytorch_model_fsdp_0")
    assert all(torch.equal(final[k], shards[f"model.{k}"]) for k in final) and len(final) >= 20


def test_fsdp_on_one_process_continues_the_2_process_checkpoint_as_transformers_does(runs):
    """``torchrun --nproc_per_node=1`` with ``--fsdp``: transformers (accelerate's FSDP2 on one rank) and hflight
    continue the 2-process SHARDED_STATE_DICT checkpoint-5 on one process (the distributed checkpoint resharded onto
    it, no RNG file for one process: both warn and go on) and log, evaluate and write the same, bit for bit. hflight's
    run is sharded (its checkpoints are FSDP's folders, written by one process) where it used to refuse fsdp with one
    process."""
    both = _pair(runs, "transformers_on_1", "hflight_on_1")
    console = (runs["transformers_on_1"].parent / "console.txt").read_text()
    assert "find_unused_parameters=True was specified in DDP constructor" not in console  # FSDP, not DDP
    dropin.assert_same_results(both, ("eval_results.json", "train_results.json", "all_results.json"))
    dropin.assert_same_log_history(both, min_losses=8)
    checkpoints = sorted(p.name for p in both["hflight"].glob("checkpoint-*"))
    assert checkpoints == sorted(p.name for p in both["transformers"].glob("checkpoint-*")) and checkpoints
    for checkpoint in checkpoints:
        names = {
            p.relative_to(both["hflight"] / checkpoint).as_posix() for p in (both["hflight"] / checkpoint).rglob("*")
        }
        assert {"pytorch_model_fsdp_0/__0_0.distcp", "optimizer_0/__0_0.distcp", "rng_state.pth"} <= names
        assert "pytorch_model_fsdp_0/__1_0.distcp" not in names and "optimizer.pt" not in names
    # the distributed folders, scheduler, RNG and trainer states of every checkpoint, and the final trainer state
    assert dropin.assert_same_training_state(both) == 5 * len(checkpoints) + 1
