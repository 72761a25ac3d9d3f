"""One side of the field sweep's comparison (tests/test_field_sweep.py), a support module that the sweep's child
processes import (its fork server): train, evaluate and predict with one
library's Trainer and arguments, and what the two sides are compared on, every file by its content."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch
import transformers

import hflight

from .support import HFLIGHT_ONLY, Factory

TIMES = ("runtime", "per_second")


def _files(folder: str) -> dict[str, str]:
    """Every file the run wrote (relative name -> :func:`_content`), but hflight's own checkpoint manifest and the
    logging folders of integrations this setting does not use."""
    found = {}
    for root, dirs, names in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("runs", "lightning_logs")]
        for name in names:
            if (not name.startswith(".") or name == ".metadata") and name not in HFLIGHT_ONLY:
                path = os.path.join(root, name)
                found[os.path.relpath(path, folder)] = _content(path, folder)
    return dict(sorted(found.items()))


def _content(path: str, folder: str) -> str:
    """A digest of what the file holds, equal on both sides when the contents are: JSON (``trainer_state.json``,
    ``config.json``) parsed, without timings; ``torch.save`` files (optimizer, scheduler, RNG states, the training
    arguments) loaded, tensors and arrays by dtype, shape and bytes, the arguments by ``to_dict()``, without hflight's
    own ``hflight_*`` entries (the RNG file's epoch-start states); anything else (the weights) byte for byte. Each
    side's output folder is named ``<output_dir>`` (each run writes into its own)."""
    digest = hashlib.sha256()
    if path.endswith(".json"):
        digest.update(json.dumps(_canonical(json.loads(Path(path).read_text()), folder), sort_keys=True).encode())
    elif path.endswith(".metadata"):  # a distributed checkpoint's index: what it holds, not its ids and paths
        from hflight.checkpoints.sharded import read_metadata

        entries = read_metadata(Path(path).parent).state_dict_metadata
        digest.update(repr(sorted((k, repr(v)) for k, v in entries.items())).encode())
    elif path.endswith((".pt", ".pth", ".bin")):
        digest.update(repr(_canonical(torch.load(path, weights_only=False), folder)).encode())
    else:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()


def _canonical(value, folder: str):
    """``value`` as plain, comparable data (see :func:`_content`)."""
    if isinstance(value, dict):
        return {str(k): _canonical(v, folder) for k, v in sorted(value.items(), key=lambda item: str(item[0]))
                if not str(k).startswith("hflight_") and not any(t in str(k) for t in TIMES)}  # fmt: skip
    if isinstance(value, (list, tuple)):
        return [_canonical(v, folder) for v in value]
    if isinstance(value, str):
        return value.replace(folder, "<output_dir>")
    if isinstance(value, torch.Tensor):  # any dtype (bfloat16 has no numpy twin): its bytes
        data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return [str(value.dtype), list(value.shape), hashlib.sha256(data).hexdigest()]
    if isinstance(value, np.ndarray):
        return [str(value.dtype), list(value.shape), hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()]
    if isinstance(value, transformers.TrainingArguments):
        return _canonical(value.to_dict(), folder)
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return repr(value)


def run_field(library: str, out: str, fields: dict) -> dict:
    """One side of one field's comparison, run in a process of its own (test_field_sweep.py's ``fresh`` fixture):
    train, evaluate and predict with ``library``'s Trainer and arguments, and return what the two sides are compared
    on."""
    module = {"transformers": transformers, "hflight": hflight}[library]
    args = module.TrainingArguments(output_dir=out, **Factory.pair_args(**fields))
    train, evaluation = Factory.cls_dataset(16), Factory.cls_dataset(8, seed=1)
    trainer = module.Trainer(Factory.cls_model(), args, train_dataset=train, eval_dataset=evaluation)
    output = trainer.train()
    metrics = trainer.evaluate()
    prediction = trainer.predict(evaluation)
    return {
        "pid": os.getpid(),
        "log_history": trainer.state.log_history,
        "global_step": output.global_step,
        "metrics": metrics,
        "predictions": prediction.predictions,
        "files": _files(out),
    }
