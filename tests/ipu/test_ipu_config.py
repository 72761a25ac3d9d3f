"""IPUConfig: optimum-graphcore's fields, defaults, validation, file format, and poptorch.Options in its order."""

from __future__ import annotations

import json

import pytest
import torch

from hflight.ipu import IncompatibleIPUConfigError, IPUConfig

# Graphcore's published IPU config for bert-base (Graphcore/bert-base-ipu on the Hub), as optimum-graphcore 1.x wrote
# it: includes a deprecated key and optimum's version stamp.
GRAPHCORE_BERT_BASE = {
    "device_iterations": 1,
    "embedding_serialization_factor": 2,
    "enable_half_first_order_momentum": True,
    "enable_half_partials": True,
    "executable_cache_dir": "./exe_cache",
    "gradient_accumulation_steps": 512,
    "inference_device_iterations": 4,
    "inference_replication_factor": 4,
    "ipus_per_replica": 4,
    "layers_per_ipu": [0, 4, 4, 4],
    "matmul_proportion": [0.1, 0.15, 0.15, 0.15],
    "optimizer_state_offchip": True,
    "optimum_version": "1.0.0",
    "output_mode": "final",
    "recompute_checkpoint_every_layer": True,
    "replicated_tensor_sharding": True,
    "replication_factor": 4,
    "seed": 42,
}


def test_defaults_are_optimum_graphcores():
    config = IPUConfig()
    assert (config.replication_factor, config.gradient_accumulation_steps, config.device_iterations) == (1, 1, 1)
    assert config.layers_per_ipu == [-1] and config.inference_layers_per_ipu == [-1]
    assert config.ipus_per_replica == 1 and config.inference_ipus_per_replica == 1
    assert config.matmul_proportion == 0.2 and config.inference_matmul_proportion == 0.2
    assert config.output_mode == "final" and config.enable_half_partials is True
    assert config.embedding_serialization_factor == 1 and config.inference_projection_serialization_factor == 1
    assert config.parallelize_kwargs == {} and config.executable_cache_dir == ""


def test_derived_inference_defaults():
    assert IPUConfig(layers_per_ipu=[1, 2, 3]).ipus_per_replica == 3
    config = IPUConfig(layers_per_ipu=[1, 2, 3, 4], matmul_proportion=[0.1, 0.2, 0.3, 0.4])
    assert config.inference_matmul_proportion == [0.1, 0.2, 0.3, 0.4]
    config = IPUConfig(
        layers_per_ipu=[1, 2, 3, 4], matmul_proportion=[0.1, 0.2, 0.3, 0.4], inference_layers_per_ipu=[3, 7]
    )
    assert config.inference_ipus_per_replica == 2 and config.inference_matmul_proportion == 0.2
    assert IPUConfig(ipus_per_replica=10).inference_ipus_per_replica == 10


def test_batch_size_factor():
    config = IPUConfig(
        replication_factor=2, gradient_accumulation_steps=8, device_iterations=4, inference_replication_factor=3,
        inference_device_iterations=5,
    )  # fmt: skip
    assert config.batch_size_factor() == 64 and config.batch_size_factor(for_inference=True) == 15


def test_modes_switch_the_inference_variants():
    config = IPUConfig(layers_per_ipu=[2, 2], inference_layers_per_ipu=[4], matmul_proportion=[0.1, 0.2])
    assert config.train()._layers_per_ipu == [2, 2] and config._ipus_per_replica == 2
    assert config.eval()._layers_per_ipu == [4] and config._ipus_per_replica == 1
    config._layers_per_ipu = [5]  # writes the inference field in inference mode
    assert config.inference_layers_per_ipu == [5] and config.layers_per_ipu == [2, 2]
    with pytest.raises(ValueError, match="mode"):
        config.mode = "testing"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"replication_factor": 0}, "replication_factor must be >= 1"),
        ({"layers_per_ipu": [2, -2]}, "layers_per_ipu must be >= -1"),
        ({"output_mode": "every"}, "output_mode must be one of"),
        ({"gradient_accumulation_steps": 2.0}, "gradient_accumulation_steps must be int"),
        ({"enable_half_partials": "yes"}, "enable_half_partials must be bool"),
        ({"serialized_embedding_splits_per_ipu": [3, 0, 2, 0], "ipus_per_replica": 4}, "consecutive"),
    ],
)
def test_invalid_values_name_the_field(kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        IPUConfig(**kwargs)


def test_incoherent_values_and_unknown_keys():
    with pytest.raises(IncompatibleIPUConfigError, match=r"matmul_proportion=\[0.1, 0.2\].*ipus_per_replica=3"):
        IPUConfig(layers_per_ipu=[1, 1, 1], matmul_proportion=[0.1, 0.2])
    with pytest.raises(IncompatibleIPUConfigError, match="inference_layers_per_ipu=.*inference_ipus_per_replica=2"):
        IPUConfig(inference_layers_per_ipu=[1, 1, 1], inference_ipus_per_replica=2)
    with pytest.raises(IncompatibleIPUConfigError, match="replication_factr=2"):
        IPUConfig(replication_factr=2)
    with pytest.raises(ValueError, match="Only one of `embedding_serialization_factor`"):
        IPUConfig(embedding_serialization_factor=2, serialized_embedding_splits_per_ipu=[1], ipus_per_replica=1)
    config = IPUConfig()
    with pytest.raises(ValueError, match="device_iterations must be >= 1"):
        config.device_iterations = 0  # assignments are checked too


def test_graphcore_published_config_round_trips(tmp_path):
    folder = tmp_path / "bert-base-ipu"
    folder.mkdir()
    (folder / "ipu_config.json").write_text(json.dumps(GRAPHCORE_BERT_BASE))
    with pytest.warns(FutureWarning, match="enable_half_first_order_momentum"):
        config = IPUConfig.from_pretrained(folder)
    assert config.layers_per_ipu == [0, 4, 4, 4] and config.ipus_per_replica == 4
    assert config.gradient_accumulation_steps == 512 and config.inference_replication_factor == 4
    assert config.embedding_serialization_factor == 2 and config.seed == 42
    assert config.batch_size_factor() == 4 * 512 and config.batch_size_factor(for_inference=True) == 16
    saved = tmp_path / "saved"
    config.save_pretrained(saved)
    written = json.loads((saved / "ipu_config.json").read_text())
    for key, value in GRAPHCORE_BERT_BASE.items():
        if key not in ("enable_half_first_order_momentum", "optimum_version"):
            assert written[key] == value, key
    assert IPUConfig.from_pretrained(saved) == config
    overridden = IPUConfig.from_pretrained(saved / "ipu_config.json", executable_cache_dir="elsewhere")
    assert overridden.executable_cache_dir == "elsewhere"


def test_bad_files_name_the_file_and_key(tmp_path):
    bad = tmp_path / "ipu_config.json"
    bad.write_text(json.dumps({"replication_factor": 1, "layers_per_ipux": [1]}))
    with pytest.raises(IncompatibleIPUConfigError, match=rf"{bad}.*layers_per_ipux"):
        IPUConfig.from_pretrained(bad)
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=rf"{bad} is not valid JSON"):
        IPUConfig.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="has no ipu_config.json"):
        IPUConfig.from_pretrained(tmp_path / "..")


