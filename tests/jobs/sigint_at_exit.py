"""A plain script stopped by SIGINT mid-training; a second SIGINT arrives while the interpreter runs its exit callbacks
(as when a slow library shuts down and the user presses Ctrl-C again). Run by test_signals.py.

    python tests/jobs/sigint_at_exit.py OUT
"""

import atexit
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


class SendSigint(hflight.TrainerCallback):
    def on_substep_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            os.kill(os.getpid(), signal.SIGINT)


if __name__ == "__main__":
    atexit.register(slow_shutdown)
    args = hflight.TrainingArguments(
        output_dir=sys.argv[1], max_steps=4, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        save_steps=10, report_to="none", disable_tqdm=True, dataloader_pin_memory=False,
    )  # fmt: skip
    trainer = hflight.Trainer(Factory.qa_model(), args, train_dataset=Factory.qa_dataset(16), callbacks=[SendSigint()])
    trainer.train()
