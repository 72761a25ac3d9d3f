"""Models larger than one device (issue 35): FSDP2 (hflight's FSDP2Strategy) and DeepSpeed ZeRO-3 on this CPU (gloo),
their checkpoints, and resuming them on another number of processes.

``tests/jobs/sharded_job.py`` trains a tiny GPT-2 under ``torchrun --nproc_per_node=2`` with ``fsdp="full_shard
auto_wrap"`` (both checkpoint forms) and with ``deepspeed`` (ZeRO-3), all at once, then resumes the sharded
checkpoint on 1 process (no FSDP at all) and on 4, the full one on 1, the ZeRO-3 one on 2. Each resumed run
saves the whole model and optimizer states it holds once the checkpoint is restored: they must be the checkpoint's,
bit for bit (torch.distributed.checkpoint reshards the states on the way). ZeRO-3 trains as FSDP2 does (the same
arithmetic: each process's shard of every parameter, the Trainer's AdamW) and continues its own checkpoint bit for
bit. The numbers of a sharded run against transformers' own: tests/test_sharded_dropin.py, tests/test_deepspeed.py.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

import hflight
from hflight.arguments import lightning_kwargs
from hflight.checkpoints.manifest import get_last_checkpoint, read_manifest, verify_checkpoint
from hflight.checkpoints.sharded import load_dcp, read_full_model, read_metadata, tensor_shapes
from hflight.checkpoints.writers.files import IncompleteCheckpointError, UnsafeCheckpointFile
from hflight.sharding import plans

from . import durability, launch
from .support import HFLIGHT_ONLY

JOB = launch.JOBS / "sharded_job.py"

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]


def _start(out: Path, processes: int, *options: str, restarts: int = 0) -> launch.Job:
    """The job under ``torchrun`` (``processes`` > 1), else in one plain Python process; its output kept beside
    ``out``."""
    out.mkdir(parents=True)
    launched = launch.torchrun(processes, f"--max-restarts={restarts}")
    launcher = launched if processes > 1 else [sys.executable]
    return launch.Job([*launcher, JOB, out, *options], out, console=out.parent / f"{out.name}.console.txt", timeout=420)


def _finish(jobs: dict[str, launch.Job]) -> dict[str, str]:
    """Every job's output, once all ended and exited 0."""
    return {name: ended.output for name, ended in launch.all_ok(jobs).items()}


#: DeepSpeed ZeRO-3 with the Trainer's own optimizer and schedule (transformers' "auto" values), the 16-bit weights
#: gathered for save_model; the same without gathering (save_model then writes DeepSpeed's checkpoint instead)
ZERO3 = {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
         "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
         "gradient_clipping": "auto"}  # fmt: skip


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict:
    """FSDP2 (both forms, the full one written with save_async), ZeRO-3 and DDP on 2 processes at once; then the resumes
    at once: the sharded checkpoint on 1 process (no FSDP) and on 4, the full one on 1 process, the DDP one in FSDP2 on
    2, the ZeRO-3 one on 2 (without gathering for save_model), and a sharded run stopped by SIGTERM, then killed while
    it writes, restarted twice.

    Not run, each proved through the same code by a job here or elsewhere: the full form resumed with FSDP on one
    process (optimizer.bin read by GatheredState.read_optimizer as full_on_1 reads it; whole optimizer states and
    weights cut to FSDP2's shards as ddp_to_fsdp2 cuts them; FSDP on one rank continuing a 2-process checkpoint:
    tests/test_sharded_dropin.py::test_fsdp_on_one_process_continues_the_2_process_checkpoint_as_transformers_does)."""
    root = tmp_path_factory.mktemp("sharding")
    configs = {}
    for name, gather in (("zero3", True), ("zero3_no_gather", False)):
        config = json.loads(json.dumps(ZERO3))
        config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = gather
        configs[name] = root / f"{name}.json"
        configs[name].write_text(json.dumps(config))
    trained = {
        # the sharded one records its file-system calls on both processes, for the power-loss replay
        "SHARDED_STATE_DICT": _start(root / "SHARDED_STATE_DICT", 2, "--form", "SHARDED_STATE_DICT", "--record"),
        # the full one writes its checkpoints in the background (save_async)
        "FULL_STATE_DICT": _start(root / "FULL_STATE_DICT", 2, "--form", "FULL_STATE_DICT", "--save-async"),
    }
    trained["ZERO3"] = _start(root / "ZERO3", 2, "--deepspeed", str(configs["zero3"]))
    trained["DDP"] = _start(root / "DDP", 2, "--no-fsdp")
    logs = _finish(trained)
    sharded, full = root / "SHARDED_STATE_DICT" / "checkpoint-3", root / "FULL_STATE_DICT" / "checkpoint-3"
    resumed = {
        "sharded_on_1": _start(root / "sharded_on_1", 1, "--resume", str(sharded), "--no-fsdp"),
        # 4 processes as 2 copies, each sharded over 2 (parallelism_config: HSDP)
        "sharded_on_4": _start(root / "sharded_on_4", 4, "--resume", str(sharded), "--hsdp", "2,2"),
        "full_on_1": _start(root / "full_on_1", 1, "--resume", str(full), "--no-fsdp"),
        # DDP's optimizer.pt (by position, whole tensors) into FSDP2's sharded optimizer
        "ddp_to_fsdp2": _start(root / "ddp_to_fsdp2", 2, "--resume", str(root / "DDP" / "checkpoint-3")),
        "zero3_resumed": _start(
            root / "zero3_resumed",
            2,
            "--resume",
            str(root / "ZERO3" / "checkpoint-3"),
            "--deepspeed",
            str(configs["zero3_no_gather"]),
        ),  # fmt: skip
        # under torchrun --max-restarts=2, continued by train(resume_from_checkpoint="auto") as a restart is:
        # SIGTERM mid-step 5 (first attempt), then rank 0 killed while it writes checkpoint-6 (the shards written, not
        # its manifest; second attempt)
        "stopped_then_killed": _start(
            root / "stopped_then_killed",
            2,
            "--auto",
            "--fault",
            "SIGTERM,5,0,substep",
            "--fault",
            "SIGKILL,6,0,writing,1",
            restarts=2,
        ),  # fmt: skip
    }
    logs.update(_finish(resumed))
    return {"root": root, "logs": logs, "sharded": sharded, "full": full}


