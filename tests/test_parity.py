"""hflight and transformers.Trainer produce the same numbers for the same model, data and arguments."""

from __future__ import annotations

import numpy as np
import pytest
import transformers

import hflight

from .support import Factory

COMMON = Factory.pair_args(
    num_train_epochs=2, warmup_steps=0.1, weight_decay=0.01, max_grad_norm=1.0, lr_scheduler_type="linear"
)


def _run(trainer_cls, args_cls, tmp_path, name, model, train, evaluation, **kwargs):
    args_kwargs = {**COMMON, **kwargs.pop("args", {})}
    args = args_cls(output_dir=str(tmp_path / name), **args_kwargs)
    trainer = trainer_cls(model=model, args=args, train_dataset=train, eval_dataset=evaluation, **kwargs)
    output = trainer.train()
    return trainer, output, trainer.evaluate(), trainer.predict(evaluation)


def _step_logs(history):
    return [entry for entry in history if "loss" in entry]


def _assert_close_rel(a, b, rtol, what):
    assert abs(a - b) <= rtol * max(abs(a), abs(b), 1e-12), f"{what}: {a} vs {b}"


def _compare(hf, hl, rtol=1e-4):
    hf_trainer, hf_out, hf_eval, hf_pred = hf
    hl_trainer, hl_out, hl_eval, hl_pred = hl
    hf_logs, hl_logs = _step_logs(hf_trainer.state.log_history), _step_logs(hl_trainer.state.log_history)
    assert [e["step"] for e in hl_logs] == [e["step"] for e in hf_logs]
    assert len(hl_logs) == hf_trainer.state.global_step
    for a, b in zip(hf_logs, hl_logs):
        for key in ("loss", "learning_rate", "grad_norm", "epoch"):
            _assert_close_rel(a[key], b[key], rtol, f"step {a['step']} {key}")
    assert hl_out.global_step == hf_out.global_step
    _assert_close_rel(hf_out.training_loss, hl_out.training_loss, rtol, "train_loss")
    assert abs(hf_eval["eval_loss"] - hl_eval["eval_loss"]) <= 1e-5
    hf_preds = hf_pred.predictions if isinstance(hf_pred.predictions, tuple) else (hf_pred.predictions,)
    hl_preds = hl_pred.predictions if isinstance(hl_pred.predictions, tuple) else (hl_pred.predictions,)
    assert len(hf_preds) == len(hl_preds)
    for a, b in zip(hf_preds, hl_preds):
        assert a.shape == b.shape
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
    return hf_eval, hl_eval


@pytest.mark.parametrize("accumulation", [1, 2])
def test_question_answering_parity(tmp_path, factory, accumulation):
    # 42 examples / batch 4 = 11 batches: with accumulation 2 the last cycle of each epoch is a single batch.
    train, evaluation = factory.qa_dataset(42), factory.qa_dataset(20, seed=1)
    runs = [
        _run(
            cls,
            args_cls,
            tmp_path,
            name,
            factory.qa_model(),
            train,
            evaluation,
            args={"gradient_accumulation_steps": accumulation},
        )
        for name, cls, args_cls in (
            ("hf", transformers.Trainer, transformers.TrainingArguments),
            ("hl", hflight.Trainer, hflight.TrainingArguments),
        )
    ]
    _compare(*runs)
    hl_pred = runs[1][3]
    assert [p.shape for p in hl_pred.predictions] == [(20, 24), (20, 24)]
    assert set(runs[1][2]) >= {"eval_loss", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "epoch"}


@pytest.mark.parametrize("accumulation", [1, 2])
def test_sequence_classification_parity_with_compute_metrics(tmp_path, factory, accumulation):
    def accuracy(prediction):
        return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}

    train, evaluation = factory.cls_dataset(48), factory.cls_dataset(24, seed=1)
    runs = [
        _run(
            cls,
            args_cls,
            tmp_path,
            name,
            factory.cls_model(),
            train,
            evaluation,
            compute_metrics=accuracy,
            args={"gradient_accumulation_steps": accumulation},
        )
        for name, cls, args_cls in (
            ("hf", transformers.Trainer, transformers.TrainingArguments),
            ("hl", hflight.Trainer, hflight.TrainingArguments),
        )
    ]
    hf_eval, hl_eval = _compare(*runs)
    assert hl_eval["eval_accuracy"] == hf_eval["eval_accuracy"]
    assert runs[1][3].label_ids.shape == (24,)
    assert runs[1][3].metrics["test_accuracy"] == runs[0][3].metrics["test_accuracy"]


