"""The facade's surface and behaviours: signatures, override points, defaults, files, errors."""

from __future__ import annotations

import inspect
import json

import lightning as L
import pytest
import torch
import transformers
from torch import nn

import hflight
from hflight import Trainer, TrainingArguments


def _args(tmp_path, **kwargs):
    defaults = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        num_train_epochs=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
    )
    defaults.update(kwargs)
    return TrainingArguments(**defaults)


# ---- surface ---------------------------------------------------------------------------------------------------
def test_public_api_is_exported():
    expected = {
        "Trainer",
        "TrainingArguments",
        "TrainerCallback",
        "TrainerState",
        "TrainerControl",
        "EarlyStoppingCallback",
        "EvalPrediction",
        "TrainOutput",
        "EvalLoopOutput",
        "PredictionOutput",
        "get_last_checkpoint",
        "set_seed",
    }
    assert expected <= set(hflight.__all__)
    # HF's own classes, so callbacks written for transformers work unchanged
    assert hflight.TrainerCallback is transformers.TrainerCallback
    assert hflight.TrainerState is transformers.TrainerState
    assert hflight.TrainerControl is transformers.TrainerControl
    assert hflight.EarlyStoppingCallback is transformers.EarlyStoppingCallback
    assert hflight.EvalPrediction is transformers.EvalPrediction


def test_constructor_matches_transformers():
    ours = inspect.signature(Trainer.__init__).parameters
    theirs = inspect.signature(transformers.Trainer.__init__).parameters
    positional = [n for n, p in ours.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == list(theirs)
    for name in theirs:
        assert ours[name].default == theirs[name].default, name
    assert "tokenizer" in ours


@pytest.mark.parametrize(
    "method",
    [
        "train",
        "evaluate",
        "predict",
        "evaluation_loop",
        "prediction_step",
        "compute_loss",
        "training_step",
        "create_optimizer",
        "create_scheduler",
        "create_optimizer_and_scheduler",
        "get_train_dataloader",
        "get_eval_dataloader",
        "get_test_dataloader",
        "num_examples",
        "log",
        "save_model",
        "add_callback",
        "pop_callback",
        "remove_callback",
    ],
)
def test_method_signatures_match_transformers(method):
    ours = inspect.signature(getattr(Trainer, method)).parameters
    theirs = inspect.signature(getattr(transformers.Trainer, method)).parameters
    shared = [n for n in theirs if n in ours]
    assert shared == [n for n in ours if n in theirs and ours[n].kind is not inspect.Parameter.VAR_KEYWORD]
    for name in shared:
        assert ours[name].default == theirs[name].default, (method, name)


# ---- behaviours ------------------------------------------------------------------------------------------------
def test_tokenizer_alias_and_default_collator(tmp_path, factory):
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=__import__("tokenizers").Tokenizer(
            __import__("tokenizers").models.WordLevel({"[PAD]": 0, "[UNK]": 1}, unk_token="[UNK]")
        ),
        pad_token="[PAD]",
        unk_token="[UNK]",
    )
    trainer = Trainer(factory.qa_model(), _args(tmp_path), tokenizer=tokenizer)
    assert trainer.processing_class is tokenizer
    assert isinstance(trainer.data_collator, transformers.DataCollatorWithPadding)
    plain = Trainer(factory.qa_model(), _args(tmp_path))
    assert plain.data_collator is transformers.default_data_collator
    with pytest.raises(ValueError, match="either `processing_class` or its older name `tokenizer`"):
        Trainer(factory.qa_model(), _args(tmp_path), processing_class=tokenizer, tokenizer=object())


def test_label_names_default_like_hf(tmp_path, factory):
    assert Trainer(factory.qa_model(), _args(tmp_path)).label_names == ["start_positions", "end_positions"]
    assert Trainer(factory.cls_model(), _args(tmp_path)).label_names == ["labels"]
    assert Trainer(factory.cls_model(), _args(tmp_path, label_names=["y"])).label_names == ["y"]


