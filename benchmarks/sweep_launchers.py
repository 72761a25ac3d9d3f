"""What a parallel launcher and a pruner save on an Optuna search of the main job (issue 30).

1. **Launchers**: the same search of ``--jobs`` trials (``+experiment=mrc +hparams_search=mrc_optuna``: the main
   job, the sampler seeded, all trials handed to the launcher at once: ``hydra.sweeper.n_jobs=--jobs``) once with
   Hydra's basic launcher (one job after the other, torch's default threads: one per core) and once with
   ``hydra/launcher=joblib hydra.launcher.n_jobs=2`` (two jobs at once, one thread each: hflight splits the cores).
   Wall clock of each whole command, and their ratio (target on 2 cores: joblib <= 0.75x basic). The two searches run
   the same trials (same seed, same batches); their best values are printed side by side.
2. **Pruning**: a search where about half of the trials are hopeless (``args.learning_rate=choice(2e-3, 1e-7)``:
   the second barely trains), ``--prune-trials`` trials one at a time of the main job at reduced sizes (150
   articles, 3 epochs), without a pruner and with
   ``+hydra/sweeper/pruner=median`` (``n_startup_trials=1``, evaluation every epoch): wall clock, trials pruned,
   and the best value of each.

Each search is a fresh ``python -m hflight`` (the same command as ``hflight-train``) in a temporary folder. Prints the
figures and the CPU (``lscpu``).

    python benchmarks/sweep_launchers.py               # both (~16 minutes on 2 cores)
    python benchmarks/sweep_launchers.py --only pruning
    python benchmarks/sweep_launchers.py --tiny --jobs 2 --prune-trials 2
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cluster_restart import TINY, cpu  # this folder is the script's sys.path[0]; the tests' tiny sizes

ROOT = Path(__file__).resolve().parents[1]
#: The main job at reduced sizes, for the pruning comparison (6 trials in a few minutes).
SMALL = ["data.synthetic.num_train_articles=150", "args.num_train_epochs=3"]
SEARCH = ["+experiment=mrc", "+hparams_search=mrc_optuna", "logger=none", "hydra.sweeper.sampler.seed=7"]


def search(folder: Path, overrides: list[str]) -> tuple[float, list[dict[str, str]]]:
    """Run one search in ``folder``; its wall clock and its summary's rows."""
    sweep = folder / "sweep"
    command = [sys.executable, "-m", "hflight", *SEARCH, *overrides, f"hydra.sweep.dir={sweep}"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    with open(sweep / "summary.csv", newline="") as handle:
        return elapsed, list(csv.DictReader(handle))


def best(rows: list[dict[str, str]]) -> str:
    values = [float(r["eval_f1"]) for r in rows if r.get("eval_f1")]
    return f"{max(values):.2f}" if values else "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny sizes instead of the reduced main job")
    parser.add_argument("--jobs", type=int, default=4, help="trials of the launcher comparison")
    parser.add_argument("--prune-trials", type=int, default=6, help="trials of the pruning comparison")
    parser.add_argument("--only", choices=("launchers", "pruning"), help="one of the two comparisons")
    options = parser.parse_args()
    sizes = TINY if options.tiny else SMALL
    # all trials handed to the launcher at once: joblib starts the next as soon as one of its 2 workers is free (the
    # basic launcher runs them one after the other either way); TPE's first 6 trials are its seeded random startup,
    # so both searches run the same trials
    launch = [
        *(TINY if options.tiny else []),
        f"hydra.sweeper.n_trials={options.jobs}",
        f"hydra.sweeper.n_jobs={options.jobs}",
    ]
    prune = [*sizes, f"hydra.sweeper.n_trials={options.prune_trials}", "hydra.sweeper.n_jobs=1",
             "hydra.sweeper.params=null", "args.learning_rate=choice(2e-3, 1e-7)"]  # fmt: skip
    pruner = ["+hydra/sweeper/pruner=median", "hydra.sweeper.pruner.n_startup_trials=1"]
    cores = len(os.sched_getaffinity(0))
    print(
        f"CPU: {cpu()}, {cores} cores available; sizes: {'tiny' if options.tiny else 'main job / ' + ' '.join(SMALL)}"
    )
    figures = {}
    runs = {
        "launchers": [
            ("basic launcher", launch),
            ("joblib, 2 jobs x 1 thread", [*launch, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]),
        ],
        "pruning": [("no pruner", prune), ("median pruner", [*prune, *pruner])],
    }
    for name, overrides in [run for part, rest in runs.items() if options.only in (None, part) for run in rest]:
        with tempfile.TemporaryDirectory(prefix="hflight-sweep-") as folder:
            figures[name] = search(Path(folder), overrides)
        elapsed, rows = figures[name]
        states = {s: sum(r["state"] == s for r in rows) for s in ("COMPLETE", "PRUNED", "FAIL")}
        print(f"  {name:<28} {elapsed:8.1f} s  {len(rows)} jobs {states}  best eval_f1 {best(rows)}")
    if "joblib, 2 jobs x 1 thread" in figures:
        basic, joblib = figures["basic launcher"][0], figures["joblib, 2 jobs x 1 thread"][0]
        print(f"launchers ({options.jobs} trials): joblib / basic = {joblib / basic:.2f}x (target <= 0.75x, 2 cores)")
    if "median pruner" in figures:
        plain, pruned = figures["no pruner"][0], figures["median pruner"][0]
        count = sum(r["state"] == "PRUNED" for r in figures["median pruner"][1])
        print(f"pruning ({options.prune_trials} trials, half hopeless): {pruned / plain:.2f}x the time, {count} pruned")


if __name__ == "__main__":
    main()
