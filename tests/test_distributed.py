"""Several processes: Lightning's DDP on CPU against one process with the same global batch."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, SequentialSampler

import hflight
from hflight.run import distributed
from hflight.run.datamodule import ShardedBatchSampler, shard_loader

from . import launch
from .support import torch_file_records

JOB = Path(__file__).parent / "jobs" / "ddp_job.py"


def run_job(out: Path, devices: int, batch_size: int, *extra: str) -> dict:
    """tests/jobs/ddp_job.py in ``out`` (rank 1, launched by rank 0, is in its session: killed with it if it hangs)."""
    command = [sys.executable, JOB, out, "--devices", devices, "--batch-size", batch_size, *extra]
    launch.Job(command, out, merge=False, console=out.parent / f"{out.name}.console.txt", timeout=300).ok()
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, dict, Path, Path]:
    """One process, and the DDP job, whose two processes then run the same training with save_async (async_run) and
    a last one whose background write fails on rank 0: one launch of two processes for the three."""
    one, two = tmp_path_factory.mktemp("one_process"), tmp_path_factory.mktemp("ddp")
    return run_job(one, 1, 8), run_job(two, 2, 4, "--then-save-async", "--then-fail-a-write"), one, two


@pytest.fixture(scope="module")
def async_run(runs) -> tuple[dict, Path]:
    """The DDP job's run with save_async, in the processes of its synchronous run (``runs``), then its training whose
    background write fails on rank 0."""
    folder = runs[3] / "save_async"
    return json.loads((folder / "result.json").read_text()), folder


def test_ddp_with_save_async_writes_the_synchronous_checkpoints_and_ends_the_same(runs, async_run):
    """save_async under DDP: rank 0 writes in the background, every rank its RNG file at the step boundary; the
    checkpoints are the synchronous run's byte for byte (but the output folder in training_args.bin, and so the
    manifest's checksum of it; optimizer.pt record for record), the run ends the same. The trainer's
    ``_save_checkpoint`` writes ``own_state.json`` into ``checkpoint-N`` after ``super()`` on rank 0 (TRL's
    GRPOTrainer's form): the folder is there for it, and the file is kept in the published checkpoint."""
    from hflight.checkpoints.manifest import verify_checkpoint

    _, ddp, _, two = runs
    result, folder = async_run
    assert result["checkpoints"] == ddp["checkpoints"] and result["train_loss"] == ddp["train_loss"]
    final, reference = torch.load(folder / "final.pt"), torch.load(two / "final.pt")
    assert all(torch.equal(final[k], reference[k]) for k in reference)
    for name in ddp["checkpoints"]:
        ours, theirs = folder / name, two / name
        assert json.loads((ours / "own_state.json").read_text()) == {"step": int(name.split("-")[1])}
        assert verify_checkpoint(ours, full=True) is not None
        assert sorted(p.name for p in ours.iterdir()) == sorted([*(p.name for p in theirs.iterdir()), "own_state.json"])
        differ = [p.name for p in sorted(ours.iterdir())
                  if p.name != "own_state.json" and p.read_bytes() != (theirs / p.name).read_bytes()]  # fmt: skip
        # optimizer.pt: written in the background in torch's records, not its zip framing (tests/support.py)
        allowed = {"checkpoint_manifest.json", "training_args.bin", "trainer_state.json", "optimizer.pt"}
        assert set(differ) <= allowed, (name, differ)
        records = [torch_file_records(f / "optimizer.pt") for f in (ours, theirs)]
        assert list(records[0]) == list(records[1])
        assert [k for k in records[0] if records[0][k] != records[1][k]] in ([], [".data/serialization_id"])
        untimed = [_untimed(json.loads((f / "trainer_state.json").read_text())) for f in (ours, theirs)]
        assert untimed[0] == untimed[1]  # the evaluation's timings apart


def test_a_failed_background_write_under_ddp_stops_every_rank_with_its_error(async_run):
    """Only rank 0 writes in the background; when that write fails, every rank stops at the same step boundary with
    the same CheckpointWriteError (none goes on into the next collective), and the checkpoint before it is intact."""
    from hflight.checkpoints.manifest import get_last_checkpoint, verify_checkpoint

    _, folder = async_run
    outcomes = [json.loads((folder / f"failed_write_{rank}.json").read_text()) for rank in (0, 1)]
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0]["error"] == "CheckpointWriteError" and outcomes[0]["global_step"] < 8, outcomes[0]
    assert re.search(r"checkpoint-4: writing optimizer\.pt failed: no space left on device", outcomes[0]["message"])
    run = folder / "failed_write"
    assert get_last_checkpoint(run) == str(run / "checkpoint-2")
    assert verify_checkpoint(run / "checkpoint-2", full=True) is not None
    assert not list(run.glob(".tmp-*"))
    # the folder made for the override's file went with the checkpoint whose write failed
    assert sorted(p.name for p in run.glob("*checkpoint-*")) == ["checkpoint-2"]
    assert (run / "checkpoint-2" / "own_state.json").is_file()


