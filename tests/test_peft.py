"""PEFT adapters on hflight's Trainer, beside transformers' Trainer: the same losses and gradient norms per step, the
same adapter weights and checkpoint files, and each resuming from the other's checkpoints; several adapters,
``modules_to_save``, ``save_only_model``, ``load_best_model_at_end``, ``save_async``, gradient checkpointing with the
base frozen and NEFTune on a PEFT model (issue 47, item 1; one process)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

import hflight
from hflight.checkpoints.manifest import verify_checkpoint

from .support import HFLIGHT_ONLY

peft = pytest.importorskip("peft")

LIBRARIES = {"hf": (transformers.Trainer, transformers.TrainingArguments),
             "hl": (hflight.Trainer, hflight.TrainingArguments)}  # fmt: skip


def lora_model(
    seed: int = 0, second_adapter: str | None = None, adapter_name: str = "default", **lora
) -> torch.nn.Module:
    """A tiny GPT-2 with LoRA on its attention (``lora``: more of LoraConfig's fields) as adapter ``adapter_name``;
    ``second_adapter``: a second adapter "other", and the adapter then active ("default" or "other")."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)  # fmt: skip
    base = transformers.GPT2LMHeadModel(config)
    model = peft.get_peft_model(base, peft.LoraConfig(**{"r": 4, "target_modules": ["c_attn"], **lora},
                                                      task_type="CAUSAL_LM"), adapter_name=adapter_name)  # fmt: skip
    if second_adapter:
        model.add_adapter("other", peft.LoraConfig(r=2, target_modules=["c_attn"], task_type="CAUSAL_LM"))
        model.set_adapter(second_adapter)
    return model


def tokens(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [{"input_ids": row, "labels": row} for row in torch.randint(0, 64, (n, 16), generator=generator)]


def make(lib: str, out: Path, model=None, **overrides):
    trainer_cls, args_cls = LIBRARIES[lib]
    values = dict(per_device_train_batch_size=4, max_steps=8, save_steps=4, logging_steps=1, learning_rate=1e-2,
                  seed=0, report_to="none", disable_tqdm=True, dataloader_pin_memory=False)  # fmt: skip
    values.update(overrides)
    args = args_cls(str(out), **values)
    return trainer_cls(model if model is not None else lora_model(), args, train_dataset=tokens(64, 1),
                       eval_dataset=tokens(16, 2))  # fmt: skip


def logged(trainer, *keys: str) -> list[tuple]:
    return [tuple(e[k] for k in keys) for e in trainer.state.log_history if keys[0] in e]


def adapter_weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}


def adapter_state(model) -> tuple:
    """The active adapter(s), each adapter's ``inference_mode`` and the names of the parameters that train."""
    modes = {name: config.inference_mode for name, config in model.peft_config.items()}
    return model.active_adapters, modes, sorted(k for k, v in model.named_parameters() if v.requires_grad)


def files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:3]


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    """A LoRA run of 8 steps, a checkpoint every 4, with each library."""
    root = tmp_path_factory.mktemp("lora")
    runs = {}
    for lib in LIBRARIES:
        trainer = make(lib, root / lib)
        trainer.train()
        runs[lib] = root / lib, logged(trainer, "loss", "grad_norm"), adapter_weights(trainer.model)
    return runs


def test_a_lora_run_gives_transformers_losses_grad_norms_adapters_and_files(lora_runs):
    (hf_out, hf_logs, hf_weights), (hl_out, hl_logs, hl_weights) = lora_runs["hf"], lora_runs["hl"]
    assert len(hl_logs) == 8 and hl_logs == hf_logs
    assert_same_weights(hl_weights, hf_weights)
    for step in (4, 8):
        theirs, ours = files(hf_out / f"checkpoint-{step}"), files(hl_out / f"checkpoint-{step}")
        assert "adapter_model.safetensors" in theirs and "model.safetensors" not in theirs
        assert ours == sorted([*theirs, *HFLIGHT_ONLY])
        assert verify_checkpoint(hl_out / f"checkpoint-{step}", full=True) is not None
        saved = [load_file(out / f"checkpoint-{step}" / "adapter_model.safetensors") for out in (hf_out, hl_out)]
        assert_same_weights(*saved)


