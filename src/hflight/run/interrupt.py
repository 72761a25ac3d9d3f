"""SIGTERM and SIGINT: stop at the next optimizer-step boundary, save a checkpoint, exit non-zero.

Left alone, Lightning turns SIGTERM into ``SIGTERMException`` (a ``SystemExit`` without a code: exit status 0)
after whichever micro-batch is running, and SIGINT into ``sys.exit(1)``; neither saves anything, and a preempted
job looks successful. During ``Trainer.train`` hflight instead records the signal (:class:`StopRequest`), lets the
current gradient-accumulation cycle finish, writes ``checkpoint-N`` unless ``save_strategy="no"`` and raises
:class:`TrainingInterrupted`: a ``SystemExit`` whose code is 128 + the signal number (143 for SIGTERM, 130 for
SIGINT), as a shell reports a process ended by that signal. A second signal stops at once, without a checkpoint.

Lightning's own handling stays in place. hflight's handler is installed before ``fit``, so Lightning's SIGTERM
handler composes it (Lightning keeps handlers it finds): Lightning still logs the signal and forwards it to the
processes it launched (its SLURM auto-requeue is off: see below). Only Lightning's "stop after this
micro-batch" flag is cleared again, because hflight stops at the step boundary instead; with several processes the
ranks agree on that boundary (:meth:`StopRequest.agreed`), so they all save and stop at the same step.

Several processes stop together, and each exits 143 (130), whichever launched them:

- Lightning's SIGTERM notifier is taken out of its composed handler once training starts
  (:meth:`StopRequest.drop_lightning_notifier`): it forwards the signal to the ranks Lightning launched (a second
  SIGTERM for a rank the process group's signal reached already) and broadcasts from inside the signal handler, a
  collective that hangs every rank when they received different numbers of signals (seen: rank 1 got the group's
  SIGTERM and rank 0's forwarded one, both ranks hung). hflight's per-step all-reduce (:meth:`StopRequest.agreed`)
  stops every rank, whichever got the signal;
- a scheduler signalling the process group reaches every rank, and the launcher forwards the signal it got as well
  (Lightning's to the ranks it started, torchrun's to all): within :data:`DUPLICATE_WINDOW` seconds of the first, the
  same signal again is that one stop delivered twice, not a request to stop at once;
- under Lightning's subprocess launcher, rank 0 is the parent of the other ranks, and Lightning's child-process
  monitor (``_ChildProcessObserver``, every 5 s) SIGKILLs every process, rank 0 included, as soon as a child has
  exited non-zero: a rank exiting 143 turned a rank 0 still finishing its exit (loggers, exit callbacks) into -9.
  Once the ranks agreed to stop, rank 0 retires that monitor and, when it exits, waits for the ranks it launched
  and logs their exit codes (:class:`_AwaitLaunched`; after :data:`CHILD_EXIT_TIMEOUT` seconds they are killed), so
  the job's main process ends last, as torchrun's agent does.

Under SLURM (srun launched the process), the requeue signal (``TrainingArguments.requeue_signal``, SIGUSR1 by
default, as ``#SBATCH --signal=USR1@90`` sends it before the time limit) is a stop request too: every rank stops at
the same step boundary, one complete checkpoint is written, global rank 0 runs ``scontrol requeue`` once
(``hflight.run.requeue``) and every process exits with 128 + the signal number (138), saying that the job was
requeued and from which checkpoint it continues. The signal again, from srun and from SLURM, or during the
checkpoint's write, is the same stop; a different signal afterwards (SLURM's SIGTERM at the time limit) stops at
once, as a second signal does. Lightning's own requeue handler is not installed (``SLURMEnvironment(auto_requeue=
False)``): it would write its ``hpc_ckpt_*.ckpt`` and train on.

Outside of training, :func:`terminate_on_signals` (used by the command line) turns both signals into
:class:`TrainingInterrupted` at once, so that the failure is recorded instead of the process vanishing; the requeue
signal requeues the job first.

Once a signal has stopped a run, the process is on its way out: if another SIGTERM/SIGINT arrives while the
interpreter runs its exit callbacks (a logger or library shutting down), the process exits at once with one line
instead of Python's "Exception ignored in atexit callback ... KeyboardInterrupt" traceback.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hflight._util import IGNORE_WHILE_FINALIZING

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)
DUPLICATE_WINDOW = 3.0  # seconds within which a repeated signal in a multi-process run is the same stop delivered twice
CHILD_EXIT_TIMEOUT = 60.0  # seconds rank 0 waits at exit for the ranks it launched before killing them


class TrainingInterrupted(SystemExit):
    """Training (or a command-line run) was stopped by a signal. ``code`` is 128 + the signal number.

    Attributes:
        signum: the signal received.
        global_step: the optimizer step training stopped after (None outside training).
        checkpoint: the checkpoint written (or still valid) to resume from, None when there is none.
    """

    def __init__(self, signum: int, message: str, global_step: int | None = None, checkpoint: str | None = None):
        super().__init__(message)
        self.code = 128 + int(signum)
        self.signum = int(signum)
        self.message = message
        self.global_step = global_step
        self.checkpoint = checkpoint

    def __str__(self) -> str:
        return self.message


#: The stop of this process, once a signal stopped its run (its exit status is the one the process exits with).
_STOPPED: list[TrainingInterrupted] = []


def stopped(
    signum: int, message: str, global_step: int | None = None, checkpoint: str | None = None
) -> TrainingInterrupted:
    """Log ``message`` (a plain script shows nothing else: the exit is a ``SystemExit``) and build the exception;
    a signal arriving during the exit that follows ends the process quietly (:func:`_quiet_at_exit`)."""
    logger.warning(message)
    _quiet_at_exit.register(signum)
    stop = TrainingInterrupted(signum, message, global_step, checkpoint)
    _STOPPED[:] = [stop]
    return stop


def _exit_now(signum: int, frame: Any) -> None:
    """A signal during the exit of a stopped run: one line, then exit at once, with the stop's status (a requeued
    job's tasks exit 138 even when SLURM's SIGTERM reaches one of them as it exits)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    code = _STOPPED[0].code if _STOPPED else 128 + int(signum)
    os.write(2, f"{signal_name(signum)} received while exiting after the run was stopped: exiting now.\n".encode())
    os._exit(code)


