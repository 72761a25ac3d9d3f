"""A callback that records ``trainer.accelerator.sync_gradients`` at each step event (transformers sets it per
micro-batch), for tests/test_accelerator_config.py and its torchrun job (tests/jobs/accelcfg_job.py)."""

from __future__ import annotations

from typing import Any

import transformers


class SyncRecorder(transformers.TrainerCallback):
    """Appends ``(event, trainer.accelerator.sync_gradients)`` to ``events`` at ``on_step_begin``,
    ``on_substep_end`` and ``on_step_end``; ``trainer`` may be set after construction."""

    def __init__(self, trainer: Any = None, events: list | None = None) -> None:
        self.trainer, self.events = trainer, events if events is not None else []

    def _record(self, event: str) -> None:
        self.events.append((event, self.trainer.accelerator.sync_gradients))

    def on_step_begin(self, args, state, control, **kwargs):
        self._record("begin")

    def on_substep_end(self, args, state, control, **kwargs):
        self._record("substep")

    def on_step_end(self, args, state, control, **kwargs):
        self._record("end")
