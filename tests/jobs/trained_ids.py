"""The oracle of trained examples (issue 66): what each optimizer step trained, compared between a resumed run, the
uninterrupted run and transformers' own resume of the same script. Every data feature is tested through it.

- Each example's id is coded into its first two tokens (:func:`example`, :func:`ids_of`), so the ids a batch holds
  are read back from the batch itself, whatever the pipeline did to it (a ``map``, a ``batch``, a collator).
- :func:`spying` makes a ``Trainer`` subclass (of hflight's or transformers') whose ``compute_loss`` records, per
  optimizer step, the ids it trained (``trainer.trained``: step -> ids, in order, this process's only).
- :data:`PRODUCED` counts the examples a source produced (a shared counter: loader workers are forked).
- :func:`chain` runs a script uninterrupted with a checkpoint every ``SAVE`` steps, then resumes from the uninterrupted
  run's first checkpoint, from that resumed run's next checkpoint, and so on (a second and a third resume from
  resumed runs' own checkpoints); :func:`mismatch` says where a resumed run trained other ids than the uninterrupted
  one (None: it trained the same, step for step).

:func:`source` builds every kind of stream the grid covers, each example counted as it is produced. The defaults: 64
examples, batches of 4 (a pass of 16 steps), 40 steps, a checkpoint every 8: checkpoint 8 is mid-pass, 16 a pass's
end, 24 mid the second pass.

A support module (tests import it, and so do the torchrun jobs: ``python trained_ids.py OUT --cells ...`` runs each
cell's chain on every process of a launch, writing ``OUT/<cell>/rank<R>.json``).
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import os
import shutil
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch

N, BATCH, STEPS, SAVE = 64, 4, 40, 8
#: ids are coded in base 90 into two tokens of a vocabulary of 100 (ids below 8100)
_BASE, _OFFSET, LENGTH = 90, 5, 8
PRODUCED = multiprocessing.get_context("fork").Value("i", 0)


def example(index: int) -> dict[str, Any]:
    """Example ``index``: its id in its first two tokens, the rest a function of it; label ``index % 3``."""
    rest = [_OFFSET + (index * 7 + k * 13) % _BASE for k in range(LENGTH - 2)]
    tokens = [_OFFSET + index // _BASE, _OFFSET + index % _BASE, *rest]
    return {"input_ids": tokens, "attention_mask": [1] * LENGTH, "labels": index % 3}


def ids_of(input_ids: Any) -> list[int]:
    """The ids of a batch's rows."""
    rows = input_ids.tolist() if torch.is_tensor(input_ids) else input_ids
    return [(row[0] - _OFFSET) * _BASE + row[1] - _OFFSET for row in rows]


def counted(item: Any) -> Any:
    with PRODUCED.get_lock():
        PRODUCED.value += 1
    return item


def reset_count() -> None:
    with PRODUCED.get_lock():
        PRODUCED.value = 0


def produced() -> int:
    return PRODUCED.value


def tensors(item: dict[str, Any]) -> dict[str, Any]:
    return {key: torch.tensor(value) for key, value in item.items()}


# ---- sources -------------------------------------------------------------------------------------------------------
def _generate(shards: list[list[int]]):
    for shard in shards:
        for index in shard:
            yield counted(example(index))


