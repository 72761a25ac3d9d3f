"""hflight on the IPU strategy, run against the poptorch test double (tests/ipu/poptorch_double.py).

Never run on IPU hardware: these check hflight's use of poptorch's API (combined batches, on-device accumulation,
setOptimizer, attach/detach, weight copies, padding) against a CPU simulation of its documented behaviour.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from transformers.trainer_callback import TrainerCallback

from hflight import Trainer, TrainingArguments
from hflight.ipu import IPUAccelerator, IPUConfig, IPUStrategy

COMMON = dict(
    per_device_train_batch_size=4,
    per_device_eval_batch_size=4,
    num_train_epochs=2,
    learning_rate=1e-3,
    warmup_steps=0.1,
    weight_decay=0.01,
    max_grad_norm=1.0,
    optim="adamw_torch",  # the double's AdamW is torch's; the fused kernel rounds differently
    train_sampling_strategy="random",
    logging_steps=1,
    report_to="none",
    save_strategy="no",
    disable_tqdm=True,
    seed=0,
)
N_TRAIN, N_EVAL = 48, 18


class Events(TrainerCallback):
    """Records the name of every HF event."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def __getattribute__(self, name):
        if name.startswith("on_") and name != "on_init_end":
            names = object.__getattribute__(self, "names")
            return lambda *args, **kwargs: names.append(name)
        return object.__getattribute__(self, name)


def ipu(**config) -> IPUStrategy:
    return IPUStrategy(IPUConfig(**config), accelerator=IPUAccelerator())


def run(factory, tmp_path, name, strategy="auto", callbacks=(), train=None, evaluation=None, **overrides):
    model = factory.qa_model(seed=0)
    accelerator = "cpu" if strategy == "auto" else "auto"
    args = TrainingArguments(
        str(tmp_path / name), **{**COMMON, **overrides}, strategy=strategy, accelerator=accelerator
    )
    trainer = Trainer(
        model,
        args,
        train_dataset=train if train is not None else factory.qa_dataset(N_TRAIN),
        eval_dataset=evaluation if evaluation is not None else factory.qa_dataset(N_EVAL, seed=1),
        callbacks=list(callbacks),
    )
    trainer.train()
    return trainer, model


def step_logs(trainer):
    return [entry for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize(
    "args_accumulation, config",
    [
        (4, {"output_mode": "all"}),  # the facade's accumulation moves onto the device
        (1, {"replication_factor": 2, "gradient_accumulation_steps": 2, "output_mode": "all"}),
    ],
    ids=["device-GA4", "replicas2-x-GA2"],
)
def test_device_accumulation_equals_host_accumulation(factory, tmp_path, executors, args_accumulation, config):
    cpu, cpu_model = run(factory, tmp_path, "cpu", gradient_accumulation_steps=4)
    strategy = ipu(**config)
    dev, dev_model = run(factory, tmp_path, "ipu", strategy=strategy, gradient_accumulation_steps=args_accumulation)

    cpu_logs, dev_logs = step_logs(cpu), step_logs(dev)
    assert dev.state.global_step == cpu.state.global_step == 6  # 48 samples / (4 x 4) per step, 2 epochs
    assert [e["step"] for e in dev_logs] == [e["step"] for e in cpu_logs]
    for a, b in zip(cpu_logs, dev_logs):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)
        assert b["learning_rate"] == pytest.approx(a["learning_rate"], rel=1e-6, abs=1e-12)
        assert b["epoch"] == pytest.approx(a["epoch"])
        assert "grad_norm" not in b  # gradients never reach the host on an IPU
    for (name, a), b in zip(cpu_model.named_parameters(), dev_model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5, msg=name)

    training = [e for e in executors if e.calls and e.calls[0].training]
    assert len(training) == 1, "one training executable for the whole fit"
    calls = training[0].calls
    assert len(calls) == 6 and {c.micro_batches for c in calls} == {4} and {c.optimizer_steps for c in calls} == {1}
    assert {c.input_shapes["input_ids"][0] for c in calls} == {16}  # combined batch: 4 x replicas x GA
    assert strategy.ipu_config.gradient_accumulation_steps == config.get("gradient_accumulation_steps", 4)