def test_remove_unused_columns_keeps_model_inputs(tmp_path, factory):
    data = factory.qa_dataset(8, extra_columns=True)
    trainer = Trainer(factory.qa_model(), _args(tmp_path), train_dataset=data)
    batch = next(iter(trainer.get_train_dataloader()))
    assert "example_id" not in batch and {"input_ids", "start_positions"} <= set(batch)
    kept = Trainer(factory.qa_model(), _args(tmp_path, remove_unused_columns=False), train_dataset=data)
    assert "example_id" in kept._remove_unused_columns(data).column_names


def test_model_init_builds_a_fresh_model_per_train(tmp_path, factory):
    calls = []

    def model_init():
        calls.append(1)
        return factory.qa_model(seed=len(calls))

    trainer = Trainer(model_init=model_init, args=_args(tmp_path), train_dataset=factory.qa_dataset(8))
    first = trainer.model
    trainer.train()
    assert trainer.model is not first and len(calls) == 2
    with pytest.raises(ValueError, match="but not both"):
        Trainer(factory.qa_model(), _args(tmp_path), model_init=model_init)


def test_optimizers_tuple_and_optimizer_cls_and_kwargs_are_honoured(tmp_path, factory):
    model = factory.qa_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    trainer = Trainer(model, _args(tmp_path), train_dataset=factory.qa_dataset(8), optimizers=(opt, sched))
    trainer.train()
    assert trainer.optimizer is opt and trainer.lr_scheduler is sched
    assert trainer.state.log_history[0]["learning_rate"] == pytest.approx(0.25)

    other = Trainer(
        factory.qa_model(),
        _args(tmp_path),
        train_dataset=factory.qa_dataset(8),
        optimizer_cls_and_kwargs=(torch.optim.Adagrad, {"lr": 0.01}),
    )
    other.train()
    assert isinstance(other.optimizer, torch.optim.Adagrad)


def test_weight_decay_grouping_excludes_bias_and_layernorm(tmp_path, factory):
    trainer = Trainer(factory.qa_model(), _args(tmp_path, weight_decay=0.1))
    optimizer = trainer.create_optimizer()
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    assert all("bias" in names[id(p)] or "LayerNorm" in names[id(p)] for p in no_decay["params"])
    assert not any("bias" in names[id(p)] or "LayerNorm" in names[id(p)] for p in decay["params"])
    assert isinstance(optimizer, torch.optim.AdamW)


def test_subclass_overrides_are_used(tmp_path, factory):
    seen = set()

    class Custom(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            seen.add("compute_loss")
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

        def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
            seen.add("prediction_step")
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)

        def create_optimizer(self, model=None):
            seen.add("create_optimizer")
            if self.optimizer is None:
                self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
            return self.optimizer

        def get_train_dataloader(self):
            seen.add("get_train_dataloader")
            return super().get_train_dataloader()

        def get_eval_dataloader(self, eval_dataset=None):
            seen.add("get_eval_dataloader")
            return super().get_eval_dataloader(eval_dataset)

        def get_test_dataloader(self, test_dataset):
            seen.add("get_test_dataloader")
            return super().get_test_dataloader(test_dataset)

    data = factory.qa_dataset(8)
    trainer = Custom(factory.qa_model(), _args(tmp_path), train_dataset=data, eval_dataset=data)
    trainer.train()
    trainer.evaluate()
    trainer.predict(data)
    assert isinstance(trainer.optimizer, torch.optim.SGD)
    assert seen == {
        "compute_loss",
        "prediction_step",
        "create_optimizer",
        "get_train_dataloader",
        "get_eval_dataloader",
        "get_test_dataloader",
    }


