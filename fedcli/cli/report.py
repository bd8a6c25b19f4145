"""`fedcli report`: tables from the store (minimal; issue 4 adds the paper tables and plots)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fedcli.cli.common import Panel, open_store, tracking_config
from fedcli.cli.errors import user_errors
from fedcli.errors import ConfigError


def report(
    ctx: typer.Context,
    experiment: Annotated[list[str] | None, typer.Option(help="Experiments to cover (repeatable).")] = None,
    runs: Annotated[list[str] | None, typer.Option(help="Run ids to cover (repeatable).")] = None,
    output: Annotated[Path | None, typer.Option(help="Write the markdown here instead of stdout.")] = None,
    store: Annotated[str | None, typer.Option(help="SQLAlchemy URL of the store.", rich_help_panel=Panel.TRACK)] = None,
) -> None:
    """Write a markdown table of the final metrics of runs in the store.

    This release prints final eval metrics per run only; rounds-to-threshold, metric@R,
    seeds aggregation and plots arrive with the report issue.

    Example: fedcli report --experiment demo --output report.md
    """
    with user_errors(bool(ctx.obj and ctx.obj.get("debug"))):
        db = open_store(tracking_config({"tracking.store": store}).store_url)
        records = [db.get_run(r) for r in runs] if runs else [
            r for e in (experiment or [None]) for r in db.list_runs(experiment=e)]
        if not records:
            raise ConfigError("no runs match; `fedcli list runs` shows what the store holds.")
        lines = ["| run | algo | task | seed | status | rounds | eval/accuracy | eval/loss |", "|---|---|---|---|---|---|---|---|"]
        for r in records:
            frame = db.metrics_frame([r.id], keys=["eval/accuracy", "eval/loss"])
            final = {k: g.sort_values("round_idx")["value"].iloc[-1] for k, g in frame.groupby("key")}
            cells = [f"{final[k]:.4f}" if k in final else "—" for k in ("eval/accuracy", "eval/loss")]
            lines.append(f"| {r.id[:8]} | {r.algo} | {r.task} | {r.seed} | {r.status} | {db.last_round(r.id)} | "
                         + " | ".join(cells) + " |")
        text = "\n".join(lines) + "\n"
    if output:
        output.write_text(text)
        typer.echo(str(output))
    else:
        typer.echo(text, nl=False)
