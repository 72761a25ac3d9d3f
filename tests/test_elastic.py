"""torchrun's restarts through hflight's checkpoints: a worker dies, torchrun starts the workers again, they
continue from the last complete checkpoint and end with the uninterrupted run's results.

The commands are docs/hydra.md's, as written (tiny sizes appended, and a fault: ``tests/jobs/cluster_faults.py``):
one machine with 2 processes (``--standalone --max-restarts``), worker rank 1 SIGKILLed during step 9; and two
"nodes" of one process each on 127.0.0.1 (two torchrun agents, c10d rendezvous), rank 0 SIGKILLed while it writes
the last checkpoint, which is then never used. Both are compared with the same command without a fault.
"""

from __future__ import annotations

import csv

import pytest

from . import launch
from .cluster_runs import ELASTIC, TWO_NODES, Reference, finish, outcome, start, torchrun_argv
from .support import fresh_clone

FAULT = ["+callbacks.fault._target_=cluster_faults.SignalAt", "+callbacks.fault.signal=SIGKILL",
         "+callbacks.fault.target=self"]  # fmt: skip

pytestmark = launch.needs_torchrun


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The jobs at once, the uninterrupted reference among them (the cores are shared; the restarts wait on each
    other's processes anyway). Each "node" runs in a copy of the repository of its own: its own disk."""
    reference = Reference.get()
    root = tmp_path_factory.mktemp("elastic")
    one, nodes = fresh_clone(root / "one"), [fresh_clone(root / f"node{n}") for n in range(2)]
    port = launch.free_port()
    killed = [*FAULT, "+callbacks.fault.step=9", "+callbacks.fault.rank=1"]
    writing = [*FAULT, "+callbacks.fault.step=14", "+callbacks.fault.rank=0", "+callbacks.fault.moment=writing"]
    started = {
        "killed": [start(torchrun_argv(ELASTIC, "outputs/killed", *killed), one, "killed")],
        "two_nodes": [
            start(torchrun_argv(TWO_NODES, "outputs/two_nodes", *writing, port=port), n, "two_nodes") for n in nodes
        ],
    }
    ended = {name: [finish(p) for p in processes] for name, processes in started.items()}
    return {"one": one, "nodes": nodes, "reference": reference.outcome(), **ended}


@pytest.mark.subprocess
def test_a_worker_killed_mid_step_restarts_from_the_last_checkpoint_and_ends_as_the_uninterrupted_run(runs):
    ((code, output),) = runs["killed"]
    assert code == 0, output[-4000:]
    # torchrun stopped rank 0 (or rank 0 found its peer gone), started both again, and they resumed
    assert output.count("Started by a scheduler that restarts its jobs (TORCHELASTIC_MAX_RESTARTS=3)") == 4
    assert output.count("resume_from_checkpoint='auto': resuming from") == 2, output[-4000:]  # attempt 2's workers
    assert "outputs/killed/checkpoint-7, the last valid checkpoint" in output
    assert output.count("Reusing synthetic SQuAD data") >= 2  # attempt 2 (rank 1 of attempt 1 may reuse rank 0's)
    logged = (runs["one"] / "outputs" / "killed" / "hflight" / "version_1" / "metrics.csv").read_text().splitlines()
    assert min(int(row["step"]) for row in csv.DictReader(logged) if row["loss"]) > 7  # attempt 2 continued after it
    assert outcome(runs["one"] / "outputs" / "killed") == runs["reference"]


@pytest.mark.subprocess
def test_two_nodes_restart_after_a_kill_during_a_checkpoint_write_which_is_never_used(runs):
    """Node rank 0's worker dies after the last checkpoint's weights and optimizer files, before its manifest: the
    restarted workers (on both nodes, whose agents count restarts differently) resume from the complete checkpoint-7
    of their own disks, each node's half-written folder is removed with a warning, and the run ends as one node of
    two processes ends it. With save_on_each_node each node's main process wrote its checkpoints, with its own
    ranks' RNG files, and the final model."""
    outputs = [output for _, output in runs["two_nodes"]]
    assert [code for code, _ in runs["two_nodes"]] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    for node, output in zip(runs["nodes"], outputs):
        folder = node / "outputs" / "two_nodes"
        assert output.count("resume_from_checkpoint='auto': resuming from") == 1, output[-4000:]
        assert f"{folder / 'checkpoint-7'}, the last valid checkpoint" in output
        assert "left behind by a checkpoint save or deletion that was interrupted" in output  # .tmp-checkpoint-14
        assert not list(folder.glob(".tmp-*"))
        assert sorted(p.name for p in folder.glob("checkpoint-*")) == ["checkpoint-14", "checkpoint-7"]
    node0, node1 = (node / "outputs" / "two_nodes" for node in runs["nodes"])
    assert sorted(p.name for p in (node1 / "checkpoint-14").glob("rng_state*")) == ["rng_state_1.pth"]
    assert sorted(p.name for p in (node0 / "checkpoint-14").glob("rng_state*")) == ["rng_state_0.pth"]
    assert outcome(node0) == runs["reference"]
    assert (node1 / "model.safetensors").read_bytes() == runs["reference"]["weights"]
