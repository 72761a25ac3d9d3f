"""The Hydra ``Sweeper`` plugin: hands ``hydra.sweeper``'s keys to :class:`hflight.sweeps.sweeper.OptunaSearch`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, ListConfig, OmegaConf


class OptunaSweeper(Sweeper):
    """``hydra/sweeper=optuna``: an Optuna search whose trials are the sweep's jobs (see ``OptunaSweeperConf``)."""

    def __init__(self, trial: int | None = None, **config: Any) -> None:
        """``config``: ``hydra.sweeper``'s keys (``OptunaSweeperConf``), the sampler and pruner instantiated."""
        from hflight.sweeps.sweeper import OptunaSearch

        if trial is not None:
            raise ValueError("hydra.sweeper.trial is set by the sweeper for each job; do not set it")
        plain = {k: OmegaConf.to_container(v, resolve=True) if isinstance(v, (DictConfig, ListConfig)) and k not in
                 ("sampler", "pruner") else v for k, v in config.items()}  # fmt: skip
        self.search = OptunaSearch(**plain)
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
