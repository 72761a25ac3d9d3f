"""Two processes training until a SIGTERM stops them, for the multi-process signal test (tests/test_signals.py).

    python tests/jobs/sigterm_ddp_job.py OUT [--exit-delay S]             # Lightning's launcher starts rank 1
    torchrun --nproc_per_node 2 tests/jobs/sigterm_ddp_job.py OUT --torchrun

A tiny BERT QA model trains with DDP on CPU (gloo), gradient accumulation 2, at most 200 optimizer steps, pausing
0.1 s after each; no regular checkpoint. Each rank writes ``OUT/pid-RANK`` once training runs; rank 0 prints
``step N`` after each step, and each rank writes the code it leaves ``main`` with in ``OUT/exit-RANK`` (under
torchrun, whose agent reaps the ranks, the test has no other view of them). ``--exit-delay S``: rank 0 takes S seconds
more to exit (an exit callback that sleeps, as a slow logger or library shutdown would), the case in which Lightning's
child-process monitor killed it.
"""

import argparse
import atexit
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from tiny_qa import qa_windows, tiny_bert_qa  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from hflight import Trainer, TrainingArguments  # noqa: E402


class Progress(TrainerCallback):
    def __init__(self, out: Path, rank: int) -> None:
        self.out, self.rank = out, rank

    def on_train_begin(self, args, state, control, **kwargs):
        (self.out / f"pid-{self.rank}").write_text(str(os.getpid()))

    def on_step_end(self, args, state, control, **kwargs):
        if self.rank == 0:
            print(f"step {state.global_step}", flush=True)
        time.sleep(0.1)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--exit-delay", type=float, default=0.0)
    parser.add_argument("--torchrun", action="store_true")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(opts.out)
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    if rank == 0 and opts.exit_delay:
        atexit.register(time.sleep, opts.exit_delay)
    args = TrainingArguments(
        output_dir=str(out), accelerator="cpu", devices=2, strategy="ddp", per_device_train_batch_size=2,
        gradient_accumulation_steps=2, max_steps=200, save_steps=1000, logging_steps=1000, optim="sgd",
        learning_rate=0.1, report_to="none", disable_tqdm=True, dataloader_pin_memory=False,
    )  # fmt: skip
    model = tiny_bert_qa(0, hidden=16, layers=1, dropout=0.0, max_positions=32)
    trainer = Trainer(model, args, train_dataset=qa_windows(64, 0, length=16, max_start=10),
                      callbacks=[Progress(out, rank)])  # fmt: skip
    trainer.train()
    return 0


if __name__ == "__main__":
    code = None  # an exception other than SystemExit: "None" recorded
    try:
        code = main()
    except SystemExit as exit:
        code = exit.code
        raise
    finally:
        rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
        Path(sys.argv[1], f"exit-{rank}").write_text(str(code))
    sys.exit(code)
