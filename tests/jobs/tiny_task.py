"""A task for sweep tests (``--config-dir tests/jobs/sweep_conf task=tiny``): hflight's Trainer fitting y = 3x - 1 with
one linear layer, in a second, so that a sweep's behaviour (trials, pruning, kills, launchers) is tested through real
``hflight-train`` jobs without MRC's data and model. ``TINY_MARK`` names a folder where each job writes ``<job
number>.started`` when its training starts (its torch threads, its pid and the global step it starts from: 0, or a
resumed checkpoint's) and appends the global step of each logged training loss to ``<job number>.logged``.
``TINY_HOLD`` (a global step, or ``<job number>:<step>`` for one job, with ``TINY_MARK``) holds each job (or that
one) at the end of that step, once it wrote ``<job number>.held``, until a SIGTERM or SIGINT reached it (and its own
handler ran): a test that signals or kills a batch of jobs then knows the step where each one is, whatever the
machine's load made of their speeds."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from transformers import TrainerCallback

import hflight


class Line(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(1, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = self.linear(x.unsqueeze(-1)).squeeze(-1)
        result = {"logits": out}
        if labels is not None:
            result["loss"] = torch.nn.functional.mse_loss(out, labels)
        return result


class _Marks(TrainerCallback):
    def __init__(self, mark: str | None, hold: str | None) -> None:
        self.mark = mark
        job, _, step = (hold or "").rpartition(":")  # "<step>" or "<job number>:<step>"
        self.hold_job, self.hold_step = (int(job) if job else None), (int(step) if step else None)

    @staticmethod
    def _job() -> int:
        return HydraConfig.get().job.num if HydraConfig.initialized() else 0

    def _mark(self, suffix: str) -> Path:
        return Path(self.mark, f"{self._job()}.{suffix}")

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.mark:
            self._mark("started").write_text(f"{torch.get_num_threads()}\n{os.getpid()}\n{state.global_step}\n")

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if self.mark and "loss" in (logs or {}):
            with self._mark("logged").open("a") as handle:
                handle.write(f"{state.global_step}\n")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.mark and state.global_step == self.hold_step and self.hold_job in (None, self._job()):
            self._hold_until_signalled(state.global_step)

    def _hold_until_signalled(self, step: int) -> None:
        """Writes ``<job>.held``, then waits (at most 120 s) for a SIGTERM or SIGINT, which the run's own handler
        also gets: it asks the run to stop at this step's boundary."""
        arrived = []

        def note(signum: int, frame: Any, handler: Any) -> None:
            arrived.append(signum)
            if callable(handler):
                handler(signum, frame)

        handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
        for signum, handler in handlers.items():
            signal.signal(signum, lambda n, f, handler=handler: note(n, f, handler))
        self._mark("held").write_text(f"{step}\n")
        deadline = time.monotonic() + 120
        while not arrived and time.monotonic() < deadline:
            time.sleep(0.05)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def _data(n: int, seed: int) -> list[dict[str, float]]:
    g = torch.Generator().manual_seed(seed)
    xs = torch.rand(n, generator=g) * 2 - 1
    return [{"x": float(x), "labels": float(3 * x - 1)} for x in xs]


class TinyRun:
    def __init__(self, trainer: hflight.Trainer) -> None:
        self.trainer, self.objects = trainer, {}

    def num_samples(self, split: str) -> int:
        return len(self.trainer.train_dataset if split == "train" else self.trainer.eval_dataset)

    def predict(self, split: str) -> Any:
        return self.trainer.predict(self.trainer.eval_dataset)


class TinyTask:
    def setup(self, cfg: Any, args: hflight.TrainingArguments, callbacks: list[Any]) -> TinyRun:
        marks = _Marks(os.environ.get("TINY_MARK"), os.environ.get("TINY_HOLD"))
        trainer = hflight.Trainer(
            Line(), args, train_dataset=_data(64, 1), eval_dataset=_data(32, 2), callbacks=[*callbacks, marks]
        )
        return TinyRun(trainer)
