"""HF callback events fire in HF's order with HF's state, and TrainerControl set by callbacks is honoured."""

from __future__ import annotations

import os

import pytest
import transformers
from transformers import TrainerCallback

import hflight

EVENTS = [
    "on_init_end",
    "on_train_begin",
    "on_train_end",
    "on_epoch_begin",
    "on_epoch_end",
    "on_step_begin",
    "on_pre_optimizer_step",
    "on_optimizer_step",
    "on_substep_end",
    "on_step_end",
    "on_log",
    "on_prediction_step",
    "on_evaluate",
    "on_save",
    "on_predict",
]


class Recorder(TrainerCallback):
    """Records (event, global_step, epoch rounded to 4 places) for every HF event."""

    def __init__(self):
        self.events: list[tuple[str, int, float]] = []
        self.kwargs: dict[str, set[str]] = {}

    def __getattribute__(self, name):
        if name in EVENTS:

            def record(args, state, control, **kwargs):
                self.events.append((name, state.global_step, round(state.epoch or 0.0, 4)))
                self.kwargs.setdefault(name, set()).update(k for k, v in kwargs.items() if v is not None)

            return record
        return super().__getattribute__(name)


BASE = dict(
    per_device_train_batch_size=4,
    per_device_eval_batch_size=4,
    learning_rate=1e-3,
    train_sampling_strategy="sequential",
    report_to="none",
    disable_tqdm=True,
    seed=0,
)


def _record(tmp_path, factory, name, trainer_cls, args_cls, extra_callbacks=(), n_train=20, **kwargs):
    recorder = Recorder()
    args = args_cls(output_dir=str(tmp_path / name), **{**BASE, **kwargs})
    trainer = trainer_cls(
        factory.qa_model(),
        args,
        train_dataset=factory.qa_dataset(n_train),
        eval_dataset=factory.qa_dataset(6, seed=1),
        callbacks=[recorder, *extra_callbacks],
    )
    trainer.train()
    trainer.predict(factory.qa_dataset(6, seed=2))
    return recorder, trainer


def _both(tmp_path, factory, make_extra=lambda: (), **kwargs):
    hf = _record(tmp_path, factory, "hf", transformers.Trainer, transformers.TrainingArguments, make_extra(), **kwargs)
    hl = _record(tmp_path, factory, "hl", hflight.Trainer, hflight.TrainingArguments, make_extra(), **kwargs)
    return hf, hl


