"""`fedcli report`: the papers' tables (metric@R, rounds to accuracy, bytes, time) and curves from the store.

A little over the 150-line budget of docs/style.md rule 1: the option list is the contract of
docs/architecture.md §9, and the partition heatmap needs the data layer, which `fedcli.tracking` must
not import; everything else is in the `fedcli.tracking.report` package.
"""

from __future__ import annotations

import shlex
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from fedcli.cli.common import Panel
from fedcli.cli.errors import user_errors
from fedcli.runs.outputs import check_output
from fedcli.runs.reports import Format, parse_list, parse_metric, parse_numbers, parse_where, write_report
from fedcli.runs.stores import open_store, tracking_config

SELECT, TABLES = "Selection", "Tables"


def report(
    ctx: typer.Context,
    experiment: Annotated[
        list[str] | None, typer.Option(help="Experiment to cover (repeatable).", rich_help_panel=SELECT)
    ] = None,
    runs: Annotated[
        list[str] | None,
        typer.Option(help="Run ids/names to cover (repeatable or comma-separated).", rich_help_panel=SELECT),
    ] = None,
    where: Annotated[
        list[str] | None,
        typer.Option(
            metavar="KEY=VALUE",
            help="Keep runs whose config/field matches (repeatable), e.g. algo=fedpa, hp.rho=0.1.",
            rich_help_panel=SELECT,
        ),
    ] = None,
    group_by: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated config keys, e.g. algo,hp.rho. \\[default: every "
            "key that differs between runs, except seed]",
            rich_help_panel=SELECT,
        ),
    ] = None,
    metric: Annotated[
        str | None,
        typer.Option(
            help="accuracy or eval/accuracy, … \\[default: accuracy, else dist_to_opt]",
            rich_help_panel=TABLES,
        ),
    ] = None,
    thresholds: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated thresholds for rounds-to, e.g. 0.84,0.86.", rich_help_panel=TABLES
        ),
    ] = None,
    at: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated round limits R of metric@R. \\[default: the last round every run reached]",
            rich_help_panel=TABLES,
        ),
    ] = None,
    window: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="metric@R = mean over rounds (R-W, R]. \\[default: "
            "max(1, min(100, R // 10)), R = rounds every run ran]",
            rich_help_panel=TABLES,
        ),
    ] = None,
    smooth: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Running-average window S of rounds-to-threshold. \\[default: max(1, min(10, R // 10))]",
            rich_help_panel=TABLES,
        ),
    ] = None,
    columns: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated logged keys for the last table, e.g. fedsparse/sparsity.",
            rich_help_panel=TABLES,
        ),
    ] = None,
    include_unfinished: Annotated[
        bool,
        typer.Option(
            "--include-unfinished",
            help="Also report runs that did not finish (interrupted, failed, running).",
            rich_help_panel=SELECT,
        ),
    ] = False,
    output_format: Annotated[
        Format, typer.Option("--format", help="md (with PNGs), csv or json.")
    ] = Format.md,
    output: Annotated[
        Path | None, typer.Option(help="Write here (PNGs beside it). \\[default: stdout]")
    ] = None,
    partition_heatmap: Annotated[
        bool,
        typer.Option(
            "--partition-heatmap",
            help="Also draw a shared partition that has "
            "no partition file, by loading the task's data (slow for big data).",
            rich_help_panel=TABLES,
        ),
    ] = False,
    store: Annotated[
        str | None,
        typer.Option(help="SQLAlchemy URL of the store. \\[env: FEDCLI_STORE]", rich_help_panel=Panel.TRACK),
    ] = None,
    root: Annotated[
        Path | None,
        typer.Option(
            help="Folder of the default store (<root>/fedcli.db). \\[default: ./fedcli-runs]",
            rich_help_panel=Panel.TRACK,
        ),
    ] = None,
) -> None:
    """Write the paper tables of runs in the store: metric@R, rounds to threshold, bytes, time, curves.

    Example: fedcli report --experiment femnist --group-by algo --thresholds 0.84,0.86 --at 500,1500 --output report.md
    """
    from fedcli.config.checks import require_store
    from fedcli.tracking.report.build import build_report
    from fedcli.tracking.report.model import ReportSpec

    with user_errors(bool(ctx.obj and ctx.obj.get("debug"))):
        spec = ReportSpec(
            experiments=tuple(experiment or ()),
            runs=parse_list("--runs", runs, "run"),
            where=parse_where(where or []),
            group_by=parse_list("--group-by", [group_by], "config key") if group_by is not None else None,
            metric=parse_metric(metric),
            thresholds=tuple(parse_numbers("--thresholds", thresholds, float)),
            at=tuple(parse_numbers("--at", at, int)),
            window=window,
            smooth=smooth,
            include_unfinished=include_unfinished,
            command=canonical_command(ctx),
            columns=parse_list("--columns", [columns], "metric key") if columns else (),
        )
        check_output(output, "--output")  # before any work: a rejected report writes nothing
        url = tracking_config({"tracking.store": store, "tracking.root": root and str(root)}).store_url
        require_store(url)
        text = write_report(build_report(open_store(url), spec), output, output_format, partition_heatmap)
    if output is None:
        typer.echo(text, nl=False)
        return
    typer.echo(str(output))


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
            parts += [
                flag,
                mask_url(str(item.value if isinstance(item, Enum) else item)),
            ]  # a --store password
    return shlex.join(parts)
