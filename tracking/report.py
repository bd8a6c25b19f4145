"""Paper-table reports from the SQL store (`fedcli report`, docs/architecture.md §6, docs/style.md rule 19).

`build_report(store, spec)` selects runs, groups them (by default by every config key that
differs between runs, except the seed and the `tracking` section), and computes per run
the quantities of the FedPA paper's Table 3 (metric@R, rounds to a threshold; definitions in
`fedcli.tracking.metric_defs`), bytes to each threshold (FedSparse's communication table)
and wall time; per group the mean ± std over seeds. Unless asked, the metric@R window and
the running-average length fit the run: W = max(1, min(100, R // 10)) and
S = max(1, min(10, R // 10)) for R = the last round every run reached. `render_markdown`,
`render_csv` and `render_json` turn that into text; `fedcli.tracking.plots` draws the figures.

Only the SQL store is read (pandas over SQLAlchemy); nothing here needs MLflow. The output
is deterministic: groups are sorted by their key values (numbers numerically), runs by
(seed, id) within a group, numbers use fixed decimals, and no timestamp is written.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from fedcli.errors import ConfigError
from fedcli.tracking import metric_defs as md
from fedcli.tracking.keys import flatten_config
from fedcli.tracking.store import RunRecord, SqlStore
from fedcli.tracking.urls import mask_url

__all__ = ["Column", "Group", "Report", "ReportSpec", "build_report", "default_smooth", "default_window",
           "group_label", "render_csv", "render_json", "render_markdown", "resolve_key", "resolve_metric"]

Curve = tuple[np.ndarray, np.ndarray]  # (rounds int64 ascending, values float64)
PERCENT_NAMES = ("accuracy", "precision", "recall", "f1")  # metrics whose name contains one: fractions shown as %
_IGNORED_PREFIXES = ("tracking.",)  # where results are written, not what produced them
# Settings that do not change results (how and where a run executes, like `--resume`'s
# allowed overrides): never a default group key, never a reason to call a group mixed.
NON_RESULT_KEYS = frozenset({"train.checkpoint_every", "train.keep_checkpoints", "train.device", "train.executor",
                             "train.cohort_chunk", "train.workers", "train.threads"})
_ALIASES = {"algo": "algorithm.name", "task": "data.task", "model": "data.model", "scheme": "partition.scheme"}
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
    columns: tuple[str, ...] = ()  # more logged keys for the last table (e.g. fedsparse/sparsity), final-window mean


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


# --------------------------------------------------------------------------- keys


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
    raise ConfigError(f"unknown config key {name!r}{hint}{which}; use a key such as algo, hp.rho or train.client_lr.")


def display_key(key: str) -> str:
    """Short name of a flattened config key for headers (`algorithm.hp.rho` -> `hp.rho`)."""
    if key in _DISPLAY:
        return _DISPLAY[key]
    if key.startswith("algorithm.hp."):
        return key[len("algorithm."):]
    return key[len("train."):] if key.startswith("train.") else key


def run_config(record: RunRecord) -> dict[str, str]:
    """The run's flattened config without tracking keys and empty-mapping placeholders."""
    flat = flatten_config(record.config)
    return {k: v for k, v in flat.items() if not k.startswith(_IGNORED_PREFIXES) and v != "{}"}


def _sort_value(value: str | None) -> tuple[int, float, str]:
    if value is None:
        return (2, 0.0, "")
    try:
        return (0, float(value), value)
    except ValueError:
        return (1, 0.0, value)


# --------------------------------------------------------------------------- selection and groups


def select_runs(store: SqlStore, spec: ReportSpec) -> list[RunRecord]:
    """Runs named by `--runs` plus those of each `--experiment` (all runs if neither), then `--where`."""
    chosen: dict[str, RunRecord] = {}
    for ref in spec.runs:
        record = store.get_run(ref)
        chosen[record.id] = record
    for name in spec.experiments:
        chosen.update({r.id: r for r in store.list_runs(experiment=name)})
    if not spec.runs and not spec.experiments:
        chosen.update({r.id: r for r in store.list_runs()})
    if spec.where and chosen:
        known = sorted(set().union(*(flatten_config(r.config) for r in chosen.values())))
        fields = {"id", "experiment", "run_name", "algo", "task", "seed", "status", "config_hash"}
        where = {key if key in fields else resolve_key(key, known): value for key, value in spec.where.items()}
        keep = {r.id for r in store.list_runs(where=where)}
        chosen = {k: v for k, v in chosen.items() if k in keep}
    if not chosen:
        raise ConfigError("no runs match; `fedcli list runs` shows what the store holds.")
    if not spec.include_unfinished:
        finished = {k: v for k, v in chosen.items() if v.status == "finished"}
        if not finished:
            states = ", ".join(sorted({r.status for r in chosen.values()}))
            raise ConfigError(f"none of the {len(chosen)} matching runs finished (status {states}); "
                              "pass --include-unfinished to report them anyway.")
        chosen = finished
    return list(chosen.values())