SCENARIOS = {
    "a_steps": dict(
        gradient_accumulation_steps=1,
        logging_steps=2,
        eval_strategy="steps",
        eval_steps=3,
        save_steps=4,
        num_train_epochs=2,
    ),
    "b_accumulation_epoch": dict(
        gradient_accumulation_steps=2,
        logging_strategy="epoch",
        eval_strategy="epoch",
        save_strategy="epoch",
        num_train_epochs=2,
    ),
    "c_max_steps_mid_epoch": dict(
        max_steps=7,
        logging_steps=3,
        eval_strategy="steps",
        eval_steps=5,
        save_strategy="no",
        gradient_accumulation_steps=1,
    ),
    "d_first_step_and_eval_on_start": dict(
        logging_first_step=True,
        eval_on_start=True,
        logging_steps=4,
        eval_strategy="steps",
        eval_steps=4,
        save_strategy="no",
        num_train_epochs=1,
    ),
    # no step at all: transformers still begins and ends training (with its progress bar: disable_tqdm=False)
    "e_no_step": dict(num_train_epochs=0, disable_tqdm=False),
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_event_sequence_matches_transformers(tmp_path, factory, scenario):
    (hf, hf_trainer), (hl, hl_trainer) = _both(tmp_path, factory, **SCENARIOS[scenario])
    assert hl.events == hf.events
    assert hl_trainer.state.global_step == hf_trainer.state.global_step
    hf_ckpts = sorted(p for p in os.listdir(hf_trainer.args.output_dir) if p.startswith("checkpoint-"))
    hl_ckpts = sorted(p for p in os.listdir(hl_trainer.args.output_dir) if p.startswith("checkpoint-"))
    assert hl_ckpts == hf_ckpts


def test_resuming_at_the_last_step_begins_and_ends_training_as_transformers(tmp_path, factory):
    """A run resumed from its final checkpoint has no step left: on_train_begin, on_log, on_train_end all the same
    (Lightning starts no training loop then; transformers' progress bar, created on on_train_begin, must exist)."""
    events = {}
    for name, trainer_cls, args_cls in (
        ("hf", transformers.Trainer, transformers.TrainingArguments),
        ("hl", hflight.Trainer, hflight.TrainingArguments),
    ):
        args = args_cls(output_dir=str(tmp_path / name), **{**BASE, "max_steps": 2, "save_steps": 2})
        trainer_cls(factory.qa_model(), args, train_dataset=factory.qa_dataset(8)).train()
        recorder = Recorder()
        args = args_cls(output_dir=str(tmp_path / name), **{**BASE, "max_steps": 2, "disable_tqdm": False})
        trainer = trainer_cls(factory.qa_model(), args, train_dataset=factory.qa_dataset(8), callbacks=[recorder])
        trainer.train(resume_from_checkpoint=str(tmp_path / name / "checkpoint-2"))
        events[name] = recorder.events
    assert events["hl"] == events["hf"]
    assert [e[0] for e in events["hl"]] == ["on_init_end", "on_train_begin", "on_log", "on_train_end"]


def test_events_receive_hf_keyword_arguments(tmp_path, factory):
    (hf, _), (hl, _) = _both(tmp_path, factory, **SCENARIOS["a_steps"])
    for event in ("on_train_begin", "on_step_end", "on_log", "on_evaluate", "on_save", "on_prediction_step"):
        assert hf.kwargs[event] <= hl.kwargs[event], event
    assert {"model", "optimizer", "lr_scheduler", "train_dataloader"} <= hl.kwargs["on_step_end"]
    assert "metrics" in hl.kwargs["on_evaluate"] and "logs" in hl.kwargs["on_log"]


class SetControlAt(TrainerCallback):
    def __init__(self, flag: str, step: int):
        self.flag, self.step = flag, step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            setattr(control, self.flag, True)
        return control


@pytest.mark.parametrize(
    "flag, step",
    [
        ("should_training_stop", 5),
        ("should_evaluate", 2),
        ("should_save", 3),
        ("should_log", 3),
        ("should_epoch_stop", 2),
    ],
)
def test_control_set_by_a_callback_has_the_same_effect(tmp_path, factory, flag, step):
    kwargs = dict(num_train_epochs=2, logging_steps=100, save_strategy="no", eval_strategy="no")
    (hf, hf_trainer), (hl, hl_trainer) = _both(tmp_path, factory, lambda: (SetControlAt(flag, step),), **kwargs)
    assert hl.events == hf.events
    assert [sorted(e) for e in hl_trainer.state.log_history] == [sorted(e) for e in hf_trainer.state.log_history]
    saved = lambda t: sorted(p for p in os.listdir(t.args.output_dir) if p.startswith("checkpoint-"))  # noqa: E731
    assert saved(hl_trainer) == saved(hf_trainer)
    if flag == "should_training_stop":
        assert hl_trainer.state.global_step == 5
    if flag == "should_save":
        assert saved(hl_trainer) == ["checkpoint-3"]
    if flag == "should_evaluate":
        assert any("eval_loss" in e and e["step"] == 2 for e in hl_trainer.state.log_history)


def test_callback_class_is_instantiated_like_hf(tmp_path, factory):
    trainer = hflight.Trainer(
        factory.qa_model(), hflight.TrainingArguments(str(tmp_path), report_to="none"), callbacks=[Recorder]
    )
    assert any(type(cb) is Recorder for cb in trainer.callback_handler.callbacks)


def _early_stopping_run(tmp_path, factory, name, trainer_cls, args_cls, **kwargs):
    args = args_cls(
        output_dir=str(tmp_path / name),
        **{
            **BASE,
            **dict(
                num_train_epochs=6,
                eval_strategy="steps",
                eval_steps=1,
                save_steps=1,
                logging_steps=1,
                load_best_model_at_end=True,
                metric_for_best_model="eval_loss",
                learning_rate=0.05,
            ),
            **kwargs,
        },
    )
    trainer = trainer_cls(
        factory.qa_model(),
        args,
        train_dataset=factory.qa_dataset(16),
        eval_dataset=factory.qa_dataset(8, seed=1),
        callbacks=[transformers.EarlyStoppingCallback(early_stopping_patience=2)],
    )
    trainer.train()
    return trainer


def test_early_stopping_stops_at_the_same_step_as_transformers(tmp_path, factory):
    hf = _early_stopping_run(tmp_path, factory, "hf", transformers.Trainer, transformers.TrainingArguments)
    hl = _early_stopping_run(tmp_path, factory, "hl", hflight.Trainer, hflight.TrainingArguments)
    assert hf.state.global_step < hf.state.max_steps  # it did stop early
    assert hl.state.global_step == hf.state.global_step
    assert hl.state.best_global_step == hf.state.best_global_step
    assert hl.state.best_metric == pytest.approx(hf.state.best_metric, rel=1e-5)


@pytest.mark.subprocess
def test_early_stopping_patience_survives_resume(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    job = Path(__file__).parent / "jobs" / "resume_job.py"

    def run(out, *extra):
        result = subprocess.run(
            [
                sys.executable,
                str(job),
                str(out),
                "--early-stopping",
                "2",
                "--save-steps",
                "1",
                "--max-steps",
                "30",
                "--restore-callback-attributes",  # hflight's opt-in (transformers restores nothing by default)
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        return result

    full = tmp_path / "full"
    run(full)
    full_logs = __import__("json").loads((full / "log_history.json").read_text())
    stop_step = max(e["step"] for e in full_logs)
    assert stop_step < 30
    assert len([e for e in full_logs if "eval_loss" in e]) >= 3
    # resume from the checkpoint one step before the stop, while the patience counter is non-zero: the full run
    # saved it (every step), as a run interrupted there would have; the resumed run writes into a folder of its own
    before_stop = full / f"checkpoint-{stop_step - 1}"
    state = transformers.TrainerState.load_from_json(str(before_stop / "trainer_state.json"))
    assert state.stateful_callbacks["EarlyStoppingCallback"]["attributes"]["early_stopping_patience_counter"] > 0
    resumed = tmp_path / "resumed"
    run(resumed, "--resume", str(before_stop))
    resumed_logs = __import__("json").loads((resumed / "log_history.json").read_text())
    assert max(e["step"] for e in resumed_logs) == stop_step


def test_unknown_metric_for_best_model_names_the_available_metrics(tmp_path, factory):
    args = hflight.TrainingArguments(
        output_dir=str(tmp_path),
        eval_strategy="steps",
        eval_steps=1,
        save_steps=1,
        max_steps=2,
        metric_for_best_model="f1",
        load_best_model_at_end=True,
        report_to="none",
        disable_tqdm=True,
        per_device_train_batch_size=4,
    )
    trainer = hflight.Trainer(
        factory.qa_model(), args, train_dataset=factory.qa_dataset(8), eval_dataset=factory.qa_dataset(4)
    )
    with pytest.raises(KeyError, match="'eval_f1', which is not found.*eval_loss"):
        trainer.train()


# ---- callback state across a resume (ExportableState) --------------------------------------------------------------
class Counting(TrainerCallback, transformers.trainer_callback.ExportableState):
    """A stateful callback with a constructor argument (``every``) and an attribute (``seen``: steps it saw)."""

    def __init__(self, every: int = 1):
        self.every, self.seen = every, 0

    def on_step_end(self, args, state, control, **kwargs):
        self.seen += 1

    def state(self) -> dict:
        return {"args": {"every": self.every}, "attributes": {"seen": self.seen}}


def _counting(trainer) -> list[tuple[int, int]]:
    return [(cb.every, cb.seen) for cb in trainer.callback_handler.callbacks if isinstance(cb, Counting)]


def test_callbacks_are_rebuilt_from_their_saved_args_and_attributes_as_transformers_does(tmp_path, factory, caplog):
    """restore_callback_states_from_checkpoint=True: each stateful callback is rebuilt from the saved args and
    attributes (hflight restored only the attributes: an EarlyStoppingCallback saved with patience 5 came back with the
    new instance's 1); two instances of one class keep their own states, in order (they overwrote each other); a
    saved state without a matching callback is named in transformers' warning (it was dropped silently)."""
    train = factory.qa_dataset(40)

    def run(trainer_cls, args_cls, out, callbacks, resume=None, **kwargs):
        values = {**BASE, "max_steps": 3, "save_steps": 3, "logging_steps": 1, **kwargs}
        values["output_dir"] = str(tmp_path / out)
        trainer = trainer_cls(factory.qa_model(), args_cls(**values), train_dataset=train, callbacks=callbacks)
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    run(hflight.Trainer, hflight.TrainingArguments, "ours", [Counting(5), Counting(7)])
    run(transformers.Trainer, transformers.TrainingArguments, "theirs", [Counting(5), Counting(7)])
    ours, theirs = tmp_path / "ours" / "checkpoint-3", tmp_path / "theirs" / "checkpoint-3"
    one_more = dict(max_steps=4, save_strategy="no")

    rebuilt = run(hflight.Trainer, hflight.TrainingArguments, "a", [Counting(1), Counting(2)], str(ours),
                  restore_callback_states_from_checkpoint=True, **one_more)  # fmt: skip
    assert _counting(rebuilt) == [(5, 4), (7, 4)]
    rebuilt_theirs = run(transformers.Trainer, transformers.TrainingArguments, "ta", [Counting(1), Counting(2)],
                         str(theirs), restore_callback_states_from_checkpoint=True, **one_more)  # fmt: skip
    names = [type(cb).__name__ for cb in rebuilt.callback_handler.callbacks]
    assert names == [type(cb).__name__ for cb in rebuilt_theirs.callback_handler.callbacks]  # moved to the end
    assert names == ["DefaultFlowCallback", "PrinterCallback", "Counting", "Counting"]

    default = run(hflight.Trainer, hflight.TrainingArguments, "b", [Counting(1), Counting(2)], str(ours), **one_more)
    theirs_default = run(
        transformers.Trainer, transformers.TrainingArguments, "tb", [Counting(1), Counting(2)], str(theirs), **one_more
    )
    assert _counting(default) == _counting(theirs_default) == [(1, 1), (2, 1)]  # the default: nothing restored

    class Restoring(hflight.Trainer):
        restore_callback_attributes = True  # hflight's opt-in: the saved attributes onto the callbacks in use

    opted = run(Restoring, hflight.TrainingArguments, "o", [Counting(1), Counting(2)], str(ours), **one_more)
    assert _counting(opted) == [(1, 4), (2, 4)]

    # A checkpoint written by transformers: its list holds the states the callbacks had when training started, then
    # those at each save. transformers reads back the first (seen 0: one more step gives 1); hflight the last.
    from_theirs = [
        _counting(run(cls, args_cls, f"{cls.__module__}-resumed", [Counting(1), Counting(2)], str(theirs),
                      restore_callback_states_from_checkpoint=True, **one_more))
        for cls, args_cls in ((transformers.Trainer, transformers.TrainingArguments),
                              (hflight.Trainer, hflight.TrainingArguments))
    ]  # fmt: skip
    assert from_theirs == [[(5, 1), (7, 1)], [(5, 4), (7, 4)]]

    # _load_callback_state is an override point, called once the resumed state is loaded, before the first step
    def overriding(base):
        class Overriding(base):
            def _load_callback_state(self):
                self.called_at = self.state.global_step
                super()._load_callback_state()
                for callback in self.callback_handler.callbacks:
                    if isinstance(callback, Counting):
                        callback.seen += 100

        return Overriding

    overridden = [
        run(overriding(cls), args_cls, f"ov-{cls.__module__}", [Counting(1), Counting(2)], str(folder),
            restore_callback_states_from_checkpoint=True, **one_more)
        for cls, args_cls, folder in ((transformers.Trainer, transformers.TrainingArguments, theirs),
                                      (hflight.Trainer, hflight.TrainingArguments, ours))
    ]  # fmt: skip
    assert [t.called_at for t in overridden] == [3, 3]
    assert [_counting(t) for t in overridden] == [
        [(5, 101), (7, 101)],
        [(5, 104), (7, 104)],
    ]  # as without override +100

    from transformers.testing_utils import CaptureLogger
    from transformers.utils import logging as hf_logging

    warned = []
    for cls, args_cls, folder in ((transformers.Trainer, transformers.TrainingArguments, theirs),
                                  (hflight.Trainer, hflight.TrainingArguments, ours)):  # fmt: skip
        with CaptureLogger(hf_logging.get_logger("transformers.trainer")) as captured:  # transformers' logger
            run(cls, args_cls, f"c-{cls.__module__}", [], str(folder), restore_callback_states_from_checkpoint=True,
                **one_more)  # fmt: skip
        warned.append("Checkpoint included callbacks not included in current configuration. Ignoring. (Counting)"
                      in captured.out)  # fmt: skip
    assert warned == [True, True]


def test_load_callback_state_on_a_state_set_by_hand_rebuilds_the_callbacks_as_transformers(tmp_path, factory):
    """transformers' own test: ``trainer.state`` loaded from a checkpoint's ``trainer_state.json``, then
    ``trainer._load_callback_state()`` without training (it failed: no run, no resume point)."""
    from transformers.trainer_callback import TrainerState

    train = factory.qa_dataset(40)
    lists = []
    for trainer_cls, args_cls in ((transformers.Trainer, transformers.TrainingArguments),
                                  (hflight.Trainer, hflight.TrainingArguments)):  # fmt: skip
        values = {**BASE, "max_steps": 3, "save_steps": 3, "output_dir": str(tmp_path / trainer_cls.__module__)}
        trainer_cls(factory.qa_model(), args_cls(**values), train_dataset=train, callbacks=[Counting(5)]).train()
        values["restore_callback_states_from_checkpoint"] = True
        fresh = trainer_cls(factory.qa_model(), args_cls(**values), train_dataset=train, callbacks=[Counting(1)])
        fresh.state = TrainerState.load_from_json(
            str(tmp_path / trainer_cls.__module__ / "checkpoint-3" / "trainer_state.json")
        )
        fresh._load_callback_state()
        lists.append([(type(cb).__name__, getattr(cb, "every", None)) for cb in fresh.callback_handler.callbacks])
    assert lists[0] == lists[1] and ("Counting", 5) in lists[1]
