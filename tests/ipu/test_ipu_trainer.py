"""IPUTrainer / IPUTrainingArguments: optimum-graphcore's API on the facade (against the poptorch test double)."""

from __future__ import annotations

import dataclasses
import inspect
import json

import pytest
import torch
import transformers
from transformers import default_data_collator

from hflight import TrainingArguments
from hflight.ipu import IPUConfig, IPUTrainer, IPUTrainingArguments

# optimum-graphcore 0.7's IPUTrainer.__init__, in order (its last parameter, force_to_pipelined, selects optimum's
# own pipelined model classes, which hflight does not have).
OPTIMUM_GRAPHCORE_PARAMETERS = [
    "model", "ipu_config", "args", "data_collator", "eval_data_collator", "train_dataset", "eval_dataset",
    "tokenizer", "model_init", "compute_metrics", "callbacks", "optimizers", "preprocess_logits_for_metrics",
]  # fmt: skip
IPU_FIELDS = {
    "ipu_config_name", "n_ipu", "fp32", "lamb", "lamb_no_bias_correction", "loss_scaling", "auto_loss_scaling",
    "dataloader_mode", "compile_only", "ipu_config_overrides", "pad_on_batch_axis",
}  # fmt: skip


def args(tmp_path, **kwargs) -> IPUTrainingArguments:
    base = dict(
        per_device_train_batch_size=2, per_device_eval_batch_size=2, num_train_epochs=1, learning_rate=1e-3,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True, fp32=True,
    )  # fmt: skip
    return IPUTrainingArguments(str(tmp_path / "out"), **{**base, **kwargs})


def test_signature_and_fields_are_optimum_graphcores():
    assert list(inspect.signature(IPUTrainer.__init__).parameters)[1:] == OPTIMUM_GRAPHCORE_PARAMETERS
    fields = {f.name for f in dataclasses.fields(IPUTrainingArguments)}
    assert IPU_FIELDS <= fields and {f.name for f in dataclasses.fields(TrainingArguments)} <= fields
    assert IPUTrainingArguments("o").ipu_precision == "16-true"  # optimum-graphcore trains in float16 by default
    assert IPUTrainingArguments("o", fp32=True).ipu_precision == "32-true"
    assert IPUTrainingArguments("o", fp16=True).ipu_precision == "16-mixed"
    with pytest.raises(ValueError, match="dataloader_mode must be one of sync, async, async_rebatched"):
        IPUTrainingArguments("o", dataloader_mode="fast")
    with pytest.raises(ValueError, match="n_ipu must be one of"):
        IPUTrainingArguments("o", n_ipu=3)
    with pytest.raises(ValueError, match="bf16 is not available on the IPU"):
        IPUTrainingArguments("o", bf16=True)


def test_ipu_arguments_shape_the_config(poptorch_double, factory, tmp_path):
    config = IPUConfig(layers_per_ipu=[1, 1], inference_layers_per_ipu=[2], gradient_accumulation_steps=8)
    trainer = IPUTrainer(
        factory.qa_model(),
        config,
        args(tmp_path, n_ipu=8, ipu_config_overrides="device_iterations=3", auto_loss_scaling=True, seed=5),
        train_dataset=factory.qa_dataset(8),
    )
    used = trainer.ipu_config
    assert (used.replication_factor, used.inference_replication_factor) == (4, 8)  # n_ipu // IPUs per replica
    assert used.device_iterations == 3 and used.auto_loss_scaling and used.seed == 5
    assert config.replication_factor == 1 and config.device_iterations == 1  # the caller's config is not changed