class _QuietAtExit:
    """An exit callback, registered when the first stop happens (so it runs before the exit callbacks registered
    earlier: ``atexit`` runs them last-in, first-out), that makes SIGTERM/SIGINT (and a requeue signal that stopped
    the run) end the exit quietly."""

    registered = False
    signals: tuple[int, ...] = SIGNALS

    def register(self, signum: int | None = None) -> None:
        if signum is not None and signum not in self.signals:
            self.signals = (*self.signals, signum)
        IGNORE_WHILE_FINALIZING.update(self.signals)  # and ignored after the exit callbacks (hflight._util)
        if not self.registered:
            self.registered = True
            atexit.register(self)

    def __call__(self) -> None:
        if _main_thread():
            for signum in self.signals:
                signal.signal(signum, _exit_now)


_quiet_at_exit = _QuietAtExit()


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class StopRequest:
    """Which signal asked this ``train()`` call to stop, if any; installed as the SIGTERM/SIGINT handler (and, under
    SLURM, as the requeue signal's)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.lightning_trainer: Any = None
        self.handed_over: dict[int, Any] = {}  # signal -> the handler that owns it (e.g. transformers' JIT checkpoint)
        self.global_step: int | None = None  # kept current by the caller, for the message of a second signal
        self.received_at = 0.0  # time.monotonic() of the first signal
        self.requeue_signal: int | None = None  # SLURM's requeue signal while it is handled here
        self.requeue = False  # a requeue was asked for (on any rank, once the ranks agreed)
        self.exiting = False  # the stop is complete (checkpoint written, job requeued): signals change nothing now

    def __call__(self, signum: int, frame: Any) -> None:
        if signum in self.handed_over:
            self._keep_lightning_going()
            owner = self.handed_over[signum]
            if callable(owner):
                owner(signum, frame)
            return
        name = signal_name(signum)
        if self.exiting:
            logger.info(f"{name} received while the stopped run exits: nothing more to do.")
            return
        if signum == self.requeue_signal:
            self._keep_lightning_going()
            if self.signum is not None:  # the same stop (srun and SLURM both deliver it), or a requeue on top of it
                self.requeue = True
                logger.info(f"{name} (the requeue signal) received again: already stopping; the job will be requeued.")
                return
            self.signum, self.received_at, self.requeue = signum, time.monotonic(), True
            logger.warning(
                f"Received {name}, SLURM's requeue signal: stopping after the current optimizer step to save a "
                "checkpoint and requeue the job."
            )
            return
        if self._duplicate(signum):
            self._keep_lightning_going()
            logger.info(f"{name} received again from the launcher or the process group: already stopping.")
            return
        if self.signum is not None:
            raise stopped(
                signum,
                f"Training stopped at once by a second {name} (after step {self.global_step}, mid-step): no "
                "checkpoint was written for this step.",
                self.global_step,
            )
        self.signum, self.received_at = signum, time.monotonic()
        self._keep_lightning_going()
        logger.warning(f"Received {name}: stopping after the current optimizer step (send it again to stop at once).")

    def drop_lightning_notifier(self) -> None:
        """With several processes, once Lightning registered its handlers (``on_train_start``): its SIGTERM
        notifier leaves the composed handler (see the module docstring); SLURM's handlers and this request stay."""
        world_size = getattr(self.lightning_trainer, "world_size", 1)
        composed = signal.getsignal(signal.SIGTERM) if _main_thread() and world_size > 1 else None
        handlers = getattr(composed, "signal_handlers", None)
        if handlers is not None:
            composed.signal_handlers = [h for h in handlers if getattr(h, "__name__", "") != "_sigterm_notifier_fn"]

    def _duplicate(self, signum: int) -> bool:
        """The signal already received, again within :data:`DUPLICATE_WINDOW` seconds, in a multi-process run."""
        world_size = getattr(self.lightning_trainer, "world_size", 1)
        recent = time.monotonic() - self.received_at < DUPLICATE_WINDOW
        return signum == self.signum and world_size > 1 and recent

    def agreed(self, strategy: Any) -> int | None:
        """The signal to stop for, the same on every rank: any rank's request stops them all, and any rank's requeue
        signal makes it a requeue (:attr:`requeue`, then the signal is the requeue signal); one all-reduce per step,
        and only with several processes. Once they agreed, the processes exit together (:func:`exit_together`)."""
        if strategy is None or strategy.world_size <= 1:
            return self.signum
        local = torch.tensor([float(self.signum or 0), float(self.requeue)], device=strategy.root_device)
        stop, requeue = (int(v) for v in strategy.reduce(local, reduce_op="max").tolist())
        if stop:
            exit_together(getattr(strategy, "launcher", None))
            self.requeue = bool(requeue)
            if self.requeue and self.requeue_signal is not None:
                return self.requeue_signal
        return stop or None

    def _keep_lightning_going(self) -> None:
        connector = getattr(self.lightning_trainer, "_signal_connector", None)
        if connector is not None:
            connector.received_sigterm = False  # Lightning would stop after this micro-batch; we stop after the step

    @contextlib.contextmanager
    def handling_signals(
        self, lightning_trainer: Any, handed_over: tuple[int, ...] = (), requeue_signal: int | None = None
    ) -> Iterator[StopRequest]:
        """Install this request as the SIGTERM/SIGINT handler (and ``requeue_signal``'s: SLURM's, see
        :func:`requeue_signal`) for the duration (main thread only); convert what Lightning raises for SIGTERM into
        :class:`TrainingInterrupted`. The ``handed_over`` signals go to the handler installed before (which decides
        what they mean), with Lightning kept from stopping on them."""
        self.lightning_trainer = lightning_trainer
        self.handed_over = {signum: signal.getsignal(signum) for signum in handed_over} if _main_thread() else {}
        self.requeue_signal = requeue_signal
        extra = (requeue_signal,) if requeue_signal is not None and requeue_signal not in SIGNALS else ()
        with _handlers(self, (*SIGNALS, *extra), after_stop=True), sigterm_exits_non_zero("Training"):
            yield self
            if self.signum is not None:  # arrived after the last step boundary: training had finished
                # raised inside the handlers' block, so that a second signal as it unwinds is this stop's
                message = (
                    f"{signal_name(self.signum)} arrived as training finished (step {self.global_step}); the run "
                    "stops before its remaining work."
                )
                if self.requeue:  # the ranks agree on no step any more: global rank 0 requeues, the others say so
                    from hflight.run.requeue import requeue_job, requeue_message

                    where = "the run folder's last checkpoint"
                    message += " " + requeue_message(requeue_job(), where, kept=False)
                raise stopped(self.signum, message, self.global_step)


