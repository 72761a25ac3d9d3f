"""Faults a cluster delivers, at a chosen moment of a run started from the command line (tests only).

Added to a command as a callback: ``+callbacks.fault._target_=cluster_faults.SignalAt +callbacks.fault.step=3
+callbacks.fault.signal=SIGUSR1 +callbacks.fault.target=parent`` (``tests/jobs`` on PYTHONPATH). The signal is real and
sent by the process of global rank ``rank``, in the middle of optimizer step ``step`` (after its first micro-batch)
or, with ``moment="save"``, right after checkpoint-``step`` is on disk:

- ``target="parent"``: to the process that started this one (the srun stand-in, which delivers it to every task as
  SLURM's ``--signal`` does; torchrun's agent);
- ``target="self"``: to this process only (``SIGKILL``: a worker dying, as a node failure or the OOM killer would).

With ``moment="writing"`` the process of rank ``rank`` sends it to itself while it writes checkpoint-``step``: after
the weights, optimizer and RNG files, before ``trainer_state.json`` and the manifest (a half-written checkpoint).

Only on one attempt of the job, ``attempt`` (``TORCHELASTIC_RESTART_COUNT``/``SLURM_RESTART_COUNT``; 0, the default:
the first, the variables 0 or unset), so that a restarted run is not hit again by the same fault.
"""

from __future__ import annotations

import os
import signal

from transformers import TrainerCallback


class SignalAt(TrainerCallback):
    def __init__(self, step: int, signal: str = "SIGUSR1", target: str = "parent", rank: int = 0,
                 moment: str = "substep", attempt: int = 0) -> None:  # fmt: skip
        self.step, self.signal, self.target, self.rank, self.moment = step, signal, target, rank, moment
        restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get("SLURM_RESTART_COUNT") or "0"
        self.armed = int(restarts) == attempt
        if moment == "writing" and self.armed:
            self._kill_while_writing()

    def _kill_while_writing(self) -> None:
        from hflight.checkpoints import folders

        write_state = folders.write_trainer_state

        def write(facade, tracker):
            if facade.state.global_step == self.step:
                self._fire(facade.args)
            write_state(facade, tracker)

        folders.write_trainer_state = write

    def _fire(self, args) -> None:
        if not self.armed or args.process_index != self.rank:
            return
        self.armed = False
        pid = os.getppid() if self.target == "parent" else os.getpid()
        os.kill(pid, getattr(signal, self.signal))

    def on_substep_end(self, args, state, control, **kwargs):
        if self.moment == "substep" and state.global_step + 1 == self.step:
            self._fire(args)

    def on_step_end(self, args, state, control, **kwargs):  # no accumulation: no sub-steps
        if self.moment == "substep" and args.gradient_accumulation_steps == 1 and state.global_step + 1 == self.step:
            self._fire(args)

    def on_save(self, args, state, control, **kwargs):
        if self.moment == "save" and state.global_step == self.step:
            self._fire(args)
