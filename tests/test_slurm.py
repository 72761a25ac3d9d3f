"""SLURM through hflight's checkpoints: srun's ranks, the requeue signal, scontrol, Lightning's own fallbacks off.

A cluster simulated on this host: srun's variables, the stand-ins ``tests/slurm_standin/srun`` and ``scontrol`` on
PATH (test code: they record what SLURM would be asked and do nothing else), several processes on 127.0.0.1, real
signals. In this process: one task (``SLURM_NTASKS=1``), the requeue signal sent mid-step by a callback, then the
requeued job (``SLURM_RESTART_COUNT=1``) continued with ``resume_from_checkpoint="auto"`` and compared bit for bit
with an uninterrupted run. In child processes: ``examples/slurm/train.sbatch`` run by bash with the stand-ins, its
srun line starting 2 tasks on two nodes, through a requeue and the continuation.
"""

from __future__ import annotations

import csv
import json
import os
import re
import signal
import sys
from pathlib import Path

import lightning.pytorch as lightning
import pytest
import torch

import hflight
from hflight.arguments import cluster
from hflight.checkpoints.manifest import get_last_checkpoint, verify_checkpoint
from hflight.run.interrupt import StopRequest, TrainingInterrupted

from . import launch
from .cluster_runs import SIZES, STANDIN, Reference, finish, outcome, requeues, slurm_task, start

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "examples" / "slurm" / "train.sbatch"


class SignalAt(hflight.TrainerCallback):
    """Sends ``signum`` to this process ``times`` times in the middle of optimizer step ``step`` (after its first
    micro-batch: gradient accumulation 2)."""

    def __init__(self, signum: int, step: int, times: int = 1) -> None:
        self.signum, self.step, self.times = signum, step, times
        self.handlers: dict[int, object] = {}

    def on_train_begin(self, args, state, control, **kwargs):
        self.handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}

    def on_substep_end(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)
            self.step = None


class Seen(hflight.TrainerCallback):
    """What this ``train()`` call did: the global step its training started at, the steps of the losses it logged."""

    def __init__(self) -> None:
        self.started: int | None = None
        self.logged: list[int] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = state.global_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in (logs or {}):
            self.logged.append(state.global_step)


class SignalAtTheEnd(lightning.Callback):
    """Sends ``signum`` to this process from Lightning's ``on_train_end``: after the last step boundary (and the last
    epoch's end), while ``fit`` still runs."""

    def __init__(self, signum: int) -> None:
        self.signum = signum

    def on_train_end(self, trainer, pl_module):
        os.kill(os.getpid(), self.signum)


def trainer(out: Path, factory, *callbacks, **overrides) -> hflight.Trainer:
    """A small run with dropout, random order, accumulation 2 and 3 steps per epoch (2 epochs): a requeue lands
    mid-epoch, mid-cycle, with losses logged every 2 steps (so some loss is pending at the checkpoint)."""
    values = dict(output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                  num_train_epochs=2, save_strategy="epoch", eval_strategy="epoch", logging_steps=2,
                  train_sampling_strategy="random", report_to="none", disable_tqdm=True, dataloader_pin_memory=False,
                  seed=3)  # fmt: skip
    values.update(overrides)
    return hflight.Trainer(
        factory.qa_model(dropout=0.1),
        hflight.TrainingArguments(**values),
        train_dataset=factory.qa_dataset(24),
        eval_dataset=factory.qa_dataset(8, seed=1),
        callbacks=list(callbacks),
    )


def history(trainer: hflight.Trainer) -> list[dict]:
    timing = ("runtime", "per_second")
    return [{k: v for k, v in e.items() if not k.endswith(timing)} for e in trainer.state.log_history]


def parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, factory):
    """The run without a stop, per sampling strategy (made once each)."""
    made: dict[str, hflight.Trainer] = {}

    def get(sampling: str = "random") -> hflight.Trainer:
        if sampling not in made:
            made[sampling] = trainer(tmp_path_factory.mktemp(sampling), factory, train_sampling_strategy=sampling)
            made[sampling].train()
        return made[sampling]

    return get