def test_training_with_device_iterations_eval_collator_and_ipu_config_saved(poptorch_double, factory, tmp_path):
    collated = []

    def eval_collator(rows):
        collated.append(len(rows))
        return default_data_collator(rows)

    model = factory.qa_model()
    trainer = IPUTrainer(
        model,
        IPUConfig(device_iterations=2, gradient_accumulation_steps=2, output_mode="all"),
        args(tmp_path, loss_scaling=4.0, max_grad_norm=0.5, eval_strategy="epoch"),
        eval_data_collator=eval_collator,
        train_dataset=factory.qa_dataset(24),
        eval_dataset=factory.qa_dataset(8, seed=1),
    )
    output = trainer.train()
    assert output.global_step == 3  # 24 samples / combined batch 2 x 2 x 2 = 3 host steps (6 device updates)
    optimizer = trainer.optimizer
    assert type(optimizer).__name__ == "AdamW" and optimizer.__module__.startswith("poptorch")
    assert optimizer.bias_correction is False  # optimum-graphcore's AdamW
    assert optimizer.max_grad_norm == 0.5 and optimizer.loss_scaling == 4.0
    assert optimizer.variable_attrs.isConstant("weight_decay")
    assert collated and set(collated) == {2}  # evaluation batches came through eval_data_collator
    trainer.save_model()
    saved = json.loads((tmp_path / "out" / "ipu_config.json").read_text())
    assert saved["device_iterations"] == 2 and saved["gradient_accumulation_steps"] == 2


def test_lamb(poptorch_double, factory, tmp_path):
    arguments = args(tmp_path, lamb=True, weight_decay=0.01)
    trainer = IPUTrainer(factory.qa_model(), IPUConfig(), arguments, train_dataset=factory.qa_dataset(8))
    trainer.train()
    optimizer = trainer.optimizer
    assert type(optimizer).__name__ == "LAMB" and len(optimizer.param_groups) == 3
    biases = optimizer.param_groups[1]
    assert biases["weight_decay"] == 0.0 and biases["max_weight_norm"] == 0.0


def test_float16_by_default(poptorch_double, factory, tmp_path):
    model = factory.qa_model()
    trainer = IPUTrainer(model, IPUConfig(), args(tmp_path, fp32=False), train_dataset=factory.qa_dataset(8))
    trainer.train()
    assert next(model.parameters()).dtype == torch.float16  # halved on the host, as optimum-graphcore does
    assert trainer.optimizer.accum_type == torch.float16
    assert trainer.optimizer.second_order_momentum_accum_type == torch.float32  # optimum-graphcore's
    # float32 second moments: with float16 ones, Adam's eps=1e-8 underflows and unused embedding rows became NaN
    assert all(torch.isfinite(p).all() for p in model.parameters())
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses and all(0 < loss < 10 for loss in losses)


def test_compile_only_compiles_offline_and_stops(poptorch_double, factory, tmp_path, monkeypatch):
    compiled = []
    original = poptorch_double.PoplarExecutor.compile

    def spy(self, *args, **kwargs):
        compiled.append((self.options.connection_type, {k: tuple(v.shape) for k, v in kwargs.items()}))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(poptorch_double.PoplarExecutor, "compile", spy)
    poptorch_double.system.ipu_version = 0  # no IPU in this machine: offline compilation does not need one
    model = factory.qa_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = IPUTrainer(
        model,
        IPUConfig(gradient_accumulation_steps=2),
        args(tmp_path, compile_only=True),
        train_dataset=factory.qa_dataset(8),
        eval_dataset=factory.qa_dataset(4, seed=1),
    )
    output = trainer.train()
    assert output.global_step == 0 and trainer.evaluate() == {}
    never = poptorch_double.ConnectionType.Never.value
    assert [c[0] for c in compiled] == [never, never, never]  # training + inference, then inference again
    assert compiled[0][1]["input_ids"] == (4, 24)  # the first combined training batch: 2 x GA 2
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing ran
    assert not (tmp_path / "out" / "checkpoint-1").exists()


def test_plain_training_arguments_are_converted(poptorch_double, factory, tmp_path):
    """A migrating user may pass hflight's plain TrainingArguments: the IPU fields get optimum-graphcore's defaults."""
    plain = TrainingArguments(str(tmp_path / "out"), per_device_train_batch_size=2, learning_rate=1e-3, seed=5,
                              report_to="none", save_strategy="no", max_steps=2)  # fmt: skip
    trainer = IPUTrainer(factory.qa_model(), IPUConfig(), plain, train_dataset=factory.qa_dataset(8))
    assert type(trainer.args) is IPUTrainingArguments
    assert (trainer.args.learning_rate, trainer.args.seed, trainer.args.max_steps) == (1e-3, 5, 2)
    assert trainer.args.fp32 is False and trainer.args.ipu_precision == "16-true"  # optimum-graphcore's defaults
    with pytest.raises(TypeError, match="IPUTrainer: args must be IPUTrainingArguments or TrainingArguments, got dict"):
        IPUTrainer(factory.qa_model(), IPUConfig(), {"learning_rate": 1e-3})


