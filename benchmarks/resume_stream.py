"""What resuming a stream costs: the examples produced and the seconds to the first resumed step, hflight against
transformers, from checkpoints at 10^2, 10^3 and 10^4 steps (issue 63).

transformers resumes mid-epoch by reading and dropping every batch the run had already trained on: for a stream
(an iterable dataset) that is the data itself, so the cost grows with the resume point. hflight's checkpoint holds the
training loader's position (``data_position.pt``), and the resumed run reads only what its remaining steps need.

One hflight run trains a 32-wide BERT on a ``datasets`` stream of QA windows in 64 shards (batch 4) up to the
largest point, saving a checkpoint at each point, with the examples' cost off. Then, for each point, each library
resumes from the same checkpoint in a process of its own (transformers ignores hflight's position file) and trains one
more step, its stream now charging ``--cost-ms`` of CPU for each example (a hash loop: tokenizing, decoding, a remote
read). The script prints, for each source, point and library, the examples the stream produced and the seconds from
``train()`` to the first resumed step's start.

The sources (``--sources``): ``arrow``, a dataset in memory streamed (``to_iterable_dataset(num_shards=64).map()``,
the cost in the map); ``generator``, ``IterableDataset.from_generator`` over 64 shards given in ``gen_kwargs`` (the
cost in the generator: datasets resumes a generator by running its current shard again from its start up to the
position, so those examples are produced again, though not mapped or trained); ``files``, 64 JSON lines files
streamed by ``load_dataset("json", streaming=True)`` (the cost in the map: datasets reads the current file again from
its start up to the position, which shows in the seconds only).

    python benchmarks/resume_stream.py                       # points 100 1000 10000, 0.25 ms an example
    python benchmarks/resume_stream.py --points 100 1000 --cost-ms 1 --sources generator
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from references import missing_references  # noqa: E402

BATCH = 4
#: steps the stream and the run go on after the last point (a resume there reads ahead as at any other)
AFTER = 10
LIBRARIES = ("hflight", "transformers")


SHARDS = 64
SOURCES = ("arrow", "generator", "files")


def _windows(examples: int) -> dict[str, list]:
    """The QA windows' columns."""
    import numpy as np

    rng = np.random.default_rng(0)
    ids = rng.integers(5, 100, size=(examples, 24))
    start = rng.integers(1, 20, size=examples)
    return {"input_ids": ids.tolist(), "attention_mask": np.ones_like(ids).tolist(),
            "start_positions": start.tolist(), "end_positions": (start + 1).tolist()}  # fmt: skip


class Produced:
    """The examples a stream produced (not a list: a generator's ``gen_kwargs`` lists are its shards)."""

    count = 0


def _charged(cost_ms: float, produced: Produced):
    def produce(example):
        deadline = time.thread_time() + cost_ms / 1000
        digest = b"x"
        while time.thread_time() < deadline:
            digest = hashlib.sha256(digest).digest()
        produced.count += 1
        return example

    return produce


#: the generator's cost and counter, set by the process (not in gen_kwargs: a position is tied to those, and the
#: training run and the resumed one charge differently)
_GENERATOR: dict[str, Any] = {}


def _generate(shards, columns):
    produce = _charged(_GENERATOR["cost_ms"], _GENERATOR["produced"])
    for first, end in shards:
        for index in range(first, end):
            yield produce({name: values[index] for name, values in columns.items()})


