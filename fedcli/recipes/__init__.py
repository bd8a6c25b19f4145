"""Built-in recipes: the shipped sweep specs (one YAML file each) that rerun the seed papers' claims.

`fedcli sweep --list-recipes` lists them, `fedcli sweep --recipe NAME` runs one and writes its
report, `make reproduce` runs them all into reproductions/ (docs/reproductions.md). A recipe is
a sweep spec (fedcli.sweeps) with three more keys:

- `paper`: the claim it reruns (paper, table or figure), shown by --list-recipes;
- `smoke`: overrides for `--smoke`, the seconds-long version `make test` runs so recipes do not
  rot: `base` and `report` are merged key by key, `grid` key by key, `seeds` and `variants` replaced;
  the experiment gets the suffix `-smoke` so smoke runs never mix with real ones;
- `study`: instead of training runs, a computation on a closed-form problem (fedcli.studies).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

RECIPE_DIR = Path(__file__).resolve().parent
SMOKE_SUFFIX = "-smoke"


def recipe_names() -> list[str]:
    """Names of the built-in recipes, sorted (the YAML file stems)."""
    return sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))


def read_recipe(name: str) -> dict[str, Any]:
    """The recipe's spec as written (KeyError if there is none)."""
    path = RECIPE_DIR / f"{name}.yaml"
    if not path.is_file():
        raise KeyError(name)
    from fedcli.config_checks import load_yaml

    return load_yaml(path.read_text(), f"recipe {path}")


def smoke_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The spec with its `smoke` overrides applied (see the module docstring)."""
    out = {k: v for k, v in spec.items() if k != "smoke"}
    smoke = spec.get("smoke") or {}
    for key in ("base", "grid", "report", "search"):  # search: a `search:` sweep's smoke budget (docs/sweeps.md)
        if key in smoke:
            out[key] = {**(out.get(key) or {}), **smoke[key]}
    for key in ("seeds", "variants"):
        if key in smoke:
            out[key] = smoke[key]
    out["experiment"] = f"{spec['experiment']}{SMOKE_SUFFIX}"
    return out
