"""Trains into a small disk until a checkpoint save runs out of space (run by test_checkpoint_folders.py inside a
user and mount namespace, with DISK a tmpfs of a chosen size).

    python tests/jobs/full_disk_job.py DISK RESULTS

The same run as the checkpoint tests' ``saved`` fixture (checkpoints at steps 3 and 6). Writes RESULTS/result.json
(the error's type and message, the checkpoint's file names, checkpoint-3's digest when it was written) and a copy of
DISK as RESULTS/out, since the tmpfs goes away with the namespace.
"""

import hashlib
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: tests.support's Factory

import hflight  # noqa: E402
from tests.support import Factory  # noqa: E402


def digest(folder: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(path.relative_to(folder).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


class Record(hflight.TrainerCallback):
    def __init__(self, result: dict) -> None:
        self.result = result

    def on_save(self, args, state, control, **kwargs):
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        self.result["checkpoint_3_before"] = digest(folder)
        self.result["checkpoint_files"] = sorted(p.name for p in folder.iterdir())


def main() -> None:
    disk, results = Path(sys.argv[1]), Path(sys.argv[2])
    result: dict = {"type": None}
    args = hflight.TrainingArguments(
        output_dir=str(disk), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=6,
        learning_rate=1e-3, warmup_steps=2, logging_steps=1, save_steps=3, train_sampling_strategy="random", seed=7,
        report_to="none", disable_tqdm=True, dataloader_pin_memory=False,
    )  # fmt: skip
    trainer = hflight.Trainer(
        Factory.qa_model(seed=0, dropout=0.1), args, train_dataset=Factory.qa_dataset(40), callbacks=[Record(result)]
    )
    try:
        trainer.train()
    except Exception as exc:  # noqa: BLE001 - the test checks what it was
        result.update(type=type(exc).__name__, message=str(exc))
    results.mkdir(parents=True, exist_ok=True)
    shutil.copytree(disk, results / "out")
    (results / "result.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
