"""PEFT and TRL's trainers under torchrun, 2 processes (issue 47, items 1 and 4): a LoRA run of the Trainer with a
checkpoint, a resume from it and a resume from the other library's checkpoint (crossed), under DDP and under FSDP2
(``GPT2Block`` wrapped, sharded checkpoints), TRL's SFT with a LoRA ``peft_config`` and TRL's DPO; and the best model
of a whole tiny Llama loaded at the end with ``save_total_limit=1`` under DDP, FSDP2 (sharded; gathered on hflight's
side) and DeepSpeed ZeRO-3, and its checkpoints with ``save_only_model`` under the same three (issue 48, item 4).
Each on transformers (TRL on transformers) and on hflight (``hflight.trl``) in the same script
(tests/jobs/finetune_job.py): the same log history on every rank (losses, gradient norms, TRL's metrics summed over
both processes), the same trainable weights, the same best checkpoint and the same checkpoints kept."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from . import dropin, launch

pytest.importorskip("peft")
pytest.importorskip("trl")

JOB = launch.JOBS / "finetune_job.py"
#: transformers' FSDP route on the CPU (tests/test_sharded_dropin.py says why): for transformers' side only
STANDIN = launch.TESTS / "fsdp_standin"
RUNS = ("lora", "lora_resumed", "lora_crossed", "sft", "dpo", "best_ddp", "lora_fsdp", "lora_fsdp_resumed",
        "lora_fsdp_crossed", "best_fsdp_sharded", "best_zero3", "zero3_resumed", "only_model_ddp",
        "only_model_zero3")  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Both torchrun jobs at once (two processes each, one thread per process)."""
    root = tmp_path_factory.mktemp("finetune")
    env = {"transformers": launch.environment(STANDIN), "hflight": launch.environment()}
    jobs = {library: launch.Job([*launch.torchrun(2), JOB, root, library], root, env=env[library],
                                console=root / f"{library}.console.txt", timeout=480, name=library)
            for library in ("transformers", "hflight")}  # fmt: skip
    launch.all_ok(jobs)
    return root


def _result(root: Path, library: str, rank: int) -> dict:
    return json.loads((root / library / f"rank{rank}.json").read_text(encoding="utf-8"))


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("run", RUNS)
def test_every_rank_has_transformers_numbers_and_weights(runs, run):
    for rank in (0, 1):
        theirs, ours = _result(runs, "transformers", rank), _result(runs, "hflight", rank)
        assert ours["world_size"] == theirs["world_size"] == 2
        assert len([e for e in ours[run]["log_history"] if "loss" in e]) in (4, 8), rank
        assert ours[run]["log_history"] == theirs[run]["log_history"], rank
        assert ours[run]["weights"] == theirs[run]["weights"] and ours[run]["weights"], rank
        assert ours[run]["best"] == theirs[run]["best"], rank
        assert ours[run]["kept"] == theirs[run]["kept"], rank


@pytest.mark.subprocess
@pytest.mark.slow
def test_the_runs_are_data_parallel_and_the_resume_continues(runs):
    """Both processes train one run (an epoch of 64 rows at 2 per process is 16 steps), the resumed LoRA run logs the
    checkpoint's 4 steps and 4 more, as the uninterrupted run (its train_loss is that of its own 4, as in
    transformers), and both end with the best checkpoint's adapters (an early one: the weights are not the last)."""
    ours = _result(runs, "hflight", 0)
    assert ours["lora"]["log_history"][0]["epoch"] == 1 / 16
    for run in ("lora", "lora_fsdp"):
        steps = [[e for e in ours[name]["log_history"] if "loss" in e] for name in (run, f"{run}_resumed")]
        assert len(steps[0]) == 8 and steps[1] == steps[0]
        assert ours[run]["best"] == ours[f"{run}_resumed"]["best"] == "checkpoint-2"  # loaded at the end
    assert {p.name for p in (runs / "hflight" / "lora_fsdp" / "checkpoint-4").iterdir()} >= {
        "pytorch_model_fsdp_0", "optimizer_0"}  # fmt: skip


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_sharded_lora_checkpoint_holds_transformers_tensors_by_transformers_names(runs):
    """FSDP2's checkpoint-4 of the LoRA run: the model part is the active adapter by PEFT's names (no base, no
    adapter name: what accelerate writes with adapter_only), the optimizer's states by parameter name, every tensor
    transformers' bit for bit."""
    import torch

    read = {}
    for part, count in (("pytorch_model_fsdp_0", 4), ("optimizer_0", 12)):  # 4 adapter matrices; 3 states each
        theirs, ours = (dropin.distributed_checkpoint(runs / library / "lora_fsdp" / "checkpoint-4" / part)
                        for library in ("transformers", "hflight"))  # fmt: skip
        assert ours.keys() == theirs.keys() and len(ours) == count, part
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), part
        read[part] = ours
    assert "model.base_model.model.transformer.h.0.attn.c_attn.lora_A.weight" in read["pytorch_model_fsdp_0"]


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("library", ["transformers", "hflight"])
@pytest.mark.parametrize("run", ["lora", "lora_fsdp"])
def test_a_resume_from_the_other_library_s_checkpoint_is_the_own_resume(runs, library, run):
    """checkpoint-4 of the other library's LoRA run (DDP; FSDP2 sharded), resumed: the same log history (the
    checkpoint's steps and the 4 after them, losses and gradient norms), adapters and best checkpoint as the library's
    resume of its own checkpoint-4, on both ranks."""
    for rank in (0, 1):
        result = _result(runs, library, rank)
        own, crossed = result[f"{run}_resumed"], result[f"{run}_crossed"]
        assert len([e for e in crossed["log_history"] if "loss" in e]) == 8
        assert crossed["log_history"] == own["log_history"], rank
        assert crossed["weights"] == own["weights"] and crossed["weights"], rank
        assert crossed["best"] == own["best"] == "checkpoint-2", rank


