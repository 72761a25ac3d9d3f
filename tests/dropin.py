"""Shared steps of the drop-in tests of transformers' example scripts (issue 23): copy a script folder, run it in a
subprocess as written (transformers' trainer) and with its one trainer-import line changed to hflight's, and compare
the two output folders number for number."""

from __future__ import annotations

import json
import random
import re
import shutil
import sys
from pathlib import Path

import pytest

from . import launch, seq2seq_data
from .support import HFLIGHT_ONLY

SCRIPTS = Path(__file__).resolve().parent / "scripts"
REPO_ROOT = launch.REPO_ROOT
TIMINGS = ("_runtime", "_samples_per_second", "_steps_per_second")


#: how transformers users start several processes: the script under torchrun, nothing else named
TORCHRUN_2 = launch.torchrun(2)
#: the one line of an example script that names transformers' Trainer, and what a user changes it to
ORIGINAL_IMPORT = "from transformers import Trainer\n"
CHANGED_IMPORT = "from hflight import Trainer\n"


class Job:
    """``tests/scripts/<example>`` copied to ``folder`` and ``<example>.py`` started with ``args`` (``--output_dir``
    is ``folder/out``), after replacing the line ``original`` by ``changed`` when given; ``launcher``: the command
    that starts the script (``python``, or :data:`TORCHRUN_2`); ``path``: folders put first on ``PYTHONPATH`` (a test
    stand-in's ``sitecustomize``); ``env``: variables added to the environment. :meth:`out` waits for it and returns
    the output folder."""

    def __init__(self, folder: Path, example: str, original: str, changed: str | None, args: list[str],
                 launcher: list[str] | None = None, path: list[Path] = (),
                 env: dict[str, str] | None = None) -> None:  # fmt: skip
        shutil.copytree(SCRIPTS / example, folder)
        script = folder / f"{example}.py"
        source = script.read_text(encoding="utf-8")
        assert source.count(original) == 1
        if changed is not None:
            script.write_text(source.replace(original, changed), encoding="utf-8")
        command = [*(launcher or [sys.executable]), script.name, *args, "--output_dir", str(folder / "out"),
                   "--seed", "0", "--report_to", "none", "--disable_tqdm", "true"]  # fmt: skip
        self.folder = folder
        self.job = launch.Job(command, folder, launch.environment(*path, **(env or {})), merge=False)

    def out(self) -> Path:
        """The output folder, once the job exited 0 (its output kept in ``console.txt``)."""
        self.job.ok()
        return self.folder / "out"


def run(folder: Path, example: str, original: str, changed: str | None, args: list[str],
        launcher: list[str] | None = None) -> Path:  # fmt: skip
    """One :class:`Job`, waited for; returns its output folder."""
    return Job(folder, example, original, changed, args, launcher).out()


def both(root: Path, example: str, original: str, changed: str, args: list[str],
         launcher: list[str] | None = None) -> dict[str, Path]:  # fmt: skip
    """The script as written (``transformers``) and with its import changed (``hflight``), side by side (each job
    takes one thread per process)."""
    jobs = {"transformers": Job(root / "transformers", example, original, None, args, launcher),
            "hflight": Job(root / "hflight", example, original, changed, args, launcher)}  # fmt: skip
    return {name: job.out() for name, job in jobs.items()}


def crossed(job, root: Path, args: list[str], outs: dict[str, Path], checkpoint: str = "checkpoint-5") -> dict:
    """Each library's run of ``args`` resumed from the other's ``checkpoint`` (``outs``: the two output folders),
    named ``<library>_from_<other>``; ``job(folder, library, args)`` starts one; returns their output folders."""
    jobs = {f"{library}_from_{other}": job(root / f"{library}_from_{other}", library,
                                           [*args, "--resume_from_checkpoint", str(outs[other] / checkpoint)])
            for library, other in (("hflight", "transformers"), ("transformers", "hflight"))}  # fmt: skip
    return {name: started.out() for name, started in jobs.items()}


