"""Building a report: select runs, drop repeats, group them, compute every table cell (docs/architecture.md §6).

Part of the `fedcli.tracking.report` package; the records it fills are in `model`, the renderers in
`render`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np

from fedcli.errors import ConfigError
from fedcli.tracking import metric_defs as md
from fedcli.tracking.keys import flatten_config
from fedcli.tracking.report.model import (
    MISSING,
    NON_RESULT_KEYS,
    Column,
    Curve,
    Group,
    Report,
    ReportSpec,
    config_value,
    default_smooth,
    default_window,
    display_key,
    fixed,
    is_percent,
    resolve_key,
    resolve_metric,
    run_config,
    sort_value,
)
from fedcli.tracking.report.search import STUDY_TAG, search_summary
from fedcli.tracking.store.records import RunRecord
from fedcli.tracking.store.sql_store import SqlStore
from fedcli.tracking.urls import connect_url

# --------------------------------------------------------------------------- selection and groups


def select_runs(store: SqlStore, spec: ReportSpec) -> list[RunRecord]:
    """Runs named by `--runs` plus those of each `--experiment` (all runs if neither), then `--where`."""
    chosen = {record.id: record for record in map(store.get_run, spec.runs)}
    for name in spec.experiments:
        chosen.update({r.id: r for r in store.list_runs(experiment=name)})
    if not spec.runs and not spec.experiments:
        chosen.update({r.id: r for r in store.list_runs()})
    if spec.where and chosen:
        known = sorted(set().union(*(flatten_config(r.config) for r in chosen.values())))
        fields = {"id", "experiment", "run_name", "algo", "task", "seed", "status", "config_hash"}
        where = {
            key if key in fields else resolve_key(key, known): value for key, value in spec.where.items()
        }
        keep = {r.id for r in store.list_runs(where=where)}
        chosen = {k: v for k, v in chosen.items() if k in keep}
    if not chosen:
        raise ConfigError("no runs match; `fedcli list runs` shows what the store holds.")
    if not spec.include_unfinished:
        finished = {k: v for k, v in chosen.items() if v.status == "finished"}
        if not finished:
            states = ", ".join(sorted({r.status for r in chosen.values()}))
            raise ConfigError(
                f"none of the {len(chosen)} matching runs finished (status {states}); "
                "pass --include-unfinished to report them anyway."
            )
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
    notes = [
        f"Run `{record.id[:8]}` repeats the config and seed of the newer run "
        f"`{newest[record.config_hash].id[:8]}` (config hash {record.config_hash[:10]}); "
        "only the newer one is counted."
        for record in records
        if newest[record.config_hash].id != record.id
    ]
    return kept, sorted(notes)


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


def group_runs(
    records: Sequence[RunRecord], group_by: Sequence[str] | None
) -> tuple[list[Group], dict[str, str], list[str]]:
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
        keys = [
            k
            for k in varying
            if k not in NON_RESULT_KEYS and len({config_value(c, k) for c in configs.values() if k in c}) > 1
        ]
        keys.sort(key=lambda k: k != "algorithm.name")  # groups sort by algorithm first, as they read
    else:
        keys = [resolve_key(k, known) for k in group_by]
    buckets: dict[tuple[str | None, ...], list[RunRecord]] = {}
    for record in records:
        cfg = {**configs[record.id], "seed": str(record.seed)}
        buckets.setdefault(tuple(config_value(cfg, k) for k in keys), []).append(record)
    groups = []
    for values in sorted(buckets, key=lambda vs: [sort_value(v) for v in vs]):
        runs = sorted(buckets[values], key=lambda r: (r.seed, r.id))
        label_keys = {display_key(k): v for k, v in zip(keys, values, strict=True) if v is not None}
        mixed = {}
        for key in varying:
            seen = sorted({config_value(configs[r.id], key) or MISSING for r in runs}, key=sort_value)
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
REPORT_KEYS = (
    "comm/bytes_up",
    "comm/bytes_down",
    "time/round_s",
    "eval/loss",
    "comm/cum_bytes_up",
    "comm/cum_bytes_down",
    "time/cum_train_s",
)


def logged_keys(store: SqlStore, ids: Sequence[str]) -> list[str]:
    """Distinct metric keys the runs logged, sorted (one indexed query)."""
    from sqlalchemy import select

    from fedcli.tracking.store.schema import RoundMetric

    stmt = select(RoundMetric.key).where(RoundMetric.run_id.in_(list(ids))).distinct()
    with store._session("read metric keys", write=False) as session:  # noqa: SLF001 - same package
        return sorted(session.scalars(stmt))


def _curves(
    store: SqlStore, ids: Sequence[str], keys: Sequence[str]
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


def _threshold_text(metric: str, threshold: float) -> str:
    if is_percent(metric):
        return f"{fixed(threshold * 100, 2).rstrip('0').rstrip('.')}%"
    return f"{threshold:g}"


def make_tables(
    metric: str, at: Sequence[int], thresholds: Sequence[float], eval_keys: Sequence[str]
) -> dict[str, list[Column]]:
    """The columns of the four tables: main, communication, time, all eval metrics."""
    name, low = metric.rsplit("/", 1)[-1], md.is_lower_better(metric)
    unit = "pct" if is_percent(metric) else "value"
    main = [Column(f"at@{r}", f"{name} @{r}R", low, unit) for r in at]
    main += [
        Column(f"rounds_to@{x!r}", f"rounds to {_threshold_text(metric, x)}", True, "rounds")
        for x in thresholds
    ]
    main += [Column("best", f"best {name}", low, unit), Column("final", f"final {name}", low, unit)]
    comm = [
        Column(f"{way}_to@{x!r}", f"{way} to {_threshold_text(metric, x)}", True, "bytes")
        for x in thresholds
        for way in ("up", "down")
    ]
    comm += [
        Column("up_total", "up, total", True, "bytes"),
        Column("down_total", "down, total", True, "bytes"),
    ]
    time_cols = [Column("round_s", "per round", True, "seconds"), Column("total_s", "total", True, "seconds")]
    evals = [
        Column(f"eval@{k}", k.split("/", 1)[1], md.is_lower_better(k), "pct" if is_percent(k) else "value")
        for k in eval_keys
    ]
    return {"main": main, "comm": comm, "time": time_cols, "eval": evals}


def run_values(
    curves: Mapping[str, Curve],
    last_round: int,
    metric: str,
    spec: ReportSpec,
    at: Sequence[int],
    eval_keys: Sequence[str],
) -> dict[str, float | None]:
    """Every table cell of one run (column id -> value or None); `spec` has its window and smooth resolved."""
    window, smooth = spec.window, spec.smooth
    # build_report fills both (default_window/default_smooth) before it calls this
    assert window is not None and smooth is not None
    empty: Curve = (np.zeros(0, np.int64), np.zeros(0))
    rounds, values = curves.get(metric, empty)
    low = md.is_lower_better(metric)
    out: dict[str, float | None] = {
        f"at@{r}": md.window_mean(rounds, values, r, window, last_round) if rounds.size else None for r in at
    }
    up, down = curves.get("comm/bytes_up", empty), curves.get("comm/bytes_down", empty)
    for x in spec.thresholds:
        hit = md.rounds_to_threshold(rounds, values, x, smooth, low) if rounds.size else None
        out[f"rounds_to@{x!r}"] = None if hit is None else float(hit)
        out[f"up_to@{x!r}"] = None if hit is None or not up[0].size else md.cumulative_at(*up, hit)
        out[f"down_to@{x!r}"] = None if hit is None or not down[0].size else md.cumulative_at(*down, hit)
    times = curves.get("time/round_s", empty)
    out.update(
        best=md.best_value(rounds, values, low),
        final=md.final_value(rounds, values),
        up_total=md.cumulative_at(*up) if up[0].size else None,
        down_total=md.cumulative_at(*down) if down[0].size else None,
        round_s=float(times[1][times[0] >= 1].mean()) if (times[0] >= 1).any() else None,
        total_s=md.cumulative_at(*times) if times[0].size else None,
    )
    for key in eval_keys:
        k_rounds, k_values = curves.get(key, empty)
        out[f"eval@{key}"] = (
            md.window_mean(k_rounds, k_values, last_round, window, last_round) if k_rounds.size else None
        )
    return out


def build_report(store: SqlStore, spec: ReportSpec) -> Report:
    """Select, group and compute every number of the report (see the module docstring)."""
    records, repeats = drop_repeats(select_runs(store, spec))
    groups, common, varying = group_runs(records, spec.group_by)
    ids = [r.id for r in records]
    logged = logged_keys(store, ids)
    metric = (
        resolve_metric(spec.metric)
        if spec.metric
        else next(
            (k for k in ("eval/accuracy", "eval/dist_to_opt", "eval/loss") if k in logged), "eval/accuracy"
        )
    )
    if metric not in logged:
        shown = ", ".join(k for k in logged if k.startswith("eval/")) or "none"
        raise ConfigError(
            f"metric {metric!r} is not logged by the selected runs; their eval metrics: {shown}."
        )
    missing = [k for k in spec.columns if k not in logged]
    if missing:
        raise ConfigError(
            f"column {missing[0]!r} is not logged by the selected runs; logged keys: {', '.join(logged)}."
        )
    eval_keys = [k for k in logged if k.startswith("eval/")] + [
        k for k in spec.columns if not k.startswith("eval/")
    ]
    curves, last = _curves(store, ids, sorted({metric, *eval_keys, *(k for k in REPORT_KEYS if k in logged)}))
    rounds_run = min(last.values())
    at = tuple(spec.at) or (rounds_run,)
    asked = spec
    spec = replace(
        spec,
        window=default_window(rounds_run) if spec.window is None else spec.window,
        smooth=default_smooth(rounds_run) if spec.smooth is None else spec.smooth,
    )
    report = Report(
        spec,
        store.url,
        metric,
        at,
        groups,
        make_tables(metric, at, spec.thresholds, eval_keys),
        common,
        varying,
        curves,
        last,
    )
    columns = [c for cols in report.tables.values() for c in cols]
    for group in groups:
        per_run = [run_values(curves[r.id], last[r.id], metric, spec, at, eval_keys) for r in group.runs]
        group.values = {c.id: [v[c.id] for v in per_run] for c in columns}
        group.summary = {c.id: md.summarize_seeds(group.values[c.id]) for c in columns}
    report.notes = _notes(report) + _window_notes(asked, rounds_run) + repeats
    if any(r.tags.get(STUDY_TAG) for r in records):  # runs of a search: its best trial, history, importances
        report.search = search_summary(connect_url(store), records)  # store.url is masked
    return report


def _window_notes(asked: ReportSpec, rounds_run: int) -> list[str]:
    """Where the window and smoothing came from when defaulted; warnings for explicit ones
    longer than the rounds every run ran."""
    notes = []
    defaulted = [
        f"{flag} {rule(rounds_run)}"
        for flag, value, rule in (
            ("window", asked.window, default_window),
            ("smoothing", asked.smooth, default_smooth),
        )
        if value is None
    ]
    if defaulted:
        notes.append(
            f"{' and '.join(defaulted).capitalize()}: the default for runs of {rounds_run} rounds "
            "(window = max(1, min(100, R // 10)), smoothing = max(1, min(10, R // 10)), R = the last round "
            "every run reached); pass --window / --smooth to choose."
        )
    if asked.window is not None and asked.window > rounds_run:
        notes.append(
            f"Warning: --window {asked.window} exceeds the {rounds_run} rounds every run ran: metric@R "
            f"averages all rounds 1..R. Drop --window for the default "
            f"({default_window(rounds_run)} here: max(1, min(100, rounds // 10)))."
        )
    if asked.smooth is not None and asked.smooth > rounds_run:
        notes.append(
            f"Warning: --smooth {asked.smooth} exceeds the {rounds_run} rounds every run ran: no "
            "running average is defined before round S, so rounds to a threshold is — for such runs. "
            f"Drop --smooth for the default ({default_smooth(rounds_run)} here)."
        )
    return notes


def _notes(report: Report) -> list[str]:
    notes = []
    for group in report.groups:
        for tag, what in (
            ("fedcli.degenerate", "ran a degenerate configuration"),
            ("fedcli.shortfall", "ran where the algorithm is known to trail FedAvg"),
        ):
            found = sorted({d for r in group.runs for d in (r.tags.get(tag) or "").split(" | ") if d})
            if found:
                count = sum(bool(r.tags.get(tag)) for r in group.runs)
                notes.append(
                    f"Group **{group.label}**: {count} of {len(group.runs)} run(s) {what} "
                    f"(tag {tag}): {'; '.join(found)}"
                )
        if group.mixed:
            shown = "; ".join(f"{k}: {', '.join(v)}" for k, v in group.mixed.items())
            notes.append(
                f"Group **{group.label}** mixes runs whose configs differ in more than the seed ({shown}); "
                "pass --group-by with these keys to separate them."
            )
        seeds = [r.seed for r in group.runs]
        if len(set(seeds)) < len(seeds):
            notes.append(f"Group **{group.label}** holds several runs with the same seed ({sorted(seeds)}).")
        odd = sorted({r.status for r in group.runs} - {"finished"})
        if odd:
            notes.append(
                f"Group **{group.label}** includes runs that did not finish (status {', '.join(odd)})."
            )
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
    return [
        f"Groups {', '.join(f'**{g}**' for g in labels)} have identical {report.metric} curves (every run, every "
        "round): they computed the same model, so their rows are equal and their curves overlap in the figures; "
        "see their configuration differences and any degenerate-run note above."
        for labels in same.values()
        if len(labels) > 1
    ]
