"""What the manifest's checksums cost: saving and resuming a BERT-base-sized checkpoint with and without them.

A BERT-base question-answering model (110M parameters, built from ``BertConfig()``: no download) trains one
optimizer step with AdamW, so that ``optimizer.pt`` holds both moment estimates (the checkpoint is ~1.3 GB:
``model.safetensors`` 0.44 GB, ``optimizer.pt`` 0.88 GB). Then, in alternating rounds:

- **save**: ``Trainer._save_checkpoint`` writes ``checkpoint-1`` (every file, the manifest, the rename), once with
  the checksums (xxh3-128 of every file, computed in a background thread as each file is complete) and once with the
  checksum function replaced by a no-op; the previous folder is deleted (and the disk synced) before each save,
  outside the timing; one warm-up save first. Also timed: writing the manifest, where the save waits for the
  checksums still running (what they add to the save's critical path), and the hashing thread's own time;
- **hash**: the checksums of the saved files alone;
- **resume**: ``hflight.checkpoints.resume.resolve_resume`` (manifest with checksums, trainer state, weights checked and
copied
  in, RNG/optimizer/scheduler files loaded and checked), and the checksum verification alone inside it.

Files are read back from the page cache (they were just written); on a cold cache reading the files dominates both
the checksums and the loading itself. Prints medians over rounds (and, for the two saves, the fastest rounds: on a
shared machine the same save takes 0.6 s or 3 s as the other processes' load comes and goes).

    python benchmarks/checkpoint_checksum.py                # 3 rounds
    python benchmarks/checkpoint_checksum.py --rounds 5 --out /path/on/the/disk/to/measure
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

import datasets  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import BertConfig, BertForQuestionAnswering  # noqa: E402

import hflight  # noqa: E402
from hflight.checkpoints import folders as checkpoint  # noqa: E402
from hflight.checkpoints import manifest, resume  # noqa: E402


def build_trainer(out: Path) -> hflight.Trainer:
    torch.manual_seed(0)
    model = BertForQuestionAnswering(BertConfig())
    rng = np.random.default_rng(0)
    n, length = 4, 32
    data = datasets.Dataset.from_dict(
        {
            "input_ids": rng.integers(1000, 30000, size=(n, length)).tolist(),
            "attention_mask": np.ones((n, length), dtype=int).tolist(),
            "start_positions": rng.integers(1, 20, size=n).tolist(),
            "end_positions": rng.integers(20, 30, size=n).tolist(),
        }
    )
    args = hflight.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=n, max_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, logging_strategy="no", dataloader_pin_memory=False,
    )  # fmt: skip
    return hflight.Trainer(model, args, train_dataset=data)


def timed(function) -> float:
    start = time.perf_counter()
    function()
    return time.perf_counter() - start


def save(trainer: hflight.Trainer, folder: Path, checksums: bool) -> tuple[float, float, float, float]:
    """(seconds the save took, of them writing the manifest, seconds the hashing thread spent, seconds ``os.sync``
    then took to put the checkpoint on the disk: the save writes into the page cache)."""
    shutil.rmtree(folder, ignore_errors=True)
    os.sync()
    real_digest, real_manifest, spent, manifest_time = manifest.file_digest, checkpoint.write_manifest, [], []

    def measured(path):
        start = time.perf_counter()
        digest = real_digest(path)
        spent.append(time.perf_counter() - start)
        return digest

    def timed_manifest(*args, **kwargs):
        manifest_time.append(timed(lambda: real_manifest(*args, **kwargs)))

    manifest.file_digest = measured if checksums else (lambda path: None)  # None: the manifest records sizes only
    checkpoint.write_manifest = timed_manifest
    try:
        seconds = timed(lambda: trainer._save_checkpoint(trainer.model, None))
    finally:
        manifest.file_digest, checkpoint.write_manifest = real_digest, real_manifest
    return seconds, sum(manifest_time), sum(spent), timed(os.sync)


def hash_all(folder: Path) -> float:
    files = [p for p in folder.iterdir() if p.is_file() and p.name != manifest.MANIFEST_NAME]
    return timed(lambda: [manifest.file_digest(p) for p in files])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", help="folder to write the checkpoints into (default: a temporary folder)")
    opts = parser.parse_args()
    logging.disable(logging.WARNING)
    base = Path(opts.out or tempfile.mkdtemp(prefix="hflight-checksum-"))
    trainer = build_trainer(base)
    trainer.train()  # one optimizer step: AdamW's moment estimates exist
    folder = base / "checkpoint-1"
    save(trainer, folder, True)  # warm-up
    keys = ("with", "manifest", "thread", "without", "manifest_without", "sync", "hash", "resume", "verify", "sizes")
    figures: dict[str, list[float]] = {k: [] for k in keys}
    for round_ in range(opts.rounds):
        order = (True, False) if round_ % 2 == 0 else (False, True)
        for checksums in order:
            seconds, in_manifest, hashing, sync = save(trainer, folder, checksums)
            if checksums:
                figures["with"].append(seconds)
                figures["manifest"].append(in_manifest)
                figures["thread"].append(hashing)
            else:
                figures["without"].append(seconds)
                figures["manifest_without"].append(in_manifest)
                figures["sync"].append(sync)
        save(trainer, folder, True)  # the folder resumed from below holds checksums
        figures["hash"].append(hash_all(folder))
        figures["verify"].append(timed(lambda: manifest.verify_checkpoint(folder, full=True)))
        figures["sizes"].append(timed(lambda: manifest.verify_checkpoint(folder)))
        figures["resume"].append(timed(lambda: resume.resolve_resume(trainer, str(folder))))
        print(f"round {round_ + 1}: " + ", ".join(f"{k} {v[-1]:.3f} s" for k, v in figures.items()), flush=True)
    m = {k: statistics.median(v) for k, v in figures.items()}
    size = sum(p.stat().st_size for p in folder.iterdir())
    files = len(list(folder.iterdir()))
    verify = m["verify"] - m["sizes"]
    print(f"\ncheckpoint: {size / 1e9:.2f} GB in {files} files ({base}); medians of {opts.rounds} rounds")
    waited = m["manifest"] - m["manifest_without"]
    print(f"save with checksums       {m['with']:.3f} s (the hashing thread worked {m['thread']:.3f} s beside it)")
    print(f"save without checksums    {m['without']:.3f} s (with / without: {m['with'] / m['without']:.3f}; fastest "
          f"rounds {min(figures['with']):.3f} / {min(figures['without']):.3f} s = "
          f"{min(figures['with']) / min(figures['without']):.3f})")  # fmt: skip
    print(f"waiting for checksums     {waited:.3f} s in the manifest step ({waited / m['without'] * 100:.1f}% of the "
          "save without them)")  # fmt: skip
    durable = m["without"] + m["sync"]
    print(f"then os.sync              {m['sync']:.3f} s (the save until its data is on the disk: {durable:.3f} s; the "
          f"checksums' CPU time is {m['thread'] / durable * 100:.1f}% of that)")  # fmt: skip
    print(f"checksums of the files    {m['hash']:.3f} s ({size / m['hash'] / 1e9:.1f} GB/s)")
    print(f"resume (resolve_resume)   {m['resume']:.3f} s, of which verifying checksums {verify:.3f} s "
          f"({verify / m['resume'] * 100:.1f}%)")  # fmt: skip
    if not opts.out:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
