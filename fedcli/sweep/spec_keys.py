"""The keys a sweep spec may hold, declared once, and the checks against them.

`SweepSpec` (with its `report:`, `search:` and `pruner:` blocks) declares what a spec may hold: each
key's type, bounds, help (the JSON Schema's description, docs/schema/sweep-spec.schema.json, written
by fedcli/config/schema.py) and what its value `must` be (the phrase of the error line). `check_spec`
validates a spec with pydantic against it (strict: a spec is data, nothing is coerced) and
`spec_error` turns the first problem into the one line of docs/style.md rule 11; the rules that
relate keys are the blocks' `__post_init__`; `check_range` checks one `search.space` entry.

Part of fedcli.sweep; fedcli/sweep/spec.py reads a spec and expands it into trials.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args

import pydantic
from pydantic import Field, StrictFloat, StrictInt, StrictStr, StringConstraints

from fedcli.config.checks import INT_MAX, check_name, suggest
from fedcli.errors import ConfigError

MAX_TRIALS = 1000  # trials a spec may expand to unless it says `max_trials: N` (checked before expanding)
SPEC = pydantic.ConfigDict(extra="forbid", allow_inf_nan=False)  # an undeclared key is refused
Text = Annotated[str, StringConstraints(strict=True, pattern=r"\S")]  # not blank
Texts = Annotated[list[Text], Field(min_length=1)]
Sampler = Literal["tpe", "random", "grid"]
Pruner = Literal["median", "successive_halving", "hyperband"]
PRUNERS: dict[Pruner, tuple[str, ...]] = {  # type -> its options (besides `type`)
    "median": ("warmup", "startup_trials", "interval"),
    "successive_halving": ("warmup", "reduction_factor", "min_early_stopping_rate"),
    "hyperband": ("warmup", "reduction_factor"),
}
RANGES = ("uniform", "log_uniform", "int")


def spec_key(default: Any = dataclasses.MISSING, doc: str = "", must: str = "", **pydantic_args: Any) -> Any:
    """A spec key: its default, help `doc`, what its value `must` be (`spec_error`; a key without it is
    reported as its block) and pydantic's field arguments (`ge`, `le`, `json_schema_extra`)."""
    meta = {"description": doc, **({"must": must} if must else {}), **pydantic_args}
    return dataclasses.field(default=default, metadata=meta)


@dataclass(frozen=True, kw_only=True)
class ReportBlock:
    """`report:`, the `fedcli report` options of the sweep's table (checked before any trial runs)."""

    __pydantic_config__ = SPEC
    metric: Text = spec_key(
        None, "the metric compared, e.g. accuracy or eval/loss", "a metric name such as accuracy or eval/loss"
    )
    thresholds: Annotated[list[StrictFloat], Field(min_length=1)] | None = spec_key(
        None, "report the round each trial first reaches these values", "finite numbers"
    )
    at: Annotated[list[Annotated[StrictInt, Field(ge=1)]], Field(min_length=1)] | None = spec_key(
        None, "rounds to report the metric at, e.g. [100, 200]", "round numbers >= 1"
    )
    window: StrictInt | None = spec_key(
        None, "rounds averaged at each `at` round", "an integer number of rounds >= 1", ge=1
    )
    smooth: StrictInt | None = spec_key(
        None, "rounds of the moving average of the curves", "an integer number of rounds >= 1", ge=1
    )
    group_by: Annotated[str, StringConstraints(strict=True, pattern=r"[^ ,]")] | Texts | None = spec_key(
        None,
        'config keys the rows are grouped by: "algo,hp.rho" or [algo, hp.rho]',
        'config keys such as "algo,hp.rho" or [algo, hp.rho]',
    )
    output: Text = spec_key(None, "a file the report is written to", "a file path")
    columns: Texts | None = spec_key(
        None,
        "logged metric keys shown as extra columns, e.g. [fedsparse/sparsity]",
        "a list of logged metric keys such as [fedsparse/sparsity]",
    )


