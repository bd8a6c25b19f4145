"""`fedcli report`: the papers' tables (metric@R, rounds to accuracy, bytes, time) and curves from the store.

A little over the 150-line budget of docs/style.md rule 1: the option list is the contract of
docs/architecture.md §9, and the partition heatmap needs the data layer, which `fedcli.tracking` must
not import; everything else is in `fedcli.tracking.report` and `fedcli.tracking.report.plots`.
"""

from __future__ import annotations

import shlex
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from fedcli.cli.common import Panel, console, open_store, tracking_config
from fedcli.cli.errors import all_or_nothing, check_output, publish, staging_dir, user_errors, write_output
from fedcli.errors import ConfigError, FedcliError

if TYPE_CHECKING:
    import numpy as np

    from fedcli.tracking.report.model import Report

SELECT, TABLES = "Selection", "Tables"


class Format(str, Enum):
    md = "md"
    csv = "csv"
    json = "json"


def report(
    ctx: typer.Context,
    experiment: Annotated[list[str] | None, typer.Option(help="Experiment to cover (repeatable).", rich_help_panel=SELECT)] = None,
    runs: Annotated[list[str] | None, typer.Option(help="Run ids/names to cover (repeatable or comma-separated).",
                                                   rich_help_panel=SELECT)] = None,
    where: Annotated[list[str] | None, typer.Option(metavar="KEY=VALUE", help="Keep runs whose config/field matches "
                                                    "(repeatable), e.g. algo=fedpa, hp.rho=0.1.", rich_help_panel=SELECT)] = None,
    group_by: Annotated[str | None, typer.Option(help="Comma-separated config keys, e.g. algo,hp.rho. \\[default: every "
                                                 "key that differs between runs, except seed]", rich_help_panel=SELECT)] = None,
    metric: Annotated[str | None, typer.Option(help="accuracy or eval/accuracy, … \\[default: accuracy, else dist_to_opt]",
                                               rich_help_panel=TABLES)] = None,
    thresholds: Annotated[str | None, typer.Option(help="Comma-separated thresholds for rounds-to, e.g. 0.84,0.86.",
                                                   rich_help_panel=TABLES)] = None,
    at: Annotated[str | None, typer.Option(help="Comma-separated round limits R of metric@R. \\[default: the last "
                                           "round every run reached]", rich_help_panel=TABLES)] = None,
    window: Annotated[int | None, typer.Option(min=1, help="metric@R = mean over rounds (R-W, R]. \\[default: "
                                               "max(1, min(100, R // 10)), R = rounds every run ran]",
                                               rich_help_panel=TABLES)] = None,
    smooth: Annotated[int | None, typer.Option(min=1, help="Running-average window S of rounds-to-threshold. "
                                               "\\[default: max(1, min(10, R // 10))]", rich_help_panel=TABLES)] = None,
    columns: Annotated[str | None, typer.Option(help="Comma-separated logged keys for the last table, e.g. "
                                                "fedsparse/sparsity.", rich_help_panel=TABLES)] = None,
    include_unfinished: Annotated[bool, typer.Option("--include-unfinished", help="Also report runs that did not "
                                                     "finish (interrupted, failed, running).", rich_help_panel=SELECT)] = False,
    output_format: Annotated[Format, typer.Option("--format", help="md (with PNGs), csv or json.")] = Format.md,
    output: Annotated[Path | None, typer.Option(help="Write here (PNGs beside it). \\[default: stdout]")] = None,
    partition_heatmap: Annotated[bool, typer.Option("--partition-heatmap", help="Also draw a shared partition that has "
                                                    "no partition file, by loading the task's data (slow for big data).",
                                                    rich_help_panel=TABLES)] = False,
    store: Annotated[str | None, typer.Option(help="SQLAlchemy URL of the store. \\[env: FEDCLI_STORE]",
                                              rich_help_panel=Panel.TRACK)] = None,
    root: Annotated[Path | None, typer.Option(help="Folder of the default store (<root>/fedcli.db). "
                                              "\\[default: ./fedcli-runs]", rich_help_panel=Panel.TRACK)] = None,
) -> None:
    """Write the paper tables of runs in the store: metric@R, rounds to threshold, bytes, time, curves.

    Example: fedcli report --experiment femnist --group-by algo --thresholds 0.84,0.86 --at 500,1500 --output report.md
    """
    from fedcli.config.checks import require_store
    from fedcli.tracking.report.build import build_report
    from fedcli.tracking.report.model import ReportSpec

    with user_errors(bool(ctx.obj and ctx.obj.get("debug"))):
        spec = ReportSpec(
            experiments=tuple(experiment or ()), runs=parse_list("--runs", runs, "run"), where=parse_where(where or []),
            group_by=parse_list("--group-by", [group_by], "config key") if group_by is not None else None,
            metric=parse_metric(metric), thresholds=tuple(parse_numbers("--thresholds", thresholds, float)),
            at=tuple(parse_numbers("--at", at, int)), window=window, smooth=smooth,
            include_unfinished=include_unfinished, command=canonical_command(ctx),
            columns=parse_list("--columns", [columns], "metric key") if columns else ())
        check_output(output, "--output")  # before any work: a rejected report writes nothing
        url = tracking_config({"tracking.store": store, "tracking.root": root and str(root)}).store_url
        require_store(url)
        built = build_report(open_store(url), spec)
        text = write_report(built, output, output_format, partition_heatmap)
    if output is None:
        typer.echo(text, nl=False)
        return
    typer.echo(str(output))


