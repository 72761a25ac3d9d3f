"""``report_to`` writes what transformers writes (issue 31), read back with TensorBoard's and MLflow's own readers
and, for W&B, its offline run file parsed here with W&B's own protobuf record classes.

tests/jobs/tracking_job.py trains a tiny classifier reporting to TensorBoard, MLflow (an SQLite store) and W&B
(offline), evaluating every 4 steps, then evaluates and predicts once more; it runs once with transformers.Trainer and
once with hflight.Trainer, each in its own process and working folder. What each run recorded is then compared:
TensorBoard's event files through tensorboard's ``EventAccumulator`` (scalar tags, steps, values, the ``args`` and
``model_config`` texts), MLflow's store through ``MlflowClient`` (runs, metric histories, params, tags), W&B's offline
run file through W&B's own protobuf records (tests/wandb_records.py: history rows, config, run name and project).
Values are compared bit for bit; timings (``*_runtime``, ``*_per_second``) by their steps only. hflight's own
``TrainingArguments`` fields (:data:`HFLIGHT_FIELDS`) are the one named addition in the logged hyperparameters.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")
pytest.importorskip("wandb")

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "jobs" / "tracking_job.py"
LIBRARIES = ("transformers", "hflight")
TIMINGS = ("runtime", "per_second")

pytestmark = [pytest.mark.subprocess]


def _hflight_fields() -> set[str]:
    import transformers

    import hflight

    ours = {f.name for f in dataclasses.fields(hflight.TrainingArguments)}
    return ours - {f.name for f in dataclasses.fields(transformers.TrainingArguments)}


#: hflight's TrainingArguments fields transformers' class lacks: logged by hflight's runs only.
HFLIGHT_FIELDS = _hflight_fields()


def _timing(key: str) -> bool:
    return any(t in key for t in TIMINGS)


def _assert_same_series(theirs: dict, ours: dict) -> int:
    """Per tag or metric, the same (step, value) points; timings by their steps only. Returns how many points."""
    assert set(ours) == set(theirs)
    for key, points in theirs.items():
        if _timing(key):
            assert [step for step, _ in ours[key]] == [step for step, _ in points], key
        else:
            assert ours[key] == points, key
    return sum(len(points) for points in theirs.values())


def _assert_same_but_hflight_fields(theirs: dict, ours: dict) -> None:
    """Logged hyperparameters: hflight's own TrainingArguments fields are the one addition (where any were logged);
    every other key and value is transformers'."""
    assert set(ours) - set(theirs) == (HFLIGHT_FIELDS if ours else set())
    assert {k: v for k, v in ours.items() if k not in HFLIGHT_FIELDS} == theirs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tracking")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for name in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_ENTITY", "MLFLOW_TAGS", "TENSORBOARD_LOGGING_DIR"):
        env.pop(name, None)

    def one(library: str) -> Path:
        folder = root / library
        folder.mkdir()
        done = subprocess.run([sys.executable, str(JOB), library], cwd=folder, env=env, capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        return folder

    with ThreadPoolExecutor(2) as pool:  # the two processes side by side (one torch thread each)
        return dict(zip(LIBRARIES, pool.map(one, LIBRARIES)))


# ---- TensorBoard ----------------------------------------------------------------------------------------------------
def _event_files(folder: Path) -> list[Path]:
    # transformers' default log dir: out/runs/<date>_<host>/; one file per SummaryWriter, numbered in creation order
    return sorted((folder / "out" / "runs").glob("*/events.out.tfevents.*"), key=lambda p: int(p.name.rsplit(".")[-1]))


def _tensorboard(path: Path) -> tuple[dict, dict]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    texts = {tag: [e.tensor_proto.string_val[0].decode() for e in events.Tensors(tag)]
             for tag in events.Tags()["tensors"]}  # fmt: skip
    return scalars, texts


def test_tensorboard_scalars_and_texts_are_transformers(runs):
    theirs, ours = (_event_files(runs[k]) for k in LIBRARIES)
    assert len(ours) == len(theirs) == 2  # train(); evaluate() after it (transformers' callback closed the first)
    compared = 0
    for their_file, our_file in zip(theirs, ours, strict=True):
        (their_scalars, their_texts), (our_scalars, our_texts) = _tensorboard(their_file), _tensorboard(our_file)
        assert list(our_scalars) == list(their_scalars)  # the same tags, first written in the same order
        compared += _assert_same_series(their_scalars, our_scalars)
        assert set(our_texts) == set(their_texts)
        for tag, texts in their_texts.items():
            if tag.startswith("args/"):
                assert len(our_texts[tag]) == len(texts)
                for theirs_json, ours_json in zip(texts, our_texts[tag]):
                    _assert_same_but_hflight_fields(json.loads(theirs_json), json.loads(ours_json))
            else:
                assert our_texts[tag] == texts, tag
    assert {"train/loss", "train/grad_norm", "train/learning_rate", "eval/loss", "train/train_loss"} <= set(
        _tensorboard(ours[0])[0]
    )
    assert compared >= 40


# ---- MLflow ---------------------------------------------------------------------------------------------------------
def _mlflow(folder: Path, experiment: str | None = "tracking") -> list:
    """(run, metric histories) of every run in ``experiment`` (None: in every experiment), oldest first."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}")
    experiments = [client.get_experiment_by_name(experiment)] if experiment else client.search_experiments()
    found = client.search_runs([e.experiment_id for e in experiments], order_by=["attributes.start_time ASC"])
    return [
        (
            run,
            {
                key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
                for key in run.data.metrics
            },
        )  # fmt: skip
        for run in found
    ]


def test_mlflow_runs_metrics_params_and_tags_are_transformers(runs):
    theirs, ours = (_mlflow(runs[k]) for k in LIBRARIES)
    assert len(ours) == len(theirs) == 2  # the training run and the run evaluate() after it opened
    compared = 0
    for (their_run, their_metrics), (our_run, our_metrics) in zip(theirs, ours, strict=True):
        assert our_run.info.run_name == their_run.info.run_name
        assert our_run.info.status == their_run.info.status == "FINISHED"
        compared += _assert_same_series(their_metrics, our_metrics)
        _assert_same_but_hflight_fields(their_run.data.params, our_run.data.params)
        assert our_run.data.tags == their_run.data.tags
    assert theirs[0][0].info.run_name == "tiny-run" and len(theirs[0][0].data.params) > 100
    assert [s for s, _ in theirs[0][1]["loss"]] == list(range(1, 9)) and compared >= 40


# ---- W&B ------------------------------------------------------------------------------------------------------------
def _wandb(folder: Path):
    from . import wandb_records

    (path,) = (folder / "wandb").glob("offline-run-*/run-*.wandb")
    return wandb_records.run(path), wandb_records.history(path), wandb_records.config(path)


def test_wandb_history_config_and_run_are_transformers(runs):
    (their_run, their_rows, their_config), (our_run, our_rows, our_config) = (_wandb(runs[k]) for k in LIBRARIES)
    assert (our_run.display_name, our_run.project) == (their_run.display_name, their_run.project)
    assert (their_run.display_name, their_run.project) == ("tiny-run", "hflight-tests")
    assert len(our_rows) == len(their_rows) >= 12
    compared = 0
    for theirs, ours in zip(their_rows, our_rows, strict=True):
        assert set(ours) == set(theirs)
        for key, value in theirs.items():
            if key in ("_timestamp", "_runtime") or _timing(key):
                continue
            assert ours[key] == value, (theirs.get("train/global_step"), key)
            compared += 1
    assert [r["train/global_step"] for r in their_rows if "train/loss" in r] == list(range(1, 9))
    their_config.pop("_wandb", None), our_config.pop("_wandb", None)  # W&B's own bookkeeping, where it writes it
    assert our_config and set(our_config) - set(their_config) == HFLIGHT_FIELDS
    _assert_same_but_hflight_fields(their_config, our_config)
    assert their_config["learning_rate"] == 1e-3 and "model/num_parameters" in their_config
    assert compared >= 40


# ---- the command line's logger groups ------------------------------------------------------------------------------
def test_cli_logger_groups_go_through_the_same_callbacks_with_the_composed_config(tmp_path, monkeypatch):
    """``logger=tensorboard`` (and report_to naming mlflow and wandb beside it): the same integration callbacks, the
    TrainingArguments as they log them, and the composed config beside them (hflight.cli.loggers)."""
    from hflight import cli
    from hflight.config import compose

    from . import wandb_records
    from .support import TINY

    monkeypatch.chdir(tmp_path)
    for name, value in (("WANDB_MODE", "offline"), ("WANDB_DIR", str(tmp_path)), ("WANDB_SILENT", "true"),
                        ("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")):  # fmt: skip
        monkeypatch.setenv(name, value)
    overrides = [*TINY, "args.num_train_epochs=1", "logger=tensorboard", f"logger.tensorboard.log_dir={tmp_path}/tb",
                 "args.report_to=[tensorboard,mlflow,wandb]", "args.run_name=cli-run"]  # fmt: skip
    cfg = compose(overrides, output_dir=tmp_path / "run")
    try:
        cli.train(cfg)
    finally:
        from hflight.cli.loggers import _close_loggers

        _close_loggers()  # what hflight.cli.run does after each job
    # TensorBoard: transformers' tags, the arguments and the composed config as text
    scalars, texts = _tensorboard(sorted((tmp_path / "tb").glob("events.out.tfevents.*"))[0])
    assert {"train/loss", "eval/f1", "eval/exact_match", "train/learning_rate"} <= set(scalars)
    assert json.loads(texts["args/text_summary"][0])["run_name"] == "cli-run"
    import yaml

    assert yaml.safe_load(texts["config/text_summary"][0])["args"]["learning_rate"] == cfg.args.learning_rate
    # MLflow: the arguments as params, the composed config as config.<key>
    (run, metrics), *_ = _mlflow(tmp_path, experiment=None)
    assert run.info.run_name == "cli-run" and "eval_f1" in metrics and [s for s, _ in metrics["loss"]]
    assert run.data.params["learning_rate"] == str(cfg.args.learning_rate)
    assert run.data.params["config.args.learning_rate"] == str(cfg.args.learning_rate)
    assert run.data.params["config.data.synthetic.num_train_articles"] == "3"
    # W&B: the arguments in wandb.config, the composed config under "config"
    (path,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    config = wandb_records.config(path)
    assert (
        config["learning_rate"] == cfg.args.learning_rate and config["config"]["model"]["config"]["hidden_size"] == 32
    )
    assert any("train/loss" in row for row in wandb_records.history(path))
