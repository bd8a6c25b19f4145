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
from typing import Annotated, Any

import typer

from fedcli.cli.common import Panel
from fedcli.cli.errors import user_errors
from fedcli.errors import ConfigError
from fedcli.runs.progress import console
from fedcli.runs.stores import open_store, tracking_config


def sync(
    ctx: typer.Context,
    runs: Annotated[
        list[str] | None, typer.Argument(help="Run ids/names (default: every ended run).")
    ] = None,
    experiment: Annotated[str | None, typer.Option(help="Only runs of this experiment.")] = None,
    root: Annotated[
        Path | None,
        typer.Option(
            help="Folder of the default stores. \\[default: ./fedcli-runs]", rich_help_panel=Panel.TRACK
        ),
    ] = None,
    store: Annotated[
        str | None,
        typer.Option(help="SQLAlchemy URL of the store. \\[env: FEDCLI_STORE]", rich_help_panel=Panel.TRACK),
    ] = None,
    tracking_uri: Annotated[
        str | None,
        typer.Option(help="MLflow tracking URI. \\[env: MLFLOW_TRACKING_URI]", rich_help_panel=Panel.TRACK),
    ] = None,
    trust_code: Annotated[
        bool,
        typer.Option(
            "--trust-code",
            help="Import the model / data function code a run's "
            "final model names, to log its MLflow model (its sha256 must match).",
        ),
    ] = False,
) -> None:
    """Copy runs from the SQL store into MLflow, one point per round, and end them as the store says.

    Example: fedcli sync --experiment demo
    """
    from fedcli.tracking.mlflow.checks import preflight
    from fedcli.tracking.mlflow.lifeline import quiet_mlflow
    from fedcli.tracking.mlflow.mirror import Mirror
    from fedcli.tracking.urls import mask_url

    with user_errors(bool(ctx.obj and ctx.obj.get("debug"))):
        cfg = tracking_config(
            {
                "tracking.root": root and str(root),
                "tracking.store": store,
                "tracking.tracking_uri": tracking_uri,
            }
        )
        db = open_store(cfg.store_url, must_exist=True)
        records = [db.get_run(ref) for ref in runs] if runs else db.list_runs(experiment=experiment)
        alive = [r.id[:8] for r in records if r.status == "running"]
        if runs and alive:
            raise ConfigError(f"run {alive[0]} is still training; its own mirror keeps MLflow in line.")
        if not trust_code:
            check_code(records, Path(cfg.root).resolve() / "runs")
        preflight(cfg.mlflow_uri)
        import fedcli.tracking.mlflow.sink  # noqa: F401 - MLflow imported, then its INFO lines off (as in the mirror)

        quiet_mlflow()
        copied = [
            record
            for record in records
            if record.status != "running"
            and Mirror(
                argparse.Namespace(
                    store=cfg.store_url,
                    run=record.id,
                    tracking_uri=cfg.mlflow_uri,
                    experiment=record.experiment,
                    parent_run=None,
                    once=True,
                    run_dir=str(Path(cfg.root).resolve() / "runs" / record.id),
                    trust_code=trust_code,
                )
            ).run_once()
        ]
        if copied or alive:
            console().print(
                f"{len(copied)} run(s) copied into MLflow at {mask_url(cfg.mlflow_uri)}"
                + (f"; {len(alive)} still training" if alive else ""),
                soft_wrap=True,
            )


def check_code(records: list[Any], runs_dir: Path) -> None:
    """Refuse (one line, nothing copied) when a run to copy has a final model naming user code.

    Logging a run's MLflow model rebuilds its module (tracking/served.py), which imports your
    model's module and calls your data function: code a store row names, which runs only when
    the user passes --trust-code (datasets/yours/trust.py; docs/operations.md, "Security").
    """
    from fedcli.datasets.yours.trust import allow_code, recorded_code
    from fedcli.tracking.served import read_model_file

    for record in records:
        path = runs_dir / record.id / "model.pt"
        if record.status == "running" or not path.is_file():
            continue  # no MLflow model to log: nothing is imported
        try:
            saved = read_model_file(path)  # weights_only: what the mirror's served.pt will name
        except ValueError:
            continue  # the mirror warns that it cannot log this model; nothing of it is imported
        config = saved.get("config")
        found = config.get("data") if isinstance(config, dict) else None
        data: dict[str, Any] = found if isinstance(found, dict) else {}
        allow_code(
            recorded_code(
                {"model": saved["model"], "model_sha256": data.get("model_sha256")},
                data_file=data.get("file"),
            ),
            source=f"the final model of run {record.id[:8]} ({path})",
            fix="pass --trust-code if you trust it, or sync the other runs by name",
        )
