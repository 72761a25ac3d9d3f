"""What the evaluation loop counts and cuts (issue 55, faults 1-3), against transformers' Trainer (and TRL on it) in
one process: each batch's loss counts ``eval_batch_size`` times whatever rows the batch holds, and of what was
gathered only the last batch is cut, to the loader's ``remainder`` (accelerate's ``gather_for_metrics``), never to
the dataset's length nor to a count of losses. A stream without labels keeps every prediction; a preference batch
(a pair's chosen and rejected rows) and a sampler that repeats each sample count every batch. The same under two
processes: tests/test_accelerator_config.py's torchrun job (a stream predicted without labels, a repeating sampler)."""

from __future__ import annotations

import lightning as L
import numpy as np
import pytest
import torch
import transformers

import hflight

from .support import Factory

TIMES = ("_runtime", "_per_second", "_time")


class Stream(torch.utils.data.IterableDataset):
    """Rows without a length."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def __iter__(self):
        yield from self.rows


def token_rows(n: int, labels: bool = False) -> list[dict]:
    generator = torch.Generator().manual_seed(n)
    ids = torch.randint(5, Factory.VOCAB, (n, 8), generator=generator)
    return [{"input_ids": row, "attention_mask": torch.ones(8, dtype=torch.long),
             **({"labels": int(row[0]) % 3} if labels else {})} for row in ids]  # fmt: skip


def both(tmp_path, run, trainer=None, batch=2, lightning_callbacks=(), **args) -> dict:
    """``run(trainer)`` with transformers' Trainer and hflight's (or ``trainer(library)``'s class), each on a fresh
    tiny BERT classifier, evaluation batches of ``batch``; ``lightning_callbacks``: hflight's only."""
    results = {}
    for library in (transformers, hflight):
        cls = trainer(library) if trainer is not None else library.Trainer
        arguments = library.TrainingArguments(str(tmp_path / library.__name__), per_device_eval_batch_size=batch,
                                              report_to="none", use_cpu=True, disable_tqdm=True, **args)  # fmt: skip
        callbacks = list(lightning_callbacks) if library is hflight else []
        results[library.__name__] = run(cls(Factory.cls_model(), arguments, callbacks=callbacks))
    return results


@pytest.mark.parametrize("rows", [11, 10])
def test_predict_of_an_unlabelled_stream_returns_every_row_as_transformers(tmp_path, rows):
    """Fault 1: no labels, no losses; the rows kept were counted from the losses, so none came back."""
    out = both(tmp_path, lambda trainer: trainer.predict(Stream(token_rows(rows))))
    theirs, ours = out["transformers"], out["hflight"]
    assert theirs.predictions.shape == ours.predictions.shape == (rows, 3)
    np.testing.assert_allclose(ours.predictions, theirs.predictions, rtol=1e-6, atol=1e-7)
    assert ours.label_ids is None and theirs.label_ids is None


@pytest.mark.parametrize("loop", ["hflight", "lightning_validate"])
def test_a_short_last_batch_counts_its_rows_as_transformers(tmp_path, loop):
    """One process, 10 rows in evaluation batches of 4: each batch's loss counts 4 times and the last batch's is cut to
    its 2 rows, so ``eval_loss`` is (4 L1 + 4 L2 + 2 L3) / 10, transformers' number bit for bit, in hflight's own loop
    and through Lightning's ``validate`` (a Lightning callback makes it run there); ``predict``'s ``test_loss`` too.
    A plain mean of the batches' losses (or no cut of the last one: the same here) gives (L1 + L2 + L3) / 3."""

    def losses(trainer):
        rows = token_rows(10, labels=True)
        return trainer.evaluate(rows)["eval_loss"], trainer.predict(rows).metrics["test_loss"]

    callbacks = [L.Callback()] if loop == "lightning_validate" else []
    out = both(tmp_path, losses, batch=4, lightning_callbacks=callbacks)
    assert out["hflight"] == out["transformers"]


def repeating(library):
    """A trainer whose evaluation sampler gives each sample twice in a row (as TRL's GRPO and RLOO give each prompt
    ``num_generations`` times): the loader yields more rows than the dataset has."""

    def _get_eval_sampler(self, eval_dataset):
        return [i for i in range(len(eval_dataset)) for _ in range(2)]

    return type("Repeating", (library.Trainer,), {"_get_eval_sampler": _get_eval_sampler})


def test_a_sampler_that_repeats_samples_is_counted_and_cut_as_transformers(tmp_path):
    """Fault 3's cause in one process: 5 samples given twice are 10 rows in 5 batches of 2; transformers repeats each
    batch's loss twice and cuts the last batch to the loader's remainder (5 % 2: its first row), so 9 losses and 9
    predictions. hflight cut them to the dataset's 5 (the first 2.5 batches)."""

    def evaluated(trainer):
        output = trainer.predict(token_rows(5, labels=True))
        return output.predictions, output.label_ids, trainer.evaluate(token_rows(5, labels=True))

    out = both(tmp_path, evaluated, trainer=repeating)
    (their_preds, their_labels, theirs), (preds, labels, ours) = out["transformers"], out["hflight"]
    assert their_preds.shape == preds.shape == (9, 3)
    np.testing.assert_allclose(preds, their_preds, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(labels, their_labels)
    assert ours["eval_loss"] == pytest.approx(theirs["eval_loss"], rel=1e-6)


# ---- TRL's preference trainers: a batch of 4 pairs is 8 rows ------------------------------------------------------
@pytest.mark.parametrize("name", ["DPO", "Reward"])
def test_preference_eval_loss_counts_every_batch_as_trl(tmp_path, name):
    """Fault 2: 8 pairs in evaluation batches of 4; each batch's loss was repeated by its 8 rows and the whole cut to
    the dataset's 8, which kept the first batch's loss only. Every metric must be TRL's on transformers."""
    trl = pytest.importorskip("trl")
    hflight_trl = pytest.importorskip("hflight.trl")
    from .tiny_lm import columns, gpt2, tokenizer

    pairs = columns(8, prompt=(3, 10), chosen=(3, 10), rejected=(3, 10))
    results = {}
    for library, module in (("trl", trl), ("hflight", hflight_trl)):
        args = getattr(trl, f"{name}Config")(str(tmp_path / library), per_device_eval_batch_size=4, report_to="none",
                                             disable_tqdm=True, bf16=False, seed=0)  # fmt: skip
        if name == "DPO":  # a reference model of its own, so that the batches' losses differ
            models = dict(model=gpt2(), ref_model=gpt2(seed=1))
        else:
            models = dict(model=gpt2(head=transformers.GPT2ForSequenceClassification, num_labels=1))
        trainer = getattr(module, f"{name}Trainer")(args=args, processing_class=tokenizer(), train_dataset=pairs,
                                                    eval_dataset=pairs, **models)  # fmt: skip
        results[library] = {k: v for k, v in trainer.evaluate().items() if not k.endswith(TIMES)}
    theirs, ours = results["trl"], results["hflight"]
    assert ours.keys() == theirs.keys() and "eval_loss" in ours
    assert ours == {key: pytest.approx(value, rel=1e-6, abs=1e-9) for key, value in theirs.items()}
