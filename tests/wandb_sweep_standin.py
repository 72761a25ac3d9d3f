"""A stand-in for the W&B sweep server and its agent: test code (no W&B server is reachable here).

``wandb.sweep`` sends a sweep's config to the W&B server, which checks it and answers a sweep id; ``wandb.agent``
then asks the server for runs, each with the parameter values the sweep's search picked. This stand-in keeps the
sweeps in memory (:meth:`Sweeps.sweep`: the config checked for what the server requires), picks values itself
(``method: random``: ``values`` drawn uniformly, ``distribution`` ``uniform``/``int_uniform``/``log_uniform_values``
between ``min`` and ``max``, from a generator seeded per sweep; ``grid``: ``values`` in order) and starts each run
as W&B's Python agent does (``wandb.agents.pyagent.Agent._run_job``): the run's values written to a config file
named by ``WANDB_SWEEP_PARAM_PATH``, ``WANDB_RUN_ID`` and ``WANDB_SWEEP_ID`` set, W&B torn down so that the
function's ``wandb.init`` reads them, the function called, the run finished. Runs are offline (``WANDB_MODE``).

Install it with :meth:`Sweeps.install` (monkeypatching ``wandb.sweep`` and ``wandb.agent``).
"""

from __future__ import annotations

import itertools
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

METHODS = ("random", "grid")
GOALS = ("minimize", "maximize")


class Sweeps:
    """The stand-in server: ``sweeps`` (id -> config), ``runs`` (id -> the runs its agents started)."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.sweeps: dict[str, dict] = {}
        self.runs: dict[str, list[dict]] = {}

    def install(self, monkeypatch: Any) -> Sweeps:
        import wandb

        monkeypatch.setattr(wandb, "sweep", self.sweep)
        monkeypatch.setattr(wandb, "agent", self.agent)
        return self

    def sweep(self, sweep: dict, entity: str | None = None, project: str | None = None, prior_runs: Any = None) -> str:
        config = sweep() if callable(sweep) else sweep
        problems = check(config)
        if problems:
            raise ValueError(f"Invalid sweep config: {problems}")  # the server's answer to a bad config
        sweep_id = f"sweep{len(self.sweeps):03d}"
        self.sweeps[sweep_id] = {"config": config, "entity": entity, "project": project}
        self.runs[sweep_id] = []
        return sweep_id

    def agent(self, sweep_id: str, function: Any = None, entity: str | None = None, project: str | None = None,
              count: int | None = None, **kwargs: Any) -> None:  # fmt: skip
        """``count`` runs of the sweep (a grid: until it is done), each calling ``function``."""
        import wandb

        picks = values(self.sweeps[sweep_id]["config"], np.random.default_rng(self.seed))
        try:
            for number, assignment in zip(range(count) if count is not None else itertools.count(), picks):
                self.runs[sweep_id].append(self._run_job(sweep_id, f"{sweep_id}r{number}", assignment, function))
        finally:
            wandb.teardown()  # the W&B service ends, the runs' files complete

    @staticmethod
    def _run_job(sweep_id: str, run_id: str, assignment: dict, function: Any) -> dict:
        """One run, started as W&B's agent starts it: its values in the config file W&B's ``init`` reads."""
        import wandb
        from wandb.sdk.lib import config_util

        folder = Path(os.environ.get(wandb.env.DIR, os.getcwd()), "wandb", f"sweep-{sweep_id}")
        path = folder / f"config-{run_id}.yaml"
        config_util.save_config_file_from_dict(str(path), {k: {"value": v} for k, v in assignment.items()})
        names = {wandb.env.RUN_ID: run_id, wandb.env.SWEEP_PARAM_PATH: str(path), wandb.env.SWEEP_ID: sweep_id}
        os.environ.update(names)
        try:
            wandb.teardown()
            function()
            summary = dict(wandb.run.summary) if wandb.run is not None else {}
            wandb.finish()
        finally:
            for name in names:
                os.environ.pop(name, None)
        return {"id": run_id, "config": assignment, "summary": summary}


def check(config: dict) -> list[str]:
    """What the W&B server refuses in a sweep config (the parts this stand-in reads)."""
    problems = []
    if config.get("method") not in METHODS:
        problems.append(f"method {config.get('method')!r} (stand-in: one of {METHODS})")
    metric = config.get("metric", {})
    if not isinstance(metric.get("name"), str) or metric.get("goal") not in GOALS:
        problems.append(f"metric {metric!r} needs a name and a goal in {GOALS}")
    parameters = config.get("parameters")
    if not isinstance(parameters, dict) or not parameters:
        problems.append("parameters: none")
    for name, spec in (parameters or {}).items():
        if "values" not in spec and not {"min", "max"} <= set(spec):
            problems.append(f"parameter {name}: needs values, or min and max")
    return problems


def values(config: dict, rng: np.random.Generator):
    """The parameter values of each run, in order."""
    parameters = config["parameters"]
    if config["method"] == "grid":
        names = list(parameters)
        for combination in itertools.product(*(parameters[n]["values"] for n in names)):
            yield dict(zip(names, combination))
        return
    while True:
        yield {name: draw(spec, rng) for name, spec in parameters.items()}


def draw(spec: dict, rng: np.random.Generator) -> Any:
    if "values" in spec:
        return spec["values"][int(rng.integers(len(spec["values"])))]
    low, high = spec["min"], spec["max"]
    distribution = spec.get(
        "distribution", "int_uniform" if isinstance(low, int) and isinstance(high, int) else "uniform"
    )
    if distribution == "int_uniform":
        return int(rng.integers(low, high + 1))
    if distribution == "log_uniform_values":
        return float(math.exp(rng.uniform(math.log(low), math.log(high))))
    return float(rng.uniform(low, high))
