"""What a GPU run does as transformers does it, checked on the CPU (issue 56): fp16's gradient scaler as accelerate's
(gradients unscaled before they are measured, clipped or seen by a callback, for every optimizer, fused or not), the
model kept on ``args.device`` from construction on, and the CUDA RNG state in transformers' form.

fp16 on the CPU: accelerate builds no scaler there, so both libraries are given the same ``torch.amp.GradScaler("cpu")``
(transformers through its ``Accelerator``, hflight through Lightning's ``MixedPrecision("16-mixed", "cpu", scaler)``)
with torch's fused AdamW, which takes a scaler's gradients on the CPU as on CUDA. CUDA's generator functions are
mocked: the RNG file and what each library's resume sets are compared."""

from __future__ import annotations

import logging
import sys
from typing import Any

import pytest
import torch
import transformers
from lightning.pytorch.plugins.precision import MixedPrecision

import hflight

PAIR = (("hf", transformers.Trainer, transformers.TrainingArguments),
        ("hl", hflight.Trainer, hflight.TrainingArguments))  # fmt: skip


def _history(trainer):
    return [
        {k: v for k, v in e.items() if not k.endswith(("runtime", "per_second"))} for e in trainer.state.log_history
    ]


class GradientProbe(transformers.TrainerCallback):
    """The gradients' 2-norm ``on_pre_optimizer_step`` sees (after clipping)."""

    def __init__(self):
        self.norms = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        grads = [p.grad for p in self.trainer.model.parameters() if p.grad is not None]
        self.norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())


class MeasuringTrainer(hflight.Trainer):
    """Measures the gradients with ``accelerator.clip_grad_norm_`` after each backward (no clipping: an infinite
    bound). transformers' own loop would unscale the gradients a second time after it and raise."""

    measured: list[float]

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.measured.append(self.accelerator.clip_grad_norm_(model.parameters(), float("inf")).item())
        return loss


@pytest.fixture
def cpu_fp16_scaler(monkeypatch):
    """Every hflight run in the test gets Lightning's ``MixedPrecision`` with a CPU ``GradScaler`` (``scale``: its
    initial scale); returns a factory of the same scaler for transformers' ``Accelerator``."""
    import hflight.run.run as run_module

    scales = {}
    build = run_module.lightning_trainer_kwargs

    def kwargs(*args, **kw):
        out = build(*args, **kw)
        scaler = torch.amp.GradScaler("cpu", init_scale=scales["init"])
        return {
            **out,
            "precision": None,
            "plugins": [*out.get("plugins", []), MixedPrecision("16-mixed", "cpu", scaler)],
        }

    monkeypatch.setattr(run_module, "lightning_trainer_kwargs", kwargs)

    def scaler(init_scale):
        scales["init"] = init_scale
        return torch.amp.GradScaler("cpu", init_scale=init_scale)

    return scaler


def fp16_fused_run(tmp_path, factory, scaler, name, trainer_cls, args_cls):
    """3 steps in fp16 with torch's fused AdamW and ``max_grad_norm=1`` on ``scaler``: the trainer, its history and
    the norms ``on_pre_optimizer_step`` saw (``MeasuringTrainer``: also what it measured after each backward)."""
    settings = dict(fp16=True, use_cpu=True, max_steps=3, optim="adamw_torch_fused", max_grad_norm=1.0)
    args = args_cls(str(tmp_path / name), **factory.pair_args(**settings))
    probe = GradientProbe()
    trainer = trainer_cls(factory.cls_model(), args, train_dataset=factory.cls_dataset(12), callbacks=[probe])
    probe.trainer = trainer
    if name == "hf":  # accelerate's scaler and autocast, which it builds off the CPU only
        trainer.accelerator.scaler, trainer.accelerator.native_amp = scaler, True
    if isinstance(trainer, MeasuringTrainer):
        trainer.measured = []
    trainer.train()
    return trainer, _history(trainer), probe.norms