@dataclass(frozen=True, kw_only=True)
class SearchBlock:
    """`search:`, an Optuna search instead of a grid (docs/sweeps.md; run by fedcli/sweep/search.py)."""

    __pydantic_config__ = SPEC
    sampler: Sampler = spec_key("tpe", "Optuna sampler", f"one of {', '.join(get_args(Sampler))}")
    trials: StrictInt | None = spec_key(
        None, "trials to run (required unless sampler: grid)", "an integer >= 1", ge=1
    )
    metric: Text = spec_key(
        None,
        "the metric optimised, e.g. accuracy or eval/loss",
        "a metric name such as accuracy or eval/loss",
    )
    direction: Literal["max", "min"] = spec_key("max", "max or min", "max or min")
    seed: StrictInt = spec_key(0, "the sampler's seed", "an integer >= 0 (the sampler's seed)", ge=0)
    space: Annotated[Mapping[str, Any], Field(min_length=1)] = spec_key(
        doc="config key -> a list of choices, or one of {uniform: [low, high]}, {log_uniform: [low, high]}, "
        "{int: [low, high]}",
        must="a mapping of config keys to ranges such as {client_lr: {log_uniform: [0.001, 1]}, hp.rho: "
        "[0.01, 0.1]}",
        json_schema_extra={
            "additionalProperties": {
                "anyOf": [
                    {"type": "array", "minItems": 1},
                    *(
                        {
                            "type": "object",
                            "properties": {k: {"type": "array", "minItems": 2, "maxItems": 2}},
                            "required": [k],
                            "additionalProperties": False,
                        }
                        for k in RANGES
                    ),
                ]
            }
        },
    )

    def __post_init__(self) -> None:
        for name, value in self.space.items():
            check_range(name, value, self.sampler)
        if self.trials is None and self.sampler != "grid":
            raise ConfigError("search.trials is required: the number of trials to run, e.g. trials: 50.")


@dataclass(frozen=True, kw_only=True)
class PrunerBlock:
    """`pruner:`, which stops search trials early. median takes warmup, startup_trials, interval;
    successive_halving warmup, reduction_factor, min_early_stopping_rate; hyperband warmup, reduction_factor."""

    __pydantic_config__ = SPEC
    type: Pruner = spec_key(doc="the Optuna pruner")
    warmup: StrictInt = spec_key(None, "rounds before a trial may be pruned", "an integer >= 0", ge=0)
    startup_trials: StrictInt = spec_key(
        None, "median: trials that run unpruned first", "an integer >= 0", ge=0
    )
    interval: StrictInt = spec_key(None, "median: rounds between checks", "an integer >= 1", ge=1)
    reduction_factor: StrictInt = spec_key(
        None, "successive_halving, hyperband: the reduction factor", "an integer >= 2", ge=2
    )
    min_early_stopping_rate: StrictInt = spec_key(
        None, "successive_halving: the minimum early-stopping rate", "an integer >= 0", ge=0
    )

    def __post_init__(self) -> None:
        valid = PRUNERS[self.type]
        for name in (f.name for f in dataclasses.fields(self)):
            if name != "type" and getattr(self, name) is not None and name not in valid:
                raise ConfigError(
                    f"unknown pruner key {name!r} for type {self.type}{suggest(name, valid)}; "
                    f"valid: {', '.join(valid)}."
                )