@pytest.mark.parametrize("checkpoint_of", ["hf", "hl"])
def test_a_lora_run_resumes_from_either_library_s_checkpoint_as_transformers_does(lora_runs, tmp_path, checkpoint_of):
    """Each library resumes from ``checkpoint_of``'s checkpoint-4 (the adapters loaded, the optimizer's state matched
    to the trainable parameters): steps 5 to 8 as the uninterrupted run, in both."""
    folder = lora_runs[checkpoint_of][0] / "checkpoint-4"
    for lib in LIBRARIES:
        trainer = make(lib, tmp_path / lib)
        trainer.train(resume_from_checkpoint=str(folder))
        assert logged(trainer, "loss", "grad_norm")[4:] == lora_runs["hf"][1][4:], lib
        assert_same_weights(adapter_weights(trainer.model), lora_runs["hf"][2])


def test_an_adapter_that_does_not_fit_is_refused_naming_the_file_and_leaves_the_model_alone(lora_runs, tmp_path):
    trainer = make("hl", tmp_path, model=lora_model(r=8))
    before = adapter_weights(trainer.model)
    with pytest.raises(ValueError, match=r"adapter_model\.safetensors does not match the model's adapter 'default'.*"
                                         r"shapes"):  # fmt: skip
        trainer.train(resume_from_checkpoint=str(lora_runs["hl"][0] / "checkpoint-4"))
    assert_same_weights(adapter_weights(trainer.model), before)


LM_HEAD = dict(modules_to_save=["lm_head"])


@pytest.mark.parametrize(("written", "resumed", "keys"), [({}, LM_HEAD, "missing"), (LM_HEAD, {}, "unexpected")])
def test_an_adapter_file_without_or_with_the_model_s_other_modules_is_refused_naming_it_and_its_keys(
    tmp_path, written, resumed, keys
):
    """``modules_to_save`` (the lm_head trained beside the adapter) on one side only, resumed with save_only_model (no
    optimizer state to disagree first): the adapter file lacks the model's lm_head (PEFT would load the rest and say
    nothing) or holds one the model lacks (PEFT's bare KeyError); both are refused naming the file and the keys,
    before anything is loaded: the model bit for bit as it was."""
    make("hl", tmp_path / "run", model=lora_model(**written), max_steps=2, save_steps=2, save_only_model=True).train()
    trainer = make("hl", tmp_path / "resumed", model=lora_model(**resumed), save_only_model=True)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    weights = tmp_path / "run" / "checkpoint-2" / "adapter_model.safetensors"
    lm_head = re.escape("['base_model.model.lm_head.weight']")
    with pytest.raises(
        ValueError, match=rf"{re.escape(str(weights))} does not match .* 'default': {keys} keys {lm_head}"
    ):
        trainer.train(resume_from_checkpoint=str(weights.parent))
    after = trainer.model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_a_checkpoint_of_adapters_is_refused_for_a_model_without_them(lora_runs, tmp_path):
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2,
                                                                 n_head=2))  # fmt: skip
    trainer = make("hl", tmp_path, model=plain)
    with pytest.raises(ValueError, match="holds PEFT adapters .* is not a PEFT model"):
        trainer.train(resume_from_checkpoint=str(lora_runs["hl"][0] / "checkpoint-4"))