# ---- srun's processes -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nodes, per_node", [(1, 2), (2, 1), (2, 2)])
def test_ranks_come_from_sruns_variables_as_lightning_reads_them(monkeypatch, tmp_path, nodes, per_node):
    """srun sets no WORLD_SIZE/RANK: the arguments read SLURM_NTASKS/SLURM_PROCID/SLURM_LOCALID, so only global rank 0
    writes checkpoints and takes the writer lock (before, task 1 took itself for a second run: OutputDirInUse)."""
    for rank in range(nodes * per_node):
        slurm_task(monkeypatch, tmp_path, SLURM_NTASKS=str(nodes * per_node), SLURM_NTASKS_PER_NODE=str(per_node),
                   SLURM_NNODES=str(nodes), SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % per_node),
                   SLURM_NODEID=str(rank // per_node))  # fmt: skip
        args = hflight.TrainingArguments(str(tmp_path), num_nodes=nodes, devices=per_node)
        assert (args.world_size, args.process_index, args.local_process_index) == (
            nodes * per_node, rank, rank % per_node
        )  # fmt: skip
        assert args.should_save is (rank == 0)
        assert hflight.TrainingArguments(str(tmp_path), save_on_each_node=True).should_save is (rank % per_node == 0)
        assert cluster.environment() == "slurm" and cluster.job_identity() == "slurm job 4242"


def test_trainer_slurm_takes_devices_and_nodes_from_sruns_variables(monkeypatch, tmp_path):
    from hflight.config import compose

    slurm_task(monkeypatch, tmp_path, SLURM_NTASKS="8", SLURM_NTASKS_PER_NODE="4", SLURM_NNODES="2")
    args = hflight.TrainingArguments.from_config(compose(["trainer=slurm"], output_dir=tmp_path).args)
    assert (args.accelerator, args.devices, args.num_nodes, args.strategy) == ("auto", 4, 2, "ddp")


def test_an_interactive_allocation_or_torchrun_inside_slurm_is_not_srun(monkeypatch, tmp_path):
    slurm_task(monkeypatch, tmp_path, SLURM_JOB_NAME="interactive", SLURM_NTASKS="4", SLURM_PROCID="3")
    assert cluster.environment() == "lightning" and hflight.TrainingArguments(str(tmp_path)).process_index == 0
    slurm_task(monkeypatch, tmp_path, SLURM_NTASKS="4", SLURM_PROCID="3")
    for name, value in dict(TORCHELASTIC_RUN_ID="r", RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", GROUP_RANK="0",
                            MASTER_ADDR="127.0.0.1", MASTER_PORT="1").items():  # fmt: skip
        monkeypatch.setenv(name, value)
    args = hflight.TrainingArguments(str(tmp_path))
    assert cluster.environment() == "torchelastic" and (args.world_size, args.process_index) == (2, 1)


def test_the_requeue_signal_is_checked_and_named(tmp_path):
    assert hflight.TrainingArguments(str(tmp_path)).requeue_signal == "SIGUSR1"
    assert hflight.TrainingArguments(str(tmp_path), requeue_signal="usr2").requeue_signal == "SIGUSR2"
    assert hflight.TrainingArguments(str(tmp_path), requeue_signal=None).requeue_signal is None
    for bad, words in (("SIGBOGUS", "not a signal"), ("SIGKILL", "cannot be the requeue signal"),
                       ("INT", "cannot be the requeue signal")):  # fmt: skip
        with pytest.raises(ValueError, match=words):
            hflight.TrainingArguments(str(tmp_path), requeue_signal=bad)
    with pytest.raises(ValueError, match="both claim SIGTERM"):
        hflight.TrainingArguments(str(tmp_path), requeue_signal="SIGTERM", enable_jit_checkpoint=True)


# ---- the requeue, in this process -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sampling, step",
    [
        ("random", 2),  # mid-epoch, mid-cycle, a loss pending
        ("group_by_length", 5),  # epoch 2: the order drawn from torch's global generator at the epoch's start
        ("random", 3),  # the last step of epoch 1: its end (evaluation, save) runs in the requeued job
    ],
)
def test_a_requeue_checkpoints_at_the_step_requeues_once_and_the_requeued_job_continues_bit_for_bit(
    monkeypatch, tmp_path, factory, uninterrupted, sampling, step
):
    log = slurm_task(monkeypatch, tmp_path)
    out = tmp_path / "run"
    sender = SignalAt(signal.SIGUSR1, step=step)
    with pytest.raises(TrainingInterrupted) as stopped:
        trainer(out, factory, sender, train_sampling_strategy=sampling).train()
    error = stopped.value
    assert error.code == 138 and error.signum == signal.SIGUSR1 and error.global_step == step
    assert error.checkpoint == str(out / f"checkpoint-{step}") and verify_checkpoint(error.checkpoint, full=True)
    assert "SLURM job 4242 requeued (`scontrol requeue 4242`): the requeued job continues from" in str(error)
    assert requeues(log) == [["requeue", "4242"]]
    assert isinstance(sender.handlers[signal.SIGUSR1], StopRequest)  # hflight's, not Lightning's auto-requeue
    assert not list(out.glob("hpc_ckpt_*"))
    # the requeued job: same folder, SLURM_RESTART_COUNT=1, a new process (a new trainer) asked for "auto"
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    seen = Seen()
    resumed = trainer(out, factory, seen, train_sampling_strategy=sampling)
    resumed.train(resume_from_checkpoint="auto")
    assert seen.started == step and seen.logged[0] == step + 2 - step % 2  # continued: the next loss logged (every 2)
    reference = uninterrupted(sampling)
    assert history(resumed) == history(reference)  # losses, grad norms, evaluations and train_loss
    ours, theirs = parameters(resumed.model), parameters(reference.model)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert requeues(log) == [["requeue", "4242"]]