@pytest.mark.parametrize("init_scale", [2.0**16, 1e9], ids=["scaled", "overflowing"])
def test_fp16_fused_optimizer_clips_unscaled_gradients_as_transformers(tmp_path, factory, cpu_fp16_scaler, init_scale):
    """fp16, torch's fused AdamW, ``max_grad_norm=1``: every step's loss, grad norm and learning rate, the norm
    ``on_pre_optimizer_step`` sees and the final weights are transformers' number for number. Before, Lightning left
    the fused optimizer's gradients scaled: hflight logged and clipped the norm times 65536 (step 1: 38977 against
    0.5947) and the update shrank by the scale. ``trainer.accelerator.clip_grad_norm_`` in a ``training_step``
    measures the unscaled gradients too, and ``trainer.accelerator.scaler`` is the run's scaler. Overflowing steps
    (every step at a scale of 1e9) still step the scheduler, as transformers (accelerate never reports a fused
    optimizer's step skipped): before, the learning rate stayed at 1e-3."""
    seen = {}
    for name, trainer_cls, args_cls in (PAIR[0], ("hl", MeasuringTrainer, hflight.TrainingArguments)):
        trainer, history, norms = fp16_fused_run(tmp_path, factory, cpu_fp16_scaler(init_scale), name, trainer_cls,
                                                 args_cls)  # fmt: skip
        if name == "hl":  # accelerate's attribute: the run's scaler
            assert trainer.accelerator.scaler is trainer.lightning_trainer.precision_plugin.scaler is not None
            measured = trainer.measured
        seen[name] = history, norms, trainer.model.state_dict()
    (hf_history, hf_norms, hf_weights), (history, norms, weights) = seen["hf"], seen["hl"]
    assert [e["learning_rate"] for e in hf_history[:3]] == [1e-3, 1e-3 * 2 / 3, 1e-3 / 3]
    if init_scale == 2.0**16:
        assert 0.3 < hf_history[0]["grad_norm"] < 1
    assert str(history) == str(hf_history)  # nan == nan
    assert norms == pytest.approx(hf_norms, nan_ok=True) and len(norms) == 3
    assert measured == pytest.approx([e["grad_norm"] for e in history[:3]], nan_ok=True)
    assert all(torch.equal(value, hf_weights[key]) for key, value in weights.items())


def test_fp16_fused_optimizer_plain_trainer_unscales_as_transformers(tmp_path, factory, cpu_fp16_scaler):
    """The same run with a plain ``hflight.Trainer``, whose step touches no gradient: the unscale before the grad norm,
    clipping and ``on_pre_optimizer_step`` is the precision plugin's own, not a side effect of the
    ``accelerator.clip_grad_norm_`` that ``MeasuringTrainer`` calls after every backward (which alone kept the test
    above passing without it). Every step's loss, grad norm and learning rate, the norms the callback sees and the
    final weights are transformers'."""
    seen = {}
    for name, trainer_cls, args_cls in PAIR:
        trainer, history, norms = fp16_fused_run(tmp_path, factory, cpu_fp16_scaler(2.0**16), name, trainer_cls,
                                                 args_cls)  # fmt: skip
        seen[name] = history, norms, trainer.model.state_dict()
    (hf_history, hf_norms, hf_weights), (history, norms, weights) = seen["hf"], seen["hl"]
    assert 0.3 < hf_history[0]["grad_norm"] < 1 and len(hf_norms) == 3
    assert [(e["loss"], e["grad_norm"], e["learning_rate"]) for e in history if "loss" in e] == [
        (e["loss"], e["grad_norm"], e["learning_rate"]) for e in hf_history if "loss" in e
    ]
    assert str(history) == str(hf_history)
    assert norms == pytest.approx(hf_norms)
    assert all(torch.equal(value, hf_weights[key]) for key, value in weights.items())


