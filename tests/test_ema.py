"""EMACallback: the average is right, evaluation and saved models use it, training continues on raw weights,
and it survives a resume."""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file

from hflight import Trainer, TrainingArguments
from hflight.callbacks.ema import EMACallback

from .support import torch_file_records


class Snapshots(transformers.TrainerCallback):
    """Raw parameters (and the EMA's average, when given) after every optimizer step."""

    def __init__(self, ema=None):
        self.ema, self.raw, self.averages = ema, {}, {}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.raw[state.global_step] = {n: p.detach().clone() for n, p in model.named_parameters()}
        if self.ema is not None:
            self.averages[state.global_step] = {n: t.clone() for n, t in self.ema.shadow.items()}


def _args(tmp_path, **kwargs):
    base = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        max_steps=8,
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        seed=0,
    )
    base.update(kwargs)
    return TrainingArguments(**base)


def _trainer(tmp_path, factory, callbacks, **kwargs):
    return Trainer(
        factory.qa_model(dropout=0.1),
        _args(tmp_path, **kwargs),
        train_dataset=factory.qa_dataset(40),
        eval_dataset=factory.qa_dataset(8, seed=1),
        callbacks=callbacks,
    )


def test_average_follows_the_formula(tmp_path, factory):
    ema = EMACallback(decay=0.9, use_num_updates=False)
    snaps = Snapshots()
    trainer = _trainer(tmp_path, factory, [snaps, ema])
    initial = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    expected = initial
    for step in range(1, 9):
        expected = {n: 0.9 * expected[n] + 0.1 * snaps.raw[step][n] for n in expected}
    for name, value in expected.items():
        torch.testing.assert_close(ema.shadow[name], value, atol=1e-6, rtol=1e-5)
    # after training the model holds the averaged weights
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p.detach(), ema.shadow[name])


def test_num_updates_warm_start():
    ema = EMACallback(decay=0.999)
    assert ema.current_decay() == pytest.approx(0.1)
    ema.num_updates = 10
    assert ema.current_decay() == pytest.approx(11 / 20)
    with pytest.raises(ValueError, match="decay"):
        EMACallback(decay=1.5)


def test_evaluation_and_checkpoints_use_the_average_training_the_raw_weights(tmp_path, factory):
    plain = Snapshots()  # same evaluations (their loaders draw from the global RNG, as in HF), no EMA
    _trainer(tmp_path / "plain", factory, [plain], eval_strategy="steps", eval_steps=4).train()

    ema = EMACallback(decay=0.8)
    snaps = Snapshots(ema)
    trainer = _trainer(
        tmp_path / "ema",
        factory,
        [ema, snaps],
        eval_strategy="steps",
        eval_steps=4,
        save_strategy="steps",
        save_steps=4,
    )
    trainer.train()
    # swapping the average in for evaluation and saving did not disturb training: same raw weights as without EMA
    for name, value in plain.raw[8].items():
        assert torch.equal(snaps.raw[8][name], value), name
    # the checkpoint's model is the average at that step
    saved = load_file(str(tmp_path / "ema" / "checkpoint-4" / "model.safetensors"))
    for name, value in snaps.averages[4].items():
        assert torch.equal(saved[name], value), name
    # and the logged eval_loss is the loss of that averaged model
    logged = next(e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e and e["step"] == 4)
    averaged = transformers.AutoModelForQuestionAnswering.from_pretrained(str(tmp_path / "ema" / "checkpoint-4"))
    check = Trainer(averaged, _args(tmp_path / "check"), eval_dataset=factory.qa_dataset(8, seed=1))
    assert check.evaluate()["eval_loss"] == pytest.approx(logged, rel=1e-6)


def test_average_survives_resume(tmp_path, factory):
    full_ema = EMACallback(decay=0.8)
    full = _trainer(tmp_path / "full", factory, [full_ema], max_steps=12)
    full.train()

    class StopAt6(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 6

    first = _trainer(
        tmp_path / "part",
        factory,
        [EMACallback(decay=0.8), StopAt6()],
        max_steps=12,
        save_strategy="steps",
        save_steps=6,
    )
    first.train()
    resumed_ema = EMACallback(decay=0.8)
    resumed = _trainer(tmp_path / "part", factory, [resumed_ema], max_steps=12)
    resumed.train(resume_from_checkpoint=str(tmp_path / "part" / "checkpoint-6"))
    assert resumed_ema.num_updates == full_ema.num_updates == 12
    for name, value in full_ema.shadow.items():
        torch.testing.assert_close(resumed_ema.shadow[name], value, atol=1e-6, rtol=0)
    full_losses = [e["loss"] for e in full.state.log_history if "loss" in e and e["step"] > 6]
    resumed_losses = [e["loss"] for e in resumed.state.log_history if "loss" in e and e["step"] > 6]
    assert len(resumed_losses) == 6
    assert resumed_losses == pytest.approx(full_losses, rel=1e-6)


def test_save_async_writes_the_synchronous_run_s_checkpoints_last_included(tmp_path, factory):
    """With save_async the model files are written from a copy: the averaged weights' copy, for the run's last
    checkpoint too (written from the state itself otherwise), so both runs' checkpoints are the same files, the
    tensor archives record for record (save_async writes torch's records in its own framing)."""
    runs = {}
    for save_async in (False, True):
        out = tmp_path / f"async-{save_async}"
        trainer = _trainer(out, factory, [EMACallback(decay=0.5)], max_steps=4, save_strategy="steps", save_steps=2,
                           save_async=save_async)  # fmt: skip
        trainer.train()
        runs[save_async] = out, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    (sync, averaged), (background, _) = runs[False], runs[True]
    for name in ("checkpoint-2", "checkpoint-4"):
        a, b = sync / name, background / name
        assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
        differ = [p.name for p in sorted(a.iterdir()) if p.read_bytes() != (b / p.name).read_bytes()]
        assert set(differ) <= {"checkpoint_manifest.json", "optimizer.pt", "training_args.bin"}, (name, differ)
        for archive in ("optimizer.pt", "ema_state.pt"):
            ours, theirs = torch_file_records(a / archive), torch_file_records(b / archive)
            assert [k for k in ours if ours[k] != theirs[k]] in ([], [".data/serialization_id"]), (name, archive)
    last = load_file(str(background / "checkpoint-4" / "model.safetensors"))
    for name, value in averaged.items():  # the model ends with the averaged weights: those of the last checkpoint
        assert torch.equal(last[name], value), name