def _untimed(state: dict) -> dict:
    timing = ("_runtime", "_per_second")
    state["log_history"] = [{k: v for k, v in e.items() if not k.endswith(timing)} for e in state["log_history"]]
    return state


def train_logs(result: dict) -> list[dict]:
    return [entry for entry in result["log_history"] if "loss" in entry]


@pytest.mark.subprocess
def test_ddp_trains_like_one_process_with_the_same_global_batch(runs):
    single, ddp, one, two = runs
    assert (single["world_size"], ddp["world_size"]) == (1, 2)
    assert ddp["global_step"] == single["global_step"] == 6  # 40 examples / 8 per step / GA 2 -> 3 cycles, 2 epochs
    for a, b in zip(train_logs(single), train_logs(ddp), strict=True):
        assert (a["step"], a["epoch"], a["learning_rate"]) == (b["step"], b["epoch"], b["learning_rate"])
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)  # the logged loss is averaged over the ranks
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)  # of the all-reduced gradients
    assert ddp["train_loss"] == pytest.approx(single["train_loss"], rel=1e-6)
    params_one, params_two = torch.load(one / "final.pt"), torch.load(two / "final.pt")
    assert max((params_one[k] - params_two[k]).abs().max().item() for k in params_one) < 1e-5


@pytest.mark.subprocess
def test_ddp_gathers_evaluation_in_dataset_order_without_the_padding_repeats(runs):
    single, ddp, _, _ = runs
    # evaluate(): 12 examples fill whole global batches; loss and compute_metrics(EvalPrediction) agree.
    assert ddp["eval"]["eval_loss"] == pytest.approx(single["eval"]["eval_loss"], rel=1e-5)
    assert ddp["eval"]["eval_count"] == single["eval"]["eval_count"] == 12
    assert ddp["eval"]["eval_exact"] == single["eval"]["eval_exact"]
    # predict(): 11 examples, so the last global batch carries a repeated example that must be dropped.
    predictions, reference = np.array(ddp["predictions"]), np.array(single["predictions"])
    assert predictions.shape == reference.shape == (2, 11, 16)
    np.testing.assert_allclose(predictions, reference, atol=1e-5)
    assert ddp["label_ids"] == single["label_ids"]
    assert ddp["test_metrics"]["test_count"] == 11


