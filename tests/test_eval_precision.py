"""Reduced-precision evaluation (issue 42, item 3): ``bf16_full_eval`` as transformers does it, hflight's
``int8_eval`` (an int8 copy of the model for ``evaluate()``/``predict()`` outside ``train()``), each refused where it
cannot apply and falling back, with a warning, on a CPU without the instructions it needs; and the evaluation path
outside training (issue 42, item 1): run in this process where Lightning's ``validate`` adds nothing, with the
same results, and its run reused while nothing changed."""

from __future__ import annotations

import copy

import lightning as L
import numpy as np
import pytest
import torch
import transformers

import hflight
from hflight.run import eval_precision

PAIRS = [
    ("hf", transformers.Trainer, transformers.TrainingArguments),
    ("hl", hflight.Trainer, hflight.TrainingArguments),
]


def _trainer(tmp_path, factory, model=None, **overrides):
    args = hflight.TrainingArguments(str(tmp_path), **factory.pair_args(**overrides))
    return hflight.Trainer(
        model if model is not None else factory.cls_model(), args, eval_dataset=factory.cls_dataset(16)
    )


@pytest.fixture
def int8_cpu(monkeypatch):
    """A CPU with int8 dot-product instructions, as far as hflight can tell (the tests run on any CPU)."""
    monkeypatch.setattr(eval_precision, "cpu_flags", lambda: frozenset({"avx512_vnni"}))


@pytest.fixture
def plain_cpu(monkeypatch):
    """A CPU with none of the reduced-precision instructions (AVX2 only, as a first-generation Zen)."""
    monkeypatch.setattr(eval_precision, "cpu_flags", lambda: frozenset({"avx2", "fma"}))


# ---- bf16_full_eval / fp16_full_eval: transformers' fields -----------------------------------------------------
@pytest.mark.parametrize("field", ["bf16_full_eval", "fp16_full_eval"])
def test_full_eval_casts_the_model_and_gives_transformers_predictions(tmp_path, factory, field):
    """As transformers' evaluation_loop: the model cast (and left cast), the same loss and logits."""
    results = {}
    for name, trainer_cls, args_cls in PAIRS:
        model = factory.cls_model()
        args = args_cls(str(tmp_path / name), **factory.pair_args(**{field: True}, use_cpu=True))
        output = trainer_cls(model, args).predict(factory.cls_dataset(16))
        results[name] = output
        assert next(model.parameters()).dtype == (torch.bfloat16 if field == "bf16_full_eval" else torch.float16)
    assert results["hl"].metrics["test_loss"] == results["hf"].metrics["test_loss"]
    np.testing.assert_array_equal(results["hl"].predictions, results["hf"].predictions)


def test_bf16_full_eval_on_a_cpu_without_bf16_warns_and_still_casts(tmp_path, factory, plain_cpu):
    model = factory.cls_model()
    with pytest.warns(UserWarning, match="bf16_full_eval: this CPU has none of avx512_bf16, amx_bf16"):
        _trainer(tmp_path, factory, model, bf16_full_eval=True).evaluate()
    assert next(model.parameters()).dtype == torch.bfloat16  # transformers' behaviour, whatever the CPU


# ---- int8_eval: hflight's -----------------------------------------------------------------------------------------
def test_int8_eval_runs_an_int8_copy_and_leaves_the_model_untouched(tmp_path, factory, int8_cpu):
    model = factory.cls_model()
    before = copy.deepcopy(model.state_dict())
    full = _trainer(tmp_path / "fp32", factory, factory.cls_model()).predict(factory.cls_dataset(16))
    trainer = _trainer(tmp_path / "int8", factory, model, int8_eval=True)
    int8 = trainer.predict(factory.cls_dataset(16))
    # the model: same tensors, same values, float32 linear layers
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(type(m) is not torch.ao.nn.quantized.dynamic.Linear for m in model.modules())
    # the numbers: close to float32's, not equal to them (the int8 layers ran)
    assert not np.array_equal(int8.predictions, full.predictions)
    np.testing.assert_allclose(int8.predictions, full.predictions, atol=0.05)
    assert int8.metrics["test_loss"] == pytest.approx(full.metrics["test_loss"], rel=0.02)
    assert (int8.predictions.argmax(-1) == full.predictions.argmax(-1)).mean() >= 0.9


def test_int8_copy_is_kept_while_the_weights_do_not_change(factory):
    model = factory.cls_model()
    first = eval_precision.quantized_copy(model)
    assert eval_precision.quantized_copy(model) is first
    assert (
        sum(type(m) is torch.ao.nn.quantized.dynamic.Linear for m in first.modules()) == 14
    )  # 2 layers x 6, pooler, classifier
    with torch.no_grad():
        model.classifier.bias.add_(1.0)  # as an optimizer step would
    assert eval_precision.quantized_copy(model) is not first