def test_parity_with_max_steps_and_epoch_logging(tmp_path, factory):
    train, evaluation = factory.qa_dataset(40), factory.qa_dataset(8, seed=1)
    extra = {"max_steps": 7, "logging_strategy": "epoch", "gradient_accumulation_steps": 2}
    runs = [
        _run(cls, args_cls, tmp_path, name, factory.qa_model(), train, evaluation, args=extra)
        for name, cls, args_cls in (
            ("hf", transformers.Trainer, transformers.TrainingArguments),
            ("hl", hflight.Trainer, hflight.TrainingArguments),
        )
    ]
    hf_logs, hl_logs = (_step_logs(r[0].state.log_history) for r in runs)
    assert [e["step"] for e in hl_logs] == [e["step"] for e in hf_logs]
    for a, b in zip(hf_logs, hl_logs):
        _assert_close_rel(a["loss"], b["loss"], 1e-4, "loss")
        _assert_close_rel(a["epoch"], b["epoch"], 1e-9, "epoch")
    assert runs[1][0].state.global_step == 7


def _causal_lm(seed: int = 0):
    import torch

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    return transformers.LlamaForCausalLM(config)


def _padded_lm_dataset(n: int, seed: int = 0):
    """Rows of 8 tokens whose labels end in a different amount of padding (-100), so the label items differ between
    micro-batches and whether position 0 is counted changes the loss."""
    import datasets

    ids = np.random.default_rng(seed).integers(0, 50, size=(n, 8))
    labels = [[t if j < 2 + i % 6 else -100 for j, t in enumerate(row)] for i, row in enumerate(ids.tolist())]
    return datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels})


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_causal_lm_loss_normalisation_parity(tmp_path, smoothing):
    """A causal LM whose loss shifts its labels (Llama: ``loss_type`` ForCausalLM) normalises by the items of
    ``labels[..., 1:]`` over the accumulation cycle, with or without label smoothing (which then gets the count too):
    transformers' numbers, step for step."""
    train, evaluation = _padded_lm_dataset(16), _padded_lm_dataset(8, seed=1)
    extra = {"gradient_accumulation_steps": 2, "label_smoothing_factor": smoothing}
    runs = [
        _run(cls, args_cls, tmp_path, name, _causal_lm(), train, evaluation, args=extra)
        for name, cls, args_cls in (
            ("hf", transformers.Trainer, transformers.TrainingArguments),
            ("hl", hflight.Trainer, hflight.TrainingArguments),
        )
    ]
    _compare(*runs)


def test_random_order_follows_torch_initial_seed_as_accelerate_draws_it(tmp_path, factory):
    """The random training order is drawn from ``data_seed``, else from torch's initial seed when the loader is
    prepared (accelerate's ``SeedableRandomSampler``), not from ``args.seed``: a ``model_init`` that seeds torch itself
    moves both trainers' orders alike (args.seed 42, model_init seeding 0)."""

    def model_init():
        import torch

        torch.manual_seed(0)
        return factory.cls_model(seed=0)

    train = factory.cls_dataset(24)
    runs = []
    for library in (transformers, hflight):
        args = library.TrainingArguments(output_dir=str(tmp_path / library.__name__), per_device_train_batch_size=4,
                                         max_steps=3, logging_steps=1, report_to="none", save_strategy="no",
                                         disable_tqdm=True, seed=42, use_cpu=True)  # fmt: skip
        trainer = library.Trainer(args=args, model_init=model_init, train_dataset=train)
        trainer.train()
        runs.append([entry["loss"] for entry in _step_logs(trainer.state.log_history)])
    assert runs[0] == runs[1]
