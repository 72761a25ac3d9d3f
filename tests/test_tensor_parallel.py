"""Tensor parallelism from transformers' plans (issue 48, part 2; 2-D and checkpoints as far as transformers' own
loading goes): a tiny Llama loaded with ``from_pretrained(MODEL, tp_plan="auto")`` under torchrun (DTensor weights on
transformers' mesh, gloo on this CPU) trains on hflight's ``TensorParallelStrategy`` and equals the same model trained
in one plain process, step for step; so does the 2-D layout transformers builds for
``DistributedConfig(tp_size=2, fsdp_size=2)`` on 4 processes (FSDP2 across, TP inside). Their checkpoints are torch
distributed checkpoints, resumed on one process (the Mixtral's, below), on 2 data-parallel (DDP) processes (2 x 2's)
and on HSDP x TP (TP-2's, on ``DistributedConfig(tp_size=2, dp_replicate_size=2)``) with the uninterrupted run's
losses.
With ``save_only_model`` (what transformers requires to save a model it sharded at load time) the checkpoints are the
whole model, gathered by transformers' ``save_pretrained`` on every process.

Tolerance (measured, float32): losses and gradient norms 2e-6 relative, final weights 1e-4 absolute (measured: 1.6e-5
after 4 steps at lr 1e-2), predictions 1e-4 (measured 1e-5). Jobs: ``tests/jobs/tp_job.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hflight.arguments import strategies
from hflight.sharding.tensor_parallel import check_layout

from . import launch

JOB = launch.JOBS / "tp_job.py"

LOSS_RTOL, WEIGHT_ATOL = 2e-6, 1e-4


def _start(out: Path, processes: int, *options: str) -> launch.Job:
    out.mkdir(parents=True)
    launcher = launch.torchrun(processes) if processes > 1 else [sys.executable]
    return launch.Job([*launcher, JOB, out, *options], out, console=out.parent / f"{out.name}.console.txt", timeout=420)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """TP-2 (torchrun, 2 processes; its processes then train TP-2 again with the best checkpoint kept and loaded at the
    end, with ``save_only_model``: tp2_only_model), 2 x 2 (4 processes) and the one-process run at once;
    then the resumes at once: TP-2's checkpoint-2 on HSDP x TP (4 processes:
    ``DistributedConfig(tp_size=2, dp_replicate_size=2)``), 2 x 2's on 2 DDP processes. A tiny Mixtral (packed
    expert weights) on TP-2, and its checkpoint resumed on one process, beside them.

    Not run, each proved by a job above through the same code: a tensor-parallel checkpoint on one process (the
    Mixtral's, whose attention is sharded as the Llama's, plus its packed experts: moe_tp2_on_1) and on DDP (2 x 2's,
    DTensor shards over both mesh dimensions: 2x2_on_ddp2), each as the Llama's TP-2 one would be; a 4-process DDP
    resume (the same reshard onto whole tensors as on 2)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    root = tmp_path_factory.mktemp("tensor_parallel")
    model, moe = root / "model", ["--model", str(root / "mixtral")]  # (a second --model is the one argparse takes)
    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**sizes)).save_pretrained(model)
    torch.manual_seed(0)
    MixtralForCausalLM(MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **sizes)).save_pretrained(moe[1])
    phases = [
        {"tp2": (2, "--tp", "--then-best", str(root / "tp2_only_model")), "one": (1,),
         "2x2": (4, "--fsdp", "2", "--batch", "2", "--parallelism-config"), "moe_tp2": (2, "--tp", *moe)},
        {"tp2_on_hsdp": (4, "--replicate", "2", "--batch", "2", "--resume", str(root / "tp2" / "checkpoint-2")),
         "2x2_on_ddp2": (2, "--batch", "2", "--resume", str(root / "2x2" / "checkpoint-2")),
         "moe_tp2_on_1": (1, *moe, "--resume", str(root / "moe_tp2" / "checkpoint-2"))},
    ]  # fmt: skip
    for phase in phases:
        started = {name: _start(root / name, n, "--model", str(model), *options) for name, (n, *options) in
                   phase.items()}  # fmt: skip
        launch.all_ok(started)
    names = [name for phase in phases for name in phase] + ["tp2_only_model"]
    results = {name: json.loads((root / name / "result.json").read_text()) for name in names}
    return {"root": root, "results": results}