# ---- the model where transformers keeps it ----------------------------------------------------------------------
@pytest.mark.parametrize("full_eval", [False, True], ids=["placed", "fp16_full_eval"])
def test_the_model_is_placed_on_args_device_at_construction_as_transformers(tmp_path, factory, monkeypatch, full_eval):
    """``Trainer(model, args)`` moves the model to ``args.device`` (mocked: a second GPU) as transformers'
    ``place_model_on_device`` does, and not where transformers postpones it (``fp16_full_eval``); before, hflight
    left it where it was until a run started (and moved it back to the CPU after)."""
    moves = {}
    for name, trainer_cls, args_cls in PAIR:
        args = args_cls(str(tmp_path / name), fp16_full_eval=full_eval, report_to="none")
        monkeypatch.setattr(type(args), "device", property(lambda self: torch.device("cuda", 1)))
        model = factory.cls_model()
        moves[name] = []
        model.to = lambda *a, moves=moves[name], model=model, **k: moves.append((a, k)) or model
        trainer_cls(model, args)
        monkeypatch.undo()
    assert moves["hl"] == moves["hf"] == ([] if full_eval else [((torch.device("cuda", 1),), {})])


class StopAtTrainBegin(transformers.TrainerCallback):
    """Ends ``train()`` before its first batch (``TrainingStopped``)."""

    def on_train_begin(self, args, state, control, **kwargs):
        raise TrainingStopped


class TrainingStopped(Exception):
    pass


def spied_model_init(factory, moves: list) -> Any:
    """A ``model_init`` whose every model records its ``.to`` calls (a list per model, appended to ``moves``) instead
    of moving."""

    def model_init():
        model, calls = factory.cls_model(), []
        moves.append(calls)
        model.to = lambda *args, **kwargs: calls.append((args, kwargs)) or model
        return model

    return model_init


def test_the_model_of_model_init_is_placed_on_args_device_in_train_as_transformers(tmp_path, factory, monkeypatch):
    """With ``model_init``, ``train()`` builds a fresh model and moves it to ``args.device``, as transformers'
    ``train()`` does after ``call_model_init`` (the constructor placed the first one); spied on until the training
    begins.
    ``args.device`` is mocked as ``cpu:1``, where nothing else moves a model and transformers can make its tensors
    before that (it makes them on ``args.device``; a mocked GPU fails there). Without the move in ``train()``, the
    model it trains stayed where ``model_init`` built it."""
    device = torch.device("cpu", 1)
    moves = {}
    for name, trainer_cls, args_cls in PAIR:
        args = args_cls(str(tmp_path / name), **factory.pair_args(use_cpu=True, max_steps=1))
        monkeypatch.setattr(type(args), "device", property(lambda self: device))
        moves[name] = []
        model_init = spied_model_init(factory, moves[name])
        trainer = trainer_cls(model_init=model_init, args=args, train_dataset=factory.cls_dataset(8),
                              callbacks=[StopAtTrainBegin()])  # fmt: skip
        with pytest.raises(TrainingStopped):
            trainer.train()
        monkeypatch.undo()
    to_device = [((device,), {})]
    # the constructor's model, then train()'s (accelerate's prepare then moves transformers' to its own device)
    assert [calls[:1] for calls in moves["hf"]] == [to_device, to_device]
    assert moves["hl"] == [to_device, to_device]


def test_no_move_to_the_cpu_after_train_evaluate_and_predict(tmp_path, factory, monkeypatch):
    """Lightning's strategy teardown (after ``fit``, ``validate``, ``predict``) moved the LightningModule and every
    optimizer's state to the CPU; transformers leaves both on the device. Spied on: no ``cpu()`` of a module and no
    optimizer state moved, through a training run, an evaluation and a prediction on Lightning's own loops (a
    Lightning callback makes them run there)."""
    import lightning as L
    import lightning.pytorch.strategies.strategy as strategy_module

    moved = []
    module_cpu, to_device = torch.nn.Module.cpu, strategy_module._optimizers_to_device

    def optimizers_to_device(optimizers, device):
        if sys._getframe(1).f_code.co_name == "teardown":  # (the strategy's setup moves them to its device)
            moved.extend(type(optimizer).__name__ for optimizer in optimizers)
        to_device(optimizers, device)

    monkeypatch.setattr(torch.nn.Module, "cpu", lambda self: moved.append(type(self).__name__) or module_cpu(self))
    monkeypatch.setattr(strategy_module, "_optimizers_to_device", optimizers_to_device)
    args = hflight.TrainingArguments(str(tmp_path), **factory.pair_args(use_cpu=True, max_steps=2))
    trainer = hflight.Trainer(factory.cls_model(), args, train_dataset=factory.cls_dataset(8), callbacks=[L.Callback()])
    trainer.train()
    trainer.evaluate(factory.cls_dataset(8))
    trainer.predict(factory.cls_dataset(8))
    assert moved == []


