"""transformers' data surface of the ``Trainer``: loader getters, samplers, unused-column pruning.

The loaders are built here, on the facade's side, through transformers' override points (``_get_dataloader``,
``_get_train_sampler``, ``_get_eval_sampler``, ``_remove_unused_columns``), so a subclass's override takes effect;
the run's ``HFDataModule`` asks the facade for them once Lightning has launched the processes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, Sampler, SequentialSampler

from hflight.run import console
from hflight.run.loaders import private_stream
from hflight.run.samplers import check_even


def empty_batch(signature_columns: list[str]) -> ValueError:
    """transformers' error for an empty batch, listing the columns the model takes (``signature_columns``)."""
    return ValueError(
        "The batch received was empty, your model won't be able to train on it. Double-check that your "
        f"training dataset contains keys expected by the model: {','.join(signature_columns)}."
    )


# ---- loaders the facade's getters build ----------------------------------------------------------------------
def remove_unused_columns(
    dataset: Any, signature_columns: list[str], description: str | None = None, model_name: str = "model"
) -> Any:
    """Drop the columns of a ``datasets.Dataset`` that the model's ``forward`` does not take (HF's rule, with its
    note naming them; ``model_name``: the model's class name, for the note)."""
    import datasets

    if not isinstance(dataset, datasets.Dataset):
        return dataset
    ignored = [c for c in dataset.column_names if c not in signature_columns]
    if ignored:
        console.columns_ignored(ignored, description, model_name)
    if len(ignored) == len(dataset.column_names):
        raise ValueError(
            f"No columns in the {description or ''} dataset match the model's forward method signature: "
            f"({', '.join(signature_columns)}). The following columns have been ignored: [{', '.join(ignored)}]. "
            "Please check the dataset and model. "
            "You may need to set `remove_unused_columns=False` in `TrainingArguments`."
        )
    return dataset.remove_columns(ignored) if ignored else dataset


def length_grouped_sampler(
    dataset: Any, args: Any, processing_class: Any, batch_size: int, seed: int | None
) -> Sampler[int]:
    """transformers' ``LengthGroupedSampler`` for ``dataset``: lengths from ``length_column_name``, else from the
    processing class's first input. ``seed`` None: it draws from torch's global generator, as transformers' training
    sampler does (so, as there, the order depends on what drew before it); else a generator seeded with it (the
    evaluation and test samplers of transformers 5.23)."""
    import datasets
    from transformers.trainer_pt_utils import LengthGroupedSampler

    lengths = None
    if isinstance(dataset, datasets.Dataset) and args.length_column_name in dataset.column_names:
        lengths = dataset[args.length_column_name]
    input_name = processing_class.model_input_names[0] if processing_class is not None else None
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return LengthGroupedSampler(
        batch_size, dataset=dataset, lengths=lengths, model_input_name=input_name, generator=generator
    )


def _group_by_length(dataset: Any, args: Any, processing_class: Any, seed: int) -> Sampler[int]:
    batch_size = args.train_batch_size * args.gradient_accumulation_steps
    return length_grouped_sampler(dataset, args, processing_class, batch_size, None)


def _random(dataset: Any, args: Any, processing_class: Any, seed: int) -> Sampler[int]:
    """torch's ``RandomSampler``, as transformers builds it; ``trainer.accelerator.prepare`` then swaps it as
    accelerate's ``prepare_data_loader`` does (``use_seedable_sampler``, the default: the order drawn from
    ``data_seed``, else torch's initial seed, + epoch; otherwise the generator accelerate gives it). An empty dataset
    is named here (torch's own error would say ``num_samples=0``)."""
    if len(dataset) == 0:
        raise ValueError(
            "The training dataloader is empty: the train_dataset has no examples. Pass a non-empty train_dataset."
        )
    return RandomSampler(dataset)


TRAIN_SAMPLERS: dict[str, Callable[[Any, Any, Any, int], Sampler[int]]] = {
    "random": _random,
    "sequential": lambda dataset, args, processing_class, seed: SequentialSampler(dataset),
    "group_by_length": _group_by_length,
}


def train_sampler(dataset: Any, args: Any, processing_class: Any) -> Sampler[int]:
    """The sampler ``args.train_sampling_strategy`` names, seeded with ``data_seed`` (else ``seed``)."""
    strategy = str(getattr(args.train_sampling_strategy, "value", args.train_sampling_strategy))
    seed = args.data_seed if args.data_seed is not None else args.seed
    return TRAIN_SAMPLERS[strategy](dataset, args, processing_class, seed)


def make_dataloader(
    dataset: Any, args: Any, collator: Callable, batch_size: int, sampler: Sampler[int] | None
) -> DataLoader:
    """The DataLoader of all the data with ``args``' worker settings, as transformers builds it before
    ``accelerator.prepare`` deals it to the processes (``trainer.accelerator.prepare``)."""
    params: dict[str, Any] = {
        "collate_fn": collator,
        "num_workers": args.dataloader_num_workers,
        "pin_memory": args.dataloader_pin_memory and torch.cuda.is_available(),
        "persistent_workers": args.dataloader_persistent_workers,  # without workers torch refuses it, as transformers
        "prefetch_factor": args.dataloader_prefetch_factor,
    }
    if args.dataloader_num_workers > 0:  # only worker processes have a start method and an order to keep
        params["multiprocessing_context"] = args.dataloader_multiprocessing_context
        params["in_order"] = args.dataloader_in_order
    if isinstance(dataset, IterableDataset):
        return DataLoader(dataset, batch_size=batch_size, **params)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=args.dataloader_drop_last, **params)


