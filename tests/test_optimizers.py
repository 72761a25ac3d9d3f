"""The optimizer and scheduler menu (issue 40, item 4): every transformers ``optim`` name and ``lr_scheduler_type`` run
with transformers' Trainer and with hflight's on the same tiny model and data, compared number for number (losses,
grad norms, learning rates, final weights: equal, every optimizer here is deterministic on the CPU); the names that
cannot run on this CPU raise transformers' own error; LOMO's fused backward, GaLore's layer-wise optimizers with
``optim_target_modules`` (saved and resumed), schedule-free optimizers' eval/train switching; Liger as transformers
applies it; a missing optional package named with hflight's extra (docs/optimizers.md holds the table)."""

from __future__ import annotations

import functools
import re
import sys
import types
from pathlib import Path

import pytest
import torch
import transformers
import transformers.trainer_optimizer as hf_optimizers
from transformers.trainer_utils import SchedulerType
from transformers.training_args import OptimizerNames

import hflight
from hflight.arguments.optimizers import OPTIONAL_PACKAGES

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LIBRARIES = {
    "transformers": (transformers.Trainer, transformers.TrainingArguments),
    "hflight": (hflight.Trainer, hflight.TrainingArguments),
}
#: the Linear modules GaLore/APOLLO project (BERT's attention and feed-forward layers)
TARGETS = ["attention", "intermediate"]
#: names whose optimizer cannot run on this CPU: the exception transformers raises there and the part of its message
#: that names the cause (hflight raises the same)
RAISING = {
    "adamw_torch_xla": (ValueError, "failed to import syncfree AdamW from torch_xla"),  # TPUs
    "adamw_torch_npu_fused": (ValueError, "failed to import FusedAdamW from torch_npu"),  # Ascend NPUs
    "adamw_anyprecision": (ValueError, "Please install https://github.com/pytorch/torchdistx"),  # not on PyPI
    # GaLore's 8-bit step synchronises CUDA
    "galore_adamw_8bit": (AssertionError, "Torch not compiled with CUDA enabled"),
    "galore_adamw_8bit_layerwise": (AssertionError, "Torch not compiled with CUDA enabled"),
    "adalomo": (AssertionError, "Torch not compiled with CUDA enabled"),  # AdaLomo allocates its state with .cuda()
    # transformers' own failure, on any machine: its layer-wise GaLoreAdafactor keeps relative_step=True
    "galore_adafactor_layerwise": (ValueError, "Cannot combine manual `lr` and `relative_step=True` options"),
}
RUNNING = [name.value for name in OptimizerNames if name.value not in RAISING]
#: scheduler kwargs that make each schedule move within a few steps
SCHEDULER_KWARGS = {
    "cosine_with_min_lr": {"min_lr": 1e-4},
    "cosine_warmup_with_min_lr": {"min_lr": 1e-4},
    "warmup_stable_decay": {"num_decay_steps": 2},
    "reduce_lr_on_plateau": {"patience": 0, "factor": 0.5},
    "greedy": {"patience": 0, "min_lr": 1e-5, "factor": 0.5},
}


def _trainer(library, factory, out: Path, *, steps=2, eval_dataset=None, callbacks=None, model=None, **overrides):
    """``model``: what builds the model (default ``factory.cls_model``)."""
    trainer_cls, args_cls = LIBRARIES[library]
    name = overrides.get("optim", "")
    if ("galore" in name or "apollo" in name) and "optim_target_modules" not in overrides:
        overrides["optim_target_modules"] = TARGETS
    args = args_cls(output_dir=str(out / library), max_steps=steps, **factory.pair_args(**overrides))
    return trainer_cls(model=(model or factory.cls_model)(), args=args, train_dataset=factory.cls_dataset(16),
                       eval_dataset=eval_dataset, callbacks=callbacks)  # fmt: skip


def _trained(library, factory, out: Path, resume=None, **kwargs):
    trainer = _trainer(library, factory, out, **kwargs)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _numbers(trainer):
    """(step, loss, grad_norm, learning_rate) of every logged step, eval losses, and the final weights."""
    history = trainer.state.log_history
    steps = [(e["step"], e["loss"], e["grad_norm"], e["learning_rate"]) for e in history if "loss" in e]
    evals = [(e["step"], e["eval_loss"]) for e in history if "eval_loss" in e]
    return steps, evals, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _assert_same(reference, ours):
    assert ours[0] == reference[0]  # losses, grad norms, learning rates, bit for bit
    assert ours[1] == reference[1]
    assert ours[2].keys() == reference[2].keys()
    for key, value in reference[2].items():
        assert torch.equal(ours[2][key], value), key


def _both(factory, tmp_path, **kwargs):
    return [_numbers(_trained(library, factory, tmp_path, **kwargs)) for library in LIBRARIES]


