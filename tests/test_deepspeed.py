"""DeepSpeed as transformers runs it (issue 35, items 2 and 3): transformers' run_clm.py under ``torchrun
--nproc_per_node=2 ... --use_cpu --deepspeed ds_config.json`` (ZeRO-2, every value ``"auto"``, gradient accumulation 2,
clipping at 1.0), and with the trainer import changed to hflight's under DeepSpeed's own launcher (``deepspeed
--num_gpus 2 run_clm.py ...``, which passes ``--local_rank``: issue 40, recognised like torchrun): the same losses,
gradient norms, learning rates, metrics, files, weights, scheduler, RNG states and DeepSpeed partitions, bit for bit;
hflight then resumes transformers' ``checkpoint-5`` under torchrun and ends as transformers' run (transformers resuming
hflight's would read the same files: the checkpoints are the same bit for bit).

transformers' own DeepSpeed route runs on this CPU for ZeRO 1-2 with ``--use_cpu`` (its DeepSpeed engine on gloo).
ZeRO-3 does not get that far with transformers' arguments on the CPU: ``from_pretrained`` builds the model inside
``deepspeed.zero.Init`` before DeepSpeed's processes are connected (transformers connects them for DeepSpeed only off
the CPU), so its batch-size check sees one process. hflight's arguments connect them (as transformers does on GPUs):
ZeRO-3 runs with ``from hflight import Trainer, TrainingArguments`` (tests/test_sharding.py: against FSDP2, resumed).
Bad configs are refused before any process group starts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import hflight
from hflight.arguments import lightning_kwargs
from hflight.arguments import strategies as strategy_settings

from . import dropin, launch

ZERO2 = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
         "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}  # fmt: skip
ARGS = [
    "--block_size", "16", "--do_train", "--do_eval", "--use_cpu",
    "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "4", "--gradient_accumulation_steps", "2",
    "--learning_rate", "2e-3", "--num_train_epochs", "2", "--logging_steps", "1",
    "--eval_strategy", "epoch", "--save_steps", "5",
]  # fmt: skip


def _job(folder: Path, library: str, args: list[str], launcher: list[str] = dropin.TORCHRUN_2) -> dropin.Job:
    changed = None if library == "transformers" else dropin.CHANGED_IMPORT
    return dropin.Job(folder, "run_clm", dropin.ORIGINAL_IMPORT, changed, args, launcher=launcher)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepspeed")
    inputs = dropin.clm_inputs(root / "inputs")
    config = root / "ds_config.json"
    config.write_text(json.dumps(ZERO2))
    args = ["--model_name_or_path", str(inputs["model"]), "--train_file", str(inputs["train"]),
            "--validation_file", str(inputs["validation"]), *ARGS, "--deepspeed", str(config)]  # fmt: skip
    deepspeed = [str(Path(sys.executable).with_name("deepspeed")), "--num_gpus", "2", "--master_port",
                 str(launch.free_port())]  # fmt: skip
    first = {"transformers": _job(root / "transformers", "transformers", args),
             "hflight": _job(root / "hflight", "hflight", args, launcher=deepspeed)}  # fmt: skip
    outs = {name: job.out() for name, job in first.items()}
    # hflight continues transformers' checkpoint-5 (the other way round is transformers reading its own files: the
    # two trainers' checkpoints are the same bit for bit, test_zero2_under_deepspeeds_launcher_...)
    resumed = [*args, "--resume_from_checkpoint", str(outs["transformers"] / "checkpoint-5")]
    outs["hflight_from_transformers"] = _job(root / "hflight_from_transformers", "hflight", resumed).out()
    return outs


@pytest.mark.subprocess
@pytest.mark.slow
def test_zero2_under_deepspeeds_launcher_is_transformers_deepspeed_bit_for_bit(runs):
    both = {"transformers": runs["transformers"], "hflight": runs["hflight"]}
    manifest = json.loads((runs["hflight"] / "checkpoint-5" / "checkpoint_manifest.json").read_text(encoding="utf-8"))
    assert manifest["run"]["world_size"] == 2  # both processes DeepSpeed's launcher started trained as one run
    console = (runs["transformers"].parent / "console.txt").read_text()
    assert "DDP constructor" not in console and (runs["transformers"] / "checkpoint-5" / "global_step5").is_dir()
    dropin.assert_same_results(both, ("eval_results.json", "train_results.json", "all_results.json"))
    dropin.assert_same_log_history(both, min_losses=8)  # the engine's gradient norm, clipped in the engine
    dropin.assert_same_files(both)  # global_stepN/, latest, zero_to_fp32.py, the model files beside them
    # weights (the model files of the run and of each checkpoint), scheduler, RNG and trainer states, and DeepSpeed's
    # own partitions: parameter names, fp32 master weights and Adam's moments of every process
    assert dropin.assert_same_training_state(both) >= 2 * 8 + 2


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize(("continued", "original"), [("hflight_from_transformers", "transformers")])
def test_hflight_continues_transformers_deepspeed_checkpoint(runs, continued, original):
    resumed = {"transformers": runs[original], "hflight": runs[continued]}
    history = [dropin.read_json(p / "trainer_state.json")["log_history"] for p in resumed.values()]
    timing = ("_runtime", "_per_second", "train_loss")  # train_loss: over the resumed call's steps, as transformers
    assert [{k: v for k, v in e.items() if not k.endswith(timing)} for e in history[0]] == [
        {k: v for k, v in e.items() if not k.endswith(timing)} for e in history[1]]  # fmt: skip
    from safetensors.torch import load_file

    ours, theirs = (load_file(p / "model.safetensors") for p in resumed.values())
    assert ours.keys() == theirs.keys() and all(ours[k].equal(theirs[k]) for k in ours)


# ---- bad configs, refused before any process group starts -----------------------------------------------------------
def _refused(config, message: str, tmp_path: Path) -> None:
    if isinstance(config, str):
        path = tmp_path / "ds_config.json"
        path.write_text(config)
        config = str(path)
    with pytest.raises(ValueError, match=message):
        args = hflight.TrainingArguments("o", report_to="none", use_cpu=True, deepspeed=config)
        strategy_settings.deepspeed_strategy(args)


def test_an_invalid_deepspeed_json_is_named_with_its_position(tmp_path):
    _refused('{"zero_optimization": {"stage": 2},\n  "gradient_clipping": }', r"ds_config\.json is not valid JSON: "
             r"Expecting value at line 2 column 24", tmp_path)  # fmt: skip


@pytest.mark.parametrize("stage", [4, -1, "2", True])
def test_a_zero_stage_out_of_range_is_refused(stage, tmp_path):
    _refused({"zero_optimization": {"stage": stage}}, r"zero_optimization\.stage must be one of 0, 1, 2, 3", tmp_path)


def test_deepspeed_s_own_optimizer_and_fsdp_beside_it_are_refused(tmp_path):
    _refused({**ZERO2, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}, r"optimizer \('optimizer'\) choose "
             r"DeepSpeed's own optimizer/schedule", tmp_path)  # fmt: skip
    with pytest.raises(ValueError, match="fsdp and deepspeed and strategy='auto' each choose"):
        hflight.TrainingArguments("o", fsdp=True, deepspeed=dict(ZERO2))


def test_save_only_model_with_load_best_model_at_end_is_refused_as_transformers_refuses_it():
    """transformers' Trainer.__init__ refusal, word for word (the best checkpoint would hold no DeepSpeed state);
    hflight used to train and then load the best checkpoint's whole weights into the partitioned model."""
    args = hflight.TrainingArguments("o", report_to="none", use_cpu=True, deepspeed=dict(ZERO2), save_only_model=True,
                                     load_best_model_at_end=True, eval_strategy="steps", save_steps=2,
                                     eval_steps=2)  # fmt: skip
    with pytest.raises(ValueError, match=r"DeepSpeed can't be used with `save_only_model` along with "
                                         r"`load_best_model_at_end`\."):  # fmt: skip
        strategy_settings.deepspeed_strategy(args)
    strategy_settings.deepspeed_strategy(
        hflight.TrainingArguments("o", report_to="none", use_cpu=True, deepspeed=dict(ZERO2), save_only_model=True)
    )


