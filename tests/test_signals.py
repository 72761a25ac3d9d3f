"""SIGTERM and SIGINT during ``Trainer.train``: the run finishes the optimizer step it is in, writes a checkpoint and
stops with a non-zero exit code; Lightning's own handlers stay in place.

The signals are real: a callback sends them to this very process during the first micro-batch of an accumulation
cycle (gradient accumulation 2), so that they arrive mid-step, deterministically. The same in a child process,
with the signal sent from outside and an exact resume, is test_resume.py's
``test_resume_after_sigterm_then_after_sigkill_is_exact_with_one_writer_per_output_folder``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import hflight
from hflight.checkpoints.manifest import get_last_checkpoint, verify_checkpoint
from hflight.run.interrupt import StopRequest, TrainingInterrupted

from . import launch


class SendSignal(hflight.TrainerCallback):
    """Sends ``signum`` (``times`` times) to this process in the middle of optimizer step ``step``."""

    def __init__(self, signum: int, step: int, times: int = 1) -> None:
        self.signum, self.step, self.times = signum, step, times
        self.handlers: dict[int, object] = {}

    def on_train_begin(self, args, state, control, **kwargs):
        self.handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}

    def on_substep_end(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)
            self.step = None


def train(tmp_path, factory, *callbacks: hflight.TrainerCallback, **overrides) -> hflight.Trainer:
    values = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=8,
        save_steps=3,
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        dataloader_pin_memory=False,
    )
    values.update(overrides)
    trainer = hflight.Trainer(
        factory.qa_model(),
        hflight.TrainingArguments(**values),
        train_dataset=factory.qa_dataset(40),
        callbacks=list(callbacks),
    )
    trainer.train()
    return trainer


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_mid_step_finishes_the_step_saves_and_exits_non_zero(tmp_path, factory, signum, code):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    sender = SendSignal(signum, step=5)
    with pytest.raises(TrainingInterrupted) as stopped:
        train(tmp_path, factory, sender)
    error = stopped.value
    assert isinstance(error, SystemExit) and error.code == code and error.signum == signum
    assert error.global_step == 5  # the step in progress was completed, not cut short
    assert error.checkpoint == str(tmp_path / "checkpoint-5")
    assert verify_checkpoint(error.checkpoint)["global_step"] == 5
    assert get_last_checkpoint(tmp_path) == error.checkpoint
    assert f"stopped by {signal.Signals(signum).name} after step 5 of 8" in str(error)
    assert "resume_from_checkpoint" in str(error)
    # the previous handlers are back, behind the stop's, which answers a second signal for a few seconds (then theirs)
    assert {s: getattr(signal.getsignal(s), "previous", None) for s in before} == before


def test_lightning_keeps_its_sigterm_handler_and_under_slurm_its_requeue_handler_is_hflights(
    tmp_path, factory, monkeypatch
):
    """Under SLURM Lightning's SIGTERM handler stays and composes hflight's (the run stops at the step boundary with a
    checkpoint), but the requeue signal (SIGUSR1) is hflight's StopRequest: Lightning's auto-requeue handler, which
    writes hpc_ckpt files, and its "bypass SIGTERM" handler are not installed (tests/test_slurm.py runs the requeue)."""
    for name, value in dict(SLURM_NTASKS="1", SLURM_JOB_NAME="train", SLURM_JOB_ID="42", SLURM_PROCID="0",
                            SLURM_LOCALID="0", SLURM_NODEID="0").items():  # fmt: skip
        monkeypatch.setenv(name, value)
    sender = SendSignal(signal.SIGTERM, step=2)
    with pytest.raises(TrainingInterrupted) as stopped:
        train(tmp_path, factory, sender)
    assert stopped.value.checkpoint == str(tmp_path / "checkpoint-2")
    assert isinstance(sender.handlers[signal.SIGUSR1], StopRequest)
    sigterm = sender.handlers[signal.SIGTERM].signal_handlers
    assert [getattr(h, "__name__", None) for h in sigterm[:1]] == ["_sigterm_notifier_fn"]
    assert isinstance(sigterm[1], StopRequest) and len(sigterm) == 2
    assert not list(tmp_path.glob("hpc_ckpt_*"))


def test_a_second_signal_stops_at_once_without_a_checkpoint(tmp_path, factory):
    with pytest.raises(TrainingInterrupted, match="stopped at once by a second SIGTERM") as stopped:
        train(tmp_path, factory, SendSignal(signal.SIGTERM, step=5, times=2))
    assert stopped.value.code == 143 and stopped.value.checkpoint is None
    assert get_last_checkpoint(tmp_path) == str(tmp_path / "checkpoint-3")  # the last regular one, untouched


def test_without_saving_the_run_still_stops_non_zero(tmp_path, factory):
    with pytest.raises(TrainingInterrupted, match=r"no checkpoint was saved \(save_strategy='no'\)") as stopped:
        train(tmp_path, factory, SendSignal(signal.SIGTERM, step=2), save_strategy="no")
    assert stopped.value.code == 143 and stopped.value.global_step == 2
    assert not list(tmp_path.glob("checkpoint-*"))


def test_a_signal_after_a_regular_save_does_not_save_twice(tmp_path, factory):
    saves = []

    class CountSaves(hflight.TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            saves.append(state.global_step)

    with pytest.raises(TrainingInterrupted):
        train(tmp_path, factory, SendSignal(signal.SIGTERM, step=3), CountSaves())
    assert saves == [3]


def test_sigterm_during_evaluate_exits_non_zero(tmp_path, factory):
    """Outside of train(), Lightning's validate loop stops on SIGTERM with a SystemExit of status 0: not here."""

    class SignalDuringEvaluation(hflight.TrainerCallback):
        sent = False

        def on_prediction_step(self, args, state, control, **kwargs):
            if not self.sent:
                self.sent = True
                os.kill(os.getpid(), signal.SIGTERM)

    values = dict(output_dir=str(tmp_path), per_device_eval_batch_size=2, report_to="none", disable_tqdm=True)
    trainer = hflight.Trainer(
        factory.qa_model(),
        hflight.TrainingArguments(**values, dataloader_pin_memory=False),
        eval_dataset=factory.qa_dataset(8),
        callbacks=[SignalDuringEvaluation()],
    )
    with pytest.raises(TrainingInterrupted, match="Evaluation stopped by SIGTERM") as stopped:
        trainer.evaluate()
    assert stopped.value.code == 143