def _steps(result: dict) -> list[tuple[int, float, float]]:
    return [(e["step"], e["loss"], e["grad_norm"]) for e in result["log_history"] if "loss" in e]


def _same_steps(run: dict, reference: dict, after: int = 0) -> None:
    steps = [s for s in _steps(run) if s[0] > after]
    expected = [s for s in _steps(reference) if s[0] > after]
    assert [s[0] for s in steps] == [s[0] for s in expected] == list(range(after + 1, 5))
    for (step, loss, norm), (_, loss_ref, norm_ref) in zip(steps, expected):
        assert loss == pytest.approx(loss_ref, rel=LOSS_RTOL), step
        assert norm == pytest.approx(norm_ref, rel=LOSS_RTOL), step


def _weights(runs: dict, name: str) -> dict:
    return torch.load(runs["root"] / name / "weights.pt")


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp2", "2x2"])
def test_a_tensor_parallel_run_equals_the_one_process_run_step_for_step(runs, name):
    """Losses and (clipped: max_grad_norm 0.5 is below every step's norm) gradient norms per step, the final whole
    weights and the gathered predictions of TP-2 (2 processes, one data-parallel replica) and of 2 x 2 (FSDP2 across
    2 replicas, TP inside; loaded with DistributedConfig(tp_size=2, fsdp_size=2) and trained with
    parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2), as a transformers user sets both) equal the
    one-process run's: no DDP over DTensors, the batch per data-parallel replica,
    the norm over the whole model, predictions gathered per replica (6 rows, not one per process), as tensors and as
    pickled objects (``eval_use_gather_object``)."""
    run, one = runs["results"][name], runs["results"]["one"]
    assert (run["world_size"], run["tp_size"], run["sharded"]) == ({"tp2": 2, "2x2": 4}[name], 2, True)
    # transformers' attributes: sharded at load time, so not placed by the Trainer
    assert run["loaded_sharded"] == [True, False] and one["loaded_sharded"] == [False, True]
    # transformers' (dp_shard_size, tp_size): built from the model for TP-2, the arguments' (checked) for 2 x 2
    assert run["parallelism_config"] == {"tp2": [1, 2], "2x2": [2, 2]}[name] and one["parallelism_config"] is None
    # trainer.accelerator.gather: every process's rows, as accelerate's (the loop's gathers are per replica, above)
    assert run["accelerator_gather"] == list(range(run["world_size"])) and one["accelerator_gather"] == [0]
    # trainer.accelerator.clip_grad_norm_ after the loop's clipping: the whole model's norm, max_grad_norm
    assert run["accelerator_norms"] == pytest.approx([0.5] * 4, rel=1e-5) == one["accelerator_norms"]
    # counted over every process, as transformers' gathers count them: each tensor-parallel copy of a batch (tp = 2)
    assert run["tokens_seen"] == 2 * one["tokens_seen"] == 2 * 4 * 4 * 12
    assert run["total_flos"] == pytest.approx(2 * one["total_flos"], rel=1e-6) and one["total_flos"] > 0
    assert run["total_train_batch_size"] == one["total_train_batch_size"] == 4
    assert all(norm > 0.5 for _, _, norm in _steps(one))  # every step clips
    _same_steps(run, one)
    weights, reference = _weights(runs, name), _weights(runs, "one")
    assert sorted(weights["weights"]) == sorted(reference["weights"])
    for key, value in reference["weights"].items():
        torch.testing.assert_close(weights["weights"][key], value, atol=WEIGHT_ATOL, rtol=0, msg=key)
    assert weights["predictions"].shape == reference["predictions"].shape == (6, 12, 64)
    torch.testing.assert_close(weights["predictions"], reference["predictions"], atol=WEIGHT_ATOL, rtol=0)
    torch.testing.assert_close(weights["pickled"], reference["predictions"], atol=WEIGHT_ATOL, rtol=0)