def test_an_explicit_resume_reports_train_loss_over_its_own_steps_as_transformers(
    monkeypatch, tmp_path, factory, uninterrupted
):
    """resume_from_checkpoint=<folder> keeps transformers' meaning (the mean over this call's steps); "auto" continues
    the run (the test above): the difference is what makes the latter equal the uninterrupted run."""
    slurm_task(monkeypatch, tmp_path)
    out = tmp_path / "run"
    with pytest.raises(TrainingInterrupted):
        trainer(out, factory, SignalAt(signal.SIGUSR1, step=2)).train()
    resumed = trainer(out, factory)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    ours, theirs = history(resumed), history(uninterrupted())
    assert ours[-1]["train_loss"] != theirs[-1]["train_loss"]
    assert [e for e in ours if "eval_loss" in e] == [e for e in theirs if "eval_loss" in e]


def test_an_array_task_is_requeued_by_its_array_id(monkeypatch, tmp_path, factory):
    log = slurm_task(monkeypatch, tmp_path, job="900", SLURM_ARRAY_JOB_ID="77", SLURM_ARRAY_TASK_ID="3")
    with pytest.raises(TrainingInterrupted, match=r"SLURM job 77_3 requeued"):
        trainer(tmp_path / "run", factory, SignalAt(signal.SIGUSR1, step=1)).train()
    assert requeues(log) == [["requeue", "77_3"]]