def test_metric_keys_log_history_and_files(tmp_path, factory):
    data = factory.qa_dataset(16)
    trainer = Trainer(
        factory.qa_model(),
        _args(tmp_path, num_train_epochs=2),
        train_dataset=data,
        eval_dataset={"a": data, "b": factory.qa_dataset(8, seed=3)},
    )
    output = trainer.train()
    assert {"train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss", "epoch"} <= set(
        output.metrics
    )
    step_log = trainer.state.log_history[0]
    assert set(step_log) == {"loss", "grad_norm", "learning_rate", "epoch", "step"}
    metrics = trainer.evaluate()
    assert {"eval_a_loss", "eval_b_loss", "eval_a_runtime", "eval_b_samples_per_second"} <= set(metrics)
    trainer.save_metrics("eval", metrics)
    trainer.save_metrics("train", output.metrics)
    trainer.save_state()
    out = tmp_path / "out"
    assert json.loads((out / "eval_results.json").read_text())["eval_a_loss"] == metrics["eval_a_loss"]
    combined = json.loads((out / "all_results.json").read_text())
    assert "train_loss" in combined and "eval_b_loss" in combined
    state = transformers.TrainerState.load_from_json(str(out / "trainer_state.json"))
    assert state.global_step == trainer.state.global_step == 8


