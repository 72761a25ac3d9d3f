"""The backends of ``Trainer.hyperparameter_search``, one class each, looked up by transformers' ``HPSearchBackend``.

Each says what transformers' ``Trainer`` does with its trials: how a search runs, the default search space, the
hyperparameters a trial sets, the id of its ``run-{id}`` folder, and what an evaluation during the trial reports.

- **optuna** runs on hflight's own driver, which returns what transformers' ``run_hp_search_optuna`` returns and
  spans several processes as it does: under a launcher (torchrun, srun) the processes are connected before the
  first trial (:func:`connect`, the group Lightning then keeps), rank 0 runs the study and samples each trial, every
  rank trains it (the others get an ``optuna.trial.FixedTrial`` of its values, as in transformers) and only rank 0
  returns the ``BestRun`` (the others ``None``). Unlike transformers' driver, whose other ranks loop ``n_trials``
  times, rank 0 also sends the end of the study (a ``timeout`` ends it early) and its pruner's decision, so that a
  pruned trial stops on every rank, not on rank 0 alone (which would leave the others training into the next
  trial's collectives).

  **A trial that fails on one rank fails on every rank** (:meth:`Processes.trial`). The rank that raised records
  its error in the process group's store (which outlives the group), logs it (rank 0's study logs rank 0's), lets
  the failed run go and destroys its process group (:func:`_let_go`: gloo closes its connections only then; the error
  keeps its traceback's text as a note): a rank waiting for it in a collective (the step boundary's, a gradient
  all-reduce, an evaluation's gather, the next trial's values) leaves training with a connection error at once,
  instead of after the group's time-out (30 minutes). Then every rank records its outcome in the store and reads
  every other's before the next trial: if any rank failed, each connects a new process group (on the same store) for
  what follows, and the first error recorded is the trial's. The rank that raised it raises it again; every other
  rank raises :class:`TrialFailedOnAnotherRank`, which names that rank and error. When the search's ``catch`` names
  the error's type (on the rank that raised it), the trial fails and the search goes on, on every rank: rank 0's
  study records it as failed (``TrialState.FAIL``, as optuna does in one process; another rank's error arrives there
  as :class:`CaughtOnAnotherRank`, which hflight adds to optuna's ``catch``) and the other ranks take the next trial.
  Otherwise the search stops on every rank with that error (so does a failure of rank 0's study outside a trial: its
  sampler, its storage), and the processes stay connected for the rest of the script; a script that does not catch
  it ends on every rank, and the launcher exits non-zero. Ranks that cannot agree (their store unreachable) stop the
  search with that error on each rank, ``catch`` or not. Only errors (``Exception``) are agreed on: a
  ``KeyboardInterrupt`` or ``SystemExit`` ends its process, and the launcher the job. Run with gloo, on the CPU; NCCL
  was not run (whether a rank waiting in an NCCL collective leaves it before the group's time-out is untested).
- **ray** and **wandb** run transformers' own drivers (``run_hp_search_ray``, ``run_hp_search_wandb``: the same
  keyword arguments, defaults and results), which call back into the facade's ``_hp_search_setup``,
  ``_report_to_hp_search``, ``_tune_save_checkpoint`` and ``_get_output_dir`` as transformers' ``Trainer`` does.
  Neither spans a launcher's processes (Ray Tune trains each trial in a worker process of its own, a W&B agent in the
  process that calls it), so under a launcher they are refused.
"""

from __future__ import annotations

import gc
import itertools
import json
import logging
import tempfile
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import lightning as L
from transformers.hyperparameter_search import ALL_HYPERPARAMETER_SEARCH_BACKENDS
from transformers.trainer_utils import BestRun, HPSearchBackend

from hflight.arguments import cluster, process_group
from hflight.arguments.lightning_kwargs import lightning_trainer_kwargs, quiet_lightning
from hflight.run.events import dispatch
from hflight.run.launch_check import check_spans_launch
from hflight.trainer.memory import release_memory

