"""hflight's Optuna search: the loop behind ``hydra/sweeper=optuna`` (``hydra_plugins.hflight_optuna_sweeper``
registers it with Hydra and keeps hydra-optuna-sweeper's config keys; this module holds the work).

Each round asks the study for ``n_jobs`` trials, hands their overrides to the launcher (basic, joblib, submitit,
...) and tells the study how each job ended: COMPLETE with the value ``main`` returned, PRUNED when the job's pruner
stopped it (the job records that in the study, :mod:`hflight.sweeps.trial`), FAIL otherwise (the job's failure
never stops the others; ``max_failure_rate`` only concerns jobs that raised past hflight's own error handling, as
in hydra-optuna-sweeper). The search ends when the study holds ``n_trials`` finished trials (COMPLETE, PRUNED, or
FAIL by its own job), whoever ran them: a continued sweep (``hflight-train resume=<sweep folder>``) or a second
sweeper on the same storage adds to the same count; a seeded sampler then continues with a seed of its own rather
than proposing the study's trials again from its first draw. Trials interrupted by a signal or by a dead sweeper (a
stale heartbeat) are FAIL, with their parameters queued to run again (``max_retry`` times).

SIGTERM and SIGINT reach every job (forwarded to the launcher's worker processes), which stop at a step boundary
with a checkpoint; the sweeper then marks the batch's unfinished trials FAIL (interrupted), writes the summary and
exits with 128 + the signal number.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import signal
import threading
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import optuna
from hydra.core.utils import JobReturn, JobStatus
from hydra.utils import get_method
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from hflight.sweeps.search_space import distribution_from_dict, grid_choices, split_overrides
from hflight.sweeps.study import (
    FAILURE,
    INTERRUPTED,
    JOB_DIR,
    PRUNED_AT,
    SweepError,
    default_storage_url,
    finished,
    mask_url,
    open_storage,
    open_study,
    retry_trial,
    write_results,
)
from hflight.sweeps.summary import write_summary
from hflight.sweeps.trial import SWEEPER_PID

__all__ = ["OptunaSearch"]

log = logging.getLogger(__name__)


def _quote(value: str) -> str:
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _directions(direction: Any) -> list[str]:
    items = list(direction) if isinstance(direction, Sequence) and not isinstance(direction, str) else [direction]
    names = [getattr(d, "name", d) for d in items]
    for name in names:
        if name not in ("minimize", "maximize"):
            raise SweepError(f"hydra.sweeper.direction must be minimize or maximize (or a list of them), got {name!r}")
    return names


def _suggest(trial: optuna.Trial, key: str, distribution: BaseDistribution) -> Any:
    if isinstance(distribution, CategoricalDistribution):
        return trial.suggest_categorical(key, distribution.choices)
    if isinstance(distribution, IntDistribution):
        return trial.suggest_int(key, distribution.low, distribution.high, step=distribution.step, log=distribution.log)
    if isinstance(distribution, FloatDistribution):
        return trial.suggest_float(
            key, distribution.low, distribution.high, step=distribution.step, log=distribution.log
        )
    raise TypeError(f"{key}: unsupported distribution {distribution}")


def _job_folder(config: Any, sweep_dir: Path, number: int) -> Path | None:
    """Where job ``number`` will write, when the sweep's subdir is Hydra's default (the job's number): absolute, as
    the folder Hydra gives the job, so that a retry finds the checkpoint from wherever the search is continued."""
    from omegaconf import OmegaConf

    subdir = OmegaConf.to_container(config.hydra.sweep, resolve=False).get("subdir")
    return sweep_dir.resolve() / str(number) if subdir == "${hydra.job.num}" else None


def _continue_from(study: optuna.Study, trial: optuna.Trial) -> list[str]:
    """For a trial that runs an interrupted one's parameters again: ``args.resume_from_checkpoint=`` the last valid
    checkpoint the interrupted job left (its training goes on from there, in the new job's folder); else nothing."""
    from hflight.checkpoints.manifest import get_last_checkpoint

    history = study._storage.get_trial_system_attrs(trial._trial_id).get("retry_history") or []
    if not history:
        return []
    storage = study._storage
    previous = storage.get_trial(storage.get_trial_id_from_study_id_trial_number(study._study_id, history[-1]))
    folder = previous.user_attrs.get(JOB_DIR)
    checkpoint = get_last_checkpoint(folder) if folder and Path(folder).is_dir() else None
    if checkpoint is None:
        log.info(f"Trial {trial.number} runs trial {history[-1]}'s parameters again, from the start")
        return []
    log.info(f"Trial {trial.number} continues trial {history[-1]} from {checkpoint}")
    return [f"args.resume_from_checkpoint={_quote(checkpoint)}"]


#: Samplers that continue from the study itself, whatever their seed: QMC keeps its sample index in the study, grid
#: and brute force draw among the points no trial has taken yet.
_CONTINUE_FROM_THE_STUDY = (optuna.samplers.QMCSampler, optuna.samplers.GridSampler, optuna.samplers.BruteForceSampler)


def _continued_sampler(study: optuna.Study, node: Any) -> None:
    """A study that holds trials already (``resume=<sweep folder>``, a second sweeper) and a seeded sampler: built
    from its seed again, the sampler would start its sequence again and propose the trials already run, trial 0's
    parameters first. The study gets the same sampler (``node``, the ``hydra.sweeper.sampler`` config) with a seed of
    this continuation's own, derived from the configured seed and the number of trials in the study: the continued
    search draws anew, and the same continuation draws the same. (Unseeded, a sampler draws anew in every process.)"""
    trials = len(study.get_trials(deepcopy=False))
    seed = node.get("seed") if node is not None else None
    if not trials or seed is None or isinstance(study.sampler, _CONTINUE_FROM_THE_STUDY):
        return
    import numpy as np
    from hydra.utils import instantiate

    derived = int(np.random.SeedSequence([int(seed), trials]).generate_state(1)[0])
    study.sampler = instantiate(node, seed=derived)
    log.info(f"The study holds {trials} trials: the sampler continues with seed {derived} (derived from {seed})")


def _summary(config: Any, sweep_dir: Path) -> None:
    """The sweep's summary when it stops early (Hydra's end-of-multirun callbacks do not run then)."""
    with contextlib.suppress(Exception):
        write_summary(sweep_dir, config.get("optimized_metric"), config.hydra.sweeper.get("direction"), "trials")


def _next_job_number(sweep_dir: Path, start: int) -> int:
    """The first job number after the job folders already in ``sweep_dir`` (a continued sweep numbers on)."""
    numbers = (
        [int(p.name) for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()] if sweep_dir.is_dir() else []
    )
    return max([start, *(n + 1 for n in numbers)])


class _Heartbeat:
    """Records the heartbeat of the running trials every ``interval`` seconds, in a thread."""

    def __init__(self, storage: Any, trial_ids: list[int], interval: int | None) -> None:
        self._storage, self._ids, self._interval = storage, trial_ids, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hflight-heartbeat", daemon=True)

    def _run(self) -> None:
        while True:
            for trial_id in self._ids:
                with contextlib.suppress(Exception):  # a busy database: the next beat will do
                    self._storage.record_heartbeat(trial_id)
            if self._stop.wait(self._interval):
                return

    def __enter__(self) -> _Heartbeat:
        if self._interval:
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


class _Signals:
    """While jobs run in other processes: SIGTERM/SIGINT are forwarded to the sweeper's child processes (the
    launcher's workers and jobs) and remembered; in the sweeper's own process (the basic launcher) the job's own
    handlers take over while it trains."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        first = self.received is None
        self.received = self.received or signum
        children = _children()
        if not children:
            raise SystemExit(128 + signum)
        if first:
            log.warning(
                f"{signal.Signals(signum).name}: stopping the sweep; {len(children)} job processes stop at their "
                "next step boundary with a checkpoint"
            )
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def __enter__(self) -> _Signals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


#: Launcher processes between the sweeper and its jobs that must not get the forwarded signal: submitit's local
#: controller (``python -m submitit.local._local``) forwards SIGTERM to its job itself (the job would get it twice, the
#: second time a stop at once without a checkpoint) and takes SIGINT as a KeyboardInterrupt, sending its job SIGINT
#: and, a second later, SIGKILL. Its jobs are the sweeper's descendants too, and get the signal from the sweeper.
_NOT_JOBS = ("submitit.local._local",)


def _children() -> list[int]:
    """The sweeper's descendant processes that get a forwarded signal: the launcher's workers and jobs; the
    :data:`_NOT_JOBS` processes only when there is nothing else yet (a batch's first moment, no job started)."""
    try:
        import psutil
    except ImportError:  # the sweeps extra brings it; without it, only the process group's own signals reach jobs
        return []
    jobs, launchers = [], []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):  # exited meanwhile
            (launchers if any(name in child.cmdline() for name in _NOT_JOBS) else jobs).append(child.pid)
    return jobs or launchers


@contextlib.contextmanager
def _sweeper_pid() -> Iterator[None]:
    previous = os.environ.get(SWEEPER_PID)
    os.environ[SWEEPER_PID] = str(os.getpid())
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(SWEEPER_PID, None)
        else:
            os.environ[SWEEPER_PID] = previous


class OptunaSearch:
    """The search of one sweep: see the module's docstring. Built from ``hydra.sweeper`` (the keys of
    ``hydra_plugins.hflight_optuna_sweeper.config.OptunaSweeperConf``)."""

    def __init__(
        self,
        sampler: Any,
        direction: Any,
        storage: str | None,
        study_name: str | None,
        n_trials: int,
        n_jobs: int,
        max_failure_rate: float,
        search_space: dict[str, Any] | None,
        params: dict[str, str] | None,
        custom_search_space: str | None,
        pruner: Any,
        heartbeat_interval: int | None = 60,
        grace_period: int | None = None,
        max_retry: int | None = 1,
    ) -> None:
        if n_trials < 1 or n_jobs < 1:
            raise SweepError(f"hydra.sweeper.n_trials and n_jobs must be >= 1, got {n_trials} and {n_jobs}")
        if not 0.0 <= max_failure_rate <= 1.0:
            raise SweepError(f"hydra.sweeper.max_failure_rate must be in [0, 1], got {max_failure_rate}")
        self.sampler, self.pruner = sampler, pruner
        self.directions = _directions(direction)
        self.storage, self.study_name = storage, study_name
        self.n_trials, self.n_jobs, self.max_failure_rate = n_trials, n_jobs, max_failure_rate
        self.search_space, self.params = search_space, params
        self.custom_search_space = get_method(custom_search_space) if custom_search_space else None
        self.heartbeat_interval, self.grace_period, self.max_retry = heartbeat_interval, grace_period, max_retry

    # ------------------------------------------------------------------------------------------------ the space
    def space(self, arguments: list[str]) -> tuple[dict[str, BaseDistribution], dict[str, str]]:
        """The search space and the fixed values: ``search_space`` (dict form), then ``params``, then the command
        line's sweep overrides (a later one wins)."""
        space = {key: distribution_from_dict(key, node) for key, node in (self.search_space or {}).items()}
        overrides = [f"{key}={value}" for key, value in (self.params or {}).items()] + list(arguments)
        found, fixed = split_overrides(overrides)
        space.update(found)
        for key in fixed:
            space.pop(key, None)
        return space, fixed

    def _sampler(self, space: dict[str, BaseDistribution]) -> tuple[Any, int]:
        if isinstance(self.sampler, functools.partial) and self.sampler.func is optuna.samplers.GridSampler:
            grid = {key: grid_choices(key, dist) for key, dist in space.items()}
            size = math.prod(len(values) for values in grid.values())
            if size < self.n_trials:
                log.info(f"GridSampler: {size} points, so {size} trials (n_trials={self.n_trials})")
            return self.sampler(grid), min(self.n_trials, size)
        return self.sampler, self.n_trials

    # ------------------------------------------------------------------------------------------------ the loop
    def run(self, arguments: list[str], sweep_dir: Path, config: Any, launch: Any, first_job: int) -> None:
        """The search: ``launch(overrides, initial_job_idx)`` runs one batch of jobs (the launcher's ``launch``)."""
        space, fixed = self.space(arguments)
        sampler, n_trials = self._sampler(space)
        url = self.storage or default_storage_url(sweep_dir)
        storage = open_storage(url, self.heartbeat_interval, self.grace_period, self.max_retry)
        study = open_study(storage, self.study_name, self.directions, sampler, self.pruner, space)
        _continued_sampler(study, config.hydra.sweeper.get("sampler"))
        from omegaconf import OmegaConf

        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(config, sweep_dir / "multirun.yaml")  # as Hydra's basic sweeper: how the sweep was composed
        log.info(
            f"Study {study.study_name!r} in {mask_url(url)}: {', '.join(self.directions)}, sampler "
            f"{type(sampler).__name__}, pruner {type(self.pruner).__name__ if self.pruner else 'none'}, "
            f"{n_trials} trials, {self.n_jobs} at a time"
        )
        already = sum(finished(t) for t in study.get_trials(deepcopy=False))
        if already:
            log.info(f"The study holds {already} finished trials: {max(0, n_trials - already)} to go")
        job = _next_job_number(sweep_dir, first_job)
        common = [f"hydra.sweeper.storage={_quote(url)}", f"hydra.sweeper.study_name={_quote(study.study_name)}"]
        with _Signals() as signals, _sweeper_pid():
            while (todo := self._to_run(study, n_trials)) is not None:
                with warnings.catch_warnings():  # heartbeats outside Study.optimize: the sweeper records them
                    warnings.filterwarnings("ignore", "Heartbeat of storage", UserWarning)
                    batch = [study.ask() for _ in range(min(self.n_jobs, todo))]
                overrides = []
                for i, trial in enumerate(batch):
                    folder = _job_folder(config, sweep_dir, job + i)
                    if folder is not None:
                        trial.set_user_attr(JOB_DIR, str(folder))
                    values = self._overrides(trial, space, fixed, config)
                    overrides.append(
                        [*values, *_continue_from(study, trial), *common, f"hydra.sweeper.trial={trial.number}"]
                    )
                try:
                    with _Heartbeat(storage, [t._trial_id for t in batch], self.heartbeat_interval):
                        returns = launch(overrides, job)
                except BaseException as exc:
                    self._interrupted(study, batch, f"{type(exc).__name__}: {exc}")
                    _summary(config, sweep_dir)
                    raise
                job += len(returns)
                raised = self._tell(study, batch, returns, interrupted=signals.received)
                if signals.received:
                    _summary(config, sweep_dir)
                    raise SystemExit(128 + signals.received)
                if raised and len(raised) / len(returns) > self.max_failure_rate:
                    log.error(f"{len(raised)} of {len(returns)} jobs raised (max_failure_rate={self.max_failure_rate})")
                    _ = raised[0].return_value  # re-raises the job's exception, with its traceback
        write_results(study, sweep_dir)

    def _to_run(self, study: optuna.Study, n_trials: int) -> int | None:
        """How many trials to start now (> 0), or None when the study holds ``n_trials`` finished ones. Trials
        running elsewhere (another sweeper, or a dead one whose heartbeat has not gone stale yet) are waited for."""
        while True:
            with contextlib.suppress(Exception), warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                optuna.storages.fail_stale_trials(study)
            trials = study.get_trials(deepcopy=False)
            running = sum(t.state == TrialState.RUNNING for t in trials)
            todo = n_trials - sum(finished(t) for t in trials) - running
            if todo > 0:
                return todo
            if running == 0:
                return None
            log.info(f"Waiting for {running} trials running elsewhere (or stale after their grace period)")
            threading.Event().wait(self.heartbeat_interval or 10)

    def _overrides(
        self, trial: optuna.Trial, space: dict[str, BaseDistribution], fixed: dict[str, str], config: Any
    ) -> list[str]:
        for key, distribution in space.items():
            _suggest(trial, key, distribution)
        for key, value in fixed.items():
            trial.set_user_attr(key, value)
        if self.custom_search_space is not None:
            self.custom_search_space(config, trial)
        overlap = set(trial.params) & set(fixed)
        if overlap:
            raise SweepError(f"fixed values and search space overlap: {sorted(overlap)}")
        return [f"{key}={value}" for key, value in {**trial.params, **fixed}.items()]

    def _tell(
        self, study: optuna.Study, batch: list[optuna.Trial], returns: Sequence[JobReturn], interrupted: int | None
    ) -> list[JobReturn]:
        """Tell the study how each job ended; the jobs that raised (past hflight's own error handling)."""
        raised = []
        for trial, ret in zip(batch, returns):
            with contextlib.suppress(Exception):  # the folder Hydra gave the job (a custom subdir included)
                trial.set_user_attr(JOB_DIR, str(ret.hydra_cfg.hydra.runtime.output_dir))
            frozen = study._storage.get_trial(trial._trial_id)
            if frozen.state != TrialState.RUNNING:  # failed as stale by another sweeper meanwhile
                continue
            if frozen.user_attrs.get(PRUNED_AT) is not None:
                study.tell(trial, state=TrialState.PRUNED)
                log.info(f"Trial {trial.number} pruned at step {frozen.user_attrs[PRUNED_AT]}")
                continue
            values = _values(ret, len(self.directions))
            if values is not None:
                study.tell(trial, values=values)
                continue
            if interrupted:
                self._interrupted(study, [trial], f"stopped by {signal.Signals(interrupted).name}")
                continue
            if ret.status == JobStatus.FAILED:
                raised.append(ret)
                reason = f"raised {type(ret._return_value).__name__}: {ret._return_value}"
            else:
                reason = f"returned {ret._return_value!r}, not {'a float' if len(self.directions) == 1 else 'floats'}"
            trial.set_user_attr(FAILURE, reason[:500])
            study.tell(trial, state=TrialState.FAIL)
            log.warning(f"Trial {trial.number} failed: its job {reason}")
        return raised

    def _interrupted(self, study: optuna.Study, batch: list[optuna.Trial], reason: str) -> None:
        for trial in batch:
            with contextlib.suppress(Exception):
                frozen = study._storage.get_trial(trial._trial_id)
                if frozen.state != TrialState.RUNNING:
                    continue
                trial.set_user_attr(INTERRUPTED, reason[:500])
                study.tell(trial, state=TrialState.FAIL)
                retry_trial(self.max_retry, study, study._storage.get_trial(trial._trial_id))


def _values(ret: JobReturn, count: int) -> list[float] | None:
    if ret.status != JobStatus.COMPLETED:
        return None
    value = ret._return_value
    items = list(value) if count > 1 and isinstance(value, (list, tuple)) else [value]
    try:
        values = [float(v) for v in items]
    except (TypeError, ValueError):
        return None
    if len(values) != count or not all(math.isfinite(v) for v in values):
        return None
    return values
