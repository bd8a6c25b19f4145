"""A sweep spec: reading and checking it (YAML or a recipe) and expanding it into trials.

The keys a spec may hold are declared in fedcli/sweep/spec_keys.py (`SweepSpec`, `check_spec`). A
spec is used as the mapping it was read as.

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
from typing import Any

from fedcli.config.build import build_config
from fedcli.config.checks import NAME_MAX_BYTES, read_yaml, suggest
from fedcli.config.sections import SECTIONS, AlgorithmConfig, RunConfig
from fedcli.errors import ConfigError
from fedcli.sweep.spec_keys import MAX_TRIALS, check_spec


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
    """Read a spec file or a built-in recipe (fedcli.recipes) and check it (`check_spec`).

    `smoke` applies the spec's `smoke:` overrides (fedcli.recipes.smoke_spec), then checks it again.
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
    check_spec(spec)
    if smoke:
        if not spec.get("smoke") and not spec.get("study"):
            raise ConfigError(
                "--smoke needs a spec with a `smoke:` block (e.g. {base: {rounds: 2}, seeds: [0]})."
            )
        spec = recipes.smoke_spec(spec)
        check_spec(spec)
    return spec


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
    base = {dotted_key(k, aliases): v for k, v in (spec.get("base") or {}).items()}
    grid = {
        dotted_key(k, aliases): v if isinstance(v, list) else [v] for k, v in (spec.get("grid") or {}).items()
    }
    short = {
        dotted_key(k, aliases): k for k in (spec.get("grid") or {})
    }  # the names the user wrote, for labels
    seeds = spec.get("seeds", [0])
    variants = [
        (v.get("label"), {dotted_key(k, aliases): x for k, x in v.items() if k != "label"})
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
        hp = {k[3:]: v for k, v in values.items() if k.startswith("hp.") and has_hp(algo, k[3:])}
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


def dotted_key(key: str, aliases: Mapping[str, str]) -> str:
    if key.startswith("hp.") or key == "seed" or "." in key:
        return key
    if key not in aliases:
        raise ConfigError(
            f"unknown sweep key {key!r}{suggest(key, list(aliases))}; use a config key such as "
            "train.rounds or hp.<name>."
        )
    return aliases[key]


def has_hp(algo: str, name: str) -> bool:
    from fedcli.algorithms import ALGORITHMS

    record = ALGORITHMS.get(algo)
    return record is not None and name in {f.name for f in dataclasses.fields(record.config_cls)}
