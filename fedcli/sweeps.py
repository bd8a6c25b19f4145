"""Sweeps: expand a grid (algorithms x hyperparameters x seeds) into run configs and run them.

A sweep spec (YAML, DESIGN.md §9)::

    experiment: femnist-fedpa-vs-fedavg
    base: {task: femnist, rounds: 200, clients_per_round: 10, local_epochs: 5}
    grid: {algo: [fedavg, fedpa], hp.rho: [0.01, 0.1]}
    seeds: [0, 1, 2]
    report: {metric: accuracy, thresholds: [0.7, 0.8], at: [100, 200]}

Keys are config keys: dotted (`train.rounds`), short (`rounds`, `task`, `algo`, the last part
of a dotted key when unambiguous) or `hp.<name>` for algorithm hyperparameters. A grid
value applies only to algorithms that have that hyperparameter (so `hp.rho` does not
multiply FedAvg's runs). Trials whose config hash already finished in the experiment are
skipped, so an interrupted sweep resumes by running the same command again.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedcli.config import SECTIONS, RunConfig, build_config, read_yaml, suggest
from fedcli.errors import ConfigError

SPEC_KEYS = ("experiment", "base", "grid", "seeds", "report", "description")

RECIPES: Mapping[str, dict[str, Any]] = {
    "fedpa-vs-fedavg-femnist": {
        "description": "FedPA vs FedAvg on the bundled FEMNIST writers (MLP, 5 local epochs), 2 seeds",
        "experiment": "fedpa-vs-fedavg-femnist",
        "base": {"task": "femnist", "rounds": 60, "clients_per_round": 10, "local_epochs": 5,
                 "client_lr": 0.05, "client_momentum": 0.9, "server_opt": "momentum", "server_lr": 0.5},
        "grid": {"algo": ["fedavg", "fedpa"], "hp.burn_in_rounds": [20], "hp.rho": [0.1]},
        "seeds": [0, 1],
        "report": {"metric": "accuracy", "thresholds": [0.6, 0.7], "at": [30, 60]},
    },
    "fedopt-lsq": {
        "description": "FedAvg with the five server optimisers on federated least squares (dist_to_opt)",
        "experiment": "fedopt-lsq",
        "base": {"task": "lsq", "rounds": 50, "clients_per_round": 5, "local_epochs": 2, "client_lr": 0.01},
        "grid": {"server_opt": ["sgd", "momentum", "adam", "adagrad", "yogi"]},
        "seeds": [0],
        "report": {"metric": "dist_to_opt"},
    },
}


@dataclass(frozen=True)
class Trial:
    """One run of a sweep."""

    name: str
    config: RunConfig


def short_keys() -> dict[str, str]:
    """Map unambiguous short names (`rounds`, `task`) to dotted config keys."""
    names: dict[str, list[str]] = {}
    for section, cls in SECTIONS.items():
        for field in dataclasses.fields(cls):
            names.setdefault(field.name, []).append(f"{section}.{field.name}")
    out = {name: dotted[0] for name, dotted in names.items() if len(dotted) == 1}
    out.update({"algo": "algorithm.name", "model": "data.model", "scheme": "partition.scheme",
                "clients": "partition.num_clients", "alpha": "partition.alpha"})
    return out


def load_spec(path: Path | None, recipe: str | None) -> dict[str, Any]:
    """Read a spec file or a built-in recipe; check its top-level keys."""
    if recipe is not None:
        if recipe not in RECIPES:
            raise ConfigError(f"unknown recipe {recipe!r}{suggest(recipe, list(RECIPES))}; "
                              "`fedcli sweep --list-recipes` lists them.")
        spec = dict(RECIPES[recipe])
    elif path is not None:
        spec = read_yaml(path)
    else:
        raise ConfigError("fedcli sweep needs a SPEC.yaml or --recipe NAME.")
    for key in spec:
        if key not in SPEC_KEYS:
            raise ConfigError(f"unknown sweep key {key!r}{suggest(key, list(SPEC_KEYS))}; valid: {', '.join(SPEC_KEYS)}.")
    if "experiment" not in spec:
        raise ConfigError("a sweep spec needs `experiment: NAME`.")
    return spec


def expand(spec: Mapping[str, Any], tracking: Mapping[str, Any] | None = None) -> list[Trial]:
    """Return the validated trials of a spec, in grid order then seed order."""
    aliases = short_keys()
    base = {_dotted(k, aliases): v for k, v in (spec.get("base") or {}).items()}
    grid = {_dotted(k, aliases): v if isinstance(v, list) else [v] for k, v in (spec.get("grid") or {}).items()}
    short = {_dotted(k, aliases): k for k in (spec.get("grid") or {})}  # the names the user wrote, for labels
    seeds = spec.get("seeds", [0])
    trials, seen = [], set()
    for combo in itertools.product(*grid.values()):
        values = {**base, **dict(zip(grid, combo, strict=True))}
        algo = values.get("algorithm.name", "fedavg")
        hp = {k[3:]: v for k, v in values.items() if k.startswith("hp.") and _has_hp(algo, k[3:])}
        overrides = {k: v for k, v in values.items() if not k.startswith("hp.")}
        for seed in seeds:
            cfg = build_config(overrides={**overrides, **(tracking or {}), "seed": seed,
                                          "tracking.experiment": spec["experiment"]}, hp=hp)
            if cfg.config_hash in seen:
                continue
            seen.add(cfg.config_hash)
            label = ",".join(f"{short[k]}={v}" for k, v in zip(grid, combo, strict=True)
                             if not k.startswith("hp.") or k[3:] in hp)
            trials.append(Trial(name=f"{label or 'base'},seed={seed}", config=cfg))
    return trials


def _dotted(key: str, aliases: Mapping[str, str]) -> str:
    if key.startswith("hp.") or key == "seed" or "." in key:
        return key
    if key not in aliases:
        raise ConfigError(f"unknown sweep key {key!r}{suggest(key, list(aliases))}; use a config key such as "
                          "train.rounds or hp.<name>.")
    return aliases[key]


def _has_hp(algo: str, name: str) -> bool:
    from fedcli.algorithms import ALGORITHMS

    record = ALGORITHMS.get(algo)
    return record is not None and name in {f.name for f in dataclasses.fields(record.config_cls)}
