"""``hydra/sweeper=optuna``'s config: hydra-optuna-sweeper's keys (``sampler``, ``direction``, ``storage``,
``study_name``, ``n_trials``, ``n_jobs``, ``max_failure_rate``, ``search_space``, ``params``,
``custom_search_space``), with its sampler presets (``hydra/sweeper/sampler=tpe|random|cmaes|nsgaii|grid``, plus
``qmc`` and ``gp``), and hflight's additions: ``pruner`` (``hydra/sweeper/pruner=median|percentile|hyperband|
successive_halving|nop`` or any ``_target_``), ``heartbeat_interval``/``grace_period``/``max_retry`` (interrupted
trials) and ``trial`` (set by the sweeper for each job).

Differences from hydra-optuna-sweeper 1.3: ``storage: null`` keeps the study in ``<sweep folder>/optuna.db``
(there: in memory); the TPE preset leaves out the keys Optuna 4 deprecated (``consider_prior``, ...: still
accepted when given, with Optuna's warning); ``motpe`` is gone from Optuna 4 (use ``tpe`` or ``nsgaii``).
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class SamplerConfig:
    _target_: str = MISSING


@dataclass
class TPESamplerConfig(SamplerConfig):
    _target_: str = "optuna.samplers.TPESampler"
    seed: Optional[int] = None
    n_startup_trials: int = 10
    n_ei_candidates: int = 24
    multivariate: bool = False
    group: bool = False
    constant_liar: bool = True


@dataclass
class RandomSamplerConfig(SamplerConfig):
    _target_: str = "optuna.samplers.RandomSampler"
    seed: Optional[int] = None


@dataclass
class CmaEsSamplerConfig(SamplerConfig):
    _target_: str = "optuna.samplers.CmaEsSampler"
    seed: Optional[int] = None
    x0: Optional[Dict[str, Any]] = None
    sigma0: Optional[float] = None
    n_startup_trials: int = 1
    warn_independent_sampling: bool = True
    consider_pruned_trials: bool = False
    restart_strategy: Optional[str] = None
    inc_popsize: int = -1
    use_separable_cma: bool = False


@dataclass
class NSGAIISamplerConfig(SamplerConfig):
    _target_: str = "optuna.samplers.NSGAIISampler"
    seed: Optional[int] = None
    population_size: int = 50
    mutation_prob: Optional[float] = None
    crossover_prob: float = 0.9
    swapping_prob: float = 0.5


@dataclass
class GridSamplerConfig(SamplerConfig):
    """The grid is built from the search space (choices and ranges) when the sweep starts."""

    _target_: str = "optuna.samplers.GridSampler"
    _partial_: bool = True
    seed: Optional[int] = None


@dataclass
class QMCSamplerConfig(SamplerConfig):
    _target_: str = "optuna.samplers.QMCSampler"
    seed: Optional[int] = None
    qmc_type: str = "sobol"
    scramble: bool = False


@dataclass
class GPSamplerConfig(SamplerConfig):
    _target_: str = "optuna.samplers.GPSampler"
    seed: Optional[int] = None
    n_startup_trials: int = 10


@dataclass
class MedianPrunerConfig:
    _target_: str = "optuna.pruners.MedianPruner"
    n_startup_trials: int = 5
    n_warmup_steps: int = 0
    interval_steps: int = 1
    n_min_trials: int = 1


@dataclass
class PercentilePrunerConfig:
    _target_: str = "optuna.pruners.PercentilePruner"
    percentile: float = 25.0
    n_startup_trials: int = 5
    n_warmup_steps: int = 0
    interval_steps: int = 1
    n_min_trials: int = 1


@dataclass
class HyperbandPrunerConfig:
    _target_: str = "optuna.pruners.HyperbandPruner"
    min_resource: int = 1
    max_resource: Any = "auto"
    reduction_factor: int = 3


@dataclass
class SuccessiveHalvingPrunerConfig:
    _target_: str = "optuna.pruners.SuccessiveHalvingPruner"
    min_resource: Any = "auto"
    reduction_factor: int = 4
    min_early_stopping_rate: int = 0


@dataclass
class NopPrunerConfig:
    _target_: str = "optuna.pruners.NopPruner"


@dataclass
class OptunaSweeperConf:
    _target_: str = "hydra_plugins.hflight_optuna_sweeper.optuna_sweeper.OptunaSweeper"
    defaults: List[Any] = field(default_factory=lambda: [{"sampler": "tpe"}])

    # the sampling algorithm (a _target_ node, or hydra/sweeper/sampler=NAME)
    sampler: Any = MISSING
    # minimize or maximize, or a list of them for several objectives (main then returns as many values)
    direction: Any = "minimize"
    # an SQLAlchemy URL (sqlite:///path.db, postgresql://user:pass@host/db); null: <sweep folder>/optuna.db
    storage: Optional[str] = None
    # the study's name in the storage (a second sweeper or a continued one joins the study of that name)
    study_name: Optional[str] = None
    # finished trials the study should hold (complete, pruned, or failed by its own job)
    n_trials: int = 20
    # trials handed to the launcher at once (the launcher decides how many run in parallel)
    n_jobs: int = 2
    # fraction of a batch's jobs that may raise before the sweep stops (hflight's jobs record failures instead)
    max_failure_rate: float = 0.0
    # hydra-optuna-sweeper 1.1's dict form: key -> {type: int|float|categorical, low, high, log, step, choices}
    search_space: Optional[Dict[str, Any]] = None
    # key -> Hydra sweep grammar: interval(...), tag(log, interval(...)), choice(...), range(...), or a fixed value
    params: Optional[Dict[str, str]] = None
    # dotpath of a function(cfg, trial) suggesting more parameters (define-by-run)
    custom_search_space: Optional[str] = None
    # an optuna pruner (_target_ node, or hydra/sweeper/pruner=NAME); each job reports optimized_metric at every
    # evaluation; null: no pruning
    pruner: Any = None
    # seconds between a running trial's heartbeats; a trial silent for grace_period (default 2x) is stale: FAIL
    heartbeat_interval: int = 60
    grace_period: Optional[int] = None
    # how many times an interrupted or stale trial's parameters run again (null: no limit)
    max_retry: Optional[int] = 1
    # set by the sweeper for each job (the trial's number): not for users
    trial: Optional[int] = None


_store = ConfigStore.instance()
_store.store(group="hydra/sweeper", name="optuna", node=OptunaSweeperConf, provider="hflight")
for _name, _node in {
    "tpe": TPESamplerConfig,
    "random": RandomSamplerConfig,
    "cmaes": CmaEsSamplerConfig,
    "nsgaii": NSGAIISamplerConfig,
    "grid": GridSamplerConfig,
    "qmc": QMCSamplerConfig,
    "gp": GPSamplerConfig,
}.items():
    _store.store(group="hydra/sweeper/sampler", name=_name, node=_node, provider="hflight")
for _name, _node in {
    "median": MedianPrunerConfig,
    "percentile": PercentilePrunerConfig,
    "hyperband": HyperbandPrunerConfig,
    "successive_halving": SuccessiveHalvingPrunerConfig,
    "nop": NopPrunerConfig,
}.items():
    _store.store(group="hydra/sweeper/pruner", name=_name, node=_node, provider="hflight")
