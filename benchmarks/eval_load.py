"""Evaluation time of run_clm.py, eval only, with transformers' Trainer and with hflight's, idle and beside a busy
neighbour (issue 67).

The script is tests/scripts/run_clm (written as transformers' run_clm.py is) run twice per round: once as written,
once with ``from transformers import Trainer`` changed to hflight's, alternating, each in a fresh process, on the
tiny GPT-2 and random-word text of tests/test_run_clm_dropin.py, the validation file about ``--rows`` blocks of 16
tokens long. The figure is what each run reports as ``eval_runtime`` in ``eval_results.json`` (the whole
``evaluate()`` call). With ``--busy N``, N processes spinning on a core run beside both (one other process sharing a
2-core machine, as a build or a notebook kernel does). Printed per batch size and load: each library's median, min
and max over the rounds, and hflight's median over transformers'.

    python benchmarks/eval_load.py                           # batch 2 and 16, idle and with 1 busy neighbour, 5 rounds
    python benchmarks/eval_load.py --batch-sizes 2 --busy 1 --rounds 7
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from loop_overhead import cpu_description  # noqa: E402

ORIGINAL, CHANGED = "from transformers import Trainer\n", "from hflight import Trainer\n"


def _inputs(root: Path, rows: int) -> dict[str, Path]:
    """tests/test_run_clm_dropin.py's model and text, the validation file about ``rows`` blocks long (two lines a
    block of 16 tokens)."""
    import seq2seq_data

    return seq2seq_data.clm_inputs(root, validation_lines=rows * 2)


def _scripts(root: Path) -> dict[str, Path]:
    source = (ROOT / "tests" / "scripts" / "run_clm" / "run_clm.py").read_text(encoding="utf-8")
    assert source.count(ORIGINAL) == 1
    scripts = {}
    for library, text in (("transformers", source), ("hflight", source.replace(ORIGINAL, CHANGED))):
        folder = root / library
        shutil.copytree(ROOT / "tests" / "scripts" / "run_clm", folder)
        (folder / "run_clm.py").write_text(text, encoding="utf-8")
        scripts[library] = folder / "run_clm.py"
    return scripts


def _eval_runtime(script: Path, inputs: dict[str, Path], batch: int) -> tuple[float, int]:
    out = script.parent / "out"
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, script.name, "--model_name_or_path", str(inputs["model"]),
               "--train_file", str(inputs["train"]), "--validation_file", str(inputs["validation"]),
               "--block_size", "16", "--do_eval", "--per_device_eval_batch_size", str(batch),
               "--output_dir", str(out), "--report_to", "none", "--disable_tqdm", "true"]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(command, cwd=script.parent, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{script}: exit {done.returncode}\n{done.stderr[-3000:]}")
    results = json.loads((out / "eval_results.json").read_text(encoding="utf-8"))
    return results["eval_runtime"], results["eval_samples"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[2, 16])
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 1], help="busy neighbours (one load per value)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rows", type=int, default=252, help="about this many evaluation blocks of 16 tokens")
    opts = parser.parse_args()
    print(f"{cpu_description()}; run_clm.py eval only, tiny GPT-2, {opts.rows} blocks of 16 tokens; "
          f"{opts.rounds} rounds alternating transformers and hflight, each run a fresh process")  # fmt: skip
    print("| batch | busy neighbours | rows | transformers eval_runtime (median, min-max) | hflight (median, min-max) "
          "| hflight / transformers (medians) |\n|---|---|---|---|---|---|")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="eval_load-") as tmp:
        root = Path(tmp)
        inputs, scripts = _inputs(root / "inputs", opts.rows), _scripts(root)
        for busy in opts.busy:
            neighbours = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
            try:
                for batch in opts.batch_sizes:
                    _eval_runtime(scripts["transformers"], inputs, batch)  # page cache and datasets' cache warm
                    times: dict[str, list[float]] = {"transformers": [], "hflight": []}
                    rows = 0
                    for _ in range(opts.rounds):
                        for library in ("transformers", "hflight"):
                            seconds, rows = _eval_runtime(scripts[library], inputs, batch)
                            times[library].append(seconds)
                    cells = [f"{statistics.median(t):.3f} s ({min(t):.3f}-{max(t):.3f})" for t in times.values()]
                    ratio = statistics.median(times["hflight"]) / statistics.median(times["transformers"])
                    print(f"| {batch} | {busy} | {rows} | {cells[0]} | {cells[1]} | {ratio:.2f}x |", flush=True)
            finally:
                for process in neighbours:
                    process.kill()


if __name__ == "__main__":
    main()
