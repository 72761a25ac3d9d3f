"""What a run leaves to look at and where its numbers go: ``training_curves.png`` (``hflight.cli.curves``), a multirun's
``summary.csv``/``summary.md`` (``hflight.sweeps.summary``), and the experiment loggers ``report_to`` and the
``logger`` group build (``hflight.arguments.lightning_kwargs``, ``hflight.cli.logger_environment``).

transformers' integrations (tensorboard, wandb, mlflow) are compared with transformers' own runs in
tests/test_tracking.py; here: the ``logger`` group's options as the variables those integrations read, ``report_to``'s
names and errors, and the Lightning loggers (hflight's "csv", a user's own).
"""

from __future__ import annotations

import csv
import importlib.util
import json
import re
from pathlib import Path

import pytest
import transformers

from hflight import cli
from hflight.arguments import lightning_kwargs, reporting
from hflight.arguments.training_args import TrainingArguments
from hflight.cli.curves import curves, plot_training_curves
from hflight.config import compose
from hflight.sweeps.summary import write_summary

LOG_HISTORY = [
    {"loss": 5.0, "grad_norm": 2.0, "learning_rate": 1e-3, "epoch": 0.5, "step": 2},
    {"loss": 4.0, "grad_norm": 2.0, "learning_rate": 5e-4, "epoch": 1.0, "step": 4},
    {"eval_loss": 4.5, "eval_f1": 10.0, "eval_runtime": 0.1, "eval_samples_per_second": 9.0, "epoch": 1.0, "step": 4},
    {"loss": 3.0, "grad_norm": 2.0, "learning_rate": 0.0, "epoch": 2.0, "step": 8},
    {"eval_loss": 4.0, "eval_f1": 20.0, "eval_runtime": 0.1, "epoch": 2.0, "step": 8},
    {"train_runtime": 3.0, "train_loss": 4.0, "epoch": 2.0, "step": 8},
]


# ---- training_curves.png -------------------------------------------------------------------------------------------
def test_curves_are_the_logged_series_per_step_and_per_evaluation():
    assert curves(LOG_HISTORY) == {
        "training loss": [(2, 5.0), (4, 4.0), (8, 3.0)],
        "learning rate": [(2, 1e-3), (4, 5e-4), (8, 0.0)],
        "eval_loss": [(4, 4.5), (8, 4.0)],
        "eval_f1": [(4, 10.0), (8, 20.0)],
    }  # timings are not metrics; train_loss (the summary entry) is not a step's loss


