"""`fedcli ui`: the MLflow UI on the runs' tracking store, bound to loopback."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Annotated

import typer

from fedcli.cli.common import Panel, console, open_store, tracking_config
from fedcli.cli.errors import user_errors
from fedcli.errors import ConfigError


def ui(
    ctx: typer.Context,
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port on 127.0.0.1.")] = 5000,
    store: Annotated[str | None, typer.Option(help="SQL store whose runs' MLflow store to open. \\[env: FEDCLI_STORE]",
                                              rich_help_panel=Panel.TRACK)] = None,
    root: Annotated[Path | None, typer.Option(help="Folder of the default stores. \\[default: ./fedcli-runs]",
                                              rich_help_panel=Panel.TRACK)] = None,
    tracking_uri: Annotated[str | None, typer.Option(help="MLflow tracking URI. \\[env: MLFLOW_TRACKING_URI]",
                                                     rich_help_panel=Panel.TRACK)] = None,
    print_only: Annotated[bool, typer.Option("--print-only", help="Print the URL and command instead of running it.")] = False,
) -> None:
    """Start the MLflow UI on the runs' tracking store (127.0.0.1 only) and print its URL.

    The runs show their params (the flattened config), metric curves by round, tags and the
    stored model and config as artifacts.

    Example: fedcli ui --store sqlite:///fedcli-runs/fedcli.db --port 5000
    """
    with user_errors(bool(ctx.obj and ctx.obj.get("debug"))):
        cfg = tracking_config({"tracking.root": root and str(root), "tracking.tracking_uri": tracking_uri,
                               "tracking.store": store})
        uri = tracking_uri or (runs_tracking_uri(cfg.store_url) if store else None) or cfg.mlflow_uri
        if uri.startswith(("http://", "https://")):
            raise ConfigError(f"the tracking URI {uri} is already a server; open it in a browser.")
        database = Path(uri.removeprefix("sqlite:///")) if uri.startswith("sqlite:///") else None
        if database is not None and not database.exists():
            raise ConfigError(f"no MLflow store at {database}: the runs were trained with --no-mlflow or under "
                              "another --root; pass --tracking-uri or --store.")
        mlflow = shutil.which("mlflow") or str(Path(sys.executable).with_name("mlflow"))
        command = [mlflow, "ui", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port", str(port)]
    typer.echo(f"http://127.0.0.1:{port}")
    if print_only:
        typer.echo(" ".join(command))
        return
    console().print(f"MLflow UI on {uri} (Ctrl-C stops it): {' '.join(command)}")
    raise typer.Exit(subprocess.call(command))


def runs_tracking_uri(store_url: str) -> str | None:
    """The MLflow URI most runs of the SQL store logged to (their stored tracking config), or None."""
    from fedcli.config import require_store

    require_store(store_url)
    uris: Counter[str] = Counter()
    for record in open_store(store_url).list_runs():
        saved = record.config.get("tracking", {})
        if record.mlflow_run_id and saved:
            uris[tracking_config({"tracking.root": saved.get("root"),
                                  "tracking.tracking_uri": saved.get("tracking_uri")}).mlflow_uri] += 1
    if not uris:
        return None
    (uri, count), *others = sorted(uris.items(), key=lambda item: (-item[1], item[0]))
    if others:
        console().print(f"{count} runs logged to {uri}; others to {', '.join(u for u, _ in others)} "
                        "(pass --tracking-uri to open one of those).")
    return uri
