"""``checkpoint-N`` folders: HF-loadable model files plus everything needed to continue exactly, written so that a
checkpoint is complete or does not exist, and removed so that no reader ever sees one half-deleted.

Writing (:func:`save_checkpoint`): every file goes into ``.tmp-checkpoint-N``; ``checkpoint_manifest.json`` (each
file with its size and checksum, and the arguments that fix the data position; see ``hflight.checkpoints.manifest``) is
written last; then the folder is renamed to ``checkpoint-N``. Re-saving an existing ``checkpoint-N`` moves the old
folder aside (``.tmp-checkpoint-N.replaced``), renames the new one in and only then deletes the old one. Removing a
checkpoint (rotation, the end of training) renames it aside (``.tmp-checkpoint-N.deleting``) before deleting
anything in it. A process killed at any point therefore leaves ``checkpoint-N`` either complete (old or new) or
absent, never partial; leftover ``.tmp-checkpoint-*`` folders are removed when the next training starts
(:func:`remove_stale_folders`). A write that fails (full disk, permissions, I/O) raises one
:class:`CheckpointWriteError` naming the folder, the file and the cause, and leaves the earlier checkpoints as they
were.

The write of one checkpoint is a job (``hflight.checkpoints.job``): :func:`save_checkpoint` takes every decision
on the training loop's thread, writes each process's part through the job's steps, and hands the job to the run's
writer (``hflight.checkpoints.asynchronous``), which finishes it now or in the background.

Reading is ``hflight.checkpoints.manifest``'s (:func:`verify_checkpoint`, :func:`get_last_checkpoint`, re-exported
here).

Folder contents: the parts in ``hflight.checkpoints.parts`` (transformers' names, so folders written by either
trainer resume in both; every name in ``hflight.checkpoints.names``), and ``checkpoint_manifest.json`` (hflight's
own).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import SaveStrategy
from transformers.utils import logging as hf_logging

from hflight import durable
from hflight._util import sharded_at_load
from hflight.checkpoints.forms import NotGathered, ProcessZeroState, background_refusal
from hflight.checkpoints.job import CheckpointJob, CheckpointWriteError, write_error
from hflight.checkpoints.manifest import (
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    get_last_checkpoint,
    read_manifest,
    verify_checkpoint,
    write_manifest,
)
from hflight.checkpoints.names import (
    CHECKPOINT_RE,
    MANIFEST_NAME,
    PREFIX,
    TMP_PREFIX,
    TRAINER_STATE_NAME,
    WEIGHT_FILES,
)
from hflight.checkpoints.parts import write_trainer_state, write_training_states
from hflight.checkpoints.storage import storage_for
from hflight.checkpoints.storage.local import remove_checkpoint
from hflight.checkpoints.storage.peers import Peers
from hflight.checkpoints.weights import deepspeed_left_alone, saves_off_rank_zero
from hflight.checkpoints.writers.files import IncompleteCheckpointError
from hflight.surface import RunView, TrainerSurface

logger = logging.getLogger(__name__)
_hf_logger = hf_logging.get_logger("transformers.trainer")  # transformers' own console line, as its Trainer writes it

__all__ = [
    "CHECKPOINT_RE", "MANIFEST_FORMAT", "MANIFEST_NAME", "MANIFEST_VERSION", "PREFIX", "TMP_PREFIX",
    "TRAINER_STATE_NAME", "WEIGHT_FILES", "CheckpointWriteError", "IncompleteCheckpointError", "get_last_checkpoint",
    "read_manifest", "remove_checkpoint", "save_checkpoint", "verify_checkpoint", "write_manifest",
]  # fmt: skip

# The arguments that decide which examples a resumed run sees next and how global steps map onto batches.
RUN_ARGUMENTS = (
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "world_size",
    "num_nodes",
    "seed",
    "data_seed",
    "train_sampling_strategy",
    "dataloader_drop_last",
    "num_examples",
)


# ---- removing ------------------------------------------------------------------------------------------------------
def _saving_checkpoint(folder: str) -> None:
    _hf_logger.info(f"Saving model checkpoint to {folder}")


def remove_stale_folders(output_dir: str | os.PathLike, keep: str | None = None) -> list[str]:
    """Delete the ``.tmp-checkpoint-*`` folders an interrupted save or deletion left in ``output_dir`` (except
    ``keep``), and beside an unfinished ``.tmp-checkpoint-N`` the ``checkpoint-N`` a ``save_async`` write had made for
    what is written after the save (:func:`_unpublished_folder`)."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return []
    removed = []
    keep_path = Path(keep).resolve() if keep else None
    for path in sorted(folder.glob(f"{TMP_PREFIX}{PREFIX}-*")):
        if path.is_dir() and path.resolve() != keep_path:
            shutil.rmtree(path, ignore_errors=True)
            logger.warning(f"Removed {path}: left behind by a checkpoint save or deletion that was interrupted.")
            removed.append(str(path))
            unpublished = _unpublished_folder(path)
            if unpublished is not None and unpublished.resolve() != keep_path:
                remove_checkpoint(unpublished)
                logger.warning(f"Removed {unpublished}: made for a checkpoint whose write was interrupted; it holds no "
                               f"checkpoint (no {MANIFEST_NAME}, no {TRAINER_STATE_NAME}).")  # fmt: skip
                removed.append(str(unpublished))
    return removed