def clm_inputs(root: Path) -> dict[str, Path]:
    """What run_clm.py reads: :func:`seq2seq_data.clm_inputs`."""
    return seq2seq_data.clm_inputs(root)


def _glue_records(n: int, seed: int) -> list[dict]:
    """Sentence pairs of 3-8 random words, labelled "same" when they start with the same word, else "different"."""
    rng = random.Random(seed)
    words = seq2seq_data.WORDS
    records = []
    for _ in range(n):
        first = [rng.choice(words) for _ in range(rng.randint(3, 8))]
        second = [rng.choice(words) for _ in range(rng.randint(3, 8))]
        if rng.random() < 0.5:
            second[0] = first[0]
        label = "same" if first[0] == second[0] else "different"
        records.append({"sentence1": " ".join(first), "sentence2": " ".join(second), "label": label})
    return records


def glue_inputs(root: Path) -> dict[str, Path]:
    """What run_glue.py reads: sentence-pair files (train, validation, test) and a tiny BERT classifier saved with
    the WordPiece tokenizer."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    root.mkdir(parents=True)
    paths = {name: seq2seq_data.write_jsonl(root / f"{name}.json", _glue_records(n, seed))
             for name, n, seed in (("train", 40, 1), ("validation", 16, 2), ("test", 16, 3))}  # fmt: skip
    tokenizer = seq2seq_data.tokenizer(root / "tokenizer")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, num_labels=2)  # fmt: skip
    paths["model"] = root / "model"
    BertForSequenceClassification(config).save_pretrained(paths["model"])
    tokenizer.save_pretrained(paths["model"])
    return paths


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def largest_difference(a, b) -> float:
    return abs(a - b) if isinstance(a, (int, float)) and isinstance(b, (int, float)) else 0.0


def assert_same_results(runs: dict[str, Path], names: tuple[str, ...], rel: float = 0) -> None:
    """The ``*_results.json`` files hold the same keys and the same numbers (timings aside), exactly unless a test
    names a measured cause for ``rel``."""
    for name in names:
        theirs, ours = (read_json(runs[k] / name) for k in ("transformers", "hflight"))
        assert set(ours) == set(theirs), name
        for key, value in theirs.items():
            if not key.endswith(TIMINGS):
                assert ours[key] == pytest.approx(value, rel=rel, abs=0), (name, key, value, ours[key])


def assert_same_log_history(runs: dict[str, Path], min_losses: int, rel: float = 0) -> None:
    """``trainer_state.json``'s ``log_history``: same entries, same keys, same losses, gradient norms, learning
    rates and evaluation metrics (timings aside)."""
    theirs, ours = (read_json(runs[k] / "trainer_state.json")["log_history"] for k in ("transformers", "hflight"))
    assert len(ours) == len(theirs) and sum("loss" in e for e in theirs) >= min_losses
    for a, b in zip(theirs, ours, strict=True):
        assert set(a) == set(b), (a, b)
        for key, value in a.items():
            if not key.endswith(TIMINGS):
                assert b[key] == pytest.approx(value, rel=rel, abs=0), (a["step"], key, value, b[key])


def files(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def assert_same_files(runs: dict[str, Path], same_text: tuple[str, ...] = ("config.json", "README.md")) -> None:
    """The same set of files (hflight's checkpoint manifests aside), and the same text in ``same_text``."""
    theirs, ours = (files(runs[k]) for k in ("transformers", "hflight"))
    assert {f for f in ours if f.rsplit("/", 1)[-1] not in HFLIGHT_ONLY} == theirs
    for name in same_text:
        assert (runs["hflight"] / name).read_text() == (runs["transformers"] / name).read_text(), name


def _same(a, b, where: str, differences: list[str]) -> None:
    """Record where ``a`` and ``b`` (loaded checkpoint parts: tensors, numbers, containers) are not bit-identical."""
    import numpy as np
    import torch

    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)):
            differences.append(where)
    elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
        if not (same and a.shape == b.shape and torch.equal(a, b)):
            differences.append(where)
    elif isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            differences.append(f"{where}: keys {sorted(map(str, set(a) ^ set(b)))}")
        for key in set(a) & set(b):
            _same(a[key], b[key], f"{where}/{key}", differences)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and type(a) is type(b):
        if len(a) != len(b):
            differences.append(f"{where}: {len(a)} vs {len(b)} items")
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}/{i}", differences)
    elif type(a) is type(b) and hasattr(a, "__dict__") and not isinstance(a, type):  # an object: its attributes
        _same(vars(a), vars(b), where, differences)
    elif a != b and not (a != a and b != b):  # NaN equals NaN here
        differences.append(f"{where}: {a!r} vs {b!r}")


