"""Samplers and accumulation cycles."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import SequentialSampler

from hflight.run.datamodule import AccumulationCycles, EpochSeededRandomSampler, ShardedBatchSampler
from hflight.run.position import Start


def test_epoch_seeded_sampler_is_reproducible_and_changes_per_epoch():
    a, b = EpochSeededRandomSampler(50, seed=3), EpochSeededRandomSampler(50, seed=3)
    assert list(a) == list(b) and sorted(a) == list(range(50))
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first and sorted(a) == list(range(50))


@pytest.mark.parametrize("n, batch, world", [(10, 4, 2), (7, 3, 3), (16, 4, 2), (3, 4, 2), (9, 2, 4)])
def test_sharded_batches_gather_back_into_dataset_order(n, batch, world):
    ranks = [list(ShardedBatchSampler(SequentialSampler(range(n)), batch, False, world, r)) for r in range(world)]
    assert len({len(r) for r in ranks}) == 1  # every rank steps the same number of times
    assert all(len(b) == batch for r in ranks for b in r)  # equal shapes for all_gather
    assert all(len(r) == len(ShardedBatchSampler(SequentialSampler(range(n)), batch, False, world, 0)) for r in ranks)
    gathered = [i for step in zip(*ranks) for b in step for i in b]  # what all_gather + flatten returns
    assert gathered[:n] == list(range(n))


def test_sharded_batches_drop_last():
    ranks = [list(ShardedBatchSampler(SequentialSampler(range(10)), 4, True, 2, r)) for r in range(2)]
    assert ranks == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    with pytest.raises(ValueError, match="rank"):
        ShardedBatchSampler(SequentialSampler(range(4)), 2, False, 2, 2)


def test_accumulation_cycles_tag_micro_batches_like_hf():
    loader = [{"labels": torch.tensor([1, -100, 2])} for _ in range(5)]

    def batch_samples(iterator, num_batches):  # a cycle and its label items, as Trainer.get_batch_samples returns
        batches = list(itertools.islice(iterator, num_batches))
        return batches, sum(int(b["labels"].ne(-100).sum()) for b in batches)

    cycles = AccumulationCycles(loader, 2, batch_samples, epoch_fn=lambda: 0)
    tagged = list(cycles)
    assert [(m.index, m.cycle_size, m.num_items_in_batch, m.step_in_epoch) for m in tagged] == [
        (0, 2, 4, 0),
        (1, 2, 4, 1),
        (0, 2, 4, 2),
        (1, 2, 4, 3),
        (0, 1, 2, 4),
    ]
    assert [m.is_last for m in tagged] == [False, True, False, True, True]
    cycles.start = Start(0, 3)  # a plain list: read and dropped
    assert len(cycles) == 5  # the epoch length stays whole: it bounds the following epochs too
    assert [m.step_in_epoch for m in cycles] == [3, 4]
    assert len(list(cycles)) == 5  # the next pass is complete again


def test_micro_batch_transfer_moves_only_tensors_and_keeps_cycle_tags():
    from hflight.run.datamodule import HFDataModule, MicroBatch

    inputs = {"input_ids": torch.ones(2, 3, dtype=torch.long), "nested": [torch.zeros(2)], "tag": "x"}
    batch = MicroBatch(inputs=inputs, index=1, cycle_size=2, num_items_in_batch=torch.tensor(5), step_in_epoch=7)
    module = HFDataModule(facade=None, run=None)
    moved = module.transfer_batch_to_device(batch, torch.device("meta"), 0)
    assert moved.inputs["input_ids"].device.type == "meta" and moved.inputs["nested"][0].device.type == "meta"
    assert moved.num_items_in_batch.device.type == "meta" and moved.inputs["tag"] == "x"
    assert (moved.index, moved.cycle_size, moved.step_in_epoch, moved.is_last) == (1, 2, 7, True)
    assert batch.inputs["input_ids"].device.type == "cpu"  # the loader's batch is left as it was
    plain = module.transfer_batch_to_device({"a": torch.ones(1)}, torch.device("meta"), 0)  # other batches: Lightning
    assert plain["a"].device.type == "meta"


def test_the_loader_of_an_iterable_dataset_is_a_dataloader_as_accelerates_dispatcher(tmp_path):
    """An iterable dataset's training loader is dispatched (accelerate's default for one): accelerate's
    ``DataLoaderDispatcher`` is a ``DataLoader``, and so is hflight's, with the base loader's settings
    (transformers' tests/trainer/test_trainer_data.py::test_training_iterable_dataset asserts it)."""
    import hflight

    class Rows(torch.utils.data.IterableDataset):
        def __iter__(self):
            for i in range(8):
                yield {"input_x": torch.tensor([float(i)]), "labels": torch.tensor([2.0 * i])}

    class Linear(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(1, 1)

        def forward(self, input_x, labels=None):
            y = self.a(input_x)
            return {"loss": torch.nn.functional.mse_loss(y, labels), "logits": y}

    args = hflight.TrainingArguments(str(tmp_path), max_steps=2, report_to="none", per_device_train_batch_size=2)
    loader = hflight.Trainer(Linear(), args, train_dataset=Rows()).get_train_dataloader()
    assert isinstance(loader, torch.utils.data.DataLoader)
    assert isinstance(loader.sampler, torch.utils.data.dataloader._InfiniteConstantSampler)
    assert loader.num_workers == 0 and loader.batch_size == 2
    assert [batch["labels"].flatten().tolist() for batch in loader][:2] == [[0.0, 2.0], [4.0, 6.0]]