def drop_repeats(records: Sequence[RunRecord]) -> tuple[list[RunRecord], list[str]]:
    """Keep the newest run of each config hash (same config, same seed); return (kept, notes on the rest).

    Two runs with the same config and seed are one experiment run twice (a rerun after a
    fix, a sweep started twice); counting both would report one seed as two.
    """
    newest: dict[str, RunRecord] = {}
    for record in sorted(records, key=lambda r: (r.created_at, r.id)):
        newest[record.config_hash] = record
    kept = [r for r in records if newest[r.config_hash].id == r.id]
    notes = []
    for record in records:
        if newest[record.config_hash].id != record.id:
            notes.append(f"Run `{record.id[:8]}` repeats the config and seed of the newer run "
                         f"`{newest[record.config_hash].id[:8]}` (config hash {record.config_hash[:10]}); "
                         "only the newer one is counted.")
    return kept, sorted(notes)


def _value(config: Mapping[str, str], key: str) -> str | None:
    """A flattened config value, with an unset key (`data.file=None`) the same as an absent one."""
    value = config.get(key)
    return None if value == "None" else value


def group_label(keys: Sequence[str], values: Sequence[str | None]) -> str:
    """`fedpa rho=0.1`: the algorithm's name first and bare, then the other keys' short names.

    A short name is the key's last component (`algorithm.hp.rho` -> `rho`) unless two keys
    share it, then its display name (`hp.rho`). Keys without a value are left out.
    `group_runs` puts the algorithm first also when it is not a group key but all the
    group's runs share it (`fedpa rho=0.1` for FedPA runs that differ only in rho).
    """
    shown = [(k, v) for k, v in zip(keys, values, strict=True) if v is not None]
    tails = [k.rsplit(".", 1)[-1] for k, _ in shown]
    parts = [v for k, v in shown if k == "algorithm.name"]
    for (key, value), tail in zip(shown, tails, strict=True):
        if key != "algorithm.name":
            parts.append(f"{tail if tails.count(tail) == 1 else display_key(key)}={value}")
    return " ".join(parts) or "all runs"


def group_runs(records: Sequence[RunRecord], group_by: Sequence[str] | None) -> tuple[list[Group], dict[str, str], list[str]]:
    """Group runs; return (groups sorted by key values, common config, keys varying over runs).

    By default the groups are split by every key whose value differs between runs, except
    the seed and `NON_RESULT_KEYS`, among the runs that have it: another algorithm's
    hyperparameter does not split groups, and neither does a key that is unset (None) in
    some runs and absent from others (a key added to the config since an older run).
    """
    configs = {r.id: run_config(r) for r in records}
    known = sorted(set().union(*configs.values()))
    everywhere = [k for k in known if all(k in c for c in configs.values())]
    common = {k: configs[records[0].id][k] for k in everywhere if len({c[k] for c in configs.values()}) == 1}
    varying = [k for k in known if k not in common and k != "seed"]
    if group_by is None:
        keys = [k for k in varying if k not in NON_RESULT_KEYS and len({_value(c, k) for c in configs.values() if k in c}) > 1]
        keys.sort(key=lambda k: k != "algorithm.name")  # groups sort by algorithm first, as they read
    else:
        keys = [resolve_key(k, known) for k in group_by]
    buckets: dict[tuple[str | None, ...], list[RunRecord]] = {}
    for record in records:
        cfg = {**configs[record.id], "seed": str(record.seed)}
        buckets.setdefault(tuple(_value(cfg, k) for k in keys), []).append(record)
    groups = []
    for values in sorted(buckets, key=lambda vs: [_sort_value(v) for v in vs]):
        runs = sorted(buckets[values], key=lambda r: (r.seed, r.id))
        label_keys = {display_key(k): v for k, v in zip(keys, values, strict=True) if v is not None}
        mixed = {}
        for key in varying:
            seen = sorted({_value(configs[r.id], key) or MISSING for r in runs}, key=_sort_value)
            if len(seen) > 1 and key not in keys and key not in NON_RESULT_KEYS:
                mixed[key] = seen
        algos = {configs[r.id].get("algorithm.name") for r in runs}
        if "algorithm.name" not in keys and len(algos) == 1:  # the label still names the algorithm
            label = group_label(["algorithm.name", *keys], [algos.pop(), *values])
        else:
            label = group_label(keys, values)
        groups.append(Group(label, label_keys, runs, mixed))
    return groups, common, varying