def test_save_model_is_loadable_with_from_pretrained(tmp_path, factory):
    trainer = Trainer(factory.qa_model(), _args(tmp_path), train_dataset=factory.qa_dataset(8))
    trainer.train()
    trainer.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "model.safetensors").is_file()
    loaded = transformers.AutoModelForQuestionAnswering.from_pretrained(str(tmp_path / "saved"))
    for (name, a), b in zip(trainer.model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("lib", [transformers, hflight])
def test_save_model_saves_the_collators_tokenizer_without_a_processing_class(tmp_path, factory, lib):
    """transformers' fallback: no ``processing_class``, a data collator with a ``tokenizer``: that tokenizer is saved
    beside the model (so the folder loads with ``AutoTokenizer``)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel({"[UNK]": 0, "[PAD]": 1, "hi": 2}, unk_token="[UNK]")),
        unk_token="[UNK]",
        pad_token="[PAD]",
    )
    collator = transformers.DataCollatorWithPadding(tokenizer)
    trainer = lib.Trainer(factory.qa_model(), lib.TrainingArguments(str(tmp_path), report_to="none"), collator)
    trainer.save_model(str(tmp_path / "saved"))
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "saved").get_vocab() == tokenizer.get_vocab()


def test_progress_callbacks_follow_disable_tqdm(tmp_path, factory):
    quiet = Trainer(factory.qa_model(), _args(tmp_path, disable_tqdm=True))
    loud = Trainer(factory.qa_model(), _args(tmp_path, disable_tqdm=False))
    names = lambda t: {type(cb).__name__ for cb in t.callback_handler.callbacks}  # noqa: E731
    assert "PrinterCallback" in names(quiet) and "ProgressCallback" not in names(quiet)
    assert "ProgressCallback" in names(loud) and "PrinterCallback" not in names(loud)


def test_callbacks_api_and_lightning_callbacks_reach_lightning(tmp_path, factory):
    class Counter(L.Callback):
        batches = 0

        def on_train_batch_end(self, *args, **kwargs):
            Counter.batches += 1

    trainer = Trainer(
        factory.qa_model(),
        _args(tmp_path),
        train_dataset=factory.qa_dataset(8),
        callbacks=[Counter(), transformers.EarlyStoppingCallback],
    )
    assert any(isinstance(cb, transformers.EarlyStoppingCallback) for cb in trainer.callback_handler.callbacks)
    popped = trainer.pop_callback(transformers.EarlyStoppingCallback)
    assert isinstance(popped, transformers.EarlyStoppingCallback)
    trainer.add_callback(popped)
    trainer.remove_callback(transformers.EarlyStoppingCallback)
    assert not any(isinstance(cb, transformers.EarlyStoppingCallback) for cb in trainer.callback_handler.callbacks)
    trainer.train()
    assert Counter.batches == 2  # 8 examples / batch 4
    assert trainer.is_world_process_zero() and trainer.is_local_process_zero()


def test_predict_without_labels_returns_logits_only(tmp_path, factory):
    data = factory.qa_dataset(10).remove_columns(["start_positions", "end_positions"])
    trainer = Trainer(factory.qa_model(), _args(tmp_path))
    output = trainer.predict(data)
    assert output.label_ids is None and output.predictions[0].shape == (10, 24)
    assert "test_loss" not in output.metrics and "test_runtime" in output.metrics


def test_label_smoothing_is_disabled_with_a_warning_for_multi_label_classification(tmp_path, factory):
    """transformers' rule: a multi-label classifier (BCE loss) gets no label smoother, and a UserWarning says so."""
    model = factory.cls_model()
    args = _args(tmp_path, label_smoothing_factor=0.1)
    assert Trainer(model, args).label_smoother is not None
    model.config.problem_type = "multi_label_classification"
    with pytest.warns(UserWarning, match="Label smoothing is not compatible with multi-label classification"):
        assert Trainer(model, args).label_smoother is None


class _SkipLogitsRecorder(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.seen = nn.Linear(2, 2), []

    def forward(self, x, labels=None, skip_logits=None):
        self.seen.append(skip_logits)
        return {"loss": self.linear(x).sum(), "logits": self.linear(x)}


def test_prediction_step_asks_liger_models_to_skip_logits_for_a_loss_only_evaluation(tmp_path):
    """With ``use_liger_kernel`` (set on the arguments object: building it with the flag is the optimizer helpers'
    part), a loss-only prediction step passes ``skip_logits=True``, as transformers', and not otherwise."""
    model = _SkipLogitsRecorder()
    trainer = Trainer(model, _args(tmp_path))
    batch = {"x": torch.ones(1, 2), "labels": torch.zeros(1)}
    trainer.prediction_step(model, dict(batch), prediction_loss_only=True)
    trainer.args.use_liger_kernel = True
    trainer.prediction_step(model, dict(batch), prediction_loss_only=False)
    trainer.prediction_step(model, dict(batch), prediction_loss_only=True)
    assert model.seen == [None, None, True]


# ---- bad input -------------------------------------------------------------------------------------------------
class NoLossModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x, labels=None):
        return {"logits": self.linear(x.float())}


def test_model_without_loss_raises_a_clear_error(tmp_path):
    import datasets

    data = datasets.Dataset.from_dict({"x": [[0.0] * 4] * 8, "labels": [0] * 8})
    trainer = Trainer(NoLossModel(), _args(tmp_path), train_dataset=data)
    with pytest.raises(ValueError, match="did not return a loss"):
        trainer.train()


def test_batch_missing_label_columns_raises(tmp_path, factory):
    data = factory.qa_dataset(8).remove_columns(["start_positions", "end_positions"])
    trainer = Trainer(factory.qa_model(), _args(tmp_path), train_dataset=data)
    with pytest.raises(ValueError, match="start_positions, end_positions"):
        trainer.train()


def test_empty_dataset_raises(tmp_path, factory):
    empty = factory.qa_dataset(8).select([])
    trainer = Trainer(factory.qa_model(), _args(tmp_path), train_dataset=empty)
    with pytest.raises(ValueError, match="empty"):
        trainer.train()


def test_evaluate_without_eval_dataset_raises(tmp_path, factory):
    trainer = Trainer(factory.qa_model(), _args(tmp_path))
    with pytest.raises(ValueError, match="evaluation requires an eval_dataset"):
        trainer.evaluate()
    with pytest.raises(ValueError, match="training requires a train_dataset"):
        trainer.train()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"model": "bert"}, TypeError, "`model` must be a torch.nn.Module"),
        ({"callbacks": "EarlyStopping"}, TypeError, "`callbacks` must be a list"),
        ({"callbacks": [object()]}, TypeError, "neither a transformers TrainerCallback"),
        ({"optimizers": None}, TypeError, "`optimizers` must be a tuple"),
        ({"compute_metrics": 3}, TypeError, "`compute_metrics` must be callable"),
        ({"train_dataset": 5}, TypeError, "`train_dataset` must be a Dataset"),
        ({"args": {"output_dir": "x"}}, TypeError, "TrainingArguments"),
    ],
)
def test_wrong_argument_types_raise(tmp_path, factory, kwargs, error, match):
    base = {"model": factory.qa_model(), "args": _args(tmp_path)}
    base.update(kwargs)
    with pytest.raises(error, match=match):
        Trainer(**base)