def test_int8_eval_quantizes_gpt2_conv1d_projections(tmp_path, int8_cpu):
    """GPT-2's projections are transformers' Conv1D, not nn.Linear: converted, then quantized."""
    import datasets

    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=16, use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = np.random.default_rng(0).integers(0, 64, size=(8, 16)).tolist()
    data = datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})
    losses = {}
    for name, int8 in (("fp32", False), ("int8", True)):
        args = hflight.TrainingArguments(str(tmp_path / name), report_to="none", int8_eval=int8)
        losses[name] = hflight.Trainer(model, args).evaluate(data)["eval_loss"]
    quantized = eval_precision.quantized_copy(model)
    assert sum(type(m) is torch.ao.nn.quantized.dynamic.Linear for m in quantized.modules()) == 5  # 4 Conv1D + head
    assert losses["int8"] != losses["fp32"] and losses["int8"] == pytest.approx(losses["fp32"], rel=0.02)


def test_int8_eval_on_a_cpu_without_int8_instructions_warns_and_evaluates_in_float32(tmp_path, factory, plain_cpu):
    full = _trainer(tmp_path / "fp32", factory).evaluate()
    with pytest.warns(UserWarning, match="int8_eval: this CPU has none of avx512_vnni, avx_vnni, amx_int8"):
        fallback = _trainer(tmp_path / "int8", factory, int8_eval=True).evaluate()
    assert fallback["eval_loss"] == full["eval_loss"]


def test_int8_eval_is_refused_for_a_training_run_that_evaluates(tmp_path, factory, int8_cpu):
    args = hflight.TrainingArguments(str(tmp_path), **factory.pair_args(int8_eval=True, eval_strategy="epoch"))
    trainer = hflight.Trainer(
        factory.cls_model(), args, train_dataset=factory.cls_dataset(8), eval_dataset=factory.cls_dataset(8)
    )
    with pytest.raises(ValueError, match=r"int8_eval quantizes a copy .* eval_strategy='no'"):
        trainer.train()
    assert trainer.state.global_step == 0


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (dict(strategy="ort"), "not ORTStrategy"),
        (dict(bf16_full_eval=True), "choose one reduced precision"),
    ],
    ids=["backend-strategy", "with-bf16_full_eval"],
)
def test_int8_eval_is_refused_where_it_cannot_apply(tmp_path, factory, int8_cpu, overrides, reason):
    if overrides.get("strategy") == "ort":
        pytest.importorskip("onnxruntime", reason="pip install 'hflight[ort]'")
    model = factory.cls_model()
    with pytest.raises(ValueError, match=rf"int8_eval cannot apply: .*{reason}"):
        _trainer(tmp_path, factory, model, int8_eval=True, **overrides).evaluate()


# ---- the evaluation path outside training (item 1) -----------------------------------------------------------------
class _CountValidationBatches(L.Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_validation_batch_end(self, *args, **kwargs) -> None:
        self.batches += 1


def test_evaluation_in_this_process_gives_validates_results_and_leaves_eval_mode(tmp_path, factory, monkeypatch):
    """Without Lightning callbacks the evaluation runs in this process (Lightning's validate is not called); with one,
    through validate (its hooks called): the same metrics and predictions, and every module in eval mode afterwards,
    as transformers' evaluation_loop leaves the model."""
    counter = _CountValidationBatches()
    through_validate = hflight.Trainer(
        factory.cls_model(dropout=0.1),
        hflight.TrainingArguments(str(tmp_path / "validate"), **factory.pair_args()),
        callbacks=[counter],
    ).predict(factory.cls_dataset(16))
    assert counter.batches == 2
    model = factory.cls_model(dropout=0.1)
    model.train()
    validate = L.Trainer.validate
    monkeypatch.setattr(L.Trainer, "validate", lambda *a, **k: pytest.fail("validate called"))
    trainer = hflight.Trainer(model, hflight.TrainingArguments(str(tmp_path / "direct"), **factory.pair_args()))
    direct = trainer.predict(factory.cls_dataset(16))
    monkeypatch.setattr(L.Trainer, "validate", validate)
    np.testing.assert_array_equal(direct.predictions, through_validate.predictions)
    assert direct.metrics["test_loss"] == through_validate.metrics["test_loss"]
    assert not any(m.training for m in model.modules())
    reference = transformers.Trainer(model.train(), transformers.TrainingArguments(str(tmp_path / "hf"),
                                                                                   **factory.pair_args()))  # fmt: skip
    reference.predict(factory.cls_dataset(16))
    assert not any(m.training for m in model.modules()), "transformers leaves the model in eval mode too"


def test_an_evaluation_run_is_reused_until_something_changes(tmp_path, factory):
    trainer = _trainer(tmp_path, factory)
    first = trainer.evaluate()
    lightning_trainer = trainer.lightning_trainer
    assert trainer.evaluate()["eval_loss"] == first["eval_loss"]
    assert trainer.lightning_trainer is lightning_trainer  # nothing changed: the same run
    trainer.args.per_device_eval_batch_size = 4
    trainer.evaluate()
    assert trainer.lightning_trainer is not lightning_trainer  # an argument changed: a new run
    lightning_trainer = trainer.lightning_trainer
    trainer.model = factory.cls_model(seed=1)
    trainer.evaluate()
    assert trainer.lightning_trainer is not lightning_trainer  # another model: a new run