class PlainStream(torch.utils.data.IterableDataset):
    """A torch stream with no state of its own (torchdata's loader can only count what it yielded)."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        for index in range(worker, self.n, workers):
            yield tensors(counted(example(index)))


class StatefulStream(PlainStream):
    """A torch stream with torchdata's Stateful protocol. ``live``: ``state_dict()`` returns the dict it keeps updating
    (torchdata's own save and load are exact with it); ``numpy``: its position is a numpy integer."""

    def __init__(self, n: int = N, live: bool = False, numpy: bool = False) -> None:
        super().__init__(n)
        self.live, self.numpy = live, numpy
        self.position = {"next": np.int64(0) if numpy else 0}

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        while True:
            index = int(self.position["next"]) * workers + worker
            if index >= self.n:
                self.position["next"] = type(self.position["next"])(0)  # the next pass starts over
                return
            self.position["next"] += 1
            yield tensors(counted(example(index)))

    def state_dict(self) -> dict[str, Any]:
        return self.position if self.live else dict(self.position)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = dict(state)


class RefusingStream(StatefulStream):
    """A stream whose dataset refuses every saved position (its data changed, say): in ``load_state_dict``, or
    ``lazy``: at its first example, keeping the state for its next iteration as a ``datasets`` stream does (in its
    ``_starting_state_dict``)."""

    def __init__(self, n: int = N, lazy: bool = False) -> None:
        super().__init__(n)
        self.lazy, self._starting_state_dict = lazy, None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.lazy:
            raise ValueError("this position is not one of this stream's")
        self._starting_state_dict = state

    def __iter__(self):
        if self._starting_state_dict is not None:
            raise ValueError("this position is not one of this stream's")
        yield from super().__iter__()


class Unhashable:
    """A ``map`` function datasets cannot hash (a lock inside): the mapped dataset gets a random fingerprint."""

    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()

    def __call__(self, item):
        return item

    def __reduce__(self):
        raise TypeError("not picklable")


def write_json_lines(folder: Path, n: int = N, files: int = 4, start: int = 0) -> list[str]:
    """Examples ``start`` to ``start + n`` as ``files`` JSON lines files in ``folder`` (one shard each), in id
    order."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for part in range(files):
        path = folder / f"part-{part}.jsonl"
        with open(path, "w", encoding="utf-8") as file:
            for index in range(start + part * n // files, start + (part + 1) * n // files):
                file.write(json.dumps(example(index)) + "\n")
        paths.append(str(path))
    return paths


def _arrow(n: int = N, start: int = 0):
    import datasets

    return datasets.Dataset.from_list([example(i) for i in range(start, start + n)])


def source(kind: str, n: int = N, shards: int = 4, files: Path | None = None) -> Any:
    """A fresh stream of ``kind`` (each call a new object, as a new process builds it):

    ``generator`` (``IterableDataset.from_generator``, its shards in gen_kwargs), ``torch`` (no state),
    ``torch_state``, ``torch_live`` (``state_dict()`` returns its live dict), ``torch_numpy`` (a numpy integer in its
    state), ``torch_refusing`` and ``torch_refusing_lazy`` (every position refused: :class:`RefusingStream`), ``map``
    (``Dataset.to_iterable_dataset().map()``), ``unhashable_map`` (``Dataset.map`` with a function datasets cannot
    hash, then ``to_iterable_dataset``), ``json`` (``load_dataset("json", streaming=True)`` of the
    files in ``files``), ``json_converted`` (``load_dataset("json")`` of them, then ``to_iterable_dataset``),
    ``shuffle`` (``shuffle(seed, buffer_size=32)``), ``interleave`` (``interleave_datasets`` of two halves),
    ``filter`` (ids that are multiples of 5 dropped), ``batch`` (pairs: :func:`pairs` collates them), ``skip_take``."""
    import datasets

    if kind == "torch":
        return PlainStream(n)
    if kind in ("torch_state", "torch_live", "torch_numpy"):
        return StatefulStream(n, live=kind == "torch_live", numpy=kind == "torch_numpy")
    if kind in ("torch_refusing", "torch_refusing_lazy"):
        return RefusingStream(n, lazy=kind == "torch_refusing_lazy")
    if kind == "generator":
        parts = [list(range(s * n // shards, (s + 1) * n // shards)) for s in range(shards)]
        stream = datasets.IterableDataset.from_generator(_generate, gen_kwargs={"shards": parts})
        return stream.with_format("torch")
    if kind in ("json", "json_converted"):
        paths = sorted(str(path) for path in Path(files).glob("*.jsonl"))
        if kind == "json":
            stream = datasets.load_dataset("json", data_files=paths, split="train", streaming=True)
        else:
            stream = datasets.load_dataset("json", data_files=paths, split="train").to_iterable_dataset(shards)
        return stream.map(counted).with_format("torch")
    if kind == "unhashable_map":
        return _arrow(n).map(Unhashable()).to_iterable_dataset(shards).map(counted).with_format("torch")
    if kind == "interleave":
        halves = [_arrow(n // 2, start).to_iterable_dataset(shards // 2) for start in (0, n // 2)]
        return datasets.interleave_datasets(halves).map(counted).with_format("torch")
    stream = _arrow(n).to_iterable_dataset(shards).map(counted)
    if kind == "shuffle":
        stream = stream.shuffle(seed=3, buffer_size=32)
    elif kind == "filter":
        stream = stream.filter(lambda item: ids_of([item["input_ids"]])[0] % 5 != 0)
    elif kind == "batch":
        return stream.batch(batch_size=2).with_format("torch")
    elif kind == "skip_take":
        stream = stream.skip(4).take(n - 8)
    elif kind != "map":
        raise ValueError(f"unknown source kind {kind!r}")
    return stream.with_format("torch")


def pairs(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The collator of a ``batch`` stream: its pairs put end to end."""
    return {key: torch.cat([torch.as_tensor(item[key]) for item in items]) for key in items[0]}


# ---- the spy and the runs ------------------------------------------------------------------------------------------
def model(seed: int = 0):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=LENGTH, num_labels=3,
                        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.0)  # fmt: skip
    return BertForSequenceClassification(config)


def spying(library: Any) -> type:
    """``library.Trainer`` recording, per optimizer step, the ids its ``compute_loss`` trained (``trained``)."""

    class Spy(library.Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.trained: dict[int, list[int]] = {}

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if model.training:
                self.trained.setdefault(self.state.global_step + 1, []).extend(ids_of(inputs["input_ids"]))
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)  # fmt: skip

    return Spy


def arguments(out: Path | str, **overrides: Any) -> dict[str, Any]:
    values = dict(output_dir=str(out), per_device_train_batch_size=BATCH, max_steps=STEPS, learning_rate=1e-3,
                  logging_steps=1, save_steps=SAVE, seed=7, report_to="none", disable_tqdm=True, use_cpu=True,
                  dataloader_pin_memory=False)  # fmt: skip
    values.update(overrides)
    return values


