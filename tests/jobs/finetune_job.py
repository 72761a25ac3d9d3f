"""PEFT and TRL under torchrun, transformers' side or hflight's, on the same script (issue 47, items 1 and 4), and the
best model from sharded checkpoints (issue 48, item 4):

    torchrun --standalone --nproc_per_node 2 tests/jobs/finetune_job.py OUT transformers|hflight

In the same two processes, one after the other: a LoRA GPT-2 trained 8 steps by the ``Trainer`` (transformers' or
hflight's), evaluated and saved every 2 and its best checkpoint loaded at the end, then resumed from checkpoint-4 by a
new trainer; TRL's ``SFTTrainer`` (TRL's or ``hflight.trl``'s) with a LoRA ``peft_config``, 4 steps; TRL's
``DPOTrainer``, 4 steps; the LoRA run resumed from the other library's checkpoint-4 (crossed); a tiny Llama (its own
keys start with ``model.``) trained whole with its best checkpoint loaded at the end and ``save_total_limit=1``; the
LoRA run, its resume and its crossed resume again under FSDP2 (sharded checkpoints; transformers' side needs
tests/fsdp_standin on its ``PYTHONPATH``) and the Llama under FSDP2 (sharded; hflight also gathered: transformers'
FULL_STATE_DICT save fails on the CPU); last the Llama under DeepSpeed ZeRO-3, and resumed from its best checkpoint.
The Llama with ``save_only_model`` (4 steps, checkpoints at 2 and 4) under DDP, FSDP2 (gathered: hflight's side only)
and ZeRO-3.

The two libraries' jobs run at the same time: a crossed resume waits for the marker ``OUT/<other>/<run>.complete``
that the other job writes once its run and its own resume (the same folder) are done. Each rank writes
``OUT/<library>/rank<r>.json``: every run's log history, its trainable weights at the end, the best checkpoint and the
checkpoints left in its folder.
"""

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gloo_exit  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from tiny_lm import columns, gpt2, lora, token_rows, tokenizer  # noqa: E402

import hflight  # noqa: E402
import hflight.trl  # noqa: E402

COMMON = dict(per_device_train_batch_size=2, logging_steps=1, learning_rate=1e-2, seed=0, report_to="none",
              disable_tqdm=True, dataloader_pin_memory=False, use_cpu=True)  # fmt: skip


#: the LoRA runs: evaluated and saved every 2 steps, the best checkpoint loaded at the end; "best" is the highest
#: evaluation loss, so that it is an early checkpoint, not the weights the run ends with
BEST = dict(max_steps=8, save_steps=2, eval_strategy="steps", eval_steps=2, load_best_model_at_end=True,
            metric_for_best_model="eval_loss", greater_is_better=True)  # fmt: skip
#: checkpoints of the whole model alone (transformers refuses it beside load_best_model_at_end under FSDP and ZeRO)
ONLY_MODEL = dict(max_steps=4, save_steps=2, save_only_model=True)


def whole(model) -> dict:
    """Every trainable parameter, whole (collective under FSDP2 and ZeRO-3: each rank holds a shard)."""
    named = [(k, v) for k, v in model.named_parameters() if v.requires_grad]
    if any(hasattr(v, "ds_id") for _, v in named):  # ZeRO-3's partitions, gathered for the moment
        import deepspeed

        with deepspeed.zero.GatheredParameters([v for _, v in named]):
            return {k: v.detach().flatten().tolist() for k, v in named}
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().flatten().tolist() for k, v in named}


def trained(trainer, resume=None) -> dict:
    trainer.train(resume_from_checkpoint=resume)
    best = trainer.state.best_model_checkpoint
    history = [{k: v for k, v in e.items() if not k.endswith(("runtime", "per_second", "step_time"))}
               for e in trainer.state.log_history]  # fmt: skip
    torch.distributed.barrier()  # every rank's files written and rotated
    kept = sorted(p.name for p in Path(trainer.args.output_dir).glob("checkpoint-*"))
    return {"log_history": history, "weights": whole(trainer.model), "best": best and Path(best).name, "kept": kept}