def _unpublished_folder(tmp: Path) -> Path | None:
    """Beside ``tmp`` (``.tmp-checkpoint-N``, an unfinished save), the ``checkpoint-N`` that is not a checkpoint (no
    manifest, no ``trainer_state.json``): ``save_async`` makes it when the save returns, for what a ``_save_checkpoint``
    override or an ``on_save`` callback writes into it, and publishes the checkpoint in its place."""
    if not tmp.name.startswith(TMP_PREFIX) or not CHECKPOINT_RE.match(tmp.name[len(TMP_PREFIX) :]):
        return None
    final = tmp.with_name(tmp.name[len(TMP_PREFIX) :])
    if not final.is_dir() or final.is_symlink():
        return None
    return None if any(os.path.lexists(final / name) for name in (MANIFEST_NAME, TRAINER_STATE_NAME)) else final


def clean_output_dir(args: Any, resume_folder: str | None) -> None:
    """On the processes that write checkpoints (``args.should_save``), when training starts: delete the
    ``.tmp-checkpoint-*`` folders interrupted saves left (not ``resume_folder``, the checkpoint being resumed)."""
    if args.should_save:
        remove_stale_folders(args.output_dir, keep=resume_folder)


# ---- the storage --------------------------------------------------------------------------------------------------
def probe_storage(args: Any) -> None:
    """When training starts, on the processes that write checkpoints: an object store that cannot take them is an
    error naming its URL and the cause, before anything is trained (``hflight.checkpoints.storage``)."""
    if args.should_save:
        storage_for(args).probe()


def settle_storage(args: Any) -> list[str]:
    """When training ends: what could not be stored yet is tried again; returns what is still only local (the other
    processes of a job: their own files' uploads finished)."""
    if not args.should_save:
        storage_for(args).wait()
        return []
    return storage_for(args).settle()


@contextlib.contextmanager
def storing(args: Any) -> Iterator[None]:
    """A ``train()``: :func:`probe_storage` when it starts (an object store that cannot take checkpoints is an error
    before anything is read or trained), :func:`settle_storage` when it returns. A ``train()`` that fails lets the
    uploads in flight finish first (at most :data:`FAILED_RUN_UPLOAD_S`), on every process, while the process can still
    open connections: the checkpoint saved before the failure is in the store, as its local copy is on disk."""
    probe_storage(args)
    try:
        yield
    except Exception:
        storage_for(args).wait(FAILED_RUN_UPLOAD_S)
        raise
    settle_storage(args)


#: how long a failed ``train()`` waits for the uploads in flight before it raises
FAILED_RUN_UPLOAD_S = 120.0


# ---- write errors --------------------------------------------------------------------------------------------------
#: set while the training loop's thread writes a checkpoint: ``save_model`` called by it (or by an override of it)
#: leaves its failures to the checkpoint's step that called it, and its fsyncs to the checkpoint's publication
_WRITING_CHECKPOINT: contextvars.ContextVar[bool] = contextvars.ContextVar("hflight_writing_checkpoint", default=False)


@contextlib.contextmanager
def writing(folder: str, what: str, discard: bool, file: str | None = None) -> Iterator[None]:
    """Turn a failed write into ``folder`` into one :class:`CheckpointWriteError` naming ``what`` (the checkpoint or
    model being saved), the file (``file``, else found from the error or the folder) and the cause; ``discard``:
    delete the unfinished ``folder`` first (``hflight.checkpoints.job.write_error``)."""
    try:
        yield
    except Exception as exc:
        error = write_error(exc, folder, what, file, discard)
        if error is None:
            raise
        raise error from exc