def exit_together(launcher: Any) -> None:
    """The ranks agreed to stop and each will exit 143 (130): if this process launched others (rank 0 under
    Lightning's subprocess launcher, ``launcher.procs``), Lightning's child-process monitor must not take their exit
    code for a crash and SIGKILL everything, this process included; this process waits for them when it exits."""
    children = list(getattr(launcher, "procs", None) or [])
    if not children:
        return
    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

    for thread in threading.enumerate():
        if isinstance(thread, _ChildProcessObserver):
            thread._child_processes = []  # its next check ends it, quietly: the exit codes are ours to expect
    _AwaitLaunched(children).register()


class _AwaitLaunched:
    """An exit callback: wait until the processes this one launched have exited and say with which codes; those still
    running after :data:`CHILD_EXIT_TIMEOUT` seconds are killed."""

    registered: list[_AwaitLaunched] = []

    def __init__(self, children: list[Any]) -> None:
        self.children = children

    def register(self) -> None:
        if not self.registered:
            self.registered.append(self)
            atexit.register(self)

    def __call__(self) -> None:
        deadline = time.monotonic() + CHILD_EXIT_TIMEOUT
        while any(child.poll() is None for child in self.children) and time.monotonic() < deadline:
            time.sleep(0.05)
        for child in self.children:
            if child.poll() is None:
                logger.warning(f"Process {child.pid} launched by this one did not exit: killing it.")
                with contextlib.suppress(OSError):
                    child.kill()
                    child.wait(5)
        codes = ", ".join(f"{child.pid}: {child.returncode}" for child in self.children)
        logger.warning(f"The processes this one launched have exited (pid: exit code): {codes}.")