def _without_timings(state: dict) -> dict:
    history = [{k: v for k, v in e.items() if not k.endswith(TIMINGS)} for e in state.get("log_history", [])]
    return {**state, "log_history": history}


#: what hflight adds to a file transformers also writes: the RNG state an epoch began with (a mid-epoch resume
#: draws that epoch's order from it, docs/checkpoints.md); one RNG file per process with several
HFLIGHT_ADDITIONS = {r"rng_state(_\d+)?\.pth": ("hflight_epoch_start",)}

#: what each file holds, loaded for the comparison (training_args.bin holds each library's own arguments class)
_LOADERS = {
    r".*\.safetensors": lambda path: __import__("safetensors.torch").torch.load_file(path),
    r"optimizer\.pt": lambda path: __import__("torch").load(path, weights_only=True),
    r"scheduler\.pt": lambda path: __import__("torch").load(path, weights_only=True),
    r"rng_state(_\d+)?\.pth": lambda path: __import__("torch").load(path, weights_only=False),
    r"trainer_state\.json": lambda path: _without_timings(read_json(path)),
    # DeepSpeed's own checkpoint files (pickles it writes; loaded here only to compare what they hold)
    r"(bf16_)?(zero_pp_rank_\d+_)?mp_rank_\d+_(model|optim)_states\.pt": lambda path: __import__("torch").load(
        path, weights_only=False
    ),
}


def distributed_checkpoint(folder: Path) -> dict:
    """Every tensor a ``torch.distributed.checkpoint`` folder holds, whole (read by this process alone)."""
    from hflight.checkpoints.sharded import load_dcp, read_metadata

    entries = read_metadata(folder).state_dict_metadata
    state = {key: torch_empty(entry) for key, entry in entries.items() if hasattr(entry, "chunks")}
    load_dcp(folder, state, collective=False)
    return state


def torch_empty(entry):
    import torch

    return torch.empty(tuple(entry.size), dtype=entry.properties.dtype)


def assert_same_training_state(runs: dict[str, Path]) -> int:
    """Every weights file, optimizer, scheduler, RNG state, ``trainer_state.json`` (timings aside) and
    distributed-checkpoint folder (its tensors, whole) of the run folder and its checkpoints, bit for bit between the
    two trainers. Returns how many files and folders were compared."""
    theirs, ours = runs["transformers"], runs["hflight"]
    differences: list[str] = []
    compared = 0
    for folder in sorted({p.parent for p in theirs.rglob(".metadata")}):
        relative = folder.relative_to(theirs)
        _same(distributed_checkpoint(folder), distributed_checkpoint(ours / relative), str(relative), differences)
        compared += 1
    for relative in sorted(files(theirs)):
        name = relative.rsplit("/", 1)[-1]
        loader = next((load for pattern, load in _LOADERS.items() if re.fullmatch(pattern, name)), None)
        if loader is None:
            continue
        mine = loader(ours / relative)
        additions = next((keys for pattern, keys in HFLIGHT_ADDITIONS.items() if re.fullmatch(pattern, name)), ())
        for key in additions:
            mine.pop(key)  # hflight's own addition, named (KeyError if it is gone)
        _same(loader(theirs / relative), mine, relative, differences)
        compared += 1
    assert not differences, differences[:20]
    assert compared > 0
    return compared