# ---- every optim name -------------------------------------------------------------------------------------------
def test_every_optim_name_is_run_or_raises_here():
    assert set(RUNNING) | set(RAISING) == {name.value for name in OptimizerNames}
    for name in OptimizerNames:
        assert hflight.TrainingArguments(optim=name.value).optim is name


#: the packages not in `dev`, which CI installs apart: once installed, transformers imports torchao with every model
#: (`transformers.quantizers`, 1.6-2 s of CPU more for each process of the suite that builds one, most of them) and
#: bitsandbytes with its Trainer (`transformers.trainer_utils` imports peft, which imports it: ~2.5 s more for every
#: process); galore-torch and apollo-torch require bitsandbytes. `.ci/run` installs the four with `pip install
#: --target` and runs the tests marked `apart` with them on PYTHONPATH; without them these tests skip, naming the
#: package (the missing package's error is test_missing_package_names_its_extra)
APART = {package.extra: package for package in OPTIONAL_PACKAGES
         if package.extra in ("torchao", "bitsandbytes", "galore", "apollo")}  # fmt: skip
TORCHAO = APART["torchao"]
#: the releases checked with torch 2.13.0 and transformers 5.23 (torchao declares no torch requirement)
APART_PINS = ("torchao>=0.18,<0.19", "bitsandbytes>=0.50,<0.51", "galore-torch>=1.0,<1.1", "apollo-torch>=1.0,<1.1")


def _apart(optim: str):
    return next((package for package in APART.values() if optim in package.names), None)


def _marked(names) -> list:
    """``names`` as parameters, those that need a package installed apart marked ``apart``."""
    return [pytest.param(name, marks=pytest.mark.apart) if _apart(name) else name for name in names]


def _require(optim: str) -> None:
    package = _apart(optim)
    if package is not None and not _available(package):
        install = f"pip install 'hflight[{package.extra}]'"
        pytest.skip(f"optim={optim!r} needs {package.pip}, which is not installed: {install}")


#: RAdam takes no step until its variance estimate is rectified (rho_t > 4: the fifth step with beta2 0.999)
STEPS = {"schedule_free_radam": 5}


def _torchao_model(factory):
    """torchao keeps a parameter's state in 4 or 8 bits only from 4096 elements (in blocks of 128 or 256), in float32
    below: the tiny BERT (3200 elements at most) with its feed-forward layers widened to 32 x 128, four such weights."""
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(factory.config(num_labels=3, intermediate_size=128))


@pytest.mark.parametrize("optim", _marked(RUNNING))
def test_optim_matches_transformers(tmp_path, factory, monkeypatch, optim):
    model = factory.cls_model
    _require(optim)
    if optim in TORCHAO.names:
        # torchao compiles its step for every parameter shape (CI time: 15-60 s here); eager in both libraries
        monkeypatch.setattr(torch, "compile", lambda function, **options: function)
        model = functools.partial(_torchao_model, factory)
    trainers = [_trained(library, factory, tmp_path, model=model, optim=optim, weight_decay=0.01,
                         steps=STEPS.get(optim, 2)) for library in LIBRARIES]  # fmt: skip
    reference, ours = (_numbers(trainer) for trainer in trainers)
    _assert_same(reference, ours)
    initial = model().state_dict()
    assert any(not torch.equal(initial[key], value) for key, value in ours[2].items())  # it trained
    if optim in TORCHAO.names:  # the four wide weights' exp_avg and exp_avg_sq in 4 or 8 bits, not in float32
        states = [type(value).__name__ for state in trainers[1].optimizer.state.values() for value in state.values()]
        assert states.count(f"OptimState{optim.removeprefix('adamw_torch_')}") == 8, states


@pytest.mark.parametrize("optim", _marked(sorted(RAISING)))
def test_optim_that_cannot_run_here_raises_transformers_error(tmp_path, factory, optim):
    _require(optim)
    kind, cause = RAISING[optim]
    errors = []
    for library in LIBRARIES:
        with pytest.raises(kind, match=re.escape(cause)) as info:
            _trained(library, factory, tmp_path, optim=optim)
        errors.append((type(info.value), str(info.value)))
    assert errors[1] == errors[0]


def test_optim_args_as_transformers_reads_them(tmp_path, factory):
    reference, ours = _both(factory, tmp_path, optim="sgd", optim_args="momentum=0.9, nesterov=true")
    _assert_same(reference, ours)
    args = hflight.TrainingArguments(str(tmp_path), optim="sgd", optim_args="momentum")
    with pytest.raises(ValueError, match="optim_args must be 'key=value' pairs.*'momentum'"):
        hflight.Trainer.get_optimizer_cls_and_kwargs(args)