# ---- writing -------------------------------------------------------------------------------------------------------


def save_model(facade: TrainerSurface, output_dir: str, backend: Any) -> None:
    """``Trainer.save_model`` (every process calls it, as in transformers): the host weights made current
    (``backend``: the strategy's hooks; a checkpoint's write, which calls this, made them current before it began),
    a sharded model's whole state dict gathered (collective), then, on the main process, the model files and the
    backend's own files, on disk before it returns (a failed write raises :class:`CheckpointWriteError`; inside a
    checkpoint's write the checkpoint reports it, and its publication makes the files durable)."""
    outer = not _WRITING_CHECKPOINT.get()
    if outer:
        backend.hf_sync_to_host()
    if sharded_at_load(facade.model):
        # transformers' save_pretrained gathers the shards of a model it sharded at load time (tensor parallelism)
        # itself, on every process: each process calls it, the main one writes
        if not facade.args.should_save:
            facade._save(output_dir)
            return
        state_dict = None
    else:
        form = backend.hf_checkpoint_state()
        try:
            state_dict = form.full_model_state(facade.model)
        except NotGathered as not_gathered:  # transformers' way: the run's own checkpoint form, and no weights file
            _hf_logger.warning(str(not_gathered))
            _save_without_weights(facade, form, output_dir, outer)
            return
    if facade.args.should_save:
        _saving_checkpoint(output_dir)
        with _model_writes(output_dir, outer), stored_writes(facade.args, output_dir, outer), \
                durable_writes(output_dir, outer), deepspeed_left_alone():  # fmt: skip
            if state_dict is None:
                facade._save(output_dir)
            else:
                facade._save(output_dir, state_dict=state_dict)
            backend.hf_save_files(output_dir)


def _model_writes(output_dir: str, outer: bool) -> contextlib.AbstractContextManager[None]:
    """``save_model``'s failures as one :class:`CheckpointWriteError` (inside a checkpoint's write: as they are, for
    the checkpoint to report)."""
    return writing(output_dir, f"the model in {output_dir}", discard=False) if outer else contextlib.nullcontext()


@contextlib.contextmanager
def durable_writes(folder: str, enabled: bool = True) -> Iterator[None]:
    """The files written into ``folder`` (directly) during the block are on disk when it ends, with ``folder``'s
    entries (``hflight.durable``): ``save_model``, ``save_metrics``, ``save_state``."""
    if not enabled:
        yield
        return
    before = durable.stamps(folder)
    yield
    durable.sync_new_files(folder, before)


@contextlib.contextmanager
def stored_writes(args: Any, folder: str, enabled: bool = True) -> Iterator[None]:
    """The files written into ``folder`` (directly) during the block are stored when it ends, where the run's
    storage is an object store (``hflight.checkpoints.storage``; a file outside its staging folder stays local):
    ``save_model``, ``save_metrics``, ``save_state``."""
    storage = storage_for(args)
    if not enabled or not storage.remote:
        yield
        return
    before = durable.stamps(folder) or {}
    yield
    changed = [path for path, stamp in (durable.stamps(folder) or {}).items() if before.get(path) != stamp]
    if changed:
        storage.put_files(folder, changed)


def on_disk_when_returned(write: Callable[..., Any]) -> Callable[..., Any]:
    """transformers' ``save_metrics``/``save_state`` (``write(trainer, ...)``), whose files are durable
    (:func:`durable_writes` of ``trainer.args.output_dir`` on the process that writes them) and stored
    (:func:`stored_writes`) when it returns."""

    @functools.wraps(write)
    def written(trainer: Any, *args: Any, **kwargs: Any) -> Any:
        main, folder = trainer.is_world_process_zero(), trainer.args.output_dir
        with stored_writes(trainer.args, folder, main), durable_writes(folder, main):
            return write(trainer, *args, **kwargs)

    return written