def test_training_curves_png_is_drawn_and_nothing_logged_draws_nothing(tmp_path):
    import matplotlib

    backend = matplotlib.get_backend()
    path = plot_training_curves(LOG_HISTORY, tmp_path / "curves" / "training_curves.png", title="run")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    width, height = Image.open(path).size
    assert width > 3 * height // 2  # four panels: three columns, two rows
    assert matplotlib.get_backend() == backend  # drawn on an Agg canvas of its own
    assert plot_training_curves([{"train_runtime": 1.0, "step": 0}], tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


# ---- summary.csv / summary.md -------------------------------------------------------------------------------------
def _job(sweep: Path, number: int, overrides: list[str], results: dict | None, failed: bool = False) -> None:
    folder = sweep / str(number)
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if results is not None:
        (folder / "all_results.json").write_text(json.dumps(results))
    if failed:
        (folder / "error.txt").write_text("ValueError: boom\n")


@pytest.mark.parametrize(("metric", "direction", "best"), [("eval_f1", None, "1"), ("eval_loss", None, "0"),
                                                           ("eval_f1", "minimize", "0")])  # fmt: skip
def test_summary_has_a_row_per_job_and_marks_the_best(tmp_path, metric, direction, best):
    _job(tmp_path, 0, ["args.seed=1"], {"eval_f1": 10.0, "eval_loss": 1.0, "eval_runtime": 2.0, "train_loss": 3.0})
    _job(tmp_path, 1, ["args.seed=2"], {"eval_f1": 30.0, "eval_loss": 2.0, "train_loss": 2.5})
    _job(tmp_path, 10, ["args.seed=3"], None, failed=True)
    write_summary(tmp_path, metric, direction)
    rows = list(csv.DictReader((tmp_path / "summary.csv").open()))
    assert [r["job"] for r in rows] == ["0", "1", "10"]  # job order, not text order
    assert [r["state"] for r in rows] == ["COMPLETE", "COMPLETE", "FAIL"]
    assert [r["best"] for r in rows] == ["*" if r["job"] == best else "" for r in rows]
    assert rows[1]["overrides"] == "args.seed=2" and rows[1]["eval_f1"] == "30" and "eval_runtime" not in rows[1]
    assert rows[0]["folder"] == str(tmp_path / "0")
    markdown = (tmp_path / "summary.md").read_text()
    assert f"Best by `{metric}`: job {best}" in markdown and markdown.count("\n| ") == 5  # header, rule, 3 rows


def test_a_stopped_job_that_another_job_continued_counts_once_and_every_folder_is_absolute(tmp_path, monkeypatch):
    """An Optuna search's retry continues an interrupted job's checkpoint in a folder of its own: the interrupted job
    is RESUMED, naming its continuation, and the title counts trials (``n_trials=2`` read "3 jobs", the interrupted
    one a FAIL). The folder column is absolute for a sweep folder given relative (it was relative there, and
    absolute once ``resume=`` continued the sweep)."""
    monkeypatch.chdir(tmp_path)
    sweep = tmp_path / "sweep"
    _job(sweep, 0, ["args.seed=1"], None, failed=True)
    _job(sweep, 1, ["args.seed=1", f"args.resume_from_checkpoint='{sweep / '0' / 'checkpoint-2'}'"], {"eval_f1": 3.0})
    _job(sweep, 2, ["args.seed=2"], {"eval_f1": 4.0})
    write_summary("sweep", "eval_f1", None, "trials")
    rows = list(csv.DictReader((sweep / "summary.csv").open()))
    assert [(r["job"], r["state"], r["folder"]) for r in rows] == [
        ("0", "RESUMED", str(sweep / "0")), ("1", "COMPLETE", str(sweep / "1")), ("2", "COMPLETE", str(sweep / "2"))
    ]  # fmt: skip
    markdown = (sweep / "summary.md").read_text()
    assert markdown.startswith("# Sweep summary (2 trials)\n\nJob 0 stopped before its end; job 1 continued it")


def test_summary_rejects_an_unknown_direction(tmp_path):
    _job(tmp_path, 0, [], {"eval_f1": 1.0})
    with pytest.raises(ValueError, match="hydra.sweeper.direction"):
        write_summary(tmp_path, "eval_f1", "upwards")


# ---- loggers --------------------------------------------------------------------------------------------------------
def _args(cfg) -> TrainingArguments:
    return TrainingArguments.from_config(cfg.args)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["logger=wandb", "logger.wandb.project=qa", "logger.wandb.entity=team", "logger.wandb.tags=[mrc,base]",
          "logger.wandb.name=first"],
         {"WANDB_PROJECT": "qa", "WANDB_ENTITY": "team", "WANDB_TAGS": "mrc,base", "WANDB_NAME": "first"}),
        (["logger=wandb", "args.run_name=named"], {}),
        (["logger=mlflow", "logger.mlflow.experiment_name=qa", "logger.mlflow.tracking_uri=http://mlflow:5000",
          "+logger.mlflow.tags.team=nlp"],
         {"MLFLOW_EXPERIMENT_NAME": "qa", "MLFLOW_TRACKING_URI": "http://mlflow:5000",
          "MLFLOW_TAGS": '{"team": "nlp"}'}),
        (["logger=tensorboard", "logger.tensorboard.log_dir=/tmp/tb"], {"TENSORBOARD_LOGGING_DIR": "/tmp/tb"}),
    ],
)  # fmt: skip
def test_logger_options_are_the_variables_transformers_integrations_read(tmp_path, monkeypatch, overrides, expected):
    import os

    variables = ("WANDB_PROJECT", "WANDB_ENTITY", "WANDB_TAGS", "WANDB_NAME", "MLFLOW_EXPERIMENT_NAME",
                 "MLFLOW_TRACKING_URI", "MLFLOW_TAGS", "TENSORBOARD_LOGGING_DIR")  # fmt: skip
    for variable in variables:
        monkeypatch.delenv(variable, raising=False)
    cfg = compose(overrides, output_dir=tmp_path)
    args = _args(cfg)
    with cli.logger_environment(cfg.get("logger"), args):
        assert {v: os.environ[v] for v in variables if v in os.environ} == expected
        if "TENSORBOARD_LOGGING_DIR" in expected and importlib.util.find_spec("tensorboard") is not None:
            from transformers.integrations import TensorBoardCallback

            assert TensorBoardCallback().logging_dir == "/tmp/tb"  # read when transformers' callback is built
    assert not any(v in os.environ for v in variables)  # restored afterwards


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["logger=wandb", "+logger.wandb.team=x"], r"logger.wandb.team: unknown option; wandb has project"),
        (["logger=wandb", "args.report_to=[csv]", "logger.wandb.project=x"], "does not log to wandb"),
        (["+logger.comet.project=x"], "logger.comet: unknown logger"),
    ],
)
def test_logger_options_that_would_be_ignored_are_errors(tmp_path, overrides, message):
    cfg = compose(overrides, output_dir=tmp_path)
    with pytest.raises(ValueError, match=message), cli.logger_environment(cfg.get("logger"), _args(cfg)):
        pass


