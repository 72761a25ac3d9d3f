"""The package face: every name of ``hflight.qa.__all__`` imports from ``hflight.qa`` and is its module's object."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import hflight.qa

# The issue's list: what users import from hflight.qa, and the module each name lives in.
HOMES = {
    "MRCTrainer": "hflight.qa.trainer",
    "QuestionAnsweringTrainer": "hflight.qa.trainer",
    "load_squad_json": "hflight.qa.data",
    "prepare_train_features": "hflight.qa.preprocess",
    "prepare_validation_features": "hflight.qa.preprocess",
    "postprocess_qa_predictions": "hflight.qa.postprocess",
    "squad_metrics": "hflight.qa.metrics",
    "SquadMetric": "hflight.qa.metrics",
}


def test_the_issues_names_are_exported():
    assert set(HOMES) <= set(hflight.qa.__all__)
    assert hflight.qa.QuestionAnsweringTrainer is hflight.qa.MRCTrainer


@pytest.mark.parametrize("name", sorted(hflight.qa.__all__))
def test_every_exported_name_is_its_modules_object(name):
    namespace: dict = {}
    exec(f"from hflight.qa import {name}", namespace)  # the statement users write
    home = importlib.import_module(HOMES.get(name) or hflight.qa._EXPORTS[name])
    assert namespace[name] is getattr(home, name)
    assert name in dir(hflight.qa)


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'MRCTrainr'"):
        hflight.qa.MRCTrainr  # noqa: B018
    with pytest.raises(ImportError):
        exec("from hflight.qa import MRCTrainr", {})


def test_light_names_do_not_load_the_trainer():
    """Data, post-processing and metrics load only their own modules (no Lightning); the trainer module loads on
    first use."""
    code = (
        "import sys\n"
        "import hflight\n"
        "assert not [m for m in ('torch', 'lightning') if m in sys.modules]\n"
        "from hflight.qa import load_squad_json, postprocess_qa_predictions, prepare_validation_features, "
        "squad_metrics\n"
        "heavy = [m for m in ('hflight.qa.trainer', 'hflight.qa.recipe', 'hflight.trainer', 'lightning') "
        "if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "from hflight.qa import MRCTrainer\n"
        "assert 'hflight.qa.trainer' in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