def _save_without_weights(facade: TrainerSurface, form: Any, output_dir: str, outer: bool) -> None:
    """``save_model`` of a run whose weights are not gathered: the config, processing class and arguments, and the
    run's checkpoint form (every process writes its partition) with its script to rebuild the weights (inside a
    checkpoint's write, ``outer`` False, the checkpoint writes its form itself: transformers writes it twice)."""
    with durable_writes(output_dir, outer and facade.args.should_save):
        if facade.args.should_save:
            with _model_writes(output_dir, outer), deepspeed_left_alone():
                facade._save(output_dir, state_dict={})
                for name in WEIGHT_FILES:  # the empty weights file save_pretrained wrote
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(os.path.join(output_dir, name))
        if outer:
            written = form.write(output_dir, facade.model, facade.optimizer, facade.args.should_save)
            for name in written:
                durable.sync_tree(os.path.join(output_dir, name))


def run_arguments(args: Any, world_size: int, plan: Any, num_nodes: int | None = None) -> dict[str, Any]:
    """The values of :data:`RUN_ARGUMENTS` for the running ``train()`` (recorded in the manifest); ``plan`` is the
    run's ``TrainingPlan`` (None before the fit planned it); ``num_nodes``: the nodes the run spans (the arguments'
    when not given)."""
    values = {name: getattr(args, name, None) for name in RUN_ARGUMENTS}
    strategy = args.train_sampling_strategy
    values["train_sampling_strategy"] = str(getattr(strategy, "value", strategy))
    values["world_size"] = world_size
    values["num_nodes"] = num_nodes if num_nodes is not None else getattr(args, "num_nodes", 1)
    values["num_examples"] = plan.num_examples if plan is not None else None
    return values


def save_checkpoint(facade: TrainerSurface, run: RunView, trial: Any = None) -> str:
    """Write ``checkpoint-{global_step}`` into ``facade._get_output_dir(trial)`` and publish it durably, update the
    best checkpoint, rotate old ones (after the new one is durable). The model files are ``facade.save_model``'s, as
    in transformers. Every decision is taken here, on the training loop's thread, into the checkpoint's job
    (``hflight.checkpoints.job``); with ``save_async`` (``run.checkpoint_writer``) the tensors are copied at the step
    boundary and the tensor files, the manifest, the publication and the rotation happen in the background
    (``hflight.checkpoints.asynchronous``); the folder returned then appears when that write is done.

    Raises:
        CheckpointWriteError: a write failed (full disk, permissions, I/O); the unfinished folder is removed and the
            earlier checkpoints are as they were. With ``save_async`` a background failure is raised at the next step
            boundary, checkpoint or the end of ``fit``, on every process.
    """
    args, state, world, writer = facade.args, facade.state, run.world, run.checkpoint_writer
    writer.wait()  # at most one write in flight; a failed one stops the run here
    facade.store_flos()
    run_dir = facade._get_output_dir(trial)
    name = f"{PREFIX}-{state.global_step}"
    final_dir = os.path.join(run_dir, name)
    tmp_dir = os.path.join(run_dir, f"{TMP_PREFIX}{name}")
    is_main = args.should_save  # the main process; with save_on_each_node, the main process of each node
    if is_main:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    if writer.asynchronous:  # a strategy object given directly (the arguments refuse theirs)
        nodes = run.lightning_trainer.num_nodes if args.save_on_each_node else 1
        refusal = background_refusal(run.backend.hf_checkpoint_state(), nodes)
        if refusal is not None:
            raise ValueError(refusal)
    run.backend.hf_sync_to_host()
    # training ends after this checkpoint (every process sees the same): save_async writes it without a copy
    last = state.global_step >= state.max_steps or facade.control.should_training_stop
    job = writer.job(tmp_dir, final_dir, main=is_main, last=last, on_save_follows=_fit_running(run),
                     to_come=_checkpoints_to_come(args, state))  # fmt: skip
    try:
        progress = _write_files(facade, run, job, run_dir)
    except BaseException:
        job.abandon()
        raise
    # the processes' uploads of this checkpoint (an object store): each its own files, process 0 the manifest last
    storage, background = storage_for(args), writer.asynchronous and not last
    round = storage.round()
    peers = Peers.of(world.rank, world.size) if round is not None else None
    if is_main:
        run_args = run_arguments(args, world.size, run.plan, run.lightning_trainer.num_nodes)
        job.publish_with((state.global_step, bool(args.save_only_model), run_args, progress),
                         functools.partial(storage.store, final_dir, run_dir, args.save_total_limit,
                                           state.best_model_checkpoint, background, peers, round),
                         lambda failed: storage.release(peers, round, f"{type(failed).__name__}: {failed}"),
                         )  # fmt: skip
    if is_main and _overrides_save_checkpoint(facade):  # it writes into checkpoint-N after super(), as TRL's do
        job.open_final_dir()
    if not is_main and peers is not None:  # waits for process 0's word on a thread: the writer's wait below may be a
        storage.store_part(final_dir, peers, round)  # collective that process 0 reaches after it
    writer.submit(job if is_main else None, name, last=last)
    if not is_main and peers is not None and not background:
        storage.wait()  # this process's files are stored before training goes on, as process 0's are
    if args.push_to_hub:  # the push reads the published folder
        writer.wait()
    world.barrier()
    return final_dir