#: how long a crossed resume waits for the other library's checkpoints (both jobs run at once)
WAIT_S = 360
#: written into ``OUT/<library>/`` by a rank of a job that failed, for the other job's crossed resume
FAILED = "job.failed"


def done(folder: Path, run: str) -> None:
    """Marks ``folder/run`` complete (every rank's files written) for the other library's job."""
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        (folder / f"{run}.complete").write_text("", encoding="utf-8")


def other_checkpoint(out: Path, library: str, run: str, step: int = 4) -> str:
    """The other library's ``run/checkpoint-<step>``, once its job marked the run complete (at once a RuntimeError
    if that job failed, a TimeoutError after :data:`WAIT_S`)."""
    other = "hflight" if library == "transformers" else "transformers"
    ours, theirs = (f"{name}'" if name.endswith("s") else f"{name}'s" for name in (library, other))
    marker, waited = out / other / f"{run}.complete", 0.0
    while not marker.exists():
        if (out / other / FAILED).exists():
            raise RuntimeError(f"{ours} crossed resume needs {theirs} {run} run, but {theirs} job failed before it "
                               f"was complete: see {theirs} console")  # fmt: skip
        if waited >= WAIT_S:
            raise TimeoutError(f"{ours} crossed resume waited {WAIT_S} s for {theirs} {run} run to finish "
                               f"(no {marker}): see {theirs} console")  # fmt: skip
        time.sleep(0.5)
        waited += 0.5
    return str(out / other / run / f"checkpoint-{step}")


def llama():
    """A 2-layer Llama over 64 ids, its weights drawn from seed 0 (its own keys start with ``model.``)."""
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32))  # fmt: skip


#: the ZeRO-3 run: the Trainer's optimizer and schedule (transformers' "auto" values), 16-bit weights gathered
ZERO3 = {"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
         "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
         "gradient_clipping": "auto"}  # fmt: skip


