"""The Hydra ``Sweeper`` plugin: hands ``hydra.sweeper``'s keys to :class:`hflight.sweeps.sweeper.OptunaSearch`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf


class OptunaSweeper(Sweeper):
    """``hydra/sweeper=optuna``: an Optuna search whose trials are the sweep's jobs (see ``OptunaSweeperConf``)."""

    def __init__(
        self,
        sampler: Any,
        direction: Any,
        storage: str | None,
        study_name: str | None,
        n_trials: int,
        n_jobs: int,
        max_failure_rate: float = 0.0,
        search_space: DictConfig | None = None,
        params: DictConfig | None = None,
        custom_search_space: str | None = None,
        pruner: Any = None,
        heartbeat_interval: int | None = 60,
        grace_period: int | None = None,
        max_retry: int | None = 1,
        trial: int | None = None,
    ) -> None:
        from hflight.sweeps.sweeper import OptunaSearch

        if trial is not None:
            raise ValueError("hydra.sweeper.trial is set by the sweeper for each job; do not set it")
        plain = lambda node: OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
        self.search = OptunaSearch(
            sampler=sampler,
            direction=plain(direction),
            storage=storage,
            study_name=study_name,
            n_trials=n_trials,
            n_jobs=n_jobs,
            max_failure_rate=max_failure_rate,
            search_space=plain(search_space),
            params=plain(params),
            custom_search_space=custom_search_space,
            pruner=pruner,
            heartbeat_interval=heartbeat_interval,
            grace_period=grace_period,
            max_retry=max_retry,
        )
        self.config: DictConfig | None = None
        self.launcher: Any = None
        self.job_idx = 0

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: list[str]) -> None:
        assert self.config is not None and self.launcher is not None, "setup() first"
        self.search.run(
            arguments,
            Path(self.config.hydra.sweep.dir),
            self.config,
            lambda overrides, first: self.launcher.launch(overrides, initial_job_idx=first),
            self.job_idx,
        )