def _overrides_save_checkpoint(facade: TrainerSurface) -> bool:
    """Whether the trainer's ``_save_checkpoint`` is not hflight's own: a subclass's (TRL's trainers', a script's),
    which may write into ``checkpoint-N`` once ``super()._save_checkpoint`` returns."""
    method = getattr(facade, "_save_checkpoint", None)
    return not getattr(getattr(method, "__func__", method), "__module__", "").startswith("hflight.")


def prepare_staging(facade: TrainerSurface, run: RunView) -> None:
    """``save_async``, once the run's state exists (its first optimizer step): the staging area made before the first
    checkpoint (``CheckpointWriter.prepare``), for the model's and optimizer's tensors, where the state is the
    process's own (a sharded or engine-held state is laid out by its first checkpoint)."""
    writer, args = run.checkpoint_writer, facade.args
    if not writer.asynchronous or args.save_strategy == "no" or not args.should_save:
        return
    if not isinstance(run.backend.hf_checkpoint_state(), ProcessZeroState):
        return
    to_come = _checkpoints_to_come(args, facade.state)
    tensors = [*facade.model.state_dict().values()]
    optimizer = facade.optimizer
    if optimizer is not None:
        tensors += [value for entry in optimizer.state.values() for value in entry.values()]
    writer.prepare(tensors, to_come)