def test_report_to_all_means_every_installed_integration_as_transformers_decides(tmp_path):
    from transformers.integrations import get_available_reporting_integrations

    assert reporting.report_to_names("all") == get_available_reporting_integrations()
    ours = TrainingArguments(str(tmp_path), report_to="all").report_to
    assert ours == transformers.TrainingArguments(str(tmp_path), report_to="all").report_to


# transformers' MLflowCallback.__del__ reads an attribute its failed __init__ never set (transformers' own warning)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("name", ["wandb", "mlflow", "tensorboard", "comet_ml"])
def test_a_missing_integration_fails_at_construction_naming_its_install(tmp_path, factory, monkeypatch, name):
    from transformers.integrations import integration_utils

    from hflight import Trainer

    checks = {"wandb": "is_wandb_available", "mlflow": "is_mlflow_available",
              "tensorboard": "is_tensorboard_available", "comet_ml": "is_comet_available"}  # fmt: skip
    monkeypatch.setattr(integration_utils, checks[name], lambda: False)  # as where the package is not installed
    args = TrainingArguments(str(tmp_path), report_to=name)
    install = {"comet_ml": "comet-ml"}.get(name, f'"hflight[{name}]"')
    with pytest.raises(ImportError, match=rf"report_to='{name}' needs its package: pip install {re.escape(install)}"):
        Trainer(factory.qa_model(), args)


def test_lightning_loggers_passed_in_callbacks_get_every_entry(tmp_path, factory):
    """A Lightning user's own logger instances ride in ``callbacks=`` beside report_to's integrations."""
    from lightning.pytorch.loggers import CSVLogger

    from hflight import Trainer

    mine = CSVLogger(str(tmp_path / "mine"), name="lightning")
    args = TrainingArguments(str(tmp_path / "out"), report_to="none", max_steps=2, per_device_train_batch_size=4,
                             logging_steps=1, save_strategy="no", dataloader_pin_memory=False)  # fmt: skip
    data = factory.qa_dataset(8)
    trainer = Trainer(factory.qa_model(), args, train_dataset=data, eval_dataset=data, callbacks=[mine])
    trainer.train()
    assert trainer.lightning_trainer.loggers == [mine]
    trainer.evaluate()
    rows = list(csv.DictReader((Path(mine.log_dir) / "metrics.csv").open()))
    assert [r["step"] for r in rows if r.get("loss")] == ["1", "2"] and [r["step"] for r in rows if r.get("eval_loss")]
    with pytest.raises(TypeError, match="nor a Lightning Callback or Logger instance"):
        Trainer(factory.qa_model(), args, callbacks=[object()])


def test_csv_logger_gets_the_training_arguments_as_hyperparameters(tmp_path):
    args = TrainingArguments(str(tmp_path), report_to="csv", learning_rate=1e-4, run_name="mine")
    (logger,) = lightning_kwargs.build_loggers(args)
    logger.save()
    import yaml

    hparams = yaml.safe_load((tmp_path / "mine" / "version_0" / "hparams.yaml").read_text())
    assert hparams["training_args"]["learning_rate"] == 1e-4 and hparams["training_args"]["output_dir"] == str(tmp_path)


def test_evaluate_and_predict_after_train_log_to_the_fits_loggers(tmp_path, factory):
    """As with transformers' integrations, the loggers of train() outlive it: the evaluation after it lands in the
    same CSV log (one version folder), not in a new one or nowhere; predict() runs with the same loggers (it logs no
    metrics itself, as in transformers, but a callback's trainer.log during it goes there)."""
    from hflight import Trainer

    args = TrainingArguments(str(tmp_path), report_to="csv", max_steps=2, per_device_train_batch_size=4,
                             logging_steps=1, save_strategy="no", dataloader_pin_memory=False)  # fmt: skip
    data = factory.qa_dataset(8)
    trainer = Trainer(factory.qa_model(), args, train_dataset=data, eval_dataset=data)
    trainer.train()
    (fit_logger,) = trainer.lightning_trainer.loggers
    trainer.evaluate()
    trainer.predict(data)
    assert trainer.lightning_trainer.loggers == [fit_logger]
    (log_dir,) = (tmp_path / "hflight").iterdir()
    rows = list(csv.DictReader((log_dir / "metrics.csv").open()))
    assert [r["step"] for r in rows if r.get("eval_loss")] == ["2"]
