"""Checks of an MLflow tracking URI before a run writes anything, and MLflow's schema lock.

Part of `fedcli.tracking.mlflow` (tracking/mlflow/mirror.py describes the mirror). `preflight` checks a tracking URI cheaply (no MLflow import) before
anything is written; `schema_lock` makes N runs that start together on a fresh root set
MLflow's schema up once (a lock file beside a SQLite database, an advisory lock on PostgreSQL);
`mlflow_params` is what a run's MLflow params are; `first_cause_line` is what an MLflow failure says.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fedcli.errors import ConfigError
from fedcli.tracking.urls import mask_url, sqlite_path

MIN_FREE_BYTES = 4 << 20  # room a new MLflow SQLite store needs before the run starts (`_no_room`)
_PG_LOCK_KEY = 0x6D6C666C  # "mlfl": advisory-lock key of MLflow's schema set-up

# --------------------------------------------------------------------------- checks before a run


def preflight(uri: str, timeout_s: float = 5.0) -> None:
    """Fail fast, with one line, when MLflow at `uri` cannot be used; creates nothing.

    Raises:
        ConfigError: unreachable server, unwritable folder, or a store left half-migrated.
    """
    fix = "pass --tracking-uri with a reachable MLflow store, --mlflow-optional to train without it, or --no-mlflow"
    if uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(f"{uri.rstrip('/')}/health", timeout=timeout_s) as answer:
                answer.read(64)
        except (urllib.error.URLError, OSError, ValueError) as err:
            reason = getattr(err, "reason", None) or err
            raise ConfigError(mask_url(f"MLflow server {uri} is not reachable ({reason}); {fix}.")) from None
        _check_credentials(uri, timeout_s, fix)
        return
    if uri.partition("://")[0].partition("+")[0] in (
        "sqlite",
        "postgresql",
        "mysql",
        "mssql",
    ):  # a database URL
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError

        try:
            make_url(uri)
        except (ArgumentError, ValueError) as err:  # a port that is not a number: before the run is written
            raise ConfigError(
                f"MLflow store {mask_url(uri)} is not a valid database URL ({mask_url(str(err))}); {fix}."
            ) from None
    path = sqlite_path(uri)
    if path is None:
        return
    path = path.resolve()
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise ConfigError(f"MLflow store {uri}: {folder} is a file, not a folder; {fix}.")
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"MLflow store {uri}: folder {folder} is not writable; {fix}.")
    full = None if path.exists() else _no_room(folder)  # a new store: MLflow's schema needs room
    if full:
        raise ConfigError(
            f"MLflow store {uri}: No space left on device ({full} under {folder}); free space or {fix}."
        )
    if path.exists() and not set_up_in_progress(path):  # a set-up under way has its tables half-made
        half = half_migrated_tables(path)
        if half:
            raise ConfigError(
                f"MLflow store {path} was left half-migrated by a process killed during its set-up "
                f"(table {half[0]}); move it aside (`mv {path} {path}.broken`) and rerun: the SQL store "
                "keeps every run, and `fedcli sync` copies them into the new MLflow store."
            )


def _check_credentials(uri: str, timeout_s: float, fix: str) -> None:
    """Raise ConfigError when the MLflow server refuses the credentials MLflow would send (HTTP 401 or 403).

    `/health` answers anyone; this asks for an experiment with what MLflow's client sends
    (`MLFLOW_TRACKING_USERNAME` and `MLFLOW_TRACKING_PASSWORD`, else `MLFLOW_TRACKING_TOKEN`). Before this check a
    wrong password trained, exited 0, and MLflow never got the run with no line saying so: the mirror
    that would have said it was still waiting for a core (at idle priority) when the run ended. Any
    other answer (the experiment, "does not exist", an error) is left to the mirror.
    """
    import base64

    request = urllib.request.Request(
        f"{uri.rstrip('/')}/api/2.0/mlflow/experiments/get-by-name?experiment_name=Default"
    )
    user, password, token = (
        os.environ.get(f"MLFLOW_TRACKING_{key}") for key in ("USERNAME", "PASSWORD", "TOKEN")
    )
    if user and password:
        request.add_header(
            "Authorization", "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        )
    elif token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            answer.read(64)
    except urllib.error.HTTPError as err:
        if err.code in (401, 403):
            raise ConfigError(
                mask_url(
                    f"MLflow server {uri} refused the credentials (HTTP {err.code} {err.reason}): MLflow would not get "
                    "the run; set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) to "
                    f"ones it accepts, or {fix} (`fedcli sync` copies such a run into MLflow later)."
                )
            ) from None
    except (urllib.error.URLError, OSError, ValueError):
        return


def _no_room(folder: Path) -> str | None:
    """What a file system lacks for MLflow's set-up ("no free inode", "12 KiB free"), else None.

    The run no longer waits for MLflow's set-up (tracking/mlflow/handle.py `start`), so a disk
    that cannot take MLflow's schema is named here, before anything is written, by statvfs
    (nothing created). MIN_FREE_BYTES: what a fresh MLflow SQLite store takes (~1 MiB) and more.
    """
    try:
        stats = os.statvfs(folder)
    except OSError:
        return None
    if stats.f_files > 0 and stats.f_favail == 0:
        return "no free inode"
    free = stats.f_bavail * stats.f_frsize
    if stats.f_blocks > 0 and free < MIN_FREE_BYTES:
        return f"{free // 1024} KiB free"
    return None


def half_migrated_tables(path: Path) -> list[str]:
    """Alembic's temporary tables, which exist only while (or because) a migration was cut short."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)) as conn:
            rows = conn.execute(
                "SELECT name FROM sqlite_master WHERE type='table' AND name LIKE '\\_alembic\\_tmp\\_%' ESCAPE '\\'"
            ).fetchall()
    except sqlite3.Error:
        return []
    return sorted(name for (name,) in rows)