def _checkpoints_to_come(args: Any, state: Any) -> int | None:
    """How many checkpoints the run saves after this one at ``save_steps`` before its last step (whose checkpoint,
    ending training, is written from the state itself); None where that is not known ahead (an epoch or best-metric
    strategy, a callback's ``should_save``)."""
    if args.save_strategy != "steps" or not state.save_steps or not state.max_steps:
        return None
    return max((state.max_steps - 1) // state.save_steps - state.global_step // state.save_steps, 0)


def _fit_running(run: RunView) -> bool:
    """Whether the run's ``fit`` is running (its loop dispatches ``on_save`` after a checkpoint, and waits for the
    write in flight at its end); not a checkpoint saved after ``train()`` returned."""
    from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus

    state = run.lightning_trainer.state
    return run.fitting and state.fn == TrainerFn.FITTING and state.status == TrainerStatus.RUNNING


def _write_files(facade: TrainerSurface, run: RunView, job: CheckpointJob, run_dir: str) -> dict[str, Any] | None:
    """A checkpoint's files into the job's folder, each a step of the job (every process: its own part; the tensor
    files of ``save_async`` are snapshotted for later), and the best checkpoint updated; returns the loop's
    bookkeeping for the manifest."""
    args, state, world, is_main = facade.args, facade.state, run.world, facade.args.should_save
    writing_checkpoint = _WRITING_CHECKPOINT.set(True)
    try:
        with final_path_in_logs(job.folder, job.final_dir):
            if is_main:
                job.write(None, lambda: os.makedirs(job.folder, exist_ok=True))
            world.barrier()  # the folder exists for every process
            if not args.save_only_model:
                # The largest file first: its checksum is computed (in the background) while the model is written.
                until = _optimizer_alone_changes_its_state(facade, run) if job.background else None
                write_training_states(facade, run, job, is_main, until=until)
            if args.save_only_model or run.backend.hf_checkpoint_state().with_model_files:
                # every process: sharded models gather (save_only_model: the whole model in place of a form's shards,
                # as transformers writes a tensor-parallel model's checkpoints)
                _write_model_files(facade, run, job, is_main)
            _update_best_checkpoint(args, state, run_dir)
            progress = run.loop.progress() if run.loop is not None else None  # every rank: their running losses
            world.barrier()
            if is_main:
                job.write(TRAINER_STATE_NAME, lambda: write_trainer_state(facade, job.folder))
            run.checkpoint_writer.snapshot_done()
            # Every writer's folder is complete before any is published (save_on_each_node: one writer per node, each
            # on its own disk): a writer whose peer died mid-write fails here instead of publishing a checkpoint the
            # other nodes lack, so the nodes' last checkpoints agree.
            world.barrier()
    finally:
        _WRITING_CHECKPOINT.reset(writing_checkpoint)
    return progress


#: the events a callback may override and still have the optimizer's copy made beside the next step: those that never
#: come between a checkpoint and the next step (an epoch's end, its evaluation and its logs, the end of training may)
_BEFORE_ANY_CHECKPOINT = ("on_init_end", "on_train_begin")
#: whose callbacks and trainer methods are known to leave the optimizer's state alone
_KNOWN = ("hflight.", "transformers.", "lightning.")


def _optimizer_alone_changes_its_state(facade: TrainerSurface, run: RunView) -> Any:
    """With ``save_async``: the run's optimizer where nothing but a torch optimizer's ``step()`` can change its state
    before the next step (its copy is then made beside that step's forward and backward, and the step waits for it:
    ``CheckpointWriter.snapshot(until=)``); None where something else might, and the copy is made now, as before:

    - the state is one process's own torch optimizer, stepped through torch's ``Optimizer.step`` (whose pre-hooks
      run): not a sharded form's, nor one whose step runs elsewhere (the IPU's replaces it);
    - every callback whose events may come between a checkpoint and the next step (``on_save``, ``on_step_begin``,
      an epoch's ``on_epoch_end``, ``on_evaluate`` and ``on_log``, ``on_train_end``, ...: all but ``on_init_end`` and
      ``on_train_begin``) and every class of the trainer are transformers', Lightning's or hflight's: a user's
      callback, or a subclass's ``training_step``, ``compute_loss``, ``evaluate``, ``log``, ..., may change the state
      in place (a reset of the moments at an epoch's end), and is not second-guessed.

    Only the state's per-parameter entries are copied beside the step; its ``param_groups`` are copied at the boundary
    (a scheduler stepping on a metric may fill a learning rate held as a tensor after an evaluation)."""
    optimizer = facade.optimizer
    if not isinstance(run.backend.hf_checkpoint_state(), ProcessZeroState) or not _steps_with_hooks(optimizer):
        return None
    for callback in facade.callback_handler.callbacks:
        if _foreign(type(callback)) and _overrides_events_after_a_checkpoint(callback):
            return None
    if any(_foreign(type(callback)) for callback in run.lightning_trainer.callbacks):
        return None
    if any(_foreign(kind) for kind in type(facade).__mro__ if kind is not object):
        return None
    return optimizer


def _steps_with_hooks(optimizer: Any) -> bool:
    """Whether ``optimizer.step()`` runs torch's hooked ``Optimizer.step`` of its class (its pre-hooks run first):
    the class's own, or torch's LR schedulers' wrapper of it (which notes the call and calls it); not a step the
    instance was given in its place (the IPU's, which runs on the device)."""
    import torch

    if not isinstance(optimizer, torch.optim.Optimizer):
        return False
    hooked = type(optimizer).step
    if not getattr(hooked, "hooked", False):
        return False
    own = vars(optimizer).get("step")
    return own is None or (getattr(own, "_wrapped_by_lr_sched", False) and getattr(own, "__wrapped__", None) is hooked)


def _foreign(kind: type) -> bool:
    return not kind.__module__.startswith(_KNOWN)


def _overrides_events_after_a_checkpoint(callback: Any) -> bool:
    """Whether ``callback`` overrides an event of ``TrainerCallback`` other than :data:`_BEFORE_ANY_CHECKPOINT`."""
    from transformers import TrainerCallback

    events = [name for name in vars(TrainerCallback) if name.startswith("on_") and name not in _BEFORE_ANY_CHECKPOINT]
    return any(getattr(type(callback), name, None) is not getattr(TrainerCallback, name) for name in events)


class _FinalPathInLogs(logging.Filter):
    def __init__(self, tmp_dir: str, final_dir: str) -> None:
        super().__init__()
        self.tmp_dir, self.final_dir = tmp_dir, final_dir

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if self.tmp_dir in message:
            record.msg, record.args = message.replace(self.tmp_dir, self.final_dir), ()
        return True


@contextlib.contextmanager
def final_path_in_logs(tmp_dir: str, final_dir: str) -> Iterator[None]:
    """While a checkpoint is written into its temporary folder, the messages of transformers' and hflight's loggers
    ("Model weights saved in ...", "Configuration saved in ...") name the folder the checkpoint will have, as
    transformers' (which writes in place) do."""
    rewrite = _FinalPathInLogs(tmp_dir, final_dir)
    loggers = [
        found
        for name, found in list(logging.root.manager.loggerDict.items())
        if isinstance(found, logging.Logger) and name.split(".")[0] in ("transformers", "hflight")
    ]
    for each in loggers:
        each.addFilter(rewrite)
    try:
        yield
    finally:
        for each in loggers:
            each.removeFilter(rewrite)


def _update_best_checkpoint(args: Any, state: TrainerState, run_dir: str) -> None:
    if args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) and state.best_global_step:
        best_dir = os.path.join(run_dir, f"{PREFIX}-{state.best_global_step}")
        if state.best_global_step == state.global_step or os.path.exists(best_dir):
            state.best_model_checkpoint = best_dir