def run(out: Path | str, dataset: Any, library: Any, resume: str | None = None, callbacks=(), **overrides):
    """One run of the script: (trainer, the ids trained per step, the examples the source produced).
    ``eval_dataset="train"``: the training stream object is also the evaluation dataset."""
    values = arguments(out, **overrides)
    collator = values.pop("data_collator", None)
    eval_dataset = values.pop("eval_dataset", None)
    eval_dataset = dataset if eval_dataset == "train" else eval_dataset  # the training stream object itself
    trainer = spying(library)(model(), library.TrainingArguments(**values), train_dataset=dataset,
                              eval_dataset=eval_dataset, data_collator=collator, callbacks=list(callbacks))  # fmt: skip
    reset_count()
    trainer.train(resume_from_checkpoint=resume)
    return trainer, trainer.trained, produced()


class Chain:
    """The uninterrupted run's ids per step, and each resume's: (the checkpoint it resumed from, the step it resumed
    at, its ids per step, the examples its source produced)."""

    def __init__(self, full: dict[int, list[int]]) -> None:
        self.full = full
        self.resumes: list[tuple[str, int, dict[int, list[int]], int]] = []

    def mismatch(self) -> str | None:
        """Where a resume trained other ids than the uninterrupted run (None: every step the same)."""
        return next(filter(None, (mismatch(self.full, trained, at) for _, at, trained, _ in self.resumes)), None)


def mismatch(full: dict[int, list[int]], resumed: dict[int, list[int]], at: int) -> str | None:
    """The first step after ``at`` whose ids differ between ``full`` and ``resumed`` (None: all the same)."""
    expected = {step: ids for step, ids in full.items() if step > at}
    if resumed == expected:
        return None
    for step in sorted(set(expected) | set(resumed)):
        if expected.get(step) != resumed.get(step):
            return (f"resumed at {at}: step {step} trained {resumed.get(step)} where the uninterrupted run trained "
                    f"{expected.get(step)}")  # fmt: skip
    return None


def chain(root: Path, make: Callable[[], Any], library: Any, points: tuple[int, ...] = (SAVE, 2 * SAVE, 3 * SAVE),
          in_place: bool = False, **overrides: Any) -> Chain:  # fmt: skip
    """The uninterrupted run in ``root/full``, then a resume from its checkpoint ``points[0]``, from that run's own
    checkpoint ``points[1]``, and so on, each in a folder of its own. ``in_place``: each resume continues in a copy of
    the run folder it resumes from as it was when that checkpoint was written (its later checkpoints left out), as
    a run interrupted there and resumed in its own folder."""
    _, full, _ = run(root / "full", make(), library, **overrides)
    result, previous = Chain(full), root / "full"
    for index, at in enumerate(points):
        out = root / f"resume{index + 1}"
        if in_place:
            later = {path.name for path in previous.glob("checkpoint-*") if int(path.name.split("-")[1]) > at}
            shutil.copytree(previous, out, ignore=shutil.ignore_patterns(*later))
        folder = (out if in_place else previous) / f"checkpoint-{at}"
        _, trained, count = run(out, make(), library, resume=str(folder), **overrides)
        result.resumes.append((str(folder), at, trained, count))
        previous = out
    return result


# ---- several processes ---------------------------------------------------------------------------------------------
#: the multi-process cells: name -> (source kind, how each process gets it, training arguments)
CELLS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "dispatched": ("map", "shared", {}),
    "per_process": ("map", "split", {"accelerator_config": {"dispatch_batches": False}}),
    "per_process_own_files": ("json", "own", {"accelerator_config": {"dispatch_batches": False}}),
    "per_process_torch": ("torch_state", "shared", {"accelerator_config": {"dispatch_batches": False}}),
    "dispatched_refusing": ("torch_refusing_lazy", "shared", {}),
}


def cell_source(cell: str, rank: int, world: int, root: Path) -> Callable[[], Any]:
    """The maker of a multi-process cell's stream on process ``rank`` (own files: each process's own examples, ids
    from ``rank * N``, in a folder of its own and as another number of files: 4 on process 0, 2 on process 1)."""
    from datasets.distributed import split_dataset_by_node

    kind, how, _ = CELLS[cell]
    files = None
    if how == "own":
        files = root / f"data-rank{rank}"
        write_json_lines(files, n=N, files=4 if rank == 0 else 2, start=rank * N)

    def make():
        stream = source(kind, n=N, files=files)
        return split_dataset_by_node(stream, rank=rank, world_size=world) if how == "split" else stream

    return make


def main() -> None:
    import transformers

    import hflight

    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--cells", nargs="+", default=list(CELLS))
    parser.add_argument("--library", choices=["hflight", "transformers"], default="hflight")
    options = parser.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    library = hflight if options.library == "hflight" else transformers
    for cell in options.cells:
        root = Path(options.out, cell)
        overrides = copy.deepcopy(CELLS[cell][2])
        result = chain(root, cell_source(cell, rank, world, root), library, **overrides)
        record = {"full": result.full, "resumes": result.resumes}
        (root / f"rank{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
