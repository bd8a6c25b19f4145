"""The report's vocabulary: what was asked (ReportSpec), its records (Column, Group, Report) and config keys.

Part of the `fedcli.tracking.report` package (docs/architecture.md §6): `build` computes a Report
from the store, `render` turns it into markdown, CSV and JSON. This module imports neither.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedcli.errors import ConfigError
from fedcli.tracking import metric_defs as md
from fedcli.tracking.keys import flatten_config
from fedcli.tracking.store.records import RunRecord

Curve = tuple[np.ndarray, np.ndarray]  # (rounds int64 ascending, values float64)
PERCENT_NAMES = (
    "accuracy",
    "precision",
    "recall",
    "f1",
)  # metrics whose name contains one: fractions shown as %
_IGNORED_PREFIXES = ("tracking.",)  # where results are written, not what produced them
# Settings that do not change results (how and where a run executes, like `--resume`'s
# allowed overrides): never a default group key, never a reason to call a group mixed.
NON_RESULT_KEYS = frozenset(
    {
        "train.checkpoint_every",
        "train.keep_checkpoints",
        "train.device",
        "train.executor",
        "train.cohort_chunk",
        "train.workers",
        "train.threads",
    }
)
# What the data turned out to be, recorded with the run (docs/your-data.md), not a setting: a synthetic
# task's data follows the seed, so comparing it would split the seeds of one setting into groups.
_IGNORED_KEYS = frozenset({"data.fingerprint"})
_ALIASES = {
    "algo": "algorithm.name",
    "task": "data.task",
    "model": "data.model",
    "scheme": "partition.scheme",
}
_DISPLAY = {v: k for k, v in _ALIASES.items()}
MISSING = "—"


@dataclass(frozen=True)
class ReportSpec:
    """What `fedcli report` was asked for (see docs/architecture.md §9)."""

    experiments: tuple[str, ...] = ()
    runs: tuple[str, ...] = ()
    where: Mapping[str, str] = field(default_factory=dict)
    group_by: tuple[str, ...] | None = None  # None = every key that differs between runs
    metric: str | None = None  # None = eval/accuracy, else eval/dist_to_opt, else eval/loss
    thresholds: tuple[float, ...] = ()
    at: tuple[int, ...] = ()  # () = the last round every run reached
    window: int | None = None  # None = default_window(rounds run)
    smooth: int | None = None  # None = default_smooth(rounds run)
    command: str = "fedcli report"
    include_unfinished: bool = False  # False: only finished runs (interrupted/failed/running are left out)
    columns: tuple[
        str, ...
    ] = ()  # more logged keys for the last table (e.g. fedsparse/sparsity), final-window mean


def default_window(rounds_run: int) -> int:
    """Default metric@R window W = max(1, min(100, R // 10)), R = the rounds every run ran.

    A tenth of the run, capped at the FedPA paper's 100 rounds, so a 12-round test run is
    not averaged over a window longer than itself.
    """
    return max(1, min(100, rounds_run // 10))


def default_smooth(rounds_run: int) -> int:
    """Default running-average window S = max(1, min(10, R // 10)) (the paper's 10 from R = 100)."""
    return max(1, min(10, rounds_run // 10))


@dataclass(frozen=True)
class Column:
    """One column of a table: an id (per-run value key), its header and how to format it."""

    id: str
    header: str
    lower_is_better: bool
    unit: str  # "pct" | "value" | "rounds" | "bytes" | "seconds"


@dataclass
class Group:
    """Runs that share the group-by values; `mixed` lists other keys that differ inside it."""

    label: str
    keys: dict[str, str]
    runs: list[RunRecord]
    mixed: dict[str, list[str]]
    values: dict[str, list[float | None]] = field(default_factory=dict)  # column id -> per run
    summary: dict[str, md.SeedSummary] = field(default_factory=dict)


@dataclass
class Report:
    """Everything the renderers and plots need."""

    spec: ReportSpec  # as asked, with window and smooth resolved to numbers
    store_url: str
    metric: str
    at: tuple[int, ...]
    groups: list[Group]
    tables: dict[str, list[Column]]
    common: dict[str, str]
    varying: list[str]
    curves: dict[str, dict[str, Curve]]  # run id -> key -> curve
    last_round: dict[str, int]
    notes: list[str] = field(default_factory=list)
    search: Any = None  # search.SearchSummary of a search's runs (docs/sweeps.md), else None


# --------------------------------------------------------------------------- keys


def is_percent(key: str) -> bool:
    """True for fractions the report shows in % (accuracy, precision, recall, F1): tables and figures."""
    return any(part in key.rsplit("/", 1)[-1] for part in PERCENT_NAMES)


def resolve_metric(name: str) -> str:
    """`accuracy` -> `eval/accuracy`; keys with a `/` are taken as given."""
    return name if "/" in name else f"eval/{name}"


def resolve_key(name: str, known: Sequence[str]) -> str:
    """Map a group-by / where key to a flattened config key.

    Accepts the full key (`train.client_lr`), the aliases `algo`, `task`, `model`, `scheme`,
    `hp.<name>` (= `algorithm.hp.<name>`), and a last component that names one key
    (`client_lr`). Raises ConfigError with the nearest key otherwise.
    """
    if name in known or name == "seed":
        return name
    candidate = _ALIASES.get(name) or (f"algorithm.{name}" if name.startswith("hp.") else None)
    if candidate is not None:
        return candidate
    tails = [k for k in known if k.rsplit(".", 1)[-1] == name]
    if len(tails) == 1:
        return tails[0]
    names = {*known, *_ALIASES, *(display_key(k) for k in known), *(k.rsplit(".", 1)[-1] for k in known)}
    near = difflib.get_close_matches(name, sorted(names), n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    which = f"; it names several keys: {', '.join(tails)}" if tails else ""
    raise ConfigError(
        f"unknown config key {name!r}{hint}{which}; use a key such as algo, hp.rho or train.client_lr."
    )


def display_key(key: str) -> str:
    """Short name of a flattened config key for headers (`algorithm.hp.rho` -> `hp.rho`)."""
    if key in _DISPLAY:
        return _DISPLAY[key]
    if key.startswith("algorithm.hp."):
        return key[len("algorithm.") :]
    return key[len("train.") :] if key.startswith("train.") else key


def run_config(record: RunRecord) -> dict[str, str]:
    """The run's flattened config without tracking keys and empty-mapping placeholders."""
    flat = flatten_config(record.config)
    return {
        k: v
        for k, v in flat.items()
        if not k.startswith(_IGNORED_PREFIXES) and k not in _IGNORED_KEYS and v != "{}"
    }


def sort_value(value: str | None) -> tuple[int, float, str]:
    if value is None:
        return (2, 0.0, "")
    try:
        return (0, float(value), value)
    except ValueError:
        return (1, 0.0, value)


def config_value(config: Mapping[str, str], key: str) -> str | None:
    """A flattened config value, with an unset key (`data.file=None`) the same as an absent one."""
    value = config.get(key)
    return None if value == "None" else value


def fixed(value: float, decimals: int) -> str:
    """`value` with `decimals` fixed decimals, never `-0.00`."""
    text = f"{value:.{decimals}f}"
    return text[1:] if text.startswith("-") and float(text) == 0 else text
