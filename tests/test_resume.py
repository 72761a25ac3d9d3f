"""Checkpoints and exact resume: same parameters, losses and learning rates as the uninterrupted run."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers

import hflight
from hflight import get_last_checkpoint

JOB = Path(__file__).parent / "jobs" / "resume_job.py"


def run_job(out: Path, *extra: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(
        [sys.executable, str(JOB), str(out), *extra], capture_output=True, text=True, timeout=timeout, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def start_job(out: Path, *extra: str, stderr: int = subprocess.DEVNULL) -> subprocess.Popen:
    """The job in a child process; it prints "step N" after every optimizer step (read them from ``stdout``)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, str(JOB), str(out), *extra]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)


def final(out: Path):
    params = torch.load(out / "final.pt")
    history = json.loads((out / "log_history.json").read_text())
    return params, {e["step"]: e for e in history if "loss" in e}


def assert_same_run(reference: Path, resumed: Path, from_step: int):
    ref_params, ref_logs = final(reference)
    params, logs = final(resumed)
    diff = max((ref_params[k] - params[k]).abs().max().item() for k in ref_params)
    assert diff <= 1e-6, f"max abs parameter difference {diff}"
    for step in range(from_step + 1, 13):
        assert logs[step]["loss"] == pytest.approx(ref_logs[step]["loss"], rel=1e-6, abs=1e-7), step
        assert logs[step]["learning_rate"] == pytest.approx(ref_logs[step]["learning_rate"], rel=1e-9), step


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The run no stop interrupts, a checkpoint every 3 steps: its ``checkpoint-3`` is where
    test_resume_early_in_an_epoch_then_at_an_epoch_boundary starts (a run stopped at step 3 writes the same one; a
    stopped run's checkpoint is that test's second continuation's)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    run_job(out, "--save-steps", "3")
    return out


def assert_transformers_checkpoint(checkpoint: Path, step: int) -> None:
    """transformers' files, its trainer state at ``step`` (5 optimizer steps per epoch), loadable by
    ``from_pretrained``."""
    expected = {"model.safetensors", "config.json", "trainer_state.json", "training_args.bin", "optimizer.pt",
                "scheduler.pt", "rng_state.pth"}  # fmt: skip
    assert expected <= set(os.listdir(checkpoint))
    state = transformers.TrainerState.load_from_json(str(checkpoint / "trainer_state.json"))
    assert state.global_step == step and state.epoch == pytest.approx(step / 5)


@pytest.mark.subprocess
def test_resume_early_in_an_epoch_then_at_an_epoch_boundary(tmp_path, uninterrupted):
    """One run continued twice, each time in a new process: from step 3 (6 of 10 batches skipped; the uninterrupted
    run's ``checkpoint-3``, copied into the run's folder), resumed from the checkpoint's path with the model
    initialised from another seed (so the weights must come from the checkpoint), every later epoch must still be
    whole; that continuation stops at 5, an epoch boundary, and is resumed with ``resume_from_checkpoint="last"``.
    Steps 4 and 5 (the first continuation's, in the log history the second one carries on) and 6 to 12 are the
    uninterrupted run's. The checkpoint holds transformers' files and loads with ``from_pretrained``."""
    out = tmp_path / "run"
    checkpoint = out / "checkpoint-3"
    shutil.copytree(uninterrupted / "checkpoint-3", checkpoint)
    assert_transformers_checkpoint(checkpoint, 3)
    model = transformers.AutoModelForQuestionAnswering.from_pretrained(str(checkpoint))
    assert model.config.architectures == ["BertForQuestionAnswering"]
    run_job(out, "--resume", str(checkpoint), "--model-seed", "123", "--stop-at", "5", "--save-steps", "5")
    assert_transformers_checkpoint(out / "checkpoint-5", 5)
    run_job(out, "--resume", "last", "--save-steps", "5")
    assert_same_run(uninterrupted, out, from_step=3)
    epochs = {e["step"]: e["epoch"] for e in json.loads((out / "log_history.json").read_text()) if "loss" in e}
    assert epochs[10] == pytest.approx(2.0) and epochs[12] == pytest.approx(2.4)


@pytest.mark.subprocess
def test_resume_after_sigterm_then_after_sigkill_is_exact_with_one_writer_per_output_folder(tmp_path, factory,
                                                                                           uninterrupted):  # fmt: skip
    """One run stopped twice from outside, each time continued in a new process with ``resume_from_checkpoint=
    "last"``, and compared with the uninterrupted run from the first stop on:

    - SIGTERM during the pause after step 4 or during step 5: the job finishes the step it is in, writes a checkpoint
      (no regular one is due) and exits with 128 + 15;
    - its continuation, a checkpoint every step, SIGKILLed at a random moment of a random later step (the save
      included): the last checkpoint on disk is a complete one.

    While the continuation runs, a second run writing the same output_dir (two resumes at once overwrote each other's
    checkpoints: one died with FileNotFoundError on the other's .tmp-checkpoint-N) fails at once, naming the folder
    and the process that holds it; after that process is killed, the next run takes its lock over with a warning."""
    from hflight.checkpoints.writelock import LOCK_NAME, OutputDirInUse

    out = tmp_path / "run"
    process = start_job(out, "--save-steps", "100", "--step-sleep", "0.2", stderr=subprocess.PIPE)
    for line in process.stdout:
        if line.strip() == "step 4":
            time.sleep(random.uniform(0.0, 0.4))  # within step 4's pause or during step 5
            process.send_signal(signal.SIGTERM)
            break
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 143, stderr[-3000:]
    assert "Training stopped by SIGTERM after step" in stderr
    last = get_last_checkpoint(out)
    assert last is not None and not (out / "final.pt").exists()
    stopped_at = int(Path(last).name.split("-")[1])
    assert stopped_at in (4, 5) and f"after step {stopped_at} of 12" in stderr

    go = tmp_path / "go"
    process = start_job(out, "--resume", "last", "--save-steps", "1", "--step-sleep", "0.15", "--wait-for", str(go))
    assert next(process.stdout).strip() == f"step {stopped_at + 1}"  # and it waits for `go`, its folder locked
    args = hflight.TrainingArguments(**_args(out, max_steps=2, save_steps=1))
    second = hflight.Trainer(factory.qa_model(), args, train_dataset=factory.qa_dataset(8))
    for resume in (None, True):
        with pytest.raises(OutputDirInUse) as error:
            second.train(resume_from_checkpoint=resume)
        assert str(error.value).startswith(
            f"Output folder {out} is in use by another training run: process {process.pid} on host "
        ), str(error.value)
    assert not second.is_in_train and second.state.global_step == 0
    go.touch()
    rng = random.Random()
    kill_after_step = rng.randint(stopped_at + 2, 10)
    extra_delay = rng.uniform(0.0, 0.15)  # anywhere within the step, the save included
    for line in process.stdout:
        if line.strip() == f"step {kill_after_step}":
            time.sleep(extra_delay)
            process.send_signal(signal.SIGKILL)
            break
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL
    assert (out / LOCK_NAME).is_file()  # a killed process cannot remove it
    last = get_last_checkpoint(out)
    assert last is not None
    resumed = run_job(out, "--resume", "last", "--save-steps", "1")
    assert f"Took over {out / LOCK_NAME}, left by process {process.pid} on host" in resumed.stderr
    assert not (out / LOCK_NAME).exists()
    assert_same_run(uninterrupted, out, from_step=stopped_at)


def test_partial_checkpoint_is_never_picked(tmp_path):
    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / "checkpoint-4" / "trainer_state.json").write_text("{}")  # no weights: what a killed deletion leaves
    (tmp_path / "checkpoint-9").mkdir()  # interrupted: no trainer_state.json
    (tmp_path / "checkpoint-9" / "model.safetensors").write_bytes(b"")
    (tmp_path / ".tmp-checkpoint-12").mkdir()
    assert get_last_checkpoint(tmp_path) is None
    (tmp_path / "checkpoint-4" / "model.safetensors").write_bytes(b"")  # a transformers folder: weights, state
    assert get_last_checkpoint(tmp_path) == str(tmp_path / "checkpoint-4")


