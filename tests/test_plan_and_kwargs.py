"""Run-length plan equals transformers' set_initial_training_values; the TrainingArguments -> Lightning mapping."""

from __future__ import annotations

import pytest
import torch
import transformers

from hflight import Trainer, TrainingArguments
from hflight.arguments.lightning_kwargs import PRECISION, lightning_trainer_kwargs, split_callbacks
from hflight.run.plan import plan_training


@pytest.mark.parametrize(
    "n, batch, accumulation, epochs, max_steps",
    [
        (40, 4, 1, 2.0, -1),
        (42, 4, 2, 2.0, -1),
        (42, 4, 3, 1.5, -1),
        (10, 4, 4, 3.0, -1),
        (40, 4, 2, 2.0, 7),
        (40, 8, 1, 1.0, 12),
        (5, 8, 1, 1.0, -1),
        (40, 4, 2, 2.0, 0),
    ],
)
def test_plan_equals_transformers(tmp_path, factory, n, batch, accumulation, epochs, max_steps):
    common = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=accumulation,
        num_train_epochs=epochs,
        max_steps=max_steps,
        report_to="none",
    )
    data = factory.qa_dataset(n)
    hf = transformers.Trainer(factory.qa_model(), transformers.TrainingArguments(**common), train_dataset=data)
    loader = hf.get_train_dataloader()
    expected = hf.set_initial_training_values(hf.args, loader)
    ours = Trainer(factory.qa_model(), TrainingArguments(**common), train_dataset=data)
    our_loader = ours.get_train_dataloader()
    plan = plan_training(ours.args, len(our_loader), ours.num_examples(our_loader))
    assert (
        plan.num_train_epochs,
        plan.num_update_steps_per_epoch,
        plan.num_examples,
        plan.num_train_samples,
        plan.total_train_batch_size,
        plan.steps_in_epoch,
        plan.max_steps,
    ) == tuple(expected)


def test_max_steps_zero_trains_one_step_as_transformers(tmp_path, factory):
    """transformers 5 treats only a negative max_steps as "use num_train_epochs": with max_steps=0 its state's
    max_steps is 0 and DefaultFlowCallback stops after the first optimizer step (hflight trained whole epochs)."""
    common = dict(max_steps=0, num_train_epochs=2, per_device_train_batch_size=4, logging_steps=1, save_strategy="no",
                  report_to="none", disable_tqdm=True, seed=0)  # fmt: skip
    logs = []
    for trainer_cls, args_cls in ((transformers.Trainer, transformers.TrainingArguments), (Trainer, TrainingArguments)):
        args = args_cls(output_dir=str(tmp_path / trainer_cls.__module__), **common)
        trainer = trainer_cls(factory.qa_model(), args, train_dataset=factory.qa_dataset(16))
        result = trainer.train()
        assert (result.global_step, trainer.state.max_steps) == (1, 0)
        logs.append([{k: v for k, v in e.items() if "runtime" not in k and "per_second" not in k}
                     for e in trainer.state.log_history])  # fmt: skip
    assert logs[0] == logs[1]


def test_plan_for_iterable_data_needs_max_steps(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=-1, report_to="none")
    with pytest.raises(ValueError, match="max_steps must be set to a positive value"):
        plan_training(args, None, None)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=5, report_to="none")
    assert plan_training(args, None, None).max_steps == 5


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({}, {"precision": "32-true", "accelerator": "auto", "devices": "auto", "strategy": "auto", "num_nodes": 1}),
        ({"bf16": True}, {"precision": "bf16-mixed"}),
        ({"fp16": True, "accelerator": "cuda"}, {"precision": "16-mixed", "accelerator": "cuda"}),
        ({"devices": "2", "strategy": "ddp", "num_nodes": 2}, {"devices": 2, "strategy": "ddp", "num_nodes": 2}),
        ({"full_determinism": True}, {"deterministic": None}),  # transformers' enable_full_determinism did it
    ],
)
def test_lightning_kwargs_table(tmp_path, fields, expected):
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", **fields)
    kwargs = lightning_trainer_kwargs(args, [], fitting=True)
    for key, value in expected.items():
        assert kwargs[key] == value, key
    # what HF does differently is always off on the Lightning side
    assert kwargs["enable_checkpointing"] is False and kwargs["enable_progress_bar"] is False
    assert kwargs["use_distributed_sampler"] is False and kwargs["num_sanity_val_steps"] == 0
    assert kwargs["max_steps"] == -1 and "accumulate_grad_batches" not in kwargs
    assert "gradient_clip_val" not in kwargs  # clipping is HF's, inside the module


def test_precision_table_covers_every_flag_combination():
    assert set(PRECISION) == {(False, False), (True, False), (False, True)}


def test_split_callbacks():
    import lightning as L

    hf_cb, l_cb = transformers.EarlyStoppingCallback, L.Callback()
    assert split_callbacks([hf_cb, l_cb]) == ([hf_cb], [l_cb])
    with pytest.raises(TypeError, match="pass an instance"):
        split_callbacks([L.Callback])


def test_bf16_mixed_precision_trains_on_cpu(tmp_path, factory):
    args = TrainingArguments(
        output_dir=str(tmp_path),
        bf16=True,
        max_steps=2,
        per_device_train_batch_size=4,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
    )
    trainer = Trainer(factory.qa_model(), args, train_dataset=factory.qa_dataset(8))
    trainer.train()
    assert trainer.lightning_trainer.precision == "bf16-mixed"
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in trainer.state.log_history if "loss" in e)
    assert next(trainer.model.parameters()).dtype == torch.float32  # mixed precision keeps fp32 master weights


def test_fp16_on_the_cpu_is_full_precision_as_transformers_but_backends_keep_theirs(tmp_path):
    """accelerate enables fp16 autocast and scaling only off the CPU; a backend strategy (IPU) keeps 16-mixed."""
    cpu = TrainingArguments(output_dir=str(tmp_path), report_to="none", fp16=True, use_cpu=True)
    assert lightning_trainer_kwargs(cpu, [], fitting=True)["precision"] == "32-true"
    ipu = TrainingArguments(output_dir=str(tmp_path), report_to="none", fp16=True, strategy="ipu")
    assert lightning_trainer_kwargs(ipu, [], fitting=True)["precision"] == "16-mixed"