def _whole_optimizer(folder: Path) -> dict[str, torch.Tensor]:
    shapes = tensor_shapes(folder, "optimizer")
    state = {"optimizer": {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in shapes.items()}}
    load_dcp(folder, state, collective=False)
    return {k: v for k, v in state["optimizer"].items() if k.startswith("state.")}


def _flat(optimizer_state: dict) -> dict[str, torch.Tensor]:
    return {f"state.{name}.{key}": v for name, entry in optimizer_state["state"].items() for key, v in entry.items()}


def test_every_process_holds_its_half_of_every_parameter(jobs):
    result = json.loads((jobs["root"] / "SHARDED_STATE_DICT" / "result.json").read_text())
    assert result["world_size"] == 2
    first, second = result["elements"]
    assert set(first) == set(second) and len(first) >= 20
    for name, (local, whole) in first.items():
        assert local + second[name][0] == whole, name  # each element on one process only
        assert local <= -(-whole // 2), name  # at most half (dim 0 split in two)
    assert sum(local for local, _ in first.values()) * 2 >= sum(whole for _, whole in first.values()) - 64


def test_a_sharded_checkpoint_survives_a_power_loss_at_any_point(jobs):
    """The file-system calls of both processes of the 2-process SHARDED_STATE_DICT run (train() and save_model()),
    replayed as one history under the power-loss rules (tests/durability.py): every shard each process wrote, the
    distributed checkpoints' .metadata (renamed into place by torch's writer), the folders and the renames are durable
    before a checkpoint is published, before an older one is retired and before a call returns."""
    out = jobs["root"] / "SHARDED_STATE_DICT"
    events = durability.merged(*sorted((out / "recorded").glob("fs_events_*.json")))
    assert durability.violations(events, out) == []
    assert len({e["pid"] for e in events}) == 2
    fsyncs = [e for e in events if e["kind"] == "fsync"]
    shards = {(e["pid"], Path(e["path"]).name) for e in fsyncs if e["path"].endswith(".distcp")}
    assert {name for _, name in shards} >= {"__0_0.distcp", "__1_0.distcp"} and len({pid for pid, _ in shards}) == 2
    metadata = [e for e in events if e["kind"] == "rename" and Path(e["dst"]).name == ".metadata"]
    assert len(metadata) == 4, metadata  # optimizer_0/ and pytorch_model_fsdp_0/ of checkpoints 3 and 6
    published = [Path(e["dst"]).name for e in events if e["kind"] == "rename" and e["tree"] is not None]
    assert published == ["checkpoint-3", "checkpoint-6"], published


def test_parallelism_config_replicates_two_sharded_copies_over_four_processes(jobs):
    """dp_replicate_size=2, dp_shard_size=2 (transformers 5's parallelism_config, accelerate's HSDP): every process
    holds half of every parameter, the halves of each copy on two processes."""
    result = json.loads((jobs["root"] / "sharded_on_4" / "result.json").read_text())
    assert result["world_size"] == 4
    for name, (local, whole) in result["elements"][0].items():
        assert [e[name] for e in result["elements"]] == [[local, whole]] * 4 and local <= -(-whole // 2), name
    assert sum(e[name][0] for e in result["elements"] for name in e) == 2 * sum(w for _, w in result["elements"][0]
                                                                                 .values())  # fmt: skip


def test_parallelism_config_beyond_data_parallelism_is_refused_naming_the_field(factory):
    from accelerate import ParallelismConfig

    refused = r"(?s)parallelism_config=.*cp_size=2.*cp_size > 1 needs torch's context parallelism"
    with pytest.raises(ValueError, match=refused):
        hflight.TrainingArguments("o", report_to="none", parallelism_config=ParallelismConfig(cp_size=2))
    three = _args(fsdp=True, parallelism_config=ParallelismConfig(dp_replicate_size=3, dp_shard_size=2))
    with pytest.raises(ValueError, match=r"3 x 2 = 6, but the run has 2 processes"):
        lightning_kwargs.strategy_for(three, factory.cls_model())
    unsharded = _args(parallelism_config=ParallelismConfig(dp_shard_size=2))
    with pytest.raises(ValueError, match=r"dp_shard_size=2 shards the model.*set fsdp"):
        lightning_kwargs.strategy_for(unsharded, factory.cls_model())


def test_a_sharded_checkpoint_is_transformers_layout_with_every_shard_in_the_manifest(jobs):
    folder = jobs["sharded"]
    names = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    expected_shards = {f"{d}/{f}" for d in ("pytorch_model_fsdp_0", "optimizer_0")
                       for f in (".metadata", "__0_0.distcp", "__1_0.distcp")}  # fmt: skip
    assert expected_shards <= names
    # as transformers' sharded checkpoint: no save_model files (the shards are the model); hflight's own files added
    assert names - expected_shards == {"scheduler.pt", "rng_state_0.pth", "rng_state_1.pth", "trainer_state.json",
                                       *HFLIGHT_ONLY}  # fmt: skip
    manifest = read_manifest(folder)
    assert expected_shards <= set(manifest["files"]) and manifest["run"]["world_size"] == 2
    assert verify_checkpoint(folder, full=True) == manifest
    full_names = {p.name for p in jobs["full"].iterdir()}
    assert {"model.safetensors", "pytorch_model_fsdp.bin", "optimizer.bin", "config.json"} <= full_names


def test_full_state_dict_trains_as_the_sharded_run_and_writes_its_shards_whole(jobs):
    """FULL_STATE_DICT (written in the background: save_async) against SHARDED_STATE_DICT (synchronous): the same log
    history and final weights, and each checkpoint's gathered model and optimizer files (transformers'
    ``pytorch_model_fsdp.bin`` and ``optimizer.bin``, parameters by name as accelerate's) hold the shards' tensors
    exactly. (transformers' own FULL_STATE_DICT save fails on the CPU: tests/test_sharded_dropin.py.)"""
    from safetensors.torch import load_file

    assert _history(jobs, "FULL_STATE_DICT") == _history(jobs, "SHARDED_STATE_DICT")
    full, sharded = jobs["root"] / "FULL_STATE_DICT", jobs["root"] / "SHARDED_STATE_DICT"
    ours, theirs = load_file(full / "model.safetensors"), load_file(sharded / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(ours[k].equal(theirs[k]) for k in ours) and len(ours) >= 20
    for checkpoint in ("checkpoint-3", "checkpoint-6"):
        whole = torch.load(full / checkpoint / "pytorch_model_fsdp.bin", weights_only=True)
        shards = read_full_model(sharded / checkpoint / "pytorch_model_fsdp_0")
        assert whole.keys() == shards.keys() and all(torch.equal(whole[k], shards[k]) for k in shards), checkpoint
        states = _flat(torch.load(full / checkpoint / "optimizer.bin", weights_only=True))  # by name, as accelerate's
        optimizer = _whole_optimizer(sharded / checkpoint / "optimizer_0")
        assert states.keys() == optimizer.keys() and len(states) >= 3 * 20, checkpoint
        assert all(torch.equal(states[k], optimizer[k]) for k in states), checkpoint


@pytest.mark.parametrize("name", ["sharded_on_1", "sharded_on_4", "full_on_1"])
def test_a_checkpoint_of_2_processes_resumes_on_1_and_4_with_the_same_states(jobs, name):
    """The whole model and optimizer states the resumed run holds before its first step are the checkpoint's, bit for
    bit: on 1 process without FSDP (either form) and resharded onto 4; the change is said aloud; the run then trains
    to its end, sharded or not as asked. (FSDP over 1 process: see the fixture's docstring.)"""
    restored = torch.load(jobs["root"] / name / "restored.pt", weights_only=True)
    full_source = name.startswith("full_on")
    source = jobs["full"] if full_source else jobs["sharded"]
    if full_source:
        model = torch.load(source / "pytorch_model_fsdp.bin", weights_only=True)
        optimizer = _flat(torch.load(source / "optimizer.bin", weights_only=True))
    else:
        model = read_full_model(source / "pytorch_model_fsdp_0")
        optimizer = _whole_optimizer(source / "optimizer_0")
    assert set(restored["model"]) >= set(model) and len(optimizer) >= 3 * 20
    assert all(torch.equal(restored["model"][k], model[k]) for k in model)
    ours = _flat(restored["optimizer"])
    assert set(ours) == set(optimizer) and all(torch.equal(ours[k], optimizer[k]) for k in optimizer)
    processes = 4 if name == "sharded_on_4" else 1
    log = jobs["logs"][name]
    assert f"world_size: {processes} (now) != 2 (checkpoint)" in log
    if not full_source:
        assert f"written by 2 process(es), read by {processes}: torch.distributed.checkpoint reshards" in log
    result = json.loads((jobs["root"] / name / "result.json").read_text())
    assert result["world_size"] == processes and result["log_history"][-1]["step"] == 6
    assert result["sharded"] == (name not in ("sharded_on_1", "full_on_1"))  # DTensor parameters: FSDP2


def _tiny_gpt2() -> torch.nn.Module:
    """The job's model (``tests/jobs/sharded_job.py``), freshly initialised."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=16))


def _position_names() -> list[str]:
    """The parameters of the job's model in the order of the Trainer's optimizer (its groups: weight decay, then
    none), i.e. what the positions of its ``optimizer.pt`` stand for; found without the product's conversion."""
    model = _tiny_gpt2()
    args = hflight.TrainingArguments("o", use_cpu=True, report_to="none")
    optimizer = hflight.Trainer(model, args).create_optimizer()
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def test_an_fsdp2_run_converts_a_ddp_checkpoint_and_continues_as_the_ddp_run(jobs):
    """DDP's checkpoint-3 (optimizer.pt: whole states by position) resumed by FSDP2 on 2 processes: the states it holds
    before its first step are the checkpoint's, bit for bit (each position's parameter named, the whole tensors cut to
    each process's shard by torch's set_optimizer_state_dict); the old behaviour loaded them as plain tensors into the
    DTensor-sharded optimizer and died in the first step ("aten._fused_adamw_.default got mixed torch.Tensor and
    DTensor"). It then trains as the DDP run it continues: FSDP2's step is DDP's arithmetic, the gradients summed in
    another order under accumulation and clipping (measured here: losses and gradient norms equal, weights up to
    1.2e-6 apart after 3 steps)."""
    from safetensors.torch import load_file

    ddp = jobs["root"] / "DDP"
    restored = torch.load(jobs["root"] / "ddp_to_fsdp2" / "restored.pt", weights_only=True)
    weights = load_file(ddp / "checkpoint-3" / "model.safetensors")
    assert all(torch.equal(restored["model"][k], weights[k]) for k in weights) and len(weights) >= 20
    saved, names = torch.load(ddp / "checkpoint-3" / "optimizer.pt", weights_only=True), _position_names()
    expected = {f"state.{names[pid]}.{key}": v for pid, entry in saved["state"].items() for key, v in entry.items()}
    ours = _flat(restored["optimizer"])
    assert set(ours) == set(expected) and all(torch.equal(ours[k], expected[k]) for k in expected)
    assert json.loads((jobs["root"] / "ddp_to_fsdp2" / "result.json").read_text())["sharded"]
    continued, uninterrupted = _history(jobs, "ddp_to_fsdp2"), _history(jobs, "DDP")
    assert [e["step"] for e in continued] == [e["step"] for e in uninterrupted] and len(continued) == 7
    for a, b in zip(uninterrupted[3:], continued[3:]):
        for key in ("loss", "grad_norm", "learning_rate"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-6, abs=0), (a["step"], key)
    ours_final, theirs = (load_file(jobs["root"] / n / "model.safetensors") for n in ("ddp_to_fsdp2", "DDP"))
    assert all(torch.allclose(ours_final[k], theirs[k], rtol=0, atol=1e-5) for k in theirs)


def test_deepspeed_and_the_other_forms_refuse_each_other_before_anything_is_loaded(jobs, tmp_path):
    """DeepSpeed's partitions are read by its engine only, and its engine reads nothing else: a DDP checkpoint in a
    DeepSpeed run, a ZeRO-3 checkpoint in a run without DeepSpeed (one process or FSDP2) stop in train() before any
    weight is copied, naming both forms and what to do."""
    fsdp2 = {"fsdp": True, "fsdp_config": {"state_dict_type": "SHARDED_STATE_DICT"}}
    cases = [
        (jobs["root"] / "DDP" / "checkpoint-3", {"deepspeed": {"zero_optimization": {"stage": 2}}},
         r"holds a one-process/DDP checkpoint \(optimizer\.pt.*this run writes DeepSpeed's own checkpoint.*resume it "
         r"without deepspeed"),
        (jobs["root"] / "ZERO3" / "checkpoint-3", {},
         r"holds DeepSpeed's own checkpoint.*this run writes a one-process/DDP checkpoint.*resume it with the "
         r"deepspeed config it was written with.*zero_to_fp32\.py"),
        (jobs["root"] / "ZERO3" / "checkpoint-3", fsdp2,
         r"holds DeepSpeed's own checkpoint.*this run writes a SHARDED_STATE_DICT checkpoint \(FSDP2's"),
    ]  # fmt: skip
    for folder, settings, message in cases:
        model = _tiny_gpt2()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        args = hflight.TrainingArguments(str(tmp_path / "out"), max_steps=6, use_cpu=True, report_to="none", **settings)
        data = [{"input_ids": torch.arange(16), "labels": torch.arange(16)}] * 8
        trainer = hflight.Trainer(model, args, train_dataset=data)
        with pytest.raises(ValueError, match=f"(?s)Checkpoint {re.escape(str(folder))}.*{message}"):
            trainer.train(resume_from_checkpoint=str(folder))
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def _history(jobs: dict, name: str) -> list[dict]:
    history = json.loads((jobs["root"] / name / "result.json").read_text())["log_history"]
    return [{k: v for k, v in e.items() if not k.endswith(("_runtime", "_per_second"))} for e in history]


def test_zero3_trains_as_fsdp2_and_continues_its_own_checkpoint_bit_for_bit(jobs):
    """ZeRO-3 and FSDP2 do the same arithmetic (each process steps the Trainer's AdamW on its shard of every
    parameter): the same learning rates, losses and gradient norms within 1e-6. Measured cause of the last bits: the
    gradient norm, summed over the partitions in float64 by DeepSpeed and over the DTensor shards in float32 by FSDP2
    (up to 1.2e-7 apart here), scales the gradients where it exceeds max_grad_norm (step 1: 1.054), and the losses
    after follow (up to 6e-8). Resumed from its checkpoint-3 (every process reads its own partitions back), ZeRO-3
    continues exactly as the run that did not stop."""
    fsdp, zero3, resumed = (_history(jobs, name) for name in ("SHARDED_STATE_DICT", "ZERO3", "zero3_resumed"))
    steps = [e for e in zero3 if "loss" in e]
    assert len(steps) == 6 and len(fsdp) == len(zero3)
    for a, b in zip(fsdp, zero3):
        assert a.keys() == b.keys() and a.get("learning_rate") == b.get("learning_rate")
        for key in ("loss", "grad_norm", "train_loss"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-6, abs=0), (a["step"], key)
    assert [e for e in zero3 if e["step"] > 3 and "loss" in e] == [e for e in resumed if e["step"] > 3 and "loss" in e]


def test_a_zero3_checkpoint_is_deepspeed_s_own_and_zero_to_fp32_rebuilds_its_weights(jobs):
    """checkpoint-N of a DeepSpeed run holds what transformers' holds: DeepSpeed's global_stepN/ (each process's
    partitions), latest and zero_to_fp32.py, and, with stage3_gather_16bit_weights_on_model_save, the gathered
    model.safetensors; zero_to_fp32 (DeepSpeed's own route) rebuilds the same weights, under the model's own names.
    Without the option, save_model writes DeepSpeed's checkpoint and no weights, saying so, as transformers."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    folder = jobs["root"] / "ZERO3" / "checkpoint-3"
    names = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    partitions = {f"global_step3/zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in (0, 1)
                  for kind in ("model", "optim")}  # fmt: skip
    assert partitions | {"latest", "zero_to_fp32.py", "model.safetensors", "scheduler.pt"} <= names
    assert partitions <= set(read_manifest(folder)["files"]) and verify_checkpoint(folder, full=True)
    gathered = load_file(folder / "model.safetensors")
    rebuilt = get_fp32_state_dict_from_zero_checkpoint(str(folder))
    assert set(gathered) <= set(rebuilt) and all(torch.equal(rebuilt[k], gathered[k]) for k in gathered)
    final = jobs["root"] / "zero3_resumed"
    assert "stage3_gather_16bit_weights_on_model_save=false. Saving the full checkpoint instead" in jobs["logs"][
        "zero3_resumed"]  # fmt: skip
    assert not (final / "model.safetensors").exists() and (final / "global_step6").is_dir()
    assert (final / "zero_to_fp32.py").is_file() and (final / "config.json").is_file()
    assert not (final / "checkpoint-6" / "model.safetensors").exists()
    # what transformers' save_model writes into its checkpoints then: all but the weights
    assert {"config.json", "training_args.bin"} <= {p.name for p in (final / "checkpoint-6").iterdir()}
    assert jobs["logs"]["zero3_resumed"].count("Saving the full checkpoint instead") >= 2  # each save, as transformers
    verify_checkpoint(final / "checkpoint-6", full=True)  # DeepSpeed's partitions are its weights


def test_a_sharded_run_stopped_or_killed_restarts_from_its_last_checkpoint_and_ends_as_the_uninterrupted_run(jobs):
    """torchrun restarts the workers, which continue from the last complete sharded checkpoint: SIGTERM to rank 0
    alone during step 5 (every rank stops at the step boundary, checkpoint-5 written by all, then the restart continues
    it); in that restart rank 0 SIGKILLed while it writes checkpoint-6 (its shards and the other rank's on disk, the
    folder never published, so the second restart takes checkpoint-5 again, the half-written one removed). The log
    history (train_loss included: a continued run keeps the loss bookkeeping) and the weights are the uninterrupted
    run's, bit for bit. (One job for both faults: each restart is the same resume_from_checkpoint="auto".)"""
    from safetensors.torch import load_file

    name = "stopped_then_killed"
    log, folder = jobs["logs"][name], jobs["root"] / name
    stopped = log.index("Training stopped by SIGTERM after step 5 of 6; checkpoint saved in")
    resumed = f"resuming from {folder / 'checkpoint-5'}, the last valid checkpoint"
    assert log.index("left behind by a checkpoint save or deletion that was interrupted") > log.index(resumed, stopped)
    # each attempt says where it starts as often as the first (fresh) one: both restarts from checkpoint-5
    fresh = log.count(f"no valid checkpoint in {folder}; starting fresh")
    assert fresh >= 1 and log.count(resumed) == 2 * fresh, log[-3000:]
    assert not any(f"resuming from {folder / f'checkpoint-{n}'}" in log for n in (3, 6))
    assert _history(jobs, name) == _history(jobs, "SHARDED_STATE_DICT")
    ours, reference = (load_file(jobs["root"] / n / "model.safetensors") for n in (name, "SHARDED_STATE_DICT"))
    assert ours.keys() == reference.keys() and all(ours[k].equal(reference[k]) for k in ours)


def test_a_damaged_or_missing_shard_makes_the_checkpoint_invalid_and_resume_auto_takes_the_one_before(jobs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(jobs["root"] / "SHARDED_STATE_DICT", run, ignore=shutil.ignore_patterns("result.json"))
    shard = run / "checkpoint-6" / "pytorch_model_fsdp_0" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    verify_checkpoint(run / "checkpoint-6")  # sizes still match: only the checksum finds it
    with pytest.raises(IncompleteCheckpointError, match=r"pytorch_model_fsdp_0/__1_0\.distcp is damaged"):
        verify_checkpoint(run / "checkpoint-6", full=True)
    (run / "checkpoint-6" / "optimizer_0" / "__0_0.distcp").unlink()
    with pytest.raises(IncompleteCheckpointError, match=r"no optimizer_0/__0_0\.distcp"):
        verify_checkpoint(run / "checkpoint-6")
    assert get_last_checkpoint(run) == str(run / "checkpoint-3")


class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_a_crafted_metadata_file_is_refused_without_running_it(jobs, tmp_path):
    """torch's own reader unpickles a distributed checkpoint's .metadata with plain pickle; hflight's refuses anything
    but the metadata classes."""
    folder = tmp_path / "pytorch_model_fsdp_0"
    shutil.copytree(jobs["sharded"] / "pytorch_model_fsdp_0", folder)
    assert read_metadata(folder).state_dict_metadata
    (folder / ".metadata").write_bytes(pickle.dumps(_Exploit()))
    with pytest.raises(UnsafeCheckpointFile, match=r"\.metadata cannot be loaded safely: .*posix\.system"):
        read_metadata(folder)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_metadata_entry_stored_outside_its_folder_is_refused_naming_the_entry(tmp_path):
    """torch's reader opens each entry's ``_StorageInfo.relative_path`` joined to the folder as it is: a crafted
    ``.metadata`` naming ``../``, an absolute path or a link leading elsewhere would read another checkpoint's (or any)
    file. hflight refuses it, naming the entry and the path, before anything is read."""
    import torch.distributed.checkpoint as dcp

    folder, elsewhere = tmp_path / "run" / "checkpoint-2" / "optimizer_0", tmp_path / "elsewhere"
    dcp.save({"optimizer": {"w": torch.ones(3)}}, checkpoint_id=str(folder), no_dist=True)
    dcp.save({"optimizer": {"w": torch.full((3,), 7.0)}}, checkpoint_id=str(elsewhere), no_dist=True)
    shard = next(folder.glob("*.distcp")).name
    (folder / "link.distcp").symlink_to(elsewhere / shard)
    written = read_metadata(folder)
    state = {"optimizer": {"w": torch.zeros(3)}}
    load_dcp(folder, state, collective=False)
    assert torch.equal(state["optimizer"]["w"], torch.ones(3)), "the folder as written reads"
    outside = os.path.relpath(elsewhere / shard, folder)
    for relative in (outside, str(elsewhere / shard), "link.distcp"):
        for info in written.storage_data.values():
            info.relative_path = relative
        (folder / ".metadata").write_bytes(pickle.dumps(written))
        untouched = {"optimizer": {"w": torch.zeros(3)}}
        dcp.load(untouched, checkpoint_id=str(folder), no_dist=True)  # torch's own reader follows it
        assert torch.equal(untouched["optimizer"]["w"], torch.full((3,), 7.0)), relative
        entry = re.escape(f"{folder / '.metadata'} (the entry 'optimizer.w')")
        shown = re.escape(repr(relative)) if relative != "link.distcp" else re.escape(str(folder / "link.distcp"))
        for read, arguments in ((read_metadata, ()), (load_dcp, (untouched, False)), (tensor_shapes, ("optimizer",))):
            with pytest.raises(UnsafeCheckpointFile, match=f"^{entry}.*{shown}.*outside the checkpoint folder"):
                read(folder, *arguments)


# ---- bad settings, refused before any process group starts --------------------------------------------------------
#: the best checkpoint loaded at the end (evaluated and saved at the same steps)
BEST_AT_END = {"load_best_model_at_end": True, "eval_strategy": "steps", "save_steps": 2, "eval_steps": 2}


def _args(**fsdp) -> hflight.TrainingArguments:
    return hflight.TrainingArguments("o", accelerator="cpu", devices=2, report_to="none", **fsdp)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"fsdp": True, "fsdp_config": {"transformer_layer_cls_to_wrap": ["NoSuchLayer"]}},
         r"fsdp_config\['transformer_layer_cls_to_wrap'\] names \['NoSuchLayer'\]"),
        ({"fsdp": True, "fsdp_config": {"min_num_param": 10}}, r"fsdp_config has keys transformers does not know: "
                                                              r"min_num_param"),
        ({"fsdp": True, "fsdp_config": {"state_dict_type": "LOCAL_STATE_DICT"}},
         r"fsdp_config\['state_dict_type'\]='LOCAL_STATE_DICT': FSDP2 writes FULL_STATE_DICT or SHARDED_STATE_DICT"),
        ({"fsdp": True, "fsdp_config": {"backward_prefetch": "BACKWARD_PRE"}},
         r"sets backward_prefetch, which only FSDP1"),
        ({"fsdp": True, "fsdp_config": {"xla": True}}, r"fsdp_config\['xla'\]=True is FSDP on TPUs"),
        # transformers' Trainer.__init__ refusals, word for word (hflight used to fail at the end of training: "has no
        # model weights" in the best checkpoint)
        ({"fsdp": True, "save_only_model": True, **BEST_AT_END},
         r"FSDP can't be used with `save_only_model` along with `load_best_model_at_end`\."),
        ({"fsdp": True, "save_only_model": True, "fsdp_config": {"state_dict_type": "SHARDED_STATE_DICT"}},
         r"save_only_model option is not compatible with FSDP state dict type 'SHARDED_STATE_DICT'"),
    ],
)  # fmt: skip
def test_fsdp_settings_that_cannot_run_are_refused_naming_the_key(settings, message, factory):
    with pytest.raises(ValueError, match=message):
        lightning_kwargs.strategy_for(_args(**settings), factory.cls_model())