def test_set_optimizer_after_every_step_brings_the_schedule_to_the_device(factory, tmp_path, executors):
    trainer, _ = run(factory, tmp_path, "ipu", strategy=ipu(), gradient_accumulation_steps=4)
    logged = [e["learning_rate"] for e in step_logs(trainer)]
    (training,) = [e for e in executors if e.calls and e.calls[0].training]
    device = [call.lrs[0][0] for call in training.calls]  # the lr the device stepped with, first group
    assert device == pytest.approx(logged, abs=1e-12)
    assert logged[0] == 0.0 and max(logged) == pytest.approx(1e-3)  # warmup then decay: the lr really moves
    # one setOptimizer per step, carrying the scheduler's next learning rate (HF: step, scheduler, setOptimizer)
    pushed = [lrs[0] for lrs in training.set_optimizer_calls]
    assert len(pushed) == len(logged)
    assert pushed[:-1] == pytest.approx(logged[1:], abs=1e-12)
    assert pushed[-1] == pytest.approx(trainer.lr_scheduler.get_last_lr()[0])


def test_evaluation_detaches_training_and_reattaches(factory, tmp_path, executors, poptorch_double):
    seen = []

    class Watch(TrainerCallback):
        def on_evaluate(self, args, state, control, **kwargs):
            training = [e for e in executors if e.calls and e.calls[0].training]
            seen.append((training[0].isAttachedToDevice(), poptorch_double.system.holders()))

        def on_step_end(self, args, state, control, **kwargs):
            training = [e for e in executors if e.calls and e.calls[0].training]
            seen.append((training[0].isAttachedToDevice(), None))

    # 16 IPUs in the simulated system; a training and an inference executable of 8 each would fit side by side, so
    # make them 16 each: attaching the inference one must fail unless training was detached first
    strategy = ipu(replication_factor=16, inference_replication_factor=16)
    trainer, _ = run(
        factory, tmp_path, "ipu", strategy=strategy, per_device_train_batch_size=1, per_device_eval_batch_size=1,
        train=factory.qa_dataset(32), evaluation=factory.qa_dataset(16, seed=1),
        eval_strategy="steps", eval_steps=1, callbacks=[Watch()],
    )  # fmt: skip
    evaluations = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    assert len(evaluations) == 4  # 2 steps per epoch x 2 epochs, one evaluation after each step
    assert all(attached for attached, _ in seen), "training is re-attached after every evaluation"
    inference = [e for e in executors if e.calls and not e.calls[0].training]
    assert len(inference) == 1 and len(inference[0].calls) == 4  # one inference executable, reused
    assert not inference[0].isCompiled()  # destroyed at teardown
    assert poptorch_double.system.held_ipus() == 0  # every IPU released after fit


def test_pad_on_batch_axis_returns_every_prediction(factory, tmp_path, executors):
    evaluation = factory.qa_dataset(N_EVAL, seed=1)  # 18 windows: not a multiple of the combined batch 4 x 2
    cpu, _ = run(factory, tmp_path, "cpu", gradient_accumulation_steps=4, evaluation=evaluation)
    expected = cpu.predict(evaluation)
    dev, _ = run(
        factory, tmp_path, "ipu", strategy=ipu(inference_replication_factor=2), gradient_accumulation_steps=4,
        evaluation=evaluation,
    )  # fmt: skip
    predicted = dev.predict(evaluation)
    assert predicted.predictions[0].shape == expected.predictions[0].shape == (N_EVAL, 24)
    for a, b in zip(expected.predictions, predicted.predictions):
        np.testing.assert_allclose(b, a, atol=1e-5)
    inference = [e for e in executors if e.calls and not e.calls[0].training]
    assert {c.input_shapes["input_ids"][0] for c in inference[-1].calls} == {8}  # every call a full batch
    assert dev.evaluate(evaluation)["eval_loss"] == pytest.approx(cpu.evaluate(evaluation)["eval_loss"], abs=0.05)


def test_without_padding_an_incomplete_last_batch_runs_on_an_executable_of_its_own(factory, tmp_path, executors):
    """poptorch refuses a batch shape an executable was not compiled for: the last batch of 18 rows in combined
    batches of 8 (2 rows) is run by a second inference executable compiled for its rows, and the evaluation ends on
    the CPU's loss."""
    evaluation = factory.qa_dataset(18, seed=1)
    cpu, _ = run(factory, tmp_path, "cpu", gradient_accumulation_steps=4, evaluation=evaluation)
    config = IPUConfig(inference_replication_factor=2)
    strategy = IPUStrategy(config, pad_on_batch_axis=False, accelerator=IPUAccelerator())
    dev, _ = run(factory, tmp_path, "ipu", strategy=strategy, gradient_accumulation_steps=4, evaluation=evaluation)
    assert dev.evaluate(evaluation)["eval_loss"] == pytest.approx(cpu.evaluate(evaluation)["eval_loss"], abs=0.05)
    inference = [e for e in executors if e.calls and not e.calls[0].training]
    assert [[c.input_shapes["input_ids"][0] for c in e.calls] for e in inference[-2:]] == [[8, 8], [2]]