@dataclass(frozen=True, kw_only=True)
class SweepSpec:
    """A sweep spec (docs/sweeps.md); fedcli/recipes adds `study`, `paper` and `data`."""

    __pydantic_config__ = SPEC
    experiment: StrictStr = spec_key(
        doc="the experiment the trials are stored under (a name, at most 200 bytes)", must="a name (text)"
    )
    base: Mapping[str, Any] | None = spec_key(
        None,
        "config keys and values every trial shares: dotted (train.rounds) or short (rounds, task, algo)",
        "a mapping of config keys to values such as {task: lsq, rounds: 20}",
    )
    grid: Mapping[str, Any] | None = spec_key(
        None,
        "config key -> list of values; the trials are the product of the lists",
        "a mapping of config keys to values such as {algo: [fedavg, fedprox], hp.mu: [0.01, 0.1]}",
    )
    variants: list[Mapping[str, Any]] | None = spec_key(
        None,
        "a list of settings, each a mapping of config keys (with an optional label), crossed with the grid",
        "a list of mappings such as [{label: FedAvg-1E, algo: fedavg, local_epochs: 1}]",
    )
    seeds: Annotated[list[StrictInt], Field(min_length=1)] = spec_key(
        (0,),
        "seeds each setting runs with (distinct)",
        "a non-empty list of integer seeds such as [0, 1, 2]",
        json_schema_extra={"uniqueItems": True},
    )
    report: ReportBlock | None = spec_key(
        None,
        "the `fedcli report` options of the sweep's table",
        "a mapping such as {metric: accuracy, thresholds: [0.8]}",
    )
    description: StrictStr | None = spec_key(None, "one line on what the sweep compares", "text")
    paper: StrictStr | None = spec_key(None, "the paper and figure or table it reproduces", "text")
    smoke: Mapping[str, Any] | None = spec_key(
        None,
        "overrides of these keys for `--smoke` (a few rounds on little data), e.g. {base: {rounds: 2}}",
        "a mapping such as {base: {rounds: 2}, seeds: [0]}",
    )
    study: StrictStr | None = spec_key(
        None, "a study that runs the recipe instead of trials (fedcli/recipes)", "text"
    )
    max_trials: StrictInt = spec_key(
        MAX_TRIALS, "the most trials the spec may expand to", "an integer >= 1", ge=1, le=INT_MAX
    )
    search: SearchBlock | None = spec_key(
        None,
        "an Optuna search instead of a grid (docs/sweeps.md)",
        "a mapping such as {sampler: tpe, trials: 50, space: {client_lr: {log_uniform: [0.001, 1]}}}",
    )
    pruner: PrunerBlock | None = spec_key(
        None,
        "stops search trials early; needs search",
        f"a mapping with type: {' | '.join(PRUNERS)}, e.g. {{type: median, warmup: 5}}",
    )
    data: Mapping[str, Any] | None = spec_key(
        None,
        "paper-scale recipes: {source: where the files come from, generate: {format, clients, mean_size}}",
        "a mapping such as {source: URL, generate: {format: emnist, clients: 12}}",
    )

    def __post_init__(self) -> None:
        check_name("experiment", self.experiment, "`experiment:`")
        for name, values in (self.grid or {}).items():
            if values == []:
                raise ConfigError(
                    f"grid key {name} must have at least one value; got []. Give its values, or drop it."
                )
            if isinstance(values, Mapping):
                raise ConfigError(
                    f"grid key {name} must be a list of values such as [0.01, 0.1]; got {values!r}."
                )
        if len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(
                f"seeds must not repeat a seed (a repeated seed is the same run); got {self.seeds!r}."
            )
        if self.search is None:
            if self.pruner is not None:
                raise ConfigError(
                    "pruner needs a `search:` block (pruning stops search trials); add search: {...}, "
                    "or drop pruner."
                )
            return
        for name in ("grid", "variants"):
            if getattr(self, name):
                raise ConfigError(
                    f"a spec with `search:` takes no `{name}:`; move its keys into search.space "
                    "(a list of values is a categorical choice), or drop search."
                )
        if len(self.seeds) != 1:
            raise ConfigError(
                f"search trials run one seed each; got seeds: {self.seeds!r}. Give one seed, e.g. seeds: [0]."
            )
        if self.search.trials is not None and self.search.trials > self.max_trials:
            raise ConfigError(
                f"search.trials = {self.search.trials} is more than max_trials = {self.max_trials}; "
                f"raise the limit with `max_trials: {self.search.trials}` in the spec."
            )


SPEC_KEYS = tuple(f.name for f in dataclasses.fields(SweepSpec))
REPORT_KEYS = tuple(f.name for f in dataclasses.fields(ReportBlock))  # `fedcli report` options
SEARCH_KEYS = tuple(f.name for f in dataclasses.fields(SearchBlock))
BLOCKS: dict[str, type] = {"report": ReportBlock, "search": SearchBlock, "pruner": PrunerBlock}


