"""A sweep spec: reading it (YAML or a recipe), checking its keys and values, expanding it into trials.

Part of fedcli.sweep; fedcli/sweep/__init__.py describes how a sweep owns its trials and the
package's layout.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedcli.config.build import build_config
from fedcli.config.checks import NAME_MAX_BYTES, read_yaml, suggest
from fedcli.config.sections import SECTIONS, AlgorithmConfig, RunConfig
from fedcli.errors import ConfigError

if TYPE_CHECKING:
    pass


SPEC_KEYS = (
    "experiment",
    "base",
    "grid",
    "variants",
    "seeds",
    "report",
    "description",
    "paper",
    "smoke",
    "study",
    "max_trials",
    "search",
    "pruner",
    "data",
)  # search, pruner: fedcli/sweep/search_spec.py; data: fedcli/recipes
REPORT_KEYS = (
    "metric",
    "thresholds",
    "at",
    "window",
    "smooth",
    "group_by",
    "output",
    "columns",
)  # `fedcli report` options
MAX_TRIALS = 1000  # trials a spec may expand to unless it says `max_trials: N` (checked before expanding)


@dataclass(frozen=True)
class Trial:
    """One run of a sweep: a readable name (`fedpa rho=0.1 s0`, also its run name) and its config."""

    name: str
    config: RunConfig


def short_keys() -> dict[str, str]:
    """Map unambiguous short names (`rounds`, `task`) to dotted config keys."""
    names: dict[str, list[str]] = {}
    for section, cls in SECTIONS.items():
        for item in dataclasses.fields(cls):
            names.setdefault(item.name, []).append(f"{section}.{item.name}")
    out = {name: dotted[0] for name, dotted in names.items() if len(dotted) == 1}
    out.update(
        {
            "algo": "algorithm.name",
            "model": "data.model",
            "scheme": "partition.scheme",
            "clients": "partition.num_clients",
            "alpha": "partition.alpha",
        }
    )
    return out


def load_spec(path: Path | None, recipe: str | None, *, smoke: bool = False) -> dict[str, Any]:
    """Read a spec file or a built-in recipe (fedcli.recipes); check its top-level keys.

    `smoke` applies the spec's `smoke:` overrides (fedcli.recipes.smoke_spec).
    """
    from fedcli import recipes

    if recipe is not None:
        try:
            spec = recipes.read_recipe(recipe)
        except KeyError:
            raise ConfigError(
                f"unknown recipe {recipe!r}{suggest(recipe, recipes.recipe_names())}; "
                "`fedcli sweep --list-recipes` lists them."
            ) from None
    elif path is not None:
        spec = read_yaml(path)
    else:
        raise ConfigError("fedcli sweep needs a SPEC.yaml or --recipe NAME.")
    if not isinstance(spec, Mapping):
        raise ConfigError(
            f"a sweep spec must be a mapping of {', '.join(SPEC_KEYS)}; got {type(spec).__name__}."
        )
    for key in spec:
        if key not in SPEC_KEYS:
            raise ConfigError(
                f"unknown sweep key {key!r}{suggest(key, list(SPEC_KEYS))}; valid: {', '.join(SPEC_KEYS)}."
            )
    if "experiment" not in spec:
        raise ConfigError("a sweep spec needs `experiment: NAME`.")
    if spec.get("smoke") is not None and not isinstance(spec["smoke"], Mapping):
        raise ConfigError(
            f"smoke must be a mapping such as {{base: {{rounds: 2}}, seeds: [0]}}; got {spec['smoke']!r}."
        )
    if smoke:
        if not spec.get("smoke") and not spec.get("study"):
            raise ConfigError(
                "--smoke needs a spec with a `smoke:` block (e.g. {base: {rounds: 2}, seeds: [0]})."
            )
        spec = recipes.smoke_spec(spec)
    check_spec_values(spec)
    variants = spec.get("variants")
    if variants is not None and not (
        isinstance(variants, list) and all(isinstance(v, Mapping) for v in variants)
    ):
        raise ConfigError(
            "variants must be a list of mappings such as [{label: FedAvg-1E, algo: fedavg, "
            f"local_epochs: 1}}]; got {variants!r}."
        )
    report = spec.get("report")
    if report is not None and not isinstance(report, Mapping):
        raise ConfigError(
            f"report must be a mapping such as {{metric: accuracy, thresholds: [0.8]}}; got {report!r}."
        )
    for key in report or {}:
        if key not in REPORT_KEYS:
            raise ConfigError(
                f"unknown report key {key!r}{suggest(key, list(REPORT_KEYS))}; "
                f"valid: {', '.join(REPORT_KEYS)}."
            )
    check_report_values(report or {})
    if spec.get("search") is not None or spec.get("pruner") is not None:
        from fedcli.sweep.search_spec import check_search

        check_search(spec)
    return spec


def check_spec_values(spec: Mapping[str, Any]) -> None:
    """The type of every top-level value (a spec is data, not code: nothing is coerced)."""
    from fedcli.config.checks import INT_MAX, check_name

    if not isinstance(spec["experiment"], str):
        raise ConfigError(f"experiment must be a name (text); got {spec['experiment']!r}.")
    check_name("experiment", spec["experiment"], "`experiment:`")
    for key in ("base", "grid"):
        if spec.get(key) is not None and not isinstance(spec[key], Mapping):
            example = (
                "{task: lsq, rounds: 20}"
                if key == "base"
                else "{algo: [fedavg, fedprox], hp.mu: [0.01, 0.1]}"
            )
            raise ConfigError(
                f"{key} must be a mapping of config keys to values such as {example}; got {spec[key]!r}."
            )
    for key, values in (spec.get("grid") or {}).items():
        if isinstance(values, list) and not values:
            raise ConfigError(
                f"grid key {key} must have at least one value; got []. Give its values, or drop it."
            )
        if isinstance(values, Mapping):
            raise ConfigError(f"grid key {key} must be a list of values such as [0.01, 0.1]; got {values!r}.")
    seeds = spec.get("seeds", [0])
    if not (
        isinstance(seeds, list)
        and seeds
        and all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)
    ):
        raise ConfigError(
            f"seeds must be a non-empty list of integer seeds such as [0, 1, 2]; got {seeds!r}."
        )
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"seeds must not repeat a seed (a repeated seed is the same run); got {seeds!r}.")
    for key in ("description", "paper", "study"):
        if spec.get(key) is not None and not isinstance(spec[key], str):
            raise ConfigError(f"{key} must be text; got {spec[key]!r}.")
    limit = spec.get("max_trials", MAX_TRIALS)
    if not (isinstance(limit, int) and not isinstance(limit, bool) and 1 <= limit <= INT_MAX):
        raise ConfigError(f"max_trials must be an integer >= 1; got {limit!r}.")


def check_report_values(block: Mapping[str, Any]) -> None:
    """The values of a spec's `report:` block, as `fedcli report` checks its options (before any trial runs)."""

    def fail(key: str, what: str) -> ConfigError:
        return ConfigError(f"report.{key} must be {what}; got {block[key]!r}.")

    def numbers(key: str, kind: type) -> None:
        values = block.get(key)
        if values is None:
            return
        if not isinstance(values, list) or not values:
            raise fail(
                key,
                f"a list of {'round numbers' if kind is int else 'numbers'} such as "
                f"{'[100, 200]' if kind is int else '[0.7, 0.8]'}",
            )
        for value in values:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if kind is int:
                ok = ok and isinstance(value, int) and value >= 1
            if not ok or not math.isfinite(value):
                raise fail(key, "finite numbers" if kind is float else "round numbers >= 1")

    for key in ("metric", "output"):
        if key in block and not (isinstance(block[key], str) and block[key].strip()):
            raise fail(
                key, "a metric name such as accuracy or eval/loss" if key == "metric" else "a file path"
            )
    numbers("thresholds", float)
    numbers("at", int)
    for key in ("window", "smooth"):
        value = block.get(key)
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise fail(key, "an integer number of rounds >= 1")
    group_by = block.get("group_by")
    if group_by is not None and not (
        isinstance(group_by, str)
        and group_by.strip(" ,")
        or isinstance(group_by, list)
        and group_by
        and all(isinstance(k, str) and k.strip() for k in group_by)
    ):
        raise fail("group_by", 'config keys such as "algo,hp.rho" or [algo, hp.rho]')
    columns = block.get("columns")
    if columns is not None and not (
        isinstance(columns, list) and columns and all(isinstance(k, str) and k.strip() for k in columns)
    ):
        raise fail("columns", "a list of logged metric keys such as [fedsparse/sparsity]")