@pytest.mark.subprocess
@pytest.mark.slow
def test_tp2_evaluation_is_gathered_once_per_replica(runs):
    """TP-2 is one data-parallel replica: its eval loss is the one-process run's (each tensor-parallel rank's copy of
    the batch counted once)."""
    tp2, one = runs["results"]["tp2"], runs["results"]["one"]
    assert tp2["eval"]["eval_loss"] == pytest.approx(one["eval"]["eval_loss"], rel=LOSS_RTOL)


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize(("resumed", "trained"), [("tp2_on_hsdp", "tp2"), ("2x2_on_ddp2", "2x2")])
def test_a_tensor_parallel_checkpoint_resumes_on_another_layout_with_the_same_losses(runs, resumed, trained):
    """checkpoint-2 of TP-2 (and of 2 x 2) is torch distributed checkpoint shards in hflight's manifest, and resumed
    on HSDP x TP (FSDP2's replicas across, TP inside: 2 replicas of TP-2) or on 2 DDP processes (2 x 2's) steps 3 and
    4 have the uninterrupted run's losses and norms. HSDP x TP is one more layout trained: transformers' Trainer gives
    accelerate its 2 replicas as dp_shard_size (accelerate refuses TP with replicas alone), and so does hflight's
    ``trainer.accelerator.parallelism_config``. A tensor-parallel checkpoint on one process:
    test_a_mixture_of_experts_with_packed_weights_trains_and_resumes_on_one_process, below."""
    run = runs["results"][resumed]
    if resumed == "tp2_on_hsdp":
        assert (run["world_size"], run["tp_size"], run["sharded"]) == (4, 2, True)
        assert run["parallelism_config"] == [2, 2, 1]  # dp_shard_size, tp_size, dp_replicate_size
        assert run["tokens_seen"] == 2 * runs["results"]["one"]["tokens_seen"]
    else:  # DDP: whole tensors on every process
        assert (run["world_size"], run["tp_size"], run["sharded"]) == (2, 1, False)
    folder = runs["root"] / trained / "checkpoint-2"
    manifest = json.loads((folder / "checkpoint_manifest.json").read_text())
    listed = json.dumps(manifest)
    assert (folder / "pytorch_model_fsdp_0" / ".metadata").is_file() and "pytorch_model_fsdp_0" in listed
    assert (folder / "optimizer_0" / ".metadata").is_file() and "optimizer_0" in listed
    _same_steps(run, runs["results"][trained], after=2)


def _tp_model(tp: int, mesh: tuple[int, ...] | None) -> SimpleNamespace:
    return SimpleNamespace(_tp_size=tp, _device_mesh=None if mesh is None else SimpleNamespace(shape=mesh))


def test_a_layout_the_launch_cannot_hold_is_refused_naming_both_numbers():
    with pytest.raises(ValueError, match=r"mesh spans 2 processes \(tp_size=2\), but this run has 4"):
        check_layout(_tp_model(2, (1, 1, 2)), 4)
    with pytest.raises(ValueError, match=r"tp_size=3 does not divide the run's 4 processes"):
        check_layout(_tp_model(3, None), 4)
    assert check_layout(_tp_model(2, (1, 2, 2)), 4) == 2


@pytest.mark.parametrize("setting", ["fsdp", "deepspeed", "strategy"])
def test_a_tensor_parallel_model_refuses_a_second_wrapping_naming_it(setting):
    """A model loaded tensor-parallel would be wrapped or sharded again by fsdp, deepspeed or another strategy:
    refused before any process group starts, naming the setting."""
    args = SimpleNamespace(fsdp=[], deepspeed=None, parallelism_config=None, save_async=False)
    strategy = "ddp" if setting == "strategy" else "auto"
    if setting != "strategy":
        setattr(args, setting, "set")
    with pytest.raises(ValueError, match=rf"tp_size=2.*{setting} would wrap or shard it again"):
        strategies.strategy_from_args(strategy, args, _tp_model(2, (1, 1, 2)))