def test_a_model_whose_own_names_start_with_model_loads_from_a_deepspeed_checkpoint():
    """DeepSpeed reads a checkpoint's module states (by the model's own names, as transformers writes them) into its
    engine's module, hflight's module whose ``model`` is the transformers model: a Llama's ``model.embed_tokens...``
    is ``model.model.embed_tokens...`` there. It used to be taken for a name that had the prefix already
    ('Missing key(s) in state_dict: "model.model.embed_tokens.weight"' at load_best_model_at_end and resume under
    ZeRO-3; a GPT-2, ``transformer.*``, loaded). hflight's older checkpoints, by the engine module's names, still
    load."""
    import torch
    import transformers

    from hflight.checkpoints.forms import _load_as_engine_module

    def llama():
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=16))  # fmt: skip

    torch.manual_seed(0)
    saved = llama().state_dict()
    assert any(k.startswith("model.") for k in saved) and any(not k.startswith("model.") for k in saved)
    engine_module = torch.nn.Module()
    engine_module.model = llama()  # other weights (drawn after the first)
    _load_as_engine_module(saved, engine_module)
    assert all(torch.equal(v, engine_module.model.state_dict()[k]) for k, v in saved.items())
    # hflight's older checkpoints named the module state by the engine module's names: they still load
    engine_module.model = llama()
    _load_as_engine_module({"model." + k: v for k, v in saved.items()}, engine_module)
    assert all(torch.equal(v, engine_module.model.state_dict()[k]) for k, v in saved.items())


def test_deepspeed_takes_gradient_accumulation_as_transformers(factory):
    """transformers passes gradient_accumulation_steps to the engine; hflight's strategy keeps it in the config
    (Lightning's own refuses it there)."""
    args = hflight.TrainingArguments("o", report_to="none", use_cpu=True, gradient_accumulation_steps=4,
                                     deepspeed=dict(ZERO2))  # fmt: skip
    strategy = lightning_kwargs.strategy_for(args, factory.cls_model())
    assert strategy.config["gradient_accumulation_steps"] == 4
    strategy._format_batch_size_and_grad_accum_config()  # what Lightning calls before building the engine
    assert strategy.config["gradient_accumulation_steps"] == 4


def test_deepspeed_not_installed_is_named_with_the_install_command(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else find_spec(name, *a)
    )
    with pytest.raises(
        ModuleNotFoundError, match=r'needs DeepSpeed, which is not installed: pip install "hflight\[deepspeed\]"'
    ):
        hflight.TrainingArguments("o", report_to="none", deepspeed=dict(ZERO2))
