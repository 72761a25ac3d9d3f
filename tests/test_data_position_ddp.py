"""The training data's position under torchrun, 2 processes (issue 63, item 2; issue 66): a stream dispatched from
process 0 (dispatch_batches, the default for an iterable dataset) and a stream each process reads its own part of
(split_dataset_by_node, dispatch_batches=False), each run for 40 steps with a checkpoint every 10 and resumed from
its checkpoint-30 (tests/jobs/stream_job.py): the resumed run reads only what its remaining steps need and ends on
the uninterrupted run's weights and losses, bit for bit. The oracle of trained examples (tests/jobs/trained_ids.py)
runs its chain of three resumes on 2 processes: dispatched, split per process, each process its own files (another
number of files on each: case 9), a torch stream each process reads (read and dropped). On another number of
processes (2 to 1, in this process; 1 to 2) the dispatched stream continues from the next example; the per-process
one reads and drops the trained batches, as transformers does, saying why."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from . import launch

pytestmark = launch.needs_torchrun
sys.path.insert(0, str(launch.JOBS))

JOB = launch.JOBS / "stream_job.py"
HOWS = ("dispatched", "per_process")
STEPS, RESUMED_AT, BATCH, PROCESSES = 40, 30, 4, 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """For each way of reading: ``<how>/full`` (40 steps) and ``<how>/resumed`` (from full/checkpoint-30)."""
    root = tmp_path_factory.mktemp("stream_ddp")
    for phase in ("full", "resumed"):
        jobs = {}
        for how in HOWS:
            out = root / how / phase
            out.mkdir(parents=True)
            resume = ["--resume", root / how / "full" / f"checkpoint-{RESUMED_AT}"] if phase == "resumed" else []
            jobs[how] = launch.Job([*launch.torchrun(PROCESSES), JOB, out, "--how", how, *resume], out,
                                   env=launch.environment(launch.JOBS))  # fmt: skip
        launch.all_ok(jobs)
    return root


def _result(folder: Path, rank: int) -> dict:
    return json.loads((folder / f"rank{rank}.json").read_text())


@pytest.mark.parametrize("how", HOWS)
def test_each_process_continues_its_stream_and_ends_on_the_uninterrupted_run(runs, how):
    full, resumed = runs / how / "full", runs / how / "resumed"
    weights, resumed_weights = torch.load(full / "final.pt"), torch.load(resumed / "final.pt")
    assert all(torch.equal(weights[name], resumed_weights[name]) for name in weights)
    position = torch.load(full / f"checkpoint-{RESUMED_AT}" / "data_position.pt", weights_only=True)
    assert position["loader"]["how"] == how and len(position["ranks"]) == PROCESSES
    remaining = (STEPS - RESUMED_AT) * BATCH
    for rank in range(PROCESSES):
        before, after = _result(full, rank), _result(resumed, rank)
        assert after["first_step"] == RESUMED_AT + 1 and after["losses"] == before["losses"]
        assert after["trained"] == before["trained"][-remaining:], f"rank {rank} trained other examples"
        if how == "dispatched":  # process 0 reads for both: the remaining global batches, two read ahead
            read = (remaining * PROCESSES + 2 * BATCH * PROCESSES) if rank == 0 else 0
            assert after["produced"] == read, f"rank {rank} produced {after['produced']}"
        else:  # each its own part (100 examples: the checkpoint is in its second pass), one batch read ahead
            assert after["produced"] == remaining + 2 * BATCH, f"rank {rank} produced {after['produced']}"
            assert before["produced"] > 3 * after["produced"]


@pytest.fixture
def job(monkeypatch):
    monkeypatch.syspath_prepend(str(launch.JOBS))
    import stream_job

    stream_job.PRODUCED = 0
    return stream_job


def test_a_dispatched_stream_continues_from_the_same_example_on_another_number_of_processes(runs, job, tmp_path):
    """Process 0 alone read the stream; one process continues where it was: the examples after the 30 x 8 trained,
    in order, none repeated or dropped."""
    checkpoint = tmp_path / f"checkpoint-{RESUMED_AT}"
    shutil.copytree(runs / "dispatched" / "full" / checkpoint.name, checkpoint)
    trainer = job.trainer(str(tmp_path), "dispatched", 0, 1)
    trainer.train(resume_from_checkpoint=str(checkpoint))
    order = job.windows()["input_ids"]
    start = RESUMED_AT * BATCH * PROCESSES
    assert trainer.trained == order[start : start + (STEPS - RESUMED_AT) * BATCH]
    assert job.PRODUCED <= (STEPS - RESUMED_AT) * BATCH + 2 * BATCH


def test_a_dispatched_stream_of_one_process_continues_on_two_from_the_next_example(job, tmp_path):
    """The other way: one process trains 30 steps of 4; two processes resumed from its checkpoint-30 train the
    examples after the 120 trained, process 0 the first 4 of each global batch of 8, process 1 the next 4."""
    job.trainer(str(tmp_path / "one"), "dispatched", 0, 1).train()
    out = tmp_path / "two"
    out.mkdir()
    resume = ["--resume", tmp_path / "one" / f"checkpoint-{RESUMED_AT}"]
    launch.Job([*launch.torchrun(PROCESSES), JOB, out, "--how", "dispatched", *resume], out,
               env=launch.environment(launch.JOBS)).ok()  # fmt: skip
    order, start = job.windows()["input_ids"], RESUMED_AT * BATCH
    for rank in range(PROCESSES):
        result = _result(out, rank)
        assert result["first_step"] == RESUMED_AT + 1
        expected = [order[start + PROCESSES * BATCH * step + rank * BATCH + row]
                    for step in range(STEPS - RESUMED_AT) for row in range(BATCH)]  # fmt: skip
        assert result["trained"] == expected, f"rank {rank} trained other examples"
    assert _result(out, 0)["produced"] <= (STEPS - RESUMED_AT + 2) * BATCH * PROCESSES


def test_a_per_process_stream_on_another_number_of_processes_reads_and_drops_as_transformers(runs, job, tmp_path,
                                                                                             caplog):  # fmt: skip
    """Each part's position is its own and the parts cannot be dealt again: the trained batches are read and dropped
    (transformers' arithmetic: 30 batches of the one process's stream), with one line saying why."""
    checkpoint = tmp_path / f"checkpoint-{RESUMED_AT}"
    shutil.copytree(runs / "per_process" / "full" / checkpoint.name, checkpoint)
    trainer = job.trainer(str(tmp_path), "per_process", 0, 1)
    trainer.train(resume_from_checkpoint=str(checkpoint))
    assert "saved by 2 process(es) each reading its own part of the stream and this run has 1" in caplog.text
    order = job.windows()["input_ids"]
    start = RESUMED_AT * BATCH
    assert trainer.trained == order[start : start + (STEPS - RESUMED_AT) * BATCH]


@pytest.fixture(scope="module")
def oracle(tmp_path_factory) -> Path:
    """The oracle's chains of every multi-process cell (tests/jobs/trained_ids.py), in one launch."""
    out = tmp_path_factory.mktemp("oracle")
    launch.Job([*launch.torchrun(PROCESSES), launch.JOBS / "trained_ids.py", out], out,
               env=launch.environment(launch.JOBS)).ok()  # fmt: skip
    return out