# ---- CUDA RNG states in transformers' form ----------------------------------------------------------------------
class FakeCuda:
    """torch.cuda's generator functions on a machine with two GPUs, without one: ``get_*`` give fixed states, the
    ``set_*`` calls are recorded."""

    STATE, OTHER = torch.arange(16, dtype=torch.uint8), torch.arange(16, 32, dtype=torch.uint8)

    def __init__(self, monkeypatch):
        self.set = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda.random, "get_rng_state", lambda device="cuda": self.STATE.clone())
        monkeypatch.setattr(torch.cuda.random, "get_rng_state_all", lambda: [self.STATE.clone(), self.OTHER.clone()])
        monkeypatch.setattr(torch.cuda.random, "set_rng_state", lambda state, device="cuda": self.set.append(state))
        monkeypatch.setattr(torch.cuda.random, "set_rng_state_all", lambda states: self.set.append(list(states)))


class _Point:
    """What ``hflight.checkpoints.parts.load_rng_state`` reads of the ``ResumePoint`` it resumes from."""

    def __init__(self, folder):
        self.folder, self.model_only = folder, False


def _checkpoint_rng_file(tmp_path, factory, monkeypatch):
    """The RNG file of an hflight checkpoint of a one-process run, written with CUDA's generators (mocked) about."""
    settings = factory.pair_args(use_cpu=True, max_steps=1, save_strategy="steps", save_steps=1)
    args = hflight.TrainingArguments(str(tmp_path / "hl"), **settings)
    trainer = hflight.Trainer(factory.cls_model(), args, train_dataset=factory.cls_dataset(4))
    with monkeypatch.context() as patch:
        FakeCuda(patch)
        trainer.train()
    return tmp_path / "hl" / "checkpoint-1" / "rng_state.pth"


def test_cuda_rng_state_is_transformers_form_and_each_library_resumes_the_others(tmp_path, factory, monkeypatch,
                                                                                 caplog):  # fmt: skip
    """One process's checkpoint holds the current device's CUDA state (a tensor), as transformers' ``_save_rng_state``
    writes it: transformers' ``_load_rng_state`` on hflight's checkpoint sets it with ``set_rng_state`` (before,
    hflight wrote every device's list, which transformers' ``set_rng_state`` refused with a logged error, leaving
    CUDA's generator unrestored); hflight's resume sets transformers' file's state; an older hflight file (a list)
    is set with ``set_rng_state_all``."""
    from hflight.checkpoints.parts import load_rng_state
    from hflight.run.distributed import World

    rng_file = _checkpoint_rng_file(tmp_path, factory, monkeypatch)
    states = torch.load(rng_file, weights_only=False)
    assert torch.equal(states["cuda"], FakeCuda.STATE)

    hf_args = transformers.TrainingArguments(str(tmp_path / "hf"), use_cpu=True, report_to="none")
    hf_trainer = transformers.Trainer(factory.cls_model(), hf_args)
    cuda = FakeCuda(monkeypatch)
    with caplog.at_level(logging.ERROR, logger="transformers"):
        hf_trainer._load_rng_state(str(rng_file.parent))
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(cuda.set) == 1 and torch.equal(cuda.set[0], FakeCuda.STATE)

    (tmp_path / "hf").mkdir(exist_ok=True)
    hf_trainer._save_rng_state(str(tmp_path / "hf"))
    world = World(args=hflight.TrainingArguments(str(tmp_path), use_cpu=True))
    cuda.set.clear()
    load_rng_state(_Point(str(tmp_path / "hf")), world)
    assert len(cuda.set) == 1 and torch.equal(cuda.set[0], FakeCuda.STATE)

    torch.save({**states, "cuda": [FakeCuda.OTHER, FakeCuda.STATE]}, rng_file)  # an older hflight one-process file
    cuda.set.clear()
    load_rng_state(_Point(str(rng_file.parent)), world)
    assert len(cuda.set) == 1 and [state.tolist() for state in cuda.set[0]] == [[*range(16, 32)], [*range(16)]]