def test_save_async_with_a_tensor_parallel_model_is_refused_before_training():
    """Every process writes a tensor-parallel checkpoint together (a collective): not in the background. Refused when
    the strategy is chosen, naming it, where the checkpoint writer would refuse it at the first checkpoint."""
    from accelerate import ParallelismConfig

    import hflight

    args = hflight.TrainingArguments("o", report_to="none", use_cpu=True, devices=2, save_async=True,
                                     parallelism_config=ParallelismConfig(tp_size=2))  # fmt: skip
    with pytest.raises(ValueError, match=r"save_async=True cannot be combined with a model loaded tensor-parallel "
                                         r"\(tp_size=2\)"):  # fmt: skip
        strategies.strategy_from_args("auto", args, _tp_model(2, (1, 1, 2)))
    args.save_async = False
    assert strategies.strategy_from_args("auto", args, _tp_model(2, (1, 1, 2))).tp_size == 2


def _loaded(tp: int, fsdp: int = 1, replicate: int = 1) -> SimpleNamespace:
    """A stand-in for a model from_pretrained(distributed_config=DistributedConfig(tp_size, fsdp_size)) loaded."""
    layout = SimpleNamespace(fsdp_size=fsdp, dp_replicate_size=replicate)
    return SimpleNamespace(_tp_size=tp, _device_mesh=SimpleNamespace(shape=(1, fsdp, tp)),
                           config=SimpleNamespace(distributed_config=layout))  # fmt: skip


def test_parallelism_config_with_tp_size_takes_the_layout_the_model_was_loaded_with():
    """parallelism_config(dp_shard_size, tp_size) beside a model transformers loaded with the same sizes is accepted
    (the 2 x 2 run above trains that way); a config that says otherwise is refused before any process group starts,
    naming both numbers: tp_size against the model's (or a model not loaded tensor-parallel), the sizes' product
    against the run's processes, the data-parallel sizes against the model's."""
    from accelerate import ParallelismConfig

    check = strategies.check_tensor_parallel_config
    assert check(ParallelismConfig(dp_shard_size=2, tp_size=2), _loaded(2, fsdp=2), 4) is None
    assert check(ParallelismConfig(tp_size=2), _loaded(2), 2) is None
    assert check(ParallelismConfig(dp_shard_size=2), None, 2) is None  # no tensor parallelism: FSDP2's to check
    with pytest.raises(ValueError, match=r"tp_size=4, but the model was loaded with tp_size=2"):
        check(ParallelismConfig(dp_shard_size=1, tp_size=4), _loaded(2, fsdp=2), 4)
    with pytest.raises(ValueError, match=r"tp_size=1, but the model was loaded with tp_size=2"):
        check(ParallelismConfig(dp_shard_size=2), _loaded(2, fsdp=2), 4)
    with pytest.raises(
        ValueError,
        match=r"tp_size=2, but the model was not loaded tensor-parallel.*"
        r"DistributedConfig\(tp_size=2, fsdp_size=2\)",
    ):
        check(ParallelismConfig(dp_shard_size=2, tp_size=2), _loaded(1), 4)
    with pytest.raises(ValueError, match=r"1 x 3 x 2 = 6, but the run has 4 processes"):
        check(ParallelismConfig(dp_shard_size=3, tp_size=2), _loaded(2, fsdp=2), 4)
    with pytest.raises(ValueError, match=r"dp_shard_size=2, but the model was loaded with fsdp_size=1"):
        check(ParallelismConfig(dp_shard_size=2, tp_size=2), _loaded(2, replicate=2), 4)
    with pytest.raises(ValueError, match=r"dp_replicate_size=1, but the model was loaded with dp_replicate_size=2"):
        check(ParallelismConfig(dp_shard_size=1, tp_size=2), _loaded(2, replicate=2), 2)


