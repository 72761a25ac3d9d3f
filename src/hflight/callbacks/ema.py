"""A moving average of the weights, in the spirit of AllenNLP's ``ExponentialMovingAverage``.

Training updates the raw weights; after every optimizer step the average moves towards them. Evaluation (also
mid-training) and every saved model see the averaged weights; training then continues on the raw ones, bit for
bit. A checkpoint's ``model.safetensors`` holds the averaged weights (so ``from_pretrained`` gives the averaged
model) and ``ema_state.pt`` the raw weights and the update count, so a resumed run continues exactly. When
training ends the model keeps the averaged weights, so ``evaluate()`` and ``save_model()`` afterwards use them.

Example:
    >>> from hflight.callbacks.ema import EMACallback
    >>> trainer = Trainer(model, args, train_dataset=ds, callbacks=[EMACallback(decay=0.999)])  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import os
import pickle
from collections.abc import Iterator

import torch
from transformers.trainer_callback import TrainerCallback

from hflight.checkpoints.weights import refused_pickle
from hflight.checkpoints.writers.files import regular_file

STATE_FILE = "ema_state.pt"


class EMACallback(TrainerCallback):
    """Exponential moving average of the trainable parameters.

    Args:
        decay: the average keeps ``decay`` of itself per step (``shadow = decay * shadow + (1 - decay) * raw``).
        use_num_updates: AllenNLP's warm start: the effective decay is ``min(decay, (1 + n) / (10 + n))`` after
            ``n`` updates, so early averages are not dominated by the initial weights.
    """

    def __init__(self, decay: float = 0.9999, use_num_updates: bool = True) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMACallback: decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.use_num_updates = use_num_updates
        self.num_updates = 0
        self.shadow: dict[str, torch.Tensor] | None = None
        self._pending: tuple[str, dict | None] | None = None  # checked by check_checkpoint_state, not yet loaded

    # ---- averaging ---------------------------------------------------------------------------------------------
    @staticmethod
    def _params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
        return {name: p for name, p in model.named_parameters() if p.requires_grad}

    def _ensure_shadow(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        params = self._params(model)
        if self.shadow is None:
            self.shadow = {name: p.detach().clone() for name, p in params.items()}
        elif params and (first := next(iter(params))) and self.shadow[first].device != params[first].device:
            # the model moved (Lightning places it on the accelerator at fit start): follow it
            self.shadow = {name: t.to(params[name].device) for name, t in self.shadow.items()}
        return self.shadow

    def current_decay(self) -> float:
        if self.use_num_updates:
            return min(self.decay, (1 + self.num_updates) / (10 + self.num_updates))
        return self.decay

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._ensure_shadow(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        shadow = self._ensure_shadow(model)
        decay = self.current_decay()
        params = self._params(model)
        averages = [shadow[name] for name in params]
        raw = [p.detach() for p in params.values()]
        torch._foreach_mul_(averages, decay)
        torch._foreach_add_(averages, raw, alpha=1.0 - decay)
        self.num_updates += 1

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if self.shadow is not None:
            self._copy_in(model, self.shadow)

    # ---- the facade's weights protocol --------------------------------------------------------------------------
    def _copy_in(self, model: torch.nn.Module, values: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, p in self._params(model).items():
                p.copy_(values[name])

    @contextlib.contextmanager
    def averaged_weights(self, model: torch.nn.Module) -> Iterator[None]:
        """The averaged weights in ``model`` for the duration (evaluation, saving); the raw ones restored after."""
        if self.shadow is None:
            yield
            return
        raw = {name: p.detach().clone() for name, p in self._params(model).items()}
        self._copy_in(model, self.shadow)
        try:
            yield
        finally:
            self._copy_in(model, raw)

    def save_checkpoint_state(self, folder: str, model: torch.nn.Module) -> None:
        """Raw weights and update count next to the (averaged) model files."""
        raw = {name: p.detach().cpu().clone() for name, p in self._params(model).items()}
        torch.save({"raw": raw, "num_updates": self.num_updates, "decay": self.decay}, os.path.join(folder, STATE_FILE))

    def check_checkpoint_state(self, folder: str, model: torch.nn.Module) -> None:
        """Read and check ``ema_state.pt`` before the facade copies any weight in (a bad file changes nothing)."""
        self._pending = (folder, self._read_state(folder, model))

    def load_checkpoint_state(self, folder: str, model: torch.nn.Module) -> None:
        """After the facade loaded ``model.safetensors`` (the averages): averages -> shadow, raw -> model."""
        pending, self._pending = self._pending, None
        saved = pending[1] if pending is not None and pending[0] == folder else self._read_state(folder, model)
        if saved is None:
            return  # a checkpoint written without EMA: start averaging from its weights
        params = self._params(model)
        self.shadow = {name: p.detach().clone() for name, p in params.items()}
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(saved["raw"][name].to(p.device))
        self.num_updates = int(saved["num_updates"])

    def _read_state(self, folder: str, model: torch.nn.Module) -> dict | None:
        path = regular_file(folder, STATE_FILE)  # a regular file inside the folder, or None
        if path is None:
            return None
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:  # refers to objects beyond tensors: never unpickled
            raise refused_pickle(path, exc, "tensors and plain values") from None
        try:
            raw, num_updates = saved["raw"], int(saved["num_updates"])
        except Exception as exc:
            raise ValueError(f"Cannot read the moving-average state {path}: {type(exc).__name__}: {exc}") from exc
        params = self._params(model)
        missing = sorted(set(params) - set(raw))
        if missing:
            raise ValueError(f"{path} lacks raw weights for {missing[:5]}: written for another model?")
        wrong = [n for n, p in params.items() if not torch.is_tensor(raw[n]) or raw[n].shape != p.shape]
        if wrong:
            raise ValueError(f"{path} has raw weights of the wrong shape for {wrong[:5]}: written for another model?")
        return {"raw": raw, "num_updates": num_updates}