def _args(tmp_path, **kwargs):
    base = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        report_to="none",
        disable_tqdm=True,
        train_sampling_strategy="sequential",
        logging_steps=1,
        learning_rate=1e-3,
        seed=0,
    )
    base.update(kwargs)
    return base


def test_resume_from_a_transformers_checkpoint(tmp_path, factory):
    train = factory.qa_dataset(40)
    hf_full = transformers.Trainer(
        factory.qa_model(),
        transformers.TrainingArguments(**_args(tmp_path / "full", max_steps=12, save_strategy="no")),
        train_dataset=train,
    )
    hf_full.train()
    hf_half = transformers.Trainer(
        factory.qa_model(),
        transformers.TrainingArguments(**_args(tmp_path / "half", max_steps=12, save_steps=6)),
        train_dataset=train,
        callbacks=[StopAt(6)],
    )
    hf_half.train()
    ours = hflight.Trainer(
        factory.qa_model(seed=99),
        hflight.TrainingArguments(**_args(tmp_path / "ours", max_steps=12, save_strategy="no")),
        train_dataset=train,
    )
    ours.train(resume_from_checkpoint=str(tmp_path / "half" / "checkpoint-6"))
    assert ours.state.global_step == 12
    for a, b in zip(hf_full.model.state_dict().values(), ours.model.state_dict().values()):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
    hf_logs = {e["step"]: e for e in hf_full.state.log_history if "loss" in e}
    our_logs = {e["step"]: e for e in ours.state.log_history if "loss" in e}
    for step in range(7, 13):
        assert our_logs[step]["loss"] == pytest.approx(hf_logs[step]["loss"], rel=1e-5)
        assert our_logs[step]["learning_rate"] == pytest.approx(hf_logs[step]["learning_rate"], rel=1e-9)


