"""`fedcli ui`: the MLflow UI on the run store, bound to loopback."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer

from fedcli.cli.common import Panel, console, tracking_config
from fedcli.cli.errors import user_errors
from fedcli.errors import ConfigError


def ui(
    ctx: typer.Context,
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port on 127.0.0.1.")] = 5000,
    root: Annotated[Path | None, typer.Option(help="Folder of the default stores. [default: ./fedcli-runs]",
                                              rich_help_panel=Panel.TRACK)] = None,
    tracking_uri: Annotated[str | None, typer.Option(help="MLflow tracking URI. [env: MLFLOW_TRACKING_URI]",
                                                     rich_help_panel=Panel.TRACK)] = None,
    print_only: Annotated[bool, typer.Option("--print-only", help="Print the command instead of running it.")] = False,
) -> None:
    """Start the MLflow UI on the runs' tracking store (127.0.0.1 only).

    Example: fedcli ui --port 5000
    """
    with user_errors(bool(ctx.obj and ctx.obj.get("debug"))):
        cfg = tracking_config({"tracking.root": root and str(root), "tracking.tracking_uri": tracking_uri})
        uri = cfg.mlflow_uri
        if uri.startswith(("http://", "https://")):
            raise ConfigError(f"the tracking URI {uri} is already a server; open it in a browser.")
        mlflow = shutil.which("mlflow") or str(Path(sys.executable).with_name("mlflow"))
        command = [mlflow, "ui", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port", str(port)]
    typer.echo(" ".join(command))
    if print_only:
        return
    console().print(f"MLflow UI on http://127.0.0.1:{port} (Ctrl-C stops it)")
    raise typer.Exit(subprocess.call(command))