@pytest.mark.subprocess
def test_evaluate_and_predict_as_the_first_calls_under_ddp_match_one_process_and_transformers(runs):
    """evaluate() and predict() before any training are the calls that launch the processes: the launching process
    built its loader before the launch (one process, unsharded), the launched rank after it (sharded); both must
    iterate the same shard of batches, and the gathered outputs come back in dataset order, each sample once."""
    single, ddp, _, _ = runs
    reference = single["transformers_first"]
    for result in (single, ddp):
        first = result["first"]
        assert first["eval"]["eval_count"] == 12 and first["test_count"] == 11
        assert first["eval"]["eval_exact"] == reference["eval"]["eval_exact"]
        assert first["eval"]["eval_loss"] == pytest.approx(reference["eval"]["eval_loss"], rel=1e-5)
        predictions = np.array(first["predictions"])
        assert predictions.shape == (2, 11, 16)
        np.testing.assert_allclose(predictions, np.array(reference["predictions"]), atol=1e-5)
        assert first["label_ids"] == reference["label_ids"]


@pytest.mark.subprocess
def test_ddp_checkpoints_and_events_match_one_process(runs):
    single, ddp, _, two = runs
    assert ddp["events"] == single["events"]  # each HF event once (rank 0's view), in the same order
    assert ddp["events"][0] == ["evaluate", 0]  # the evaluate() before train()
    assert ddp["checkpoints"] == single["checkpoints"] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    folder = two / "checkpoint-6"
    # HF's layout: one RNG file per rank, everything else written once by rank 0; no half-written folder left.
    assert {"rng_state_0.pth", "rng_state_1.pth", "trainer_state.json", "model.safetensors"} <= {
        p.name for p in folder.iterdir()
    }
    assert not any(p.name.startswith(".tmp-checkpoint") for p in two.iterdir())
    assert json.loads((folder / "trainer_state.json").read_text())["global_step"] == 6
    # The manifest (checksums of every rank's files) verifies, and a resume reads the RNG files of both ranks by the
    # names a 2-process run writes; the writer lock (rank 0's) is gone.
    from hflight.checkpoints.manifest import verify_checkpoint
    from hflight.checkpoints.parts import rng_files

    manifest = verify_checkpoint(folder, full=True)
    assert manifest["run"]["world_size"] == 2
    assert [p.name for p in rng_files(folder, manifest)] == ["rng_state_0.pth", "rng_state_1.pth"]
    assert not (two / ".hflight-writer.lock").exists()


def test_each_rank_ends_its_process_group_before_the_interpreter_teardown(runs):
    """hflight's end of the group (``hflight.arguments.process_group.end``, at exit) destroys it with its gloo worker
    threads joined on each rank, so none is left to take the interpreter lock while Python finalizes (the abort
    "terminate called without an active exception")."""
    two = runs[3]
    assert sorted(p.name for p in two.glob("gloo_threads_at_exit_*.txt")) == [
        "gloo_threads_at_exit_0.txt",
        "gloo_threads_at_exit_1.txt",
    ]
    assert {p.read_text() for p in two.glob("gloo_threads_at_exit_*.txt")} == {"0"}


class FakeStrategy:
    """Two ranks as rank 0 sees them: ``other`` is what rank 1 contributes for each gathered tensor."""

    world_size = 2

    def __init__(self, other):
        self.other = other
        self.groups = []

    def all_gather(self, tensor, group=None):
        self.groups.append(group)
        return torch.stack([tensor, self.other(tensor)])


def test_pad_across_processes_pads_to_the_longest_rank_and_leaves_the_rest():
    # Rank 1's sequences are 5 long; ours 3: pad with -100 along dim 1. Non-tensors pass through.
    strategy = FakeStrategy(lambda t: torch.tensor(5) if t.dim() == 0 else t)
    value = {"logits": (torch.ones(2, 3), torch.zeros(2, 3)), "name": "x", "scalar": torch.tensor(1.0)}
    padded = distributed.pad_across_processes(strategy, value)
    assert padded["logits"][0].shape == (2, 5) and padded["logits"][0][:, 3:].eq(-100).all()
    assert padded["logits"][0][:, :3].eq(1).all() and padded["name"] == "x" and padded["scalar"].dim() == 0
    longest = distributed.pad_across_processes(FakeStrategy(lambda t: torch.tensor(2)), torch.ones(2, 3))
    assert longest.shape == (2, 3)  # already the longest: unchanged


