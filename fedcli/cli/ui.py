"""`fedcli ui`: the MLflow UI on the runs' tracking store, bound to loopback.

The server runs with one worker (MLflow's default of 4 processes is too many beside a
training run on a laptop), and the URL is printed only once the server answers `/health`,
pointing at the runs table of the experiment of interest, on fedcli's saved view (the metrics
and params runs are compared by, tracking/mlflow/view.py) where MLflow has saved views; stderr
says what that page shows. The server runs in its own process group (fedcli.children), which SIGINT or
SIGTERM stops as a whole before this command exits, so no worker is left behind; were this command
killed, the server gets SIGTERM (`die_with_parent`).

Over the 150-line budget of docs/style.md rule 1: starting, waiting for and stopping a server
process, and choosing the page it opens on, are this command's whole job, and it has no engine
to delegate to.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from fedcli import children
from fedcli.cli.common import Panel
from fedcli.cli.errors import user_errors
from fedcli.errors import ConfigError, TrackingError
from fedcli.runs.progress import console
from fedcli.runs.stores import open_store, tracking_config
from fedcli.tracking.urls import has_password, mask_url, sqlite_path

READY_TIMEOUT_S = 120.0  # a cold MLflow start (imports, store migration check) on a busy laptop


def ui(
    ctx: typer.Context,
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port on 127.0.0.1.")] = 5000,
    experiment: Annotated[
        str | None,
        typer.Option(
            help="Open this MLflow experiment's runs. \\[default: the "
            "experiment of the newest run in the store]"
        ),
    ] = None,
    open_browser: Annotated[
        bool, typer.Option("--open", help="Open the URL in a browser once the server answers.")
    ] = False,
    store: Annotated[
        str | None,
        typer.Option(
            help="SQL store whose runs' MLflow store to open. \\[env: FEDCLI_STORE]",
            rich_help_panel=Panel.TRACK,
        ),
    ] = None,
    root: Annotated[
        Path | None,
        typer.Option(
            help="Folder of the default stores. \\[default: ./fedcli-runs]", rich_help_panel=Panel.TRACK
        ),
    ] = None,
    tracking_uri: Annotated[
        str | None,
        typer.Option(help="MLflow tracking URI. \\[env: MLFLOW_TRACKING_URI]", rich_help_panel=Panel.TRACK),
    ] = None,
    print_only: Annotated[
        bool, typer.Option("--print-only", help="Print the URL and command instead of running it.")
    ] = False,
) -> None:
    """Start the MLflow UI on the runs' tracking store (127.0.0.1 only) and print its URL.

    The URL opens the experiment's runs table on the saved view "fedcli: compare runs" (final
    metrics, algorithm, task, rounds, seed, hyperparameters; MLflow 3.15+). Each run shows its
    params (the flattened config), metric curves by round, tags and the stored model and config
    as artifacts. The URL is printed once the server answers.

    Example: fedcli ui --root fedcli-runs --port 5000 --open
    """
    with user_errors(bool(ctx.obj and ctx.obj.get("debug"))):
        cfg = tracking_config(
            {
                "tracking.root": root and str(root),
                "tracking.tracking_uri": tracking_uri,
                "tracking.store": store,
            }
        )
        uri = tracking_uri or (runs_tracking_uri(cfg.store_url) if store else None) or cfg.mlflow_uri
        if uri.startswith(("http://", "https://")):
            raise ConfigError(f"the tracking URI {mask_url(uri)} is already a server; open it in a browser.")
        database = sqlite_path(uri)
        if database is not None and not database.exists():
            raise ConfigError(
                f"no MLflow store at {database}: the runs were trained with --no-mlflow or under "
                "another --root; pass --tracking-uri or --store."
            )
        if print_only and open_browser:
            raise ConfigError(
                "--open needs the server running; got --open with --print-only. Drop one of them."
            )
        # a password goes to the server in its environment, never on its command line (`ps` shows that)
        secret = has_password(uri)
        command = [
            shutil.which("mlflow") or str(Path(sys.executable).with_name("mlflow")),
            "ui",
            *([] if secret else ["--backend-store-uri", uri]),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ]
        base = f"http://127.0.0.1:{port}"
        if print_only:
            typer.echo(landing_url(base, uri, experiment, cfg.store_url))
            typer.echo((f"MLFLOW_BACKEND_STORE_URI={mask_url(uri)} " if secret else "") + " ".join(command))
            return
        require_free_port(port)
        code = serve(
            command,
            base,
            lambda: landing_url(base, uri, experiment, cfg.store_url),
            open_browser,
            env={
                **os.environ,
                # the job runner (GenAI jobs) starts Huey consumers that outlive a killed server; runs
                # are browsed without it (MLFLOW_SERVER_ENABLE_JOB_EXECUTION=true turns it back on)
                "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": os.environ.get(
                    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false"
                ),
                **({"MLFLOW_BACKEND_STORE_URI": uri} if secret else {}),
            },
        )
    raise typer.Exit(code)


def landing_url(base: str, uri: str, name: str | None, store_url: str) -> str:
    """The URL to open: the runs table of experiment `name` (default: the newest run's), on fedcli's
    saved view where MLflow has saved views (what the page shows is said on stderr), or the UI's start
    page. MLflow 3.15+ keeps `viewStateShareKey` only on the `/runs` route."""
    from fedcli.tracking.mlflow.view import VIEW_ID, has_saved_views

    found = experiment_id(uri, name, store_url)
    if not found:
        return base
    view = comparison_view(uri, found)
    route = f"{found}/runs" if has_saved_views() else found
    return f"{base}/#/experiments/{route}?workflowType=machine_learning" + (
        f"&viewStateShareKey={VIEW_ID}" if view else ""
    )


def comparison_view(uri: str, experiment: str) -> bool:
    """Write fedcli's saved view (tracking/mlflow/view.py) to `experiment` and say on stderr what
    the first visit shows; False where MLflow has no saved views or the view cannot be written
    (then the page shows MLflow's default columns, and stderr says which clicks add ours)."""
    from mlflow import MlflowClient

    from fedcli.tracking.mlflow import view as mlflow_view

    out = console()
    default = (
        "the runs table opens on MLflow's default columns (Run Name, Created, Dataset, Duration, Source, "
        "Models): its Columns button adds the metrics (eval/accuracy, eval/loss) and params (algorithm.name, "
        "hp.*) to compare runs by."
    )
    if not mlflow_view.has_saved_views():
        from importlib.metadata import version

        out.print(f"MLflow {version('mlflow')} has no saved views (3.15+): {default}", soft_wrap=True)
        return False
    try:
        columns = mlflow_view.write_view(MlflowClient(tracking_uri=uri), experiment)
    except Exception as err:  # noqa: BLE001 - the page still opens, on MLflow's default columns
        out.print(
            mask_url(
                f"[yellow]warning:[/] could not write fedcli's saved view to {uri}: "
                f"{(str(err).splitlines() or [type(err).__name__])[0]}; {default}"
            ),
            soft_wrap=True,
        )
        return False
    if not columns:
        return False
    shown = ", ".join(c.split("`")[1] for c in columns)
    out.print(
        f"The URL opens the view '{mlflow_view.VIEW_NAME}' (runs page, Views menu): {shown}. MLflow's "
        "Assistant panel opens by itself on a browser's first visit; its x closes it for good. A sweep's "
        "trials are folded under its parent run: the box left of its name lists them.",
        soft_wrap=True,
        markup=False,
    )
    return True


def experiment_id(uri: str, name: str | None, store_url: str) -> str | None:
    """The MLflow id of experiment `name`, else of the newest run's experiment in the SQL store.

    None when it cannot be found or MLflow cannot be read (the URL then opens MLflow's
    start page, with a warning if reading failed).

    Raises:
        ConfigError: `name` is not an experiment of the MLflow store.
    """
    from fedcli.config.checks import store_file

    try:
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException

        client = MlflowClient(tracking_uri=uri)
        if name is not None:
            found = client.get_experiment_by_name(name)
            if found is None:
                known = sorted(e.name for e in client.search_experiments())
                raise ConfigError(
                    f"--experiment must name an MLflow experiment of {uri}; got {name!r}. "
                    f"It has: {', '.join(known) or 'none'}."
                )
            return str(found.experiment_id)
        path = store_file(store_url)
        runs = open_store(store_url).list_runs() if path is None or path.is_file() else []
        newest = runs[-1] if runs else None
        if newest is not None and newest.mlflow_run_id:
            try:
                return str(client.get_run(newest.mlflow_run_id).info.experiment_id)
            except MlflowException:  # a run mirrored to another MLflow store: fall back to the name
                pass
        found = client.get_experiment_by_name(newest.experiment) if newest is not None else None
        if found is None:
            recent = client.search_experiments(max_results=1, order_by=["last_update_time DESC"])
            found = recent[0] if recent else None
        return None if found is None else str(found.experiment_id)
    except ConfigError:
        raise
    except Exception as err:  # noqa: BLE001 - only the URL's precision depends on it
        console().print(
            mask_url(
                f"[yellow]warning:[/] could not look the experiment up in {uri}: "
                f"{(str(err).splitlines() or [type(err).__name__])[0]}"
            ),
            soft_wrap=True,
        )
        return None


def require_free_port(port: int) -> None:
    """ConfigError when something listens on 127.0.0.1:port (its /health would look like ours)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            raise ConfigError(
                f"--port {port} is in use on 127.0.0.1; pass another --port (or open "
                f"http://127.0.0.1:{port} if that is an MLflow UI already)."
            )


def serve(
    command: list[str],
    base: str,
    find_url: Callable[[], str],
    open_browser: bool,
    env: dict[str, str],
) -> int:
    """Run the server (`env`: its environment), print the runs URL once /health
    answers, and stop it on SIGINT/SIGTERM."""
    import webbrowser

    try:  # the server's own output goes to stderr: stdout carries only the URL
        out: Any = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a captured stderr (tests): keep the server's
        out = None
    server = subprocess.Popen(  # its own group, stopped as a whole; no terminal input for a background group
        command,
        stdin=subprocess.DEVNULL,
        stdout=out,
        env=env,
        preexec_fn=children.die_with_parent(os.getpid()),
        **children.own_process_group(),
    )

    # SIGINT or SIGTERM: KeyboardInterrupt, which stops the server and exits
    previous = {s: signal.signal(s, signal.default_int_handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        console().print("starting MLflow UI…")
        url = find_url()
        wait_ready(f"{base}/health", server)
        typer.echo(url)
        console().print(f"MLflow UI (Ctrl-C stops it): {' '.join(command)}", soft_wrap=True)
        if open_browser:
            webbrowser.open(url)
        return server.wait()
    except KeyboardInterrupt:
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stop_group(server)


def wait_ready(health: str, server: subprocess.Popen[bytes], timeout_s: float = READY_TIMEOUT_S) -> None:
    """Poll `health` until it answers 200; TrackingError if the server exits or the time runs out."""
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise TrackingError(
                f"the MLflow server {children.death(server.returncode)} before it answered {health}; "
                "its messages are above."
            )
        try:
            with urllib.request.urlopen(health, timeout=2) as response:  # noqa: S310 - loopback http
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.25)
    raise TrackingError(f"the MLflow server did not answer {health} within {timeout_s:.0f} s; stopped it.")


def stop_group(server: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM the server's process group, SIGKILL what is left after `grace_s`, and reap the server."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:  # the whole group is gone
            break
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if server.poll() is not None:
                try:
                    os.killpg(server.pid, 0)
                except ProcessLookupError:  # the server and every process of its group are gone
                    return
            time.sleep(0.1)
    server.wait()


def runs_tracking_uri(store_url: str) -> str | None:
    """The MLflow URI most runs of the SQL store logged to (their stored tracking config), or None."""
    from fedcli.config.checks import require_store

    require_store(store_url)
    uris = Counter(
        tracking_config(
            {
                "tracking.root": stored_root(record.config["tracking"].get("root"), store_url),
                "tracking.tracking_uri": record.config["tracking"].get("tracking_uri"),
            }
        ).mlflow_uri
        for record in open_store(store_url).list_runs()
        if record.mlflow_run_id and record.config.get("tracking", {})
    )
    if not uris:
        return None
    (uri, count), *others = sorted(uris.items(), key=lambda item: (-item[1], item[0]))
    if others:
        console().print(
            f"{count} runs logged to {uri}; others to {', '.join(u for u, _ in others)} "
            "(pass --tracking-uri to open one of those)."
        )
    return uri


def stored_root(root: str | None, store_url: str) -> str | None:
    """A run's stored `tracking.root`, as a path that works from any folder.

    Runs store the root as given (default `fedcli-runs`, relative to where `train` ran). When
    the SQL store is that root's own `fedcli.db`, the root is the store file's folder, wherever
    the command runs; otherwise a relative root is taken as relative to the current folder.
    """
    from fedcli.config.checks import store_file

    if root is None or Path(root).is_absolute():
        return root
    path = store_file(store_url)
    if path is not None and path.name == "fedcli.db" and path.parent.name == Path(root).name:
        return str(path.parent)
    return root