@pytest.mark.subprocess
def test_a_second_sigint_while_the_stopped_process_exits_prints_no_traceback(tmp_path):
    """After hflight's message, Python printed "Exception ignored in atexit callback ... KeyboardInterrupt" with a
    traceback when a second SIGINT arrived during the exit callbacks; now the process exits at once, with one line."""
    job = Path(__file__).parent / "jobs" / "sigint_at_exit.py"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(job), str(tmp_path)], capture_output=True, text=True, env=env,
                          timeout=300)  # fmt: skip
    output = proc.stdout + proc.stderr
    assert "Training stopped by SIGINT after step 2 of 4; checkpoint saved in" in output, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    assert "Exception ignored" not in output
    assert output.rstrip().endswith("SIGINT received while exiting after the run was stopped: exiting now.")
    assert proc.returncode == 130
    assert verify_checkpoint(tmp_path / "checkpoint-2")["global_step"] == 2


@pytest.mark.subprocess
def test_a_second_sigint_as_the_stop_leaves_train_says_so_and_exits_130(tmp_path):
    """Two Ctrl-C 20 ms apart, the second once the step boundary's checkpoint was written and train()'s handlers put
    back: Python's default handler raised a raw KeyboardInterrupt (status -2, one run in three on a loaded machine).
    Now the stop's handler answers it for a while after: the second-signal line and 130, however close they come."""
    job = Path(__file__).parent / "jobs" / "sigint_at_exit.py"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(job), str(tmp_path), "--unwinding"], capture_output=True, text=True,
                          env=env, timeout=300)  # fmt: skip
    output = proc.stdout + proc.stderr
    assert "Training stopped at once by a second SIGINT (after step 2)" in output, output[-3000:]
    assert "KeyboardInterrupt" not in output and proc.returncode == 130, (proc.returncode, output[-3000:])
    assert verify_checkpoint(tmp_path / "checkpoint-2")["global_step"] == 2


@pytest.mark.subprocess
def test_a_second_sigint_as_a_stop_after_the_last_step_leaves_train_says_so_and_exits_130(tmp_path):
    """The first Ctrl-C after the last step boundary (training over), the second as that stop leaves train(): the stop
    was raised after the handlers were put back, none of them the stop's, so the second was Python's raw
    KeyboardInterrupt (-2; fault read of issue 67)."""
    job = Path(__file__).parent / "jobs" / "sigint_at_exit.py"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(job), str(tmp_path), "--after-last-boundary"], capture_output=True,
                          text=True, env=env, timeout=300)  # fmt: skip
    output = proc.stdout + proc.stderr
    assert "SIGINT arrived as training finished (step 4)" in output, output[-3000:]
    assert "Training stopped at once by a second SIGINT (after step 4)" in output, output[-3000:]
    assert "KeyboardInterrupt" not in output and proc.returncode == 130, (proc.returncode, output[-3000:])