def requeue_signal(args: Any) -> int | None:
    """The signal that requeues the job: ``args.requeue_signal`` when SLURM launched this process (as Lightning
    detects it: srun's variables), else None (the signal keeps its default meaning)."""
    from hflight.arguments import cluster

    if not cluster.slurm_detected():
        return None
    found = cluster.parse_requeue_signal(getattr(args, "requeue_signal", "SIGUSR1"))
    return int(found) if found is not None else None


def handed_over_signals(args: Any) -> tuple[int, ...]:
    """The signals whose handling ``args`` gives to another owner during training: SIGTERM with
    ``enable_jit_checkpoint`` (transformers' ``JITCheckpointCallback`` checkpoints at the next step and ends the run
    normally, as with transformers.Trainer)."""
    return (signal.SIGTERM,) if args.enable_jit_checkpoint else ()


#: seconds after a stop during which SIGTERM/SIGINT again is taken as a second stop request (then the handler before)
AFTER_STOP_WINDOW = 10.0


@contextlib.contextmanager
def _handlers(handler: Any, signals: tuple[int, ...] = SIGNALS, after_stop: bool = False) -> Iterator[None]:
    """``handler`` for ``signals`` for the duration (main thread only), the handlers before put back after; with
    ``after_stop`` (training's), left by a stop (:class:`TrainingInterrupted`), each signal's next arrival soon after is
    that stop's (:class:`_AfterStop`): a second Ctrl-C 20 ms after the first, landing as the stop unwinds, ended the
    process with Python's raw ``KeyboardInterrupt`` and status -2."""
    if not _main_thread():  # signal handlers can only be set from the main thread
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in signals}
    for signum in signals:
        signal.signal(signum, handler)
    try:
        yield
    finally:
        stop = sys.exc_info()[1] if after_stop else None
        for signum, old in previous.items():
            old = old if old is not None else signal.SIG_DFL
            signal.signal(signum, _AfterStop(stop, old) if isinstance(stop, TrainingInterrupted) else old)


