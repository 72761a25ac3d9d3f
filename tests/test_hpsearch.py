"""Trainer.hyperparameter_search: optuna backend, HF semantics."""

from __future__ import annotations

import inspect
import os

import pytest
import transformers

from hflight import Trainer, TrainingArguments

optuna = pytest.importorskip("optuna")


def _trainer(tmp_path, factory, **kwargs):
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=3,
        report_to="none",
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
        **kwargs,
    )
    return Trainer(
        model_init=lambda: factory.qa_model(),
        args=args,
        train_dataset=factory.qa_dataset(16),
        eval_dataset=factory.qa_dataset(8, seed=1),
    )


def test_signature_matches_transformers():
    ours = inspect.signature(Trainer.hyperparameter_search).parameters
    theirs = inspect.signature(transformers.Trainer.hyperparameter_search).parameters
    assert list(ours) == list(theirs)
    assert all(ours[n].default == theirs[n].default for n in theirs if n != "kwargs")


def test_search_returns_the_best_run_and_trains_each_trial_in_its_folder(tmp_path, factory):
    trainer = _trainer(tmp_path, factory)
    seen = []

    def space(trial):
        lr = trial.suggest_float("learning_rate", 1e-4, 1e-2, log=True)
        seen.append(lr)
        return {"learning_rate": lr}

    best = trainer.hyperparameter_search(
        hp_space=space, n_trials=3, direction="minimize", sampler=optuna.samplers.RandomSampler(seed=0)
    )
    assert isinstance(best, transformers.trainer_utils.BestRun)
    assert set(best.hyperparameters) == {"learning_rate"} and best.hyperparameters["learning_rate"] in seen
    assert sorted(d for d in os.listdir(tmp_path) if d.startswith("run-")) == []  # save_strategy="no": no files
    assert trainer.args.learning_rate == 5e-5  # the base arguments are restored afterwards
    assert isinstance(best.objective, float)


def test_objective_is_reported_to_optuna_after_each_evaluation(tmp_path, factory):
    trainer = _trainer(tmp_path, factory, eval_strategy="steps", eval_steps=1)
    study_holder = {}

    def space(trial):
        study_holder["trial"] = trial
        return {"learning_rate": trial.suggest_float("learning_rate", 1e-4, 1e-3)}

    trainer.hyperparameter_search(hp_space=space, n_trials=1, compute_objective=lambda m: m["eval_loss"])
    trial = study_holder["trial"]
    assert sorted(trial.storage.get_trial(trial._trial_id).intermediate_values) == [1, 2, 3]


def test_requires_model_init_and_a_known_backend(tmp_path, factory):
    trainer = Trainer(factory.qa_model(), TrainingArguments(output_dir=str(tmp_path), report_to="none"))
    with pytest.raises(RuntimeError, match="model_init"):
        trainer.hyperparameter_search(n_trials=1)
    with pytest.raises(ValueError, match="unknown backend 'ray'"):
        _trainer(tmp_path, factory).hyperparameter_search(n_trials=1, backend="ray")


def test_unknown_hyperparameter_is_rejected(tmp_path, factory):
    with pytest.raises(ValueError, match="not TrainingArguments fields"):
        _trainer(tmp_path, factory).hyperparameter_search(hp_space=lambda t: {"lr": 0.1}, n_trials=1)
