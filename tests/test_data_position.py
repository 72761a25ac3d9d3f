"""The training data's position in a checkpoint (issue 63): a resumed run continues a stream from where the checkpoint
left it, reading only what its remaining steps need, and ends on the uninterrupted run's weights and losses; a
map-style dataset skips its trained batches by its sampler alone; a checkpoint without a position (transformers')
reads and drops them, with a progress bar naming ignore_data_skip; a position that does not fit is refused before
any step.

In-process, one process (the runs under torchrun: tests/test_data_position_ddp.py); a 32-wide BERT, 40 steps of 4
examples, a checkpoint every 10, the resumed run from step 30."""

from __future__ import annotations

import json
import multiprocessing
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import transformers

import hflight
from hflight.checkpoints import data_position, parts
from hflight.checkpoints.manifest import MANIFEST_NAME, verify_checkpoint
from hflight.checkpoints.names import DATA_POSITION_NAME
from hflight.checkpoints.writers.files import IncompleteCheckpointError, UnsafeCheckpointFile

from .checkpoint_runs import StopAt
from .launch import JOBS
from .support import Factory

sys.path.insert(0, str(JOBS))
import trained_ids  # noqa: E402

STEPS, STOP, BATCH = 40, 30, 4
#: the examples each process's map produced (DataLoader workers are forked: a shared counter)
READS = multiprocessing.get_context("fork").Value("i", 0)


def _count(example):
    with READS.get_lock():
        READS.value += 1
    return example


def _stream(pipeline: str = "map", shards: int = 4, n: int = 200):
    """A ``datasets`` stream of QA windows whose examples are counted as they are produced."""
    from datasets.distributed import split_dataset_by_node

    stream = Factory.qa_dataset(n).to_iterable_dataset(num_shards=shards)
    if pipeline == "filter":
        stream = stream.filter(lambda example: example["start_positions"] % 5 != 0)
    elif pipeline == "split_dataset_by_node":  # a process's part of the stream: 100 examples, a pass of 25 steps
        stream = split_dataset_by_node(stream, rank=1, world_size=2)
    elif pipeline == "batch":  # pairs of examples (the loader's batch of 2 pairs put end to end by _pairs)
        return stream.map(_count).batch(batch_size=2).with_format("torch")
    return stream.map(_count).with_format("torch")


def _pairs(items):
    return {key: torch.cat([item[key] for item in items]) for key in items[0]}


class CountedStream(torch.utils.data.IterableDataset):
    """A torch stream with torchdata's Stateful protocol: its examples made one by one (counted), its position asked
    for and set back."""

    def __init__(self, n: int = 200) -> None:
        self.windows = Factory.qa_dataset(n).with_format("torch")
        self.next_index, self.asked, self.given = 0, 0, []

    def __iter__(self):
        while self.next_index < len(self.windows):
            index, self.next_index = self.next_index, self.next_index + 1
            yield _count(self.windows[index])

    def state_dict(self):
        self.asked += 1
        return {"next_index": self.next_index}

    def load_state_dict(self, state):
        self.given.append(state)
        self.next_index = state["next_index"]


class Steps(transformers.TrainerCallback):
    def __init__(self):
        self.begun = 0

    def on_step_begin(self, args, state, control, **kwargs):
        self.begun += 1