class DataLoadersMixin:
    """transformers' data surface of the ``Trainer`` (loader getters, samplers, column pruning), over its public
    attributes; ``self.accelerator.prepare`` deals each loader to the run's processes."""

    _signature_columns: list[str] | None = None  # the model's forward arguments and label names, found once

    def _set_signature_columns_if_needed(self) -> None:
        if self._signature_columns is None:
            columns = list(inspect.signature(self.model.forward).parameters)
            self._signature_columns = columns + list({"label", "label_ids", *self.label_names})

    def _remove_unused_columns(self, dataset: Any, description: str | None = None) -> Any:
        if not self.args.remove_unused_columns:
            return dataset
        self._set_signature_columns_if_needed()
        return remove_unused_columns(dataset, self._signature_columns, description, type(self.model).__name__)

    def _prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        inputs = self._prepare_input(inputs)
        if len(inputs) == 0:
            self._set_signature_columns_if_needed()
            raise empty_batch(self._signature_columns or [])
        return inputs

    def _prepare_input(self, data: Any) -> Any:
        """One element of a batch on the run's device, as transformers: mappings, lists and tuples element by element
        through this method (an override sees each element), tensors moved, anything else as it is."""
        if isinstance(data, Mapping):
            return type(data)({key: self._prepare_input(value) for key, value in data.items()})
        if isinstance(data, (tuple, list)):
            return type(data)(self._prepare_input(value) for value in data)
        device = self.accelerator.device
        # a plain (blocking) copy, as transformers' (accelerator_config's non_blocking is for the loaders' batches)
        return data.to(device) if isinstance(data, torch.Tensor) and device is not None else data

    def _get_dataloader(
        self,
        dataset: Any,
        description: str,
        batch_size: int,
        sampler_fn: Callable[[Any], Sampler[int]] | None = None,
        is_training: bool = False,
        dataloader_key: str | None = None,
    ) -> DataLoader:
        """``dataset`` in batches of ``batch_size``: unused columns removed (``_remove_unused_columns``), the sampler
        from ``sampler_fn`` (none for iterable datasets), dealt to the processes by ``self.accelerator.prepare`` (as
        ``accelerator_config`` says)."""
        if dataset is None:
            raise ValueError(f"Trainer: {description.lower()} requires a dataset.")
        if not is_training and dataset is getattr(self, "train_dataset", None):  # the training stream, evaluated too:
            dataset = private_stream(dataset)  # on a copy, so that the training's position stays the training's
        dataset = self._remove_unused_columns(dataset, description)
        sampler = None
        if not isinstance(dataset, IterableDataset) and sampler_fn is not None:
            sampler = sampler_fn(dataset)
        loader = self.accelerator.prepare(make_dataloader(dataset, self.args, self.data_collator, batch_size, sampler))
        check_even(loader, is_training)
        if dataloader_key is not None and self.args.dataloader_persistent_workers:
            # kept, so that its persistent workers serve every evaluation (transformers' _eval_dataloaders)
            self._eval_dataloaders = {**getattr(self, "_eval_dataloaders", {}), dataloader_key: loader}
        return loader

    def _get_train_sampler(self, train_dataset: Any = None) -> Sampler[int]:
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        return train_sampler(dataset, self.args, self.processing_class)

    def _get_eval_sampler(self, eval_dataset: Any) -> Sampler[int]:
        """Sequential; length-grouped (seeded with ``data_seed``, else ``seed``) under ``group_by_length``, as in
        transformers 5.23 (predictions then come back in that order)."""
        args = self.args
        if str(getattr(args.train_sampling_strategy, "value", args.train_sampling_strategy)) == "group_by_length":
            seed = args.data_seed if args.data_seed is not None else args.seed
            return length_grouped_sampler(eval_dataset, args, self.processing_class, args.eval_batch_size, seed)
        return SequentialSampler(eval_dataset)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError(
                "Trainer: evaluation requires an eval_dataset. Pass `eval_dataset=` to the Trainer or to evaluate()."
            )
        # with persistent workers, one loader per evaluation set (a name of the eval_dataset dict, else "eval": an
        # eval_dataset passed in then gets the kept loader, as in transformers), so that its workers are started once
        key = eval_dataset if isinstance(eval_dataset, str) else "eval"
        kept = getattr(self, "_eval_dataloaders", {})
        if key in kept and self.args.dataloader_persistent_workers:
            return kept[key]
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        return self._get_dataloader(
            dataset, "Evaluation", self.args.eval_batch_size, self._get_eval_sampler, dataloader_key=key
        )

    def get_test_dataloader(self, test_dataset: Any) -> DataLoader:
        return self._get_dataloader(test_dataset, "test", self.args.eval_batch_size, self._get_eval_sampler)

    def num_examples(self, dataloader: DataLoader) -> int:
        try:
            return len(dataloader.dataset)
        except (NameError, AttributeError, TypeError):
            return len(dataloader) * self.args.per_device_train_batch_size
