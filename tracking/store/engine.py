"""Opening a database: the SQLite connection settings (WAL, busy timeout, BEGIN IMMEDIATE), PostgreSQL
session settings, the engine, and who holds SQLite's write lock (/proc/locks).

Part of the `fedcli.tracking.store` package (docs/architecture.md §6), whose docstring gives the layout.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event
from sqlalchemy.engine import Engine
from sqlalchemy.engine.url import URL, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from fedcli.errors import TrackingError
from fedcli.tracking.store.common import (
    BEGIN_OPTION,
    HOSTNAME,
    SQLITE_BUSY_TIMEOUT_MS,
    STORE_FIX,
    WAL_SWITCH_S,
    _first_line,
)
from fedcli.tracking.urls import mask_url, sqlite_path


def _on_sqlite_connect(
    dbapi_connection: Any, connection_record: Any, busy_ms: int = SQLITE_BUSY_TIMEOUT_MS
) -> None:
    """Per-connection SQLite settings; hand transaction control to SQLAlchemy."""
    dbapi_connection.isolation_level = None  # the driver emits no BEGIN; `_on_sqlite_begin` does
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout = {busy_ms}")
        _enable_wal(cursor)
        cursor.execute("PRAGMA synchronous = NORMAL")
        cursor.execute("PRAGMA foreign_keys = ON")
    finally:
        cursor.close()


def _enable_wal(cursor: Any) -> None:
    """Switch the file to WAL unless it is already (the mode is stored in the file).

    Changing the journal mode needs the database to itself, and SQLite answers "database is
    locked" at once, without its busy handler, when another connection is opening the same new
    file at that moment (four processes creating one store); retry within the busy timeout.
    """
    deadline = time.monotonic() + WAL_SWITCH_S
    while True:
        try:
            if str(cursor.execute("PRAGMA journal_mode").fetchone()[0]).lower() != "wal":
                cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as err:
            if "locked" not in str(err) or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def _on_sqlite_begin(conn: Any) -> None:
    """Emit BEGIN IMMEDIATE for write connections, a deferred BEGIN for reads."""
    mode = conn.get_execution_options().get(BEGIN_OPTION, "DEFERRED")
    conn.exec_driver_sql(f"BEGIN {mode}")


def sqlite_lock_holder(db_file: Path) -> int | None:
    """The pid of the process holding the write lock of a SQLite file, from /proc/locks (Linux).

    In WAL mode a writer holds a POSIX lock on byte 120 of `<db>-shm` (SQLite's
    WAL_WRITE_LOCK); in rollback mode, the RESERVED byte (0x40000001) of the file itself.
    Reading /proc/locks opens neither file: closing a descriptor of the database would drop
    this process's own SQLite locks on it. None when no other process holds it, off Linux,
    or when the holder runs in another pid namespace.
    """
    targets: dict[int, int] = {}
    for path, byte in ((Path(f"{db_file}-shm"), 120), (db_file, 0x40000001)):
        with contextlib.suppress(OSError):
            targets[path.stat().st_ino] = byte
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        if "->" in parts:  # a waiter, not a holder
            continue
        try:
            kind, mode, pid = parts[1], parts[3], int(parts[4])
            inode = int(parts[5].rsplit(":", 1)[1])
            start, end = int(parts[6]), (math.inf if parts[7] == "EOF" else int(parts[7]))
        except (IndexError, ValueError):
            continue
        byte = targets.get(inode, -1)
        if kind == "POSIX" and mode == "WRITE" and start <= byte <= end and pid != os.getpid():
            return pid
    return None


def _pg_session_args(parsed: URL, busy_ms: int) -> dict[str, str]:
    """libpq session settings of a PostgreSQL store (psycopg drivers), unless the URL sets them:
    `lock_timeout` (a row lock held by a stopped process is waited for `busy_ms`, then retried
    like SQLite's write lock, instead of forever) and an `application_name` naming this
    process, which `SqlStore._holder` reads back from pg_stat_activity."""
    if parsed.get_driver_name() not in ("psycopg", "psycopg2"):
        return {}
    args = {
        "options": f"-c lock_timeout={busy_ms}",
        "application_name": f"fedcli pid {os.getpid()} on {HOSTNAME}"[:63],
    }
    return {key: value for key, value in args.items() if key not in parsed.query}


def open_engine(url: str, busy_ms: int = SQLITE_BUSY_TIMEOUT_MS) -> tuple[Engine, str]:
    """Parse `url`, prepare a SQLite file's directory, build the engine with its hooks
    (`busy_ms`: SQLite's busy timeout of one attempt at its write lock)."""
    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError) as err:  # ValueError: a port that is not a number, an unclosed "["
        raise TrackingError(  # the string did not parse: mask_url masks it from its user name to its last "@"
            f"store {mask_url(url)!r} is not a valid SQLAlchemy URL: {mask_url(_first_line(err))}; "
            "pass --store sqlite:////absolute/path/fedcli.db or set FEDCLI_STORE"
        ) from None
    shown = mask_url(parsed.render_as_string(hide_password=False))  # `?password=` too: not only user:***@
    is_sqlite = parsed.get_backend_name() == "sqlite"
    db_file = sqlite_path(parsed)
    if db_file is not None:
        try:
            db_file.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise TrackingError(f"store {shown!r} is not writable: {err}; {STORE_FIX}") from err
    try:  # pool_pre_ping: a connection that a restarted server dropped is replaced before use
        engine = (
            create_engine(parsed, connect_args={"timeout": busy_ms / 1000})
            if is_sqlite
            else create_engine(parsed, pool_pre_ping=True, connect_args=_pg_session_args(parsed, busy_ms))
        )
    except (ArgumentError, NoSuchModuleError, ImportError) as err:
        raise TrackingError(f"store {shown!r} cannot be used: {_first_line(err)}; {STORE_FIX}") from err
    if is_sqlite:
        event.listen(engine, "connect", functools.partial(_on_sqlite_connect, busy_ms=busy_ms))
        event.listen(engine, "begin", _on_sqlite_begin)
    else:  # psycopg's own warning about a lost connection repeats the store's one line (`SqlStore._retry`)
        logging.getLogger("psycopg").setLevel(logging.ERROR)
    return engine, shown