def test_parallelism_config_refusals_reach_the_strategy_and_the_arguments():
    """Through the arguments: tp_size is taken when they are built and the 2 x 2 model trains on the tensor-parallel
    strategy; a model not loaded tensor-parallel under parallelism_config(tp_size=2) is refused when the strategy is
    chosen; cp_size and sp_size are refused at once, saying what they need (torch's context parallelism has no
    sharding rule for the CPU's attention kernel)."""
    from accelerate import ParallelismConfig

    import hflight
    from hflight.sharding.tensor_parallel import TensorParallelStrategy

    config = ParallelismConfig(dp_shard_size=2, tp_size=2)
    args = hflight.TrainingArguments("o", report_to="none", use_cpu=True, devices=4, parallelism_config=config)
    with pytest.raises(ValueError, match=r"tp_size=2, but the model was not loaded tensor-parallel"):
        strategies.strategy_from_args("auto", args, torch.nn.Linear(2, 2))
    strategy = strategies.strategy_from_args("auto", args, _loaded(2, fsdp=2))
    assert isinstance(strategy, TensorParallelStrategy) and strategy.tp_size == 2
    for size in ("cp_size", "sp_size"):
        with pytest.raises(
            ValueError,
            match=rf"(?s)parallelism_config=.*{size}=2.*cp_size > 1 needs torch's context "
            r"parallelism .*CPU's attention kernel.*sp_size > 1 needs DeepSpeed's",
        ):
            hflight.TrainingArguments("o", report_to="none", parallelism_config=ParallelismConfig(**{size: 2}))


def _deepspeed_checkpoint(folder: Path) -> Path:
    """A folder in DeepSpeed's form (``latest`` naming ``global_step2/``), with a trainer state and a scheduler."""
    from transformers import TrainerState

    (folder / "global_step2").mkdir(parents=True)
    (folder / "latest").write_text("global_step2")
    (folder / "scheduler.pt").write_bytes(b"")
    TrainerState(global_step=2).save_to_json(str(folder / "trainer_state.json"))
    return folder


def test_a_checkpoint_a_tensor_parallel_run_cannot_reshard_is_refused_naming_both_layouts(tmp_path):
    """DeepSpeed's ZeRO partitions (read by its engine alone) resumed by a model loaded tensor-parallel: refused before
    anything is loaded, naming DeepSpeed's form and the run's tensor-parallel layout (the arguments alone would say a
    one-process run); the other way round a tensor-parallel checkpoint in a DeepSpeed run names it too. The forms
    hflight reshards (one process/DDP, FSDP2's gathered or sharded, another tensor-parallel layout's) pass."""
    from transformers import TrainerState

    from hflight.checkpoints import forms, resume

    folder = _deepspeed_checkpoint(tmp_path / "checkpoint-2")
    facade = SimpleNamespace(args=SimpleNamespace(output_dir=str(tmp_path), fsdp=[], deepspeed=None),
                             state=TrainerState(), model=_tp_model(2, (1, 1, 2)))  # fmt: skip
    with pytest.raises(
        ValueError,
        match=r"(?s)holds DeepSpeed's own checkpoint.*this run \(tensor-parallel, "
        r"tp_size=2: .*\) writes a SHARDED_STATE_DICT checkpoint.*Only DeepSpeed's",
    ):
        resume._resume_from(facade, folder, None)
    plain = forms.resume_refusal(facade.args, None, forms.DeepSpeedState, folder)
    assert plain is not None and "this run writes a one-process/DDP checkpoint" in plain
    for written in (forms.ProcessZeroState, forms.GatheredState, forms.ShardedState):
        assert forms.resume_refusal(facade.args, facade.model, written, folder) is None
    refused = forms.DeepSpeedState.refusal(forms.ShardedState, folder)
    assert refused is not None and "holds a SHARDED_STATE_DICT checkpoint (FSDP2's or a tensor-parallel" in refused


