"""What keeping a stream's position costs per batch: the state hflight's training loader takes after every batch
(``hflight.run.loaders.loader_state``: a structure of its own, so that a checkpoint after a read-ahead holds the state
of the batch that trained) against torchdata's own ``StatefulDataLoader.state_dict()``, which 921895b called per
batch (on Python 3.11 each of its six ``Stateful`` checks, a runtime protocol, costs ~20-30 µs).

Streams of rows of 8 tokens, batches of 4, with 0 and 2 loader workers: a ``datasets`` stream after ``map``
(``to_iterable_dataset().map()``), ``IterableDataset.from_generator``, a torch ``IterableDataset`` with
``state_dict()``/``load_state_dict()`` and one without. Each figure is the median over ``--batches`` batches (after 20
untimed), with the 10th and 90th percentiles; both takes of the same batch, one after the other. Also checks that both
give the same state.

    python benchmarks/position_cost.py
    python benchmarks/position_cost.py --batches 2000
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "jobs"))

import torch  # noqa: E402
import trained_ids  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from hflight.run.loaders import loader_state  # noqa: E402

KINDS = {"map": "datasets stream, map", "generator": "datasets from_generator", "torch_state": "torch, with state",
         "torch": "torch, without state"}  # fmt: skip


def spread(samples: list[float]) -> str:
    cuts = statistics.quantiles(samples, n=10)
    return f"{statistics.median(samples) * 1e6:7.1f} ({cuts[0] * 1e6:.1f}-{cuts[-1] * 1e6:.1f})"


def measure(kind: str, workers: int, batches: int) -> tuple[list[float], list[float]]:
    stream = trained_ids.source(kind, n=4 * (batches + 40))
    loader = StatefulDataLoader(stream, batch_size=4, num_workers=workers)
    iterator = iter(loader)
    for _ in range(20):
        next(iterator)
    ours, theirs = [], []
    for _ in range(batches):
        next(iterator)
        start = time.perf_counter()
        state = loader_state(loader)
        middle = time.perf_counter()
        reference = loader.state_dict()
        ours.append(middle - start)
        theirs.append(time.perf_counter() - middle)
        if state != reference:
            raise SystemExit(f"{kind}, {workers} workers: hflight's state differs from torchdata's")
    return ours, theirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=1000)
    opts = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}; {os.cpu_count()} CPUs")
    print("µs per batch, median (10th-90th percentile)\n")
    print(f"{'stream':28s} workers  {'hflight loader_state':>24s}  {'torchdata state_dict()':>24s}  ratio")
    for kind, name in KINDS.items():
        for workers in (0, 2):
            ours, theirs = measure(kind, workers, opts.batches)
            ratio = statistics.median(ours) / statistics.median(theirs)
            print(f"{name:28s} {workers:7d}  {spread(ours):>24s}  {spread(theirs):>24s}  {ratio:5.2f}")


if __name__ == "__main__":
    main()