# --------------------------------------------------------------------------- numbers


# read besides the metric and eval/*: the tables' inputs and the x-axes of the bytes and time figures
REPORT_KEYS = ("comm/bytes_up", "comm/bytes_down", "time/round_s", "eval/loss", "comm/cum_bytes_up",
               "comm/cum_bytes_down", "time/cum_train_s")


def logged_keys(store: SqlStore, ids: Sequence[str]) -> list[str]:
    """Distinct metric keys the runs logged, sorted (one indexed query)."""
    from sqlalchemy import select

    from fedcli.tracking.store import RoundMetric

    stmt = select(RoundMetric.key).where(RoundMetric.run_id.in_(list(ids))).distinct()
    with store._session("read metric keys", write=False) as session:  # noqa: SLF001 - same package
        return sorted(session.scalars(stmt))


def _curves(store: SqlStore, ids: Sequence[str], keys: Sequence[str]
            ) -> tuple[dict[str, dict[str, Curve]], dict[str, int]]:
    """Curves of `keys` per run, and each run's last round (over `time/round_s` and the keys read)."""
    frame = store.metrics_frame(ids, keys=list(keys))
    curves: dict[str, dict[str, Curve]] = {run_id: {} for run_id in ids}
    last = {run_id: 0 for run_id in ids}
    if frame.empty:
        return curves, last
    rounds = frame["round_idx"].to_numpy()
    values = frame["value"].to_numpy()
    for (run_id, key), positions in frame.groupby(["run_id", "key"], sort=False).indices.items():
        curves[run_id][key] = (rounds[positions], values[positions])
        last[run_id] = max(last[run_id], int(rounds[positions][-1]))
    return curves, last


def _is_fraction(key: str) -> bool:
    name = key.rsplit("/", 1)[-1]
    return any(part in name for part in PERCENT_NAMES)


def _threshold_text(metric: str, threshold: float) -> str:
    if _is_fraction(metric):
        return f"{_fixed(threshold * 100, 2).rstrip('0').rstrip('.')}%"
    return f"{threshold:g}"


def make_tables(metric: str, at: Sequence[int], thresholds: Sequence[float], eval_keys: Sequence[str]
                ) -> dict[str, list[Column]]:
    """The columns of the four tables: main, communication, time, all eval metrics."""
    name, low = metric.rsplit("/", 1)[-1], md.is_lower_better(metric)
    unit = "pct" if _is_fraction(metric) else "value"
    main = [Column(f"at@{r}", f"{name} @{r}R", low, unit) for r in at]
    main += [Column(f"rounds_to@{x!r}", f"rounds to {_threshold_text(metric, x)}", True, "rounds") for x in thresholds]
    main += [Column("best", f"best {name}", low, unit), Column("final", f"final {name}", low, unit)]
    comm = []
    for x in thresholds:
        text = _threshold_text(metric, x)
        comm += [Column(f"up_to@{x!r}", f"up to {text}", True, "bytes"),
                 Column(f"down_to@{x!r}", f"down to {text}", True, "bytes")]
    comm += [Column("up_total", "up, total", True, "bytes"), Column("down_total", "down, total", True, "bytes")]
    time_cols = [Column("round_s", "per round", True, "seconds"), Column("total_s", "total", True, "seconds")]
    evals = [Column(f"eval@{k}", k.split("/", 1)[1], md.is_lower_better(k),
                    "pct" if _is_fraction(k) else "value") for k in eval_keys]
    return {"main": main, "comm": comm, "time": time_cols, "eval": evals}