def _compare(tmp_path, model_kwargs=None, resume_at=4, **overrides) -> dict[str, tuple]:
    """Each library's run with ``overrides``, then resumed from its own ``checkpoint-{resume_at}``: their logs,
    adapters and checkpoint files must agree."""
    results = {}
    for lib in LIBRARIES:
        trainer = make(lib, tmp_path / lib, model=lora_model(**(model_kwargs or {})), **overrides)
        trainer.train()
        resumed = make(lib, tmp_path / lib, model=lora_model(**(model_kwargs or {})), **overrides)
        resumed.train(resume_from_checkpoint=str(tmp_path / lib / f"checkpoint-{resume_at}"))
        results[lib] = (logged(trainer, "loss", "grad_norm"), logged(resumed, "loss", "grad_norm"),
                        adapter_weights(trainer.model), adapter_weights(resumed.model), trainer,
                        adapter_state(trainer.model), adapter_state(resumed.model))  # fmt: skip
    (hf_logs, hf_resumed, hf_w, hf_rw, *_, hf_s, hf_rs) = results["hf"]
    (hl_logs, hl_resumed, hl_w, hl_rw, *_, hl_s, hl_rs) = results["hl"]
    assert hl_logs == hf_logs and hl_resumed == hf_resumed
    assert hl_s == hf_s and hl_rs == hf_rs  # the active adapter, each one's inference_mode and what trains
    assert_same_weights(hl_w, hf_w)
    assert_same_weights(hl_rw, hf_rw)
    theirs = files(tmp_path / "hf" / f"checkpoint-{resume_at}")
    ours = [*HFLIGHT_ONLY] if not overrides.get("save_only_model") else ["checkpoint_manifest.json"]  # no data position
    assert files(tmp_path / "hl" / f"checkpoint-{resume_at}") == sorted([*theirs, *ours])
    return results


def test_several_adapters_the_active_one_trained_resume_as_in_transformers(tmp_path):
    """A second adapter, active: save_pretrained writes it in its own subfolder; a resume loads both, the active one
    trainable, and sets it active again: the same active adapter, inference modes and trainable parameters as
    transformers' after the same resume."""
    results = _compare(tmp_path, model_kwargs=dict(second_adapter="other"))
    active, modes, trained = results["hl"][-1]
    assert active == ["other"] and modes == {"default": False, "other": False}
    assert trained and all(".other." in name for name in trained)
    assert (tmp_path / "hl" / "checkpoint-4" / "other" / "adapter_model.safetensors").is_file()


def test_an_adapter_the_model_lacks_is_added_from_the_checkpoint_frozen_as_in_transformers(tmp_path):
    """The checkpoint has a second adapter ("other", not active) the resumed model lacks: transformers adds it from its
    adapter_config.json, frozen, and goes on training the active one; so does hflight."""
    ends = {}
    for lib in LIBRARIES:
        make(lib, tmp_path / lib, model=lora_model(second_adapter="default")).train()
        resumed = make(lib, tmp_path / lib)  # the "default" adapter only
        resumed.train(resume_from_checkpoint=str(tmp_path / lib / "checkpoint-4"))
        assert set(resumed.model.peft_config) == {"default", "other"}
        frozen = {k for k, v in resumed.model.named_parameters() if ".other." in k and not v.requires_grad}
        ends[lib] = (
            logged(resumed, "loss", "grad_norm"),
            adapter_weights(resumed.model),
            frozen,
            adapter_state(resumed.model),
        )
    assert ends["hl"][0] == ends["hf"][0] and ends["hl"][2] == ends["hf"][2] and ends["hl"][2]
    assert ends["hl"][3] == ends["hf"][3] and ends["hl"][3][1] == {"default": False, "other": True}
    assert_same_weights(ends["hl"][1], ends["hf"][1])


def test_modules_to_save_are_saved_and_resumed_as_in_transformers(tmp_path):
    results = _compare(tmp_path, model_kwargs=dict(modules_to_save=["lm_head"]))
    assert any("modules_to_save" in name for name in results["hl"][2])


def test_save_only_model_resumes_as_in_transformers(tmp_path):
    _compare(tmp_path, save_only_model=True)
    assert "optimizer.pt" not in files(tmp_path / "hl" / "checkpoint-4")


