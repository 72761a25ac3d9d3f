"""The study a sweep keeps in a database: opening its storage, checking that a study found there is this search's,
counting what is left to run, and what a search leaves at the sweep's root (``optimization_results.yaml``,
``optimization_history.png``, ``param_importances.png``).

The default storage is an SQLite file in the sweep folder (:data:`DB_NAME`); any SQLAlchemy URL works
(``hydra.sweeper.storage=postgresql://user:pass@host/db`` for sweepers on several machines). Trials record a
heartbeat while they run (``heartbeat_interval`` seconds): a trial whose sweeper died (killed, its machine lost)
goes stale after ``grace_period`` and is then marked FAIL by the next sweeper that opens the study, which runs it
again with the same parameters (Optuna's ``RetryHeartbeatStaleTrialCallback``, up to ``max_retry`` times).
"""

from __future__ import annotations

import functools
import json
import logging
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import optuna
from hydra.errors import CompactHydraException
from optuna.distributions import BaseDistribution, distribution_to_json
from optuna.storages import RDBStorage
from optuna.trial import FrozenTrial, TrialState

__all__ = [
    "DB_NAME",
    "SweepError",
    "FAILURE",
    "INTERRUPTED",
    "PRUNED_AT",
    "SPACE_ATTR",
    "check_study",
    "default_storage_url",
    "finished",
    "mask_url",
    "open_storage",
    "open_study",
    "retry_trial",
    "write_results",
]

log = logging.getLogger(__name__)


class SweepError(CompactHydraException, ValueError):
    """A search that cannot start as configured (storage, study, search space): Hydra prints its message alone."""


#: The study's database in the sweep folder when ``hydra.sweeper.storage`` is null.
DB_NAME = "optuna.db"
#: Study attribute holding the search space (JSON of Optuna distributions), checked when a study is reopened.
SPACE_ATTR = "hflight:search_space"
#: Trial attribute of a trial stopped by a signal or by its sweeper's end (FAIL, and run again).
INTERRUPTED = "hflight:interrupted"
#: Trial attribute a pruned job sets (the global step it stopped at), read by the sweeper to tell PRUNED.
PRUNED_AT = "hflight:pruned_at_step"
#: Trial attribute: the job folder of the trial.
JOB_DIR = "hflight:job_dir"
#: Trial attribute of a trial whose job failed (why): it counts as finished and is not run again.
FAILURE = "hflight:failure"


def default_storage_url(sweep_dir: str | Path) -> str:
    return f"sqlite:///{Path(sweep_dir).resolve() / DB_NAME}"


def mask_url(url: str) -> str:
    """``url`` with its password, if any, shown as ``***``."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a URL at all: nothing to mask
        return url


def open_storage(
    url: str, heartbeat_interval: int | None = None, grace_period: int | None = None, max_retry: int = 1
) -> RDBStorage:
    """The RDB storage at ``url`` (tables created on first use), with heartbeats; a failure names the URL, its
    password masked.

    Raises:
        SweepError: the URL cannot be parsed or the database cannot be opened.
    """
    from sqlalchemy.engine import make_url

    shown = mask_url(url)
    try:
        parsed = make_url(url)
    except Exception:  # noqa: BLE001 - sqlalchemy's ArgumentError, with the URL in it
        raise SweepError(
            f"hydra.sweeper.storage: {shown!r} is not a database URL (SQLAlchemy's form, e.g. "
            f"sqlite:///optuna.db or postgresql://user:pass@host/db)"
        ) from None
    engine_kwargs: dict[str, Any] = {}
    if parsed.get_backend_name() == "sqlite":
        # jobs and sweepers write to one file: wait for its lock rather than fail at once
        engine_kwargs = {"connect_args": {"timeout": 60}}
        if parsed.database and parsed.database != ":memory:":
            try:
                Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise SweepError(f"hydra.sweeper.storage: cannot open {shown}: {exc}") from None
    try:
        return _rdb_storage(url, engine_kwargs, heartbeat_interval, grace_period, max_retry)
    except Exception as exc:  # noqa: BLE001 - whatever the driver raises, said with the URL
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if parsed.password:
            message = message.replace(str(parsed.password), "***")
        raise SweepError(f"hydra.sweeper.storage: cannot open {shown}: {type(exc).__name__}: {message}") from None


def _rdb_storage(
    url: str, engine_kwargs: dict[str, Any], heartbeat_interval: int | None, grace_period: int | None, max_retry: int
) -> RDBStorage:
    """``RDBStorage(url)``, tried three times: two processes creating a new database's tables at once (two sweepers
    started together) make one of them fail on the other's version row; the next try finds the tables."""
    from sqlalchemy.exc import IntegrityError, OperationalError

    for attempt in range(3):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return RDBStorage(
                    url,
                    engine_kwargs=engine_kwargs,
                    heartbeat_interval=heartbeat_interval,
                    grace_period=grace_period,
                    heartbeat_stale_trial_callback=functools.partial(retry_trial, max_retry)
                    if heartbeat_interval and max_retry
                    else None,
                )
        except (IntegrityError, OperationalError):
            if attempt == 2:
                raise
            time.sleep(0.5 * (attempt + 1))
    raise AssertionError("unreachable")