class _AfterStop:
    """A signal's handler while a stopped run unwinds: within :data:`AFTER_STOP_WINDOW` seconds, the signal again
    raises the stop once more (its exit status, a line saying so); then, or later, the handler before comes back
    (a notebook's kernel keeps its own Ctrl-C)."""

    def __init__(self, stop: TrainingInterrupted, previous: Any) -> None:
        self.stop, self.previous, self.at = stop, previous, time.monotonic()

    def __call__(self, signum: int, frame: Any) -> None:
        signal.signal(signum, self.previous)
        if time.monotonic() - self.at > AFTER_STOP_WINDOW:
            if callable(self.previous):
                self.previous(signum, frame)
            elif self.previous == signal.SIG_DFL:
                os.kill(os.getpid(), signum)
            return
        written = f"; {self.stop.checkpoint} was written before" if self.stop.checkpoint else ""
        step = f" (after step {self.stop.global_step})" if self.stop.global_step is not None else ""
        logger.warning(f"Training stopped at once by a second {signal_name(signum)}{step}{written}.")
        raise self.stop


@contextlib.contextmanager
def sigterm_exits_non_zero(what: str) -> Iterator[None]:
    """Lightning's ``SIGTERMException`` (a ``SystemExit`` with status 0) as :class:`TrainingInterrupted` (143):
    around ``validate`` outside of training, and as a safety net around ``fit``."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    try:
        yield
    except SIGTERMException:
        raise stopped(signal.SIGTERM, f"{what} stopped by SIGTERM (Lightning's handler).") from None


@contextlib.contextmanager
def sigterm_stops_between_batches(what: str) -> Iterator[Callable[[], None]]:
    """What Lightning's ``validate`` does on SIGTERM, for an evaluation hflight runs without it
    (``hflight.run.evaluation``): the signal is noted (a handler installed before still runs, as Lightning composes
    them), and the check this yields, called before each batch, raises :class:`TrainingInterrupted` (143) once it
    came. Outside the main thread nothing is installed (as Lightning)."""
    received = []
    if not _main_thread():
        yield lambda: None
        return
    previous = signal.getsignal(signal.SIGTERM)

    def note(signum: int, frame: Any) -> None:
        received.append(signum)
        if callable(previous):
            previous(signum, frame)

    def check() -> None:
        if received:
            raise stopped(signal.SIGTERM, f"{what} stopped by SIGTERM.")

    signal.signal(signal.SIGTERM, note)
    try:
        yield check
    finally:
        signal.signal(signal.SIGTERM, previous)


def _raise_now(signum: int, frame: Any) -> None:
    if _STOPPED:  # the run stopped already and its exception is on its way out
        _exit_now(signum, frame)
    raise stopped(signum, f"Terminated by {signal_name(signum)} outside of training: nothing to save.")


def _requeue_now(signum: int, frame: Any) -> None:
    from hflight.run.requeue import requeue_job, requeue_message

    if _STOPPED:
        _exit_now(signum, frame)
    outcome = requeue_job()
    message = requeue_message(outcome, "the run folder's last checkpoint (if it has one)", kept=False)
    raise stopped(signum, f"{signal_name(signum)} (SLURM's requeue signal) outside of training. {message}")


@contextlib.contextmanager
def terminate_on_signals(requeue_signal: int | None = None, process_exits: bool = False) -> Iterator[None]:
    """SIGTERM and SIGINT raise :class:`TrainingInterrupted` at once, and ``requeue_signal`` (under SLURM, see
    :func:`requeue_signal`) requeues the job first (``Trainer.train`` installs its own step-boundary handling
    inside). Once a signal stopped the run, the process is on its way out: a signal then ends it at once, with the
    stop's exit status (:func:`_exit_now`), and with ``process_exits`` (the command line, which exits after a stop)
    for the rest of the exit too; otherwise (a notebook) the previous handlers come back."""
    plain = tuple(signum for signum in SIGNALS if signum != requeue_signal)
    requeue = () if requeue_signal is None else (requeue_signal,)
    _STOPPED.clear()
    try:
        with _handlers(_raise_now, plain), _handlers(_requeue_now, requeue):
            yield
    finally:
        if process_exits and _STOPPED and _main_thread():  # a signal during the exit that follows ends it at once
            for signum in (*plain, *requeue):
                signal.signal(signum, _exit_now)