# ---- issue 16: what optimum-graphcore users rely on ----------------------------------------------------------------
def _parsed(argv: list[str]) -> IPUTrainingArguments:
    from transformers import HfArgumentParser

    (parsed,) = HfArgumentParser(IPUTrainingArguments).parse_args_into_dataclasses(argv)
    return parsed


@pytest.mark.parametrize(
    "argv, device_accumulation",
    [([], 8), (["--gradient_accumulation_steps", "1"], 1), (["--gradient_accumulation_steps", "2"], 2)],
)
def test_an_explicit_gradient_accumulation_overrides_the_ipu_config(
    poptorch_double, executors, factory, tmp_path, argv, device_accumulation
):
    """optimum-graphcore's field defaults to None: a value on the command line (even 1) is appended to
    ipu_config_overrides and wins over ipu_config.json's 8; no value leaves the config's and reads as 1."""
    arguments = _parsed(["--output_dir", str(tmp_path / "out"), "--per_device_train_batch_size", "1", "--fp32",
                         "--report_to", "none", "--save_strategy", "no", "--max_steps", "1", *argv])  # fmt: skip
    assert arguments.gradient_accumulation_steps == (int(argv[1]) if argv else 1)
    assert ("gradient_accumulation_steps" in (arguments.ipu_config_overrides or "")) is bool(argv)
    trainer = IPUTrainer(
        factory.qa_model(), IPUConfig(gradient_accumulation_steps=8), arguments, train_dataset=factory.qa_dataset(16)
    )
    assert trainer.ipu_config.gradient_accumulation_steps == device_accumulation
    trainer.train()
    (training,) = [e for e in executors if e.calls and e.calls[0].training]
    assert training.options.Training.gradient_accumulation == device_accumulation
    (call,) = training.calls
    assert call.micro_batches == device_accumulation and call.input_shapes["input_ids"][0] == device_accumulation


def test_plain_training_arguments_leave_the_ipu_configs_accumulation(poptorch_double, factory, tmp_path):
    plain = TrainingArguments(str(tmp_path / "out"), report_to="none")
    assert (
        IPUTrainer(
            factory.qa_model(), IPUConfig(gradient_accumulation_steps=8), plain
        ).ipu_config.gradient_accumulation_steps
        == 8
    )
    plain = TrainingArguments(str(tmp_path / "out"), report_to="none", gradient_accumulation_steps=4)
    assert (
        IPUTrainer(
            factory.qa_model(), IPUConfig(gradient_accumulation_steps=8), plain
        ).ipu_config.gradient_accumulation_steps
        == 4
    )


def test_n_ipu_smaller_than_a_replica_raises(poptorch_double, factory, tmp_path):
    """optimum-graphcore computes replication_factor = n_ipu // ipus_per_replica = 0, which its validator refuses;
    hflight used to clamp it to 1 silently."""
    with pytest.raises(
        ValueError, match=r"n_ipu=2 is smaller .*`replication_factor` must be >= 1\. You provided value=0"
    ):
        IPUTrainer(factory.qa_model(), IPUConfig(layers_per_ipu=[1, 1, 1, 1]), args(tmp_path, n_ipu=2))
    trainer = IPUTrainer(factory.qa_model(), IPUConfig(layers_per_ipu=[1, 1, 1, 1]), args(tmp_path, n_ipu=8))
    assert trainer.ipu_config.replication_factor == 2


def test_dataloader_getters_return_combined_batches(poptorch_double, factory, tmp_path):
    config = IPUConfig(replication_factor=2, gradient_accumulation_steps=3, device_iterations=2,
                       inference_replication_factor=2, inference_device_iterations=3)  # fmt: skip
    trainer = IPUTrainer(
        factory.qa_model(), config, args(tmp_path, per_device_train_batch_size=2, per_device_eval_batch_size=1),
        train_dataset=factory.qa_dataset(30), eval_dataset=factory.qa_dataset(13, seed=1),
    )  # fmt: skip
    train = trainer.get_train_dataloader()
    assert isinstance(train, poptorch_double.DataLoader) and train.combinedBatchSize == 2 * 2 * 3 * 2
    assert [b["input_ids"].shape[0] for b in train] == [24]  # 30 samples: one complete combined batch
    for loader in (trainer.get_eval_dataloader(), trainer.get_test_dataloader(factory.qa_dataset(13, seed=1))):
        assert isinstance(loader, poptorch_double.DataLoader) and loader.combinedBatchSize == 1 * 2 * 3
        assert loader.options.replication_factor == 2 and loader.options.device_iterations == 3
        assert [b["input_ids"].shape[0] for b in loader] == [6, 6, 1]


