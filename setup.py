"""The package layout, which pyproject.toml cannot express alone: ``src/hflight`` (every subpackage found) plus the
Hydra config tree ``conf/``, which stays at the repository's top level and ships inside the package as
``hflight.conf`` (read through Hydra's ``pkg://hflight.conf`` search path once installed), and hflight's Optuna
sweeper in Hydra's plugin namespace (``src/hydra_plugins/hflight_optuna_sweeper``). Everything else is in
pyproject.toml."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages("src"), "hydra_plugins.hflight_optuna_sweeper", "hflight.conf"],
    package_dir={"": "src", "hflight.conf": "conf"},
)
