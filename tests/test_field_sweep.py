"""Field by field (issue 24, point 1): transformers.TrainingArguments' fields, each set to a plausible non-default
value, run with transformers' Trainer and with hflight's on the same model and data (train, evaluate, predict), and
compared bit for bit: the logged numbers and keys, the metrics, the predictions, and the files written, by name and by
content (see tests/field_runs.py's :func:`_content`: timings aside, each side's own folder named alike, hflight's own
additions left out). A swept field must change what the run shows (against hflight's run with every field at its
default), or be listed in :data:`NOT_OBSERVABLE` with the reason it shows nothing in this setting: it runs, but is not
counted as compared. Fields this machine cannot run are listed in :data:`NOT_RUNNABLE` with the reason; fields with a
test of their own elsewhere in :data:`TESTED_ELSEWHERE`. A field in none of the three fails
:func:`test_every_field_is_swept_or_listed`; docs/coming-from-transformers.md gives the counts
(:func:`test_the_guide_counts_the_fields_as_this_test_does`)."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import transformers

from .field_runs import TIMES as _TIMES
from .field_runs import run_field

#: field -> a plausible non-default value (with what it needs beside it).
SWEEP: dict[str, dict] = {
    "per_device_train_batch_size": dict(per_device_train_batch_size=3),
    "num_train_epochs": dict(num_train_epochs=2),
    "max_steps": dict(max_steps=3),
    "learning_rate": dict(learning_rate=3e-3),
    "lr_scheduler_type": dict(lr_scheduler_type="cosine"),
    "lr_scheduler_kwargs": dict(lr_scheduler_type="cosine_with_restarts", lr_scheduler_kwargs={"num_cycles": 2}),
    "warmup_steps": dict(warmup_steps=2),
    "optim": dict(optim="sgd"),
    "optim_args": dict(optim="adafactor", optim_args="scale_parameter=False,relative_step=False"),
    "weight_decay": dict(weight_decay=0.1),
    "adam_beta1": dict(adam_beta1=0.8),
    "adam_beta2": dict(adam_beta2=0.95),
    "adam_epsilon": dict(adam_epsilon=1e-6),
    "gradient_accumulation_steps": dict(gradient_accumulation_steps=2),
    "average_tokens_across_devices": dict(average_tokens_across_devices=False),
    "max_grad_norm": dict(max_grad_norm=0.1),
    "label_smoothing_factor": dict(label_smoothing_factor=0.1),
    "activation_checkpointing": dict(activation_checkpointing=True),
    "use_cache": dict(use_cache=True),
    "neftune_noise_alpha": dict(neftune_noise_alpha=5.0),
    "torch_empty_cache_steps": dict(torch_empty_cache_steps=1),
    "logging_strategy": dict(logging_strategy="epoch"),
    "logging_steps": dict(logging_steps=2),
    "logging_first_step": dict(logging_steps=3, logging_first_step=True),
    "logging_nan_inf_filter": dict(logging_nan_inf_filter=False),
    "eval_strategy": dict(eval_strategy="steps", eval_steps=2),
    "eval_steps": dict(eval_strategy="steps", eval_steps=3),
    "eval_delay": dict(eval_strategy="steps", eval_steps=1, eval_delay=2),
    "per_device_eval_batch_size": dict(per_device_eval_batch_size=3),
    "prediction_loss_only": dict(prediction_loss_only=True),
    "eval_on_start": dict(eval_on_start=True),
    "eval_accumulation_steps": dict(eval_accumulation_steps=1),
    "include_for_metrics": dict(include_for_metrics=["loss"]),
    "save_only_model": dict(save_strategy="steps", save_steps=2, save_only_model=True),
    "save_strategy": dict(save_strategy="epoch"),
    "save_steps": dict(save_strategy="steps", save_steps=3),
    "save_total_limit": dict(save_strategy="steps", save_steps=1, save_total_limit=2),
    "load_best_model_at_end": dict(eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2,
                                   load_best_model_at_end=True),
    "metric_for_best_model": dict(eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
                                  load_best_model_at_end=True, metric_for_best_model="loss", save_total_limit=1),
    "greater_is_better": dict(eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
                              load_best_model_at_end=True, greater_is_better=True, save_total_limit=1),
    "seed": dict(seed=7),
    "data_seed": dict(train_sampling_strategy="random", data_seed=3),
    "train_sampling_strategy": dict(train_sampling_strategy="random"),
    "dataloader_drop_last": dict(per_device_train_batch_size=3, dataloader_drop_last=True),
    "remove_unused_columns": dict(remove_unused_columns=False),
    "label_names": dict(label_names=["labels"]),
    "ignore_data_skip": dict(ignore_data_skip=True),
    "run_name": dict(run_name="sweep"),
    "disable_tqdm": dict(disable_tqdm=False),
    "log_level": dict(log_level="error"),
    "do_train": dict(do_train=True),
    "do_eval": dict(do_eval=True),
    "do_predict": dict(do_predict=True),
    "local_rank": dict(local_rank=-1),
    "dataloader_pin_memory": dict(dataloader_pin_memory=False),
    "dataloader_prefetch_factor": dict(dataloader_num_workers=0, dataloader_prefetch_factor=None),
    "length_column_name": dict(length_column_name="lengths"),
    "use_cpu": dict(use_cpu=True),
    "bf16": dict(bf16=True, use_cpu=True),  # bf16 autocast on the CPU (transformers asks for use_cpu)
    "debug": dict(debug="underflow_overflow"),
    "log_on_each_node": dict(log_on_each_node=False),
    "log_level_replica": dict(log_level_replica="error"),
    "save_on_each_node": dict(save_strategy="steps", save_steps=2, save_on_each_node=True),
    "ddp_timeout": dict(ddp_timeout=600),
    "ddp_find_unused_parameters": dict(ddp_find_unused_parameters=True),
    "ddp_bucket_cap_mb": dict(ddp_bucket_cap_mb=5),
    "ddp_broadcast_buffers": dict(ddp_broadcast_buffers=False),
    "ddp_static_graph": dict(ddp_static_graph=True),
    "hub_strategy": dict(hub_strategy="end"),
    "hub_private_repo": dict(hub_private_repo=True),
    "hub_always_push": dict(hub_always_push=True),
    "project": dict(project="sweep"),
}  # fmt: skip

#: fields with a test of their own that compares with transformers (test file: what it checks).
TESTED_ELSEWHERE = {
    "fsdp": 'test_sharded_dropin (run_clm with --fsdp "full_shard auto_wrap", 2 processes a side, bit for bit, its '
    "sharded checkpoints); test_sharding (the full checkpoint form, equal to the sharded run's)",
    "deepspeed": "test_deepspeed (ZeRO-2 bit for bit with transformers' run, 2 processes; ZeRO-3; the checkpoints)",
    "fsdp_config": 'test_sharded_dropin (run_clm with --fsdp_config {"version": 2, ...}: FSDP2, the layer class to '
    "wrap, SHARDED_STATE_DICT, 2 processes a side, bit for bit, its shards), test_sharding (each key's effect on "
    "the plan: reshard_after_forward, cpu_offload, activation_checkpointing; keys that cannot run refused)",
    "include_num_input_tokens_seen": "test_fields_parity",
    "eval_do_concat_batches": "test_fields_parity",
    "skip_memory_metrics": "test_fields_parity",
    "restore_callback_states_from_checkpoint": "test_callbacks",
    "full_determinism": "test_fields_parity",
    "fp16": "test_fields_parity (CPU: full precision, as transformers)",
    "resume_from_checkpoint": "test_fields_parity (not read by train())",
    "batch_eval_metrics": "test_surface",
    "bf16_full_eval": "test_arguments_on_lightning",
    "fp16_full_eval": "test_arguments_on_lightning (as bf16_full_eval)",
    "auto_find_batch_size": "test_arguments_on_lightning",
    "torch_compile": "test_arguments_on_lightning (subprocess, frames counted)",
    "torch_compile_backend": "test_arguments_on_lightning",
    "torch_compile_mode": "test_training_args (implies torch_compile, as transformers)",
    "eval_use_gather_object": "test_arguments_on_lightning",
    "dataloader_num_workers": "test_arguments_on_lightning",
    "dataloader_persistent_workers": "test_arguments_on_lightning (with and without workers, as transformers)",
    "optim_target_modules": "test_optimizers (GaLore/APOLLO, layer-wise too, saved and resumed, against transformers)",
    "use_liger_kernel": "test_optimizers (transformers' ImportError without liger-kernel; with a test stand-in of "
    "Liger's patch, applied and evaluated as transformers does: liger-kernel needs CUDA/Triton)",
    "liger_kernel_config": "test_optimizers (handed to Liger's patch as transformers hands it, via a test stand-in)",
    "report_to": "test_tracking (TensorBoard, MLflow and W&B offline: what each tool recorded, read back with "
    "TensorBoard's and MLflow's readers and W&B's protobuf records) and test_run_reports (names, errors, csv)",
    "dataloader_multiprocessing_context": "test_arguments_on_lightning",
    "dataloader_in_order": "test_arguments_on_lightning",
    "enable_jit_checkpoint": "test_jit_checkpoint",
    "gradient_checkpointing": "test_training_args (deprecated alias of activation_checkpointing)",
    "gradient_checkpointing_kwargs": "test_training_args (alias)",
    "activation_checkpointing_kwargs": "test_arguments_on_lightning",
    "parallelism_config": "test_sharding (its data-parallel sizes under FSDP2, HSDP over 4 processes; context and "
    "sequence parallelism refused naming the field), test_tensor_parallel (dp_shard_size x tp_size: 2 x 2 against "
    "the one-process run; sizes other than the model's refused)",
    "accelerator_config": "test_accelerator_config (every field under torchrun, 2 processes, against transformers; "
    "the input forms and errors)",
    "ddp_backend": "test_arguments_on_lightning (Lightning's process_group_backend); in one process transformers' "
    "own arguments fail on it (accelerate asks for a process group that does not exist), hflight's do not",
}

#: fields whose value in :data:`SWEEP` changes nothing this test observes (logs, metrics, predictions, files) in one
#: CPU process without the hub, in either library: they run (accepted, same results) but are not counted as compared.
_DDP = "configures DistributedDataParallel: one process here (test_distributed runs DDP against transformers)"
_HUB = "acts only with push_to_hub, which needs the hub (test_hub runs it against a local stand-in)"
_CONSOLE = "console output, which this test does not read"
NOT_OBSERVABLE = {
    "activation_checkpointing": "recomputes activations in the backward pass: the same numbers with less memory, and "
    "memory is not observed",
    "average_tokens_across_devices": "averages the token count over processes: one process here",
    "dataloader_pin_memory": "pinning needs an accelerator (none here): the same batches either way",
    "dataloader_prefetch_factor": "prefetching happens in worker processes only; without workers None is the default",
    "ddp_broadcast_buffers": _DDP,
    "ddp_bucket_cap_mb": _DDP,
    "ddp_find_unused_parameters": _DDP,
    "ddp_static_graph": _DDP,
    "ddp_timeout": "the process group's timeout: one process here",
    "debug": "underflow_overflow reports the first inf/nan activation: this run has none",
    "disable_tqdm": "the progress bar is " + _CONSOLE,
    "do_train": "read by example scripts, not by the Trainer (as in transformers)",
    "do_eval": "read by example scripts, not by the Trainer (as in transformers)",
    "do_predict": "read by example scripts, not by the Trainer (as in transformers)",
    "eval_accumulation_steps": "moves predictions to the CPU every N steps: on the CPU already, the same arrays",
    "hub_always_push": _HUB,
    "hub_private_repo": _HUB,
    "hub_strategy": _HUB,
    "ignore_data_skip": "acts only when a run resumes mid-epoch from a checkpoint",
    "include_for_metrics": "hands inputs or losses to compute_metrics: this run has no compute_metrics",
    "label_names": "['labels'] is what both libraries find for this model by themselves",
    "length_column_name": "read only when batches are grouped by length",
    "local_rank": "-1 is the one-process value both libraries take by themselves",
    "log_level": "log verbosity: " + _CONSOLE,
    "log_level_replica": "the log level of other processes: one process here",
    "log_on_each_node": "whether other nodes log: one node here",
    "logging_nan_inf_filter": "acts only when a loss is nan or inf: none here",
    "project": "the trackio project's name: no integration reports here",
    "run_name": "the run's name in report_to's integrations: none here (test_tracking compares the names they record)",
    "remove_unused_columns": "the dataset holds only the model's inputs: nothing to remove",
    "seed": "nothing is drawn from it here: the model is built before the trainer (with its own seed), sampling is "
    "sequential and dropout 0",
    "torch_empty_cache_steps": "empties an accelerator's memory cache: no accelerator here",
    "use_cache": "the model's key/value cache: BERT keeps none",
    "use_cpu": "the machine has only a CPU: the default runs there already",
}

#: fields this machine cannot run, with the reason.
NOT_RUNNABLE = {
    "output_dir": "each run needs its own folder (the files are compared, relative to it)",
    "tf32": "TF32 is a CUDA setting (no GPU here)",
    "trackio_space_id": "trackio needs the hub",
    "trackio_bucket_id": "trackio needs the hub",
    "trackio_static_space_id": "trackio needs the hub",
    "push_to_hub": "needs the hub (test_hub runs it against a local stand-in)",
    "hub_token": "needs the hub",
    "hub_model_id": "needs the hub",
    "hub_revision": "needs the hub",
}

_LIBRARIES = {"hf": "transformers", "hl": "hflight"}


#: what the fork server imports before any run (the libraries' lazy modules included: a child that imported them
#: itself would spend seconds on each run; transformers' Trainer imports DeepSpeed, when installed, in every run).
_PRELOAD = [
    "torch", "datasets", "lightning.pytorch", "transformers.trainer", "transformers.models.bert.modeling_bert",
    "deepspeed", "hflight.trainer", "hflight.run.run", "tests.support", "tests.field_runs",
]  # fmt: skip


@pytest.fixture(scope="module")
def fresh():
    """Runs :func:`run_field` in a new process each time, forked from a server that has imported torch,
    transformers, Lightning and hflight and done nothing else: no run sees another run's global state (torch's
    and numpy's generators, transformers' log level, environment variables a field sets, compiled or patched
    modules), and neither library shares a process with the other, at the cost of a fork rather than an import."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    root = str(Path(__file__).resolve().parents[1])
    added = root not in sys.path
    if added:  # the server copies sys.path when it starts: the children import tests.* from the checkout
        sys.path.insert(0, root)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)

    def call(*runs: tuple[str, str, dict]) -> list[dict]:
        """Each ``(library, out, fields)`` in a process of its own, all at once (the two sides of a field overlap on
        2 cores; neither sees the other)."""
        pools = [ProcessPoolExecutor(1, mp_context=context, max_tasks_per_child=1) for _ in runs]
        try:
            futures = [pool.submit(run_field, *run) for pool, run in zip(pools, runs)]
            return [future.result() for future in futures]
        finally:
            for pool in pools:
                pool.shutdown()

    try:
        yield call
    finally:
        if added:
            sys.path.remove(root)