def _run(out: Path, dataset, stop_at=None, resume=None, library=hflight, **overrides):
    """A run of 40 steps (stopped after ``stop_at``; resumed from ``resume``); (trainer, examples produced, losses).
    ``overrides``: training arguments, and the trainer's ``data_collator``."""
    values = dict(output_dir=str(out), per_device_train_batch_size=BATCH, max_steps=STEPS, learning_rate=1e-3,
                  warmup_steps=2, logging_steps=1, save_steps=10, seed=7, report_to="none", disable_tqdm=True,
                  use_cpu=True)  # fmt: skip
    values.update(overrides)
    callbacks = [StopAt(stop_at)] if stop_at else []
    collator = values.pop("data_collator", None)
    trainer = library.Trainer(Factory.qa_model(seed=0, dropout=0.1), library.TrainingArguments(**values),
                              train_dataset=dataset, callbacks=callbacks, data_collator=collator)  # fmt: skip
    with READS.get_lock():
        READS.value = 0
    trainer.train(resume_from_checkpoint=resume)
    return trainer, READS.value, [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _same_weights(a, b) -> bool:
    left, right = a.model.state_dict(), b.model.state_dict()
    return all(torch.equal(left[name], right[name]) for name in left)


@pytest.mark.parametrize(
    "pipeline, settings",
    [
        pytest.param("map", {}, id="map"),
        pytest.param("map", {"dataloader_num_workers": 2}, id="map, 2 workers"),
        pytest.param("filter", {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}, id="filter, GA 2"),
        pytest.param("split_dataset_by_node", {}, id="split_dataset_by_node, a pass of 25 steps"),
        pytest.param("batch", {"per_device_train_batch_size": 2, "data_collator": _pairs}, id="batch, 2 pairs a step"),
        pytest.param("map", {"accelerator_config": {"dispatch_batches": False}}, id="map, read by the process"),
    ],
)
def test_a_stream_resumes_reading_only_what_its_remaining_steps_need(tmp_path, pipeline, settings):
    """transformers and hflight before this read every trained example again: 168 for the 10 steps after step 30
    (184 with two workers); now the remaining steps' 40 and what the loaders read ahead, and the run ends on the
    uninterrupted run's weights and losses, bit for bit."""
    full, _, losses = _run(tmp_path / "full", _stream(pipeline), **settings)
    _run(tmp_path / "run", _stream(pipeline), stop_at=STOP, **settings)
    folder = str(tmp_path / "run/checkpoint-30")
    resumed, reads, resumed_losses = _run(tmp_path / "run", _stream(pipeline), resume=folder, **settings)
    workers = settings.get("dataloader_num_workers", 0)
    ahead = BATCH * (2 + 2 * workers)  # the loader's batch read ahead and the next cycle's; each worker's prefetch
    if pipeline == "batch":  # datasets' map node below the batch resumes from its last saved state, mapping again
        ahead += 2  # the examples since (one pair here), which the batch node drops: none of them trains again
    remaining = (STEPS - STOP) * BATCH
    assert reads <= remaining + ahead, f"{reads} examples produced for {remaining}"
    assert _same_weights(full, resumed)
    assert resumed_losses[-(STEPS - STOP) :] == losses[STOP:]


@pytest.mark.parametrize("settings", [{}, {"accelerator_config": {"dispatch_batches": False}}],
                         ids=["dispatched", "read by the process"])  # fmt: skip
def test_a_checkpoint_at_the_end_of_a_pass_continues_with_the_next_pass(tmp_path, settings):
    """A pass of 25 steps, the checkpoint at step 25: the resumed run starts the second pass (the dispatched loader,
    reading one batch ahead, knew the pass had ended; the per-process one continues its stream's state into the
    next) and reads only its 15 steps' examples."""
    settings = {"save_steps": 25, **settings}
    full, _, losses = _run(tmp_path / "full", _stream("split_dataset_by_node"), **settings)
    _run(tmp_path / "run", _stream("split_dataset_by_node"), stop_at=25, **settings)
    resumed, reads, resumed_losses = _run(tmp_path / "run", _stream("split_dataset_by_node"),
                                          resume=str(tmp_path / "run/checkpoint-25"), **settings)  # fmt: skip
    assert reads <= (STEPS - 25) * BATCH + 2 * BATCH, f"{reads} examples produced for {(STEPS - 25) * BATCH}"
    assert _same_weights(full, resumed) and resumed_losses[-(STEPS - 25) :] == losses[25:]


def test_a_torch_stream_with_state_dict_is_asked_for_its_position_and_given_it_back(tmp_path):
    full, _, losses = _run(tmp_path / "full", CountedStream())
    stopped = CountedStream()
    _run(tmp_path / "run", stopped, stop_at=STOP)
    assert stopped.asked > 0, "the stream's state_dict() was never asked for"
    again = CountedStream()
    resumed, reads, resumed_losses = _run(tmp_path / "run", again, resume=str(tmp_path / "run/checkpoint-30"))
    assert again.given and again.given[0]["next_index"] >= STOP * BATCH
    assert reads <= (STEPS - STOP) * BATCH + 2 * BATCH
    assert _same_weights(full, resumed) and resumed_losses[-(STEPS - STOP) :] == losses[STOP:]


class CountedWindows(torch.utils.data.Dataset):
    def __init__(self, windows):
        self.windows, self.read = windows, 0

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, index):
        self.read += 1
        return self.windows[index]


