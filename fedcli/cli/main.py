"""The `fedcli` Typer application: global options and command registration."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

import fedcli.tracking  # noqa: F401 - sets MLflow's defaults (no telemetry) before a command imports MLflow
from fedcli.cli.errors import OneLineUsageErrors
from fedcli.cli.evaluate import evaluate
from fedcli.cli.listing import list_command
from fedcli.cli.partition import partition
from fedcli.cli.report import report
from fedcli.cli.sweep import sweep
from fedcli.cli.sync import sync
from fedcli.cli.train import train
from fedcli.cli.ui import ui

app = typer.Typer(
    cls=OneLineUsageErrors,  # usage mistakes (bad option values, unknown options) as one line, exit 2
    name="fedcli",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
    rich_markup_mode="rich",
    help="Federated-learning research toolkit: Bayesian FL algorithms (FedPA, FedSparse, FOLA, "
    "BayesADMM, SCAFFLSA) and the FedOpt baselines, tracked in MLflow and SQL, reported as paper tables.",
)


def _print_version(value: bool) -> None:
    if value:
        import torch

        import fedcli

        typer.echo(f"fedcli {fedcli.__version__} (torch {torch.__version__})")
        raise typer.Exit(0)


@app.callback()
def root(
    ctx: typer.Context,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log DEBUG detail to stderr.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Log warnings only.")] = False,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for user errors too.")] = False,
    version: Annotated[
        bool,
        typer.Option("--version", is_eager=True, callback=_print_version, help="Print the version and exit."),
    ] = False,
) -> None:
    """Configure logging once for every command."""
    from rich.logging import RichHandler

    level = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    from rich.console import Console

    # logs go to stderr (stdout carries only results, e.g. the run id); no wrapping without a terminal
    logging.basicConfig(
        level=level,
        format="%(message)s",
        datefmt="[%X]",
        handlers=[
            RichHandler(console=Console(stderr=True, soft_wrap=True), show_path=False, rich_tracebacks=False)
        ],
        force=True,
    )
    for noisy in ("alembic", "mlflow", "urllib3", "matplotlib", "git"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    ctx.obj = {"debug": debug, "quiet": quiet}


def demo(
    ctx: typer.Context,
    rounds: Annotated[int | None, typer.Option(min=1, help="Communication rounds. \\[default: 40]")] = None,
    root: Annotated[
        Path | None, typer.Option(help="Folder for stores, models, checkpoints. \\[default: ./fedcli-runs]")
    ] = None,
    store: Annotated[
        str | None, typer.Option(help="SQLAlchemy URL of the results store. \\[env: FEDCLI_STORE]")
    ] = None,
    tracking_uri: Annotated[
        str | None, typer.Option(help="MLflow tracking URI. \\[env: MLFLOW_TRACKING_URI]")
    ] = None,
    no_mlflow: Annotated[bool, typer.Option("--no-mlflow", help="Log to the SQL store only.")] = False,
) -> None:
    """Train the demo: FedPA on the bundled FEMNIST writers, 40 rounds (about 30 s on 2 CPU cores).

    The config ships with fedcli (`fedcli train --config demo` is the same run, with every option of
    train); a copy to edit is examples/fedpa-femnist-demo.yaml in the repository.
    """
    train(
        ctx,
        config="demo",
        rounds=rounds,
        root=root,
        store=store,
        tracking_uri=tracking_uri,
        no_mlflow=no_mlflow,
    )


app.command("train")(train)
app.command("demo")(demo)
app.command("list")(list_command)
app.command("sweep")(sweep)
app.command("evaluate")(evaluate)
app.command("report")(report)
app.command("ui")(ui)
app.command("sync")(sync)
app.command("partition")(partition)


def main() -> None:
    """Console-script entry point."""
    app()
