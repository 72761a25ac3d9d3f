"""hflight's Optuna sweeper for Hydra (``hydra/sweeper=optuna``): hydra-optuna-sweeper's config keys on Optuna >= 4,
with the study in a database (``optuna.db`` in the sweep folder by default), pruning, heartbeats and continued
searches. The search itself is ``hflight.sweeps.sweeper.OptunaSearch``; Hydra finds plugins only under the
``hydra_plugins`` namespace, hence this package."""

from hydra_plugins.hflight_optuna_sweeper import config as _config  # noqa: F401 - registers the configs
