"""A plain script stopped by SIGINT mid-training; a second SIGINT arrives while the interpreter runs its exit callbacks
(as when a slow library shuts down and the user presses Ctrl-C again), or, with ``--finalizing``, a SIGTERM arrives
while the interpreter tears its modules down after them (as srun's --kill-on-bad-exit sends it to a task that is still
exiting). Run by test_signals.py.

    python tests/jobs/sigint_at_exit.py OUT [--finalizing]
"""

import atexit
import functools
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: conftest's Factory

from conftest import Factory  # noqa: E402

import hflight  # noqa: E402


def slow_shutdown() -> None:
    """Registered before training, so it runs after the exit callbacks registered later."""
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)
    print("slow shutdown finished", flush=True)


class SigtermWhenCollected:
    """Kept in a module global: collected when Python tears ``__main__`` down, after the exit callbacks."""

    def __init__(self):  # bound now: the module's globals are gone (None) when this is collected
        self.send = functools.partial(os.kill, os.getpid(), signal.SIGTERM)
        self.sleep = time.sleep

    def __del__(self):
        self.send()
        self.sleep(0.5)  # a signal's default action lands here


class SendSigint(hflight.TrainerCallback):
    def on_substep_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            os.kill(os.getpid(), signal.SIGINT)


if __name__ == "__main__":
    if "--finalizing" in sys.argv:
        collected_last = SigtermWhenCollected()
    else:
        atexit.register(slow_shutdown)
    args = hflight.TrainingArguments(
        output_dir=sys.argv[1], max_steps=4, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        save_steps=10, report_to="none", disable_tqdm=True, dataloader_pin_memory=False,
    )  # fmt: skip
    trainer = hflight.Trainer(Factory.qa_model(), args, train_dataset=Factory.qa_dataset(16), callbacks=[SendSigint()])
    trainer.train()