def test_a_map_style_dataset_skips_its_trained_batches_by_its_sampler_alone(tmp_path):
    """The sampler draws the trained batches' indices (the same order), no example is read for them: before, every
    skipped batch was read and collated (48 examples here)."""
    windows = Factory.qa_dataset(64).with_format("torch")
    settings = dict(max_steps=12, save_steps=4, gradient_accumulation_steps=2, train_sampling_strategy="random")
    full, _, losses = _run(tmp_path / "full", CountedWindows(windows), **settings)
    _run(tmp_path / "run", CountedWindows(windows), stop_at=6, **settings)
    dataset = CountedWindows(windows)
    # checkpoint-4, then 8 of the 12 steps: 4 x 2 batches of 4 from there, of the 16 of an epoch of 64 (step 8 of 8 is
    # the epoch's end); the first 8 batches are the sampler's
    resumed, _, resumed_losses = _run(tmp_path / "run", dataset, resume=str(tmp_path / "run/checkpoint-4"), **settings)
    assert dataset.read <= 8 * 2 * BATCH + BATCH, f"{dataset.read} examples read for 64"
    assert _same_weights(full, resumed) and resumed_losses[-8:] == losses[4:]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A stream run stopped at step 30, its checkpoint-30."""
    out = tmp_path_factory.mktemp("stopped")
    _run(out, _stream(), stop_at=STOP)
    return out / "checkpoint-30"


def test_the_position_is_a_checkpoint_file_in_the_manifest_read_without_running_code(stopped):
    manifest = verify_checkpoint(stopped, full=True)
    assert DATA_POSITION_NAME in manifest["files"] and manifest["files"][DATA_POSITION_NAME].get("xxh3_128")
    assert parts.part_of(DATA_POSITION_NAME) == "data position"
    position = torch.load(stopped / DATA_POSITION_NAME, weights_only=True)
    assert position["global_step"] == STOP and position["loader"]["how"] == "dispatched"
    (entry,) = position["ranks"]
    assert (entry["epoch"], entry["batches"], entry["end_of_pass"]) == (0, STOP, False)
    assert position["dataset"]["num_shards"] == 4 and position["dataset"]["kind"] == "iterable"


def _resumed(out: Path, folder: Path, dataset, **settings):
    """A resume from a copy of ``folder`` in ``out``: (trainer, examples produced, the console's and log's text)."""
    copy = out / folder.name
    shutil.copytree(folder, copy)
    return _run(out, dataset, resume=str(copy), **settings)


@pytest.mark.parametrize(
    "dataset, settings, why",
    [
        pytest.param(lambda: _stream(shards=2), {}, r"another training dataset \(num_shards 4 where this run's is 2",
                     id="another number of shards"),  # fmt: skip
        pytest.param(lambda: _stream(n=120), {}, r"another training dataset", id="another stream"),
        pytest.param(lambda: _stream(), {"accelerator_config": {"dispatch_batches": False}},
                     r"saved for a stream process 0 reads .* this run reads a stream each process reads",
                     id="another kind of loader"),  # fmt: skip
        pytest.param(lambda: _stream(), {"dataloader_num_workers": 1},
                     r"states of 0 loader workers .* this run has dataloader_num_workers=1", id="other workers"),
        pytest.param(lambda: _stream(), {"per_device_train_batch_size": 2},
                     r"counts batches of 4 examples and this run reads batches of 2", id="another batch size"),
    ],
)  # fmt: skip
def test_a_position_that_does_not_fit_is_read_and_dropped_saying_why(tmp_path, stopped, dataset, settings, why, caplog):
    """transformers resumes each of these runs, reading and dropping the trained batches: so does hflight, with one
    line saying why the position is not used (the examples trained are then transformers' own: the oracle grid,
    tests/test_trained_examples.py)."""
    with caplog.at_level("INFO"):
        trainer, reads, _ = _resumed(tmp_path, stopped, dataset(), disable_tqdm=False, **settings)
    assert trainer.state.global_step == STEPS
    assert reads >= STOP * settings.get("per_device_train_batch_size", BATCH), "the trained batches are not read"
    assert re.search(r"reading and dropping the \d+ batches .* as transformers does: .*" + why, caplog.text)


def test_a_map_style_position_continues_another_dataset_as_transformers_and_a_stream_in_its_place(tmp_path):
    """A map-style dataset's position is transformers' arithmetic, which continues any map-style dataset (a changed
    preprocessing, as transformers lets it); a stream in its place reads and drops the trained batches."""
    settings = dict(max_steps=8, save_steps=4, gradient_accumulation_steps=2)
    _run(tmp_path / "run", CountedWindows(Factory.qa_dataset(64).with_format("torch")), stop_at=4, **settings)
    resumed, _, _ = _run(tmp_path / "run", CountedWindows(Factory.qa_dataset(80).with_format("torch")),
                         resume=str(tmp_path / "run/checkpoint-4"), **settings)  # fmt: skip
    assert resumed.state.global_step == 8
    trainer, reads, _ = _resumed(tmp_path / "again", tmp_path / "run/checkpoint-4", _stream(), **settings)
    assert trainer.state.global_step == 8 and reads >= 4 * 2 * BATCH


def test_a_position_its_dataset_refuses_is_read_and_dropped_with_a_warning(tmp_path, monkeypatch, caplog):
    def refuse(self, state):
        raise KeyError("next_index: not a position of this stream")

    full, _, losses = _run(tmp_path / "full", CountedStream())
    _run(tmp_path / "run", CountedStream(), stop_at=STOP)
    monkeypatch.setattr(CountedStream, "load_state_dict", refuse)
    resumed, reads, resumed_losses = _run(tmp_path / "run", CountedStream(), resume=str(tmp_path / "run/checkpoint-30"))
    assert "dataset refused the checkpoint's data position (KeyError" in caplog.text
    assert reads >= STEPS * BATCH and _same_weights(full, resumed) and resumed_losses[-10:] == losses[STOP:]


def test_a_damaged_position_is_refused_as_every_checkpoint_file(tmp_path, stopped):
    copy = tmp_path / "damaged"
    shutil.copytree(stopped, copy)
    data = bytearray((copy / DATA_POSITION_NAME).read_bytes())
    data[-20] ^= 0xFF
    (copy / DATA_POSITION_NAME).write_bytes(bytes(data))
    steps = Steps()
    trainer = hflight.Trainer(Factory.qa_model(seed=0), hflight.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH, max_steps=STEPS, report_to="none",
        use_cpu=True), train_dataset=_stream(), callbacks=[steps])  # fmt: skip
    with pytest.raises((ValueError, IncompleteCheckpointError), match=r"data_position.pt"):
        trainer.train(resume_from_checkpoint=str(copy))
    assert steps.begun == 0, "a step was trained"


def test_a_crafted_position_is_refused_without_running_code(tmp_path, stopped):
    """A folder without a manifest (hflight resumes transformers' checkpoints): a data_position.pt whose pickle would
    run code is refused through hflight's own reader, naming the file and ignore_data_skip; nothing runs."""
    copy = tmp_path / "crafted"
    shutil.copytree(stopped, copy)
    (copy / MANIFEST_NAME).unlink()
    marker = tmp_path / "ran"
    position = torch.load(copy / DATA_POSITION_NAME, weights_only=True)
    position["why"] = _RunsCode(marker)
    torch.save(position, copy / DATA_POSITION_NAME)
    with pytest.raises(UnsafeCheckpointFile, match=r"data_position.pt cannot be loaded safely.*ignore_data_skip"):
        data_position.read(copy)
    assert not marker.exists(), "the file ran code"
    torch.load(copy / DATA_POSITION_NAME, weights_only=False)  # the file does run code when loaded so
    assert marker.exists()


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_ignore_data_skip_starts_the_data_over_whatever_the_position(tmp_path, stopped):
    """transformers' meaning: the epoch's data from its beginning; the position is neither used nor compared."""
    copy = tmp_path / stopped.name
    shutil.copytree(stopped, copy)
    _, reads, _ = _run(tmp_path, _stream(shards=2), resume=str(copy), ignore_data_skip=True)
    assert reads <= (STEPS - STOP) * BATCH + 2 * BATCH


# ---- through the oracle of trained examples (tests/jobs/trained_ids.py) ---------------------------------------------
def test_a_transformers_checkpoint_is_read_and_dropped_training_transformers_own_examples(tmp_path, capsys):
    """transformers' checkpoint (no position): hflight reads and drops the trained batches, with a progress bar naming
    ignore_data_skip, and trains exactly what transformers' own resume trains (not one batch more or less)."""
    make = lambda: trained_ids.source("map")  # noqa: E731
    _, full, _ = trained_ids.run(tmp_path / "run", make(), transformers)
    folder = tmp_path / "run/checkpoint-8"
    assert not (folder / DATA_POSITION_NAME).exists() and not (folder / MANIFEST_NAME).exists()
    _, theirs, _ = trained_ids.run(tmp_path / "theirs", make(), transformers, resume=str(folder))
    capsys.readouterr()
    _, ours, reads = trained_ids.run(tmp_path / "ours", make(), hflight, resume=str(folder), disable_tqdm=False)
    assert "ignore_data_skip=True starts the data over" in capsys.readouterr().err
    assert ours == theirs and trained_ids.mismatch(full, ours, 8) is None
    assert reads >= 8 * trained_ids.BATCH


@pytest.mark.parametrize("how", ["dispatched", "per_process"])
def test_an_epoch_end_checkpoint_resumes_in_place_without_running_that_epoch_end_again(tmp_path, how):
    """Case 3: a stream without a length marks the end of its pass only when it runs out; a checkpoint written at
    the epoch's end (save_strategy="epoch") resumed in its own run folder starts the next pass: the epoch's
    evaluation is not run again, the checkpoint not rewritten (its data position kept), and a second resume from the
    next epoch's checkpoint trains the uninterrupted run's examples (a shuffled stream: each pass its own order)."""
    settings = dict(save_strategy="epoch", eval_strategy="epoch", eval_dataset=trained_ids.source("map", n=8))
    if how == "per_process":
        settings["accelerator_config"] = {"dispatch_batches": False}
    result = trained_ids.chain(tmp_path, lambda: trained_ids.source("shuffle"), hflight, (16, 32), in_place=True,
                               **settings)  # fmt: skip
    assert result.mismatch() is None, result.mismatch()
    for index, at in enumerate((16, 32)):
        folder = tmp_path / f"resume{index + 1}"
        state = json.loads((folder / f"checkpoint-{trained_ids.STEPS}" / "trainer_state.json").read_text())
        evaluated = [entry["step"] for entry in state["log_history"] if "eval_loss" in entry]
        assert evaluated == sorted(set(evaluated)), f"an evaluation ran twice: {evaluated}"
        assert (folder / f"checkpoint-{at}" / DATA_POSITION_NAME).is_file()
        verify_checkpoint(folder / f"checkpoint-{at}", full=True)


@pytest.mark.parametrize("kind", ["json", "json_converted"])
def test_the_same_files_at_another_path_continue_from_the_position(tmp_path, kind):
    """Case 8: a job that stages its data to per-job scratch space: the same JSON lines files at another path are the
    same data, so the resumed run continues from the position (reading only its remaining steps' examples)."""
    staged = iter(range(10))

    def make():
        folder = tmp_path / f"scratch-{next(staged)}"
        trained_ids.write_json_lines(folder)
        return trained_ids.source(kind, files=folder)

    result = trained_ids.chain(tmp_path, make, hflight, (8, 16))
    assert result.mismatch() is None, result.mismatch()
    remaining = (trained_ids.STEPS - 8) * trained_ids.BATCH
    assert result.resumes[0][3] <= remaining + 3 * trained_ids.BATCH, "the position was not used"


@pytest.mark.parametrize("doctored", ["another checkpoint's file", "no stream state"])
def test_a_position_file_that_is_not_the_checkpoints_is_read_and_dropped(tmp_path, doctored, caplog):
    """Case 10: a folder without a manifest (hflight resumes those, as transformers') holding checkpoint-16's
    data_position.pt in checkpoint-8, or a position whose stream state is None: the trained batches are read and
    dropped (the console says why), and the run trains the uninterrupted run's examples."""
    make = lambda: trained_ids.source("map")  # noqa: E731
    _, full, _ = trained_ids.run(tmp_path / "full", make(), hflight)
    folder = tmp_path / "full/checkpoint-8"
    (folder / MANIFEST_NAME).unlink()
    if doctored == "no stream state":
        position = torch.load(folder / DATA_POSITION_NAME, weights_only=True)
        position["ranks"][0]["state"] = None
        torch.save(position, folder / DATA_POSITION_NAME)
        why = "holds no stream state for process 0"
    else:
        shutil.copy(tmp_path / "full/checkpoint-16" / DATA_POSITION_NAME, folder / DATA_POSITION_NAME)
        why = "records step 16 and the checkpoint is at step 8"
    with caplog.at_level("INFO"):
        _, resumed, reads = trained_ids.run(tmp_path / "resumed", make(), hflight, resume=str(folder))
    assert trained_ids.mismatch(full, resumed, 8) is None
    assert why in caplog.text and reads >= 8 * trained_ids.BATCH


def test_a_tensor_parallel_run_takes_up_its_replicas_position():
    """Under tensor parallelism a checkpoint holds one position per data-parallel replica (the processes of a group
    share their batches): a process takes up its replica's entry, compared with the number of replicas, not of
    processes (4 processes, TP 2: 2 replicas, this process in replica 1)."""
    from types import SimpleNamespace

    from hflight.run.loop import TrainingLoop

    stream = trained_ids.source("map")
    entries = [{"epoch": 0, "batches": 6, "end_of_pass": False, "state": {"replica": r}} for r in (0, 1)]
    described = data_position.describe(stream, stream)
    saved = {"format": data_position.FORMAT, "version": data_position.VERSION, "global_step": 6,
             "dataset": described, "datasets": {}, "ranks": entries, "why": None,
             "loader": {"how": "per_process", "num_workers": 0, "batch_size": 4, "processes": 2}}  # fmt: skip
    loader = SimpleNamespace(how="per_process", num_workers=0, batch_size=4, sharding=None, positioned=stream)
    world = SimpleNamespace(size=4, rank=3, data_parallel=(2, 1), gather_objects=lambda values: values)
    loop = TrainingLoop.__new__(TrainingLoop)
    loop.facade = SimpleNamespace(state=SimpleNamespace(global_step=6), args=SimpleNamespace(ignore_data_skip=False),
                                  train_dataset=stream)  # fmt: skip
    loop.run = SimpleNamespace(world=world, resume=SimpleNamespace(folder="checkpoint-6", data_position=saved))
    loop.plan = SimpleNamespace(resume_position=lambda step, ignore: (0, step))
    loop.tracker = SimpleNamespace(dataset=described)
    start = loop._data_start(loader)
    assert (start.how, start.batches, start.state) == ("position", 6, {"replica": 1})


@pytest.mark.parametrize("kind", ["map", "generator", "torch_state", "torch_live", "torch"])
def test_the_state_taken_after_each_batch_is_torchdatas_own_and_does_not_move(kind):
    """hflight reads torchdata's one-process loader state itself (its Stateful checks cached: benchmarks/
    position_cost.py): the same as torchdata's state_dict() after every batch, and a structure of its own (a dataset
    whose state_dict() returns its live dict does not move it as the loader reads on)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from hflight.run.loaders import loader_state

    loader = StatefulDataLoader(trained_ids.source(kind), batch_size=4)
    taken = []
    for _ in loader:
        state = loader_state(loader)
        assert state == loader.state_dict()
        taken.append((state, repr(state)))
    assert all(repr(state) == text for state, text in taken), "a state taken earlier moved"