def test_a_failed_scontrol_is_reported_and_the_checkpoint_kept(monkeypatch, tmp_path, factory):
    log = slurm_task(monkeypatch, tmp_path, SCONTROL_EXIT="1")
    with pytest.raises(TrainingInterrupted) as stopped:
        trainer(tmp_path / "run", factory, SignalAt(signal.SIGUSR1, step=2)).train()
    message = str(stopped.value)
    assert "Requeuing SLURM job 4242 failed: `scontrol requeue 4242` exited with status 1: scontrol: error:" in message
    assert f"The checkpoint {tmp_path / 'run' / 'checkpoint-2'} is kept" in message
    assert stopped.value.code == 138 and requeues(log) == [["requeue", "4242"]]
    assert verify_checkpoint(tmp_path / "run" / "checkpoint-2", full=True)["global_step"] == 2


def test_an_scontrol_that_does_not_answer_is_reported_and_the_checkpoint_kept(monkeypatch, tmp_path, factory):
    """SLURM's controller not answering: ``scontrol requeue`` is given up after ``SCONTROL_TIMEOUT`` (60 s; 1 s here)
    and reported as a failed requeue, the stop and its checkpoint unchanged."""
    from hflight.run import requeue as run_requeue

    log = slurm_task(monkeypatch, tmp_path, SCONTROL_HANG="1")
    monkeypatch.setattr(run_requeue, "SCONTROL_TIMEOUT", 1.0)
    with pytest.raises(TrainingInterrupted) as stopped:
        trainer(tmp_path / "run", factory, SignalAt(signal.SIGUSR1, step=2)).train()
    message = str(stopped.value)
    assert "Requeuing SLURM job 4242 failed: `scontrol requeue 4242` did not answer within 1 s." in message
    assert f"The checkpoint {tmp_path / 'run' / 'checkpoint-2'} is kept" in message
    assert stopped.value.code == 138 and requeues(log) == [["requeue", "4242"]]  # asked once, then given up
    assert verify_checkpoint(tmp_path / "run" / "checkpoint-2", full=True)["global_step"] == 2


def test_the_requeue_signal_after_the_last_step_boundary_requeues_and_the_requeued_job_ends_the_run(
    monkeypatch, tmp_path, factory, uninterrupted
):
    """The signal arrives after the last step and the last epoch's end (Lightning's on_train_end, inside fit): no step
    boundary is left to stop at, so the run stops before its remaining work (train metrics, best model, on_train_end)
    and requeues the job; the requeued job finds the final checkpoint and ends the run as the uninterrupted one."""
    log = slurm_task(monkeypatch, tmp_path)
    out = tmp_path / "run"
    with pytest.raises(TrainingInterrupted) as stopped:
        trainer(out, factory, SignalAtTheEnd(signal.SIGUSR1)).train()
    error = stopped.value
    assert error.code == 138 and error.global_step == 6 and error.checkpoint is None
    assert str(error).startswith("SIGUSR1 arrived as training finished (step 6); the run stops before its remaining")
    assert "SLURM job 4242 requeued (`scontrol requeue 4242`): the requeued job continues from the run folder's" in str(
        error
    )
    assert requeues(log) == [["requeue", "4242"]] and get_last_checkpoint(out) == str(out / "checkpoint-6")
    assert not any("train_loss" in entry for entry in json.loads((out / "checkpoint-6" / "trainer_state.json")
                                                                   .read_text())["log_history"])  # fmt: skip
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    seen = Seen()
    resumed = trainer(out, factory, seen)
    resumed.train(resume_from_checkpoint="auto")
    assert resumed.state.global_step == 6 and seen.logged == []  # nothing trained again
    assert history(resumed) == history(uninterrupted())
    ours, theirs = parameters(resumed.model), parameters(uninterrupted().model)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert requeues(log) == [["requeue", "4242"]]


