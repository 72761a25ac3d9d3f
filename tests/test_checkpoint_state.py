"""What a resume restores besides the weights, and checks before anything changes: ``trainer_state.json``
validated (transformers' starting point for the best metric, unknown keys dropped with a warning), the optimizer and
scheduler files named when missing, empty or not fitting the model, ``save_only_model`` folders resumed from the
weights, changed arguments named (the new cadence wins), and the first non-finite logged loss reported once.

The runs are in-process (tests/checkpoint_runs.py)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import hflight
from hflight.checkpoints.manifest import MANIFEST_NAME, verify_checkpoint
from hflight.checkpoints.parts import read_trainer_state

from .checkpoint_runs import CreatesMarker, copy_checkpoint, make_trainer, params, refresh_manifest

GOOD_STATE = {"global_step": 6, "epoch": 1.2, "max_steps": 12, "log_history": []}


@pytest.mark.parametrize(
    "content, message",
    [
        ("{}", r"lacks the key\(s\) 'global_step', 'epoch', 'max_steps', 'log_history'"),
        ("[]", "must hold a JSON object"),
        ('{"global_step": 6,', "is not valid JSON"),
        (json.dumps({**GOOD_STATE, "global_step": "6"}), "key 'global_step' must be an integer, got \"6\""),
        (json.dumps({**GOOD_STATE, "global_step": True}), "key 'global_step' must be an integer"),
        (json.dumps({**GOOD_STATE, "save_steps": None}), "key 'save_steps' must be an integer or a number"),
        (json.dumps({**GOOD_STATE, "log_history": {}}), "key 'log_history' must be a list"),
        (json.dumps({**GOOD_STATE, "log_history": [1]}), "'log_history' entry 0 must be an object"),
        (json.dumps({**GOOD_STATE, "global_step": -1}), "must not be negative"),
        (json.dumps({**GOOD_STATE, "stateful_callbacks": {"X": 3}}), r"'stateful_callbacks'\['X'\]"),
        (json.dumps({**GOOD_STATE, "stateful_callbacks": {"X": {"args": 1}}}), r"with 'args' and 'attributes' objects"),
        (
            '{"global_step": 6, "epoch": NaN, "max_steps": 12, "log_history": []}',
            "key 'epoch' must be a finite number, got NaN",
        ),
        (
            json.dumps({**GOOD_STATE, "best_metric": float("inf"), "best_global_step": 3}),
            "key 'best_metric' must be a finite number, got Infinity",
        ),
        (json.dumps({**GOOD_STATE, "total_flos": float("-inf")}), "key 'total_flos' must be a finite number"),
    ],
)
def test_trainer_state_json_is_validated(tmp_path, content, message):
    path = tmp_path / "trainer_state.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as error:
        read_trainer_state(path)
    assert str(path) in str(error.value)


def test_an_invalid_trainer_state_is_rejected_before_the_model_is_touched(saved, tmp_path, factory):
    folder = copy_checkpoint(saved, tmp_path)
    (folder / "trainer_state.json").write_text("{}")
    refresh_manifest(folder)
    trainer = make_trainer(tmp_path / "out", factory)
    before = params(trainer)
    with pytest.raises(ValueError, match=r"trainer_state\.json lacks the key\(s\) 'global_step'"):
        trainer.train(resume_from_checkpoint=str(folder))
    assert all(torch.equal(before[k], v) for k, v in params(trainer).items())


def test_transformers_starting_point_for_the_best_metric_means_no_best_yet(tmp_path):
    """transformers starts best_metric at -inf/+inf and writes it as such when no evaluation improved on it (a NaN
    metric): that is read as "no best yet"; hflight writes null instead."""
    path = tmp_path / "trainer_state.json"
    path.write_text(json.dumps({**GOOD_STATE, "best_metric": float("-inf"), "best_global_step": None}))
    assert read_trainer_state(path).best_metric is None


def test_a_run_whose_metric_never_improved_writes_a_finite_state_and_resumes(tmp_path, factory):
    """A NaN evaluation metric never beats transformers' starting point (-inf for greater_is_better): hflight keeps it
    in memory as transformers does (EarlyStoppingCallback compares with it), but writes null, not -Infinity."""
    trainer = make_trainer(tmp_path, factory, stop_at=3, eval_strategy="steps", eval_steps=3,
                           metric_for_best_model="score", greater_is_better=True)  # fmt: skip
    trainer.compute_metrics = lambda prediction: {"score": float("nan")}
    trainer.train()
    assert trainer.state.best_metric == float("-inf")
    written = json.loads((tmp_path / "checkpoint-3" / "trainer_state.json").read_text())
    assert written["best_metric"] is None and written["best_global_step"] is None
    resumed = make_trainer(tmp_path / "resumed", factory, max_steps=4, save_strategy="no")
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    assert resumed.state.global_step == 4


def test_unknown_trainer_state_keys_are_dropped_with_a_warning(tmp_path, caplog):
    path = tmp_path / "trainer_state.json"
    path.write_text(json.dumps({**GOOD_STATE, "from_the_future": 1}))
    with caplog.at_level(logging.WARNING, logger="hflight.checkpoints.resume"):
        assert read_trainer_state(path).global_step == 6
    assert "from_the_future" in caplog.text


def test_a_missing_empty_or_crafted_optimizer_file_is_named(saved, tmp_path, factory):
    folder = copy_checkpoint(saved, tmp_path)
    (folder / "optimizer.pt").unlink()
    with pytest.raises(ValueError, match=r"checkpoint-6 is incomplete or damaged: no optimizer\.pt"):
        make_trainer(tmp_path / "a", factory).train(resume_from_checkpoint=str(folder))

    (folder / "optimizer.pt").write_bytes(b"")
    refresh_manifest(folder)
    with pytest.raises(ValueError, match=r"Cannot restore .*optimizer\.pt: the file is empty \(0 bytes\)"):
        make_trainer(tmp_path / "b", factory).train(resume_from_checkpoint=str(folder))

    marker = tmp_path / "pwned"
    torch.save({"state": {}, "param_groups": CreatesMarker(marker)}, folder / "optimizer.pt")
    refresh_manifest(folder)
    with pytest.raises(ValueError, match=r"optimizer\.pt cannot be loaded safely.*refers to io\.open"):
        make_trainer(tmp_path / "c", factory).train(resume_from_checkpoint=str(folder))
    assert not marker.exists()

    (folder / MANIFEST_NAME).unlink()  # as transformers.Trainer writes it: no manifest
    (folder / "optimizer.pt").unlink()
    with pytest.raises(ValueError, match=r"has scheduler\.pt but no optimizer\.pt"):
        make_trainer(tmp_path / "d", factory).train(resume_from_checkpoint=str(folder))


def test_save_only_model_folders_resume_from_the_weights_with_a_warning(tmp_path, factory, caplog):
    make_trainer(tmp_path, factory, stop_at=3, save_only_model=True).train()
    folder = tmp_path / "checkpoint-3"
    assert not (folder / "optimizer.pt").exists() and verify_checkpoint(folder)["save_only_model"] is True
    resumed = make_trainer(tmp_path / "resumed", factory, model=factory.qa_model(seed=5, dropout=0.1), max_steps=5)
    with caplog.at_level(logging.WARNING, logger="hflight.checkpoints.resume"):
        resumed.train(resume_from_checkpoint=str(folder))
    assert "saved with save_only_model=True" in caplog.text and "reproducibility is not guaranteed" in caplog.text
    logged = {e["step"]: e for e in resumed.state.log_history if "loss" in e}
    assert sorted(logged) == [1, 2, 3, 4, 5]  # steps 1-3 from the checkpoint's history, 4-5 trained now
    assert logged[4]["learning_rate"] == 0.0  # a fresh schedule starts its warmup again, as in transformers


def test_changed_arguments_are_named_and_the_new_cadence_wins(saved, tmp_path, factory, caplog):
    folder = copy_checkpoint(saved, tmp_path)
    out = tmp_path / "out"
    trainer = make_trainer(
        out, factory, per_device_train_batch_size=8, gradient_accumulation_steps=1, data_seed=3, save_steps=5
    )
    with caplog.at_level(logging.WARNING, logger="hflight.checkpoints.resume"):
        trainer.train(resume_from_checkpoint=str(folder))
    text = caplog.text
    assert "change the data position or the step arithmetic" in text
    assert "per_device_train_batch_size: 8 (now) != 4 (checkpoint)" in text
    assert "gradient_accumulation_steps: 1 (now) != 2 (checkpoint)" in text
    assert "data_seed: 3 (now) != None (checkpoint)" in text  # the sampler's seed was `seed`, now 3
    assert "save_steps: 5 (now) != 3 (checkpoint)" in text and "this run's logging/evaluation/saving cadence" in text
    assert "seed:" not in text.replace("data_seed", "")
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-12"]
    assert read_trainer_state(out / "checkpoint-10" / "trainer_state.json").save_steps == 5


def test_resuming_with_the_same_arguments_is_silent(saved, tmp_path, factory, caplog):
    folder = copy_checkpoint(saved, tmp_path)
    with caplog.at_level(logging.WARNING, logger="hflight"):
        trainer = make_trainer(tmp_path / "out", factory, save_strategy="no", max_steps=7)
        trainer.train(resume_from_checkpoint=str(folder))
    assert trainer.state.global_step == 7 and "(now) !=" not in caplog.text


class NaNFrom(hflight.Trainer):
    """Makes the loss NaN from optimizer step ``nan_from`` on (the weights then turn NaN too)."""

    nan_from = 3

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if self.state.global_step + 1 >= self.nan_from:
            return loss * float("nan")
        return loss


def test_the_first_nonfinite_logged_loss_is_reported_once(tmp_path, factory, caplog):
    args = hflight.TrainingArguments(
        output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=4, logging_steps=1, save_strategy="no",
        logging_nan_inf_filter=False, report_to="none", disable_tqdm=True, dataloader_pin_memory=False,
    )  # fmt: skip
    trainer = NaNFrom(factory.qa_model(), args, train_dataset=factory.qa_dataset(24))
    with caplog.at_level(logging.WARNING, logger="hflight"):
        trainer.train()
    warnings = [r.getMessage() for r in caplog.records if "logged" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("Step 3: logged loss=nan, grad_norm=nan.")


def _shrunk_state(state):
    entry = state["state"][0]
    return {**state, "state": {**state["state"], 0: {**entry, "exp_avg": torch.zeros(3)}}}


MISFITS = {
    "no optimizer groups": (
        "optimizer.pt", lambda s: {"state": {}, "param_groups": []},
        r"optimizer\.pt: 'param_groups' has 0 group\(s\), the AdamW this run builds has 2",
    ),
    "optimizer state shape": (
        "optimizer.pt", _shrunk_state,
        r"optimizer\.pt: 'state'\[0\]\['exp_avg'\] is \[3\], parameter bert\.embeddings\.word_embeddings\.weight "
        r"has shape \[100, 32\]",
    ),
    "empty scheduler": (
        "scheduler.pt", lambda s: {},
        r"scheduler\.pt lacks the field\(s\) 'last_epoch', 'base_lrs', '_last_lr', '_step_count' of LambdaLR",
    ),
    "scheduler base_lrs length": (
        "scheduler.pt", lambda s: {**s, "base_lrs": s["base_lrs"][:1]},
        r"scheduler\.pt: field 'base_lrs' has 1 entries, LambdaLR has 2 \(one per parameter group\)",
    ),
    "scheduler overwriting an attribute": (
        "scheduler.pt", lambda s: {**s, "optimizer": {}},
        r"scheduler\.pt: field 'optimizer' is not part of LambdaLR's state",
    ),
}  # fmt: skip


@pytest.mark.parametrize("misfit", MISFITS)
def test_an_optimizer_or_scheduler_state_that_does_not_fit_is_refused_before_anything_changes(
    saved, tmp_path, factory, misfit
):
    """torch loads an optimizer state of no groups, a scheduler state of {} or a base_lrs of the wrong length
    without a word (the last fails at the first scheduler step, naming no file); they were rejected, if at all,
    after the weights had been copied in."""
    name, damage, message = MISFITS[misfit]
    folder = copy_checkpoint(saved, tmp_path)
    torch.save(damage(torch.load(folder / name, weights_only=True)), folder / name)
    refresh_manifest(folder)
    trainer = make_trainer(tmp_path / "out", factory)
    before = params(trainer)
    with pytest.raises(ValueError, match=message):
        trainer.train(resume_from_checkpoint=str(folder))
    assert all(torch.equal(before[k], v) for k, v in params(trainer).items()), "the weights were copied in"
    assert trainer.optimizer is None and trainer.lr_scheduler is None, "nothing was built on the trainer"


def test_a_state_by_name_grouped_by_another_layout_maps_each_group_to_its_saved_one(tmp_path):
    """transformers splits a group by device mesh where DTensor and plain parameters mix (a tensor-parallel mixture of
    experts): its 3 groups (decay on the mesh, decay plain, no decay) resumed by a run of 2 (decay, no decay). Each of
    the run's groups takes the saved group its parameters were in, when the saved groups it joins are set alike; the
    scheduler's per-group lists follow. Saved groups set differently, or a parameter no saved group lists, are refused
    naming the file."""
    from hflight.checkpoints.optim_state import (
        IncompatibleTrainingState,
        check_named_optimizer_state,
        group_map,
        regrouped_scheduler,
    )

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    names = {id(p): name for name, p in model.named_parameters()}
    w0, b0, w1, b1 = model.parameters()
    optimizer = torch.optim.AdamW(
        [{"params": [w0, w1], "weight_decay": 0.1}, {"params": [b0, b1], "weight_decay": 0.0}]
    )
    decay, plain = {"lr": 1e-3, "weight_decay": 0.1}, {"lr": 1e-3, "weight_decay": 0.0}
    saved = [
        {**decay, "params": ["0.weight"]},
        {**decay, "params": ["1.weight"]},
        {**plain, "params": ["0.bias", "1.bias"]},
    ]
    path = tmp_path / "optimizer.bin"
    assert group_map(path, saved, optimizer, names) == [0, 2]
    check_named_optimizer_state(path, {"state": {}, "param_groups": saved}, optimizer, names)
    scheduler = {"base_lrs": [1e-3, 1e-3, 5e-4], "_last_lr": [1, 2, 3], "last_epoch": 2}
    assert regrouped_scheduler(scheduler, [0, 2], 3) == {"base_lrs": [1e-3, 5e-4], "_last_lr": [1, 3], "last_epoch": 2}
    assert regrouped_scheduler(scheduler, [0, 1, 2], 3) is scheduler
    reordered = [saved[2], {**decay, "params": ["0.weight", "1.weight"]}]  # the saved groups in the other order
    assert group_map(path, reordered, optimizer, names) == [1, 0]
    assert regrouped_scheduler({"base_lrs": [5e-4, 1e-3], "_last_lr": [3, 1], "last_epoch": 2}, [1, 0], 2) == {
        "base_lrs": [1e-3, 5e-4], "_last_lr": [1, 3], "last_epoch": 2}  # fmt: skip
    refusal = r"optimizer.bin: the optimizer's group 0 holds parameters of the saved groups \[0, 1\], which are set"
    with pytest.raises(IncompatibleTrainingState, match=refusal):
        group_map(path, [saved[0], {**plain, "params": ["1.weight"]}, saved[2]], optimizer, names)
    with pytest.raises(IncompatibleTrainingState, match=r"group 1 steps \['1.bias'\], which no saved parameter group"):
        group_map(path, [saved[0], saved[1], {**plain, "params": ["0.bias"]}], optimizer, names)
