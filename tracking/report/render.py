"""Rendering a built report: number formats, markdown tables and page, tidy CSV, JSON (docs/architecture.md §6).

Part of the `fedcli.tracking.report` package; the figures are drawn by
`fedcli.tracking.report.plots`. Output is deterministic: fixed decimals, no timestamp.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fedcli.tracking import metric_defs as md
from fedcli.tracking.report.model import (
    MISSING,
    NON_RESULT_KEYS,
    Column,
    Group,
    Report,
    config_value,
    display_key,
    fixed,
    run_config,
    sort_value,
)
from fedcli.tracking.store.records import RunRecord
from fedcli.tracking.urls import mask_url

BYTE_UNITS = ((1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1.0, "B"))


def byte_unit(columns_max: float) -> tuple[float, str]:
    """The SI unit that shows the largest value of a column in 1..1000."""
    return next(((scale, name) for scale, name in BYTE_UNITS if columns_max >= scale), (1.0, "B"))


def format_number(value: float, unit: str, scale: float = 1.0) -> str:
    """Fixed decimals per unit: % and values 2/4, rounds 0, bytes 2 (in `scale`), seconds 3."""
    if unit == "pct":
        return fixed(value * 100, 2)
    if unit == "rounds":
        return fixed(value, 0) if float(value).is_integer() else fixed(value, 1)
    if unit == "bytes":
        return fixed(value / scale, 2)
    return fixed(value, 3 if unit == "seconds" else 4)


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
            shown[i] = (
                float(format_number(s.mean, column.unit, scale)),
                float(format_number(s.std, column.unit, scale)),
            )
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
            means = [m for g in report.groups if (m := g.summary[c.id].mean) is not None]
            scales[c.id] = byte_unit(max(means, default=0.0))
    headers = []
    for c in columns:
        arrow = "↓" if c.lower_is_better else "↑"
        unit = {
            "pct": "%, ",
            "rounds": "#, ",
            "bytes": f"{scales.get(c.id, (1, 'B'))[1]}, ",
            "seconds": "s, ",
        }.get(c.unit, "")
        headers.append(f"{c.header} ({unit}{arrow})")
    lines = ["| group | seeds | " + " | ".join(headers) + " |", "|---|---|" + "---:|" * len(columns)]
    best = {c.id: _best_groups(report, c, scales.get(c.id, (1.0, ""))[0]) for c in columns}
    for i, group in enumerate(report.groups):
        cells = []
        for c in columns:
            text = format_cell(
                group.summary[c.id], c.unit, scales.get(c.id, (1.0, ""))[0], _rounds_run(group, report)
            )
            cells.append(f"**{text}**" if i in best[c.id] else text)
        lines.append(f"| {group.label} | {len(group.runs)} | " + " | ".join(cells) + " |")
    return lines


# --------------------------------------------------------------------------- renderers

CONVENTIONS = (
    "cells are mean ± sample std (ddof 1) over the group's seeds; (k/n): only k of n seeds have a "
    "value; **bold**: see the rule under each table; ↑/↓: higher/lower is better; — : no value "
    "(footnote under each table)"
)
BOLD_RULE = (
    "Bold: the best mean of a column, only where it beats the runner-up by more than the larger of their "
    "two seed standard deviations (as shown; among groups where every seed has a value); no bold on ties "
    "or when the spread covers the gap."
)
_TITLES = {
    "main": "Table 3 layout",
    "comm": "Communication: bytes to each threshold and in total",
    "time": "Wall time",
    "eval": "All evaluation metrics (and the requested columns)",
}


# The F1 decision rule of a multi-label run, as recorded in its config (data.f1_rule, the task's `record`,
# fedcli/datasets/bundled/mulan.py); a run that records none (stackoverflow-lr, every run before the rule was
# recorded) thresholded at 0.5 (fedcli/datasets/metrics.py).
F1_RULE_KEY = "data.f1_rule"
THRESHOLD_RULE = "a tag is predicted when sigmoid(logit) > 0.5"


def f1_rules(report: Report) -> str:
    """'F1 decision rule: <rule> (tasks); ...' over the report's runs: the line under a table with F1."""
    rules: dict[str, set[str]] = {}
    for group in report.groups:
        for record in group.runs:
            config = run_config(record)
            rules.setdefault(config_value(config, F1_RULE_KEY) or THRESHOLD_RULE, set()).add(
                config_value(config, "data.task") or MISSING
            )
    shown = "; ".join(f"{rule} ({', '.join(sorted(tasks))})" for rule, tasks in sorted(rules.items()))
    return f"F1 decision rule (micro_f1, macro_f1): {shown}."


