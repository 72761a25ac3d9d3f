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
    assert IPUConfig.modes == ("training", "inference")  # optimum-graphcore's class attribute
    assert config.train()._layers_per_ipu == [2, 2] and config._ipus_per_replica == 2
    assert config.eval()._layers_per_ipu == [4] and config._ipus_per_replica == 1
    config._layers_per_ipu = [5]  # writes the inference field in inference mode
    assert config.inference_layers_per_ipu == [5] and config.layers_per_ipu == [2, 2]
    assert config._get_managed_attr_mode_name("layers_per_ipu") == "inference_layers_per_ipu"
    assert config._get_managed_attr_mode_name("seed") == "seed"  # no inference variant
    with pytest.raises(ValueError) as raised:
        config.mode = "testing"
    assert str(raised.value) == (
        "`IPUConfig` mode can only take values in ('training', 'inference'). You provided: value='testing'. "
        "Use the `train` and `eval` methods instead to avoid error."
    )


def test_a_subclass_validates_in_its_own_modes():
    """optimum-graphcore's validation loops over ``self.modes``: a subclass that adds a mode gets it accepted and
    checked (a mode other than inference reads the training fields)."""

    class ThreeModes(IPUConfig):
        modes = ("training", "inference", "compile")

    config = ThreeModes(layers_per_ipu=[1, 1])
    config.mode = "compile"
    assert config._layers_per_ipu == [1, 1]
    with pytest.raises(ValueError, match="mode can only take values in"):
        IPUConfig().mode = "compile"


# optimum-graphcore's messages, word for word (scripts and tests match on them).
@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"replication_factor": 0}, ValueError,
         "`IPUConfig` attribute `replication_factor` must be >= 1. You provided value=0"),
        ({"layers_per_ipu": [2, -2]}, ValueError,
         "`IPUConfig` attribute `layers_per_ipu` must have all elements >= -1. You provided value=[2, -2]"),
        ({"output_mode": "every"}, ValueError, "`IPUConfig` attribute `output_mode` can only take values in "
         "('all', 'sum', 'final', 'default'). You provided: value='every'"),
        ({"gradient_accumulation_steps": 2.0}, TypeError, "Setting `IPUConfig` attribute: gradient_accumulation_steps, "
         "type: <class 'int'> with value=2.0, type: <class 'float'> is invalid."),
        ({"enable_half_partials": "yes"}, TypeError, "Setting `IPUConfig` attribute: enable_half_partials, type: "
         "<class 'bool'> with value='yes', type: <class 'str'> is invalid."),
        ({"replication_factor": 2.0}, ValueError,
         "replication_factor must be of type `int`. You provided: replication_factor=2.0, <class 'float'>."),
        ({"serialized_embedding_splits_per_ipu": [3, 0, 2, 0], "ipus_per_replica": 4}, ValueError,
         "`IPUConfig` attribute `serialized_embedding_splits_per_ipu=[3, 0, 2, 0]` must have its splits on "
         "consecutive IPUs."),
        ({"serialized_projection_splits_per_ipu": [0, 0]}, ValueError,
         "`IPUConfig` attribute `serialized_projection_splits_per_ipu=[0, 0]` must have atleast 1 split on 1 IPU."),
    ],
)  # fmt: skip
def test_invalid_values_raise_optimum_graphcores_errors(kwargs, error, message):
    with pytest.raises(error) as raised:
        IPUConfig(**kwargs)
    assert str(raised.value) == message


