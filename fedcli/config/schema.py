"""JSON Schemas of a run config and of a sweep spec, generated from their declarations.

`python -m fedcli.config.schema` writes docs/schema/run-config.schema.json (from RunConfig,
fedcli/config/sections.py: each field's help as its description, choices as enums, bounds and
defaults) and docs/schema/sweep-spec.schema.json (from `SweepSpec` below: the top-level keys of
a spec, fedcli/sweep/spec.py SPEC_KEYS, with the report, search and pruner blocks). tests/config/
test_schema.py regenerates both and fails when the committed files differ, and validates the
packaged configs and recipes against them. docs/guide.md, "Config files", says how to point an
editor at them.

The sweep schema describes what fedcli/sweep/spec.py and search_spec.py check by hand; `SweepSpec`
is declared for the schema only (a spec is read as a mapping, not built into it). Part of the package
fedcli.config (fedcli/config/__init__.py); imports `sections` and `checks`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic

from fedcli.config.checks import INT_MAX
from fedcli.config.sections import SECTION, RunConfig, opt
from fedcli.sweep.search_spec import PRUNERS, SAMPLERS
from fedcli.sweep.spec import MAX_TRIALS

DRAFT = "https://json-schema.org/draft/2020-12/schema"
FOLDER = Path(__file__).resolve().parents[2] / "docs" / "schema"
RUN_CONFIG = "run-config.schema.json"
SWEEP_SPEC = "sweep-spec.schema.json"
POSITIVE = {"type": "integer", "minimum": 1}


@dataclass(frozen=True, kw_only=True)
class ReportBlock:
    __pydantic_config__ = SECTION
    metric: str | None = opt(None, "the metric compared, e.g. accuracy or eval/loss")
    thresholds: list[float] | None = opt(None, "report the round each trial first reaches these values")
    at: list[int] | None = opt(None, "rounds to report the metric at, e.g. [100, 200]", items={"minimum": 1})
    window: int | None = opt(None, "rounds averaged at each `at` round", ge=1)
    smooth: int | None = opt(None, "rounds of the moving average of the curves", ge=1)
    group_by: str | list[str] | None = opt(
        None, 'config keys the rows are grouped by: "algo,hp.rho" or [algo, hp.rho]'
    )
    output: str | None = opt(None, "a file the report is written to")
    columns: list[str] | None = opt(
        None, "logged metric keys shown as extra columns, e.g. [fedsparse/sparsity]"
    )


@dataclass(frozen=True, kw_only=True)
class SearchBlock:
    __pydantic_config__ = SECTION
    sampler: str = opt("tpe", "Optuna sampler", choices=SAMPLERS)
    trials: int | None = opt(None, "trials to run (required unless sampler: grid)", ge=1)
    metric: str | None = opt(None, "the metric optimised, e.g. accuracy or eval/loss")
    direction: str = opt("max", "max or min", choices=("max", "min"))
    seed: int = opt(0, "the sampler's seed", ge=0)
    space: Mapping[str, Any] = opt(
        factory=dict,
        doc="config key -> a list of choices, or one of {uniform: [low, high]}, {log_uniform: [low, high]}, "
        "{int: [low, high]}",
        additionalProperties={
            "anyOf": [
                {"type": "array", "minItems": 1},
                *(
                    {
                        "type": "object",
                        "properties": {k: {"type": "array", "minItems": 2, "maxItems": 2}},
                        "required": [k],
                        "additionalProperties": False,
                    }
                    for k in ("uniform", "log_uniform", "int")
                ),
            ]
        },
    )


@dataclass(frozen=True, kw_only=True)
class PrunerBlock:
    __pydantic_config__ = SECTION
    type: str = opt(doc="the Optuna pruner", choices=tuple(PRUNERS))
    warmup: int | None = opt(None, "rounds before a trial may be pruned", ge=0)
    startup_trials: int | None = opt(None, "median: trials that run unpruned first", ge=0)
    interval: int | None = opt(None, "median: rounds between checks", ge=1)
    reduction_factor: int | None = opt(None, "successive_halving, hyperband: the reduction factor", ge=2)
    min_early_stopping_rate: int | None = opt(
        None, "successive_halving: the minimum early-stopping rate", ge=0
    )


@dataclass(frozen=True, kw_only=True)
class SweepSpec:
    __pydantic_config__ = SECTION
    experiment: str = opt(doc="the experiment the trials are stored under (a name, at most 200 bytes)")
    base: Mapping[str, Any] | None = opt(
        None, "config keys and values every trial shares: dotted (train.rounds) or short (rounds, task, algo)"
    )
    grid: Mapping[str, list[Any]] | None = opt(
        None, "config key -> list of values; the trials are the product of the lists"
    )
    variants: list[Mapping[str, Any]] | None = opt(
        None,
        "a list of settings, each a mapping of config keys (with an optional label), crossed with the grid",
    )
    seeds: list[int] = opt(
        factory=lambda: [0], doc="seeds each setting runs with (distinct)", minItems=1, uniqueItems=True
    )
    report: ReportBlock | None = opt(None, "the `fedcli report` options of the sweep's table")
    description: str | None = opt(None, "one line on what the sweep compares")
    paper: str | None = opt(None, "the paper and figure or table it reproduces")
    smoke: Mapping[str, Any] | None = opt(
        None, "overrides of these keys for `--smoke` (a few rounds on little data), e.g. {base: {rounds: 2}}"
    )
    study: str | None = opt(None, "a study that runs the recipe instead of trials (fedcli/recipes)")
    max_trials: int = opt(MAX_TRIALS, "the most trials the spec may expand to", ge=1, le=INT_MAX)
    search: SearchBlock | None = opt(None, "an Optuna search instead of a grid (docs/sweeps.md)")
    pruner: PrunerBlock | None = opt(None, "stops search trials early; needs search")
    data: Mapping[str, Any] | None = opt(
        None,
        "paper-scale recipes: {source: where the files come from, generate: {format, clients, mean_size}}",
    )


def _document(schema: dict[str, Any], title: str, description: str) -> dict[str, Any]:
    return {"$schema": DRAFT, "title": title, "description": description, **schema}


def run_config_schema() -> dict[str, Any]:
    """The JSON Schema of a run config file (`fedcli train --config FILE`), from RunConfig's declaration."""
    schema = pydantic.TypeAdapter(RunConfig).json_schema()
    schema.pop("title", None)
    return _document(
        schema,
        "fedcli run config",
        "A run's config file (fedcli train --config FILE): any of the sections and seed; generated by "
        "python -m fedcli.config.schema from fedcli/config/sections.py.",
    )


def sweep_spec_schema() -> dict[str, Any]:
    """The JSON Schema of a sweep spec (`fedcli sweep SPEC.yaml`, fedcli/recipes)."""
    schema = pydantic.TypeAdapter(SweepSpec).json_schema()
    schema.pop("title", None)
    return _document(
        schema,
        "fedcli sweep spec",
        "A sweep spec (fedcli sweep SPEC.yaml) or recipe; generated by python -m fedcli.config.schema "
        "from fedcli/config/schema.py.",
    )


def render(schema: Mapping[str, Any]) -> str:
    """The committed form: indented JSON, keys in declaration order, a final newline."""
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def write(folder: Path = FOLDER) -> list[Path]:
    """Write both schemas into `folder`; return their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name, schema in ((RUN_CONFIG, run_config_schema()), (SWEEP_SPEC, sweep_spec_schema())):
        path = folder / name
        path.write_text(render(schema))
        out.append(path)
    return out


if __name__ == "__main__":
    for written in write(Path(sys.argv[1]) if len(sys.argv) > 1 else FOLDER):
        print(written)