def test_save_async_writes_the_adapters_of_a_synchronous_save_and_resumes_from_them(lora_runs, tmp_path):
    """transformers has no save_async: hflight's two write modes give the same adapter files (the last checkpoint's
    too), and the background one's checkpoint resumes as the synchronous one's."""
    background = make("hl", tmp_path / "async", save_async=True)
    background.train()
    for step in (4, 8):
        a, b = (out / f"checkpoint-{step}" for out in (lora_runs["hl"][0], tmp_path / "async"))
        assert files(a) == files(b)
        assert (a / "adapter_model.safetensors").read_bytes() == (b / "adapter_model.safetensors").read_bytes()
    resumed = make("hl", tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "async" / "checkpoint-4"))
    assert logged(resumed, "loss", "grad_norm")[4:] == lora_runs["hf"][1][4:]


def saved_adapters(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Each adapter ``folder`` holds (PEFT's layout: "default" at the top, any other in its subfolder) -> its file's
    tensors."""
    found = {p.parent: p for p in [folder / "adapter_model.safetensors", *folder.glob("*/adapter_model.safetensors")]}
    return {"default" if where == folder else where.name: load_file(f) for where, f in found.items() if f.is_file()}


def test_load_best_model_at_end_loads_the_best_adapters_from_where_peft_wrote_them(tmp_path):
    """Evaluation every 2 steps, the best the highest eval_loss (an early checkpoint, not the last): its adapters are
    the model's at the end and what the script's save_model writes after train(). transformers loads it for the
    "default" adapter; hflight's is the same. An adapter not named "default" (PEFT writes it in checkpoint-N/mine/,
    where transformers' Trainer does not look: it warns and keeps the last weights; hflight crashed) and two adapters
    with the second active (transformers reads the top file, the first adapter's, into it: a size error) are loaded
    from where PEFT wrote them; the "mine" run ends with transformers' "default" weights."""
    best = dict(eval_strategy="steps", eval_steps=2, save_steps=2, load_best_model_at_end=True, learning_rate=5e-2,
                metric_for_best_model="eval_loss", greater_is_better=True, save_total_limit=2)  # fmt: skip
    runs = {"hf": {}, "hl": {}, "mine": dict(adapter_name="mine"), "two": dict(second_adapter="other")}
    ends = {}
    for run, model_kwargs in runs.items():
        trainer = make("hf" if run == "hf" else "hl", tmp_path / run, model=lora_model(**model_kwargs), **best)
        trainer.train()
        best_checkpoint = Path(trainer.state.best_model_checkpoint)
        assert best_checkpoint.name == ("checkpoint-2" if run == "two" else "checkpoint-4"), run
        held = saved_adapters(best_checkpoint)
        assert set(held) == set(trainer.model.peft_config), run
        for name, saved in held.items():
            assert_same_weights(peft.get_peft_model_state_dict(trainer.model, adapter_name=name), saved)
        active = trainer.model.active_adapter
        last = saved_adapters(tmp_path / run / "checkpoint-8")[active]  # the weights the load replaced
        assert not all(torch.equal(v, held[active][k]) for k, v in last.items()), run
        trainer.save_model(str(tmp_path / run / "final"))  # the script's own save after train()
        final = saved_adapters(tmp_path / run / "final")
        assert final.keys() == held.keys() and all(assert_same_weights(final[n], held[n]) is None for n in held)
        ends[run] = {k.replace(f".{active}.", ".default."): v for k, v in adapter_weights(trainer.model).items()}
    assert_same_weights(ends["hl"], ends["hf"])
    assert_same_weights(ends["mine"], ends["hf"])


@pytest.mark.parametrize("settings", [dict(gradient_checkpointing=True), dict(neftune_noise_alpha=5.0)],
                         ids=["gradient_checkpointing", "neftune"])  # fmt: skip
def test_gradient_checkpointing_and_neftune_on_a_peft_model_as_in_transformers(tmp_path, settings):
    """With the base frozen, gradient checkpointing needs the inputs to require gradients (transformers enables it);
    NEFTune's noise goes on the base model's input embeddings: both libraries' runs are the same, step for step."""
    results = {}
    for lib in LIBRARIES:
        trainer = make(lib, tmp_path / lib, max_steps=4, save_strategy="no", **settings)
        trainer.train()
        results[lib] = logged(trainer, "loss", "grad_norm"), adapter_weights(trainer.model)
    assert results["hl"][0] == results["hf"][0]
    assert all(norm > 0 for _, norm in results["hl"][0])  # the adapters had gradients
    assert_same_weights(results["hl"][1], results["hf"][1])


# ---- quantized bases (bitsandbytes' CPU backend) ------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    pytest.importorskip("bitsandbytes")
    folder = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def quantized(folder: Path, bits: int, adapters: bool = True) -> torch.nn.Module:
    settings = dict(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32) if bits == 4 else dict(load_in_8bit=True)
    base = transformers.AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=transformers.BitsAndBytesConfig(**settings), device_map="cpu"
    )
    if not adapters:
        return base
    torch.manual_seed(0)
    return peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))


