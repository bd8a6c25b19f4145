"""What `fedcli sweep --backend ray` checks of a Ray cluster before anything is written (docs/scaling.md,
"Sweeps on Ray"): that HOST:PORT listens (`probe`), Ray's auth token (`use_token_if_there`), that
the nodes can share the store and MLflow and hold one trial (`check_cluster`), and that the workers
hold the sweep's URLs with a password in their own environment (`secret_env`, `check_secrets`: a
password never travels as a Ray argument). The connection and the scheduler that use them are in
fedcli/sweep/ray_runner.py.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from fedcli.errors import ConfigError

if TYPE_CHECKING:
    from fedcli.config.sections import TrackingConfig


CONNECT_TIMEOUT_S = 5.0  # a TCP probe of HOST:PORT before ray.init (which retries for a long time)


def secret_env(track: TrackingConfig) -> dict[str, str]:
    """The environment variables of the sweep's URLs that hold a password (FEDCLI_STORE, MLFLOW_TRACKING_URI)."""
    from fedcli.tracking.urls import has_password

    env = {"FEDCLI_STORE": track.store_url}
    if track.use_mlflow:
        env["MLFLOW_TRACKING_URI"] = track.mlflow_uri
    return {key: value for key, value in env.items() if has_password(value)}


def _masked_env(keys: Sequence[str]) -> dict[str, str | None]:
    """Runs on a Ray worker: these variables of its environment, masked (no password leaves the node)."""
    from fedcli.tracking.urls import mask_url

    return {key: None if os.environ.get(key) is None else mask_url(os.environ[key]) for key in keys}


def check_secrets(ray: Any, secrets: Mapping[str, str]) -> None:
    """The workers of the cluster must hold the sweep's URLs that carry a password in their own environment:
    one short task reads them there and sends them back masked, compared with this process's masked.

    Raises:
        ConfigError: a worker lacks one, or has another URL (one line, no password in it).
    """
    if not secrets:
        return
    from fedcli.tracking.urls import mask_url

    try:
        seen = ray.get(ray.remote(_masked_env).options(num_cpus=0).remote(sorted(secrets)), timeout=120)
    except Exception as err:  # noqa: BLE001 - any failure of the probe task: one line
        raise ConfigError(
            f"cannot read the environment of the Ray cluster's workers ({first_line(err)})."
        ) from None
    for key, value in sorted(secrets.items()):
        if seen.get(key) != mask_url(value):
            found = "does not set it" if seen.get(key) is None else f"sets {seen[key]!r}"
            raise ConfigError(
                f"the URL {mask_url(value)!r} holds a password, which fedcli never passes to Ray as an "
                f"argument (Ray may log them), but the Ray cluster's workers' environment {found}; set "
                f"{key} to it where `ray start` runs on every node, then rerun."
            )


def use_token_if_there() -> None:
    """Send Ray's auth token when this machine has one and RAY_AUTH_MODE is unset.

    Since Ray 2.60 `ray start --head` turns token authentication on by default and saves the token
    in ~/.ray/auth_token, but a driver that connects to that head with `ray.init(address=...)` sends
    no token unless RAY_AUTH_MODE=token: it retried for 20 s printing "InvalidAuthToken" and failed.
    Setting the mode (never the token: Ray reads it from its own file or RAY_AUTH_TOKEN[_PATH]) makes
    the driver, and the trials it starts, authenticate; an explicit RAY_AUTH_MODE is respected.
    """
    if "RAY_AUTH_MODE" in os.environ:
        return
    sources = [
        os.environ.get("RAY_AUTH_TOKEN"),
        os.environ.get("RAY_AUTH_TOKEN_PATH"),
        (Path.home() / ".ray" / "auth_token").is_file() or None,
    ]
    if any(sources):
        os.environ["RAY_AUTH_MODE"] = "token"


def probe(address: str) -> None:
    """Fail fast, in one line, when nothing listens at HOST:PORT (or ray://HOST:PORT)."""
    target = address.removeprefix("ray://")
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ConfigError(f"--address must be auto, HOST:PORT or ray://HOST:PORT; got {address!r}.")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as err:
        raise ConfigError(
            f"the Ray cluster at {address!r} cannot be reached ({err.strerror or err}); start it "
            f"(`ray start --head --port {port}` on {host}) or pass --address of a running cluster."
        ) from None


def check_cluster(nodes: Sequence[Mapping[str, Any]], track: TrackingConfig, cpus: int, gpus: float) -> None:
    """Refuse, before anything is written, what the trials of this cluster could not do.

    On more than one node the trials write the store and MLflow from other machines: a SQLite
    store (the default one under --root included) or a file-based MLflow URI of this
    machine would be a different file on each node, so they are refused. A trial that no
    single node can hold would wait forever, so it is refused too.

    Args:
        nodes: the alive nodes, as `ray.nodes()` lists them (`Resources`: CPU, GPU, ...).

    Raises:
        ConfigError: naming the problem and the fix.
    """
    if len(nodes) > 1:
        if track.store_url.startswith("sqlite"):
            raise ConfigError(
                f"the store {track.store_url!r} is a SQLite file, but the trials run on the "
                f"{len(nodes)} nodes of the Ray cluster, which cannot share it; pass --store "
                "postgresql+psycopg://USER@HOST/DB (or set FEDCLI_STORE) with a database every node reaches."
            )
        if track.use_mlflow and urlsplit(track.mlflow_uri).scheme in ("", "file", "sqlite"):
            raise ConfigError(
                f"the MLflow tracking URI {track.mlflow_uri!r} is a local file, but the trials run on "
                f"the {len(nodes)} nodes of the Ray cluster, which cannot share it; pass --tracking-uri "
                "http://HOST:5000 (an `mlflow server` every node reaches) or --no-mlflow."
            )
    sizes = [(n.get("Resources", {}).get("CPU", 0.0), n.get("Resources", {}).get("GPU", 0.0)) for n in nodes]
    if not any(cpu >= cpus and gpu >= gpus for cpu, gpu in sizes):
        largest = max(sizes, default=(0.0, 0.0))
        raise ConfigError(
            f"--cpus-per-trial {cpus} --gpus-per-trial {gpus:g} fits no node of the Ray cluster "
            f"(the largest has {largest[0]:g} CPUs and {largest[1]:g} GPUs); lower them or add a node."
        )


def first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__