CELLS = {"dispatched": True, "per_process": True, "per_process_own_files": True, "per_process_torch": False,
         "dispatched_refusing": False}  # fmt: skip


@pytest.mark.parametrize("cell", list(CELLS))
def test_every_resume_on_two_processes_trains_the_uninterrupted_runs_examples(oracle, cell):
    """Each process's ids, step for step, at each of three chained resumes; from their position (reading only the
    remaining steps' examples) where the stream has a state, else read and dropped; a dispatched stream whose dataset
    refuses the position (at its first example) is read and dropped by process 0 alone (the other process took the
    dropped batches for its own and the run hung)."""
    import trained_ids

    remaining = [(trained_ids.STEPS - at) * trained_ids.BATCH for at in (8, 16, 24)]
    for rank in range(PROCESSES):
        record = json.loads((oracle / cell / f"rank{rank}.json").read_text())
        full = {int(step): ids for step, ids in record["full"].items()}
        for (_, at, trained, produced), needed in zip(record["resumes"], remaining):
            problem = trained_ids.mismatch(full, {int(step): ids for step, ids in trained.items()}, at)
            assert problem is None, f"rank {rank}: {problem}"
            if CELLS[cell] and not (cell == "dispatched" and rank == 1):
                reads = needed * (PROCESSES if cell == "dispatched" else 1)
                assert produced <= reads + 3 * trained_ids.BATCH * PROCESSES, f"rank {rank} read {produced}"