@pytest.mark.subprocess
def test_a_sigterm_while_the_stopped_process_tears_down_its_modules_keeps_the_stop_status(tmp_path):
    """Python gives signals their default action back after the exit callbacks, before its slow module teardown: a
    SIGTERM then killed the process (-15), so a requeued task that srun's --kill-on-bad-exit reached there ended 143
    instead of 138; it is ignored there now."""
    job = Path(__file__).parent / "jobs" / "sigint_at_exit.py"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(job), str(tmp_path), "--finalizing"], capture_output=True, text=True,
                          env=env, timeout=300)  # fmt: skip
    output = proc.stdout + proc.stderr
    assert "Training stopped by SIGINT after step 2 of 4; checkpoint saved in" in output, output[-3000:]
    assert proc.returncode == 130, (proc.returncode, output[-3000:])
    # the object was collected in the teardown and its SIGTERM sent, pending, then delivered (and ignored)
    assert (tmp_path / "sigterm_when_collected.txt").read_text() == "sent pending\nsurvived\n"


JOBS = Path(__file__).parent / "jobs"


def stop_ddp_job(out: Path, launcher: str, exit_delay: float) -> tuple[dict[int, int], str]:
    """Run tests/jobs/sigterm_ddp_job.py (two ranks) under ``launcher`` through tests/jobs/reap_all.py, send SIGTERM
    after step 3 to the job's process group, as a scheduler does. Returns the exit code of every process reaped by the
    wrapper (pid -> code) and the output."""
    out.mkdir()
    job = [str(JOBS / "sigterm_ddp_job.py"), str(out), "--exit-delay", str(exit_delay)]
    if launcher == "torchrun":
        job = [*launch.torchrun(2, standalone=False), *job, "--torchrun"]
    else:
        job = [sys.executable, *job]
    codes_file = out / "codes.json"
    wrapper = launch.Job([sys.executable, JOBS / "reap_all.py", codes_file, "150", "--", *job], out.parent,
                         console=out.parent / "console.txt", timeout=160, name="reap_all.py")  # fmt: skip
    try:
        for line in wrapper.lines():
            if line.startswith("job ") and not wrapper.groups:  # the job's own session: killed with the wrapper
                wrapper.groups.append(int(line.split()[1]))
            if line.strip() == "step 3":
                os.killpg(wrapper.groups[0], signal.SIGTERM)
                break
    except BaseException:
        wrapper.kill()
        raise
    output = wrapper.wait().output
    return {int(pid): code for pid, code in json.loads(codes_file.read_text()).items()}, output


@pytest.mark.subprocess
@pytest.mark.parametrize("launcher", ["lightning", "torchrun"])
def test_sigterm_to_two_processes_exits_143_everywhere_with_the_checkpoint_complete(tmp_path, launcher):
    """SIGTERM after step 3 to the process group of a 2-process DDP job whose rank 0 takes 6 s to exit (slow exit
    callbacks): each rank finishes the step, both write checkpoint-3 and exit 143. Under Lightning's launcher its
    child-process monitor (every 5 s) SIGKILLed rank 0 (-9) once rank 1 had exited 143; now rank 0 outlives the rank
    it launched. Under torchrun each rank gets the signal twice (the group's, the agent's): one stop.

    A signal to one rank only, the others stopping at the same step through the per-step all-reduce
    (``StopRequest.agreed``, whichever launcher), is the first attempt of test_sharding.py's ``stopped_then_killed``
    job (SIGTERM to rank 0 alone, every rank stops at step 5 with checkpoint-5), checked by
    test_sharding.py::test_a_sharded_run_stopped_or_killed_restarts_from_its_last_checkpoint_and_ends_as_the_uninterrupted_run;
    Lightning's exit path for that case (``exit_together``) is the one above."""
    if launcher == "torchrun" and not launch.TORCHRUN.exists():
        pytest.skip("torchrun is not installed beside this Python")
    out = tmp_path / "job"
    codes, output = stop_ddp_job(out, launcher, exit_delay=6.0)
    pids = {rank: int((out / f"pid-{rank}").read_text()) for rank in (0, 1)}
    assert [(out / f"exit-{rank}").read_text() for rank in (0, 1)] == ["143", "143"], output[-3000:]
    if launcher == "lightning":  # rank 0 is the job's main process (reaped here) and reaps rank 1, its child
        assert codes == {pids[0]: 143}, output[-3000:]
        assert f"have exited (pid: exit code): {pids[1]}: 143." in output
    else:  # the agent reaps the ranks (its own exit code is torchrun's: 1 after its SignalException)
        assert "closing signal SIGKILL" not in output and "Received 15 death signal" in output
    assert "Forcefully terminating" not in output
    manifest = verify_checkpoint(out / "checkpoint-3", full=True)
    assert manifest["global_step"] == 3 and manifest["run"]["world_size"] == 2
    assert get_last_checkpoint(out) == str(out / "checkpoint-3")