def check_spec(spec: Any) -> None:
    """Validate a spec against `SweepSpec`; ConfigError: its first problem as one line (`spec_error`)."""
    try:
        pydantic.TypeAdapter(SweepSpec).validate_python(spec)
    except pydantic.ValidationError as exc:
        raise spec_error(exc, spec) from None


def spec_error(exc: pydantic.ValidationError, spec: Any) -> ConfigError:
    """The first problem pydantic found in a spec (an unknown or missing key first) as one line: `unknown
    sweep key 'gird' (did you mean 'grid'?); valid: ...`, `a sweep spec needs `experiment: NAME``, or
    `KEY must be WHAT; got VALUE.` with WHAT the `must` of the deepest key on the error's path that has one."""
    unknown = ("unexpected_keyword_argument", "invalid_key")  # a key not declared; one not text
    first = min(exc.errors(), key=lambda e: (e["type"] not in unknown, e["type"] != "missing"))
    loc = [str(part) for part in first["loc"]]
    if first["type"] == "missing" and len(loc) == 1:
        return ConfigError(f"a sweep spec needs `{loc[0]}: NAME`.")
    cls: type | None = SweepSpec
    path: list[str] = []
    said = None
    for part in loc:
        item = next((f for f in dataclasses.fields(cls) if f.name == part), None) if cls else None
        if item is None:
            break
        path.append(part)
        said = (".".join(path), item.metadata["must"]) if "must" in item.metadata else said
        cls = BLOCKS.get(part)
    if first["type"] in unknown and cls is not None:
        name, valid, kind = loc[len(path)], [f.name for f in dataclasses.fields(cls)], ""
        if cls is PrunerBlock and spec["pruner"].get("type") in tuple(PRUNERS):  # the options of its type
            kind, valid = f" for type {spec['pruner']['type']}", list(PRUNERS[spec["pruner"]["type"]])
        return ConfigError(
            f"unknown {path[-1] if path else 'sweep'} key {name!r}{kind}{suggest(name, valid)}; "
            f"valid: {', '.join(valid)}."
        )
    if said is None:
        return ConfigError(
            f"a sweep spec must be a mapping of {', '.join(SPEC_KEYS)}; got {type(spec).__name__}."
        )
    value = spec
    for part in said[0].split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
    return ConfigError(f"{said[0]} must be {said[1]}; got {value!r}.")


def check_range(name: str, value: Any, sampler: str) -> None:
    """One `search.space` entry: a list of choices, or {uniform|log_uniform|int: [low, high]}."""
    where = f"search.space.{name}"

    def fail(what: str, got: Any, at: str = where) -> ConfigError:
        return ConfigError(f"{at} must be {what}; got {got!r}.")

    if isinstance(value, list):
        if not value or len({repr(v) for v in value}) != len(value):
            raise fail("a non-empty list of distinct choices such as [0.01, 0.1, 1]", value)
        if not all(v is None or isinstance(v, (str, int, float, bool)) for v in value):
            raise fail("a list of numbers or names", value)
        return
    if sampler == "grid":
        raise fail("a list of values with sampler: grid (a grid has no continuous range)", value)
    if not (isinstance(value, Mapping) and len(value) == 1 and next(iter(value)) in RANGES):
        raise fail(
            "a list of choices or one of {uniform: [low, high]}, {log_uniform: [low, high]}, {int: [low, high]}",
            value,
        )
    kind, bounds = next(iter(value.items()))
    numbers = isinstance(bounds, list) and len(bounds) == 2
    numbers = numbers and all(
        isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b) for b in bounds
    )
    if not (numbers and bounds[0] < bounds[1]):
        raise fail("[low, high] with low < high", bounds, f"{where}.{kind}")
    if kind == "log_uniform" and bounds[0] <= 0:
        raise fail("[low, high] with 0 < low (a log scale)", bounds, f"{where}.log_uniform")
    if kind == "int" and not all(isinstance(b, int) for b in bounds):
        raise fail("[low, high] of integers", bounds, f"{where}.int")


def budget(search: Mapping[str, Any]) -> int:
    """The number of trials of a search: `trials`, or with sampler: grid the size of the grid."""
    if search.get("trials") is not None:
        return int(search["trials"])
    return math.prod(len(v) for v in search["space"].values())