def _observed(result: dict) -> tuple:
    """What a run shows of its fields: log entries (timings aside), metrics (timings aside), predictions, files."""
    history = [{k: v for k, v in e.items() if not any(t in k for t in _TIMES)} for e in result["log_history"]]
    metrics = {k: v for k, v in result["metrics"].items() if not any(t in k for t in _TIMES)}
    predictions = None if result["predictions"] is None else np.asarray(result["predictions"]).tolist()
    return history, result["global_step"], metrics, predictions, result["files"]


@pytest.fixture(scope="module")
def default_run(tmp_path_factory, fresh) -> tuple:
    """hflight with every field at its default: a field whose run shows nothing else is not observable here."""
    return _observed(fresh(("hflight", str(tmp_path_factory.mktemp("defaults")), {}))[0])


@pytest.mark.parametrize("field", sorted(SWEEP))
def test_field_as_transformers(field, tmp_path, fresh, default_run):
    hf, hl = fresh(*((library, str(tmp_path / name), SWEEP[field]) for name, library in _LIBRARIES.items()))
    assert len({hf["pid"], hl["pid"], os.getpid()}) == 3  # each side in its own process
    ours, theirs = _observed(hl), _observed(hf)
    assert [sorted(e) for e in ours[0]] == [sorted(e) for e in theirs[0]]
    assert list(ours[4]) == list(theirs[4])  # the same files
    assert ours == theirs  # bit for bit: logs, metrics, predictions, the files' contents
    # the setting acts, or the field is listed as not observable in this setting (with the reason)
    assert (ours == default_run) == (field in NOT_OBSERVABLE), ours == default_run


