"""``enable_jit_checkpoint=True`` with transformers.Trainer, then hflight.Trainer, one after the other in this process
(one start for both: the trainers share no state but the signal handlers, which each must give back): each run sends
this process SIGTERM during optimizer step 3, as a scheduler announcing preemption would, then trains on;
transformers' JITCheckpointCallback asks for a checkpoint once its grace period has passed, and training stops.
Prints, per trainer, as JSON: the trainer's callbacks, the final step, the checkpoint folders and their files.

The grace period (``kill_wait``, 3 s) is set to 0 on both trainers and the job waits 0.5 s after the signal, so the
checkpoint is requested before the next step begins under either trainer (transformers' timer thread sets the flag).
Usage: ``python jit_checkpoint_job.py OUT_DIR transformers hflight`` (each trainer's run in ``OUT_DIR/<name>``).
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import transformers  # noqa: E402
from tiny_qa import qa_windows, tiny_bert_qa  # noqa: E402

import hflight  # noqa: E402


class PreemptAtStep3(transformers.TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 3:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)  # the JIT manager's timer (kill_wait=0) sets its request meanwhile


def run(out: Path, kind: str) -> None:
    trainer_cls, args_cls = {
        "transformers": (transformers.Trainer, transformers.TrainingArguments),
        "hflight": (hflight.Trainer, hflight.TrainingArguments),
    }[kind]
    args = args_cls(
        output_dir=str(out), enable_jit_checkpoint=True, max_steps=8, save_strategy="no",
        per_device_train_batch_size=4, logging_steps=1, report_to="none", disable_tqdm=True,
        train_sampling_strategy="sequential",
    )  # fmt: skip
    trainer = trainer_cls(tiny_bert_qa(0, 16, 1, 0.0, 32), args, train_dataset=qa_windows(40, 0, 24, 10),
                          callbacks=[PreemptAtStep3()])  # fmt: skip
    for callback in trainer.callback_handler.callbacks:
        if getattr(callback, "jit_manager", None) is not None:
            callback.jit_manager.kill_wait = 0
    trainer.train()
    folders = sorted(p for p in out.iterdir() if p.name.startswith("checkpoint-"))
    print(f"RESULT {kind} " + json.dumps({
        "callbacks": [type(c).__name__ for c in trainer.callback_handler.callbacks],
        "global_step": trainer.state.global_step,
        "checkpoints": {p.name: sorted(f.name for f in p.iterdir()) for p in folders},
        "sigterm_handler_restored": signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None),
    }))  # fmt: skip


if __name__ == "__main__":
    for name in sys.argv[2:]:
        run(Path(sys.argv[1]) / name, name)