if TYPE_CHECKING:
    from hflight.surface import TrainerSurface

logger = logging.getLogger(__name__)
T = TypeVar("T")


class SearchBackend:
    """One backend: transformers' backend class of the same name says whether it is installed."""

    name: ClassVar[HPSearchBackend]
    #: hflight's extra that installs the backend
    extra: ClassVar[str]

    def available(self) -> bool:
        return ALL_HYPERPARAMETER_SEARCH_BACKENDS[self.name].is_available()

    def ensure_available(self) -> None:
        if not self.available():
            raise RuntimeError(
                f"hyperparameter_search(backend={self.name.value!r}) needs {self.name.value}, which is not "
                f"installed: pip install 'hflight[{self.extra}]'"
            )

    def run(self, trainer: TrainerSurface, n_trials: int, direction: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def default_hp_space(self, trial: Any) -> dict[str, Any]:
        raise NotImplementedError

    def params(self, trainer: TrainerSurface, trial: Any) -> dict[str, Any]:
        """The hyperparameters ``trial`` sets on the ``TrainingArguments``."""
        raise NotImplementedError

    def run_id(self, trial: Any) -> Any:
        """The id of the trial's folder (``output_dir/run-{id}``, unless ``hp_name`` names it)."""
        raise NotImplementedError

    def report(self, trainer: TrainerSurface, trial: Any, step: int, metrics: dict[str, Any]) -> None:
        """After an evaluation during the trial (``trainer.objective`` holds its objective)."""


# ---- optuna ------------------------------------------------------------------------------------------------------
class OptunaBackend(SearchBackend):
    name = HPSearchBackend.OPTUNA
    extra = "optuna"

    def run(self, trainer: TrainerSurface, n_trials: int, direction: Any, **kwargs: Any) -> Any:
        import optuna

        settings = {key: kwargs.pop(key) for key in ("timeout", "n_jobs", "gc_after_trial", "catch") if key in kwargs}
        caught = tuple(settings.get("catch", ()))
        processes = connect(trainer, caught)
        if processes.size > 1 and settings.get("n_jobs", 1) != 1:
            raise ValueError(
                f"hyperparameter_search(n_jobs={settings['n_jobs']}) over {processes.size} processes: the processes "
                "train one trial at a time together; leave n_jobs at 1."
            )
        if processes.rank != 0:
            return _follow(trainer, processes, (optuna.TrialPruned, CaughtOnAnotherRank, *caught))
        settings["catch"] = (*caught, CaughtOnAnotherRank) if processes.size > 1 else caught
        directions = list(direction) if isinstance(direction, (list, tuple)) else None
        study = optuna.create_study(direction=None if directions else direction, directions=directions, **kwargs)
        try:
            study.optimize(lambda trial: _objective(trainer, processes, trial), n_trials=n_trials, **settings)
        except Exception as error:
            processes.stop(error)  # the other ranks stop with it, also when it came from outside a trial
            raise
        if processes.broken is not None:  # a trial's outcome could not be agreed on (optuna caught the error)
            raise processes.broken
        processes.trial(lambda: processes.broadcast(None), catchable=False)  # the study is over: the others return
        if len(study.directions) == 1:
            best = study.best_trial
            return BestRun(str(best.number), best.value, best.params)
        return [BestRun(str(best.number), best.values, best.params) for best in study.best_trials]

    def default_hp_space(self, trial: Any) -> dict[str, Any]:
        from transformers.trainer_utils import default_hp_space_optuna

        return default_hp_space_optuna(trial)

    def params(self, trainer: TrainerSurface, trial: Any) -> dict[str, Any]:
        return trainer.hp_space(trial)

    def run_id(self, trial: Any) -> Any:
        return trial.number

    def report(self, trainer: TrainerSurface, trial: Any, step: int, metrics: dict[str, Any]) -> None:
        """Report a single objective to the study (a multi-objective study takes none, as in transformers); prune
        when rank 0's pruner says so, on every rank."""
        import optuna

        prune = False
        if hasattr(trial, "study") and len(trial.study.directions) == 1:  # rank 0's trial; the others' are fixed
            trial.report(trainer.objective, step)
            prune = trial.should_prune()
        if Processes.current().broadcast(prune):
            dispatch(trainer, "on_train_end")
            raise optuna.TrialPruned()


def _objective(trainer: TrainerSurface, processes: Processes, trial: Any) -> Any:
    """Rank 0's trial: sampled here and sent to the other ranks, trained, scored by its last evaluation (or one
    more); then the model is let go, as transformers' driver does."""
    import optuna

    def train() -> Any:
        trainer.objective = None
        if processes.size > 1:
            trainer.hp_space(trial)  # samples the trial's values, which the other ranks train with
            processes.broadcast(optuna.trial.FixedTrial(trial.params, trial.number))
        trainer.train(trial=trial)
        if trainer.objective is None:
            trainer.objective = trainer.compute_objective(trainer.evaluate())
        return trainer.objective

    try:
        objective = processes.trial(train, trial.number)  # its outcome, agreed by every rank before the next trial
    except Exception:
        if processes.broken is not None:  # optuna's catch would go on to the next trial: the study stops here
            trial.study.stop()
        raise
    trainer.model_wrapped = trainer.model = None
    release_memory()
    return objective


def _follow(trainer: TrainerSurface, processes: Processes, caught: tuple[type[BaseException], ...]) -> None:
    """A rank other than 0: train each trial rank 0 sends until it sends the end; ``None``, as in transformers."""

    def train() -> bool:
        if (trial := processes.broadcast(None)) is None:
            return False  # the study's end
        processes.number, trainer.objective = trial.number, None
        trainer.train(trial=trial)
        if trainer.objective is None:
            trainer.objective = trainer.compute_objective(trainer.evaluate())
        return True

    while True:
        try:
            if not processes.trial(train):  # its outcome (or the end's), agreed by every rank before the next trial
                return None
        except caught:  # pruned, or a failure the study catches: on every rank alike, and the search goes on
            if processes.broken is not None:  # the ranks could not agree: the search stops on every rank
                raise


# ---- Ray Tune and W&B sweeps: transformers' drivers ---------------------------------------------------------------
class RayBackend(SearchBackend):
    name = HPSearchBackend.RAY
    extra = "ray"

    def run(self, trainer: TrainerSurface, n_trials: int, direction: Any, **kwargs: Any) -> Any:
        from transformers.integrations import run_hp_search_ray

        one_process("ray", trainer)
        gpus = (kwargs.get("resources_per_trial") or {}).get("gpu", 0)
        if gpus > 1:
            raise ValueError(
                f"hyperparameter_search(backend='ray', resources_per_trial={kwargs['resources_per_trial']}): hflight "
                "trains a Ray trial in the one process Ray starts for it, on one device (transformers would run "
                "torch's DataParallel over the GPUs); give each trial at most 1 GPU."
            )
        if not trainer.args.skip_memory_metrics:
            raise ValueError(
                "hyperparameter_search(backend='ray') with skip_memory_metrics=False: the memory tracker cannot "
                "travel to Ray's trial processes (transformers turns it off there); set skip_memory_metrics=True."
            )
        return run_hp_search_ray(trainer, n_trials, direction, **kwargs)

    def default_hp_space(self, trial: Any) -> dict[str, Any]:
        from transformers.trainer_utils import default_hp_space_ray

        return default_hp_space_ray(trial)

    def params(self, trainer: TrainerSurface, trial: Any) -> dict[str, Any]:
        return {key: value for key, value in trial.items() if key != "wandb"}  # Ray's W&B settings, as transformers

    def run_id(self, trial: Any) -> Any:
        import ray.tune

        return ray.tune.get_context().get_trial_id()

    def report(self, trainer: TrainerSurface, trial: Any, step: int, metrics: dict[str, Any]) -> None:
        """Every evaluation to Ray Tune, with a checkpoint (into the trial's folder) when this step saves one."""
        import ray.tune

        with tempfile.TemporaryDirectory() as folder:
            checkpoint = None
            if trainer.control.should_save:
                trainer._tune_save_checkpoint(checkpoint_dir=folder)
                checkpoint = ray.tune.Checkpoint.from_directory(folder)
            ray.tune.report({**metrics, "objective": trainer.objective}, checkpoint=checkpoint)


class WandbBackend(SearchBackend):
    name = HPSearchBackend.WANDB
    extra = "wandb"
    #: what transformers' driver adds to each sweep run's config beside the hyperparameters
    BOOKKEEPING: ClassVar[frozenset[str]] = frozenset({"assignments", "metric", "_wandb"})

    def run(self, trainer: TrainerSurface, n_trials: int, direction: Any, **kwargs: Any) -> Any:
        from transformers.integrations import run_hp_search_wandb

        one_process("wandb", trainer)
        return run_hp_search_wandb(trainer, n_trials, direction, **kwargs)

    def default_hp_space(self, trial: Any) -> dict[str, Any]:
        from transformers.trainer_utils import default_hp_space_wandb

        return default_hp_space_wandb(trial)

    def params(self, trainer: TrainerSurface, trial: Any) -> dict[str, Any]:
        return {key: value for key, value in trial.items() if key not in self.BOOKKEEPING}

    def run_id(self, trial: Any) -> Any:
        import wandb

        return wandb.run.id


BACKENDS: dict[HPSearchBackend, SearchBackend] = {
    backend.name: backend for backend in (OptunaBackend(), RayBackend(), WandbBackend())
}


def one_process(name: str, trainer: TrainerSurface) -> None:
    if trainer.args.world_size > 1:
        raise ValueError(
            f"hyperparameter_search(backend={name!r}) under a launcher with {trainer.args.world_size} processes: "
            "each process would run a search of its own (hflight spans a launcher's processes with backend='optuna' "
            "only). Start the script as one process (python script.py), or use backend='optuna'."
        )


# ---- the processes of a search ---------------------------------------------------------------------------------
class TrialFailedOnAnotherRank(Exception):
    """A trial of a search under a launcher failed on another rank (the message names it and its error): raised on
    every rank but that one, which raises its own error; the search stops on every rank."""


class CaughtOnAnotherRank(TrialFailedOnAnotherRank):
    """:class:`TrialFailedOnAnotherRank` with an error of a type the search's ``catch`` names: the trial fails and
    the search goes on, on every rank (hflight adds this class to rank 0's ``catch``)."""


#: each multi-process search of this process, numbered alike on every rank (they all run every search): its keys in
#: the store
_SEARCHES = itertools.count()


class Processes:
    """The processes a search spans: ``size``, this one's ``rank``, rank 0's values sent to every rank, and (from
    :func:`connect`, with several) the outcome of each trial agreed by every rank (:meth:`trial`)."""

    def __init__(self, size: int, rank: int, caught: tuple[type[BaseException], ...] = ()) -> None:
        self.size, self.rank = size, rank
        self.caught = caught  # the search's catch: the errors after which the search goes on
        self.store: Any = None  # the process group's store, where the ranks agree: it outlives an aborted group
        self.backend: Any = None
        self.search = 0
        self.iteration = 0  # of the trials and the study's end, counted alike on every rank
        self.number: int | None = None  # the number of the trial in progress, once this rank knows it
        self.agreed: BaseException | None = None  # the error the last agreement raised on this rank
        self.broken: Exception | None = None  # the ranks could not agree: the search stops on every rank

    @classmethod
    def current(cls, caught: tuple[type[BaseException], ...] = ()) -> Processes:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_world_size(), dist.get_rank(), caught)
        return cls(1, 0, caught)

    def agreeing(self) -> Processes:
        """These processes, ready to agree on their trials' outcomes (the current process group's store)."""
        from torch.distributed import distributed_c10d

        self.store, self.backend = distributed_c10d._get_default_store(), distributed_c10d.get_backend()
        self.search = next(_SEARCHES)
        return self

    def trial(self, train: Callable[[], T], number: int | None = None, catchable: bool = True) -> T:
        """``train()``: a trial (``number``: rank 0's; the others set :attr:`number` once they received it), or rank
        0's search outside its trials (``catchable=False``: the study's end, or its failure). Every rank leaves it
        with the same outcome, before the next: an error on this rank is logged and recorded and ends it on every
        rank (see the module docstring).

        Raises:
            RuntimeError: the ranks could not agree on the outcome (:attr:`broken`): the search stops on every rank.
        """
        import optuna

        if self.size == 1:
            return train()
        self.number = number
        failed: Exception | None = None
        try:
            result = train()
        except Exception as error:  # noqa: BLE001 - every rank learns it; raised again below
            failed = error
        # out of the except clause: the traceback is the error's alone, which _fail can let go
        pruned = isinstance(failed, optuna.TrialPruned)  # rank 0's decision, taken by every rank at once
        try:
            failure = None if failed is None or pruned else self._fail(failed, catchable)
            outcomes = self._exchange({"number": self.number, "failure": failure})
        except Exception as error:  # noqa: BLE001 - raised as the search's end, on every rank
            what = "the search" if self.number is None else f"trial {self.number}"
            self.broken = self.agreed = RuntimeError(
                f"Rank {self.rank}: the processes of the search could not agree on the outcome of {what} "
                f"({type(error).__name__}: {error}); the search stops on every rank."
            )
            raise self.broken from failed
        self._settle(outcomes, failed)
        if failed is not None:
            raise failed
        return result

    def stop(self, error: Exception) -> None:
        """Rank 0's search raised ``error``: unless every rank agreed on it already (a trial's), the others stop
        with it."""

        def again() -> None:
            raise error

        if self.size > 1 and error is not self.agreed:
            self.trial(again, catchable=False)

    def _key(self, name: str) -> str:
        return f"hflight/hpsearch/{self.search}/{self.iteration}/{name}"

    def _fail(self, error: Exception, catchable: bool) -> dict[str, Any]:
        """This rank's error: recorded in the store and logged here (a rank that fails after another did, most
        likely for that one's sake, only warns), then the failed run is let go, and the process group with it, so
        that a rank waiting for this one in a collective leaves it (see :func:`_let_go`)."""
        order = self.store.add(self._key("failures"), 1)
        what = "the search" if self.number is None else f"trial {self.number}"
        if order > 1:
            logger.warning(f"Rank {self.rank} left {what} with {type(error).__name__}: {error} (another rank failed)")
        elif self.rank != 0:  # rank 0's study logs its own errors, with their traceback
            logger.error(f"Rank {self.rank}: {what} failed; it fails on every rank.", exc_info=error)
        failure = {"order": order, "kind": type(error).__name__, "message": str(error),
                   "caught": catchable and isinstance(error, self.caught)}  # fmt: skip
        _let_go(error, f"rank {self.rank}")
        process_group.abort()
        return failure

    def _exchange(self, outcome: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's ``outcome`` (in rank order), through the store; if one failed, a new process group. Rank 0's
        process holds the store (hflight's connection of a launcher's processes): it leaves last, once every other
        rank read what it needed."""
        keys = [self._key(f"outcome/{rank}") for rank in range(self.size)]
        self.store.set(keys[self.rank], json.dumps(outcome))
        self.store.wait(keys)
        outcomes = [json.loads(value) for value in self.store.multi_get(keys)]
        if self.rank != 0:
            self.store.set(self._key(f"read/{self.rank}"), "1")
        else:
            self.store.wait([self._key(f"read/{rank}") for rank in range(1, self.size)])
        if any(each["failure"] is not None for each in outcomes):
            self._reconnect()
        self.iteration += 1
        return outcomes

    def _settle(self, outcomes: list[dict[str, Any]], error: Exception | None) -> None:
        """The first error recorded, raised on every rank but its own (which raises it itself)."""
        failures = sorted((each["failure"]["order"], rank) for rank, each in enumerate(outcomes) if each["failure"])
        if not failures or failures[0][1] == self.rank:
            self.agreed = error
            return
        first = failures[0][1]
        failure = outcomes[first]["failure"]
        number = next((each["number"] for each in outcomes if each["number"] is not None), None)  # rank 0's
        what = "The search" if number is None else f"Trial {number}"
        kind = CaughtOnAnotherRank if failure["caught"] else TrialFailedOnAnotherRank
        self.agreed = kind(f"{what} failed on rank {first}: {failure['kind']}: {failure['message']}")
        raise self.agreed from None

    def _reconnect(self) -> None:
        """A new default process group for what follows the failed trial (this rank's is aborted, or broken by a
        rank that aborted its own), on the same store under keys of its own (``hflight.arguments.process_group``
        connects it)."""
        import torch.distributed as dist

        store = dist.PrefixStore(self._key("group"), self.store)
        process_group.reconnect(self.backend, store, self.rank, self.size, self.store.timeout)

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (``value`` itself with one process)."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def _let_go(error: BaseException, where: str) -> None:
    """The failed run let go: the frames ``error`` (and the errors it chains) went through hold it, and with it its
    process group (Lightning's forward wrapper holds the DDP wrapper, which holds the group). A gloo group closes its
    connections only once destroyed (its ``abort`` leaves them open), and only then does a rank that waits for this
    one in a collective leave it. So the tracebacks go (``error`` keeps the text of its own as a note) and the run is
    collected while the group is still registered, as ``hflight.arguments.process_group.end`` does: the group is then
    destroyed when it is unregistered, with the interpreter lock released."""
    if hasattr(error, "add_note") and error.__traceback__ is not None:  # Python >= 3.11
        error.add_note(f"Raised on {where} at:\n" + "".join(traceback.format_tb(error.__traceback__)).rstrip())
    seen: set[int] = set()
    each: BaseException | None = error
    while each is not None and id(each) not in seen:
        seen.add(id(each))
        traceback.clear_frames(each.__traceback__)
        each.__traceback__ = None
        each = each.__cause__ or each.__context__
    gc.collect()


def connect(trainer: TrainerSurface, caught: tuple[type[BaseException], ...] = ()) -> Processes:
    """The processes of this search, connected as the first trial's run would connect them (its Lightning strategy
    starts the process group, which every run after keeps), so that rank 0 can send the first trial's values; with
    several, ready to agree on each trial's outcome (``caught``: the search's ``catch``). One process: nothing to
    connect.

    Raises:
        WorldMismatchError: the strategy would not span the launched processes (``hflight.run.launch_check``).
        ValueError: several processes that Lightning itself would launch (no torchrun, srun, ...): each trial's run
            would start them anew, running the script, and the search, again.
    """
    current = Processes.current(caught)
    if current.size > 1:
        return current.agreeing()
    args = trainer.args
    kwargs = lightning_trainer_kwargs(args, [], fitting=False, strategy=trainer.lightning_strategy, model=trainer.model)
    with quiet_lightning():
        lightning_trainer = L.Trainer(**kwargs)
    check_spans_launch(lightning_trainer, args)  # before the study: never a study per process
    if lightning_trainer.world_size <= 1:
        return current
    if cluster.environment() == "lightning":
        raise ValueError(
            f"hyperparameter_search over {lightning_trainer.world_size} processes that Lightning would launch "
            f"itself (devices={args.devices!r}, num_nodes={args.num_nodes}): each trial's run would start them "
            "anew. Start the processes with a launcher (torchrun --nproc_per_node=N script.py, or srun) and leave "
            "devices='auto'; every trial then trains on all of them."
        )
    strategy = lightning_trainer.strategy
    process_group.connect_strategy(strategy)
    strategy.setup_environment()
    return Processes.current(caught).agreeing()
