"""Checkpoint files never run code: RNG states, ``pytorch_model.bin`` weights, optimizer states and the EMA state
are loaded with ``weights_only`` (a crafted pickle is refused, naming the file; its code never runs), and the RNG
files transformers writes load that way too.

The runs are in-process (tests/checkpoint_runs.py)."""

from __future__ import annotations

import pytest
import torch

from hflight.checkpoints.parts import load_rng_file
from hflight.checkpoints.weights import load_model_weights

from .checkpoint_runs import CreatesMarker, copy_checkpoint, make_trainer, params, refresh_manifest


def test_a_malicious_rng_state_is_never_unpickled(saved, tmp_path, factory):
    folder = copy_checkpoint(saved, tmp_path)
    marker = tmp_path / "pwned"
    rng_file = folder / "rng_state.pth"
    states = torch.load(rng_file, weights_only=False)
    states["python"] = CreatesMarker(marker)
    torch.save(states, rng_file)
    refresh_manifest(folder)

    trainer = make_trainer(tmp_path / "out", factory)
    before = params(trainer)
    with pytest.raises(ValueError, match=r"rng_state\.pth cannot be loaded safely.*refers to io\.open"):
        trainer.train(resume_from_checkpoint=str(folder))
    assert not marker.exists()
    assert all(torch.equal(before[k], v) for k, v in params(trainer).items()), "checked before the model is touched"
    with pytest.raises(ValueError, match="rng_state.pth cannot be loaded safely"):
        load_rng_file(rng_file)
    assert not marker.exists()
    torch.load(rng_file, weights_only=False)  # the control: unpickled the unsafe way, the file does run code
    assert marker.exists()


def test_rng_states_written_by_transformers_load_safely(tmp_path):
    import random

    import numpy as np

    states = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    torch.save(states, tmp_path / "rng_state.pth")
    loaded = load_rng_file(tmp_path / "rng_state.pth")
    assert loaded["python"] == states["python"] and np.array_equal(loaded["numpy"][1], states["numpy"][1])
    torch.save({"python": (3, (1, 2), None), "numpy": states["numpy"], "cpu": states["cpu"]}, tmp_path / "bad.pth")
    with pytest.raises(ValueError, match="bad.pth does not hold valid RNG states"):
        load_rng_file(tmp_path / "bad.pth")


def test_weights_in_pytorch_bin_load_with_weights_only_and_a_crafted_one_is_refused(tmp_path, factory):
    source, target = factory.qa_model(seed=1), factory.qa_model(seed=2)
    torch.save(source.state_dict(), tmp_path / "pytorch_model.bin")
    load_model_weights(target, tmp_path)
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in source.state_dict().items())
    marker = tmp_path / "pwned"
    torch.save({**source.state_dict(), "extra": CreatesMarker(marker)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin cannot be loaded safely.*refers to io\.open"):
        load_model_weights(target, tmp_path)
    assert not marker.exists()


def test_a_crafted_ema_state_is_refused_as_unsafe(saved, tmp_path, factory):
    from hflight.callbacks.ema import STATE_FILE, EMACallback
    from hflight.checkpoints.writers.files import UnsafeCheckpointFile

    folder = copy_checkpoint(saved, tmp_path)
    marker = tmp_path / "pwned"
    torch.save({"raw": CreatesMarker(marker), "num_updates": 1}, folder / STATE_FILE)
    refresh_manifest(folder)
    trainer = make_trainer(tmp_path / "out", factory, callbacks=[EMACallback(decay=0.9)])
    with pytest.raises(UnsafeCheckpointFile) as error:
        trainer.train(resume_from_checkpoint=str(folder))
    assert str(error.value).startswith(f"{folder / STATE_FILE} cannot be loaded safely: it holds objects other than")
    assert "weights_only=False" not in str(error.value) and not marker.exists()