def check_report_keys(block: Mapping[str, Any], trials: Sequence[Trial]) -> None:
    """What can be known of a `report:` block before the trials run: its group-by keys name config
    keys of the trials, and an `eval/` metric is one the trials' tasks log (classification:
    accuracy, loss; regression and LSA: loss, dist_to_opt; other kinds are checked by the report)."""
    from fedcli.datasets.registry import TASKS
    from fedcli.tracking.keys import flatten_config
    from fedcli.tracking.report.model import resolve_key, resolve_metric

    group_by = block.get("group_by")
    if group_by is not None:
        known = sorted(
            {
                k
                for t in trials
                for k in flatten_config({k: v for k, v in t.config.to_dict().items() if k != "tracking"})
            }
        )
        for key in group_by.split(",") if isinstance(group_by, str) else group_by:
            if key.strip():
                resolve_key(key.strip(), known)
    metric = block.get("metric")
    if not metric:
        return
    name = resolve_metric(metric)
    kinds = {TASKS[t.config.data.task].kind if t.config.data.file is None else "byo" for t in trials}
    logged = {
        "classification": {"eval/loss", "eval/accuracy", "eval/dist_to_opt"},
        "regression": {"eval/loss", "eval/dist_to_opt"},
        "lsa": {"eval/loss", "eval/dist_to_opt"},
    }
    if name.startswith("eval/") and kinds <= set(logged) and not any(name in logged[k] for k in kinds):
        possible = sorted(set().union(*(logged[k] for k in kinds)))
        raise ConfigError(
            f"report.metric {metric!r} is not logged by the sweep's tasks ({', '.join(sorted(kinds))}); "
            f"they log {', '.join(possible)}. Pick one of those."
        )