def test_a_crossed_resume_names_the_other_job_when_its_checkpoint_does_not_come(tmp_path, monkeypatch):
    """The two jobs run at once: a crossed resume waits for the other job's marker, and says whose run it waited for
    when that job failed (at once) or the time ran out."""
    monkeypatch.syspath_prepend(str(launch.JOBS))
    import finetune_job

    monkeypatch.setattr(finetune_job, "WAIT_S", 1)
    timed_out = (r"hflight's crossed resume waited 1 s for transformers' lora run to finish "
                 r"\(no .*transformers/lora\.complete\): see transformers' console")  # fmt: skip
    with pytest.raises(TimeoutError, match=timed_out):
        finetune_job.other_checkpoint(tmp_path, "hflight", "lora")
    (tmp_path / "hflight").mkdir()
    (tmp_path / "hflight" / finetune_job.FAILED).write_text("")
    with pytest.raises(RuntimeError, match=r"transformers' crossed resume needs hflight's lora_fsdp run, but "
                                           r"hflight's job failed before it was complete"):  # fmt: skip
        finetune_job.other_checkpoint(tmp_path, "transformers", "lora_fsdp")
    (tmp_path / "hflight" / "lora_fsdp.complete").write_text("")
    assert finetune_job.other_checkpoint(tmp_path, "transformers", "lora_fsdp") == str(
        tmp_path / "hflight" / "lora_fsdp" / "checkpoint-4")  # fmt: skip


def _weights_file(checkpoint: Path) -> dict:
    """The whole model a checkpoint holds: its model.safetensors, else its FSDP shards (names without ``model.``)."""
    from safetensors.torch import load_file

    if (checkpoint / "model.safetensors").exists():
        return load_file(checkpoint / "model.safetensors")
    shards = dropin.distributed_checkpoint(checkpoint / "pytorch_model_fsdp_0")
    return {k.removeprefix("model."): v for k, v in shards.items()}


@pytest.mark.subprocess
@pytest.mark.slow
@pytest.mark.parametrize("run", ["best_ddp", "best_fsdp_sharded", "best_fsdp_full", "best_zero3"])
def test_the_best_checkpoint_of_a_sharded_run_is_kept_and_loaded_at_the_end(runs, run):
    """A whole tiny Llama (keys ``model.*``), evaluated and saved every 2 steps, ``save_total_limit=1``: the best
    checkpoint (checkpoint-2, the highest evaluation loss: not the last) is the one kept, and the weights the run ends
    with are that checkpoint's, element for element. FSDP2's (sharded and gathered) are DDP's to 1e-7 (bit for bit on
    an Intel Xeon with AVX-512; 7.5e-9 measured on an AVX2-only AMD EPYC, where the kernels updating FSDP2's per-rank
    shards round some last bits otherwise); ZeRO-3's
    are within 2e-5 of them (1.05e-5 measured: its gradients are reduced in another order, and two AdamW steps at
    1e-2 carry that). transformers' FSDP2 FULL_STATE_DICT save fails on the CPU: hflight's gathered run is compared
    with DDP (and so with the sharded run); the other runs equal transformers' (above)."""
    import torch

    ours = _result(runs, "hflight", 0)[run]
    assert ours["best"] == "checkpoint-2" and ours["kept"] == ["checkpoint-2"]
    saved = _weights_file(runs / "hflight" / run / "checkpoint-2")
    assert len(saved) == len(ours["weights"]) >= 20
    for name, values in ours["weights"].items():
        assert torch.tensor(values).equal(saved[name].flatten().float()), name
    tolerance = 2e-5 if run == "best_zero3" else (1e-7 if run.startswith("best_fsdp") else 0)
    for name, values in _result(runs, "hflight", 0)["best_ddp"]["weights"].items():
        assert torch.allclose(torch.tensor(ours["weights"][name]), torch.tensor(values), rtol=0, atol=tolerance), name