@pytest.mark.parametrize("lib", [transformers, hflight])
def test_constructor_refuses_what_transformers_refuses(tmp_path, factory, lib):
    """An evaluation strategy without an evaluation set, an optimizer given twice, an optimizer for a model that
    ``model_init`` replaces, a ``model_init`` of two arguments: transformers refuses each when the Trainer is built;
    so does hflight, with its words."""
    model = factory.qa_model()
    args = {"output_dir": str(tmp_path), "report_to": "none"}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="but you didn't pass an `eval_dataset` to `Trainer`"):
        lib.Trainer(model, lib.TrainingArguments(**args, eval_strategy="steps", eval_steps=1))
    with pytest.raises(RuntimeError, match="Passing both `optimizers` and `optimizer_cls_and_kwargs`"):
        lib.Trainer(
            model,
            lib.TrainingArguments(**args),
            optimizers=(optimizer, None),
            optimizer_cls_and_kwargs=(torch.optim.SGD, {}),
        )
    with pytest.raises(RuntimeError, match="Passing a `model_init` is incompatible with providing the `optimizers`"):
        lib.Trainer(args=lib.TrainingArguments(**args), model_init=lambda: model, optimizers=(optimizer, None))
    with pytest.raises(RuntimeError, match="model_init should have 0 or 1 argument."):
        lib.Trainer(args=lib.TrainingArguments(**args), model_init=lambda trial, other: model)


def test_model_or_model_init_required():
    with pytest.raises(RuntimeError, match="requires either a `model` or `model_init`"):
        Trainer()


def test_transformers_training_arguments_are_accepted(tmp_path, factory):
    hf_args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), learning_rate=3e-4, report_to="none")
    trainer = Trainer(factory.qa_model(), hf_args)
    assert isinstance(trainer.args, TrainingArguments) and trainer.args.learning_rate == 3e-4
    bad = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), debug="tpu_metrics_debug", report_to="none")
    with pytest.raises(ValueError, match="debug="):
        Trainer(factory.qa_model(), bad)


def test_report_to_csv_writes_a_lightning_csv_log(tmp_path, factory):
    import csv

    trainer = Trainer(
        factory.qa_model(), _args(tmp_path, report_to="csv", max_steps=2), train_dataset=factory.qa_dataset(8)
    )
    trainer.train()
    files = list((tmp_path / "out").rglob("metrics.csv"))
    assert len(files) == 1
    rows = list(csv.DictReader(files[0].open()))
    assert [r["step"] for r in rows if r["loss"]] == ["1", "2"]
    assert any(r.get("train_loss") for r in rows)


def test_report_to_is_transformers_integrations_plus_csv(tmp_path, factory):
    """transformers' integration callbacks where transformers.Trainer puts them (after DefaultFlowCallback, before
    the caller's), hflight's "csv" a Lightning logger; an unknown name fails at construction, naming the known ones."""
    from transformers.integrations import TensorBoardCallback

    from hflight.arguments import reporting

    assert reporting.report_to_names("none") == [] and reporting.report_to_names("csv,tensorboard") == [
        "csv",
        "tensorboard",
    ]
    with pytest.raises(ValueError, match=r"unknown integration\(s\) \['comet'\]; known: azure_ml, comet_ml"):
        hflight.Trainer(factory.qa_model(), _args(tmp_path, report_to=["comet"]))
    pytest.importorskip("tensorboard")
    seen = []
    for library in (transformers, hflight):
        trainer = library.Trainer(factory.qa_model(), _args(tmp_path, report_to=["tensorboard"]),
                                  callbacks=[transformers.EarlyStoppingCallback()])  # fmt: skip
        seen.append([type(cb).__name__ for cb in trainer.callback_handler.callbacks])
    assert seen[0] == seen[1] and seen[1][:2] == ["DefaultFlowCallback", TensorBoardCallback.__name__]
    trainer = hflight.Trainer(factory.qa_model(), _args(tmp_path, report_to=["csv"]))
    assert [type(cb).__name__ for cb in trainer.callback_handler.callbacks] == [
        "DefaultFlowCallback",
        "PrinterCallback",
    ]


