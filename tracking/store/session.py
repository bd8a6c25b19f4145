"""The SQL store's session layer: opening a store (its schema created or upgraded once, under the
database's own lock), one session per call, failures in one line, the retry of a locked or lost
store with the lock holder named, and the lease check of every write (the module docstring of
tracking/store/sql_store.py describes them). `StoreSession` is the base of the store's writes
(writes.py) and reads (queries.py); `SqlStore` (sql_store.py) joins them.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

from sqlalchemy import inspect, select, text
from sqlalchemy import update as sql_update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import CursorResult
from sqlalchemy.exc import DisconnectionError, InterfaceError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session

from fedcli.errors import ConfigError, TrackingError
from fedcli.tracking.store.common import (
    BEGIN_OPTION,
    HOSTNAME,
    RETRY_ENV,
    RETRY_S,
    SQLITE_BUSY_TIMEOUT_MS,
    STORE_FIX,
    RunTakenOver,
    StoreUnavailable,
    Transient,
    _first_line,
    disk_full,
    env_seconds,
    log,
    utcnow,
)
from fedcli.tracking.store.engine import open_engine, sqlite_lock_holder
from fedcli.tracking.store.liveness import pid_state
from fedcli.tracking.store.schema import Base, Run, schema_current, upgrade_schema
from fedcli.tracking.urls import sqlite_path

_P = ParamSpec("_P")
_R = TypeVar("_R")
_S = TypeVar("_S", bound="StoreSession")


def retrying(method: Callable[Concatenate[_S, _P], _R]) -> Callable[Concatenate[_S, _P], _R]:
    """A public store method, retried whole while the store is locked or its server gone (`_retry`);
    typed as the method itself, so that mypy checks its callers (and `RunStore`, tracking/store/protocol.py)."""

    @functools.wraps(method)
    def retried(self: _S, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        return cast("_R", self._retry(method.__name__, lambda: method(self, *args, **kwargs)))

    return retried


class StoreSession:
    """A store's connection, transactions and retries; every write and read method is built on `_session`
    and `_retry` (`retrying`). Opened as `SqlStore` (its docstring gives the arguments)."""

    def __init__(self, url: str, *, setup_schema: bool = True, retry_s: float | None = None) -> None:
        self.retry_s = env_seconds(RETRY_ENV, RETRY_S) if retry_s is None else retry_s
        self._engine, self.url = open_engine(url, int(min(SQLITE_BUSY_TIMEOUT_MS, self.retry_s * 250)))
        self._write_engine = self._engine.execution_options(**{BEGIN_OPTION: "IMMEDIATE"})
        self._sqlite = self._engine.dialect.name == "sqlite"
        self._db_file = sqlite_path(self._engine.url)
        self._leases: dict[str, str] = {}  # run id -> the lease token this process holds on it
        self._local = threading.local()  # per thread: inside a retried call (no nested retries)
        self._announced = -math.inf  # when a wait for this store was last announced (one warning per outage)
        self._read_columns: list[Any] | None = None  # `reader` of an older store: the runs columns it has
        if not setup_schema:  # a reader of an existing store (the MLflow mirror): take no write lock
            return
        try:
            with self._engine.connect() as conn:  # a read: no lock, answered while a writer is stopped
                current = schema_current(conn)
            if not current:
                self._retry("set up the store", self._setup_schema, kinds=("locked",))
        except SQLAlchemyError as err:
            self._engine.dispose()
            raise TrackingError(
                f"store {self.url!r} cannot be opened: {_first_line(err)}; {STORE_FIX}"
            ) from err
        except TrackingError:
            self._engine.dispose()
            raise
        log.debug("opened store %s", self.url)

    def _setup_schema(self) -> None:
        try:
            with self._write_engine.begin() as conn:
                upgrade_schema(conn)
        except SQLAlchemyError as err:
            kind = self._transient(err)
            if kind is not None:
                raise Transient(kind, "set up the store", err) from err
            raise TrackingError(
                f"store {self.url!r} is not writable: {_first_line(err)}; {STORE_FIX}"
            ) from err

    def close(self) -> None:
        """Release all pooled connections."""
        self._engine.dispose()

    @contextlib.contextmanager
    def _session(self, what: str, *, write: bool) -> Iterator[Session]:
        """One transaction; database failures become `TrackingError` naming `what` (`Transient`
        for a locked file or a lost server, which the public methods retry)."""
        engine = self._write_engine if write else self._engine
        try:
            with Session(engine, expire_on_commit=False) as session, session.begin():
                yield session
        except SQLAlchemyError as err:
            if disk_full(err):
                raise TrackingError(
                    f"no space left on device for the store {self.url!r} (could not {what}); "
                    "free disk space, then resume the run with `fedcli train --resume RUN`"
                ) from err
            kind = self._transient(err)
            if kind is not None:
                raise Transient(kind, what, err) from err
            raise TrackingError(f"store {self.url!r} could not {what}: {_first_line(err)}") from err

    def _transient(self, err: SQLAlchemyError) -> str | None:
        """ "locked" (SQLite's write lock is held elsewhere), "lost" (the server connection), else None."""
        if self._sqlite:
            message = str(getattr(err, "orig", None) or err).lower()
            return (
                "locked"
                if isinstance(err, OperationalError) and ("locked" in message or "busy" in message)
                else None
            )
        if getattr(getattr(err, "orig", None), "sqlstate", None) == "55P03":  # lock_timeout: a row lock held
            return "locked"
        if isinstance(err, (OperationalError, InterfaceError, DisconnectionError)) or getattr(
            err, "connection_invalidated", False
        ):
            return "lost"
        return None

    def _retry(self, name: str, call: Any, *, kinds: tuple[str, ...] = ("locked", "lost")) -> Any:
        """Run `call()` (one whole transaction), retrying a locked file or a lost server for `retry_s`.

        Says once, as a warning, what it waits for ("store … is locked by pid N (running run
        X); waiting up to 60 s"), and when the store answers again. Nested calls run once:
        only the outermost public method retries.

        Raises:
            StoreUnavailable: Still locked or unreachable after `retry_s` seconds.
        """
        local = self._local
        if getattr(local, "busy", False):
            return call()
        local.busy = True
        try:
            start, delay, waiting = time.monotonic(), 0.05, False
            while True:
                try:
                    result = call()
                except Transient as err:
                    if err.kind not in kinds:
                        raise TrackingError(
                            f"store {self.url!r} could not {err.what}: {err}; {STORE_FIX}"
                        ) from err
                    if not waiting:
                        waiting = True
                        if time.monotonic() - self._announced > self.retry_s:  # once per outage, all threads
                            self._announced = time.monotonic()
                            log.warning("%s", self._waiting(err))
                    waited = time.monotonic() - start
                    if waited >= self.retry_s:
                        raise StoreUnavailable(self._gave_up(err, waited)) from err
                    time.sleep(min(delay, max(0.0, self.retry_s - waited)))
                    delay = min(delay * 2, 2.0)
                    continue
                if waiting and self._announced >= start:
                    log.warning("store %s answers again after %.1f s", self.url, time.monotonic() - start)
                return result
        finally:
            local.busy = False

    def _holder(self) -> tuple[int | None, str]:
        """Who holds the lock: its pid and, in words, "pid N (running run X, stopped)" (or "another
        process" when /proc, or PostgreSQL's pg_stat_activity, does not say).

        SQLite: the holder of the WAL write lock in /proc/locks. PostgreSQL: the fedcli session of
        this database longest idle in a transaction (`application_name` "fedcli pid N on H").
        """
        pid, host = (sqlite_lock_holder(self._db_file) if self._db_file is not None else None), HOSTNAME
        if not self._sqlite:
            with contextlib.suppress(Exception), self._engine.connect() as conn:
                name = conn.execute(
                    text(
                        "SELECT application_name FROM pg_stat_activity WHERE datname = current_database() "
                        "AND pid <> pg_backend_pid() AND state LIKE 'idle in transaction%' "
                        "AND application_name LIKE 'fedcli pid %' ORDER BY xact_start LIMIT 1"
                    )
                ).scalar()
                words = str(name or "").split()
                if len(words) >= 5:
                    pid, host = int(words[2]), words[4]
            if pid is not None and host != HOSTNAME:
                return pid, f"pid {pid} on {host}"
        if pid is None:
            return None, "another process"
        what: str | None = None
        with (
            contextlib.suppress(Exception),
            Session(self._engine) as session,
        ):  # a read: the lock does not block it
            found = session.scalars(
                select(Run.id).where(Run.host == HOSTNAME, Run.pid == pid, Run.status == "running")
            ).first()
            what = f"running run {found[:8]}" if found else None
        if what is None:  # the program's name only: a command line may hold a password
            with contextlib.suppress(OSError):
                what = Path(f"/proc/{pid}/comm").read_text().strip() or None
        details = ", ".join(x for x in (what, "stopped" if pid_state(pid) == "stopped" else None) if x)
        return pid, f"pid {pid}" + (f" ({details})" if details else "")

    def _waiting(self, err: Transient) -> str:
        if err.kind == "locked":
            return (
                f"store {self.url} is locked by {self._holder()[1]}; waiting up to {self.retry_s:.0f} s to "
                f"{err.what}"
            )
        return f"lost the connection to the store {self.url} ({err}); retrying for up to {self.retry_s:.0f} s"

    def _gave_up(self, err: Transient, waited: float) -> str:
        if err.kind == "locked":
            pid, holder = self._holder()
            who = "PID" if pid is None else str(pid)
            return (
                f"store {self.url} is locked by {holder} and stayed locked for {waited:.0f} s, so this "
                f"process could not {err.what}; let that process finish (`kill -CONT {who}` if it is stopped) "
                f"or end it, then retry ({RETRY_ENV} sets how long to wait)"
            )
        return (
            f"the store {self.url} cannot be reached ({err}) and did not come back within {waited:.0f} s, so "
            f"this process could not {err.what}; check the database server, then retry ({RETRY_ENV} sets "
            "how long to wait)"
        )

    def _own(self, session: Session, run_id: str, now: datetime | None = None) -> Run:
        """The run, checked in this transaction to be still this process's (when it holds its lease).

        `UPDATE runs SET heartbeat_at = now WHERE id = … AND lease = <token>`: on SQLite under
        the write lock, on PostgreSQL taking the row's lock, so a takeover cannot slip
        between the check and the writes that follow in the same transaction.

        Raises:
            RunTakenOver: Another process resumed the run (nothing of this transaction is written).
        """
        token = self._leases.get(run_id)
        if token is None:  # not a run this process owns (a test, `fedcli evaluate`, the mirror)
            return self._require_run(session, run_id)
        result = session.execute(
            sql_update(Run)
            .where(Run.id == run_id, Run.lease == token)
            .values(heartbeat_at=now or utcnow())
            .execution_options(synchronize_session=False)
        )
        run = self._require_run(session, run_id)
        if cast("CursorResult[Any]", result).rowcount != 1:
            raise RunTakenOver(run_id, run.pid, run.host)
        return run

    def _upsert(
        self, session: Session, model: type[Base], rows: list[dict[str, Any]], update: Sequence[str]
    ) -> None:
        """Insert `rows`, overwriting the `update` columns of rows whose primary key exists."""
        if not rows:
            return
        table = model.__table__
        dialect = self._engine.dialect.name
        if dialect in ("sqlite", "postgresql"):
            stmt = (sqlite if dialect == "sqlite" else postgresql).insert(table)
            keys = [column.name for column in inspect(model).primary_key]
            stmt = stmt.on_conflict_do_update(index_elements=keys, set_={c: stmt.excluded[c] for c in update})
            session.execute(stmt, rows)
        else:  # portable fallback: one merge per row, still inside the caller's transaction
            for row in rows:
                session.merge(model(**row))

    @staticmethod
    def _require_run(session: Session, run_id: str) -> Run:
        run = session.get(Run, run_id)
        if run is None:
            raise ConfigError(f"unknown run {run_id!r}; `fedcli list runs` shows the ids")
        return run