def test_every_field_is_swept_or_listed():
    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    listed = set(SWEEP) | set(TESTED_ELSEWHERE) | set(NOT_RUNNABLE)
    assert sorted(fields - listed) == []
    assert not (set(SWEEP) & set(NOT_RUNNABLE)) and not (set(TESTED_ELSEWHERE) & set(NOT_RUNNABLE))
    assert set(NOT_OBSERVABLE) <= set(SWEEP) and all(NOT_OBSERVABLE.values())


def _guide(marker: str) -> str:
    guide = (Path(__file__).resolve().parents[1] / "docs" / "coming-from-transformers.md").read_text()
    return guide.split(f"<!-- {marker} -->")[1].split(f"<!-- /{marker} -->")[0]


@pytest.mark.parametrize(
    "marker, table", [("not-runnable-fields", NOT_RUNNABLE), ("not-observable-fields", NOT_OBSERVABLE)]
)
def test_the_guide_lists_the_fields_not_run_or_not_observable_here(marker, table):
    """docs/coming-from-transformers.md's tables of fields not run here and of fields that show nothing in the sweep's
    setting are the test's NOT_RUNNABLE and NOT_OBSERVABLE, reasons included."""
    rows = [line.split(" | ", 1) for line in _guide(marker).strip().splitlines()[2:]]
    assert {name.strip("| `"): why.rstrip(" |") for name, why in rows} == table


def test_the_guide_counts_the_fields_as_this_test_does():
    """The guide's counts: all fields, compared (swept and observable), not observable, tested elsewhere, not run."""
    import re

    said = re.findall(r"\b(\d+) (?:fields|are compared|more run|have a comparison|could)", _guide("field-counts"))
    fields = len(dataclasses.fields(transformers.TrainingArguments))
    compared = len(SWEEP) - len(NOT_OBSERVABLE)
    assert [int(n) for n in said] == [fields, compared, len(NOT_OBSERVABLE), len(TESTED_ELSEWHERE), len(NOT_RUNNABLE)]
