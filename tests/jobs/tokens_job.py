"""Two processes under torchrun, transformers' Trainer or hflight's on the same script (issue 24, point 6):

    torchrun --nproc_per_node 2 tests/jobs/tokens_job.py OUT hf|hl

A tiny BERT classifier (its forward takes ``**kwargs``, so ``average_tokens_across_devices`` multiplies the loss by
the number of processes), sequential data, gradient accumulation 2; rank 0 writes ``OUT/log_history.json``.
"""

import gc
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gloo_exit  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from support import Factory  # noqa: E402

import hflight  # noqa: E402


def main() -> int:
    out, impl = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    fields = Factory.pair_args(gradient_accumulation_steps=2, per_device_train_batch_size=2, num_train_epochs=1)
    if impl == "hl":
        fields.update(accelerator="cpu", devices="2", strategy="ddp")
        trainer_cls, args_cls = hflight.Trainer, hflight.TrainingArguments
    else:
        fields.update(use_cpu=True, ddp_backend="gloo")
        trainer_cls, args_cls = transformers.Trainer, transformers.TrainingArguments
    args = args_cls(output_dir=f"{out}/{impl}", average_tokens_across_devices=True, **fields)
    trainer = trainer_cls(Factory.cls_model(), args, train_dataset=Factory.cls_dataset(24))
    trainer.train()
    if trainer.is_world_process_zero():
        Path(out, f"{impl}.json").write_text(json.dumps(trainer.state.log_history))
    if impl == "hf":  # transformers' side ends without the interpreter's teardown (tests/gloo_exit.py says why)
        gloo_exit.exit_without_teardown()
    # End the gloo group here, not in the interpreter's teardown, which sometimes aborted a rank ("terminate called
    # without an active exception"). But only once the DDP wrapper is gone: destroying the group while its
    # Reducer still holds pending allgather work deadlocks (the group's destructor joins its worker thread holding the
    # GIL; the worker waits for the GIL to free the work's Python objects), a hang of 30-40% under load on 2 cores.
    torch.distributed.barrier()
    del trainer
    gc.collect()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
