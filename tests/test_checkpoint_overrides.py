"""What a ``Trainer`` subclass and a callback write into ``checkpoint-N`` after its save, with ``save_async``.

``_save_checkpoint`` is an override point: when ``super()._save_checkpoint`` returns, ``checkpoint-N`` exists for the
override to write into (TRL's ``GRPOTrainer`` writes its adaptive-entropy state so), and what it writes is kept in the
published checkpoint, as in a synchronous save. ``on_save`` comes before the background publication.
"""

from __future__ import annotations

import errno
import json
import os
import time

import pytest
import transformers
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

import hflight
from hflight.checkpoints import folders, job
from hflight.checkpoints.manifest import get_last_checkpoint, verify_checkpoint
from hflight.checkpoints.names import MANIFEST_NAME

from .checkpoint_runs import make_trainer

STATE_FILE = "entropy_ctrl_state.json"


class SavesItsOwnState(hflight.Trainer):
    """TRL's ``GRPOTrainer`` with ``use_adaptive_entropy=True`` (trl/trainer/grpo_trainer.py): its state written into
    ``checkpoint-N`` after ``super()._save_checkpoint``, on the process that saves, and read back at resume."""

    entropy_coef = 0.5
    restored: dict | None = None

    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            checkpoint_folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            output_dir = os.path.join(self._get_output_dir(trial=trial), checkpoint_folder)
            with open(os.path.join(output_dir, STATE_FILE), "w") as f:
                json.dump({"entropy_coef": self.entropy_coef, "step": self.state.global_step}, f)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None and os.path.exists(os.path.join(checkpoint, STATE_FILE)):
            with open(os.path.join(checkpoint, STATE_FILE)) as f:
                self.restored = json.load(f)


class LooksAfterAWhile(transformers.TrainerCallback):
    """At on_save, waits until the background write has written the manifest (the last file, before the publication),
    and 0.5 s more, then looks whether the checkpoint was published (its manifest in ``checkpoint-N``)."""

    def __init__(self) -> None:
        self.seen: dict[int, tuple[bool, bool]] = {}

    def on_save(self, args, state, control, **kwargs):
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        written = [os.path.join(folder, MANIFEST_NAME),
                   os.path.join(args.output_dir, f".tmp-checkpoint-{state.global_step}", MANIFEST_NAME)]  # fmt: skip
        deadline = time.monotonic() + 20
        while not any(map(os.path.exists, written)) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)  # what the publication of this small checkpoint would take, had it not waited
        self.seen[state.global_step] = (os.path.isdir(folder), os.path.exists(written[0]))


def _trainer(cls, out, factory, callbacks=(), **overrides) -> hflight.Trainer:
    """``make_trainer``'s run, as an instance of ``cls``."""
    made = make_trainer(out, factory, **overrides)
    return cls(made.model, made.args, train_dataset=made.train_dataset, eval_dataset=made.eval_dataset,
               callbacks=list(callbacks))  # fmt: skip


def test_a_save_checkpoint_override_writes_into_checkpoint_n_after_super_with_save_async(tmp_path, factory):
    """With save_async the folder is written in the background; ``checkpoint-N`` is there (empty) when
    ``super()._save_checkpoint`` returns, the override's file (written after it, as TRL's GRPOTrainer writes it) is in
    every published checkpoint, the checkpoints verify, and a resume reads it."""
    out, callback = tmp_path / "run", LooksAfterAWhile()
    trainer = _trainer(SavesItsOwnState, out, factory, [callback], max_steps=6, save_steps=2, save_async=True)
    trainer.train()  # raised FileNotFoundError at checkpoint-2: the folder did not exist yet
    assert callback.seen == {2: (True, False), 4: (True, False), 6: (True, True)}  # on_save: there, not published
    for step in (2, 4, 6):  # 2 and 4 in the background (published after on_save), 6 the last (waited for)
        folder = out / f"checkpoint-{step}"
        assert json.loads((folder / STATE_FILE).read_text()) == {"entropy_coef": 0.5, "step": step}
        assert verify_checkpoint(folder, full=True) is not None
    assert not list(out.glob(".tmp-*"))
    assert get_last_checkpoint(out) == str(out / "checkpoint-6")
    resumed = _trainer(SavesItsOwnState, out, factory, max_steps=6, save_steps=2, save_async=True)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert resumed.restored == {"entropy_coef": 0.5, "step": 4}


def test_a_failed_background_write_removes_the_folder_the_override_wrote_into(tmp_path, factory, monkeypatch):
    """The write of checkpoint-4 fails in the background: the run stops with the write's error (not the override's),
    and no partial checkpoint-4 is left, only the earlier checkpoint."""
    real = job.CheckpointJob.write_later  # the background writer's steps

    def full_disk(self, file, step):
        if self.final_dir.endswith("checkpoint-4"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.path.join(self.folder, file or "model"))
        real(self, file, step)

    monkeypatch.setattr(job.CheckpointJob, "write_later", full_disk)
    out = tmp_path / "run"
    trainer = _trainer(SavesItsOwnState, out, factory, max_steps=8, save_steps=2, save_async=True)
    with pytest.raises(folders.CheckpointWriteError, match=r"checkpoint-4.*optimizer\.pt failed: no space left"):
        trainer.train()
    assert sorted(p.name for p in out.glob("*checkpoint-*")) == ["checkpoint-2"]
    assert (out / "checkpoint-2" / STATE_FILE).is_file()


def test_on_save_comes_before_the_background_publication(tmp_path, factory):
    """With save_async, on_save comes before the checkpoint is published (the publication waits for it); the run's
    last checkpoint is published before its on_save. Without a ``_save_checkpoint`` override nothing is made under the
    checkpoint's name before its publication (with one, see above)."""
    out, callback = tmp_path / "run", LooksAfterAWhile()
    make_trainer(out, factory, max_steps=4, save_steps=2, save_async=True, callbacks=[callback]).train()
    assert callback.seen == {2: (False, False), 4: (True, True)}
    assert verify_checkpoint(out / "checkpoint-2", full=True) is not None
