"""`fedcli sync`: copy runs from the SQL store into MLflow (the store is the source of truth).

A run's own mirror process keeps MLflow in line while it trains; this command is for the
rest: runs trained with `--no-mlflow` or `--mlflow-optional` while MLflow was down, runs
whose mirror was killed, or a new MLflow store (e.g. after moving a broken one aside).
Copying is idempotent: a round already in MLflow is not added twice, and a run MLflow already
holds as the store says is not touched (`Mirror.in_line`); with nothing to copy the command
prints nothing. MLflow's runs keep the store's start and end times.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Annotated

import typer

from fedcli.cli.common import Panel, console, open_store, tracking_config
from fedcli.cli.errors import user_errors
from fedcli.errors import ConfigError


def sync(
    ctx: typer.Context,
    runs: Annotated[list[str] | None, typer.Argument(help="Run ids/names (default: every ended run).")] = None,
    experiment: Annotated[str | None, typer.Option(help="Only runs of this experiment.")] = None,
    root: Annotated[Path | None, typer.Option(help="Folder of the default stores. \\[default: ./fedcli-runs]",
                                              rich_help_panel=Panel.TRACK)] = None,
    store: Annotated[str | None, typer.Option(help="SQLAlchemy URL of the store. \\[env: FEDCLI_STORE]",
                                              rich_help_panel=Panel.TRACK)] = None,
    tracking_uri: Annotated[str | None, typer.Option(help="MLflow tracking URI. \\[env: MLFLOW_TRACKING_URI]",
                                                     rich_help_panel=Panel.TRACK)] = None,
) -> None:
    """Copy runs from the SQL store into MLflow, one point per round, and end them as the store says.

    Example: fedcli sync --experiment demo
    """
    from fedcli.tracking.mirror import Mirror, preflight, quiet_mlflow
    from fedcli.tracking.urls import mask_url

    with user_errors(bool(ctx.obj and ctx.obj.get("debug"))):
        cfg = tracking_config({"tracking.root": root and str(root), "tracking.store": store,
                               "tracking.tracking_uri": tracking_uri})
        db = open_store(cfg.store_url, must_exist=True)
        records = [db.get_run(ref) for ref in runs] if runs else db.list_runs(experiment=experiment)
        alive = [r.id[:8] for r in records if r.status == "running"]
        if runs and alive:
            raise ConfigError(f"run {alive[0]} is still training; its own mirror keeps MLflow in line.")
        preflight(cfg.mlflow_uri)
        import fedcli.tracking.mlflow_sink  # noqa: F401 - MLflow imported, then its INFO lines off (as in the mirror)

        quiet_mlflow()
        copied = [record for record in records if record.status != "running" and Mirror(argparse.Namespace(
            store=cfg.store_url, run=record.id, tracking_uri=cfg.mlflow_uri, experiment=record.experiment,
            parent_run=None, once=True, run_dir=str(Path(cfg.root).resolve() / "runs" / record.id))).run_once()]
        if copied or alive:
            console().print(f"{len(copied)} run(s) copied into MLflow at {mask_url(cfg.mlflow_uri)}"
                            + (f"; {len(alive)} still training" if alive else ""), soft_wrap=True)