def run_values(curves: Mapping[str, Curve], last_round: int, metric: str, spec: ReportSpec, at: Sequence[int],
               eval_keys: Sequence[str]) -> dict[str, float | None]:
    """Every table cell of one run (column id -> value or None)."""
    empty: Curve = (np.zeros(0, np.int64), np.zeros(0))
    rounds, values = curves.get(metric, empty)
    low = md.is_lower_better(metric)
    out: dict[str, float | None] = {}
    for r in at:
        out[f"at@{r}"] = md.window_mean(rounds, values, r, spec.window, last_round) if rounds.size else None
    up, down = curves.get("comm/bytes_up", empty), curves.get("comm/bytes_down", empty)
    for x in spec.thresholds:
        hit = md.rounds_to_threshold(rounds, values, x, spec.smooth, low) if rounds.size else None
        out[f"rounds_to@{x!r}"] = None if hit is None else float(hit)
        out[f"up_to@{x!r}"] = None if hit is None or not up[0].size else md.cumulative_at(*up, hit)
        out[f"down_to@{x!r}"] = None if hit is None or not down[0].size else md.cumulative_at(*down, hit)
    out["best"] = md.best_value(rounds, values, low)
    out["final"] = md.final_value(rounds, values)
    out["up_total"] = md.cumulative_at(*up) if up[0].size else None
    out["down_total"] = md.cumulative_at(*down) if down[0].size else None
    times = curves.get("time/round_s", empty)
    out["round_s"] = float(times[1][times[0] >= 1].mean()) if (times[0] >= 1).any() else None
    out["total_s"] = md.cumulative_at(*times) if times[0].size else None
    for key in eval_keys:
        k_rounds, k_values = curves.get(key, empty)
        out[f"eval@{key}"] = md.window_mean(k_rounds, k_values, last_round, spec.window, last_round) if k_rounds.size else None
    return out


def build_report(store: SqlStore, spec: ReportSpec) -> Report:
    """Select, group and compute every number of the report (see the module docstring)."""
    records, repeats = drop_repeats(select_runs(store, spec))
    groups, common, varying = group_runs(records, spec.group_by)
    ids = [r.id for r in records]
    logged = logged_keys(store, ids)
    metric = resolve_metric(spec.metric) if spec.metric else next(
        (k for k in ("eval/accuracy", "eval/dist_to_opt", "eval/loss") if k in logged), "eval/accuracy")
    if metric not in logged:
        shown = ", ".join(k for k in logged if k.startswith("eval/")) or "none"
        raise ConfigError(f"metric {metric!r} is not logged by the selected runs; their eval metrics: {shown}.")
    missing = [k for k in spec.columns if k not in logged]
    if missing:
        raise ConfigError(f"column {missing[0]!r} is not logged by the selected runs; logged keys: {', '.join(logged)}.")
    eval_keys = [k for k in logged if k.startswith("eval/")] + [k for k in spec.columns if not k.startswith("eval/")]
    curves, last = _curves(store, ids, sorted({metric, *eval_keys, *(k for k in REPORT_KEYS if k in logged)}))
    rounds_run = min(last.values())
    at = tuple(spec.at) or (rounds_run,)
    asked = spec
    spec = replace(spec, window=default_window(rounds_run) if spec.window is None else spec.window,
                   smooth=default_smooth(rounds_run) if spec.smooth is None else spec.smooth)
    report = Report(spec, store.url, metric, at, groups, make_tables(metric, at, spec.thresholds, eval_keys),
                    common, varying, curves, last)
    columns = [c for cols in report.tables.values() for c in cols]
    for group in groups:
        per_run = [run_values(curves[r.id], last[r.id], metric, spec, at, eval_keys) for r in group.runs]
        group.values = {c.id: [v[c.id] for v in per_run] for c in columns}
        group.summary = {c.id: md.summarize_seeds(group.values[c.id]) for c in columns}
    report.notes = _notes(report) + _window_notes(asked, rounds_run) + repeats
    return report


def _window_notes(asked: ReportSpec, rounds_run: int) -> list[str]:
    """Where the window and smoothing came from when defaulted; warnings for explicit ones
    longer than the rounds every run ran."""
    notes = []
    defaulted = [f"{flag} {rule(rounds_run)}" for flag, value, rule in
                 (("window", asked.window, default_window), ("smoothing", asked.smooth, default_smooth)) if value is None]
    if defaulted:
        notes.append(f"{' and '.join(defaulted).capitalize()}: the default for runs of {rounds_run} rounds "
                     "(window = max(1, min(100, R // 10)), smoothing = max(1, min(10, R // 10)), R = the last round "
                     "every run reached); pass --window / --smooth to choose.")
    if asked.window is not None and asked.window > rounds_run:
        notes.append(f"Warning: --window {asked.window} exceeds the {rounds_run} rounds every run ran: metric@R "
                     f"averages all rounds 1..R. Drop --window for the default "
                     f"({default_window(rounds_run)} here: max(1, min(100, rounds // 10))).")
    if asked.smooth is not None and asked.smooth > rounds_run:
        notes.append(f"Warning: --smooth {asked.smooth} exceeds the {rounds_run} rounds every run ran: no "
                     "running average is defined before round S, so rounds to a threshold is — for such runs. "
                     f"Drop --smooth for the default ({default_smooth(rounds_run)} here).")
    return notes


