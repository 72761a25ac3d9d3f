"""PEFT and TRL under torchrun, transformers' side or hflight's, on the same script (issue 47, items 1 and 4):

    torchrun --standalone --nproc_per_node 2 tests/jobs/finetune_job.py OUT transformers|hflight

In the same two processes, one after the other: a LoRA GPT-2 trained 8 steps by the ``Trainer`` (transformers' or
hflight's), evaluated and saved every 2 and its best checkpoint loaded at the end, then resumed from checkpoint-4 by a
new trainer; TRL's ``SFTTrainer`` (TRL's or
``hflight.trl``'s) with a LoRA ``peft_config``, 4 steps; TRL's ``DPOTrainer``, 4 steps; the LoRA run and its resume
again under FSDP2 (transformers' side needs tests/fsdp_standin on its ``PYTHONPATH``). Each rank writes
``OUT/<library>/rank<r>.json``: every run's log history and its trainable weights at the end.
"""

import json
import os
import sys
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


def trained(trainer, resume=None) -> dict:
    trainer.train(resume_from_checkpoint=resume)
    best = trainer.state.best_model_checkpoint
    whole = {k: v.full_tensor() if hasattr(v, "full_tensor") else v  # a shard of FSDP2's: gathered (collective)
             for k, v in trainer.model.named_parameters() if v.requires_grad}  # fmt: skip
    weights = {k: v.detach().flatten().tolist() for k, v in whole.items()}
    history = [{k: v for k, v in e.items() if not k.endswith(("runtime", "per_second", "step_time"))}
               for e in trainer.state.log_history]  # fmt: skip
    return {"log_history": history, "weights": weights, "best": best and Path(best).name}


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
    # last: accelerate's process state, one per process, keeps FSDP for every trainer after it
    fsdp = dict(fsdp="full_shard auto_wrap", fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"],
                                                          "state_dict_type": "SHARDED_STATE_DICT"})  # fmt: skip
    fsdp_args = args_cls(str(folder / "lora_fsdp"), **BEST, **fsdp, **COMMON)
    results["lora_fsdp"] = trained(trainer_cls(lora(gpt2()), fsdp_args, **data))
    resumed = trainer_cls(lora(gpt2()), fsdp_args, **data)
    results["lora_fsdp_resumed"] = trained(resumed, str(folder / "lora_fsdp" / "checkpoint-4"))

    rank = torch.distributed.get_rank()
    results["world_size"] = torch.distributed.get_world_size()
    (folder / f"rank{rank}.json").write_text(json.dumps(results), encoding="utf-8")
    gloo_exit.exit_without_teardown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