def test_the_requeue_signal_before_training_starts_requeues_at_once(monkeypatch, tmp_path):
    """hflight-train's run (``cli.run``) with the signal arriving once the data is prepared and the trainer built,
    before ``train()``: the job is requeued at once, with nothing to save, and the stop recorded in error.txt."""
    from hflight import cli
    from hflight.config import compose

    from .support import TINY

    log = slurm_task(monkeypatch, tmp_path)
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "jobs"))  # the callback's _target_
    cfg = compose([*TINY, "+callbacks.requeue._target_=signal_callbacks.SignalOnceBuilt"], output_dir=tmp_path / "run")
    with pytest.raises(TrainingInterrupted) as stopped:
        cli.run(cfg)
    error = stopped.value
    assert error.code == 138 and error.global_step is None and error.checkpoint is None
    assert str(error).startswith("SIGUSR1 (SLURM's requeue signal) outside of training. SLURM job 4242 requeued")
    assert requeues(log) == [["requeue", "4242"]]
    assert (tmp_path / "run" / "data" / "train.json").is_file()  # the data was prepared; nothing trained
    assert not list((tmp_path / "run").glob("checkpoint-*")) and not (tmp_path / "run" / "trainer_state.json").exists()
    assert "outside of training. SLURM job 4242 requeued" in (tmp_path / "run" / cli.ERROR_FILE).read_text()


def test_no_scontrol_on_path_is_reported(monkeypatch, tmp_path, factory):
    slurm_task(monkeypatch, tmp_path)
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    with pytest.raises(TrainingInterrupted, match="failed: scontrol is not on PATH"):
        trainer(tmp_path / "run", factory, SignalAt(signal.SIGUSR1, step=2)).train()
    assert get_last_checkpoint(tmp_path / "run") == str(tmp_path / "run" / "checkpoint-2")


