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
- **ray** and **wandb** run transformers' own drivers (``run_hp_search_ray``, ``run_hp_search_wandb``: the same
  keyword arguments, defaults and results), which call back into the facade's ``_hp_search_setup``,
  ``_report_to_hp_search``, ``_tune_save_checkpoint`` and ``_get_output_dir`` as transformers' ``Trainer`` does.
  Neither spans a launcher's processes (Ray Tune trains each trial in a worker process of its own, a W&B agent in the
  process that calls it), so under a launcher they are refused.
"""

from __future__ import annotations

import tempfile
from typing import TYPE_CHECKING, Any, ClassVar

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

        processes = connect(trainer)
        settings = {key: kwargs.pop(key) for key in ("timeout", "n_jobs", "gc_after_trial", "catch") if key in kwargs}
        if processes.size > 1 and settings.get("n_jobs", 1) != 1:
            raise ValueError(
                f"hyperparameter_search(n_jobs={settings['n_jobs']}) over {processes.size} processes: the processes "
                "train one trial at a time together; leave n_jobs at 1."
            )
        if processes.rank != 0:
            return _follow(trainer, processes, (optuna.TrialPruned, *settings.get("catch", ())))
        directions = list(direction) if isinstance(direction, (list, tuple)) else None
        study = optuna.create_study(direction=None if directions else direction, directions=directions, **kwargs)
        study.optimize(lambda trial: _objective(trainer, processes, trial), n_trials=n_trials, **settings)
        processes.broadcast(None)  # the study is over: the other ranks return
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

    trainer.objective = None
    if processes.size > 1:
        trainer.hp_space(trial)  # samples the trial's values, which the other ranks train with
        processes.broadcast(optuna.trial.FixedTrial(trial.params, trial.number))
    trainer.train(trial=trial)
    if trainer.objective is None:
        trainer.objective = trainer.compute_objective(trainer.evaluate())
    trainer.model_wrapped = trainer.model = None
    release_memory()
    return trainer.objective


def _follow(trainer: TrainerSurface, processes: Processes, caught: tuple[type[BaseException], ...]) -> None:
    """A rank other than 0: train each trial rank 0 sends until it sends the end; ``None``, as in transformers."""
    while (trial := processes.broadcast(None)) is not None:
        trainer.objective = None
        try:
            trainer.train(trial=trial)
        except caught:  # pruned (on every rank), or a failure the study catches (on every rank alike)
            continue
        if trainer.objective is None:
            trainer.objective = trainer.compute_objective(trainer.evaluate())
    return None


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
class Processes:
    """The processes a search spans: ``size``, this one's ``rank``, and rank 0's values sent to every rank."""

    def __init__(self, size: int, rank: int) -> None:
        self.size, self.rank = size, rank

    @classmethod
    def current(cls) -> Processes:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_world_size(), dist.get_rank())
        return cls(1, 0)

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (``value`` itself with one process)."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def connect(trainer: TrainerSurface) -> Processes:
    """The processes of this search, connected as the first trial's run would connect them (its Lightning strategy
    starts the process group, which every run after keeps), so that rank 0 can send the first trial's values. One
    process: nothing to connect.

    Raises:
        WorldMismatchError: the strategy would not span the launched processes (``hflight.run.launch_check``).
        ValueError: several processes that Lightning itself would launch (no torchrun, srun, ...): each trial's run
            would start them anew, running the script, and the search, again.
    """
    current = Processes.current()
    if current.size > 1:
        return current
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
    return Processes.current()