def test_a_model_loaded_in_eval_mode_trains_without_lightnings_eval_mode_warning(tmp_path, factory, recwarn):
    model = factory.qa_model().eval()  # from_pretrained returns models in eval mode
    Trainer(model, _args(tmp_path, max_steps=1), train_dataset=factory.qa_dataset(8)).train()
    assert model.training  # as after transformers.Trainer.train()
    assert not [w for w in recwarn if "in eval mode at the start of training" in str(w.message)]


@pytest.mark.parametrize(
    "code",
    [
        # import hflight loads neither torch nor Lightning; the backends join Lightning's registries with the arguments
        "import sys, hflight\nassert not [m for m in ('torch', 'lightning') if m in sys.modules]\n"
        "from hflight import TrainingArguments\nfrom lightning.pytorch.strategies import StrategyRegistry\n"
        "assert 'ort' in StrategyRegistry and 'ipu' in StrategyRegistry",
        # ... or when a backend package is imported, for lightning.Trainer(strategy=...) used directly
        "import hflight.ort\nfrom lightning.pytorch.strategies import StrategyRegistry\n"
        "assert 'ort' in StrategyRegistry",
    ],
)
def test_import_hflight_is_light_and_backends_register_when_used(code):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_with_persistent_workers_each_evaluation_set_keeps_its_loader_as_transformers(tmp_path, factory):
    """``dataloader_persistent_workers``: transformers keeps one evaluation loader per set (a name of the eval_dataset
    dict, else "eval"), so that its workers start once; without it every evaluation builds a new loader."""
    sets = {"a": factory.qa_dataset(8), "b": factory.qa_dataset(8, seed=1)}
    loaders = {}
    for library in (transformers, hflight):
        for persistent in (True, False):
            args = library.TrainingArguments(output_dir=str(tmp_path / f"{library.__name__}{persistent}"),
                                             dataloader_num_workers=2, dataloader_persistent_workers=persistent,
                                             report_to="none", use_cpu=True)  # fmt: skip
            trainer = library.Trainer(factory.qa_model(), args, eval_dataset=sets)
            first = {name: trainer.get_eval_dataloader(name) for name in sets}
            again = {name: trainer.get_eval_dataloader(name) for name in sets}
            loaders[library.__name__, persistent] = (
                [first[name] is again[name] for name in sets], first["a"] is first["b"],
            )  # fmt: skip
    assert loaders["hflight", True] == loaders["transformers", True] == ([True, True], False)
    assert loaders["hflight", False] == loaders["transformers", False] == ([False, False], False)


def test_a_training_step_called_outside_train_backpropagates_as_transformers(tmp_path, factory):
    """``trainer.training_step(model, inputs, num_items_in_batch)`` by hand, outside ``train()`` (as transformers' own
    tests call it): the same loss and gradients as transformers' (whose accelerator's backward is ``loss.backward``)."""
    data = factory.qa_dataset(4)
    results = []
    for library in (transformers, hflight):
        args = library.TrainingArguments(output_dir=str(tmp_path / library.__name__), report_to="none", use_cpu=True)
        model = factory.qa_model()
        trainer = library.Trainer(model, args, train_dataset=data)
        inputs = next(iter(trainer.get_train_dataloader()))
        loss = trainer.training_step(model, inputs, len(inputs["input_ids"]))
        results.append((loss.item(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (hf_loss, hf_grads), (hl_loss, hl_grads) = results
    assert hl_loss == hf_loss
    assert len(hl_grads) == len(hf_grads) > 0 and all(torch.equal(a, b) for a, b in zip(hf_grads, hl_grads))