class StopAt(transformers.TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def test_resume_true_without_checkpoint_is_a_clear_error(tmp_path, factory):
    trainer = hflight.Trainer(
        factory.qa_model(),
        hflight.TrainingArguments(**_args(tmp_path, max_steps=2)),
        train_dataset=factory.qa_dataset(8),
    )
    with pytest.raises(ValueError, match="No valid checkpoint found in output directory"):
        trainer.train(resume_from_checkpoint=True)


def test_corrupt_and_foreign_checkpoints_name_the_problem(tmp_path, factory):
    trainer = hflight.Trainer(
        factory.qa_model(),
        hflight.TrainingArguments(**_args(tmp_path / "run", max_steps=2, save_steps=2)),
        train_dataset=factory.qa_dataset(8),
    )
    trainer.train()
    good = tmp_path / "run" / "checkpoint-2"

    corrupt = tmp_path / "corrupt"
    shutil.copytree(good, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="model.safetensors.*corrupt"):
        trainer.train(resume_from_checkpoint=str(corrupt))

    partial = tmp_path / "partial"
    shutil.copytree(good, partial)
    (partial / "trainer_state.json").unlink()
    with pytest.raises(ValueError, match="no trainer_state.json"):
        trainer.train(resume_from_checkpoint=str(partial))

    other = hflight.Trainer(
        factory.cls_model(),
        hflight.TrainingArguments(**_args(tmp_path / "other", max_steps=2)),
        train_dataset=factory.cls_dataset(8),
    )
    with pytest.raises(ValueError, match="BertForQuestionAnswering.*not for BertForSequenceClassification"):
        other.train(resume_from_checkpoint=str(good))


def test_save_total_limit_rotation_keeps_the_best(tmp_path, factory):
    args = hflight.TrainingArguments(
        **_args(
            tmp_path,
            num_train_epochs=3,
            save_steps=2,
            eval_strategy="steps",
            eval_steps=2,
            save_total_limit=2,
            load_best_model_at_end=True,
            metric_for_best_model="eval_loss",
            learning_rate=0.3,
        )
    )
    trainer = hflight.Trainer(
        factory.qa_model(), args, train_dataset=factory.qa_dataset(16), eval_dataset=factory.qa_dataset(8, seed=1)
    )
    trainer.train()
    kept = sorted(p.name for p in tmp_path.glob("checkpoint-*"))
    best = Path(trainer.state.best_model_checkpoint).name
    assert best in kept and len(kept) <= 2
    assert f"checkpoint-{trainer.state.global_step}" in kept


def _scripted_run(trainer_cls, args_cls, factory, folder: Path, scores, *callbacks) -> transformers.Trainer:
    """12 steps with an evaluation and a checkpoint every 2 steps, best model by a scripted ``score``."""
    values = _args(folder, max_steps=12, eval_strategy="steps", eval_steps=2, save_steps=2, save_total_limit=2,
                   load_best_model_at_end=True, metric_for_best_model="score")  # fmt: skip
    return trainer_cls(
        factory.qa_model(),
        args_cls(**values),
        train_dataset=factory.qa_dataset(24),
        eval_dataset=factory.qa_dataset(8, seed=1),
        compute_metrics=lambda prediction: {"score": next(scores)},
        callbacks=list(callbacks),
    )


@pytest.mark.parametrize(
    "scores, best",
    [
        ([2.0, 1.0, 2.5, 0.0], "first/checkpoint-2"),  # no better evaluation after the resume: the first run's best
        ([2.0, 4.0, 1.0, 0.0], "second/checkpoint-8"),  # a better one at step 8, in the new folder
    ],
    ids=["best-stays-in-the-first-run", "best-found-after-the-resume"],
)
def test_resume_from_a_checkpoint_in_another_folder_keeps_best_model_tracking_as_transformers(
    tmp_path, factory, scores, best
):
    """resume_from_checkpoint=<another run's checkpoint> with load_best_model_at_end (a sweep's retry, a copied run):
    the run continues in its own output_dir from step 4, the first run's best checkpoint (step 2, inside the
    checkpoint's run folder) carried over as transformers carries it, and the model loaded at the end is the best
    one, wherever it lies. Both libraries, the same scripted scores: the same best path, checkpoints and weights."""
    ended = {}
    for name, trainer_cls, args_cls in (("hf", transformers.Trainer, transformers.TrainingArguments),
                                        ("hl", hflight.Trainer, hflight.TrainingArguments)):  # fmt: skip
        root = tmp_path / name
        script = iter([3.0, 1.0, *scores])  # steps 2 and 4 in the first run, 6 to 12 in the second
        _scripted_run(trainer_cls, args_cls, factory, root / "first", script, StopAt(4)).train()
        second = _scripted_run(trainer_cls, args_cls, factory, root / "second", script)
        second.train(resume_from_checkpoint=str(root / "first" / "checkpoint-4"))
        # the checkpoint's history, then steps 5 to 12: continued, not started again
        assert [e["step"] for e in second.state.log_history if "loss" in e] == list(range(1, 13))
        folders = {f: sorted(p.name for p in (root / f).glob("checkpoint-*")) for f in ("first", "second")}
        kept = ["checkpoint-10", "checkpoint-12"] if best.startswith("first") else ["checkpoint-12", "checkpoint-8"]
        assert folders == {"first": ["checkpoint-2", "checkpoint-4"], "second": kept}
        assert second.state.best_model_checkpoint == str(root / best)
        on_disk = type(second.model).from_pretrained(str(root / best)).state_dict()
        assert all(torch.equal(on_disk[k], v) for k, v in second.model.state_dict().items())  # the best, loaded
        ended[name] = second.model.state_dict()
    for key, theirs in ended["hf"].items():
        torch.testing.assert_close(ended["hl"][key], theirs, atol=1e-6, rtol=0)


@pytest.mark.subprocess
def test_sigkill_at_random_points_of_background_writes_resumes_bit_exact(tmp_path, uninterrupted):
    """save_async, a checkpoint every 2 steps, each background file write slowed down (the job's test hook, which
    announces each write): the job is SIGKILLed at a random point of a random background write after the first (a
    file, the next one, the manifest, the publication). The last checkpoint is a complete, published one; the run
    resumed from it to the end is the uninterrupted run, bit for bit."""
    out = tmp_path / "killed"
    common = ["--save-async", "--save-steps", "2", "--slow-write", "0.15"]
    process = start_job(out, *common)
    # 2 announced writes per checkpoint: the kill comes once checkpoint-2 is out, in any later write
    rng = random.Random()
    target, delay, seen = rng.randint(3, 11), rng.uniform(0.0, 0.3), 0
    for line in process.stdout:
        seen += line.startswith("writing ")
        if seen == target:
            time.sleep(delay)  # in this file's write, the next one, the manifest or the publication
            process.send_signal(signal.SIGKILL)
            break
    process.wait(timeout=60)
    assert process.returncode == -signal.SIGKILL, (target, delay)
    checkpoint = get_last_checkpoint(out)
    assert checkpoint is not None and hflight.verify_checkpoint(checkpoint, full=True) is not None
    resumed_from = int(Path(checkpoint).name.split("-")[1])
    run_job(out, "--resume", "last", *common[:3])
    ref_params, ref_logs = final(uninterrupted)
    params, logs = final(out)
    assert all(torch.equal(ref_params[k], params[k]) for k in ref_params), (target, delay, resumed_from)
    steps = range(resumed_from + 1, 13)
    assert [logs[s]["loss"] for s in steps] == [ref_logs[s]["loss"] for s in steps]