def test_fsdp_needs_a_launcher_and_refuses_deepspeed_beside_it(factory, monkeypatch):
    """As transformers: fsdp in one process that no launcher started is refused; under torchrun with one process it
    shards over that process (FSDP on one rank)."""
    from hflight.sharding.fsdp import FSDP2Strategy

    one = hflight.TrainingArguments("o", accelerator="cpu", devices=1, fsdp=True, report_to="none")
    with pytest.raises(ValueError, match="Using fsdp only works in distributed training"):  # transformers' words
        lightning_kwargs.strategy_for(one, factory.cls_model())
    with pytest.raises(ValueError, match="fsdp and deepspeed and strategy='auto' each choose"):
        hflight.TrainingArguments("o", fsdp=True, deepspeed={"zero_optimization": {"stage": 2}})
    with pytest.raises(ValueError, match="shard_what"):  # an fsdp string transformers does not know: its own error
        hflight.TrainingArguments("o", fsdp="shard_what")
    torchrun_1 = {"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}  # torchrun's variables
    for name, value in {**torchrun_1, "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    strategy = lightning_kwargs.strategy_for(hflight.TrainingArguments("o", fsdp=True, report_to="none"),
                                             factory.cls_model())  # fmt: skip
    assert isinstance(strategy, FSDP2Strategy) and strategy.plan.hybrid is None


def test_sharded_states_with_save_on_each_node_on_two_nodes_are_refused(factory):
    args = hflight.TrainingArguments("o", accelerator="cpu", devices=1, num_nodes=2, save_on_each_node=True,
                                     fsdp=True, fsdp_config={"state_dict_type": "SHARDED_STATE_DICT"},
                                     report_to="none")  # fmt: skip
    with pytest.raises(ValueError, match=r"SHARDED_STATE_DICT' with save_on_each_node=True"):
        lightning_kwargs.strategy_for(args, factory.cls_model())


def test_fsdp2_settings_are_transformers_normalised_ones(factory):
    from hflight.sharding.fsdp import FSDP2Strategy

    args = _args(fsdp="shard_grad_op offload auto_wrap", bf16=True,
                 fsdp_config={"transformer_layer_cls_to_wrap": "BertLayer", "activation_checkpointing": True,
                              "cpu_ram_efficient_loading": True, "state_dict_type": "SHARDED_STATE_DICT"})  # fmt: skip
    strategy = lightning_kwargs.strategy_for(args, factory.cls_model())
    assert isinstance(strategy, FSDP2Strategy)
    plan = strategy.plan
    assert (plan.reshard_after_forward, plan.cpu_offload, plan.activation_checkpointing) == (False, True, True)
    assert (plan.cpu_ram_efficient_loading, plan.state_dict_type, plan.param_dtype) == (
        True, "SHARDED_STATE_DICT", torch.bfloat16)  # fmt: skip
    from transformers.models.bert.modeling_bert import BertLayer

    layer = next(m for m in factory.cls_model().modules() if isinstance(m, BertLayer))
    assert plan.wrap(layer) and not plan.wrap(factory.cls_model())
    size = _args(fsdp=True, fsdp_config={"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 10**9})
    assert not plans.fsdp2_plan(size, factory.cls_model(), 2).wrap(factory.cls_model())