def test_checkpoints_and_saved_model_hold_the_device_weights(factory, tmp_path, executors, poptorch_double):
    from transformers import BertForQuestionAnswering

    trainer, model = run(
        factory, tmp_path, "ipu", strategy=ipu(), gradient_accumulation_steps=4, save_strategy="steps", save_steps=3,
    )  # fmt: skip
    folder = tmp_path / "ipu" / "checkpoint-3"
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [
            "config.json", "model.safetensors", "training_args.bin", "trainer_state.json", "optimizer.pt",
            "scheduler.pt", "rng_state.pth", "ipu_config.json", "checkpoint_manifest.json",
        ]
    )  # fmt: skip
    # the host model was trained on the device: its weights moved away from the initial ones at step 3
    initial = factory.qa_model(seed=0)
    at_three = BertForQuestionAnswering.from_pretrained(folder)
    assert not torch.equal(at_three.qa_outputs.weight, initial.qa_outputs.weight)
    trainer.save_model(str(tmp_path / "final"))
    final = BertForQuestionAnswering.from_pretrained(tmp_path / "final")
    torch.testing.assert_close(final.qa_outputs.weight, model.qa_outputs.weight)
    assert not torch.equal(final.qa_outputs.weight, at_three.qa_outputs.weight)
    assert json.loads((tmp_path / "final" / "ipu_config.json").read_text())["output_mode"] == "final"
    args = torch.load(folder / "training_args.bin", weights_only=False)
    # a plain transformers.TrainingArguments: the live strategy (model, executables) is not pickled
    assert type(args).__module__ == "transformers.training_args" and not hasattr(args, "strategy")
    manifest = json.loads((folder / "checkpoint_manifest.json").read_text())
    assert "ipu_config.json" in str(manifest["files"])  # part of what makes the folder complete


def test_hf_events_and_metric_keys_are_the_cpu_ones(factory, tmp_path, poptorch_double):
    cpu_events, ipu_events = Events(), Events()
    cpu, _ = run(factory, tmp_path, "cpu", gradient_accumulation_steps=1, callbacks=[cpu_events], eval_strategy="epoch")
    dev, _ = run(factory, tmp_path, "ipu", strategy=ipu(), callbacks=[ipu_events], eval_strategy="epoch")
    assert ipu_events.names == cpu_events.names  # host accumulation 1 on both: the same sequence, event for event
    for a, b in zip(cpu.state.log_history, dev.state.log_history):
        assert set(b) == set(a) - {"grad_norm"}


def test_one_optimizer_and_poptorch_counterparts_only(factory, tmp_path, poptorch_double):
    with pytest.raises(Exception, match="Adagrad has no poptorch counterpart"):
        run(factory, tmp_path, "ipu", strategy=ipu(), optim="adagrad")


def test_accelerator_ipu_selects_the_ipu_strategy(factory, tmp_path, poptorch_double):
    model = factory.qa_model()
    args = TrainingArguments(str(tmp_path / "out"), **{**COMMON, "num_train_epochs": 1}, accelerator="ipu")
    trainer = Trainer(model, args, train_dataset=factory.qa_dataset(16))
    trainer.train()
    assert isinstance(trainer.lightning_trainer.strategy, IPUStrategy)
    assert type(trainer.lightning_trainer.accelerator).__name__ == "IPUAccelerator"
    args = TrainingArguments(str(tmp_path / "out2"), **{**COMMON, "num_train_epochs": 1}, strategy="ipu")
    trainer = Trainer(factory.qa_model(), args, train_dataset=factory.qa_dataset(16))
    trainer.train()
    assert type(trainer.lightning_trainer.accelerator).__name__ == "IPUAccelerator"


def test_without_poptorch_selecting_the_ipu_says_what_to_install(factory, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "poptorch", None)  # makes `import poptorch` raise ImportError
    args = TrainingArguments(str(tmp_path / "out"), accelerator="ipu", report_to="none")
    assert args.accelerator == "ipu"  # the name is known without poptorch
    trainer = Trainer(factory.qa_model(), args, train_dataset=factory.qa_dataset(8))
    with pytest.raises(ModuleNotFoundError) as info:
        trainer.train()
    message = str(info.value)
    assert "Poplar SDK" in message and "poptorch" in message and "torch==2.0.1" in message
    with pytest.raises(ModuleNotFoundError, match="Poplar SDK"):
        IPUStrategy()