def _definitions(report: Report, table: str) -> str:
    """The definitions under a table, with the F1 decision rule where the table shows F1."""
    spec, metric = report.spec, report.metric
    direction = "≤" if md.is_lower_better(metric) else "≥"
    texts = {
        "main": (
            f"{metric} @R = mean of {metric} over the evaluated rounds r with R − {spec.window} < r ≤ R "
            f"(window {spec.window}; round 0, the initial model, never counts); {MISSING} if the run stopped "
            f"before R. Rounds to X = the first round t ≥ {spec.smooth} whose trailing {spec.smooth}-round running "
            f"average of {metric} is {direction} X; {MISSING} (rounds run) if never. Best = best per-round value; "
            "final = value at the last evaluated round."
        ),
        "comm": (
            "Bytes up/down to X = sum of comm/bytes_up / comm/bytes_down over rounds 1..t, t = the round the "
            f"threshold is first reached (as above); {MISSING} (rounds run) if never. Total = over all rounds. "
            "Units: SI (1 kB = 1000 B), one unit per column."
        ),
        "time": "Per round = mean of time/round_s over rounds ≥ 1 (the first round includes warm-up); total = its sum.",
        "eval": (
            f"Each eval/* metric (and each requested column) averaged over the last {spec.window} rounds of each run (r > last − {spec.window}). "
            "F1 metrics: macro = mean over labels, micro = pooled over labels; a label with no positives and no "
            f"predictions has F1 0. {MISSING}: the run logged no such value."
        ),
    }
    shows_f1 = {"main": "f1" in metric, "eval": any("f1" in c.id for c in report.tables["eval"])}
    return f"{texts[table]} {f1_rules(report)}" if shows_f1.get(table) else texts[table]