@pytest.mark.apart  # bitsandbytes: installed apart in CI (tests/test_optimizers.py's APART)
def test_a_purely_quantized_model_is_refused_with_transformers_message(llama_dir, tmp_path):
    model = quantized(llama_dir, 4, adapters=False)
    messages = []
    for lib, (trainer_cls, args_cls) in LIBRARIES.items():
        with pytest.raises(ValueError, match="You cannot perform fine-tuning on purely quantized models") as refused:
            trainer_cls(model, args_cls(str(tmp_path / lib), report_to="none"), train_dataset=tokens(8, 1))
        messages.append(str(refused.value))
    assert messages[0] == messages[1]


@pytest.mark.apart
@pytest.mark.parametrize("bits", [4, 8])
def test_qlora_trains_and_resumes_as_transformers_within_its_own_run_to_run_spread(llama_dir, tmp_path, bits):
    """LoRA on a bitsandbytes base: transformers run twice gives the spread its CPU kernels show run to run (0 here:
    the same losses to the bit, measured on torch 2.13 and bitsandbytes 0.50's CPU backend); hflight's losses and
    grad norms lie within it, its checkpoint resumes to the uninterrupted run's last steps."""
    settings = dict(max_steps=4, save_steps=2)
    runs = []
    for lib in ("hf", "hf", "hl"):
        trainer = make(lib, tmp_path / f"{lib}-{len(runs)}", model=quantized(llama_dir, bits), **settings)
        trainer.train()
        runs.append(torch.tensor(logged(trainer, "loss", "grad_norm"), dtype=torch.float64))
    spread = (runs[0] - runs[1]).abs().max()
    assert runs[2].shape == (4, 2) and (runs[2] - runs[0]).abs().max() <= spread
    resumed = make("hl", tmp_path / "hl-2", model=quantized(llama_dir, bits), **settings)
    resumed.train(resume_from_checkpoint=str(tmp_path / "hl-2" / "checkpoint-2"))
    after = torch.tensor(logged(resumed, "loss", "grad_norm")[2:], dtype=torch.float64)
    assert (after - runs[2][2:]).abs().max() <= spread


@pytest.mark.parametrize("damage", ["missing", "flipped"])
def test_a_damaged_or_missing_adapter_file_is_refused_at_resume_naming_it(lora_runs, tmp_path, damage):
    """The manifest covers the adapter files as any weights: a checkpoint whose adapter_model.safetensors is gone or
    altered is refused before anything is loaded, the file named."""
    import shutil

    folder = tmp_path / "checkpoint-4"
    shutil.copytree(lora_runs["hl"][0] / "checkpoint-4", folder)
    adapter = folder / "adapter_model.safetensors"
    if damage == "missing":
        adapter.unlink()
    else:
        data = bytearray(adapter.read_bytes())
        data[-1] ^= 0xFF
        adapter.write_bytes(bytes(data))
    trainer = make("hl", tmp_path / "out")
    before = adapter_weights(trainer.model)
    expected = (r"has no model weights \(looked for adapter_model\.safetensors, which its manifest lists"
                if damage == "missing" else r"adapter_model\.safetensors is damaged")  # fmt: skip
    with pytest.raises(hflight.IncompleteCheckpointError, match=expected):
        trainer.train(resume_from_checkpoint=str(folder))
    assert_same_weights(adapter_weights(trainer.model), before)