def test_update_from_string():
    config = IPUConfig(layers_per_ipu=[1, 1])
    config.update_from_string("device_iterations=4,gradient_accumulation_steps=64,matmul_proportion=[0.1 0.3]")
    config.update_from_string("recompute_checkpoint_every_layer=true,seed=7,output_mode=all")
    assert (config.device_iterations, config.gradient_accumulation_steps) == (4, 64)
    assert config.matmul_proportion == [0.1, 0.3] and config.recompute_checkpoint_every_layer and config.seed == 7
    with pytest.raises(ValueError, match="'device_iteration' is not an IPUConfig field"):
        config.update_from_string("device_iteration=2")
    with pytest.raises(ValueError, match="expected true or false"):
        config.update_from_string("replicated_tensor_sharding=maybe")


def _expected_option_calls(config: IPUConfig, for_inference: bool) -> list[str]:
    """optimum-graphcore's `IPUConfig._to_options`, call by call (names only, in order)."""
    calls = ["autoRoundNumIPUs", "replicationFactor", "deviceIterations"]
    if not for_inference:
        calls += ["Training.gradientAccumulation", "Training.accumulationAndReplicationReductionType"]
        if config.auto_loss_scaling:
            calls.append("Training.setAutomaticLossScaling")
    calls += ["outputMode", "randomSeed", "TensorLocations.setOptimizerLocation", "setExecutionStrategy"]
    calls += ["setAvailableMemoryProportion", "enableExecutableCaching", "_Popart.set"]  # saveInitializersToFile
    calls += ["Precision.enableStochasticRounding", "Precision.setPartialsType"]
    calls += ["_Popart.set"] * 6 + ["_Popart.setPatterns"]
    if for_inference and config.explicit_ir_inference:
        calls.append("_Popart.set")
    return calls + ["_Popart.set"]  # engineOptions


@pytest.mark.parametrize("for_inference", [False, True])
def test_options_in_optimum_graphcores_order(poptorch_double, tmp_path, for_inference):
    config = IPUConfig(
        replication_factor=2, inference_replication_factor=4, gradient_accumulation_steps=8, device_iterations=3,
        inference_device_iterations=5, layers_per_ipu=[1, 1], matmul_proportion=[0.1, 0.3], seed=11,
        auto_loss_scaling=True, executable_cache_dir=str(tmp_path / "cache"), explicit_ir_inference=True,
        optimizer_state_offchip=True, replicated_tensor_sharding=True, output_mode="sum",
    )  # fmt: skip
    opts = config.to_options(for_inference=for_inference)
    calls = [name for name, _ in opts.calls]
    expected = _expected_option_calls(config, for_inference)
    # the settings nested in setOptimizerLocation's TensorLocationSettings are recorded on that object, not here
    assert [c for c in calls if not c.startswith("TensorLocationSettings")] == expected
    assert opts.replication_factor == (4 if for_inference else 2)
    assert opts.device_iterations == (5 if for_inference else 3)
    assert opts.Training.gradient_accumulation == (1 if for_inference else 8)
    modes = poptorch_double.OutputMode
    assert opts.output_mode == (modes.All if for_inference else modes.Sum).value
    assert opts.random_seed == 11
    assert opts.available_memory_proportion == {0: 0.1, 1: 0.3}  # poptorch keys "IPU0"... by index
    popart = dict(args for name, args in opts.calls if name == "_Popart.set")
    assert popart["accumulateOuterFragmentSettings.schedule"] == 3  # PopART's OverlapMemoryOptimized
    assert popart["subgraphCopyingStrategy"] == 1  # PopART's JustInTime
    assert ("enableExplicitIR" in popart) is for_inference
    assert config.mode == "training"  # building options does not leave the config in another mode


def test_options_need_mk2_hardware_unless_compiling_offline(poptorch_double):
    poptorch_double.system.ipu_version = 1
    with pytest.raises(RuntimeError, match="IPU Mk2"):
        IPUConfig().to_options()
    opts = IPUConfig(enable_half_partials=False).to_options(compile_only=True)
    assert opts.connection_type == poptorch_double.ConnectionType.Never.value
    assert "Precision.setPartialsType" not in [name for name, _ in opts.calls]
    assert torch.float16  # partials only with enable_half_partials