@pytest.mark.subprocess
@pytest.mark.slow
def test_save_only_model_checkpoints_hold_the_whole_model_alone_as_transformers(runs):
    """``save_only_model`` (4 steps of the Llama, checkpoints at 2 and 4): under DDP and ZeRO-3 each checkpoint holds
    transformers' files, no optimizer, scheduler or DeepSpeed state, and the same ``model.safetensors`` bit for bit
    (ZeRO-3's gathered from its partitions); FSDP2's gathered form (hflight's side: transformers' FULL_STATE_DICT save
    fails on the CPU) writes DDP's files and weights within 1e-7 (on an Intel Xeon with AVX-512 bit for bit at step 2
    and 7.5e-9 at step 4; on an AVX2-only AMD EPYC 7.5e-9 and 3.2e-8: FSDP2 reduces in another order)."""
    import torch
    from safetensors.torch import load_file

    def files(library: str, run: str, step: int) -> set[str]:
        return {p.name for p in (runs / library / run / f"checkpoint-{step}").iterdir()} - dropin.HFLIGHT_ONLY

    for step in (2, 4):
        for run in ("only_model_ddp", "only_model_zero3"):
            assert files("hflight", run, step) == files("transformers", run, step), (run, step)
            ours, theirs = (load_file(runs / lib / run / f"checkpoint-{step}" / "model.safetensors")
                            for lib in ("hflight", "transformers"))  # fmt: skip
            assert ours.keys() == theirs.keys() and all(ours[k].equal(theirs[k]) for k in ours), (run, step)
        assert files("hflight", "only_model_fsdp_full", step) == files("hflight", "only_model_ddp", step)
        gathered, ddp = (load_file(runs / "hflight" / run / f"checkpoint-{step}" / "model.safetensors")
                         for run in ("only_model_fsdp_full", "only_model_ddp"))  # fmt: skip
        assert gathered.keys() == ddp.keys(), step
        for key in ddp:
            torch.testing.assert_close(gathered[key], ddp[key], rtol=0, atol=1e-7, msg=key)
    held = files("hflight", "only_model_zero3", 2)
    assert "model.safetensors" in held and not {"optimizer.pt", "scheduler.pt", "latest"} & held
    assert not any(name.startswith(("global_step", "rng_state", "pytorch_model_fsdp", "optimizer")) for name in held)


# ---- FSDP2's sharded LoRA checkpoint as transformers writes and reads it (one process, accelerate's own code) -------
def _accelerate_fsdp2():
    """accelerate's FSDP2 plugin and accelerator as its ``save_fsdp_model``/``load_fsdp_model`` read them, for a
    sharded state dict written and read by this process alone."""
    from types import SimpleNamespace

    from torch.distributed.fsdp import StateDictType

    plugin = SimpleNamespace(state_dict_type=StateDictType.SHARDED_STATE_DICT, fsdp_version=2,
                             state_dict_config=SimpleNamespace(offload_to_cpu=False, rank0_only=False))  # fmt: skip
    accelerator = SimpleNamespace(wait_for_everyone=lambda: None, process_index=0, num_processes=1, is_fsdp2=True)
    return plugin, accelerator


@pytest.fixture
def _plain_accelerate_logger(monkeypatch):
    """accelerate's FSDP functions log through a logger that needs accelerate's process state: a plain one here."""
    import logging

    from accelerate.utils import fsdp_utils

    monkeypatch.setattr(fsdp_utils, "logger", logging.getLogger("accelerate.utils.fsdp_utils"))


def _trained_lora():
    """A LoRA GPT-2 whose adapters moved from their start (lora_B starts at zero) and its optimizer."""
    import torch

    from tests.tiny_lm import gpt2, lora

    model = lora(gpt2())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 57, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return model, optimizer


def _adapters(model) -> dict:
    return {k: v.detach().clone() for k, v in model.named_parameters() if "lora_" in k}