def set_up_in_progress(path: Path) -> bool:
    """True while a process holds `schema_lock` on the SQLite store at `path` (its schema is being set up
    now: alembic's temporary tables are expected, not left behind). Creates nothing."""
    try:
        with open(f"{path}.lock") as handle:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(handle, fcntl.LOCK_UN)
    except BlockingIOError:  # held exclusively: the set-up is under way
        return True
    except OSError:  # no lock file: no set-up ever started here
        pass
    return False


@contextlib.contextmanager
def schema_lock(uri: str) -> Iterator[None]:
    """Hold an inter-process lock while MLflow creates or migrates its schema at `uri`."""
    path = sqlite_path(uri)
    if path is not None:
        path = path.resolve()
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(f"{path}.lock", "a+") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
        return
    if uri.startswith("postgresql"):
        from sqlalchemy import create_engine, text

        engine = create_engine(uri)
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT pg_advisory_lock(:k)"), {"k": _PG_LOCK_KEY})
                try:
                    yield
                finally:
                    conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": _PG_LOCK_KEY})
        finally:
            engine.dispose()
        return
    yield


def mlflow_params(config: dict[str, Any]) -> dict[str, str]:
    """The run's MLflow params: its resolved config flattened, hyperparameters as `hp.<name>`.

    Where the run's stores live (`tracking.root/store/tracking_uri`) is left out: it says
    nothing about the run and differs between machines.
    """
    from fedcli.tracking.keys import flatten_config

    body = {k: v for k, v in config.items() if k not in ("algorithm", "tracking")}
    algorithm = dict(config.get("algorithm") or {})
    hp = dict(algorithm.pop("hp", None) or {})
    params = flatten_config({**body, "algorithm": algorithm})
    params.update({f"hp.{k}": v for k, v in flatten_config(hp).items()})
    tracking = config.get("tracking") or {}
    for key in ("experiment", "run_name"):
        if tracking.get(key) is not None:
            params[f"tracking.{key}"] = str(tracking[key])
    return params


# --------------------------------------------------------------------------- what an MLflow failure says


def causes(err: BaseException) -> Iterator[BaseException]:
    """`err` and the chain of exceptions it was raised from (a database error under MLflow's)."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        orig = getattr(current, "orig", None)
        current = orig if isinstance(orig, BaseException) else current.__cause__


def first_cause_line(err: BaseException) -> str:
    """The first line of the innermost cause of `err`, masked: SQLite's "database or disk is full",
    not the note on autoflush that MLflow's SQLAlchemy session wraps it in."""
    *_, inner = causes(err)
    lines = str(inner).strip().splitlines()
    return mask_url(lines[0] if lines else type(inner).__name__)