def _notes(report: Report) -> list[str]:
    notes = []
    for group in report.groups:
        found = sorted({d for r in group.runs for d in (r.tags.get("fedcli.degenerate") or "").split(" | ") if d})
        if found:
            count = sum(bool(r.tags.get("fedcli.degenerate")) for r in group.runs)
            notes.append(f"Group **{group.label}**: {count} of {len(group.runs)} run(s) ran a degenerate configuration "
                         f"(tag fedcli.degenerate): {'; '.join(found)}")
        if group.mixed:
            shown = "; ".join(f"{k}: {', '.join(v)}" for k, v in group.mixed.items())
            notes.append(f"Group **{group.label}** mixes runs whose configs differ in more than the seed ({shown}); "
                         "pass --group-by with these keys to separate them.")
        seeds = [r.seed for r in group.runs]
        if len(set(seeds)) < len(seeds):
            notes.append(f"Group **{group.label}** holds several runs with the same seed ({sorted(seeds)}).")
        odd = sorted({r.status for r in group.runs} - {"finished"})
        if odd:
            notes.append(f"Group **{group.label}** includes runs that did not finish (status {', '.join(odd)}).")
    return notes + _identical_notes(report)


def _identical_notes(report: Report) -> list[str]:
    """One note per set of groups whose metric curves are identical, run for run (seed order), every round:
    their rows and curves coincide (the curve drawn last hides the others)."""
    def signature(group: Group) -> tuple[tuple[bytes, bytes], ...] | None:
        curves = [report.curves[r.id].get(report.metric) for r in group.runs]
        present = [c for c in curves if c is not None and c[0].size]
        if len(present) < len(curves):
            return None
        return tuple((c[0].tobytes(), c[1].tobytes()) for c in present)

    same: dict[tuple[tuple[bytes, bytes], ...], list[str]] = {}
    for group in report.groups:
        key = signature(group)
        if key is not None:
            same.setdefault(key, []).append(group.label)
    return [f"Groups {', '.join(f'**{g}**' for g in labels)} have identical {report.metric} curves (every run, every "
            "round): they computed the same model, so their rows are equal and their curves overlap in the figures; "
            "see their configuration differences and any degenerate-run note above."
            for labels in same.values() if len(labels) > 1]


# --------------------------------------------------------------------------- formatting


def _fixed(value: float, decimals: int) -> str:
    text = f"{value:.{decimals}f}"
    return text[1:] if text.startswith("-") and float(text) == 0 else text


BYTE_UNITS = ((1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1.0, "B"))


def byte_unit(columns_max: float) -> tuple[float, str]:
    """The SI unit that shows the largest value of a column in 1..1000."""
    return next(((scale, name) for scale, name in BYTE_UNITS if columns_max >= scale), (1.0, "B"))


def format_number(value: float, unit: str, scale: float = 1.0) -> str:
    """Fixed decimals per unit: % and values 2/4, rounds 0, bytes 2 (in `scale`), seconds 3."""
    if unit == "pct":
        return _fixed(value * 100, 2)
    if unit == "rounds":
        return _fixed(value, 0) if float(value).is_integer() else _fixed(value, 1)
    if unit == "bytes":
        return _fixed(value / scale, 2)
    return _fixed(value, 3 if unit == "seconds" else 4)


def format_cell(summary: md.SeedSummary, unit: str, scale: float, rounds_run: str) -> str:
    """`mean ± std`, `(k/n)` when only k of n seeds have a value, `— (rounds run)` when none."""
    if summary.mean is None or summary.std is None:
        return f"{MISSING} ({rounds_run})" if unit in ("rounds", "bytes") else MISSING
    text = format_number(summary.mean, unit, scale)
    if summary.count > 1:
        text += f" ± {format_number(summary.std, unit, scale)}"
    if summary.count < summary.total:
        text += f" ({summary.count}/{summary.total})"
    return text