def render_markdown(report: Report, figures: Sequence[tuple[str, str]] = ()) -> str:
    """The report as markdown; `figures` are (caption, relative path) pairs to embed."""
    spec = report.spec
    experiments = sorted({r.experiment for g in report.groups for r in g.runs})
    runs = [r for g in report.groups for r in g.runs]
    group_by = (
        ", ".join(spec.group_by)
        if spec.group_by
        else "every config key that differs between runs, except seed"
    )
    lines = [
        f"# fedcli report: {report.metric}",
        "",
        f"- command: `{mask_url(spec.command)}`",
        f"- store: `{shown_store(report.store_url)}`",
        f"- runs: {len(runs)} in {len(report.groups)} group(s); experiments: {', '.join(experiments)}",
        f"- metric: {report.metric} ({'↓' if md.is_lower_better(report.metric) else '↑'}); "
        f"R = {', '.join(map(str, report.at))}; window {spec.window}; smoothing {spec.smooth}",
        f"- grouped by: {group_by}",
        f"- conventions: {CONVENTIONS}",
        "",
    ]
    for name, columns in report.tables.items():
        if not columns:
            continue
        title = f"{report.metric} ({_TITLES[name]})" if name == "main" else _TITLES[name]
        lines += [
            f"## {title}",
            "",
            *markdown_table(report, columns),
            "",
            _definitions(report, name),
            "",
            BOLD_RULE,
            "",
        ]
    if report.search is not None:
        from fedcli.tracking.report.search import search_markdown

        lines += search_markdown(report.search)
    if figures:
        lines += ["## Figures", ""]
        lines += [f"![{caption}]({path})\n\n{caption}\n" for caption, path in figures]
    lines += [
        "## Runs",
        "",
        "| group | seed | run id | status | rounds | config hash | experiment |",
        "|---|---:|---|---|---:|---|---|",
    ]
    for g in report.groups:
        for r in g.runs:
            digest = r.tags.get("fedcli.config_hash", r.config_hash)[:12]
            lines.append(
                f"| {g.label} | {r.seed} | `{r.id}` | {r.status} | {report.last_round[r.id]} | "
                f"`{digest}` | {r.experiment} |"
            )
    lines += [
        "",
        "Config hash: sha256 of the run's config without the tracking section (tag fedcli.config_hash).",
        "",
    ]
    lines += _config_section(report)
    if report.notes:
        lines += ["## Notes", "", *[f"- {n}" for n in report.notes], ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def _config_section(report: Report) -> list[str]:
    lines = ["## Configuration", ""]
    configs = {r.id: run_config(r) for g in report.groups for r in g.runs}

    recommended = {r.id: recommended_keys(r) for g in report.groups for r in g.runs}

    def values(group: Group, key: str) -> str:
        return ", ".join(
            sorted({config_value(configs[r.id], key) or MISSING for r in group.runs}, key=sort_value)
        )

    def marked(group: Group, key: str) -> str:
        taken = any(key in recommended[r.id] for r in group.runs)
        return values(group, key) + (" (recommended)" if taken else "")

    result_keys = [k for k in report.varying if k not in NON_RESULT_KEYS]
    between = [k for k in result_keys if len({values(g, k) for g in report.groups}) > 1]
    if between:
        lines += [
            f"What differs between groups ({MISSING}: key absent, e.g. another algorithm's hyperparameter; "
            "several values: they differ inside the group, see Notes):",
            "",
            "| key | " + " | ".join(g.label for g in report.groups) + " |",
            "|---|" + "---|" * len(report.groups),
        ]
        lines += [
            f"| `{display_key(k)}` | " + " | ".join(marked(g, k) for g in report.groups) + " |"
            for k in between
        ]
        lines.append("")
        if any(k in keys for k in between for keys in recommended.values()):
            lines += [
                "(recommended): the value the algorithm (or the task) recommends, applied because the run did "
                "not set the key (tag fedcli.recommended, `fedcli list algos NAME`); where such a shared setting "
                "(e.g. `local_epochs`) differs, the groups ran at unequal settings: set it explicitly to compare "
                "at equal ones.",
                "",
            ]
    execution = [k for k in report.varying if k in NON_RESULT_KEYS]
    if execution:
        shown = "; ".join(
            f"`{k}`: {', '.join(sorted({c.get(k, MISSING) for c in configs.values()}, key=sort_value))}"
            for k in execution
        )
        lines += [f"Execution settings that differ between runs and do not change results: {shown}.", ""]
    lines += [
        "Common to all runs (tracking.* omitted: it says where results go, not what produced them):",
        "",
    ]
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
                cell = {"group": g.label, "table": table, "column": c.id}
                rows += [
                    {**cell, "run_id": "", "seed": "", "statistic": stat, "value": value}
                    for stat, value in asdict(g.summary[c.id]).items()
                ]
                rows += [
                    {**cell, "run_id": r.id, "seed": r.seed, "statistic": "value", "value": value}
                    for r, value in zip(g.runs, g.values[c.id], strict=True)
                ]
    return rows


def render_csv(report: Report) -> str:
    """Tidy CSV: group, run_id, seed, table, column, statistic (mean|std|count|total|value), value."""
    import csv
    import io

    buffer = io.StringIO()
    writer = csv.DictWriter(
        buffer, ["group", "run_id", "seed", "table", "column", "statistic", "value"], lineterminator="\n"
    )
    writer.writeheader()
    for row in _rows(report):
        value = row["value"]
        writer.writerow({**row, "value": "" if value is None else repr(float(value))})
    return buffer.getvalue()


def render_json(report: Report) -> str:
    """JSON: the request, the definitions, one object per group (summaries) and per run (values)."""
    spec = report.spec
    groups = [
        {
            "label": g.label,
            "keys": g.keys,
            "seeds": [r.seed for r in g.runs],
            "runs": [r.id for r in g.runs],
            "mixed": g.mixed,
            "columns": {c: asdict(s) for c, s in g.summary.items()},
        }
        for g in report.groups
    ]
    runs = [
        {
            "id": r.id,
            "name": r.run_name,
            "group": g.label,
            "seed": r.seed,
            "status": r.status,
            "experiment": r.experiment,
            "rounds": report.last_round[r.id],
            "config_hash": r.tags.get("fedcli.config_hash", r.config_hash),
            "values": {c: v[i] for c, v in g.values.items()},
        }
        for g in report.groups
        for i, r in enumerate(g.runs)
    ]
    doc = {
        "command": mask_url(spec.command),
        "store": shown_store(report.store_url),
        "metric": report.metric,
        "at": list(report.at),
        "thresholds": list(spec.thresholds),
        "window": spec.window,
        "smooth": spec.smooth,
        "columns": {
            t: [
                {"id": c.id, "header": c.header, "lower_is_better": c.lower_is_better, "unit": c.unit}
                for c in cols
            ]
            for t, cols in report.tables.items()
        },
        "groups": groups,
        "runs": runs,
        "common": report.common,
        "notes": report.notes,
    }
    return json.dumps(doc, indent=2, sort_keys=True, allow_nan=False) + "\n"


def shared_partition(report: Report) -> dict[str, str] | None:
    """The task and partition keys if every run shares them (scheme-made partitions also the seed)."""
    configs = [run_config(r) for g in report.groups for r in g.runs]
    keys = sorted(
        {k for c in configs for k in c if k.startswith("partition.")} | {"data.task", "data.data_dir", "seed"}
    )
    shared = {k: configs[0].get(k, MISSING) for k in keys}
    if shared.get("partition.scheme") == "natural" or shared.get("partition.file") not in (
        None,
        "None",
        MISSING,
    ):
        shared.pop("seed")
    if any({k: c.get(k, MISSING) for k in shared} != shared for c in configs):
        return None
    return shared


def shown_store(url: str) -> str:
    """A SQLite store URL as a report shows it: relative to the working folder when the file lies
    under it (`sqlite:///reproductions/runs/fedcli.db`), so that a committed report names no
    machine's paths and its command reruns from the same folder; any other URL with its password
    masked (`user:***@host`; the recorded command line likewise: docs/operations.md, "Security")."""
    prefix = "sqlite:///"
    if not url.startswith(prefix):
        return mask_url(url)
    path = Path(url[len(prefix) :])
    try:
        return prefix + str(path.relative_to(Path.cwd())) if path.is_absolute() else url
    except ValueError:
        return url