@pytest.mark.subprocess
@pytest.mark.slow
def test_tp2_save_only_model_writes_the_whole_model_and_loads_the_best_of_it(runs):
    """``load_best_model_at_end`` with ``save_total_limit=1`` and ``save_only_model`` under TP-2, as a transformers
    user writes a tensor-parallel script (transformers saves a model sharded at load time only with
    ``save_only_model``): the same best checkpoint (step 2's, the highest evaluation loss) and the same checkpoints
    kept as the one-process run, the same steps; each checkpoint is the whole model gathered from the shards
    (``model.safetensors``, no optimizer, no DTensor shards, the manifest saying so), the best one loaded back into
    the shards at the end: the one-process run's best weights, not the last step's; ``trainer.save_model()`` then
    writes them whole (every process calls it: transformers' ``save_pretrained`` gathers a model it sharded). A best
    checkpoint of hflight's own tensor-parallel form (DTensor shards) loads as a resume reads one onto a
    tensor-parallel model (``checked_weights``: TP-2's checkpoint resumed on HSDP x TP, above)."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    run = runs["results"]["tp2_only_model"]
    assert run["tp_size"] == 2 and run["sharded"] and run["best"] == "checkpoint-2"
    assert run["kept"] == ["checkpoint-2"]  # the best alone at the end, as transformers (test_finetune_torchrun's)
    folder = runs["root"] / "tp2_only_model" / "checkpoint-2"
    assert json.loads((folder / "checkpoint_manifest.json").read_text())["save_only_model"] is True
    assert not {"optimizer_0", "pytorch_model_fsdp_0", "optimizer.pt", "scheduler.pt"} & set(
        p.name for p in folder.iterdir()
    )
    _same_steps(run, runs["results"]["one"])
    # the one-process run's weights after step 2 (its checkpoint-2's model file)
    reference = load_file(runs["root"] / "one" / "checkpoint-2" / "model.safetensors")
    saved, best = load_file(folder / "model.safetensors"), _weights(runs, "tp2_only_model")["weights"]
    # trainer.save_model() after training: the best weights, whole, as the model's own from_pretrained reads them
    final = LlamaForCausalLM.from_pretrained(runs["root"] / "tp2_only_model" / "final").state_dict()
    assert saved.keys() == best.keys() == reference.keys() == final.keys()
    for key in reference:
        for weights in (best, saved, final):
            torch.testing.assert_close(weights[key], reference[key], rtol=0, atol=WEIGHT_ATOL, msg=key)
    # steps 3-4 moved the weights by up to 7.5e-3 (Adam at the decaying rates 5e-3, 2.5e-3): far beyond the tolerance
    last = _weights(runs, "tp2")["weights"]
    assert max((best[key] - last[key]).abs().max() for key in last) > 10 * WEIGHT_ATOL


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_mixture_of_experts_with_packed_weights_trains_and_resumes_on_one_process(runs):
    """A tiny Mixtral on TP-2: its experts' fused ``gate_up_proj`` is sharded in strides (transformers'
    ``packed_colwise``: each process holds its part of the gate and of the up projection), which torch's distributed
    checkpoint cannot write as shards ("overlapping chunks"): hflight writes those tensors whole. transformers gives
    the replicated router its own parameter group beside the DTensors (3 groups, where one process has 2), so the
    checkpoint's groups are mapped to the resuming run's by parameter name. Its checkpoint-2 resumed on one process
    gives the uninterrupted run's steps 3 and 4 and its final weights (gathered from the strided shards). (TP-2's
    training equals one process's for the Llama, above: the Mixtral's new risk was its checkpoints.) This is also the
    suite's tensor-parallel checkpoint resumed on one process: the Mixtral's attention is sharded as the Llama's
    (colwise q/k/v, rowwise o), so the Llama's TP-2 checkpoint on one process would read through the same code."""
    run, resumed = runs["results"]["moe_tp2"], runs["results"]["moe_tp2_on_1"]
    assert (run["world_size"], run["tp_size"], run["sharded"]) == (2, 2, True)
    assert (resumed["world_size"], resumed["sharded"]) == (1, False)
    _same_steps(resumed, run, after=2)
    folder = runs["root"] / "moe_tp2" / "checkpoint-2"
    assert len(torch.load(folder / "scheduler.pt", weights_only=True)["base_lrs"]) == 3
    assert len(torch.load(runs["root"] / "moe_tp2_on_1" / "checkpoint-4" / "scheduler.pt")["base_lrs"]) == 2
    weights, reference = _weights(runs, "moe_tp2")["weights"], _weights(runs, "moe_tp2_on_1")["weights"]
    assert weights.keys() == reference.keys() and any("gate_up_proj" in key for key in reference)
    for key, value in reference.items():
        torch.testing.assert_close(weights[key], value, atol=WEIGHT_ATOL, rtol=0, msg=key)
