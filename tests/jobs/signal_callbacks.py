"""Callbacks for child-process tests, importable with ``PYTHONPATH=tests/jobs`` (e.g. as a Hydra ``_target_``)."""

import os
import signal

from transformers import TrainerCallback


class SendSignal(TrainerCallback):
    """Sends ``signal_name`` (e.g. "SIGTERM") to this process in the middle of optimizer step ``step``, as a
    scheduler preempting the job would, at a moment fixed by the test instead of by timing."""

    def __init__(self, signal_name: str = "SIGTERM", step: int = 2) -> None:
        self.signum = signal.Signals[signal_name]
        self.step = step

    def _send(self, state) -> None:
        if self.step is not None and state.global_step + 1 == self.step:
            self.step = None
            os.kill(os.getpid(), self.signum)

    def on_step_begin(self, args, state, control, **kwargs):
        self._send(state)


class SignalOnceBuilt(TrainerCallback):
    """Sends ``signal_name`` to this process when the trainer is built (``on_init_end``): after the data was prepared,
    before training starts."""

    def __init__(self, signal_name: str = "SIGUSR1") -> None:
        self.signum = signal.Signals[signal_name]

    def on_init_end(self, args, state, control, **kwargs):
        os.kill(os.getpid(), self.signum)