def _best_groups(report: Report, column: Column, scale: float) -> set[int]:
    """The index of the group whose mean beats the runner-up's by more than the seed spread (BOLD_RULE);
    empty when fewer than two groups have every seed's value, on ties, or when the spread covers the gap.

    Means and standard deviations are compared as shown (rounded to the table's decimals), so a bold cell
    is never equal to another cell of its column.
    """
    shown = {}
    for i, group in enumerate(report.groups):
        s = group.summary[column.id]
        if s.mean is not None and s.std is not None and s.count == s.total:
            shown[i] = (float(format_number(s.mean, column.unit, scale)), float(format_number(s.std, column.unit, scale)))
    if len(shown) < 2:
        return set()
    order = sorted(shown, key=lambda i: shown[i][0], reverse=not column.lower_is_better)
    (best, best_std), (second, second_std) = shown[order[0]], shown[order[1]]
    return {order[0]} if abs(best - second) > max(best_std, second_std) else set()


def _rounds_run(group: Group, report: Report) -> str:
    spans = sorted({report.last_round[r.id] for r in group.runs})
    return f"{spans[0]} rounds" if len(spans) == 1 else f"{spans[0]}–{spans[-1]} rounds"


def markdown_table(report: Report, columns: Sequence[Column]) -> list[str]:
    """One markdown table: a row per group, bold best per column, arrows in the headers."""
    scales = {}
    for c in columns:
        if c.unit == "bytes":
            means = [g.summary[c.id].mean for g in report.groups if g.summary[c.id].mean is not None]
            scales[c.id] = byte_unit(max(means, default=0.0))
    headers = []
    for c in columns:
        arrow = "↓" if c.lower_is_better else "↑"
        unit = {"pct": "%, ", "rounds": "#, ", "bytes": f"{scales.get(c.id, (1, 'B'))[1]}, ", "seconds": "s, "}.get(c.unit, "")
        headers.append(f"{c.header} ({unit}{arrow})")
    lines = ["| group | seeds | " + " | ".join(headers) + " |", "|---|---|" + "---:|" * len(columns)]
    best = {c.id: _best_groups(report, c, scales.get(c.id, (1.0, ""))[0]) for c in columns}
    for i, group in enumerate(report.groups):
        cells = []
        for c in columns:
            text = format_cell(group.summary[c.id], c.unit, scales.get(c.id, (1.0, ""))[0], _rounds_run(group, report))
            cells.append(f"**{text}**" if i in best[c.id] else text)
        lines.append(f"| {group.label} | {len(group.runs)} | " + " | ".join(cells) + " |")
    return lines


# --------------------------------------------------------------------------- renderers

CONVENTIONS = ("cells are mean ± sample std (ddof 1) over the group's seeds; (k/n): only k of n seeds have a "
               "value; **bold**: see the rule under each table; ↑/↓: higher/lower is better; — : no value "
               "(footnote under each table)")
BOLD_RULE = ("Bold: the best mean of a column, only where it beats the runner-up by more than the larger of their "
             "two seed standard deviations (as shown; among groups where every seed has a value); no bold on ties "
             "or when the spread covers the gap.")
_TITLES = {
    "main": "Table 3 layout",
    "comm": "Communication: bytes to each threshold and in total",
    "time": "Wall time",
    "eval": "All evaluation metrics (and the requested columns)",
}


def _definitions(report: Report, table: str) -> str:
    spec, metric = report.spec, report.metric
    direction = "≤" if md.is_lower_better(metric) else "≥"
    if table == "main":
        return (f"{metric} @R = mean of {metric} over the evaluated rounds r with R − {spec.window} < r ≤ R "
                f"(window {spec.window}; round 0, the initial model, never counts); {MISSING} if the run stopped "
                f"before R. Rounds to X = the first round t ≥ {spec.smooth} whose trailing {spec.smooth}-round running "
                f"average of {metric} is {direction} X; {MISSING} (rounds run) if never. Best = best per-round value; "
                "final = value at the last evaluated round.")
    if table == "comm":
        return ("Bytes up/down to X = sum of comm/bytes_up / comm/bytes_down over rounds 1..t, t = the round the "
                f"threshold is first reached (as above); {MISSING} (rounds run) if never. Total = over all rounds. "
                "Units: SI (1 kB = 1000 B), one unit per column.")
    if table == "time":
        return "Per round = mean of time/round_s over rounds ≥ 1 (the first round includes warm-up); total = its sum."
    return (f"Each eval/* metric (and each requested column) averaged over the last {spec.window} rounds of each run (r > last − {spec.window}). "
            "F1 metrics: macro = mean over labels, micro = pooled over labels; a label with no positives and no "
            f"predictions has F1 0. {MISSING}: the run logged no such value.")


