"""The MRC recipe (``hflight.qa.recipe``): the data is loaded and checked before anything is trained, with errors
that name the file; the entry point (``train.py``) knows nothing about QA."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hflight import TrainingArguments, cli
from hflight.config import compose
from hflight.qa.recipe import MRCRecipe, MRCRun
from hflight.qa.synthetic import write_squad_files

REPO = Path(__file__).resolve().parents[2]
SMALL_MODEL = [
    "model.tokenizer_trainer.vocab_size=300",
    "model.config.hidden_size=32",
    "model.config.intermediate_size=64",
    "model.config.max_position_embeddings=128",
    "args.disable_tqdm=true",
]


@pytest.fixture(scope="module")
def squad_files(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("recipe_data")
    return write_squad_files(folder, num_train_articles=3, num_validation_articles=1, paragraphs_per_article=2)


def _empty_squad(path: Path) -> Path:
    path.write_text(json.dumps({"version": "1.1", "data": []}), encoding="utf-8")
    return path


def _nothing_trained(run_dir: Path) -> bool:
    return not list(run_dir.glob("checkpoint-*")) and not (run_dir / "train_results.json").exists()


def test_entry_point_names_an_empty_validation_file_before_training(squad_files, tmp_path):
    """Through train.py: an empty validation set fails at once, naming the file, and nothing is trained (it used to be
    found only after training, as 'No columns in the Evaluation dataset match the model's forward signature')."""
    train_file, _ = squad_files
    empty = _empty_squad(tmp_path / "empty-dev.json")
    run_dir = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, str(REPO / "train.py"), "+experiment=mrc", f"data.train_file={train_file}",
               f"data.validation_file={empty}", f"hydra.run.dir={run_dir}", *SMALL_MODEL]  # fmt: skip
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    reported = proc.stdout + proc.stderr + (run_dir / cli.ERROR_FILE).read_text()
    assert f"data.validation_file={empty}: the validation split has no questions" in reported
    assert "evaluation (args.do_eval) needs at least one" in reported
    assert "No columns" not in reported
    assert _nothing_trained(run_dir) and not (run_dir / "tokenizer").exists()  # checked before anything was built


def _fails(tmp_path: Path, overrides: list[str], error: type[Exception], match: str) -> None:
    cfg = compose(["+experiment=mrc", *SMALL_MODEL, *overrides], output_dir=tmp_path / "run")
    with pytest.raises(error, match=match):
        cli.train(cfg)
    assert _nothing_trained(tmp_path / "run") and not (tmp_path / "run" / "tokenizer").exists()  # nothing built


def test_missing_validation_file(squad_files, tmp_path):
    absent = tmp_path / "absent.json"
    _fails(tmp_path, [f"data.train_file={squad_files[0]}", f"data.validation_file={absent}"], FileNotFoundError,
           f"data.validation_file={absent}: no such file")  # fmt: skip


def test_empty_after_max_eval_samples(squad_files, tmp_path):
    train, dev = squad_files
    _fails(tmp_path, [f"data.train_file={train}", f"data.validation_file={dev}", "data.max_eval_samples=0"],
           ValueError, f"data.validation_file={dev}: the validation split has no questions after "
           "data.max_eval_samples")  # fmt: skip


def test_empty_train_file(squad_files, tmp_path):
    empty = _empty_squad(tmp_path / "empty-train.json")
    _fails(tmp_path, [f"data.train_file={empty}", f"data.validation_file={squad_files[1]}"], ValueError,
           r"empty-train.json: the train split has no questions .*training \(args.do_train\)")  # fmt: skip


def test_validation_without_answers_names_the_missing_column(squad_files, tmp_path):
    rows = tmp_path / "dev.jsonl"
    rows.write_text(json.dumps({"id": "a", "title": "", "context": "Anna lives in Rome.", "question": "Where?"}) + "\n")
    _fails(tmp_path, [f"data.train_file={squad_files[0]}", f"data.validation_file={rows}"], ValueError,
           f"data.validation_file={rows}: the validation split lacks the column.s. answers")  # fmt: skip


def test_unreadable_jsonl_names_the_file(squad_files, tmp_path):
    rows = tmp_path / "dev.jsonl"
    rows.write_text("{this is not json\n")
    _fails(tmp_path, [f"data.train_file={squad_files[0]}", f"data.validation_file={rows}"], ValueError,
           f"data.validation_file={rows}: could not be read as jsonl")  # fmt: skip


def test_no_locatable_training_answer(squad_files, tmp_path):
    """Found before the tokenizer is trained (it would otherwise surface as an empty training set)."""
    squad = json.loads(squad_files[0].read_text())
    for article in squad["data"]:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                qa["answers"] = [{"text": "not in the context at all", "answer_start": 0}]
    train = tmp_path / "train.json"
    train.write_text(json.dumps(squad))
    _fails(tmp_path, [f"data.train_file={train}", f"data.validation_file={squad_files[1]}"], ValueError,
           f"data.train_file={train}: nothing to train on: none of the .* questions")  # fmt: skip


def test_the_task_node_builds_the_recipe(tmp_path):
    """cli.train instantiates `task` and calls its setup(); the recipe hands back the trainer and the data."""
    overrides = ["data.synthetic.num_train_articles=2", "data.synthetic.num_validation_articles=1", *SMALL_MODEL]
    cfg = compose(["+experiment=mrc", *overrides], output_dir=tmp_path)
    from hydra.utils import instantiate

    recipe = instantiate(cfg.task)
    assert isinstance(recipe, MRCRecipe) and recipe.settings["n_best_size"] == 20
    run = recipe.setup(cfg, TrainingArguments.from_config(cfg.args), [])
    assert isinstance(run, MRCRun)
    assert run.trainer.eval_examples is run.examples["validation"]
    assert run.num_samples("validation") == len(run.features["validation"]) >= len(run.examples["validation"])
    assert {"tokenizer", "model", "examples", "features"} <= set(run.objects)


def test_the_entry_point_imports_nothing_of_qa():
    tree = ast.parse(Path(cli.__file__).read_text())
    modules = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    modules += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert modules and not [m for m in modules if m.startswith("hflight.qa")]
