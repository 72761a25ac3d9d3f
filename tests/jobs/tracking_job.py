"""One small training run reporting to TensorBoard, MLflow and W&B (offline), with transformers.Trainer or
hflight.Trainer: tests/test_tracking.py runs it once per library, each in its own process and working folder, and
reads back what each tool recorded.

    python tests/jobs/tracking_job.py transformers|hflight     # in an empty working folder

Everything is written under the working folder: ``out/`` (the run), ``out/runs/...`` (TensorBoard, transformers'
default log dir), ``mlflow.db`` (MLflow's SQLite store), ``wandb/`` (the offline W&B run)."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from support import Factory  # noqa: E402


def main() -> int:
    library = importlib.import_module(sys.argv[1])
    here = Path.cwd()
    os.environ.update(
        WANDB_MODE="offline", WANDB_DIR=str(here), WANDB_SILENT="true", WANDB_PROJECT="hflight-tests",
        MLFLOW_TRACKING_URI=f"sqlite:///{here / 'mlflow.db'}", MLFLOW_EXPERIMENT_NAME="tracking",
    )  # fmt: skip
    torch.set_num_threads(1)
    args = library.TrainingArguments(
        "out", **Factory.pair_args(report_to=["tensorboard", "mlflow", "wandb"], eval_strategy="steps", eval_steps=4,
                                   run_name="tiny-run", use_cpu=True),
    )  # fmt: skip
    data, held_out = Factory.cls_dataset(32), Factory.cls_dataset(8, seed=1)
    trainer = library.Trainer(Factory.cls_model(), args, train_dataset=data, eval_dataset=held_out)
    trainer.train()
    trainer.evaluate()  # after train(): a run of its own in MLflow (its callback ended the first), the same in W&B
    trainer.predict(held_out)
    import wandb

    wandb.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