def render_markdown(report: Report, figures: Sequence[tuple[str, str]] = ()) -> str:
    """The report as markdown; `figures` are (caption, relative path) pairs to embed."""
    spec = report.spec
    experiments = sorted({r.experiment for g in report.groups for r in g.runs})
    runs = [r for g in report.groups for r in g.runs]
    group_by = ", ".join(spec.group_by) if spec.group_by else "every config key that differs between runs, except seed"
    lines = [f"# fedcli report: {report.metric}", "",
             f"- command: `{mask_url(spec.command)}`", f"- store: `{shown_store(report.store_url)}`",
             f"- runs: {len(runs)} in {len(report.groups)} group(s); experiments: {', '.join(experiments)}",
             f"- metric: {report.metric} ({'↓' if md.is_lower_better(report.metric) else '↑'}); "
             f"R = {', '.join(map(str, report.at))}; window {spec.window}; smoothing {spec.smooth}",
             f"- grouped by: {group_by}", f"- conventions: {CONVENTIONS}", ""]
    for name, columns in report.tables.items():
        if not columns:
            continue
        title = f"{report.metric} ({_TITLES[name]})" if name == "main" else _TITLES[name]
        lines += [f"## {title}", "", *markdown_table(report, columns), "", _definitions(report, name), "",
                  BOLD_RULE, ""]
    if figures:
        lines += ["## Figures", ""]
        lines += [f"![{caption}]({path})\n\n{caption}\n" for caption, path in figures]
    lines += ["## Runs", "", "| group | seed | run id | status | rounds | config hash | experiment |",
              "|---|---:|---|---|---:|---|---|"]
    for g in report.groups:
        for r in g.runs:
            digest = r.tags.get("fedcli.config_hash", r.config_hash)[:12]
            lines.append(f"| {g.label} | {r.seed} | `{r.id}` | {r.status} | {report.last_round[r.id]} | "
                         f"`{digest}` | {r.experiment} |")
    lines += ["", "Config hash: sha256 of the run's config without the tracking section (tag fedcli.config_hash).", ""]
    lines += _config_section(report)
    if report.notes:
        lines += ["## Notes", "", *[f"- {n}" for n in report.notes], ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def _config_section(report: Report) -> list[str]:
    lines = ["## Configuration", ""]
    configs = {r.id: run_config(r) for g in report.groups for r in g.runs}

    recommended = {r.id: recommended_keys(r) for g in report.groups for r in g.runs}

    def values(group: Group, key: str) -> str:
        return ", ".join(sorted({_value(configs[r.id], key) or MISSING for r in group.runs}, key=_sort_value))

    def marked(group: Group, key: str) -> str:
        taken = any(key in recommended[r.id] for r in group.runs)
        return values(group, key) + (" (recommended)" if taken else "")

    result_keys = [k for k in report.varying if k not in NON_RESULT_KEYS]
    between = [k for k in result_keys if len({values(g, k) for g in report.groups}) > 1]
    if between:
        lines += [f"What differs between groups ({MISSING}: key absent, e.g. another algorithm's hyperparameter; "
                  "several values: they differ inside the group, see Notes):", "",
                  "| key | " + " | ".join(g.label for g in report.groups) + " |",
                  "|---|" + "---|" * len(report.groups)]
        lines += [f"| `{display_key(k)}` | " + " | ".join(marked(g, k) for g in report.groups) + " |" for k in between]
        lines.append("")
        if any(k in keys for k in between for keys in recommended.values()):
            lines += ["(recommended): the value the algorithm (or the task) recommends, applied because the run did "
                      "not set the key (tag fedcli.recommended, `fedcli list algos NAME`); where such a shared setting "
                      "(e.g. `local_epochs`) differs, the groups ran at unequal settings: set it explicitly to compare "
                      "at equal ones.", ""]
    execution = [k for k in report.varying if k in NON_RESULT_KEYS]
    if execution:
        shown = "; ".join(f"`{k}`: {', '.join(sorted({c.get(k, MISSING) for c in configs.values()}, key=_sort_value))}"
                          for k in execution)
        lines += [f"Execution settings that differ between runs and do not change results: {shown}.", ""]
    lines += ["Common to all runs (tracking.* omitted: it says where results go, not what produced them):", ""]
    lines += [f"- `{k}` = {v}" for k, v in report.common.items()]
    return [*lines, ""]


def recommended_keys(record: RunRecord) -> set[str]:
    """Flattened config keys a run took from a recommendation (its tag fedcli.recommended: `hp.x=1; train.y=2`)."""
    tag = record.tags.get("fedcli.recommended") or ""
    keys = {item.split("=", 1)[0].strip() for item in tag.split(";") if "=" in item}
    return {f"algorithm.{k}" if k.startswith("hp.") else k for k in keys}


def _rows(report: Report) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for table, columns in report.tables.items():
        for g in report.groups:
            for c in columns:
                s = g.summary[c.id]
                for stat, value in (("mean", s.mean), ("std", s.std), ("count", s.count), ("total", s.total)):
                    rows.append({"group": g.label, "run_id": "", "seed": "", "table": table, "column": c.id,
                                 "statistic": stat, "value": value})
                for r, value in zip(g.runs, g.values[c.id], strict=True):
                    rows.append({"group": g.label, "run_id": r.id, "seed": r.seed, "table": table, "column": c.id,
                                 "statistic": "value", "value": value})
    return rows


def render_csv(report: Report) -> str:
    """Tidy CSV: group, run_id, seed, table, column, statistic (mean|std|count|total|value), value."""
    import csv
    import io

    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, ["group", "run_id", "seed", "table", "column", "statistic", "value"],
                            lineterminator="\n")
    writer.writeheader()
    for row in _rows(report):
        value = row["value"]
        writer.writerow({**row, "value": "" if value is None else repr(float(value))})
    return buffer.getvalue()