def expand(spec: Mapping[str, Any], tracking: Mapping[str, Any] | None = None) -> list[Trial]:
    """Return the validated trials of a spec, in variant order, then grid order, then seed order.

    Each of `variants` (named overrides, e.g. FedPA's FedAvg-1E / FedAvg-ME / FedPA-ME) is crossed
    with the grid and the seeds; a variant's keys win over the grid's, the grid's over `base`.
    """
    aliases = short_keys()
    base = {_dotted(k, aliases): v for k, v in (spec.get("base") or {}).items()}
    grid = {
        _dotted(k, aliases): v if isinstance(v, list) else [v] for k, v in (spec.get("grid") or {}).items()
    }
    short = {_dotted(k, aliases): k for k in (spec.get("grid") or {})}  # the names the user wrote, for labels
    seeds = spec.get("seeds", [0])
    variants = [
        (v.get("label"), {_dotted(k, aliases): x for k, x in v.items() if k != "label"})
        for v in spec.get("variants") or [{}]
    ]
    count = len(variants) * math.prod(len(values) for values in grid.values()) * len(seeds)
    limit = spec.get("max_trials", MAX_TRIALS)
    if count > limit:  # before any config is built: a huge grid is refused by its size, in no time
        sizes = " x ".join(str(n) for n in (len(variants), *(len(v) for v in grid.values()), len(seeds)))
        raise ConfigError(
            f"the sweep spec expands to {count:,} trials (variants x grid values x seeds: {sizes}), more "
            f"than max_trials = {limit}; shrink the grid, or raise the limit with `max_trials: {count}` "
            "in the spec."
        )
    check_hp_keys(base, grid, [v for _, v in variants])
    trials, seen = [], set()
    for (label, variant), combo in itertools.product(variants, itertools.product(*grid.values())):
        values = {**base, **dict(zip(grid, combo, strict=True)), **variant}
        algo = values.get("algorithm.name", "fedavg")
        hp = {k[3:]: v for k, v in values.items() if k.startswith("hp.") and _has_hp(algo, k[3:])}
        overrides = {k: v for k, v in values.items() if not k.startswith("hp.")}
        for seed in seeds:
            cfg = build_config(
                overrides={
                    **overrides,
                    **(tracking or {}),
                    "seed": seed,
                    "tracking.experiment": spec["experiment"],
                },
                hp=hp,
            )
            if cfg.config_hash in seen:
                continue
            seen.add(cfg.config_hash)
            shown = [
                (short[k], v)
                for k, v in zip(grid, combo, strict=True)
                if k != "algorithm.name" and k not in variant and (not k.startswith("hp.") or k[3:] in hp)
            ]
            name = trial_name(label or cfg.algorithm.name, shown, seed)
            if len(name.encode()) > NAME_MAX_BYTES:
                raise ConfigError(
                    f"trial name {name[:60]!r}... (its run name) must be at most {NAME_MAX_BYTES} bytes; "
                    f"got {len(name.encode())}. Shorten the variant labels or the grid's values and keys."
                )
            trials.append(Trial(name=name, config=cfg))
    return trials


