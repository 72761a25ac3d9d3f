"""The poptorch double against poptorch's documented behaviour: options, DataLoader batching, the executor's
batch semantics and numerics (compared with eager torch loops), its host/device state, and the device pool."""

from __future__ import annotations

import copy
import inspect
import logging
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

ATOL = 1e-6


class Regressor(nn.Module):
    """A tiny model that returns ``(output, loss)`` when given targets, as poptorch's examples do."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.linear = nn.Linear(4, 3)

    def forward(self, x, y=None):
        out = self.linear(x)
        if y is None:
            return out
        return out, F.mse_loss(out, y)


def data(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randn(n, 3, generator=g)


def eager_adamw(model: nn.Module, steps: list[list[tuple[torch.Tensor, torch.Tensor]]], **hyper) -> nn.Module:
    """The reference: one AdamW step per entry of ``steps``, on the mean gradient of its micro-batches."""
    return eager(model, steps, torch.optim.AdamW, **hyper)


def eager(model: nn.Module, steps: list[list[tuple[torch.Tensor, torch.Tensor]]], optimizer_cls, **hyper) -> nn.Module:
    model = copy.deepcopy(model)
    optimizer = optimizer_cls(model.parameters(), **hyper)
    for micro_batches in steps:
        optimizer.zero_grad()
        for x, y in micro_batches:
            (model(x, y)[1] / len(micro_batches)).backward()
        optimizer.step()
    return model


def chunks(x: torch.Tensor, y: torch.Tensor, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(zip(x.chunk(n), y.chunk(n)))


def assert_same_weights(a: nn.Module, b: nn.Module, atol: float = ATOL) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=atol, rtol=0), f"{name} differs by {(p - q).abs().max().item()}"


def device_weights(executor) -> dict[str, torch.Tensor]:
    executor.copyWeightsToHost()
    return {n: p.detach().clone() for n, p in executor.model.named_parameters()}


# ---- installation --------------------------------------------------------------------------------------------------
def test_fixture_installs_a_fresh_double_as_poptorch(poptorch_double):
    import poptorch
    import poptorch.optim

    assert poptorch is poptorch_double
    assert poptorch.optim is poptorch_double.optim
    assert poptorch_double.system.held_ipus() == 0 and poptorch_double.system.num_ipus == 16
    assert poptorch.ipuHardwareVersion() == 2
    assert poptorch.ipuHardwareIsAvailable(16) and not poptorch.ipuHardwareIsAvailable(32)
    poptorch_double.system.num_ipus = 0
    assert not poptorch.ipuHardwareIsAvailable()
    # poptorch.Error comes from poptorch_core, a plain Exception subclass
    assert issubclass(poptorch.Error, Exception) and not issubclass(poptorch.Error, RuntimeError)
    # the optimizers live only in poptorch.optim, as in poptorch
    assert not hasattr(poptorch, "AdamW") and poptorch.optim.AdamW.__module__ == "poptorch.optim"


def test_each_test_gets_its_own_module_state(poptorch_double):
    assert poptorch_double.system.num_ipus == 16  # the previous test set it to 0 on its own copy
    assert sys.modules["poptorch"] is poptorch_double


# ---- options -------------------------------------------------------------------------------------------------------
def test_options_defaults_and_read_back(poptorch_double):
    poptorch = poptorch_double
    opts = poptorch.Options()
    assert opts.replication_factor == 1 and opts.device_iterations == 1
    assert opts.Training.gradient_accumulation == 1
    assert opts.Training.accumulation_and_replication_reduction_type == poptorch.ReductionType.Mean
    assert opts.output_mode == poptorch.OutputMode.Default and opts.defaultOutputMode()
    assert opts.connection_type == poptorch.ConnectionType.Always
    assert opts.auto_round_num_ipus is False and not opts.exists("random_seed")
    assert opts._Popart.options == {"instrumentWithHardwareCycleCounter": False, "rearrangeAnchorsOnHost": False}
    with pytest.raises(AssertionError, match="An output mode must be picked before serialisation"):
        opts.toDict()
    with pytest.raises(AttributeError, match="Invalid attribute not_an_option"):
        _ = opts.not_an_option


def test_options_setters_chain_and_are_recorded_in_order(poptorch_double):
    poptorch = poptorch_double
    opts = poptorch.Options()
    location = poptorch.TensorLocationSettings().useOnChipStorage(False).useReplicatedTensorSharding(True)
    assert opts.deviceIterations(2) is opts
    assert opts.replicationFactor(2).autoRoundNumIPUs(True).randomSeed(42) is opts
    assert opts.Training.gradientAccumulation(4) is opts.Training
    opts.Training.accumulationAndReplicationReductionType(poptorch.ReductionType.Sum)
    opts.Training.setAutomaticLossScaling(False)
    opts.outputMode(poptorch.OutputMode.EveryN, 2)
    assert opts.TensorLocations.setOptimizerLocation(location) is opts.TensorLocations
    opts.Precision.enableStochasticRounding(True).setPartialsType(torch.half)
    opts._Popart.set("outlineThreshold", 10.0).setPatterns({"TiedGather": True})
    opts.setAvailableMemoryProportion({"IPU0": 0.3})
    opts.enableExecutableCaching("/tmp/cache")
    opts.setExecutionStrategy(poptorch.ShardedExecution(poptorch.AutoStage.AutoIncrement))

    assert opts.device_iterations == 2 and opts.replication_factor == 2 and opts.random_seed == 42
    assert opts.Training.gradient_accumulation == 4
    assert opts.output_mode == poptorch.OutputMode.EveryN and opts.output_return_period == 2
    assert opts.TensorLocations.location_optimizer == {"onChip": 0, "useReplicatedTensorSharding": 1}
    assert opts.available_memory_proportion == {0: 0.3}
    popart = opts._Popart.options
    assert popart["enableStochasticRounding"] is True and popart["partialsTypeMatMuls"] == "half"
    assert popart["outlineThreshold"] == 10.0 and popart["patterns"] == {"TiedGather": True}
    assert popart["cachePath"] == "/tmp/cache" and popart["enableEngineCaching"] is True
    assert opts.toDict()["execution_mode"] == 1  # ShardedExecution
    # one record per user call (nested calls such as setPartialsType -> _Popart.set are not repeated)
    assert [name for name, _ in opts.calls] == [
        "deviceIterations",
        "replicationFactor",
        "autoRoundNumIPUs",
        "randomSeed",
        "Training.gradientAccumulation",
        "Training.accumulationAndReplicationReductionType",
        "Training.setAutomaticLossScaling",
        "outputMode",
        "TensorLocations.setOptimizerLocation",
        "Precision.enableStochasticRounding",
        "Precision.setPartialsType",
        "_Popart.set",
        "_Popart.setPatterns",
        "setAvailableMemoryProportion",
        "enableExecutableCaching",
        "setExecutionStrategy",
    ]
    assert opts.calls[4] == ("Training.gradientAccumulation", (4,))
    assert opts.calls[7] == ("outputMode", (poptorch.OutputMode.EveryN, 2))
    assert opts.calls[11] == ("_Popart.set", ("outlineThreshold", 10.0))


def test_options_type_asserts_as_poptorch(poptorch_double):
    poptorch = poptorch_double
    opts = poptorch.Options()
    with pytest.raises(AssertionError, match="Unexpected type <class 'str'> for option device_iterations"):
        opts.deviceIterations("2")
    with pytest.raises(AssertionError):
        opts.randomSeed(1.5)
    with pytest.raises(AssertionError):
        opts.outputMode("All")
    with pytest.raises(AssertionError, match="EveryN anchor must have output_return_period"):
        opts.outputMode(poptorch.OutputMode.EveryN)
    with pytest.raises(ValueError, match="must be set to poptorch.ReductionType.Mean or poptorch.ReductionType.Sum"):
        opts.Training.accumulationAndReplicationReductionType(poptorch.ReductionType.NoReduction)
    with pytest.raises(ValueError, match="setPartialsType"):
        opts.Precision.setPartialsType(torch.int8)
    with pytest.raises(AssertionError, match="Invalid key: GPU0"):
        opts.setAvailableMemoryProportion({"GPU0": 0.5})
    with pytest.raises(AssertionError):
        opts.TensorLocations.setOptimizerLocation({"onChip": 0})
    assert opts.calls == []  # failed calls leave no record


def test_options_freeze_after_use_and_clone_unfrozen(poptorch_double):
    poptorch = poptorch_double
    opts = poptorch.Options().deviceIterations(2)
    poptorch.DataLoader(opts, torch.utils.data.TensorDataset(torch.zeros(4, 1)))
    for mutate in (
        lambda: opts.deviceIterations(4),
        lambda: opts.Training.gradientAccumulation(2),
        lambda: opts._Popart.set("a", 1),
        lambda: opts.setExecutionStrategy(poptorch.PipelinedExecution()),
    ):
        with pytest.raises(AttributeError, match="Can't modify frozen Options"):
            mutate()
    clone = opts.clone()
    clone.deviceIterations(4).Training.gradientAccumulation(2)
    assert (opts.device_iterations, clone.device_iterations) == (2, 4)
    # a model freezes the user's options and works on its own copy with the output mode resolved
    fresh = poptorch.Options()
    executor = poptorch.inferenceModel(Regressor(), fresh)
    with pytest.raises(AttributeError, match="frozen"):
        fresh.replicationFactor(2)
    assert fresh.defaultOutputMode() and executor.options.output_mode == poptorch.OutputMode.All
    training = poptorch.trainingModel(Regressor(), poptorch.Options())
    assert training.options.output_mode == poptorch.OutputMode.Final
    assert training.options.toDict()["output_mode"] == poptorch.OutputMode.Final


def test_offline_target_sets_connection_type_never(poptorch_double):
    poptorch = poptorch_double
    opts = poptorch.Options().useOfflineIpuTarget()
    assert opts.connection_type == poptorch.ConnectionType.Never and opts.ipu_version == 2
    assert opts.calls == [("useOfflineIpuTarget", ())]


# ---- DataLoader ----------------------------------------------------------------------------------------------------
def test_dataloader_yields_the_combined_batch(poptorch_double):
    poptorch = poptorch_double
    opts = poptorch.Options().deviceIterations(2).replicationFactor(2)
    opts.Training.gradientAccumulation(3)
    dataset = torch.utils.data.TensorDataset(torch.arange(60).float().unsqueeze(1))
    loader = poptorch.DataLoader(opts, dataset, batch_size=2, collate_fn=None)
    assert loader.combinedBatchSize == 2 * 2 * 2 * 3 and loader.options is opts
    assert len(loader) == 60 // 24
    batches = [b for (b,) in loader]
    assert [b.shape[0] for b in batches] == [24, 24]
    assert torch.equal(batches[0].squeeze(1), torch.arange(24).float())  # contiguous and in order
    assert isinstance(loader, torch.utils.data.DataLoader)


def test_dataloader_warns_when_the_last_batch_is_partial(poptorch_double, caplog):
    poptorch = poptorch_double
    opts = poptorch.Options().deviceIterations(4)
    dataset = torch.utils.data.TensorDataset(torch.zeros(10, 1))
    with caplog.at_level(logging.WARNING, logger="poptorch::python"):
        loader = poptorch.DataLoader(opts, dataset, batch_size=1, drop_last=False)
    assert "is not divisible by the number of elements processed per step (4)" in caplog.text
    assert [b.shape[0] for (b,) in loader] == [4, 4, 2]
    with pytest.raises(poptorch.Error, match="mutually exclusive with batch_size, shuffle"):
        poptorch.DataLoader(poptorch.Options(), dataset, batch_size=2, batch_sampler=[[0, 1]])


def test_dataloader_combines_a_user_batch_sampler(poptorch_double):
    poptorch = poptorch_double
    opts = poptorch.Options().deviceIterations(2)
    dataset = torch.utils.data.TensorDataset(torch.arange(8).float())
    sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(dataset), batch_size=2, drop_last=True)
    loader = poptorch.DataLoader(opts, dataset, batch_sampler=sampler)
    assert loader.combinedBatchSize == 4
    assert [b.tolist() for (b,) in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]


# ---- wrapping ----------------------------------------------------------------------------------------------------
def test_wrapping_twice_raises_until_destroyed(poptorch_double):
    poptorch = poptorch_double
    model = Regressor()
    executor = poptorch.trainingModel(model)
    assert isinstance(model, Regressor) and type(model).__name__ == "PoptorchRegressor"
    with pytest.raises(RuntimeError, match="Model has already been wrapped in 'poptorch.trainingModel'"):
        poptorch.trainingModel(model)
    with pytest.raises(RuntimeError, match="already been wrapped"):
        poptorch.trainingModel(executor)
    x, y = data(2)
    executor(x, y)
    model.destroy()  # the wrapped model's destroy() destroys its executor
    assert not executor.isCompiled() and type(model) is Regressor
    poptorch.trainingModel(model)


def test_inference_refuses_gradient_accumulation(poptorch_double):
    poptorch = poptorch_double
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(2)
    with pytest.raises(poptorch.Error, match="gradientAccumulation to 1"):
        poptorch.inferenceModel(Regressor(), opts)
    with pytest.raises(poptorch.Error, match="Expected poptorch.Options"):
        poptorch.trainingModel(Regressor(), options={"replication_factor": 2})


# ---- batches -------------------------------------------------------------------------------------------------------
def test_invalid_batch_dimension_and_later_shape_changes(poptorch_double):
    poptorch = poptorch_double
    opts = poptorch.Options().deviceIterations(2)
    opts.Training.gradientAccumulation(2)
    executor = poptorch.trainingModel(Regressor(), opts)
    with pytest.raises(AssertionError, match=r"Invalid batch dimension.*batch dimension \(6\) must be a multiple"):
        executor(*data(6))
    assert not executor.isCompiled()
    executor(*data(8))
    with pytest.raises(poptorch.Error, match=r"Shape mismatch for x: expected torch.Size\(\[8, 4\]\)"):
        executor(*data(4))
    with pytest.raises(poptorch.Error, match="Data type mismatch for y"):
        executor(data(8)[0], data(8)[1].double())
    assert executor.compile_count == 1


# ---- numerics against eager torch ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["AdamW", "SGD"])  # AdamW cannot tell a mean from a sum: SGD can
def test_gradient_accumulation_equals_eager_steps_on_the_mean_gradient(poptorch_double, name):
    poptorch = poptorch_double
    hyper = dict(lr=0.1, weight_decay=0.01) if name == "AdamW" else dict(lr=0.1, momentum=0.9)
    model = Regressor()
    reference = eager(model, [chunks(*data(8), 4)], getattr(torch.optim, name), **hyper)
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(4)
    executor = poptorch.trainingModel(model, opts, getattr(poptorch.optim, name)(model.parameters(), **hyper))
    executor(*data(8))
    assert executor.calls[0].micro_batches == 4 and executor.calls[0].optimizer_steps == 1
    executor.copyWeightsToHost()
    assert_same_weights(model, reference)
    # stepping after every micro-batch (accumulating on the host instead) ends elsewhere
    stepwise = eager(Regressor(), [[mb] for mb in chunks(*data(8), 4)], getattr(torch.optim, name), **hyper)
    assert not torch.allclose(stepwise.linear.bias, model.linear.bias, atol=1e-3)


def test_replication_2_times_accumulation_2_equals_accumulation_4(poptorch_double):
    poptorch = poptorch_double
    results = []
    for replicas, accumulation in ((2, 2), (1, 4)):
        model = Regressor()
        opts = poptorch.Options().replicationFactor(replicas)
        opts.Training.gradientAccumulation(accumulation)
        executor = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.05))
        executor(*data(16))
        results.append(device_weights(executor))
        executor.destroy()
    for name in results[0]:
        assert torch.allclose(results[0][name], results[1][name], atol=ATOL, rtol=0)
    assert not torch.allclose(results[0]["linear.bias"], Regressor().linear.bias)


def test_device_iterations_run_one_optimizer_step_each(poptorch_double):
    poptorch = poptorch_double
    model = Regressor()
    x, y = data(8)
    reference = eager_adamw(model, [[(x[:4], y[:4])], [(x[4:], y[4:])]], lr=0.1)
    executor = poptorch.trainingModel(
        model, poptorch.Options().deviceIterations(2), poptorch.optim.AdamW(model.parameters(), lr=0.1)
    )
    executor(x, y)
    assert executor.calls[0].optimizer_steps == 2
    executor.copyWeightsToHost()
    assert_same_weights(model, reference)


def test_sum_reduction_loss_scaling_and_clipping(poptorch_double):
    poptorch = poptorch_double
    model = Regressor()
    x, y = data(8)
    reference = copy.deepcopy(model)
    eager = torch.optim.SGD(reference.parameters(), lr=0.1)
    for xs, ys in chunks(x, y, 2):
        reference(xs, ys)[1].backward()  # summed over micro-batches
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.25)
    eager.step()

    opts = poptorch.Options()
    opts.Training.gradientAccumulation(2).accumulationAndReplicationReductionType(poptorch.ReductionType.Sum)
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1, loss_scaling=128.0, max_grad_norm=0.25)
    executor = poptorch.trainingModel(model, opts, optimizer)
    executor(x, y)
    executor.copyWeightsToHost()
    assert_same_weights(model, reference)


def test_parameters_outside_the_optimizer_are_trained_with_its_defaults(poptorch_double):
    poptorch = poptorch_double
    model = Regressor()
    bias = model.linear.bias.detach().clone()
    executor = poptorch.trainingModel(model, optimizer=torch.optim.SGD([model.linear.weight], lr=0.1))
    executor(*data(2))
    executor.copyWeightsToHost()
    assert not torch.equal(model.linear.bias, bias)  # PopART updates every trainable weight


def test_lamb_matches_its_update_rule(poptorch_double):
    poptorch = poptorch_double
    model = Regressor()
    w0 = model.linear.weight.detach().clone()
    x, y = data(4)
    grad = torch.autograd.grad(model(x, y)[1], model.linear.weight)[0]
    m, v = 0.1 * grad, 0.001 * grad**2
    update = (m / 0.1) / ((v / 0.001).sqrt() + 1e-6) + 0.01 * w0
    expected = w0 - 0.05 * (w0.norm() / update.norm()) * update
    optimizer = poptorch.optim.LAMB(model.parameters(), lr=0.05, eps=1e-6, weight_decay=0.01)
    executor = poptorch.trainingModel(model, optimizer=optimizer)
    executor(x, y)
    executor.copyWeightsToHost()
    assert torch.allclose(model.linear.weight, expected, atol=ATOL, rtol=0)


# ---- outputs -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["All", "Final", "Sum", "EveryN", "Default"])
def test_training_output_modes(poptorch_double, mode):
    poptorch = poptorch_double
    model = Regressor()
    x, y = data(8)
    expected = [model(xs, ys) for xs, ys in chunks(x, y, 4)]  # lr=0: every micro-batch sees the same weights
    opts = poptorch.Options().deviceIterations(2)
    opts.Training.gradientAccumulation(2)
    if mode != "Default":
        opts.outputMode(getattr(poptorch.OutputMode, mode), 2 if mode == "EveryN" else None)
    executor = poptorch.trainingModel(model, opts, torch.optim.SGD(model.parameters(), lr=0.0))
    out, loss = executor(x, y)
    outs = torch.stack([o for o, _ in expected]).detach()
    losses = torch.stack([lo for _, lo in expected]).detach()
    want = {
        "All": (outs.reshape(8, 3), losses),
        "Final": (outs[-1], losses[-1]),
        "Default": (outs[-1], losses[-1]),
        "Sum": (outs.sum(0), losses.sum()),
        "EveryN": (outs[2:].reshape(4, 3), losses[2:]),  # every 2nd device iteration, all its micro-batches
    }[mode]
    assert out.shape == want[0].shape and loss.shape == want[1].shape
    assert torch.allclose(out, want[0], atol=ATOL) and torch.allclose(loss, want[1], atol=ATOL)
    assert not out.requires_grad


def test_replicated_final_output_has_one_value_per_replica(poptorch_double):
    poptorch = poptorch_double
    executor = poptorch.trainingModel(Regressor(), poptorch.Options().replicationFactor(2))
    out, loss = executor(*data(4))
    assert loss.shape == (2,) and out.shape == (4, 3)


@pytest.mark.parametrize("mode", ["All", "Final", "Sum", "EveryN"])
def test_inference_output_modes(poptorch_double, mode):
    poptorch = poptorch_double
    model = Regressor()
    x, _ = data(8)
    expected = model(x).detach().reshape(4, 2, 3)
    opts = poptorch.Options().deviceIterations(4)
    opts.outputMode(getattr(poptorch.OutputMode, mode), 2 if mode == "EveryN" else None)
    out = poptorch.inferenceModel(model, opts)(x)
    want = {
        "All": expected.reshape(8, 3),
        "Final": expected[-1],
        "Sum": expected.sum(0),
        "EveryN": expected[[1, 3]].reshape(4, 3),
    }[mode]
    assert out.shape == want.shape and torch.allclose(out, want, atol=ATOL)


def test_outputs_are_model_output_structures_with_ipu_dtypes(poptorch_double):
    poptorch = poptorch_double

    class Classifier(Regressor):
        def forward(self, x, y=None):
            logits = self.linear(x)
            return {"loss": F.mse_loss(logits, y), "logits": logits, "pred": logits.argmax(-1)}

    out = poptorch.trainingModel(Classifier())(*data(2))
    assert list(out) == ["loss", "logits", "pred"] and out["pred"].dtype == torch.int32  # the IPU has no int64


def test_a_transformers_model_called_with_keywords(poptorch_double, factory):
    poptorch = poptorch_double
    model = factory.qa_model()
    rows = factory.qa_dataset(n=4, length=12)[:]
    batch = {k: torch.tensor(v) for k, v in rows.items()}
    reference = copy.deepcopy(model)
    eager_sgd = torch.optim.SGD(reference.parameters(), lr=0.1)
    for half in (slice(0, 2), slice(2, 4)):
        (reference(**{k: v[half] for k, v in batch.items()}).loss / 2).backward()
    eager_sgd.step()

    opts = poptorch.Options()
    opts.Training.gradientAccumulation(2)
    training = poptorch.trainingModel(model, opts, poptorch.optim.SGD(model.parameters(), lr=0.1))
    out = training(**batch)
    assert type(out).__name__ == "QuestionAnsweringModelOutput" and out.loss.shape == ()
    assert out.start_logits.shape == (2, 12)  # OutputMode.Final: the last micro-batch
    training.copyWeightsToHost()
    assert_same_weights(model, reference, atol=1e-5)
    inference = poptorch.inferenceModel(model, poptorch.Options().deviceIterations(2))
    logits = inference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).start_logits
    assert logits.shape == (4, 12)  # OutputMode.All
    assert torch.allclose(logits, reference(batch["input_ids"], batch["attention_mask"]).start_logits, atol=1e-5)


def test_backward_on_outputs_raises_poptorchs_error(poptorch_double):
    poptorch = poptorch_double
    _, loss = poptorch.trainingModel(Regressor())(*data(2))
    with pytest.raises(poptorch.Error, match=r"backward\(\) cannot be called explicitly on outputs"):
        loss.backward()
    out = poptorch.inferenceModel(Regressor())(data(2)[0])
    with pytest.raises(poptorch.Error, match="you should use a trainingModel instead"):
        out.backward()


def test_a_training_model_needs_exactly_one_loss(poptorch_double):
    poptorch = poptorch_double
    with pytest.raises(poptorch.Error, match="Couldn't find a loss in graph!"):
        poptorch.trainingModel(Regressor())(data(2)[0])

    class TwoLosses(Regressor):
        def forward(self, x, y):
            out = self.linear(x)
            return F.mse_loss(out, y), F.l1_loss(out, y)

    with pytest.raises(poptorch.Error, match="Multiple independent losses"):
        poptorch.trainingModel(TwoLosses())(*data(2))

    class Marked(TwoLosses):
        def forward(self, x, y):
            first, second = super().forward(x, y)
            return first, poptorch.identity_loss(second, reduction="none")

    _, loss = poptorch.trainingModel(Marked())(*data(2))
    assert loss.shape == ()


# ---- host and device state -------------------------------------------------------------------------------------------
def test_host_weights_change_only_when_copied_to_host(poptorch_double):
    poptorch = poptorch_double
    model = Regressor()
    before = model.linear.weight.detach().clone()
    executor = poptorch.trainingModel(model, optimizer=poptorch.optim.SGD(model.parameters(), lr=0.1))
    x, y = data(2)
    executor(x, y)
    executor(x, y)
    assert torch.equal(model.linear.weight, before)  # DOUBLE: poptorch would copy implicitly on access
    assert torch.equal(model.state_dict()["linear.weight"], before)
    executor.copyWeightsToHost()
    assert not torch.equal(model.linear.weight, before)
    # copying host weights to the device overwrites what the device learnt since the last copy to host
    trained = model.linear.weight.detach().clone()
    executor(x, y)
    executor.copyWeightsToDevice()
    executor.copyWeightsToHost()
    assert torch.equal(model.linear.weight, trained)


def test_detach_and_destroy_copy_the_weights_back(poptorch_double):
    poptorch = poptorch_double
    for finish in ("detachFromDevice", "destroy"):
        model = Regressor()
        before = model.linear.weight.detach().clone()
        executor = poptorch.trainingModel(model)
        executor(*data(2))
        getattr(executor, finish)()
        assert not torch.equal(model.linear.weight, before), finish


def test_a_host_lr_change_reaches_the_device_only_through_set_optimizer(poptorch_double):
    poptorch = poptorch_double
    model = Regressor()
    optimizer = poptorch.optim.SGD(model.parameters(), lr=0.1)
    executor = poptorch.trainingModel(model, optimizer=optimizer)
    x, y = data(2)
    executor(x, y)
    optimizer.param_groups[0]["lr"] = 0.0  # what an LR scheduler does
    executor(x, y)
    assert executor.calls[-1].lrs == [[0.1]]
    executor.setOptimizer(optimizer)
    assert executor.set_optimizer_calls == [[0.0]]
    frozen = device_weights(executor)
    executor(x, y)
    assert executor.calls[-1].lrs == [[0.0]]
    assert all(torch.equal(frozen[n], w) for n, w in device_weights(executor).items())


def test_changing_a_compiled_constant_is_not_a_valid_replacement(poptorch_double):
    poptorch = poptorch_double
    model = Regressor()
    optimizer = poptorch.optim.AdamW(model.parameters(), lr=0.1)  # weight_decay not given: compiled as constant
    assert optimizer.variable_attrs.isConstant("weight_decay") and not optimizer.variable_attrs.isConstant("lr")
    executor = poptorch.trainingModel(model, optimizer=optimizer)
    executor(*data(2))
    optimizer.param_groups[0]["lr"] = 0.05
    executor.setOptimizer(optimizer)  # lr was given explicitly: variable
    optimizer.param_groups[0]["weight_decay"] = 0.5
    with pytest.raises(poptorch.Error, match="not a valid replacement.*weight_decay of group 0 was compiled as a"):
        executor.setOptimizer(optimizer)
    # torch optimizers: lr is always variable, weight_decay is constant at torch's AdamW default (1e-2)
    other = Regressor()
    torch_optimizer = torch.optim.AdamW(other.parameters(), lr=0.1)
    torch_executor = poptorch.trainingModel(other, optimizer=torch_optimizer)
    torch_executor(*data(2))
    torch_optimizer.param_groups[0]["lr"] = 0.01
    torch_executor.setOptimizer(torch_optimizer)
    torch_optimizer.param_groups[0]["weight_decay"] = 0.0
    with pytest.raises(poptorch.Error, match="weight_decay of group 0 changed from constant to variable"):
        torch_executor.setOptimizer(torch_optimizer)


def test_optimizer_state_is_read_from_the_device_and_survives_detach(poptorch_double):
    poptorch = poptorch_double
    model = Regressor()
    x, y = data(8)
    reference = eager_adamw(model, [[(x, y)], [(x, y)]], lr=0.1)
    optimizer = poptorch.optim.AdamW(model.parameters(), lr=0.1)
    executor = poptorch.trainingModel(model, optimizer=optimizer)
    executor(x, y)
    state = optimizer.state_dict()
    assert {"ipu_state", "ipu_param", "state", "param_groups"} <= set(state)
    assert torch.equal(state["ipu_state"]["step___linear.weight"], torch.tensor(1.0))
    assert state["state"] == {}  # the host optimizer itself never stepped
    executor.detachFromDevice()
    executor.attachToDevice()
    executor(x, y)
    executor.copyWeightsToHost()
    assert_same_weights(model, reference)
    with pytest.raises(RuntimeError, match="Only IPU optimizer states can be loaded onto the IPU."):
        optimizer.load_state_dict(torch.optim.AdamW(model.parameters(), lr=0.1).state_dict())


def test_a_loaded_ipu_state_is_written_to_the_device(poptorch_double):
    poptorch = poptorch_double
    model, resumed_model = Regressor(), Regressor()
    x, y = data(8)
    optimizer = poptorch.optim.AdamW(model.parameters(), lr=0.1)
    executor = poptorch.trainingModel(model, optimizer=optimizer)
    executor(x, y)
    executor.copyWeightsToHost()
    checkpoint = (copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict()))
    executor(x, y)
    executor.copyWeightsToHost()

    resumed_model.load_state_dict(checkpoint[0])
    resumed_optimizer = poptorch.optim.AdamW(resumed_model.parameters(), lr=0.1)
    resumed_optimizer.load_state_dict(checkpoint[1])
    resumed = poptorch.trainingModel(resumed_model, optimizer=resumed_optimizer)
    resumed(x, y)
    resumed.copyWeightsToHost()
    assert_same_weights(resumed_model, model)


def test_optimizer_signatures_are_poptorchs(poptorch_double):
    optim = poptorch_double.optim
    names = {cls: list(inspect.signature(cls.__init__).parameters)[1:] for cls in (optim.AdamW, optim.LAMB, optim.SGD)}
    assert names[optim.AdamW] == [
        "params", "lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable",
        "differentiable", "fused", "loss_scaling", "bias_correction", "accum_type",
        "first_order_momentum_accum_type", "second_order_momentum_accum_type", "max_grad_norm",
    ]  # fmt: skip
    assert names[optim.LAMB][-6:] == [
        "bias_correction", "loss_scaling", "max_weight_norm", "accum_type", "first_order_momentum_accum_type",
        "second_order_momentum_accum_type",
    ]  # fmt: skip
    assert names[optim.SGD][:2] == ["params", "lr"] and inspect.signature(optim.SGD).parameters["lr"].default is (
        inspect.Parameter.empty
    )
    adamw = optim.AdamW([nn.Parameter(torch.zeros(1))])
    assert isinstance(adamw, torch.optim.AdamW) and adamw.bias_correction and adamw.max_grad_norm == float("inf")
    assert adamw.defaults["weight_decay"] == 1e-2 and adamw.loss_scaling == 1.0
    with pytest.raises(AssertionError, match="Accumulation types must be either torch.float32 or torch.float16"):
        optim.AdamW([nn.Parameter(torch.zeros(1))], accum_type=torch.bfloat16)
    lamb = optim.LAMB([nn.Parameter(torch.zeros(1))])
    assert lamb.defaults == dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, max_weight_norm=65500.0)
    with pytest.raises(AssertionError, match="Unknown attribute nope"):
        lamb.variable_attrs.markAsVariable("nope")


# ---- the device and its IPU pool ----------------------------------------------------------------------------------
def test_attach_detach_destroy_errors(poptorch_double):
    poptorch = poptorch_double
    executor = poptorch.trainingModel(Regressor())
    for call in (executor.detachFromDevice, executor.attachToDevice, executor.copyWeightsToHost):
        with pytest.raises(poptorch.Error, match="Model has not been compiled or has been destroyed."):
            call()
    executor.destroy()  # a no-op before compilation, as poptorch
    executor(*data(2))
    assert executor.isCompiled() and executor.isAttachedToDevice()
    with pytest.raises(poptorch.Error, match="Device is already attached"):
        executor.attachToDevice()
    executor.detachFromDevice()
    with pytest.raises(poptorch.Error, match="Device is not attached"):
        executor.detachFromDevice()
    executor(*data(2))  # a call re-attaches implicitly
    assert executor.isAttachedToDevice()
    executor.destroy()
    assert not executor.isCompiled() and not executor.isAttachedToDevice()


def test_the_pool_refuses_a_second_executable_until_the_first_detaches(poptorch_double):
    poptorch = poptorch_double
    poptorch_double.system.num_ipus = 2
    model = Regressor()
    training = poptorch.trainingModel(model, poptorch.Options().replicationFactor(2))
    inference = poptorch.inferenceModel(model, poptorch.Options().replicationFactor(2))
    x, y = data(4)
    training(x, y)
    with pytest.raises(poptorch.Error, match=r"Failed to acquire 2 IPU\(s\).*trainingModel\(Regressor\)"):
        inference(x)
    training.detachFromDevice()
    inference(x)
    with pytest.raises(poptorch.Error, match=r"Failed to acquire 2 IPU\(s\)"):
        training(x, y)  # the implicit re-attach fails while inference holds the IPUs
    inference.destroy()
    training(x, y)
    assert poptorch_double.system.held_ipus() == 2


def test_ipu_counts_must_be_powers_of_two_unless_rounded(poptorch_double):
    poptorch = poptorch_double
    with pytest.raises(
        poptorch.Error, match="specifies the use of 3 IPUs, however PopTorch must reserve a minimum of 4"
    ):
        poptorch.inferenceModel(Regressor(), poptorch.Options().replicationFactor(3))(data(3)[0])
    rounded = poptorch.inferenceModel(Regressor(), poptorch.Options().replicationFactor(3).autoRoundNumIPUs())
    rounded(data(3)[0])
    assert poptorch_double.system.held_ipus() == 4
    del rounded  # a garbage-collected executable releases its IPUs
    assert poptorch_double.system.held_ipus() == 0
    poptorch_double.system.num_ipus = 2
    with pytest.raises(poptorch.Error, match="No device found on the system with 4 IPUs"):
        poptorch.inferenceModel(Regressor(), poptorch.Options().replicationFactor(4))(data(4)[0])


def test_offline_compilation(poptorch_double):
    poptorch = poptorch_double
    executor = poptorch.trainingModel(Regressor(), poptorch.Options().useOfflineIpuTarget())
    executor.compile(*data(2))
    assert executor.isCompiled() and not executor.isAttachedToDevice() and executor.compile_count == 1
    assert poptorch_double.system.held_ipus() == 0
    with pytest.raises(AssertionError, match=r"Trying to run a model on an offline device \(ConnectionType.Never\)"):
        executor(*data(2))
    with pytest.raises(AssertionError, match="Trying to attach to an offline device"):
        executor.attachToDevice()
    executor.compile(*data(2))  # ignored, with poptorch's warning
    assert executor.compile_count == 1


def test_inference_sees_the_training_weights_once_copied_to_host(poptorch_double):
    poptorch = poptorch_double
    model = Regressor()
    x, y = data(4)
    initial = model(x).detach()
    training = poptorch.trainingModel(model, optimizer=poptorch.optim.SGD(model.parameters(), lr=0.5))
    inference = poptorch.inferenceModel(model)
    training(x, y)
    assert torch.allclose(inference(x), initial, atol=ATOL)  # the trained weights are still on the device
    training.copyWeightsToHost()
    trained = inference(x)
    assert not torch.allclose(trained, initial, atol=1e-3)
    assert torch.allclose(trained, model(x).detach(), atol=ATOL)
