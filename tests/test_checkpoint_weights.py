"""Model weights in checkpoints: tied weights absent from the file, a rejected checkpoint leaving the model untouched,
sharded weights resumed exactly and loaded as the best model, transformers' error text for a missing checkpoint,
weights saved again after the save (and a killed re-save refused), shards beside a single weights file ignored, and
the weights going in through the model's own ``load_state_dict``.

The runs are in-process (tests/checkpoint_runs.py)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import hflight
from hflight.checkpoints.manifest import get_last_checkpoint
from hflight.checkpoints.weights import load_model_weights

from .checkpoint_runs import ShardedBert, assert_same, copy_checkpoint, make_trainer, params, refresh_manifest


def test_weights_the_model_ties_may_be_absent_from_the_file(tmp_path, factory):
    """save_pretrained writes a tied decoder weight once (as the embedding); loading must not call it missing."""
    from transformers import BertForMaskedLM

    torch.manual_seed(1)
    source = BertForMaskedLM(factory.config())
    source.save_pretrained(tmp_path)
    torch.manual_seed(2)
    target = BertForMaskedLM(factory.config())
    load_model_weights(target, tmp_path)
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in source.state_dict().items())
    assert target.cls.predictions.decoder.weight is target.bert.embeddings.word_embeddings.weight


@pytest.mark.parametrize("damage", ["shape", "missing", "unexpected"])
def test_a_rejected_checkpoint_leaves_the_model_untouched(saved, tmp_path, factory, damage):
    folder = copy_checkpoint(saved, tmp_path)
    weights = load_file(folder / "model.safetensors")
    if damage == "shape":
        weights["qa_outputs.weight"] = torch.zeros(3, 32)
    elif damage == "missing":
        del weights["bert.encoder.layer.1.output.dense.weight"]
    else:
        weights["bert.pooler.extra"] = torch.zeros(2)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    refresh_manifest(folder)
    trainer = make_trainer(tmp_path / "out", factory)
    before = params(trainer)
    expected = {
        "shape": r"shapes \['qa_outputs.weight: \[3, 32\] in the file, \[2, 32\] in the model'\]",
        "missing": r"missing keys \['bert.encoder.layer.1.output.dense.weight'\]",
        "unexpected": r"unexpected keys \['bert.pooler.extra'\]",
    }[damage]
    with pytest.raises(ValueError, match=rf"model\.safetensors does not match BertForQuestionAnswering: {expected}"):
        trainer.train(resume_from_checkpoint=str(folder))
    assert all(torch.equal(before[k], v) for k, v in params(trainer).items())


def test_a_sharded_checkpoint_resumes_exactly(reference, tmp_path, factory):
    make_trainer(tmp_path, factory, model=ShardedBert.build(factory), stop_at=6).train()
    folder = tmp_path / "checkpoint-6"
    assert (folder / "model.safetensors.index.json").is_file() and not (folder / "model.safetensors").exists()
    assert len(list(folder.glob("model-*-of-*.safetensors"))) > 2
    resumed = make_trainer(tmp_path / "resumed", factory, model=ShardedBert.build(factory, seed=42))
    resumed.train(resume_from_checkpoint=str(folder))
    assert_same(reference, resumed, from_step=6)

    shard = sorted(folder.glob("model-*-of-*.safetensors"))[-1]
    tensors = load_file(shard)
    key = sorted(tensors)[0]
    tensors[key] = torch.zeros(1)
    save_file(tensors, shard, metadata={"format": "pt"})
    refresh_manifest(folder)
    victim = make_trainer(tmp_path / "victim", factory, model=ShardedBert.build(factory, seed=42))
    before = params(victim)
    with pytest.raises(ValueError, match=rf"model\.safetensors\.index\.json does not match .*{key}: \[1\] in the file"):
        victim.train(resume_from_checkpoint=str(folder))
    assert all(torch.equal(before[k], v) for k, v in params(victim).items())


def test_a_sharded_best_checkpoint_is_loaded_at_the_end(tmp_path, factory):
    trainer = make_trainer(
        tmp_path,
        factory,
        model=ShardedBert.build(factory),
        eval_strategy="steps",
        eval_steps=3,
        load_best_model_at_end=True,
        metric_for_best_model="score",
    )
    scores = iter([1.0, 3.0, 2.0, 0.0])  # evaluations at steps 3, 6, 9, 12: the best is step 6, not the last
    trainer.compute_metrics = lambda prediction: {"score": next(scores)}
    trainer.train()
    assert trainer.state.best_global_step == 6 != trainer.state.global_step
    best = Path(trainer.state.best_model_checkpoint)
    assert best.name == "checkpoint-6" and (best / "model.safetensors.index.json").is_file()
    on_disk = type(trainer.model).from_pretrained(str(best)).state_dict()
    assert all(torch.equal(on_disk[k], v) for k, v in params(trainer).items())


def test_a_missing_checkpoint_path_raises_transformers_error_text(tmp_path, factory):
    missing = tmp_path / "nowhere" / "checkpoint-3"
    with pytest.raises(ValueError) as error:
        make_trainer(tmp_path / "out", factory).train(resume_from_checkpoint=str(missing))
    assert str(error.value) == f"Can't find a valid checkpoint at {missing}"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=f"^Can't find a valid checkpoint at {tmp_path / 'empty'}"):
        load_model_weights(factory.qa_model(), tmp_path / "empty")


def test_weights_saved_again_after_the_save_resume_with_a_warning_and_a_killed_resave_is_refused(
    reference, tmp_path, factory, monkeypatch, caplog
):
    """A user re-shards a checkpoint's weights (``save_pretrained(max_shard_size=...)``: new shard names, a new index,
    the old shards deleted first). The complete re-save resumes, with a warning that names what changed, and
    continues exactly; every state a kill during that re-save leaves (old shards gone, some new ones written, the old
    index still there), or a new shard cut short, is refused and changes nothing."""
    import transformers.modeling_utils as modeling_utils

    make_trainer(tmp_path, factory, model=ShardedBert.build(factory), stop_at=6).train()
    folder = tmp_path / "checkpoint-6"
    before = sorted(p.name for p in folder.glob("model-*-of-*.safetensors"))
    snapshots, real_save = tmp_path / "killed", modeling_utils.safe_save_file

    def snapshot_then_save(tensors, filename, *args, **kwargs):
        shutil.copytree(folder, snapshots / f"{len(list(snapshots.glob('*'))):02d}" / "checkpoint-6")
        return real_save(tensors, filename, *args, **kwargs)

    resaver = ShardedBert.build(factory, seed=3)
    resaver.config.use_cache = False  # as in the checkpoint's config.json (the Trainer sets args.use_cache)
    load_model_weights(resaver, folder)
    monkeypatch.setattr(modeling_utils, "safe_save_file", snapshot_then_save)
    resaver.save_pretrained(folder, max_shard_size="60KB")
    monkeypatch.undo()
    after = sorted(p.name for p in folder.glob("model-*-of-*.safetensors"))
    assert after and not set(after) & set(before)

    resumed = make_trainer(tmp_path / "resumed", factory, model=ShardedBert.build(factory, seed=42))
    with caplog.at_level(logging.WARNING, logger="hflight"):
        resumed.train(resume_from_checkpoint=str(folder))
    assert_same(reference, resumed, from_step=6)
    warning = next(r.getMessage() for r in caplog.records if "saved again" in r.getMessage())
    assert warning.startswith(f"Checkpoint {folder}: its model weights were saved again after the checkpoint was")
    assert f"new: {after[0]}" in warning and "rewritten: model.safetensors.index.json" in warning
    assert f"no longer there: {before[0]}" in warning

    killed = sorted(snapshots.iterdir())
    assert len(killed) == len(after)
    cut = tmp_path / "cut" / "checkpoint-6"
    shutil.copytree(folder, cut)
    with open(cut / after[-1], "r+b") as handle:
        handle.truncate((cut / after[-1]).stat().st_size // 2)
    for copy in [*(k / "checkpoint-6" for k in killed), cut]:
        assert get_last_checkpoint(copy.parent) is None, copy
        victim = make_trainer(tmp_path / "victim", factory, model=ShardedBert.build(factory, seed=42))
        untouched = params(victim)
        with pytest.raises(ValueError, match=r"checkpoint-6 is incomplete or damaged: (no model-|model-.* is corrupt)"):
            victim.train(resume_from_checkpoint=str(copy))
        assert all(torch.equal(untouched[k], v) for k, v in params(victim).items())


def test_shards_written_beside_a_single_weights_file_are_ignored_with_a_warning(saved, tmp_path, factory, caplog):
    """save_pretrained(max_shard_size=...) into a checkpoint holding model.safetensors writes shards and an index but
    leaves model.safetensors, which transformers loads first: so does hflight, and says so."""
    folder = copy_checkpoint(saved, tmp_path)
    other = factory.qa_model(seed=11, dropout=0.1)  # the same configuration: config.json is written unchanged
    other.config.use_cache = False  # as the Trainer set it (args.use_cache) before the checkpoint was written
    other.save_pretrained(folder, max_shard_size="30KB")
    assert (folder / "model.safetensors.index.json").is_file()
    trainer = make_trainer(tmp_path / "out", factory, max_steps=7, save_strategy="no")
    with caplog.at_level(logging.WARNING, logger="hflight"):
        trainer.train(resume_from_checkpoint=str(folder))
    assert "does not list (model-00001-of-" in caplog.text
    assert "They are ignored: the weights are read from model.safetensors, as saved." in caplog.text


def test_weights_go_in_through_the_model_own_load_state_dict(saved, tmp_path, factory):
    """On resume and on best-model loading, after hflight's header checks, as transformers loads them."""
    from transformers import BertForQuestionAnswering

    calls = []

    class RemappingBertForQuestionAnswering(BertForQuestionAnswering):  # the name tells HF its labels
        def load_state_dict(self, state_dict, strict=True, assign=False):
            calls.append((len(state_dict), strict))
            state_dict = {k: (v + 1 if k == "qa_outputs.bias" else v) for k, v in state_dict.items()}
            return super().load_state_dict(state_dict, strict=strict, assign=assign)

    torch.manual_seed(0)
    model = RemappingBertForQuestionAnswering(factory.config(dropout=0.1))
    folder = copy_checkpoint(saved, tmp_path)
    saved_bias = load_file(folder / "model.safetensors")["qa_outputs.bias"]
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["RemappingBertForQuestionAnswering"]
    (folder / "config.json").write_text(json.dumps(config))
    refresh_manifest(folder)
    loaded = {}

    class AtStart(hflight.TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            loaded["bias"] = model.qa_outputs.bias.detach().clone()

    trainer = make_trainer(tmp_path / "out", factory, model=model, max_steps=7, save_strategy="no",
                           callbacks=[AtStart()])  # fmt: skip
    trainer.train(resume_from_checkpoint=str(folder))
    assert calls == [(len(model.state_dict()), False)]
    assert torch.equal(loaded["bias"], saved_bias + 1)

    calls.clear()
    best = make_trainer(tmp_path / "best", factory, model=model, max_steps=6, eval_strategy="steps", eval_steps=3,
                        load_best_model_at_end=True, metric_for_best_model="score")  # fmt: skip
    scores = iter([2.0, 1.0])
    best.compute_metrics = lambda prediction: {"score": next(scores)}
    best.train()
    assert calls == [(len(model.state_dict()), False)] and best.state.best_global_step == 3