def check_hp_keys(
    base: Mapping[str, Any], grid: Mapping[str, list], variants: Sequence[Mapping[str, Any]]
) -> None:
    """Every `hp.<name>` key of a spec must be a hyperparameter of at least one of its algorithms
    (a key that applies to none would sweep nothing, silently)."""
    from fedcli.algorithms import ALGORITHMS

    names = {str(v) for v in grid.get("algorithm.name", [])}
    names |= {str(src["algorithm.name"]) for src in (base, *variants) if "algorithm.name" in src}
    if (
        "algorithm.name" not in base
        and "algorithm.name" not in grid
        and any("algorithm.name" not in v for v in variants)
    ):
        names.add(AlgorithmConfig.name)  # trials that name no algorithm run the default
    known = {
        n: {f.name for f in dataclasses.fields(ALGORITHMS[n].config_cls)} for n in names if n in ALGORITHMS
    }
    if not known:
        return  # only unknown algorithms: build_config names them
    for key in [*base, *grid, *(k for v in variants for k in v)]:
        if key.startswith("hp.") and not any(key[3:] in fields for fields in known.values()):
            valid = "; ".join(
                f"{n}: {', '.join(f'hp.{f}' for f in sorted(fields)) or 'none'}"
                for n, fields in sorted(known.items())
            )
            raise ConfigError(
                f"sweep key {key} is a hyperparameter of none of the sweep's algorithms "
                f"({', '.join(sorted(known))}){suggest(key, [f'hp.{f}' for fs in known.values() for f in fs])}; "
                f"valid: {valid}."
            )


def trial_name(algo: str, shown: Sequence[tuple[str, Any]], seed: int) -> str:
    """`fedpa rho=0.1 s0`: the algorithm, each varying grid value under its last key part, the seed."""
    parts = [f"{key.split('.')[-1]}={value}" for key, value in shown]
    return " ".join([algo, *parts, f"s{seed}"])


def spec_hash(spec: Mapping[str, Any]) -> str:
    """sha256 of what decides a sweep's trials (experiment, base, grid, seeds); its MLflow parent's tag."""
    body = {key: spec.get(key) for key in ("experiment", "base", "grid", "seeds")}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def _dotted(key: str, aliases: Mapping[str, str]) -> str:
    if key.startswith("hp.") or key == "seed" or "." in key:
        return key
    if key not in aliases:
        raise ConfigError(
            f"unknown sweep key {key!r}{suggest(key, list(aliases))}; use a config key such as "
            "train.rounds or hp.<name>."
        )
    return aliases[key]


def _has_hp(algo: str, name: str) -> bool:
    from fedcli.algorithms import ALGORITHMS

    record = ALGORITHMS.get(algo)
    return record is not None and name in {f.name for f in dataclasses.fields(record.config_cls)}
