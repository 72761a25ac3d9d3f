"""Mixed precision's autocast covers the model's forward only, as accelerate's ``prepare_model`` arranges it for
transformers' ``Trainer`` (issue 47): what a ``compute_loss`` override computes from the outputs runs in float32, the
outputs come back float32, and the model is its own again after the run (``hflight.run.autocast``)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import transformers

import hflight

PAIR = (("hf", transformers.Trainer, transformers.TrainingArguments),
        ("hl", hflight.Trainer, hflight.TrainingArguments))  # fmt: skip


def _margin_loss(model, inputs):
    """A loss computed outside the forward whose value depends on the dtype it runs in: a matmul of the logits (bf16
    under autocast) and a log-sigmoid of their differences (the shape of TRL's reward loss)."""
    inputs = dict(inputs)
    labels = inputs.pop("labels")
    outputs = model(**inputs)
    logits = outputs.logits
    mixed = logits @ torch.linspace(-1.0, 1.0, logits.shape[-1] ** 2, device=logits.device).view(logits.shape[-1], -1)
    chosen = mixed.gather(1, labels[:, None]).squeeze(1)
    loss = -torch.nn.functional.logsigmoid(chosen - mixed.mean(-1)).mean()
    return loss, outputs, (logits.dtype, mixed.dtype, torch.is_autocast_enabled("cpu"))


def _subclass(trainer_cls):
    class MarginTrainer(trainer_cls):
        seen: list = []

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, outputs, seen = _margin_loss(model, inputs)
            self.seen.append(seen)
            return (loss, outputs) if return_outputs else loss

    return MarginTrainer


def test_a_loss_outside_the_forward_is_float32_as_transformers(tmp_path, factory):
    """bf16 on the CPU, a ``compute_loss`` override whose loss is made from the logits: every step's loss and grad
    norm, the evaluation's loss and predictions, and the final weights are transformers' number for number; in both
    the logits reach ``compute_loss`` as float32 and it runs outside autocast (under Lightning's step-wide autocast
    the loss was bfloat16: step-1 loss 0.6953125 against 0.69394648, grad norm 0.14948 against 0.15002)."""
    import numpy as np

    seen = {}
    for name, trainer_cls, args_cls in PAIR:
        args = args_cls(str(tmp_path / name), **factory.pair_args(bf16=True, use_cpu=True, max_steps=4))
        trainer = _subclass(trainer_cls)(factory.cls_model(), args, train_dataset=factory.cls_dataset(16))
        trainer.train()
        history = [{k: v for k, v in e.items() if not k.endswith(("runtime", "per_second"))}
                   for e in trainer.state.log_history]  # fmt: skip
        prediction = trainer.predict(factory.cls_dataset(8, seed=1))
        seen[name] = history, prediction, trainer.model.state_dict(), set(trainer.seen)
    (hf_history, hf_prediction, hf_weights, hf_seen), (history, prediction, weights, dtypes) = seen["hf"], seen["hl"]
    assert sum("grad_norm" in e for e in hf_history) == 4
    assert history == hf_history
    assert prediction.metrics["test_loss"] == hf_prediction.metrics["test_loss"]
    np.testing.assert_array_equal(prediction.predictions, hf_prediction.predictions)
    assert all(torch.equal(value, hf_weights[key]) for key, value in weights.items())
    assert dtypes == hf_seen == {(torch.float32, torch.float32, False)}


def test_the_forward_is_autocast_during_the_run_and_the_models_own_afterwards(tmp_path, factory):
    """Inside the run the model's forward is autocast (its inner layers compute in bfloat16) and
    ``accelerator.autocast()`` is accelerate's (bf16, ``enabled=False`` off); afterwards the model has no patched
    forward: it deep-copies and pickles, and returns what a plain model returns."""
    model = factory.cls_model()
    inner = []
    hook = model.bert.pooler.dense.register_forward_hook(lambda module, args, output: inner.append(output.dtype))

    class Probe(hflight.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            accelerator = trainer.accelerator
            with accelerator.autocast():
                inner.append(("autocast", torch.get_autocast_dtype("cpu"), torch.is_autocast_enabled("cpu")))
            with accelerator.autocast({"enabled": False}):
                inner.append(("off", torch.is_autocast_enabled("cpu")))

    args = hflight.TrainingArguments(str(tmp_path), **factory.pair_args(bf16=True, use_cpu=True, max_steps=1))
    trainer = hflight.Trainer(model, args, train_dataset=factory.cls_dataset(4), callbacks=[Probe()])
    trainer.train()
    assert inner == [torch.bfloat16, ("autocast", torch.bfloat16, True), ("off", False)]
    assert "forward" not in vars(model)
    inputs = {"input_ids": torch.tensor([[1, 2, 3]])}
    model(**inputs)
    assert inner[-1] == torch.float32  # no autocast after the run
    hook.remove()
    assert torch.equal(copy.deepcopy(model)(**inputs).logits, model(**inputs).logits)
    assert torch.equal(pickle.loads(pickle.dumps(model))(**inputs).logits, model(**inputs).logits)


@pytest.mark.parametrize("library", ["accelerate", "hflight"])
def test_prepare_model_for_evaluation_wraps_the_forward_as_accelerate(tmp_path, factory, library):
    """``accelerator.prepare_model(model, evaluation_mode=True)`` under bf16 (TRL's reference and reward models): the
    model's forward autocast, its outputs float32, the values accelerate's own prepared model gives; ``unwrap_model(
    model, keep_fp32_wrapper=False)`` gives back the plain forward; a deep copy calls its own weights."""
    inputs = {"input_ids": torch.tensor([[1, 2, 3, 4]])}
    reference = factory.cls_model()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(**inputs).logits.float()
    model = factory.cls_model()
    if library == "accelerate":
        import accelerate

        accelerator = accelerate.Accelerator(mixed_precision="bf16", cpu=True)
    else:
        args = hflight.TrainingArguments(str(tmp_path), bf16=True, use_cpu=True, report_to="none")
        accelerator = hflight.Trainer(model, args).accelerator
    prepared = accelerator.prepare_model(model, evaluation_mode=True)
    logits = prepared(**inputs).logits
    assert logits.dtype == torch.float32 and torch.equal(logits, expected)
    if library == "hflight":
        twin = copy.deepcopy(prepared)
        with torch.no_grad():
            twin.classifier.bias.add_(1.0)
        assert torch.equal(prepared(**inputs).logits, expected)
        assert not torch.equal(twin(**inputs).logits, expected)
    plain = accelerator.unwrap_model(prepared, keep_fp32_wrapper=False)
    assert torch.equal(plain(**inputs).logits, reference(**inputs).logits)