def write_files(folder: Path, examples: int) -> None:
    """The windows as :data:`SHARDS` JSON lines files."""
    columns = _windows(examples)
    folder.mkdir(parents=True, exist_ok=True)
    for shard in range(SHARDS):
        with open(folder / f"part-{shard:03d}.jsonl", "w", encoding="utf-8") as file:
            for index in range(shard * examples // SHARDS, (shard + 1) * examples // SHARDS):
                file.write(json.dumps({name: values[index] for name, values in columns.items()}) + "\n")


def _stream(examples: int, cost_ms: float, source: str, out: str):
    """The stream of ``source``: QA windows, each costing ``cost_ms`` of CPU when produced (counted)."""
    import datasets

    produced = Produced()
    if source == "files":
        files = sorted(str(path) for path in Path(out, "files").glob("*.jsonl"))
        stream = datasets.load_dataset("json", data_files=files, split="train", streaming=True)
        stream = stream.map(_charged(cost_ms, produced))
    elif source == "generator":
        bounds = [(s * examples // SHARDS, (s + 1) * examples // SHARDS) for s in range(SHARDS)]
        _GENERATOR.update(cost_ms=cost_ms, produced=produced)
        stream = datasets.IterableDataset.from_generator(
            _generate, gen_kwargs={"shards": bounds, "columns": _windows(examples)}
        )
    else:
        stream = datasets.Dataset.from_dict(_windows(examples)).to_iterable_dataset(num_shards=min(SHARDS, examples))
        stream = stream.map(_charged(cost_ms, produced))
    return stream.with_format("torch"), produced


def _model():
    import torch
    from transformers import BertConfig, BertForQuestionAnswering

    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    return BertForQuestionAnswering(config)


def train(out: str, source: str, points: list[int]) -> None:
    """The run that writes the checkpoints: up to the largest point, one at each point."""
    import torch
    import transformers

    import hflight

    torch.set_num_threads(1)

    class SaveAtPoints(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_save = state.global_step in points

    steps = max(points)
    if source == "files":
        write_files(Path(out, "files"), (steps + AFTER) * BATCH)
    stream, _ = _stream((steps + AFTER) * BATCH, 0.0, source, out)
    args = hflight.TrainingArguments(output_dir=out, per_device_train_batch_size=BATCH, max_steps=steps + AFTER,
                                     save_strategy="no", logging_steps=10**9, report_to="none", disable_tqdm=True,
                                     use_cpu=True)  # fmt: skip
    hflight.Trainer(_model(), args, train_dataset=stream, callbacks=[SaveAtPoints()]).train()


def resume(library: str, out: str, source: str, point: int, last: int, cost_ms: float) -> dict[str, float]:
    """One library resumes from checkpoint-``point`` and trains one step: examples produced, seconds to that step."""
    import torch
    import transformers

    import hflight

    torch.set_num_threads(1)
    module = hflight if library == "hflight" else transformers
    began: list[float] = []

    class FirstStep(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            began.append(time.perf_counter())
            control.should_training_stop = True

    stream, produced = _stream((last + AFTER) * BATCH, cost_ms, source, out)
    args = module.TrainingArguments(output_dir=out, per_device_train_batch_size=BATCH, max_steps=last + AFTER,
                                    save_strategy="no", logging_steps=10**9, report_to="none", disable_tqdm=True,
                                    use_cpu=True)  # fmt: skip
    trainer = module.Trainer(_model(), args, train_dataset=stream, callbacks=[FirstStep()])
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=os.path.join(out, f"checkpoint-{point}"))
    return {"examples": produced.count, "seconds": began[0] - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--cost-ms", type=float, default=0.25, help="CPU milliseconds the stream spends on an example")
    parser.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES))
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        kind, out, source, *rest = opts.worker
        if kind == "train":
            train(out, source, [int(p) for p in rest])
        else:
            print(json.dumps(resume(kind, out, source, int(rest[0]), int(rest[1]), float(rest[2]))))
        return
    missing = missing_references()
    if missing:
        raise SystemExit(f"the transformers reference needs: {', '.join(missing)}")
    points = sorted(opts.points)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    every = {}
    for source in opts.sources:
        every[source] = _source_table(source, points, opts.cost_ms, env)
    print(json.dumps({f"{source} {lib} {point}": row for source, rows in every.items()
                      for (lib, point), row in rows.items()}))  # fmt: skip


def _source_table(source: str, points: list[int], cost_ms: float, env: dict[str, str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="resume_stream-") as out:
        started = time.perf_counter()
        _worker(["train", out, source, *map(str, points)], env)
        took = time.perf_counter() - started
        at = ", ".join(map(str, points))
        print(f"\n{source}: trained to step {max(points)} in {took:.1f} s (checkpoints at {at}; {BATCH} examples a "
              f"step, {SHARDS} shards, {cost_ms} ms an example on resume)")  # fmt: skip
        rows = {(lib, p): json.loads(_worker([lib, out, source, str(p), str(max(points)), str(cost_ms)], env)
                                     .strip().splitlines()[-1]) for p in points for lib in LIBRARIES}  # fmt: skip
    print(f"{'resume at step':>14} | {'hflight examples':>16} | {'hflight s':>9} | {'transformers examples':>21} | "
          f"{'transformers s':>14}")  # fmt: skip
    for point in points:
        ours, theirs = rows["hflight", point], rows["transformers", point]
        print(f"{point:>14} | {ours['examples']:>16} | {ours['seconds']:>9.2f} | {theirs['examples']:>21} | "
              f"{theirs['seconds']:>14.2f}")  # fmt: skip
    return rows


def _worker(args: list[str], env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, __file__, "--worker", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args[:1])} failed:\n{done.stderr[-3000:]}")
    return done.stdout


if __name__ == "__main__":
    main()
