"""One two-process job of the process-group exit stress test (tests/stress/process_group_exit.py), under torchrun.

    torchrun --nproc_per_node=2 tests/stress/exit_job.py OUT MODE

MODE: ``hflight-ddp`` or ``hflight-fsdp2`` (hflight's Trainer, ended by hflight at exit), ``transformers``
(transformers' Trainer with ``use_cpu``, the group ended as the suite's reference jobs end it: the trainer dropped, the
group destroyed, garbage collected) or ``transformers-as-is`` (nothing ended: what transformers users get).
Each ends the worst way for gloo: a user all-gather whose tensors die at once, then a barrier, right before exit.
Each rank writes how many gloo worker threads it still has when the interpreter's teardown begins.
"""

import atexit
import gc
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "jobs"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tiny_qa import qa_windows, tiny_bert_qa  # noqa: E402


def gloo_worker_threads() -> int:
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            count += Path(f"/proc/self/task/{task}/comm").read_text().strip() == "pt_gloo_runloop"
        except OSError:
            pass
    return count


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ["RANK"])
    # registered first, so it runs last of the exit handlers: what is left when the interpreter's teardown begins
    atexit.register(lambda: (out / f"threads_{rank}.txt").write_text(str(gloo_worker_threads())))
    torch.set_num_threads(1)
    if mode.startswith("hflight"):
        from hflight import Trainer, TrainingArguments

        extra = {"fsdp": True, "fsdp_config": {"version": 2}} if mode == "hflight-fsdp2" else {}
    else:
        from transformers import Trainer, TrainingArguments

        extra = {"use_cpu": True}
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, max_steps=3, logging_steps=1,
                             save_strategy="no", report_to="none", disable_tqdm=True, **extra)  # fmt: skip
    trainer = Trainer(tiny_bert_qa(0, hidden=32, layers=2, dropout=0.0, max_positions=64), args,
                      train_dataset=qa_windows(40, 0, length=16, max_start=10),
                      eval_dataset=qa_windows(12, 1, length=16, max_start=10))  # fmt: skip
    trainer.train()
    trainer.evaluate()
    gathered = [torch.zeros(1000) for _ in range(2)]
    dist.all_gather(gathered, torch.full((1000,), float(rank)))
    del gathered
    dist.barrier()
    if mode == "transformers":  # the suite's reference jobs: nothing left holding the group, then destroyed
        del trainer
        gc.collect()
        dist.destroy_process_group()
        gc.collect()


if __name__ == "__main__":
    main()