def test_the_signal_again_is_the_same_stop_and_during_a_write_the_write_finishes(monkeypatch, tmp_path, factory):
    """SLURM and srun both deliver the signal: twice is one stop, one checkpoint, one requeue. Arriving while a
    checkpoint is written (the epoch's, at step 3), it lets the write finish, and that checkpoint is the stop's."""
    from hflight.checkpoints import folders

    log = slurm_task(monkeypatch, tmp_path)
    write_state = folders.write_trainer_state

    def write_and_signal(facade, tracker):
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)
        write_state(facade, tracker)

    monkeypatch.setattr(folders, "write_trainer_state", write_and_signal)
    saves = []

    class CountSaves(hflight.TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            saves.append(state.global_step)

    with pytest.raises(TrainingInterrupted) as stopped:
        trainer(tmp_path / "run", factory, CountSaves()).train()
    assert saves == [3] and stopped.value.checkpoint == str(tmp_path / "run" / "checkpoint-3")
    assert verify_checkpoint(tmp_path / "run" / "checkpoint-3", full=True)["global_step"] == 3
    assert requeues(log) == [["requeue", "4242"]]
    assert not list((tmp_path / "run").glob(".tmp-*"))


def test_a_lightning_hpc_checkpoint_is_named_and_never_loaded(monkeypatch, tmp_path, factory, uninterrupted, caplog):
    """Lightning restores the newest hpc_ckpt_*.ckpt of its default_root_dir under SLURM whenever fit gets no
    checkpoint: hflight trains from its own state (the file is garbage: loading it would fail) and names the file."""
    slurm_task(monkeypatch, tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    (out / "hpc_ckpt_3.ckpt").write_bytes(b"not a checkpoint")
    run = trainer(out, factory)
    with caplog.at_level("WARNING", logger="hflight.run.lightning_fallbacks"):
        run.train()
    assert history(run) == history(uninterrupted())
    assert "holds Lightning's SLURM checkpoint(s) hpc_ckpt_3.ckpt" in caplog.text and "never loads them" in caplog.text
    assert sorted(p.name for p in out.glob("hpc_ckpt_*")) == ["hpc_ckpt_3.ckpt"]
    assert (out / "hpc_ckpt_3.ckpt").read_bytes() == b"not a checkpoint"


def test_without_a_requeue_signal_or_outside_slurm_sigusr1_is_left_alone(monkeypatch, tmp_path, factory):
    before = signal.getsignal(signal.SIGUSR1)
    sender = SignalAt(signal.SIGTERM, step=1)
    with pytest.raises(TrainingInterrupted):
        trainer(tmp_path / "plain", factory, sender).train()
    assert sender.handlers[signal.SIGUSR1] is before  # not under SLURM: nothing installed for it
    slurm_task(monkeypatch, tmp_path)
    sender = SignalAt(signal.SIGTERM, step=1)
    with pytest.raises(TrainingInterrupted):
        trainer(tmp_path / "none", factory, sender, requeue_signal=None).train()
    assert sender.handlers[signal.SIGUSR1] is before  # SLURM, requeue_signal=None: neither hflight's nor Lightning's


# ---- resume_from_checkpoint="auto" ------------------------------------------------------------------------------
def test_auto_starts_fresh_without_a_checkpoint_and_skips_damaged_ones(tmp_path, factory, uninterrupted, caplog):
    fresh = trainer(tmp_path / "empty", factory)
    with caplog.at_level("WARNING"):
        fresh.train(resume_from_checkpoint="auto")
    assert "no valid checkpoint in" in caplog.text and history(fresh) == history(uninterrupted())
    # a folder whose newest checkpoint is damaged (a flipped byte: sizes agree, the checksum does not)
    out = tmp_path / "damaged"
    with pytest.raises(TrainingInterrupted):
        trainer(out, factory, SignalAt(signal.SIGTERM, step=5)).train()
    weights = out / "checkpoint-5" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8] ^= 0xFF
    weights.write_bytes(bytes(data))
    caplog.clear()
    resumed = trainer(out, factory)
    with caplog.at_level("WARNING"):
        resumed.train(resume_from_checkpoint="auto")
    assert "skipping checkpoint-5" in caplog.text and "resuming from" in caplog.text and "checkpoint-3" in caplog.text
    ours, theirs = parameters(resumed.model), parameters(uninterrupted().model)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    # only broken ones: said, and a fresh start
    for folder in out.glob("checkpoint-*"):
        (folder / "trainer_state.json").write_text("{}")
    caplog.clear()
    again = trainer(out, factory)
    with caplog.at_level("WARNING"):
        again.train(resume_from_checkpoint="auto")
    assert "none complete and undamaged); starting fresh" in caplog.text


# ---- the shipped batch script, its srun line run by bash with the stand-ins ---------------------------------------
def sbatch(cwd: Path, job: str, *extra: str, nodes: int = 1, per_node: int = 2, restarts: int = 0) -> launch.Job:
    """``bash examples/slurm/train.sbatch <sizes> <extra>`` as sbatch runs it, in ``cwd`` (the submit folder): the
    allocation's variables (job ``job``, ``nodes`` x ``per_node`` tasks), stand-in srun and scontrol first on PATH."""
    env = dict(SLURM_JOB_ID=job, SLURM_JOB_NAME="hflight-mrc", SLURM_NNODES=str(nodes),
               SLURM_NTASKS_PER_NODE=str(per_node), SLURM_NTASKS=str(nodes * per_node), SLURM_NODELIST="localhost",
               SLURM_SUBMIT_DIR=str(cwd), SCONTROL_LOG=str(cwd / f"scontrol-{job}.log"), SRUN_KILL_WAIT="20",
               PATH=os.pathsep.join([str(STANDIN), str(Path(sys.executable).parent), os.environ["PATH"]]))  # fmt: skip
    if restarts:
        env["SLURM_RESTART_COUNT"] = str(restarts)
    return start(["bash", str(SBATCH), *SIZES, *extra], cwd, f"sbatch-{job}-{restarts}", **env)


@pytest.fixture(scope="module")
def requeued_job(tmp_path_factory):
    """The batch script twice for job 14242, 2 nodes of one task each: requeued by SIGUSR1 during step 9 (epoch 2 of
    7 steps each), then SLURM's restart of it (SLURM_RESTART_COUNT=1); torchrun's uninterrupted job (1 node x 2
    processes) beside it. One node of 2 tasks is not run as well (a job less): srun's ranks for it are
    test_ranks_come_from_sruns_variables_as_lightning_reads_them[1-2]'s, and 2 processes of one node training
    together, through a restart, are tests/test_elastic.py's."""
    reference = Reference.get()
    cwd = tmp_path_factory.mktemp("slurm")
    fault = ["+callbacks.fault._target_=cluster_faults.SignalAt", "+callbacks.fault.step=9"]
    first_code, first_output = finish(sbatch(cwd, "14242", *fault, nodes=2, per_node=1))
    checkpoints = sorted(p.name for p in (cwd / "outputs" / "14242").glob("checkpoint-*"))
    rng = sorted(p.name for p in (cwd / "outputs" / "14242" / checkpoints[-1]).glob("rng_state*"))
    again = finish(sbatch(cwd, "14242", *fault, nodes=2, per_node=1, restarts=1))
    return dict(cwd=cwd, first=(first_code, first_output, checkpoints, rng), again=again, reference=reference)


@pytest.mark.subprocess
def test_the_batch_script_requeues_on_sigusr1_and_the_requeued_job_finishes_the_run_bit_for_bit(requeued_job):
    """As an uninterrupted run ends: the same weights (bytes), log history and metrics as torchrun's 1 node x 2
    processes (docs/hydra.md's command; srun's 2 nodes x 1 task train as it: the test below)."""
    cwd = requeued_job["cwd"]
    code, output, checkpoints, rng = requeued_job["first"]
    assert code == 138, output[-4000:]
    assert "srun: error: node0: task 0: Exited with exit code 138" in output
    assert "srun: error: node1: task 1: Exited with exit code 138" in output
    # the signal reaches the tasks through srun after step 8: they stop at the next step boundary they agree on
    stops = set(re.findall(r"Training stopped by SIGUSR1 after step (\d+) of 14; checkpoint saved in", output))
    assert len(stops) == 1 and 8 <= int(next(iter(stops))) <= 10, output[-4000:]
    step = int(stops.pop())
    assert checkpoints == ["checkpoint-7", f"checkpoint-{step}"]  # the first epoch's (7 steps), and the requeue's
    assert rng == ["rng_state_0.pth", "rng_state_1.pth"]  # one per global rank
    assert requeues(cwd / "scontrol-14242.log") == [["requeue", "14242"]]  # once, by global rank 0
    assert output.count("SLURM job 14242 requeued (`scontrol requeue 14242`): the requeued job continues from") == 2
    assert "resume=auto: " in output and "holds no complete checkpoint; starting fresh" in output
    code, output = requeued_job["again"]
    assert code == 0, output[-4000:]
    assert f"resuming from {cwd / 'outputs' / '14242' / f'checkpoint-{step}'}" in output
    logged = (cwd / "outputs" / "14242" / "hflight" / "version_1" / "metrics.csv").read_text().splitlines()
    assert min(int(row["step"]) for row in csv.DictReader(logged) if row["loss"]) > step  # the requeued job's losses
    assert output.count("Reusing synthetic SQuAD data") == 2 and output.count("Reusing a trained tokenizer") == 2
    assert outcome(cwd / "outputs" / "14242") == requeued_job["reference"].outcome()
    assert not list((cwd / "outputs").rglob("hpc_ckpt_*"))


@pytest.mark.subprocess
def test_two_nodes_of_one_task_train_as_one_node_of_two(requeued_job):
    """srun's variables for 2 nodes x 1 task (the job above, requeued and continued): the processes train as
    torchrun's 1 node x 2 processes (gloo over 127.0.0.1), to the byte, and a requeued job of the same allocation
    resumes without a changed argument."""
    cwd = requeued_job["cwd"]
    code, output = requeued_job["again"]
    assert code == 0, output[-4000:]
    assert "with arguments that change the data position or the step arithmetic" not in output
    assert outcome(cwd / "outputs" / "14242") == requeued_job["reference"].outcome()
