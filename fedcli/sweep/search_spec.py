"""The `search:` and `pruner:` blocks of a sweep spec, checked whole before anything runs (docs/sweeps.md).

Apart from fedcli/sweep/search.py (which runs a search) so that reading a spec (fedcli/sweep/spec.py)
checks them without importing Optuna or the sweep's planning.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from fedcli.config.checks import suggest
from fedcli.errors import ConfigError

SAMPLERS = ("tpe", "random", "grid")
SEARCH_KEYS = ("sampler", "trials", "metric", "direction", "seed", "space")
PRUNERS: dict[str, tuple[str, ...]] = {  # type -> its options (besides `type`)
    "median": ("warmup", "startup_trials", "interval"),
    "successive_halving": ("warmup", "reduction_factor", "min_early_stopping_rate"),
    "hyperband": ("warmup", "reduction_factor"),
}
RANGES = ("uniform", "log_uniform", "int")


def _fail(key: str, what: str, got: Any) -> ConfigError:
    return ConfigError(f"{key} must be {what}; got {got!r}.")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_search(spec: Mapping[str, Any]) -> None:
    """Check the `search:` and `pruner:` blocks of a spec (no-op without them); ConfigError names key and fix."""
    search, pruner = spec.get("search"), spec.get("pruner")
    if search is None:
        if pruner is not None:
            raise ConfigError(
                "pruner needs a `search:` block (pruning stops search trials); add search: {...}, "
                "or drop pruner."
            )
        return
    if not isinstance(search, Mapping):
        raise _fail(
            "search",
            "a mapping such as {sampler: tpe, trials: 50, space: {client_lr: {log_uniform: [0.001, 1]}}}",
            search,
        )
    for key in search:
        if key not in SEARCH_KEYS:
            raise ConfigError(
                f"unknown search key {key!r}{suggest(key, list(SEARCH_KEYS))}; "
                f"valid: {', '.join(SEARCH_KEYS)}."
            )
    for key in ("grid", "variants"):
        if spec.get(key):
            raise ConfigError(
                f"a spec with `search:` takes no `{key}:`; move its keys into search.space "
                "(a list of values is a categorical choice), or drop search."
            )
    if len(spec.get("seeds", [0])) != 1:
        raise ConfigError(
            f"search trials run one seed each; got seeds: {spec['seeds']!r}. Give one seed, e.g. seeds: [0]."
        )
    sampler = search.get("sampler", "tpe")
    if sampler not in SAMPLERS:
        raise _fail("search.sampler", f"one of {', '.join(SAMPLERS)}", sampler)
    space = search.get("space")
    if not isinstance(space, Mapping) or not space:
        raise _fail(
            "search.space",
            "a mapping of config keys to ranges such as {client_lr: {log_uniform: "
            "[0.001, 1]}, hp.rho: [0.01, 0.1]}",
            space,
        )
    for key, value in space.items():
        check_range(str(key), value, sampler)
    trials = search.get("trials")
    if trials is None and sampler != "grid":
        raise ConfigError("search.trials is required: the number of trials to run, e.g. trials: 50.")
    if trials is not None and not (isinstance(trials, int) and not isinstance(trials, bool) and trials >= 1):
        raise _fail("search.trials", "an integer >= 1", trials)
    if trials is not None and trials > spec.get("max_trials", 1000):
        raise ConfigError(
            f"search.trials = {trials} is more than max_trials = {spec.get('max_trials', 1000)}; "
            f"raise the limit with `max_trials: {trials}` in the spec."
        )
    if search.get("direction", "max") not in ("max", "min"):
        raise _fail("search.direction", "max or min", search["direction"])
    if "metric" in search and not (isinstance(search["metric"], str) and search["metric"].strip()):
        raise _fail("search.metric", "a metric name such as accuracy or eval/loss", search["metric"])
    seed = search.get("seed", 0)
    if not (isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0):
        raise _fail("search.seed", "an integer >= 0 (the sampler's seed)", seed)
    if pruner is not None:
        check_pruner(pruner)


def check_range(key: str, value: Any, sampler: str) -> None:
    """One `search.space` entry: a list of choices, or {uniform|log_uniform|int: [low, high]}."""
    where = f"search.space.{key}"
    if isinstance(value, list):
        if not value or len({repr(v) for v in value}) != len(value):
            raise _fail(where, "a non-empty list of distinct choices such as [0.01, 0.1, 1]", value)
        if not all(v is None or isinstance(v, (str, int, float, bool)) for v in value):
            raise _fail(where, "a list of numbers or names", value)
        return
    if sampler == "grid":
        raise _fail(where, "a list of values with sampler: grid (a grid has no continuous range)", value)
    if not (isinstance(value, Mapping) and len(value) == 1 and next(iter(value)) in RANGES):
        raise _fail(
            where,
            "a list of choices or one of {uniform: [low, high]}, {log_uniform: [low, high]}, "
            "{int: [low, high]}",
            value,
        )
    kind, bounds = next(iter(value.items()))
    if not (
        isinstance(bounds, list)
        and len(bounds) == 2
        and all(_number(b) for b in bounds)
        and bounds[0] < bounds[1]
    ):
        raise _fail(f"{where}.{kind}", "[low, high] with low < high", bounds)
    if kind == "log_uniform" and bounds[0] <= 0:
        raise _fail(f"{where}.log_uniform", "[low, high] with 0 < low (a log scale)", bounds)
    if kind == "int" and not all(isinstance(b, int) for b in bounds):
        raise _fail(f"{where}.int", "[low, high] of integers", bounds)


def check_pruner(block: Any) -> None:
    if not (isinstance(block, Mapping) and block.get("type") in PRUNERS):
        raise _fail(
            "pruner", f"a mapping with type: {' | '.join(PRUNERS)}, e.g. {{type: median, warmup: 5}}", block
        )
    kind = block["type"]
    for key, value in block.items():
        if key == "type":
            continue
        if key not in PRUNERS[kind]:
            raise ConfigError(
                f"unknown pruner key {key!r} for type {kind}{suggest(key, list(PRUNERS[kind]))}; "
                f"valid: {', '.join(PRUNERS[kind])}."
            )
        low = 2 if key == "reduction_factor" else 1 if key in ("interval",) else 0
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
            raise _fail(f"pruner.{key}", f"an integer >= {low}", value)


def budget(search: Mapping[str, Any]) -> int:
    """The number of trials: `trials`, or with sampler: grid the size of the grid."""
    if search.get("trials") is not None:
        return int(search["trials"])
    return math.prod(len(v) for v in search["space"].values())