def main(out: Path, library: str) -> None:
    trainer_cls, args_cls = (transformers.Trainer, transformers.TrainingArguments) if library == "transformers" else (
        hflight.Trainer, hflight.TrainingArguments)  # fmt: skip
    trl_module = trl if library == "transformers" else hflight.trl
    folder = out / library
    results = {}

    data = dict(train_dataset=token_rows(64, 1), eval_dataset=token_rows(8, 2))
    lora_args = args_cls(str(folder / "lora"), **BEST, **COMMON)
    results["lora"] = trained(trainer_cls(lora(gpt2()), lora_args, **data))
    resumed = trainer_cls(lora(gpt2()), lora_args, **data)
    results["lora_resumed"] = trained(resumed, str(folder / "lora" / "checkpoint-4"))
    done(folder, "lora")

    import peft

    sft = trl_module.SFTTrainer(
        model=gpt2(), args=trl.SFTConfig(str(folder / "sft"), max_steps=4, bf16=False, **COMMON),
        train_dataset=columns(64, text=(5, 20)), processing_class=tokenizer(),
        peft_config=peft.LoraConfig(r=4, target_modules=["c_attn"], task_type="CAUSAL_LM"),
    )  # fmt: skip
    results["sft"] = trained(sft)
    dpo = trl_module.DPOTrainer(
        model=gpt2(), ref_model=gpt2(), args=trl.DPOConfig(str(folder / "dpo"), max_steps=4, bf16=False, **COMMON),
        train_dataset=columns(32, prompt=(3, 10), chosen=(3, 10), rejected=(3, 10)), processing_class=tokenizer(),
    )  # fmt: skip
    results["dpo"] = trained(dpo)
    crossed = trainer_cls(lora(gpt2()), args_cls(str(folder / "lora_crossed"), **BEST, **COMMON), **data)
    results["lora_crossed"] = trained(crossed, other_checkpoint(out, library, "lora"))
    # the best of a whole model kept by save_total_limit=1 and loaded at the end
    best_args = dict(**BEST, **COMMON, save_total_limit=1)
    results["best_ddp"] = trained(trainer_cls(llama(), args_cls(str(folder / "best_ddp"), **best_args), **data))
    only_args = dict(**ONLY_MODEL, **COMMON)
    results["only_model_ddp"] = trained(trainer_cls(llama(), args_cls(str(folder / "only_model_ddp"), **only_args),
                                                    **data))  # fmt: skip
    # then FSDP: accelerate's process state, one per process, keeps FSDP for every trainer after it
    fsdp = dict(fsdp="full_shard auto_wrap", fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"],
                                                          "state_dict_type": "SHARDED_STATE_DICT"})  # fmt: skip
    fsdp_args = args_cls(str(folder / "lora_fsdp"), **BEST, **fsdp, **COMMON)
    results["lora_fsdp"] = trained(trainer_cls(lora(gpt2()), fsdp_args, **data))
    resumed = trainer_cls(lora(gpt2()), fsdp_args, **data)
    results["lora_fsdp_resumed"] = trained(resumed, str(folder / "lora_fsdp" / "checkpoint-4"))
    done(folder, "lora_fsdp")
    crossed = trainer_cls(lora(gpt2()), args_cls(str(folder / "lora_fsdp_crossed"), **BEST, **fsdp, **COMMON), **data)
    results["lora_fsdp_crossed"] = trained(crossed, other_checkpoint(out, library, "lora_fsdp"))
    forms = ("SHARDED_STATE_DICT",) if library == "transformers" else ("SHARDED_STATE_DICT", "FULL_STATE_DICT")
    for form in forms:
        llama_fsdp = dict(fsdp="full_shard auto_wrap", fsdp_config={
            "version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "state_dict_type": form})  # fmt: skip
        name = f"best_fsdp_{form.split('_')[0].lower()}"
        results[name] = trained(trainer_cls(llama(), args_cls(str(folder / name), **best_args, **llama_fsdp), **data))
    if library == "hflight":  # save_only_model with the gathered form (transformers' FULL_STATE_DICT save fails here)
        name = "only_model_fsdp_full"
        results[name] = trained(trainer_cls(llama(), args_cls(str(folder / name), **only_args, **llama_fsdp), **data))
    # last, DeepSpeed ZeRO-3 (accelerate's process state made afresh for it); the model built before the arguments,
    # which connect DeepSpeed's processes (transformers' own do not on the CPU: tests/test_deepspeed.py)
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    model = llama()
    zero3_args = args_cls(str(folder / "best_zero3"), **best_args, deepspeed=json.loads(json.dumps(ZERO3)))
    results["best_zero3"] = trained(trainer_cls(model, zero3_args, **data))
    model = llama()  # resumed from the best checkpoint, the one kept (its module states by the Llama's own names)
    zero3_args = args_cls(str(folder / "zero3_resumed"), **best_args, deepspeed=json.loads(json.dumps(ZERO3)))
    best = str(folder / "best_zero3" / "checkpoint-2")
    results["zero3_resumed"] = trained(trainer_cls(model, zero3_args, **data), best)
    model = llama()
    zero3_args = args_cls(str(folder / "only_model_zero3"), **only_args, deepspeed=json.loads(json.dumps(ZERO3)))
    results["only_model_zero3"] = trained(trainer_cls(model, zero3_args, **data))

    rank = torch.distributed.get_rank()
    results["world_size"] = torch.distributed.get_world_size()
    (folder / f"rank{rank}.json").write_text(json.dumps(results), encoding="utf-8")
    gloo_exit.exit_without_teardown()


if __name__ == "__main__":
    try:
        main(Path(sys.argv[1]), sys.argv[2])
    except BaseException:
        (Path(sys.argv[1]) / sys.argv[2]).mkdir(parents=True, exist_ok=True)
        (Path(sys.argv[1]) / sys.argv[2] / FAILED).write_text("", encoding="utf-8")
        raise