@pytest.mark.usefixtures("_plain_accelerate_logger")
def test_hflight_reads_the_sharded_lora_checkpoint_transformers_writes(tmp_path):
    """transformers saves a PEFT model's FSDP2 sharded state with accelerate's ``save_fsdp_model(...,
    adapter_only=True)``: the active adapter by PEFT's names (``...lora_A.weight``), no base weights. hflight loads it
    into the model's adapter (resume and best model); it used to refuse it ('missing keys [...wte.weight ...];
    unexpected keys [...lora_A.weight ...]')."""
    import torch
    from accelerate.utils.fsdp_utils import save_fsdp_model

    from hflight.checkpoints.weights import load_model_weights
    from tests.tiny_lm import gpt2, lora

    trained, _ = _trained_lora()
    save_fsdp_model(*_accelerate_fsdp2(), trained, tmp_path, adapter_only=True)
    fresh = lora(gpt2())
    base = {k: v.clone() for k, v in fresh.state_dict().items() if "lora_" not in k}
    load_model_weights(fresh, tmp_path, resuming=True)
    expected, loaded = _adapters(trained), _adapters(fresh)
    assert expected.keys() == loaded.keys() and all(torch.equal(expected[k], loaded[k]) for k in expected)
    assert any(v.abs().sum() > 0 for k, v in loaded.items() if "lora_B" in k)  # not the zeros lora_B starts at
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in base.items())


@pytest.mark.usefixtures("_plain_accelerate_logger")
def test_hflight_writes_the_sharded_lora_checkpoint_transformers_reads(tmp_path):
    """hflight's SHARDED_STATE_DICT checkpoint of a PEFT model holds what accelerate's ``load_fsdp_model(...,
    adapter_only=True)`` reads (transformers' resume and best model): before, hflight wrote the whole model by its own
    names and accelerate failed ('Missing key in checkpoint state_dict: model.base_model...lora_A.weight')."""
    import torch
    from accelerate.utils.fsdp_utils import load_fsdp_model

    from hflight.checkpoints.forms import ShardedState
    from hflight.checkpoints.sharded import tensor_shapes
    from tests.tiny_lm import gpt2, lora

    trained, optimizer = _trained_lora()
    ShardedState().write(str(tmp_path), trained, optimizer, is_main=True)
    assert all(".default." not in k and "lora_" in k for k in tensor_shapes(tmp_path / "pytorch_model_fsdp_0", "model"))
    fresh = lora(gpt2())
    load_fsdp_model(*_accelerate_fsdp2(), fresh, tmp_path, adapter_only=True)
    expected, loaded = _adapters(trained), _adapters(fresh)
    assert expected.keys() == loaded.keys() and all(torch.equal(expected[k], loaded[k]) for k in expected)


@pytest.mark.usefixtures("_plain_accelerate_logger")
def test_a_sharded_adapter_of_another_shape_is_refused_naming_the_folder(tmp_path):
    from accelerate.utils.fsdp_utils import save_fsdp_model

    from hflight.checkpoints.weights import load_model_weights
    from tests.tiny_lm import gpt2, lora

    save_fsdp_model(*_accelerate_fsdp2(), lora(gpt2(), r=8), tmp_path, adapter_only=True)
    refusal = (r"pytorch_model_fsdp_0 does not match the model's adapter 'default': shapes "
               r"\[.*lora_A.weight: \[8, 32\] in the file, \[4, 32\] in the model")  # fmt: skip
    with pytest.raises(ValueError, match=refusal):
        load_model_weights(lora(gpt2()), tmp_path, resuming=True)


@pytest.mark.subprocess
@pytest.mark.slow
def test_a_zero3_llama_resumes_from_its_best_checkpoint_as_the_uninterrupted_run(runs):
    """The ZeRO-3 Llama resumed from checkpoint-2 (DeepSpeed's module states by the Llama's own names: resuming
    failed with the same missing "model.model..." keys as the best-model load): its steps 3-8 and evaluations are the
    uninterrupted run's, bit for bit, and it ends with the same best weights (transformers' resume: the same, above)."""
    for rank in (0, 1):
        result = _result(runs, "hflight", rank)
        runs_steps = [[e for e in result[name]["log_history"] if "loss" in e or "eval_loss" in e]
                      for name in ("best_zero3", "zero3_resumed")]  # fmt: skip
        assert len(runs_steps[0]) == 12 and runs_steps[1] == runs_steps[0], rank
        assert result["zero3_resumed"]["weights"] == result["best_zero3"]["weights"], rank