@pytest.mark.parametrize("pad", [True, False], ids=["padded", "not padded"])
@pytest.mark.parametrize(
    "config, n_ipu, rows_per_call",
    [
        ({"gradient_accumulation_steps": 4}, None, 4),
        ({"gradient_accumulation_steps": 4, "inference_device_iterations": 2}, None, 8),
        ({"gradient_accumulation_steps": 2}, 2, 8),  # n_ipu=2: two replicas for training and for inference
    ],
    ids=["replicas1-x-GA4", "replicas1-x-GA4-inference-iterations2", "replicas2-x-GA2"],
)
def test_eval_loss_counts_the_real_rows_of_the_last_batch_as_transformers_on_the_cpu(
    poptorch_double, executors, factory, tmp_path, config, n_ipu, rows_per_call, pad
):
    """10 evaluation rows in batches of 4: ``eval_loss`` (and ``predict``'s ``test_loss``) of the same model is
    transformers' Trainer's on the CPU, each call's loss weighing its real rows (the last call's 10 % rows_per_call).
    Each inference call gives one loss for its combined batch (micro-batch x inference replicas x device iterations).
    The last, incomplete batch reaches an executable in a shape it was compiled for: with ``pad_on_batch_axis`` the
    loader pads it to the combined batch; without (optimum-graphcore's default), a second executable is compiled for
    its rows (poptorch refused the first with a shape mismatch), and the loss of its 2 rows counted 4 times: 2.7742
    against the CPU's 2.7578 (issue 67)."""
    evaluation = factory.qa_dataset(10, seed=1)
    cpu_args = transformers.TrainingArguments(str(tmp_path / "cpu"), per_device_eval_batch_size=4, use_cpu=True,
                                              report_to="none", disable_tqdm=True)  # fmt: skip
    cpu = transformers.Trainer(factory.qa_model(), cpu_args)
    expected, predicted = cpu.evaluate(evaluation)["eval_loss"], cpu.predict(evaluation)
    arguments = args(tmp_path, per_device_eval_batch_size=4, pad_on_batch_axis=pad, n_ipu=n_ipu)
    trainer = IPUTrainer(factory.qa_model(), IPUConfig(**config), arguments)
    assert trainer.evaluate(evaluation)["eval_loss"] == pytest.approx(expected, rel=1e-6)
    output = trainer.predict(evaluation)
    assert output.metrics["test_loss"] == pytest.approx(expected, rel=1e-6)
    for ours, theirs in zip(output.predictions, predicted.predictions, strict=True):
        assert ours.shape == theirs.shape and abs(ours - theirs).max() < 1e-5
    calls = [call.input_shapes["input_ids"][0] for e in executors for call in e.calls if not call.training]
    last = rows_per_call if pad else 10 % rows_per_call
    assert calls == ([rows_per_call] * (10 // rows_per_call) + [last]) * 2  # evaluate's, then predict's


@pytest.mark.parametrize("rows", [11, 13])
def test_a_last_batch_whose_rows_do_not_divide_the_replicas_runs_on_one_without_repeating_rows(
    poptorch_double, executors, factory, tmp_path, rows
):
    """Two inference replicas, 8 rows a call, 11 or 13 rows: the last call's 3 or 5 rows were rounded up to 4 or 6 by
    repeating rows, whose losses entered the call's (3.20771 against the CPU's 3.20494 at 11 rows; fault read of issue
    67). They now run on an executable of one replica compiled for them: the CPU's eval_loss."""
    evaluation = factory.qa_dataset(rows, seed=1)
    cpu_args = transformers.TrainingArguments(str(tmp_path / "cpu"), per_device_eval_batch_size=4, use_cpu=True,
                                              report_to="none", disable_tqdm=True)  # fmt: skip
    expected = transformers.Trainer(factory.qa_model(), cpu_args).evaluate(evaluation)["eval_loss"]
    arguments = args(tmp_path, per_device_eval_batch_size=4, pad_on_batch_axis=False, n_ipu=2)
    trainer = IPUTrainer(factory.qa_model(), IPUConfig(gradient_accumulation_steps=2), arguments)
    assert trainer.evaluate(evaluation)["eval_loss"] == pytest.approx(expected, rel=1e-6)
    calls = [call.input_shapes["input_ids"][0] for e in executors for call in e.calls if not call.training]
    assert calls == [8, rows - 8]


@pytest.mark.parametrize(
    "config, n_ipu",
    [({"gradient_accumulation_steps": 4, "inference_device_iterations": 2}, None), ({}, 2)],
    ids=["inference-iterations2", "replicas2"],
)
def test_eval_with_dataloader_drop_last_drops_the_incomplete_last_batch_as_transformers(
    poptorch_double, factory, tmp_path, config, n_ipu
):
    """dataloader_drop_last=True: the last, incomplete combined batch (10 rows, 8 a call: 2) is dropped, not padded,
    as optimum-graphcore's evaluation loader does; transformers on the CPU drops its last batch of 4 (2 rows) too."""
    evaluation = factory.qa_dataset(10, seed=1)
    cpu_args = transformers.TrainingArguments(str(tmp_path / "cpu"), per_device_eval_batch_size=4, use_cpu=True,
                                              report_to="none", disable_tqdm=True,
                                              dataloader_drop_last=True)  # fmt: skip
    expected = transformers.Trainer(factory.qa_model(), cpu_args).evaluate(evaluation)["eval_loss"]
    arguments = args(tmp_path, per_device_eval_batch_size=4, pad_on_batch_axis=True, n_ipu=n_ipu,
                     dataloader_drop_last=True)  # fmt: skip
    trainer = IPUTrainer(factory.qa_model(), IPUConfig(**config), arguments)
    assert trainer.evaluate(evaluation)["eval_loss"] == pytest.approx(expected, rel=1e-6)


def test_each_checkpoint_copies_the_weights_to_the_host_once(poptorch_double, factory, tmp_path, monkeypatch):
    """A checkpoint writes its model through save_model (as transformers'); the weights come from the IPU once per
    checkpoint, not again for the model files."""
    copies = []
    real = poptorch_double.PoplarExecutor.copyWeightsToHost
    monkeypatch.setattr(poptorch_double.PoplarExecutor, "copyWeightsToHost",
                        lambda self: (copies.append(1), real(self))[1])  # fmt: skip
    trainer = IPUTrainer(factory.qa_model(), IPUConfig(), args(tmp_path, save_strategy="steps", save_steps=2),
                         train_dataset=factory.qa_dataset(8))  # fmt: skip
    trainer.train()
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert len(copies) == 2


def test_the_state_is_an_ipu_trainer_state_kept_across_resume(poptorch_double, factory, tmp_path):
    from hflight.ipu import IPUTrainerState

    trainer = IPUTrainer(factory.qa_model(), IPUConfig(), args(tmp_path, save_strategy="steps", save_steps=2),
                         train_dataset=factory.qa_dataset(8))  # fmt: skip
    assert type(trainer.state) is IPUTrainerState and trainer.state.start_time == -1.0
    trainer.train()
    started = trainer.state.start_time
    assert type(trainer.state) is IPUTrainerState and started > 0
    saved = json.loads((tmp_path / "out" / "checkpoint-4" / "trainer_state.json").read_text())
    assert saved["start_time"] == started
    # poptorch's trainingModel renames the model's class until it is destroyed: the checkpoint names the real one
    config = json.loads((tmp_path / "out" / "checkpoint-4" / "config.json").read_text())
    assert config["architectures"] == ["BertForQuestionAnswering"]
    resumed = IPUTrainer(factory.qa_model(), IPUConfig(), args(tmp_path, save_strategy="steps", save_steps=2,
                         num_train_epochs=2), train_dataset=factory.qa_dataset(8))  # fmt: skip
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-4"))
    assert type(resumed.state) is IPUTrainerState and resumed.state.global_step == 8
    assert resumed.state.start_time == started  # the first start, as optimum-graphcore keeps it