def parse_numbers(flag: str, text: str | None, kind: type) -> list[Any]:
    """'0.84,0.86' -> [0.84, 0.86]; ConfigError naming the flag on anything else."""
    if not text:
        return []
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ConfigError(f"{flag} must be comma-separated {'integers' if kind is int else 'numbers'}; "
                          f"got {text!r}.") from None
    if kind is int and any(v < 1 for v in values):
        raise ConfigError(f"{flag} rounds must be >= 1; got {text!r}.")
    if any(v != v or v in (float("inf"), float("-inf")) for v in values):
        raise ConfigError(f"{flag} must be finite numbers; got {text!r}.")
    return values


def parse_list(flag: str, items: list[str] | None, what: str) -> tuple[str, ...]:
    """['a,b', 'c'] -> ('a', 'b', 'c'); a flag given but naming nothing (',') is a ConfigError."""
    parts = tuple(part.strip() for item in items or [] for part in item.split(",") if part.strip())
    if items and not parts:
        raise ConfigError(f"{flag} must name at least one {what}; got {','.join(items)!r}. Drop {flag} for the default.")
    twice = next((p for i, p in enumerate(parts) if p in parts[:i]), None)
    if twice is not None:  # a repeated column or group key was shown twice (or dropped): say which
        raise ConfigError(f"{flag} names {what} {twice!r} twice; keep one.")
    return parts


def parse_metric(metric: str | None) -> str | None:
    if metric is not None and not metric.strip():
        raise ConfigError("--metric must be a metric name such as accuracy or eval/loss; got ''. "
                          "Drop --metric for the default.")
    return metric


def parse_where(items: list[str]) -> dict[str, str]:
    """['algo=fedpa'] -> {'algo': 'fedpa'}."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--where must be KEY=VALUE (e.g. algo=fedpa); got {item!r}.")
        if key.strip() in out:  # the last one won: `--where algo=a --where algo=b` matched algo=b only
            raise ConfigError(f"--where {key.strip()} must be given once; got {key.strip()}={out[key.strip()]} and "
                              f"{item.strip()!r}. Keep one (a report filters on one value per key).")
        out[key.strip()] = value.strip()
    return out


def canonical_command(ctx: typer.Context) -> str:
    """The command as an equivalent canonical line: options in declaration order, defaults left out."""
    from fedcli.tracking.urls import mask_url

    parts = ["fedcli", "report"]
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if value is None or value == param.default or value is False or not param.opts:
            continue
        flag = max(param.opts, key=len)
        if value is True:
            parts.append(flag)
            continue
        for item in value if isinstance(value, (list, tuple)) else [value]:
            parts += [flag, mask_url(str(item.value if isinstance(item, Enum) else item))]  # a --store password
    return shlex.join(parts)


def write_report(built: Report, output: Path | None, output_format: Format, load_data: bool) -> str:
    """Render the report; with --output write it (and the markdown's PNGs) all or nothing."""
    from fedcli.tracking.report.render import render_csv, render_json, render_markdown
    from fedcli.tracking.report.plots import report_figures

    if output_format is not Format.md:
        text = render_csv(built) if output_format is Format.csv else render_json(built)
        if output is not None:
            with all_or_nothing(output):
                write_output(output, text, "--output")
        return text
    if output is None:
        console().print("no figures: pass --output FILE to write the PNGs beside the markdown.")
        return render_markdown(built, [])
    counts, title = partition_counts(built, load_data)
    with all_or_nothing(output), staging_dir(output, "--output") as staging:
        text = render_markdown(built, report_figures(built, staging / output.name, counts, title))
        write_output(output, text, "--output")
        publish(staging, output.parent, "--output")
    return text


def partition_counts(built: Report, load_data: bool) -> tuple[np.ndarray | None, str]:
    """Clients x labels counts of the partition all runs share: from its partition file, else (with
    `load_data`, offline tasks with class targets only) by building the first run's setup again."""
    import json

    import numpy as np

    from fedcli.tracking.report.render import shared_partition

    shared = shared_partition(built)
    if shared is None:
        return None, ""
    file = shared.get("partition.file", "None")
    if file not in ("None", "—"):
        hist = json.loads(Path(file).read_text(encoding="utf-8")).get("label_histograms") if Path(file).exists() else None
        return (None, "") if hist is None else (np.asarray(hist), f"{shared['data.task']}, partition file {Path(file).name}")
    if not load_data:
        built.notes.append(f"The runs share the {shared.get('partition.scheme')} partition of {shared['data.task']}; "
                           "its heatmap needs the data: add --partition-heatmap.")
        return None, ""
    from fedcli.config.build import resume_config
    from fedcli.datasets.partition.summary import label_histograms
    from fedcli.datasets.registry import TASKS
    from fedcli.datasets.yours.trust import recorded_code
    from fedcli.engine.setup import build

    stored = dict(built.groups[0].runs[0].config)
    code = recorded_code(stored.get("data") if isinstance(stored.get("data"), dict) else None)
    if any(c.what == "data function" for c in code):
        built.notes.append("No partition heatmap: the runs' data comes from a data function, user code that fedcli "
                           "report does not import (docs/architecture.md, \"Security\").")  # a row names it
        return None, ""
    if code:  # the runs' own model is user code: the data and partition do not depend on the model, the default does
        stored["data"] = {**stored["data"], "model": None, "model_sha256": None, "model_args": None}
    try:
        cfg = resume_config(stored, {"train.device": "cpu"})
        if not TASKS[cfg.data.task].offline or cfg.data.data_dir:
            return None, ""
        setup = build(cfg)  # the data and partition exactly as the runs had them
    except (FedcliError, KeyError):
        return None, ""
    counts = label_histograms(setup.fed.client_indices, setup.data.y.numpy(), setup.data.num_classes)
    return counts, f"{cfg.data.task}, {cfg.partition.scheme} partition, {setup.fed.num_clients} clients"