def _write_model_files(facade: TrainerSurface, run: RunView, job: CheckpointJob, is_main: bool) -> None:
    """The model (with the weights evaluation uses) and the backend's files, through ``save_model`` (every process:
    it gathers a sharded model, the main process writes), and the weight-protocol callbacks' files (main process;
    the host weights are current). With ``save_async`` the weights are snapshotted and written by ``_save`` in the
    background, unless a subclass overrides ``save_model`` (its override is called, synchronously) or the process that
    writes is not global rank 0 (transformers' ``save_pretrained`` is then told so, on this thread)."""
    if job.background and _stock_save_model(facade) and not saves_off_rank_zero():
        _defer_model_files(facade, run, job, is_main)
    else:
        with run.evaluation_weights():
            job.write(None, lambda: facade.save_model(job.folder, _internal_call=True))  # the backend's files too
    if is_main:
        for callback in run.weight_hooks("save_checkpoint_state"):
            job.write(None, lambda callback=callback: callback.save_checkpoint_state(job.folder, facade.model))


def _stock_save_model(facade: TrainerSurface) -> bool:
    """Whether ``save_model`` is hflight's own (not a user's override, which must be called as it is)."""
    return getattr(type(facade).save_model, "__module__", "").startswith("hflight.")


def _defer_model_files(facade: TrainerSurface, run: RunView, job: CheckpointJob, is_main: bool) -> None:
    """``save_model``'s files with ``save_async``: the whole state dict (gathered from the shards, collective)
    copied now, written by ``facade._save`` in the background; the backend's files now."""
    backend = run.backend
    # the weights evaluation uses (an EMA's averages) are swapped in for the save and out after it, before the job
    # writes them: the model's state is then copied for every checkpoint, the run's last included
    swapped = bool(run.weight_hooks("averaged_weights"))
    with run.evaluation_weights():
        state_dict = backend.hf_checkpoint_state().full_model_state(facade.model)
        if not is_main:
            return
        state = facade.model.state_dict() if state_dict is None else state_dict
        snapshot = job.snapshot("model", state, transient=swapped)
    _saving_checkpoint(job.folder)
    job.write(None, lambda: backend.hf_save_files(job.folder))
    job.later(None, lambda: facade._save(job.folder, state_dict=snapshot))


# ---- best model -------------------------------------------------------------------------------------------------


def finalize_rotation(args: Any, state: TrainerState, run_dir: str) -> None:
    """With ``save_total_limit=1`` and a best checkpoint, HF keeps only the best one of ``run_dir`` at the end (main
    process)."""
    if not (args.should_save and state.best_model_checkpoint and args.save_total_limit == 1):
        return
    storage = storage_for(args)
    storage.wait()
    for name in storage.complete(run_dir) if storage.remote else []:
        if name != os.path.basename(state.best_model_checkpoint):
            storage.remove(os.path.join(run_dir, name))
    for folder in Path(run_dir).glob(f"{PREFIX}-*"):
        if folder.is_dir() and not os.path.samefile(folder, state.best_model_checkpoint):
            remove_checkpoint(folder)