@pytest.mark.parametrize(
    "field",
    [
        "serialized_embedding_splits_per_ipu", "inference_serialized_embedding_splits_per_ipu",
        "serialized_projection_splits_per_ipu", "inference_serialized_projection_splits_per_ipu",
    ],
)  # fmt: skip
def test_negative_splits_are_rejected(field):
    """[2, -1] sums to 1 split and passed the old checks; optimum-graphcore requires every entry >= 0."""
    with pytest.raises(ValueError) as raised:
        IPUConfig(**{field: [2, -1], "layers_per_ipu": [1, 1]})
    assert (
        str(raised.value) == f"`IPUConfig` attribute `{field}` must have all elements >= 0. You provided value=[2, -1]"
    )
    config = IPUConfig(layers_per_ipu=[1, 1])
    with pytest.raises(ValueError, match="must have all elements >= 0"):
        setattr(config, field, [-1, 3])  # assignments are checked too


def test_incoherent_values_and_unknown_keys():
    with pytest.raises(IncompatibleIPUConfigError, match=r"matmul_proportion=\[0.1, 0.2\].*ipus_per_replica=3"):
        IPUConfig(layers_per_ipu=[1, 1, 1], matmul_proportion=[0.1, 0.2])
    with pytest.raises(IncompatibleIPUConfigError, match="inference_layers_per_ipu=.*inference_ipus_per_replica=2"):
        IPUConfig(inference_layers_per_ipu=[1, 1, 1], inference_ipus_per_replica=2)
    with pytest.raises(IncompatibleIPUConfigError) as raised:
        IPUConfig(replication_factr=2)
    assert str(raised.value) == "IPUConfig received unknown arguments:\n  replication_factr=2"
    with pytest.raises(ValueError, match="Only one of `embedding_serialization_factor`"):
        IPUConfig(embedding_serialization_factor=2, serialized_embedding_splits_per_ipu=[1], ipus_per_replica=1)
    config = IPUConfig()
    with pytest.raises(ValueError, match="`device_iterations` must be >= 1"):
        config.device_iterations = 0  # assignments are checked too


def test_model_config_keys_are_ignored_as_optimum_graphcore_does(tmp_path):
    """An ipu_config.json saved with model-config keys (optimum-graphcore's IPUConfig is a PretrainedConfig) loads;
    the keys are dropped, any other unknown key still raises."""
    (tmp_path / "ipu_config.json").write_text(
        json.dumps({"device_iterations": 2, "return_dict": True, "architectures": ["BertForQuestionAnswering"],
                    "num_beams": 1, "torchscript": False, "transformers_version": "4.29.2"})
    )  # fmt: skip
    config = IPUConfig.from_pretrained(tmp_path)
    assert config.device_iterations == 2 and "return_dict" not in config.to_dict()
    assert not hasattr(config, "return_dict")
    assert IPUConfig(output_hidden_states=True) == IPUConfig()
    with pytest.raises(IncompatibleIPUConfigError, match="unknown arguments:\n  device_iteration=2"):
        IPUConfig(device_iteration=2, return_dict=True)


def test_from_pretrained_accepts_use_auth_token(tmp_path, monkeypatch):
    """optimum-graphcore's run_qa.py passes use_auth_token=; a Hub download hands it on as the token."""
    IPUConfig(device_iterations=3).save_pretrained(tmp_path)
    assert (
        IPUConfig.from_pretrained(tmp_path, cache_dir=None, revision="main", use_auth_token=None).device_iterations == 3
    )
    calls = []

    def download(repo_id, filename, **kwargs):
        calls.append((repo_id, filename, kwargs["token"], kwargs["revision"]))
        return str(tmp_path / "ipu_config.json")

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    config = IPUConfig.from_pretrained("Graphcore/bert-base-ipu", revision="main", use_auth_token="hf_x")
    assert config.device_iterations == 3
    assert calls == [("Graphcore/bert-base-ipu", "ipu_config.json", "hf_x", "main")]


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
    with pytest.raises(IncompatibleIPUConfigError, match=rf"(?s){bad}.*layers_per_ipux"):
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
    with pytest.raises(ValueError, match="Key device_iteration isn't in the original config dict"):
        config.update_from_string("device_iteration=2")
    with pytest.raises(ValueError, match=r"Can't derive true or false from maybe \(key replicated_tensor_sharding\)"):
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
