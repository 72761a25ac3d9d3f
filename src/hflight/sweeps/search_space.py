"""A sweep's search space: Hydra's override grammar (and hydra-optuna-sweeper's older dict form) as Optuna
distributions, with the meaning hydra-optuna-sweeper gives each form.

``hydra.sweeper.params`` (and sweep overrides on the command line) take Hydra's grammar:

=====================================  ============================================================
``interval(0.0, 0.2)``                 ``FloatDistribution(0.0, 0.2)`` (ints at both ends: ``IntDistribution``)
``tag(log, interval(3e-4, 5e-3))``     the same with ``log=True``
``choice(16, 32, 64)``                 ``CategoricalDistribution([16, 32, 64])``
``range(1, 5)``                        ``IntDistribution(1, 5)``; ``range(0.0, 1.0, step=0.25)``: a stepped float,
                                       both ends included, as hydra-optuna-sweeper maps it (Hydra's own ``range``
                                       leaves the end out); ``shuffle(range(...))`` is a choice of its values
anything else (``args.seed=3``)        a fixed value, the same in every trial
=====================================  ============================================================

``hydra.sweeper.search_space`` (hydra-optuna-sweeper 1.1's form, still read by 1.3) maps a key to
``{type: int|float|categorical, low, high, log, step, choices}``; ``params`` wins where both name a key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep, Override, RangeSweep, Transformer
from optuna.distributions import (
    BaseDistribution,
    CategoricalChoiceType,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

from hflight.sweeps.study import SweepError

__all__ = ["distribution_from_dict", "grid_choices", "split_overrides"]

_PLAIN = (str, int, float, bool, type(None))


def _choices(override: Override) -> list[CategoricalChoiceType]:
    values = list(override.sweep_iterator(transformer=Transformer.encode))
    for value in values:
        if not isinstance(value, _PLAIN):
            raise SweepError(f"{override.input_line}: a choice takes strings, numbers, booleans or null, got {value!r}")
    return values


def _distribution(override: Override) -> BaseDistribution | str:
    """One override's distribution, or its value as a string when it is not a sweep."""
    if not override.is_sweep_override():
        return override.get_value_element_as_str()
    value = override.value()
    if override.is_choice_sweep():
        return CategoricalDistribution(_choices(override))
    if override.is_range_sweep():
        assert isinstance(value, RangeSweep)
        if value.shuffle:
            return CategoricalDistribution(_choices(override))
        if any(isinstance(v, float) for v in (value.start, value.stop, value.step)):
            return FloatDistribution(float(value.start), float(value.stop), step=float(value.step))
        return IntDistribution(int(value.start), int(value.stop), step=int(value.step))
    if override.is_interval_sweep():
        assert isinstance(value, IntervalSweep)
        log = "log" in value.tags
        if isinstance(value.start, int) and isinstance(value.end, int):
            return IntDistribution(value.start, value.end, log=log)
        return FloatDistribution(float(value.start), float(value.end), log=log)
    raise SweepError(f"{override.input_line}: the Optuna sweeper takes choice, range, interval or a fixed value")


def split_overrides(overrides: list[str]) -> tuple[dict[str, BaseDistribution], dict[str, str]]:
    """``(search space, fixed values)`` of ``key=value`` overrides in Hydra's grammar (see the module's table)."""
    space: dict[str, BaseDistribution] = {}
    fixed: dict[str, str] = {}
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.get_key_element()
        found = _distribution(override)
        if isinstance(found, BaseDistribution):
            space[key] = found
            fixed.pop(key, None)
        else:
            fixed[key] = found
            space.pop(key, None)
    return space, fixed


def distribution_from_dict(key: str, node: Mapping[str, Any]) -> BaseDistribution:
    """hydra-optuna-sweeper's dict form: ``{type: int|float|categorical, low, high, log, step, choices}``."""
    kind = str(node.get("type", "")).split(".")[-1]  # "float" or DistributionType.float
    unknown = set(node) - {"type", "low", "high", "log", "step", "choices"}
    if unknown:
        raise SweepError(f"hydra.sweeper.search_space.{key}: unknown keys {sorted(unknown)}")
    if kind == "categorical":
        if not node.get("choices"):
            raise SweepError(f"hydra.sweeper.search_space.{key}: a categorical distribution needs choices")
        return CategoricalDistribution(list(node["choices"]))
    if kind not in ("int", "float"):
        raise SweepError(f"hydra.sweeper.search_space.{key}: type must be int, float or categorical, got {kind!r}")
    if node.get("low") is None or node.get("high") is None:
        raise SweepError(f"hydra.sweeper.search_space.{key}: an {kind} distribution needs low and high")
    log, step = bool(node.get("log", False)), node.get("step")
    if kind == "int":
        return IntDistribution(int(node["low"]), int(node["high"]), log=log, step=1 if log else int(step or 1))
    return FloatDistribution(
        float(node["low"]), float(node["high"]), log=log, step=None if step is None else float(step)
    )


def grid_choices(key: str, distribution: BaseDistribution) -> list[Any]:
    """The values ``optuna.samplers.GridSampler`` tries for ``distribution`` (hydra-optuna-sweeper's: a range's
    values with the end left out, a choice's choices; a continuous interval has no grid and raises)."""
    if isinstance(distribution, CategoricalDistribution):
        return list(distribution.choices)
    step = getattr(distribution, "step", None)
    if isinstance(distribution, (IntDistribution, FloatDistribution)) and step is not None and not distribution.log:
        count = int((distribution.high - distribution.low) // step)
        return [distribution.low + i * step for i in range(count)]
    raise SweepError(f"{key}: GridSampler needs discrete values (choice or range), not {distribution}")