def render_json(report: Report) -> str:
    """JSON: the request, the definitions, one object per group (summaries) and per run (values)."""
    spec = report.spec
    groups = [{"label": g.label, "keys": g.keys, "seeds": [r.seed for r in g.runs], "runs": [r.id for r in g.runs],
               "mixed": g.mixed,
               "columns": {c: {"mean": s.mean, "std": s.std, "count": s.count, "total": s.total}
                           for c, s in g.summary.items()}} for g in report.groups]
    runs = [{"id": r.id, "name": r.run_name, "group": g.label, "seed": r.seed, "status": r.status,
             "experiment": r.experiment, "rounds": report.last_round[r.id],
             "config_hash": r.tags.get("fedcli.config_hash", r.config_hash),
             "values": {c: v[i] for c, v in g.values.items()}}
            for g in report.groups for i, r in enumerate(g.runs)]
    doc = {"command": mask_url(spec.command), "store": shown_store(report.store_url), "metric": report.metric, "at": list(report.at),
           "thresholds": list(spec.thresholds), "window": spec.window, "smooth": spec.smooth,
           "columns": {t: [{"id": c.id, "header": c.header, "lower_is_better": c.lower_is_better, "unit": c.unit}
                           for c in cols] for t, cols in report.tables.items()},
           "groups": groups, "runs": runs, "common": report.common, "notes": report.notes}
    return json.dumps(doc, indent=2, sort_keys=True, allow_nan=False) + "\n"


def shared_partition(report: Report) -> dict[str, str] | None:
    """The task and partition keys if every run shares them (scheme-made partitions also the seed)."""
    configs = [run_config(r) for g in report.groups for r in g.runs]
    keys = sorted({k for c in configs for k in c if k.startswith("partition.")} | {"data.task", "data.data_dir", "seed"})
    shared = {k: configs[0].get(k, MISSING) for k in keys}
    if shared.get("partition.scheme") == "natural" or shared.get("partition.file") not in (None, "None", MISSING):
        shared.pop("seed")
    if any({k: c.get(k, MISSING) for k in shared} != shared for c in configs):
        return None
    return shared


def shown_store(url: str) -> str:
    """A SQLite store URL as a report shows it: relative to the working folder when the file lies
    under it (`sqlite:///reproductions/runs/fedcli.db`), so that a committed report names no
    machine's paths and its command reruns from the same folder; any other URL with its password
    masked (`user:***@host`; the recorded command line likewise: docs/architecture.md, "Security")."""
    prefix = "sqlite:///"
    if not url.startswith(prefix):
        return mask_url(url)
    path = Path(url[len(prefix):])
    try:
        return prefix + str(path.relative_to(Path.cwd())) if path.is_absolute() else url
    except ValueError:
        return url
