"""hflight installed as users install a package: a wheel built from the repository, installed non-editable into a
fresh folder, then its commands run from an empty folder with nothing of the checkout on the path.

The wheel is installed with ``--no-deps`` into a ``--target`` folder that goes first on ``PYTHONPATH``: its
dependencies (torch, transformers, ...) are this environment's, so nothing is downloaded and torch is never
resolved afresh.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from .support import TINY

REPO = Path(__file__).resolve().parents[1]


def _build_and_install(tmp_path: Path) -> Path:
    """A wheel of a clean copy of the repository, installed into ``tmp_path/site``; returns that folder."""
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".*", "outputs", "__pycache__", "*.egg-info", "build"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]
    wheels = tmp_path / "wheels"
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(source)], check=True)
    (wheel,) = wheels.glob("hflight-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"hflight/conf/train.yaml", "hflight/conf/experiment/mrc.yaml", "hflight/py.typed"} <= set(names)
    assert {
        "hydra_plugins/hflight_optuna_sweeper/optuna_sweeper.py",
        "hflight/conf/hydra/launcher/submitit_slurm.yaml",
    } <= set(names)
    assert "hydra_plugins/__init__.py" not in names  # Hydra's plugin namespace stays a namespace package
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)], check=True)
    return site


def _environment(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HFLIGHT_CONFIG_DIR", "HFLIGHT_ROOT")}
    return {**env, "PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.mark.subprocess
@pytest.mark.slow
def test_wheel_installs_and_runs_from_an_empty_folder(tmp_path):
    site = _build_and_install(tmp_path)
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    env = _environment(site)

    def run(*argv: str) -> subprocess.CompletedProcess:
        proc = subprocess.run(argv, cwd=empty, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{argv}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        return proc

    where = run(sys.executable, "-c", "import hflight, hflight.conf; print(hflight.__file__, hflight.__version__)")
    assert where.stdout.startswith(str(site / "hflight" / "__init__.py"))  # the installed copy, not the checkout
    # python -m hflight: the main job, tiny, from the package's own config tree
    run(sys.executable, "-m", "hflight", *TINY, "args.num_train_epochs=1")
    (run_dir,) = (empty / "outputs" / "mrc" / "runs").iterdir()
    assert (run_dir / "all_results.json").is_file() and (run_dir / "training_curves.png").is_file()
    # hflight-train: --help lists the groups and points to --cfg job
    script = site / "bin" / "hflight-train"
    help_text = run(sys.executable, str(script), "--help").stdout
    assert "experiment: mrc, mrc_squad" in help_text and "--cfg job" in help_text
    # hflight's Optuna sweeper, found by Hydra's own plugin scan in the installed wheel (hflight not imported)...
    scan = (
        "from hydra.core.plugins import Plugins\nfrom hydra.plugins.sweeper import Sweeper\n"
        "print(*(f'{c.__module__}.{c.__name__}' for c in Plugins.instance().discover(Sweeper)))\n"
        "import sys; print('hflight' in sys.modules)"
    )
    found, imported = run(sys.executable, "-c", scan).stdout.splitlines()
    assert "hydra_plugins.hflight_optuna_sweeper.optuna_sweeper.OptunaSweeper" in found.split() and imported == "False"
    # ... and listed once by the command; in the same process (``--info all``: the plugins, then the composed config,
    # as ``--cfg job`` prints it) --config-dir adds the user's configs
    mine = empty / "my_conf" / "experiment"
    mine.mkdir(parents=True)
    (mine / "mine.yaml").write_text("# @package _global_\ndefaults:\n  - mrc\ntask_name: mine\n")
    info = run(sys.executable, str(script), "--config-dir", "my_conf", "+experiment=mine", "--info", "all").stdout
    sweepers = info.split("Sweeper:")[1].split("Config search path")[0]
    assert sweepers.split().count("OptunaSweeper") == 1, info
    job = info.split("\nConfig\n******\n")[1]
    assert "task_name: mine" in job and "num_train_articles: 600" in job  # the user's file over the package's mrc


def test_the_ortmodule_lock_holds_every_runtime_dependency_of_hflight():
    """requirements/ortmodule.txt installs with ``--no-deps`` and hflight on top without dependencies: a dependency
    added to pyproject.toml and not to the lock fails CI's ORTModule environment at its ``pip check`` (isal did)."""
    import tomllib
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    def name(requirement: str) -> str:
        return canonicalize_name(Requirement(requirement).name)

    needed = {name(each) for each in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]}
    lines = (REPO / "requirements" / "ortmodule.txt").read_text().splitlines()
    locked = {name(line) for line in lines if line.strip() and not line.startswith("#")}
    assert needed - locked == set(), "pyproject.toml's dependencies missing from requirements/ortmodule.txt"