def test_gather_concatenates_nested_tensors_in_rank_order():
    strategy = FakeStrategy(lambda t: t + 10)
    gathered = distributed.gather(strategy, (torch.tensor([1, 2]), [torch.tensor([[3]])]))
    assert gathered[0].tolist() == [1, 2, 11, 12] and gathered[1][0].tolist() == [[3], [13]]
    assert distributed.gather(None, "same") == "same"  # one process: identity
    # the strategy's own group (the data-parallel ranks under tensor parallelism), or every process, padding included
    assert strategy.groups == [None, None]
    distributed.gather(strategy, torch.ones(2, 3), pad_dim=1, whole_world=True)
    assert strategy.groups[2:] == [torch.distributed.group.WORLD] * 2


def test_a_loader_built_for_one_process_is_dealt_to_the_ranks_it_runs_in():
    """What the launching process of Lightning's launcher built before the launch (one process: every batch) becomes
    its shard once it runs as rank r of n: batches r, r + n, ..., the last one filled from the start (as a launched
    rank's own loader); a loader already dealt for this world, and one process, are left as they are."""
    data = list(range(11))
    loader = DataLoader(data, batch_size=3, sampler=SequentialSampler(data), collate_fn=lambda rows: rows)
    assert [list(batch) for batch in loader] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10]]
    assert [list(b) for b in shard_loader(loader, 2, 0)] == [[0, 1, 2], [6, 7, 8]]
    assert [list(b) for b in shard_loader(loader, 2, 1)] == [[3, 4, 5], [9, 10, 0]]
    assert shard_loader(loader, 1, 0) is loader
    batches = ShardedBatchSampler(SequentialSampler(data), 3, False, 2, 1)
    dealt = DataLoader(data, batch_sampler=batches, collate_fn=lambda rows: rows)
    assert shard_loader(dealt, 2, 1) is dealt
    # dealt for another world: dealt again, as accelerate's BatchSamplerShard deals 4 batches to 3 ranks (the second
    # round is completed with the samples that follow those that filled the short batch: [9, 10, 0], [1, 2, 3], ...)
    assert [list(b) for b in shard_loader(dealt, 3, 2)] == [[6, 7, 8], [4, 5, 6]]


def test_fsdp1_on_the_cpu_is_refused_before_anything_is_launched(tmp_path, factory):
    """FSDP1 (fsdp_config version 1): Lightning's FSDPStrategy refuses the CPU ("The strategy `fsdp` requires a GPU
    accelerator, but received `accelerator='cpu'`", raised deep inside lightning.Trainer): hflight says so naming the
    setting, before a lightning.Trainer exists or a process is launched, whether the CPU was asked for or is what
    "auto" finds. (FSDP2, transformers' default, runs on the CPU: tests/test_sharding.py.)"""
    for accelerator in ("cpu", "auto") if not torch.cuda.is_available() else ("cpu",):
        args = hflight.TrainingArguments(output_dir=str(tmp_path), accelerator=accelerator, devices=2,
                                         fsdp=True, fsdp_config={"version": 1, "reshard_after_forward": "full_shard"},
                                         report_to="none", disable_tqdm=True)  # fmt: skip
        trainer = hflight.Trainer(factory.qa_model(), args, train_dataset=factory.qa_dataset(8))
        message = (
            rf"fsdp_config\['version'\]=1 \(FSDP1\) needs CUDA GPUs: .*FSDPStrategy.* is 'cpu' "
            rf"\(accelerator='{accelerator}'\)"
        )
        with pytest.raises(ValueError, match=message):
            trainer.train()
        with pytest.raises(ValueError, match=message):
            trainer.evaluate(factory.qa_dataset(4))
        assert trainer.lightning_trainer is None and "WORLD_SIZE" not in os.environ