# ---- the same on a GPU (skipped without CUDA) --------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_fp16_default_optimizer_placement_rng_and_memory_are_transformers(tmp_path, factory, caplog):
    """On a GPU, fp16 with the default optimizer (``adamw_torch_fused``) and ``max_grad_norm=1``: every step's loss,
    grad norm and learning rate are transformers' (to float32 rounding); the model sits on ``args.device`` from the
    constructor on and, with the optimizer's state, after ``train()``, ``evaluate()`` and ``predict()``; the
    checkpoint's CUDA RNG state is one tensor, which transformers' resume sets without an error; the memory metrics
    have transformers' names, and training leaves the optimizer's state allocated (a positive delta) as in
    transformers."""
    results = {}
    for name, trainer_cls, args_cls in PAIR:
        settings = factory.pair_args(fp16=True, max_steps=5, max_grad_norm=1.0, save_strategy="steps", save_steps=5,
                                     skip_memory_metrics=False)  # fmt: skip
        args = args_cls(str(tmp_path / name), **settings)
        trainer = trainer_cls(factory.cls_model(), args, train_dataset=factory.cls_dataset(20))
        placed = next(trainer.model.parameters()).device
        output = trainer.train()
        devices = {p.device for p in trainer.model.parameters()}
        states = {
            t.device for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()
        }
        trainer.evaluate(factory.cls_dataset(8))
        trainer.predict(factory.cls_dataset(8))
        after = {p.device for p in trainer.model.parameters()}
        results[name] = _history(trainer), placed, devices, states, after, output.metrics, trainer.args.device
        print(name, results[name][0][:5], {k: v for k, v in output.metrics.items() if "mem" in k})
    (hf_history, *hf_rest), (history, placed, devices, states, after, metrics, device) = results["hf"], results["hl"]
    assert placed == device and devices == states == after == {device}
    assert hf_rest[0] == placed and hf_rest[1] == devices and hf_rest[3] == after
    for ours, theirs in zip(history, hf_history, strict=True):
        ours, theirs = ({k: v for k, v in e.items() if "_mem_" not in k} for e in (ours, theirs))
        assert ours.keys() == theirs.keys()
        assert all(ours[k] == pytest.approx(v, rel=1e-4) for k, v in theirs.items()), (ours, theirs)
    hf_metrics = hf_rest[4]
    assert {k for k in metrics if "mem" in k} == {k for k in hf_metrics if "mem" in k}
    assert metrics["train_mem_gpu_alloc_delta"] > 0 and hf_metrics["train_mem_gpu_alloc_delta"] > 0
    states = torch.load(tmp_path / "hl" / "checkpoint-5" / "rng_state.pth", weights_only=False)
    assert torch.is_tensor(states["cuda"])
    hf_trainer = transformers.Trainer(
        factory.cls_model(), transformers.TrainingArguments(str(tmp_path / "x"), report_to="none")
    )
    with caplog.at_level(logging.ERROR, logger="transformers"):
        hf_trainer._load_rng_state(str(tmp_path / "hl" / "checkpoint-5"))
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert torch.equal(torch.cuda.get_rng_state().cpu(), states["cuda"])