def retry_trial(max_retry: int | None, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
    """Queue ``trial``'s parameters to run again (WAITING), as Optuna's ``RetryHeartbeatStaleTrialCallback`` does
    (``failed_trial``/``retry_history`` system attributes), at most ``max_retry`` times, without hflight's own
    trial attributes (the job folder, the failure)."""
    history = [*trial.system_attrs.get("retry_history", []), trial.number]
    if max_retry is not None and len(history) > max_retry:
        log.warning(f"Trial {trial.number} was interrupted and is not run again (max_retry={max_retry})")
        return
    system_attrs = {**trial.system_attrs, "failed_trial": history[0], "retry_history": history}
    study.add_trial(
        optuna.trial.create_trial(
            state=TrialState.WAITING,
            params=trial.params,
            distributions=trial.distributions,
            user_attrs={k: v for k, v in trial.user_attrs.items() if not k.startswith("hflight:")},
            system_attrs=system_attrs,
        )
    )
    log.warning(f"Trial {trial.number} was interrupted: its parameters will run again")


def _space_json(space: dict[str, BaseDistribution]) -> dict[str, Any]:
    return {key: json.loads(distribution_to_json(dist)) for key, dist in sorted(space.items())}


def _shown(recorded: dict[str, Any]) -> str:
    """A distribution's JSON as ``FloatDistribution(low=0.0, high=1.0, ...)``."""
    attributes = ", ".join(f"{k}={v}" for k, v in (recorded.get("attributes") or {}).items())
    return f"{recorded.get('name')}({attributes})"


def check_study(study: optuna.Study, directions: Sequence[str], space: dict[str, BaseDistribution]) -> None:
    """Refuse to mix two searches in one study: the directions and the search space must be the ones it was
    created with (recorded in the study's ``hflight:search_space`` attribute); a new study records them.

    Raises:
        SweepError: naming the study and the difference.
    """
    found = [d.name.lower() for d in study.directions]
    if found != [d.lower() for d in directions]:
        raise SweepError(
            f"study {study.study_name!r} exists with direction {found} and this sweep asks for {list(directions)}: "
            "give another hydra.sweeper.study_name (or the same direction)"
        )
    wanted = _space_json(space)
    recorded = study.user_attrs.get(SPACE_ATTR)
    if recorded is None:
        if study.trials:
            log.warning(f"Study {study.study_name!r} has trials but no recorded search space; taking this one")
        study.set_user_attr(SPACE_ATTR, wanted)
        return
    if recorded != wanted:
        differences = []
        for key in sorted(set(recorded) | set(wanted)):
            if key not in wanted:
                differences.append(f"{key}: in the study, not in this sweep")
            elif key not in recorded:
                differences.append(f"{key}: in this sweep, not in the study")
            elif recorded[key] != wanted[key]:
                differences.append(f"{key}: {_shown(recorded[key])} in the study, {_shown(wanted[key])} here")
        raise SweepError(
            f"study {study.study_name!r} exists with another search space ({'; '.join(differences)}): give another "
            "hydra.sweeper.study_name, or the study's own search space"
        )


def open_study(
    storage: RDBStorage,
    study_name: str | None,
    directions: Sequence[str],
    sampler: Any,
    pruner: Any,
    space: dict[str, BaseDistribution],
) -> optuna.Study:
    """Create the study or load the one of that name (checked by :func:`check_study`). Without a name, a storage
    holding exactly one study (a continued sweep's ``optuna.db``) opens that one."""
    if study_name is None:  # a continued sweep's optuna.db holding the one study it started
        names = [summary.study_name for summary in optuna.get_all_study_summaries(storage, include_best_trial=False)]
        study_name = names[0] if len(names) == 1 else None
    study = None
    if study_name is not None:
        try:
            study = optuna.load_study(study_name=study_name, storage=storage, sampler=sampler, pruner=pruner)
        except KeyError:
            pass
    if study is None:
        study = optuna.create_study(
            storage=storage,
            study_name=study_name,
            sampler=sampler,
            pruner=pruner,
            directions=list(directions),
            load_if_exists=True,  # another sweeper may create it meanwhile
        )
    check_study(study, directions, space)
    return study


def finished(trial: FrozenTrial) -> bool:
    """Whether a trial counts towards ``n_trials``: complete, pruned, or failed by its own job (its sweeper
    recorded why: :data:`FAILURE`). A trial failed by a signal or a stale heartbeat is run again instead."""
    if trial.state in (TrialState.COMPLETE, TrialState.PRUNED):
        return True
    return trial.state == TrialState.FAIL and FAILURE in trial.user_attrs


def write_results(study: optuna.Study, sweep_dir: Path) -> dict[str, Any] | None:
    """``optimization_results.yaml`` (hydra-optuna-sweeper's keys: ``name``, ``best_params``, ``best_value``, or
    ``solutions`` for several objectives), ``optimization_history.png`` and ``param_importances.png`` in
    ``sweep_dir``; the results (None when no trial completed)."""
    from omegaconf import OmegaConf

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not complete:
        log.warning("No trial completed: no optimization_results.yaml")
        return None
    if len(study.directions) == 1:
        best = study.best_trial
        results: dict[str, Any] = {"name": "optuna", "best_params": dict(best.params), "best_value": best.value}
        log.info(f"Best trial {best.number}: value {best.value}, parameters {best.params}")
    else:
        results = {"name": "optuna", "solutions": [{"params": t.params, "values": t.values} for t in study.best_trials]}
        log.info(f"{len(study.best_trials)} Pareto-optimal trials")
    OmegaConf.save(OmegaConf.create(results), sweep_dir / "optimization_results.yaml")
    _plots(study, sweep_dir, len(complete))
    return results


def _plots(study: optuna.Study, sweep_dir: Path, complete: int) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as plots

    wanted = [("optimization_history.png", plots.plot_optimization_history)]
    if len(study.directions) == 1 and complete >= 2 and study.best_trial.params:
        wanted.append(("param_importances.png", plots.plot_param_importances))
    else:
        log.info("No param_importances.png: it needs two completed trials, one objective and a parameter")
    for name, plot in wanted:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                axes = plot(study) if len(study.directions) == 1 else plot(study, target=lambda t: t.values[0])
            figure = axes.figure if hasattr(axes, "figure") else axes.flat[0].figure
            figure.tight_layout()
            figure.savefig(sweep_dir / name, dpi=110)
            plt.close(figure)
            log.info(f"{name}: {sweep_dir / name}")
        except (ValueError, RuntimeError, OSError) as exc:  # e.g. importances of a constant objective
            log.warning(f"Could not draw {name}: {type(exc).__name__}: {exc}")
