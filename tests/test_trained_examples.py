"""The oracle grid (issue 66): for every kind of stream, loader and resume point, a resumed run trains exactly the
examples the uninterrupted run trains, step for step, in the same order; first, second and third resumes, each from
the previous resumed run's own checkpoint (tests/jobs/trained_ids.py: the ids coded into the tokens, a spy on
``compute_loss``). transformers' own resume of the same script is the reference: it is exact within a stream's first
pass (and retrains the first pass's examples from a later pass's checkpoint), hflight everywhere.

Each cell: 64 examples, batches of 4 (a pass of 16 steps), 40 steps, a checkpoint every 8 or 4 steps; the resumes
from checkpoint 8 (mid-pass), from the resumed run's checkpoint 12 (mid-pass, a second resume in the same pass) and
from the next one's checkpoint 16 (the pass's end). Under torchrun: tests/test_data_position_ddp.py."""

from __future__ import annotations

import os
import signal
import sys

import pytest
import transformers

import hflight

from .launch import JOBS

sys.path.insert(0, str(JOBS))
import trained_ids  # noqa: E402

POINTS = (8, 12, 16)
W2 = {"dataloader_num_workers": 2}
PER_PROCESS = {"accelerator_config": {"dispatch_batches": False}}
EVAL_SAME = {"eval_strategy": "steps", "eval_steps": 6, "eval_dataset": "train"}


def _cell(kind, settings=None, points=POINTS, id=None):
    return pytest.param(kind, settings or {}, points, id=id or kind)


CELLS = [
    _cell("generator", id="from_generator"),
    _cell("generator", {**W2, "dataloader_prefetch_factor": 1}, id="from_generator, 2 workers, prefetch 1"),
    _cell("torch", id="case 1: a torch stream without state, resumed three times"),
    _cell("torch", {**W2, "dataloader_persistent_workers": True}, id="case 1: without state, 2 persistent workers"),
    _cell("torch_state", W2, id="a torch stream with state_dict, 2 workers"),
    _cell("torch_live", id="case 5: state_dict returns its live dict"),
    _cell("torch_numpy", id="case 6: a numpy integer in the stream's state"),
    _cell("torch_refusing", W2, id="a position the dataset refuses in a loader worker"),
    _cell("torch_refusing_lazy", id="a position the dataset refuses at its first example"),
    _cell("map", id="to_iterable_dataset().map()"),
    _cell("map", PER_PROCESS, (8, 16, 24), id="map, read by the process, resumed mid-second-pass"),
    _cell("unhashable_map", id="case 7: Dataset.map with a function datasets cannot hash"),
    _cell("json", points=(8, 16, 24), id="load_dataset json streaming"),
    _cell("json_converted", id="load_dataset json, to_iterable_dataset"),
    _cell("shuffle", id="case 2: shuffle with a buffer"),
    _cell("shuffle", {**PER_PROCESS, **W2}, id="case 2: shuffle with a buffer, read by the process, 2 workers"),
    _cell("interleave", id="interleave_datasets"),
    _cell("filter", {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}, id="filter, GA 2"),
    _cell("batch", {"per_device_train_batch_size": 2, "data_collator": trained_ids.pairs}, id="batch, 2 pairs a step"),
    _cell("skip_take", id="skip and take"),
    _cell("map", EVAL_SAME, id="case 4: the training stream is also the eval_dataset"),
    _cell("map", {**EVAL_SAME, **PER_PROCESS}, id="case 4: also the eval_dataset, read by the process"),
    _cell("map", {"save_strategy": "epoch", **PER_PROCESS}, (16, 32), id="case 3: epoch-end checkpoints, per process"),
    _cell("map", {"save_strategy": "epoch"}, (16, 32), id="epoch-end checkpoints, dispatched"),
    _cell("map", {"save_steps": 4, "save_async": True}, id="save_async"),
]


@pytest.mark.parametrize("kind, settings, points", CELLS)
def test_every_resume_trains_the_uninterrupted_runs_examples(tmp_path, kind, settings, points):
    trained_ids.write_json_lines(tmp_path / "data")
    files, settings = tmp_path / "data", {"save_steps": 4, **settings}
    result = trained_ids.chain(tmp_path, lambda: trained_ids.source(kind, files=files), hflight, points, **settings)
    assert result.mismatch() is None, result.mismatch()


# an in-memory stream and a file stream (the torch and shuffled streams' own exactness: the grid above)
@pytest.mark.parametrize("kind", ["map", "json"])
def test_transformers_resume_is_exact_in_the_first_pass_and_hflight_everywhere(tmp_path, kind):
    """The reference: transformers reads and drops the trained batches of the first pass (exact there); from a
    checkpoint of the second pass it trains the first pass's examples again. hflight's chain is exact at every
    point, its first resume reading less than transformers' (a position) or as much (read and drop; hflight's loop
    reads one batch further ahead at the end of training: Lightning fetches the next micro-batch before a step)."""
    trained_ids.write_json_lines(tmp_path / "data")
    files, runs = tmp_path / "data", {}
    for name, library in (("transformers", transformers), ("hflight", hflight)):
        make = lambda: trained_ids.source(kind, files=files)  # noqa: E731
        runs[name] = trained_ids.chain(tmp_path / name, make, library, (8, 16, 24))
    reference, ours = runs["transformers"], runs["hflight"]
    assert reference.resumes[0][2] == {step: ids for step, ids in reference.full.items() if step > 8}
    assert trained_ids.mismatch(reference.full, reference.resumes[2][2], 24) is not None  # past the first pass
    assert ours.mismatch() is None, ours.mismatch()
    assert ours.resumes[0][3] <= reference.resumes[0][3] + trained_ids.BATCH


class _SigtermAt(transformers.TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize(
    "kind, settings", [("map", {}), ("torch", {"save_async": True})], ids=["map", "torch, save_async"]
)
def test_a_sigterm_checkpoint_resumes_on_the_uninterrupted_runs_examples(tmp_path, kind, settings):
    """SIGTERM after step 10 (between the checkpoints of every 8): the stop's checkpoint-10, resumed in the run's own
    folder, trains the uninterrupted run's examples from step 11 (a position, or read and dropped)."""
    make = lambda: trained_ids.source(kind)  # noqa: E731
    _, full, _ = trained_ids.run(tmp_path / "full", make(), hflight, **settings)
    with pytest.raises(SystemExit):
        trained_ids.run(tmp_path / "run", make(), hflight, callbacks=[_SigtermAt(10)], **settings)
    _, resumed, _ = trained_ids.run(tmp_path / "run", make(), hflight, resume=str(tmp_path / "run/checkpoint-10"),
                                    **settings)  # fmt: skip
    assert trained_ids.mismatch(full, resumed, 10) is None


@pytest.mark.parametrize("persistent", [False, True], ids=["workers", "persistent workers"])
def test_no_loader_worker_outlives_train(tmp_path, persistent):
    """As with transformers, the training loader's worker processes are gone when train() returns (torchdata's loader
    keeps its iterator: they lived on until a garbage collection, which then waited 5 s for each)."""
    psutil = pytest.importorskip("psutil")
    before = {p.pid for p in psutil.Process().children(recursive=True)}  # e.g. multiprocessing's resource tracker
    trainer, _, _ = trained_ids.run(tmp_path, trained_ids.source("torch"), hflight, max_steps=8,
                                    dataloader_num_workers=2, dataloader_persistent_workers=persistent)  # fmt: skip
    alive = [p for p in psutil.Process().children(recursive=True)
             if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE]  # fmt: skip
    assert not alive, [p.cmdline() for p in alive]
    assert trainer.state.global_step == 8