# ---- what some optimizers need of the loop ----------------------------------------------------------------------
def test_lomo_fused_backward_gets_transformers_learning_rates(tmp_path, factory, monkeypatch):
    from lomo_optim import Lomo

    calls = {library: [] for library in LIBRARIES}
    library = "transformers"
    original = Lomo.fused_backward

    def recording(self, loss, lr):
        calls[library].append((loss.item(), lr))
        return original(self, loss, lr)

    monkeypatch.setattr(Lomo, "fused_backward", recording)
    numbers = {}
    for library in LIBRARIES:
        numbers[library] = _numbers(_trained(library, factory, tmp_path, optim="lomo", lr_scheduler_type="linear"))
    _assert_same(*numbers.values())
    assert len(calls["hflight"]) == 2 and calls["hflight"] == calls["transformers"]
    assert [lr for _, lr in calls["hflight"]] == [1e-3, 5e-4]  # the schedule's rate at each step, as logged


@pytest.mark.parametrize("optim", _marked(["galore_adamw_layerwise", "lomo"]))
def test_optimizer_updating_in_backward_saves_and_resumes_as_transformers(tmp_path, factory, optim):
    """Saved as transformers saves it, resumed as transformers resumes (and from transformers' checkpoint): the
    optimizer checked before resuming leaves no gradient hooks behind."""
    _require(optim)
    run = dict(optim=optim, steps=4, save_strategy="steps", save_steps=2)
    if optim == "galore_adamw_layerwise":
        run["optim_args"] = "rank=4,update_proj_gap=2"
    full = {library: _numbers(_trained(library, factory, tmp_path, **run)) for library in LIBRARIES}
    _assert_same(*full.values())
    checkpoint = {library: tmp_path / library / "checkpoint-2" for library in LIBRARIES}
    for name in ("optimizer.pt", "scheduler.pt"):
        saved = [torch.load(checkpoint[library] / name, weights_only=True) for library in LIBRARIES]
        assert saved[1].keys() == saved[0].keys() and repr(saved[1]) == repr(saved[0]), name
    resumed = {library: _numbers(_trained(library, factory, tmp_path, resume=checkpoint[library], **run))
               for library in LIBRARIES}  # fmt: skip
    _assert_same(*resumed.values())
    if optim == "galore_adamw_layerwise":  # transformers saves the dummy's state: the per-parameter states restart
        assert resumed["transformers"][0][3] != full["transformers"][0][3]
    else:
        _assert_same(full["transformers"], resumed["transformers"])
    crossed = _numbers(_trained("hflight", factory, tmp_path / "crossed", resume=checkpoint["transformers"], **run))
    _assert_same(resumed["transformers"], crossed)


@pytest.mark.apart
def test_galore_needs_optim_target_modules_as_transformers(tmp_path, factory):
    _require("galore_adamw")
    errors = []
    for library in LIBRARIES:
        with pytest.raises(ValueError) as info:
            _trained(library, factory, tmp_path, optim="galore_adamw", optim_target_modules=None)
        errors.append(str(info.value))
    assert errors[1] == errors[0] and errors[0].startswith("You need to define `optim_target_modules`")


class _ModeRecorder(transformers.TrainerCallback):
    """The schedule-free optimizer's mode (True: training) after each step and at each evaluation's end."""

    def __init__(self):
        self.modes, self.trainer = [], None

    def _record(self, event, state):
        self.modes.append((event, state.global_step, self.trainer.optimizer.param_groups[0]["train_mode"]))

    def on_step_end(self, args, state, control, **kwargs):
        self._record("step", state)

    def on_evaluate(self, args, state, control, **kwargs):
        self._record("evaluate", state)


def test_schedule_free_evaluates_in_eval_mode_and_trains_in_train_mode(tmp_path, factory):
    evaluation = factory.cls_dataset(8, seed=1)
    results = {}
    for library in LIBRARIES:
        recorder = _ModeRecorder()
        trainer = _trainer(library, factory, tmp_path, optim="schedule_free_adamw", steps=3, eval_strategy="steps",
                           eval_steps=2, eval_dataset=evaluation, callbacks=[recorder])  # fmt: skip
        recorder.trainer = trainer
        trainer.train()
        results[library] = (recorder.modes, _numbers(trainer), trainer.evaluate()["eval_loss"])
    reference, ours = results["transformers"], results["hflight"]
    # evaluations at step 2, at the end of training (step 3) and the one after it
    assert ours[0] == reference[0] == [("step", 1, True), ("step", 2, True), ("evaluate", 2, False), ("step", 3, True),
                                       ("evaluate", 3, False), ("evaluate", 3, False)]  # fmt: skip
    _assert_same(reference[1], ours[1])  # eval losses of the averaged weights, final weights in eval mode
    assert ours[2] == reference[2]


