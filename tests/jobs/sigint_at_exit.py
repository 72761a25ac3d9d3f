"""A plain script stopped by SIGINT mid-training; a second SIGINT arrives while the interpreter runs its exit callbacks
(as when a slow library shuts down and the user presses Ctrl-C again), or, with ``--unwinding``, as the stop's
exception leaves ``train()`` (two Ctrl-C 20 ms apart, the second after the step boundary's checkpoint), or, with
``--finalizing``, a SIGTERM arrives while the interpreter tears its modules down after them (as srun's
--kill-on-bad-exit sends it to a task that is still exiting; OUT/sigterm_when_collected.txt says it was sent and
delivered), or, with ``--after-last-boundary``, the first SIGINT lands after the last step boundary's stop check
(training over, Lightning winding down) and the second the moment train()'s handler is put back. Run by
test_signals.py.

    python tests/jobs/sigint_at_exit.py OUT [--finalizing | --unwinding | --after-last-boundary]
"""

import atexit
import functools
import os
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: support's Factory

from support import Factory  # noqa: E402

import hflight  # noqa: E402


def slow_shutdown() -> None:
    """Registered before training, so it runs after the exit callbacks registered later."""
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)
    print("slow shutdown finished", flush=True)


class SigtermWhenCollected:
    """Kept in a module global: collected when Python tears ``__main__`` down, after the exit callbacks. It sends
    SIGTERM to the main thread (this one) while the signal is blocked there, records that the signal is pending (sent
    and waiting to be delivered), unblocks it (delivered now: its default action would end the process here) and
    records that the process lived on, in ``record`` (``sent pending``, then ``survived``). Directed at the thread:
    a signal to the process would go to one of torch's threads, which do not block it."""

    def __init__(self, record: str):  # bound now: the module's globals are gone (None) when this is collected
        fd = os.open(record, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self.write = functools.partial(os.write, fd)
        self.send = functools.partial(signal.pthread_kill, threading.get_ident(), signal.SIGTERM)
        self.block = functools.partial(signal.pthread_sigmask, signal.SIG_BLOCK, [signal.SIGTERM])
        self.unblock = functools.partial(signal.pthread_sigmask, signal.SIG_UNBLOCK, [signal.SIGTERM])
        self.pending, self.signum, self.sleep = signal.sigpending, int(signal.SIGTERM), time.sleep

    def __del__(self):
        self.block()
        self.send()
        self.write(b"sent pending\n" if self.signum in {int(s) for s in self.pending()} else b"sent, not pending\n")
        self.unblock()  # delivered here: ignored, or the process ends with -15
        self.sleep(0.5)
        self.write(b"survived\n")


class SendSigint(hflight.TrainerCallback):
    def on_substep_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            os.kill(os.getpid(), signal.SIGINT)


def first_after_the_last_boundary() -> None:
    """The last epoch end's stop check wrapped: once it found no stop and training is over, SIGINT; a watcher sends the
    second as soon as SIGINT's handler is no longer training's request (the stop leaving train())."""
    from hflight.run.interrupt import StopRequest
    from hflight.run.loop import TrainingLoop

    def watch():
        while isinstance(signal.getsignal(signal.SIGINT), StopRequest):
            time.sleep(0.0002)
        os.kill(os.getpid(), signal.SIGINT)

    checked = TrainingLoop.epoch_end

    def epoch_end(self, counts_batches):
        stops = checked(self, counts_batches)
        if stops:
            os.kill(os.getpid(), signal.SIGINT)
            threading.Thread(target=watch, daemon=True).start()
            time.sleep(0.05)
        return stops

    TrainingLoop.epoch_end = epoch_end


if __name__ == "__main__":
    last_boundary = "--after-last-boundary" in sys.argv
    if last_boundary:
        first_after_the_last_boundary()
    if "--finalizing" in sys.argv:
        collected_last = SigtermWhenCollected(str(Path(sys.argv[1]) / "sigterm_when_collected.txt"))
    elif "--unwinding" not in sys.argv and not last_boundary:
        atexit.register(slow_shutdown)
    args = hflight.TrainingArguments(
        output_dir=sys.argv[1], max_steps=4, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        save_steps=10, report_to="none", disable_tqdm=True, dataloader_pin_memory=False,
    )  # fmt: skip
    callbacks = [] if last_boundary else [SendSigint()]
    trainer = hflight.Trainer(Factory.qa_model(), args, train_dataset=Factory.qa_dataset(16), callbacks=callbacks)
    try:
        trainer.train()
    finally:
        if "--unwinding" in sys.argv:
            os.kill(os.getpid(), signal.SIGINT)
