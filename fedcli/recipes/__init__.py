"""Built-in recipes: the shipped sweep specs (one YAML file each) that rerun the seed papers' claims.

`fedcli sweep --list-recipes` lists them, `fedcli sweep --recipe NAME` runs one and writes its
report, `make reproduce` runs them all into reproductions/ (docs/reproductions.md). A recipe is
a sweep spec (fedcli.sweep) with three more keys:

- `paper`: the claim it reruns (paper, table or figure), shown by --list-recipes;
- `smoke`: overrides for `--smoke`, the seconds-long version `make test` runs so recipes do not
  rot: `base` and `report` are merged key by key, `grid` key by key, `seeds` and `variants` replaced;
  the experiment gets the suffix `-smoke` so smoke runs never mix with real ones;
- `study`: instead of training runs, a computation on a closed-form problem (fedcli.studies);
- `data` (paper-scale recipes; docs/scaling.md, "The recipes and their files"): `{source: where the files come from, generate: {format,
  clients, mean_size}}`. The files are not bundled: the recipe runs on `--data-dir`; its `--smoke`
  without `--data-dir` writes a small federation in the same format (fedcli.datasets.formats.generate)
  under <root>/smoke-data/ and runs on that. `--dry-run` probes its trials (fedcli.sweep.estimate);
  `make reproduce` skips these recipes unless `--only` names them.
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
    from fedcli.config.checks import load_yaml

    return load_yaml(path.read_text(), f"recipe {path}")


def smoke_data(spec: Mapping[str, Any], root: Path) -> Path | None:
    """The generated federation of a `data: {generate: ...}` recipe's smoke form (written once, then
    reused): <root>/smoke-data/<experiment>; None when the recipe generates nothing."""
    from fedcli.errors import ConfigError

    block = spec.get("data") or {}
    gen = block.get("generate") if isinstance(block, Mapping) else None
    if not gen:
        return None
    if not isinstance(gen, Mapping) or not {"format", "clients"} <= gen.keys():
        raise ConfigError(
            f"data.generate must be a mapping with format and clients, e.g. {{format: emnist, "
            f"clients: 12, mean_size: 8}}; got {gen!r}."
        )
    from fedcli.datasets.formats.generate import generate

    folder = Path(root) / "smoke-data" / str(spec["experiment"])
    done = folder / ".generated"
    if not done.exists():
        generate(
            str(gen["format"]),
            int(gen["clients"]),
            folder,
            int(gen.get("seed", 0)),
            mean_size=gen.get("mean_size"),
            quiet=True,
        )
        done.write_text("ok\n")
    return folder.resolve()


def smoke_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The spec with its `smoke` overrides applied (see the module docstring)."""
    out = {k: v for k, v in spec.items() if k != "smoke"}
    smoke = spec.get("smoke") or {}
    # merged key by key; search: a `search:` sweep's smoke budget (docs/sweeps.md)
    out.update(
        {k: {**(out.get(k) or {}), **smoke[k]} for k in ("base", "grid", "report", "search") if k in smoke}
    )
    out.update({key: smoke[key] for key in ("seeds", "variants") if key in smoke})
    out["experiment"] = f"{spec['experiment']}{SMOKE_SUFFIX}"
    return out
