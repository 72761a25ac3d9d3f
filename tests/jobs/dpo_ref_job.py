"""TRL's DPO with a reference model under a sharding strategy, for ``tests/test_accelerator_surface.py``: a tiny GPT-2
trained for 3 steps on 2 processes, with TRL on transformers or with hflight.trl, the reference model prepared by
TRL's own ``prepare_deepspeed``/``prepare_fsdp`` from ``trainer.accelerator.state``'s plugin.

    torchrun --standalone --nproc_per_node=2 tests/jobs/dpo_ref_job.py OUT trl:fsdp2 hflight:fsdp2 trl:zero2

Each run (library ``trl`` or ``hflight``; mode ``zero2``, ``zero3``, ``fsdp2``, or ``fsdp1``, CUDA only, with
``DPO_ON_CUDA=1``) in turn in the same processes; rank 0 writes ``OUT/<library>_<mode>.json``: the log history (times
apart) and the reference model's class. TRL on transformers runs FSDP2 on the CPU with ``tests/fsdp_standin`` on
``PYTHONPATH``; accelerate's state, transformers' DeepSpeed config and the environment are reset between runs.
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the tests package (tiny_lm)

import torch  # noqa: E402

from tests.tiny_lm import columns, gpt2, tokenizer  # noqa: E402

TIMES = ("step_time", "_runtime", "_per_second")
ZERO = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto"}  # fmt: skip
MODES = {
    "zero2": {"deepspeed": {"zero_optimization": {"stage": 2}, **ZERO}},
    "zero3": {"deepspeed": {"zero_optimization": {"stage": 3}, **ZERO}},
    "fsdp2": {"fsdp": "full_shard auto_wrap",
              "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]}},
    "fsdp1": {"fsdp": "full_shard auto_wrap",
              "fsdp_config": {"version": 1, "transformer_layer_cls_to_wrap": ["GPT2Block"]}},
}  # fmt: skip


def main(out: Path, runs: list[str]) -> None:
    import trl
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    import hflight.trl

    data = columns(32, prompt=(3, 10), chosen=(3, 10), rejected=(3, 10))
    environment = dict(os.environ)
    for run in runs:
        library, mode = run.split(":")
        module = hflight.trl if library == "hflight" else trl
        settings = dict(per_device_train_batch_size=2, max_steps=3, logging_steps=1, learning_rate=1e-3, seed=0,
                        report_to="none", bf16=False, use_cpu=not os.environ.get("DPO_ON_CUDA"), save_strategy="no",
                        disable_tqdm=True, dataloader_pin_memory=False)  # fmt: skip
        args = module.DPOConfig(str(out / run.replace(":", "_")), **settings, **MODES[mode])
        trainer = module.DPOTrainer(model=gpt2(), ref_model=gpt2(), args=args, train_dataset=data,
                                    processing_class=tokenizer())  # fmt: skip
        reference = type(trainer.ref_model).__name__
        trainer.train()
        logs = [{k: v for k, v in e.items() if not k.endswith(TIMES)} for e in trainer.state.log_history]
        if torch.distributed.get_rank() == 0:
            (out / f"{library}_{mode}.json").write_text(json.dumps({"logs": logs, "reference": reference}))
        del trainer, args
        # the next run starts afresh: transformers' Accelerator takes its own plugins (not the state's), no DeepSpeed
        # config stays current, and the ACCELERATE_USE_* variables an Accelerator sets are gone
        AcceleratorState._reset_state()
        unset_hf_deepspeed_config()
        os.environ.clear()
        os.environ.update(environment)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