# ---- schedulers -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheduler", [s.value for s in SchedulerType])
def test_scheduler_matches_transformers(tmp_path, factory, scheduler):
    reference, ours = _both(factory, tmp_path, steps=4, lr_scheduler_type=scheduler, warmup_steps=1,
                            lr_scheduler_kwargs=SCHEDULER_KWARGS.get(scheduler, {}), eval_strategy="steps",
                            eval_steps=1, eval_dataset=factory.cls_dataset(4, seed=1))  # fmt: skip
    _assert_same(reference, ours)
    assert len({lr for _, _, _, lr in ours[0]}) > 1 or scheduler == "constant"  # the schedule moved


# ---- Liger ------------------------------------------------------------------------------------------------------
def test_liger_without_liger_kernel_raises_transformers_error(tmp_path, factory):
    errors = []
    for library in LIBRARIES:
        trainer = _trainer(library, factory, tmp_path, use_liger_kernel=True)
        with pytest.raises(ImportError) as info:
            trainer.train()
        errors.append(str(info.value))
    assert errors[1] == errors[0] and "liger-kernel" in errors[0]


def test_liger_applied_as_transformers_applies_it(tmp_path, factory, monkeypatch):
    """A test stand-in for liger_kernel (it needs Triton on a GPU): the patch transformers' apply_liger_kernel calls,
    with liger_kernel_config, before training; Liger's loss-only evaluation asked for with skip_logits."""
    calls = []

    def apply_stand_in(model, **config):
        calls.append((type(model).__name__, config))
        forward = model.forward

        @functools.wraps(forward)  # the model's signature, as Liger's patched forward keeps it
        def forward_with_skip_logits(*args, skip_logits=None, **kwargs):
            calls.append(("forward", skip_logits))
            return forward(*args, **kwargs)

        model.forward = forward_with_skip_logits

    stand_in = types.ModuleType("liger_kernel.transformers")
    stand_in._apply_liger_kernel_to_instance = apply_stand_in
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", stand_in)
    monkeypatch.setattr(transformers.integrations.liger, "is_liger_kernel_available", lambda: True)
    seen = {}
    for library in LIBRARIES:
        calls.clear()
        trainer = _trainer(library, factory, tmp_path, use_liger_kernel=True, liger_kernel_config={"rms_norm": False},
                           eval_dataset=factory.cls_dataset(4, seed=1), prediction_loss_only=True)  # fmt: skip
        trainer.train()
        trainer.evaluate()
        seen[library] = (list(calls), _numbers(trainer))
    assert seen["hflight"][0] == seen["transformers"][0]
    assert seen["hflight"][0][0] == ("BertForSequenceClassification", {"rms_norm": False})
    assert ("forward", True) in seen["hflight"][0]  # evaluation asked Liger's loss without logits
    _assert_same(seen["transformers"][1], seen["hflight"][1])


# ---- optional packages ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("package", OPTIONAL_PACKAGES, ids=lambda p: p.extra)
def test_missing_package_names_its_extra(tmp_path, factory, monkeypatch, package):
    monkeypatch.setattr(hf_optimizers, package.check, lambda *args: False)
    _assert_missing_package_error(tmp_path, factory, package, package.names[0])


def _available(package) -> bool:
    return getattr(hf_optimizers, package.check)()


def _assert_missing_package_error(tmp_path, factory, package, optim):
    """Both libraries raise the same exception type; hflight's message names the extra, then transformers'."""
    errors = []
    for trainer_cls, args_cls in LIBRARIES.values():
        args = args_cls(str(tmp_path), optim=optim, optim_target_modules=TARGETS, report_to="none")
        with pytest.raises((ImportError, ValueError)) as info:
            trainer_cls.get_optimizer_cls_and_kwargs(args, factory.cls_model())
        errors.append(info.value)
    assert type(errors[1]) is type(errors[0])
    assert f"pip install 'hflight[{package.extra}]'" in str(errors[1]) and str(errors[0]) in str(errors[1])


def test_every_optional_package_is_an_extra():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    names = {package.extra: package.pip for package in OPTIONAL_PACKAGES}
    for extra, pip in names.items():
        assert any(requirement.startswith(pip) for requirement in extras[extra]), extra
        assert any(requirement.startswith(pip) for requirement in extras["optimizers"]), pip
        in_dev = any(requirement.startswith(pip) for requirement in extras["dev"])
        assert in_dev is (extra not in APART), pip  # all in dev but those CI installs apart (APART)
    ci = (Path(__file__).parents[1] / ".ci" / "run").read_text()
    pins = " ".join(f"'{pin}'" for pin in APART_PINS)
    assert f"pip install --target .apart-ci --no-deps {pins}" in ci and "-m apart" in ci
    assert any(requirement.startswith("liger-kernel") for requirement in extras["liger"])
