"""The SQL results store: experiments, runs, per-round metrics, checkpoints, evaluations.

This store is the source of truth for `fedcli report` (docs/style.md rule 15/19). It accepts
any SQLAlchemy URL; the default is a SQLite file under `./fedcli-runs/` in WAL mode so
that several `fedcli train … &` processes can write the same file at once:

- every connection sets `busy_timeout` (30 s), `journal_mode=WAL`, `synchronous=NORMAL`
  and `foreign_keys=ON`;
- SQLAlchemy, not the `sqlite3` driver, emits `BEGIN`: writes use `BEGIN IMMEDIATE`, so a
  writer takes the write lock up front and waits for it through the busy timeout instead
  of failing with "database is locked" when it upgrades a read snapshot, and schema
  creation is one transaction (two processes opening a fresh file do not both create
  the tables). Reads use a plain deferred `BEGIN` and never block writers (WAL).

Metrics are stored in long form, one row per (run, round, key), written one transaction
per round; re-logging a (run, round, key) overwrites it, which `--resume` relies on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import errno
import hashlib
import json
import logging
import math
import os
import re
import socket
import sqlite3
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    DateTime,
    Double,
    ForeignKey,
    String,
    Text,
    create_engine,
    delete,
    event,
    func,
    inspect,
    select,
    text,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import CursorResult, Engine
from sqlalchemy.engine.url import URL, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, SQLAlchemyError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column
from sqlalchemy.types import TypeDecorator

from fedcli.errors import ConfigError, TrackingError
from fedcli.tracking.keys import NonFiniteMetricsError, check_metric_key, check_metrics, flatten_config

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "END_STATUSES",
    "RUN_STATUSES",
    "Base",
    "Checkpoint",
    "ClientMetric",
    "Evaluation",
    "Experiment",
    "RoundMetric",
    "Run",
    "RunRecord",
    "SqlStore",
    "canonical_json",
    "config_hash",
    "default_store_url",
]

log = logging.getLogger(__name__)

RUN_STATUSES = ("running", "finished", "failed", "interrupted")
END_STATUSES = ("finished", "failed", "interrupted")
SETTABLE_RUN_FIELDS = frozenset({"model_path", "mlflow_run_id", "git_commit", "mlflow_synced_round"})
SQLITE_BUSY_TIMEOUT_MS = 30_000
HEARTBEAT_S = 10.0  # a live run refreshes runs.heartbeat_at this often (fedcli.engine.lifecycle)
STALE_S = 60.0  # a `running` run whose heartbeat is older than this reads as `interrupted`
HOSTNAME = socket.gethostname()
_LOCK_KEY = 0x66656463  # "fedc": the PostgreSQL advisory-lock key of schema setup
_BEGIN_OPTION = "fedcli_sqlite_begin"  # execution option read by the SQLite "begin" hook
_RUN_ID_RE = re.compile(r"^[0-9a-f]{32}$")
_HEX_RE = re.compile(r"^[0-9a-f]+$")
_STORE_FIX = "pass --store with a writable path or set FEDCLI_STORE"


# --------------------------------------------------------------------------- helpers


def canonical_json(obj: Any) -> str:
    """Serialise plain data deterministically: sorted keys, no spaces, ASCII, no NaN.

    Args:
        obj: JSON-able data (dicts with string keys, lists, str, int, float, bool, None).

    Returns:
        The canonical JSON text; equal data always gives byte-identical text.

    Raises:
        TypeError: If `obj` holds something JSON cannot represent.
        ValueError: If `obj` holds NaN or infinity.
    """
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def config_hash(obj: Any) -> str:
    """Return the SHA-256 hex digest of `canonical_json(obj)` (the `fedcli.config_hash` tag)."""
    return hashlib.sha256(canonical_json(obj).encode("utf-8")).hexdigest()


def default_store_url(root: Path = Path("fedcli-runs")) -> str:
    """Return the default store URL, `sqlite:///<root>/fedcli.db` with `root` made absolute.

    Args:
        root: The runs directory; relative paths are resolved against the working directory.
    """
    path = Path(root).expanduser().resolve() / "fedcli.db"
    return f"sqlite:///{path.as_posix()}"


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


def _first_line(err: BaseException) -> str:
    orig = getattr(err, "orig", None)
    text = str(orig if orig is not None else err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _check_round_idx(round_idx: int) -> int:
    if isinstance(round_idx, bool) or not isinstance(round_idx, int) or round_idx < 0:
        raise ValueError(f"round_idx must be an int >= 0; got {round_idx!r}.")
    return round_idx


def _check_str_mapping(name: str, mapping: Mapping[str, str]) -> dict[str, str]:
    bad = {
        key: value for key, value in mapping.items() if not isinstance(key, str) or not isinstance(value, str)
    }
    if bad:
        raise ValueError(f"{name} must map str to str; got {bad!r}.")
    return dict(mapping)


# --------------------------------------------------------------------------- schema


class UtcDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime stored as a naive UTC `DateTime` (portable to SQLite)."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        """Convert an aware datetime to naive UTC; naive input is a bug."""
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"datetimes stored in the fedcli store must be timezone-aware; got {value!r}.")
        return value.astimezone(timezone.utc).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        """Attach UTC to the naive value read back."""
        return None if value is None else value.replace(tzinfo=timezone.utc)


class Base(DeclarativeBase):
    """Declarative base of the fedcli store schema."""


class Experiment(Base):
    """A named group of runs (`--experiment`)."""

    __tablename__ = "experiments"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(250), unique=True)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())


class Run(Base):
    """One `fedcli train` run: its full config, versions, status and outcome."""

    __tablename__ = "runs"
    __table_args__ = (CheckConstraint(f"status IN {RUN_STATUSES!r}", name="ck_runs_status"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True)  # uuid4().hex
    experiment_id: Mapped[int] = mapped_column(ForeignKey("experiments.id"), index=True)
    run_name: Mapped[str] = mapped_column(String(250), index=True)
    algo: Mapped[str] = mapped_column(String(100))
    task: Mapped[str] = mapped_column(String(100))
    seed: Mapped[int]
    status: Mapped[str] = mapped_column(String(16))
    config_json: Mapped[str] = mapped_column(Text)  # canonical_json(config)
    config_hash: Mapped[str] = mapped_column(String(64), index=True)  # sha256 of config_json
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())
    ended_at: Mapped[datetime | None] = mapped_column(UtcDateTime())
    fedcli_version: Mapped[str] = mapped_column(String(64))
    torch_version: Mapped[str] = mapped_column(String(64))
    git_commit: Mapped[str | None] = mapped_column(String(64))
    failure_reason: Mapped[str | None] = mapped_column(Text)
    diverged_at_round: Mapped[int | None]
    model_path: Mapped[str | None] = mapped_column(Text)
    mlflow_run_id: Mapped[str | None] = mapped_column(String(64))
    tags_json: Mapped[str] = mapped_column(Text)  # canonical_json(tags)
    # run lifecycle (added after the first release; `_migrate` adds them to older stores)
    heartbeat_at: Mapped[datetime | None] = mapped_column(UtcDateTime())  # refreshed while alive
    host: Mapped[str | None] = mapped_column(String(255))  # where the live process runs
    pid: Mapped[int | None]  # its process id
    mlflow_synced_round: Mapped[int | None]  # highest round the MLflow mirror has written
    requested_json: Mapped[str | None] = mapped_column(Text)  # the config as asked for (config_json: as run)


class RoundMetric(Base):
    """One metric value of one round, long form; `round_idx = 0` is the initial model."""

    __tablename__ = "round_metrics"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    round_idx: Mapped[int] = mapped_column(primary_key=True)
    key: Mapped[str] = mapped_column(String(250), primary_key=True)
    value: Mapped[float] = mapped_column(Double())
    logged_ms: Mapped[int | None] = mapped_column(BigInteger())  # epoch ms (MLflow's timestamp)


class ClientMetric(Base):
    """One metric value of one client in one round."""

    __tablename__ = "client_metrics"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    round_idx: Mapped[int] = mapped_column(primary_key=True)
    client_id: Mapped[int] = mapped_column(primary_key=True)
    key: Mapped[str] = mapped_column(String(250), primary_key=True)
    value: Mapped[float] = mapped_column(Double())


class Checkpoint(Base):
    """A checkpoint file written after `round_idx`."""

    __tablename__ = "checkpoints"

    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), primary_key=True)
    round_idx: Mapped[int] = mapped_column(primary_key=True)
    path: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())


class Evaluation(Base):
    """One metric of a `fedcli evaluate` call (a round's checkpoint or the final model)."""

    __tablename__ = "evaluations"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id"), index=True)
    round_idx: Mapped[int | None]
    split: Mapped[str] = mapped_column(String(32))
    key: Mapped[str] = mapped_column(String(250))
    value: Mapped[float] = mapped_column(Double())
    options_json: Mapped[str] = mapped_column(Text)  # canonical_json(options)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime())


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """A run as read from the store, with its config and tags parsed.

    Attributes mirror the `runs` table; `experiment` is the experiment's name, `config`
    the parsed `config_json` and `tags` the parsed `tags_json`.
    """

    id: str
    experiment: str
    run_name: str
    algo: str
    task: str
    seed: int
    status: str
    config: dict[str, Any]
    config_json: str
    config_hash: str
    tags: dict[str, str]
    created_at: datetime
    ended_at: datetime | None
    fedcli_version: str
    torch_version: str
    git_commit: str | None
    failure_reason: str | None
    diverged_at_round: int | None
    model_path: str | None
    mlflow_run_id: str | None
    heartbeat_at: datetime | None = None
    host: str | None = None
    pid: int | None = None
    mlflow_synced_round: int | None = None
    stored_status: str = ""  # the status column as written; `status` is what it means now
    requested: dict[str, Any] | None = None  # the config as asked for (auto, None); `config` is as it ran

    @property
    def is_alive(self) -> bool:
        """True while the run's process is (as far as the store can tell) still training it."""
        return self.status == "running"


def _liveness(run: Run, now: datetime) -> tuple[str, str | None]:
    """(status, reason) of a run as it stands now: a `running` run whose process is gone is `interrupted`.

    Gone means: its heartbeat is older than `STALE_S`, or it runs on this host and its pid
    no longer exists (so a killed run reads as interrupted at once on its own machine).
    """
    if run.status != "running":
        return run.status, run.failure_reason
    beat = run.heartbeat_at or run.created_at
    age = (now - beat).total_seconds()
    if age > STALE_S:
        return "interrupted", f"no heartbeat for {age:.0f} s (process killed or machine down)"
    if run.host == HOSTNAME and run.pid is not None and not _pid_alive(run.pid):
        return "interrupted", f"process {run.pid} on {run.host} is gone (killed)"
    return "running", None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


# Fields of RunRecord that `list_runs(where=...)` matches directly (before config and tags).
_WHERE_FIELDS = (
    "id",
    "experiment",
    "run_name",
    "algo",
    "task",
    "seed",
    "status",
    "config_hash",
    "fedcli_version",
    "torch_version",
    "git_commit",
    "mlflow_run_id",
)


def _to_record(run: Run, experiment: str, now: datetime | None = None) -> RunRecord:
    status, reason = _liveness(run, now or _utcnow())
    return RunRecord(
        id=run.id,
        experiment=experiment,
        run_name=run.run_name,
        algo=run.algo,
        task=run.task,
        seed=run.seed,
        status=status,
        config=json.loads(run.config_json),
        config_json=run.config_json,
        config_hash=run.config_hash,
        tags=json.loads(run.tags_json),
        created_at=run.created_at,
        ended_at=run.ended_at,
        fedcli_version=run.fedcli_version,
        torch_version=run.torch_version,
        git_commit=run.git_commit,
        failure_reason=reason,
        diverged_at_round=run.diverged_at_round,
        model_path=run.model_path,
        mlflow_run_id=run.mlflow_run_id,
        heartbeat_at=run.heartbeat_at,
        host=run.host,
        pid=run.pid,
        mlflow_synced_round=run.mlflow_synced_round,
        stored_status=run.status,
        requested=json.loads(run.requested_json) if run.requested_json else None,
    )


# --------------------------------------------------------------------------- where-filters


def _where_view(record: RunRecord) -> dict[str, str]:
    """Everything `list_runs(where=...)` can match, as strings: fields > config > tags."""
    view = dict(record.tags)
    view.update(flatten_config(record.config))
    view.update({name: str(getattr(record, name)) for name in _WHERE_FIELDS})
    return view


def _same_value(actual: str, wanted: str) -> bool:
    if actual == wanted:
        return True
    if actual.lower() in ("true", "false", "none"):
        return actual.lower() == wanted.lower()
    try:
        return float(actual) == float(wanted)
    except ValueError:
        return False


def _filter_where(records: list[RunRecord], where: Mapping[str, str]) -> list[RunRecord]:
    views = [_where_view(record) for record in records]
    known = set().union(*views)
    for key in where:
        if views and key not in known:
            near = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(
                f"unknown run filter key {key!r}{hint}; filters match run fields, config keys and tags."
            )
    return [
        record
        for record, view in zip(records, views, strict=True)
        if all(key in view and _same_value(view[key], str(wanted)) for key, wanted in where.items())
    ]


# --------------------------------------------------------------------------- SQLite setup


def _on_sqlite_connect(dbapi_connection: Any, connection_record: Any) -> None:
    """Per-connection SQLite settings; hand transaction control to SQLAlchemy."""
    dbapi_connection.isolation_level = None  # the driver emits no BEGIN; `_on_sqlite_begin` does
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
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
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
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
    mode = conn.get_execution_options().get(_BEGIN_OPTION, "DEFERRED")
    conn.exec_driver_sql(f"BEGIN {mode}")


def _sqlite_file(url: URL) -> Path | None:
    """The database file of a SQLite URL, or None for in-memory and `file:` URI databases."""
    database = url.database
    if not database or database == ":memory:" or url.query.get("uri") or database.startswith("file:"):
        return None
    return Path(database).expanduser()


def _create_engine(url: str) -> tuple[Engine, str]:
    """Parse `url`, prepare a SQLite file's directory, build the engine with its hooks."""
    try:
        parsed = make_url(url)
    except ArgumentError as err:
        raise TrackingError(
            f"store {url!r} is not a valid SQLAlchemy URL: {_first_line(err)}; "
            "pass --store sqlite:////absolute/path/fedcli.db or set FEDCLI_STORE"
        ) from err
    shown = parsed.render_as_string(hide_password=True)
    is_sqlite = parsed.get_backend_name() == "sqlite"
    db_file = _sqlite_file(parsed) if is_sqlite else None
    if db_file is not None:
        try:
            db_file.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise TrackingError(f"store {shown!r} is not writable: {err}; {_STORE_FIX}") from err
    try:
        engine = create_engine(
            parsed, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000} if is_sqlite else {}
        )
    except (ArgumentError, NoSuchModuleError, ImportError) as err:
        raise TrackingError(f"store {shown!r} cannot be used: {_first_line(err)}; {_STORE_FIX}") from err
    if is_sqlite:
        event.listen(engine, "connect", _on_sqlite_connect)
        event.listen(engine, "begin", _on_sqlite_begin)
    return engine, shown


# --------------------------------------------------------------------------- schema setup

# Columns added after the first release: (table, column, SQL type). `_setup_schema` adds the
# missing ones to an older store, in the same locked transaction that creates the tables.
_ADDED_COLUMNS = (
    ("runs", "heartbeat_at", "TIMESTAMP"),
    ("runs", "host", "VARCHAR(255)"),
    ("runs", "pid", "INTEGER"),
    ("runs", "mlflow_synced_round", "INTEGER"),
    ("round_metrics", "logged_ms", "BIGINT"),
    ("runs", "requested_json", "TEXT"),
)


def _setup_schema(conn: Any) -> None:
    """Create missing tables and columns, once, however many processes open the store together.

    One transaction under the database's own lock: `BEGIN IMMEDIATE` on SQLite (the write
    lock, taken before reading the schema) and a transaction-scoped advisory lock on
    PostgreSQL (`CREATE TABLE IF NOT EXISTS` alone races on the catalogue). DDL is
    transactional on both, so a process killed half-way leaves no half-made schema.
    """
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _LOCK_KEY})
    Base.metadata.create_all(conn)
    inspector = inspect(conn)
    for table, column, sql_type in _ADDED_COLUMNS:
        if column not in {c["name"] for c in inspector.get_columns(table)}:
            conn.execute(text(f"ALTER TABLE {table} ADD COLUMN {column} {sql_type}"))
            log.info("store: added column %s.%s (store made by an older fedcli)", table, column)


def disk_full(err: BaseException) -> bool:
    """True when an error (OSError or a database error) means the disk is full."""
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return True
    return "disk is full" in str(getattr(err, "orig", None) or err).lower()


# --------------------------------------------------------------------------- the store


class SqlStore:
    """The fedcli results store on any SQLAlchemy URL.

    Every public method is one transaction. Methods that take a `run_id` want the full id
    (use `get_run` to resolve a prefix or a run name first).

    Args:
        url: A SQLAlchemy URL, e.g. `default_store_url(Path("fedcli-runs"))`,
            `sqlite:////abs/path/fedcli.db` or `postgresql+psycopg://user@host/db`.

    Raises:
        TrackingError: If the URL is malformed, its driver is missing, or the database
            cannot be created or written (one line naming the URL and the fix).
    """

    def __init__(self, url: str, *, setup_schema: bool = True) -> None:
        self._engine, self.url = _create_engine(url)
        self._write_engine = self._engine.execution_options(**{_BEGIN_OPTION: "IMMEDIATE"})
        if not setup_schema:  # a reader of an existing store (the MLflow mirror): take no write lock
            return
        try:
            with self._write_engine.begin() as conn:
                _setup_schema(conn)
        except SQLAlchemyError as err:
            self._engine.dispose()
            raise TrackingError(
                f"store {self.url!r} is not writable: {_first_line(err)}; {_STORE_FIX}"
            ) from err
        log.debug("opened store %s", self.url)

    def __enter__(self) -> SqlStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Release all pooled connections."""
        self._engine.dispose()

    # ----------------------------------------------------------------- sessions

    @contextlib.contextmanager
    def _session(self, what: str, *, write: bool) -> Iterator[Session]:
        """One transaction; database failures become `TrackingError` naming `what`."""
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
            raise TrackingError(f"store {self.url!r} could not {what}: {_first_line(err)}") from err

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

    # ----------------------------------------------------------------- runs

    def start_run(
        self,
        *,
        experiment: str,
        run_name: str | None,
        config: Mapping[str, Any],
        algo: str,
        task: str,
        seed: int,
        tags: Mapping[str, str],
        fedcli_version: str,
        torch_version: str,
        git_commit: str | None,
        run_id: str | None = None,
        requested: Mapping[str, Any] | None = None,
        config_hash: str | None = None,
    ) -> str:
        """Create a run with status `running`, and its experiment if missing.

        `config` is the config as it runs (defaults resolved: model, device, executor, number
        of clients); `requested` the config as asked for (kept for `--resume`) and
        `config_hash` its identity (default: the SHA-256 of `config`'s canonical JSON).

        `config` (plain data) is stored as canonical JSON with its SHA-256; `run_name`
        defaults to `f"{algo}-{task}-s{seed}-{run_id[:6]}"`; `run_id` (32 lowercase hex,
        e.g. chosen by a sweep) defaults to a new uuid4. Returns the run id.

        Raises:
            ValueError: Malformed `run_id`, or tags that are not str -> str.
            TrackingError: The id already exists or the store cannot be written.
        """
        if run_id is not None and not _RUN_ID_RE.match(run_id):
            raise ValueError(f"run_id must be 32 lowercase hex characters; got {run_id!r}.")
        run_id = run_id or uuid.uuid4().hex
        config_text, now = canonical_json(config), _utcnow()
        run = Run(
            id=run_id,
            run_name=run_name or f"{algo}-{task}-s{seed}-{run_id[:6]}",
            algo=algo,
            task=task,
            seed=int(seed),
            status="running",
            config_json=config_text,
            config_hash=config_hash or hashlib.sha256(config_text.encode("utf-8")).hexdigest(),
            requested_json=None if requested is None else canonical_json(requested),
            created_at=now,
            fedcli_version=fedcli_version,
            torch_version=torch_version,
            git_commit=git_commit,
            tags_json=canonical_json(_check_str_mapping("tags", tags)),
            heartbeat_at=now,
            host=HOSTNAME,
            pid=os.getpid(),
        )
        with self._session("start a run", write=True) as session:
            run.experiment_id = self._experiment_id(session, experiment, now)
            session.add(run)
        log.debug("store: started run %s in experiment %r", run_id, experiment)
        return run_id

    @staticmethod
    def _experiment_id(session: Session, name: str, now: datetime) -> int:
        """Id of the named experiment, created if missing (atomic under BEGIN IMMEDIATE on SQLite)."""
        found = session.scalars(select(Experiment.id).where(Experiment.name == name)).first()
        if found is not None:
            return found
        if session.get_bind().dialect.name == "postgresql":  # two writers may both miss the select
            stmt = postgresql.insert(Experiment).values(name=name, created_at=now)
            session.execute(stmt.on_conflict_do_nothing(index_elements=["name"]))
            return session.scalars(select(Experiment.id).where(Experiment.name == name)).one()
        row = Experiment(name=name, created_at=now)  # SQLite: BEGIN IMMEDIATE already serialises writers
        session.add(row)
        session.flush()
        return row.id

    def end_run(
        self, run_id: str, status: str, *, reason: str | None = None, diverged_at_round: int | None = None
    ) -> None:
        """Mark a run ended.

        Args:
            run_id: Full run id.
            status: One of `finished`, `failed`, `interrupted`.
            reason: Why it failed or stopped (one line), if it did.
            diverged_at_round: The round whose metrics were non-finite, if any.
        """
        if status not in END_STATUSES:
            raise ValueError(f"status must be one of {', '.join(END_STATUSES)}; got {status!r}.")
        with self._session(f"end run {run_id}", write=True) as session:
            run = self._require_run(session, run_id)
            run.status, run.ended_at = status, _utcnow()
            run.failure_reason, run.diverged_at_round = reason, diverged_at_round

    def mark_running(self, run_id: str) -> None:
        """Set an ended run back to `running` in this process (for `--resume`), clearing its outcome.

        Raises:
            ConfigError: The run is alive in another process (fresh heartbeat).
        """
        with self._session(f"reopen run {run_id}", write=True) as session:
            run = self._require_run(session, run_id)
            now = _utcnow()
            status, _ = _liveness(run, now)
            if status == "running" and not (run.host == HOSTNAME and run.pid == os.getpid()):
                raise ConfigError(
                    f"run {run_id[:8]} is still running (pid {run.pid} on {run.host}, heartbeat "
                    f"{(now - (run.heartbeat_at or now)).total_seconds():.0f} s ago); stop it first "
                    "or wait for it to end"
                )
            run.status, run.ended_at = "running", None
            run.failure_reason, run.diverged_at_round = None, None
            run.heartbeat_at, run.host, run.pid = now, HOSTNAME, os.getpid()

    def heartbeat(self, run_id: str) -> None:
        """Record that the run's process is alive now (`fedcli.engine.lifecycle` calls it every few s)."""
        with self._session(f"heartbeat run {run_id}", write=True) as session:
            run = self._require_run(session, run_id)
            run.heartbeat_at = _utcnow()

    def update_config(self, run_id: str, config: Mapping[str, Any], hash_: str,
                      requested: Mapping[str, Any] | None = None) -> None:
        """Replace a run's stored config and hash (a resume that changes what the run trains, e.g. rounds)."""
        with self._session(f"update run {run_id}", write=True) as session:
            run = self._require_run(session, run_id)
            run.config_json, run.config_hash = canonical_json(config), hash_
            if requested is not None:
                run.requested_json = canonical_json(requested)
            tags = json.loads(run.tags_json)
            if "fedcli.config_hash" in tags:
                tags["fedcli.config_hash"] = hash_
                run.tags_json = canonical_json(tags)

    def set_run_fields(self, run_id: str, **fields: str | None) -> None:
        """Set some of `model_path`, `mlflow_run_id`, `git_commit` on a run."""
        unknown = sorted(set(fields) - SETTABLE_RUN_FIELDS)
        if unknown:
            raise ValueError(f"set_run_fields accepts {sorted(SETTABLE_RUN_FIELDS)}; got {unknown}.")
        with self._session(f"update run {run_id}", write=True) as session:
            run = self._require_run(session, run_id)
            for name, value in fields.items():
                setattr(run, name, value)

    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        """Add or overwrite string tags of a run."""
        new_tags = _check_str_mapping("tags", tags)
        with self._session(f"tag run {run_id}", write=True) as session:
            run = self._require_run(session, run_id)
            run.tags_json = canonical_json({**json.loads(run.tags_json), **new_tags})

    # ----------------------------------------------------------------- metrics

    def log_round(self, run_id: str, round_idx: int, metrics: Mapping[str, float],
                  clients: Iterable[tuple[int, str, float]] = ()) -> None:
        """Write one round's metrics, and its per-client rows `(client_id, key, value)`, in one
        transaction; existing rows of the same keys are overwritten. A client value that is not
        finite is left out (that client's round metrics are not a divergence of the run).

        Raises:
            ValueError: Bad key or round index.
            NonFiniteMetricsError: Some round value is NaN/inf; nothing was written.
        """
        values = check_metrics(metrics, _check_round_idx(round_idx))
        now = _utcnow()
        logged_ms = int(now.timestamp() * 1000)
        rows = [
            {"run_id": run_id, "round_idx": round_idx, "key": key, "value": value, "logged_ms": logged_ms}
            for key, value in values.items()
        ]
        client_rows = [{"run_id": run_id, "round_idx": round_idx, "client_id": int(client), "key": check_metric_key(key),
                        "value": float(value)} for client, key, value in clients if math.isfinite(value)]
        with self._session(f"log round {round_idx} of run {run_id}", write=True) as session:
            self._upsert(session, RoundMetric, rows, update=("value", "logged_ms"))
            if client_rows:
                self._upsert(session, ClientMetric, client_rows, update=("value",))
            run = session.get(Run, run_id)
            if run is not None:
                run.heartbeat_at = now

    def round_rows(self, run_id: str, after: int, upto: int) -> list[tuple[int, str, float, int | None]]:
        """Rows `(round_idx, key, value, logged_ms)` of rounds in (after, upto], by round then key."""
        stmt = (
            select(RoundMetric.round_idx, RoundMetric.key, RoundMetric.value, RoundMetric.logged_ms)
            .where(RoundMetric.run_id == run_id, RoundMetric.round_idx > after, RoundMetric.round_idx <= upto)
            .order_by(RoundMetric.round_idx, RoundMetric.key)
        )
        with self._session(f"read run {run_id}", write=False) as session:
            return [tuple(row) for row in session.execute(stmt)]  # type: ignore[misc]

    def log_client_metrics(self, run_id: str, round_idx: int, rows: Iterable[tuple[int, str, float]]) -> None:
        """Write per-client metrics of one round, rows of `(client_id, key, value)`, in one transaction."""
        _check_round_idx(round_idx)
        records: list[dict[str, Any]] = []
        for client_id, key, value in rows:
            check_metric_key(key)
            records.append(
                {
                    "run_id": run_id,
                    "round_idx": round_idx,
                    "client_id": int(client_id),
                    "key": key,
                    "value": float(value),
                }
            )
        bad = {
            f"{row['key']}@client{row['client_id']}": row["value"]
            for row in records
            if not math.isfinite(row["value"])
        }
        if bad:
            raise NonFiniteMetricsError(bad, bad, round_idx)
        with self._session(f"log client metrics of round {round_idx}", write=True) as session:
            self._upsert(session, ClientMetric, records, update=("value",))

    def last_round(self, run_id: str) -> int | None:
        """The highest round with logged metrics, or None if there is none."""
        with self._session(f"read run {run_id}", write=False) as session:
            return session.scalar(select(func.max(RoundMetric.round_idx)).where(RoundMetric.run_id == run_id))

    def delete_rounds_after(self, run_id: str, round_idx: int) -> int:
        """Drop round metrics, client metrics and checkpoint rows with round > `round_idx` (resume).

        `round_idx = -1` drops every round (a run resumed from scratch: killed before its first
        checkpoint).

        Returns:
            The number of round-metric rows deleted.
        """
        if round_idx != -1:
            _check_round_idx(round_idx)
        with self._session(f"truncate run {run_id}", write=True) as session:
            self._require_run(session, run_id)
            result = session.execute(
                delete(RoundMetric).where(RoundMetric.run_id == run_id, RoundMetric.round_idx > round_idx)
            )
            deleted = cast("CursorResult[Any]", result).rowcount
            for model in (ClientMetric, Checkpoint):
                session.execute(delete(model).where(model.run_id == run_id, model.round_idx > round_idx))
        log.debug("store: dropped %d metric rows of run %s after round %d", deleted, run_id, round_idx)
        return deleted

    # ----------------------------------------------------------------- checkpoints, evaluations

    def add_checkpoint(self, run_id: str, round_idx: int, path: str | Path) -> None:
        """Record (or replace) the checkpoint file written after `round_idx`."""
        row = {
            "run_id": run_id,
            "round_idx": _check_round_idx(round_idx),
            "path": str(path),
            "created_at": _utcnow(),
        }
        with self._session(f"record checkpoint {round_idx} of run {run_id}", write=True) as session:
            self._upsert(session, Checkpoint, [row], update=("path", "created_at"))

    def delete_checkpoints(self, run_id: str, rounds: Sequence[int]) -> None:
        """Forget the checkpoints of these rounds (retention; the files are removed by the caller)."""
        if not rounds:
            return
        with self._session(f"prune checkpoints of run {run_id}", write=True) as session:
            session.execute(
                delete(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.round_idx.in_(list(rounds)))
            )

    def checkpoints(self, run_id: str) -> list[tuple[int, str]]:
        """All checkpoints of a run as `(round_idx, path)`, by round."""
        stmt = select(Checkpoint.round_idx, Checkpoint.path).where(Checkpoint.run_id == run_id)
        with self._session(f"read checkpoints of run {run_id}", write=False) as session:
            return [(row.round_idx, row.path) for row in session.execute(stmt.order_by(Checkpoint.round_idx))]

    def add_evaluation(
        self,
        run_id: str,
        *,
        split: str,
        metrics: Mapping[str, float],
        round_idx: int | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        """Record one `fedcli evaluate` result: one row per metric, in one transaction.

        Args:
            run_id: Full run id.
            split: `test` or `train` (any short string).
            metrics: Metric key -> finite value.
            round_idx: The checkpoint round evaluated; None for the final model.
            options: Evaluation options (e.g. `{"predictive": "ensemble", "samples": 8}`).
        """
        values = check_metrics(metrics, round_idx)
        options_text, now = canonical_json(dict(options or {})), _utcnow()
        with self._session(f"record an evaluation of run {run_id}", write=True) as session:
            self._require_run(session, run_id)
            session.add_all(
                [
                    Evaluation(
                        run_id=run_id,
                        round_idx=round_idx,
                        split=split,
                        key=key,
                        value=value,
                        options_json=options_text,
                        created_at=now,
                    )
                    for key, value in values.items()
                ]
            )

    def evaluations_frame(self, run_ids: Sequence[str]) -> pd.DataFrame:
        """Evaluations of the runs: columns run_id, round_idx, split, key, value, options_json, created_at."""
        import pandas as pd

        columns = ["run_id", "round_idx", "split", "key", "value", "options_json", "created_at"]
        stmt = (
            select(*(getattr(Evaluation, name) for name in columns))
            .where(Evaluation.run_id.in_(list(run_ids)))
            .order_by(Evaluation.run_id, Evaluation.id)
        )
        with self._session("read evaluations", write=False) as session:
            rows = [tuple(row) for row in session.execute(stmt)]
        return pd.DataFrame(rows, columns=columns)

    # ----------------------------------------------------------------- queries

    def get_run(self, ref: str) -> RunRecord:
        """Find one run by exact id, run name, MLflow run id, then unique id prefix.

        Raises:
            ConfigError: If nothing matches (`unknown run 'abc'; …`) or a name or
                prefix matches several runs (the message lists them).
        """
        with self._session(f"look up run {ref!r}", write=False) as session:
            run = session.get(Run, ref)
            if run is None:
                run = self._unique_match(session, ref, select(Run).where(Run.run_name == ref), "run name")
            if run is None:  # the id MLflow shows for the run
                run = self._unique_match(session, ref, select(Run).where(Run.mlflow_run_id == ref), "MLflow run id")
            if run is None and _HEX_RE.match(ref.lower()):
                run = self._unique_match(
                    session, ref, select(Run).where(Run.id.startswith(ref.lower())), "run id prefix"
                )
            if run is None:
                raise ConfigError(f"unknown run {ref!r}; `fedcli list runs` shows the ids")
            return _to_record(run, session.get_one(Experiment, run.experiment_id).name)

    @staticmethod
    def _unique_match(session: Session, ref: str, stmt: Any, what: str) -> Run | None:
        matches = session.scalars(stmt.order_by(Run.created_at, Run.id).limit(6)).all()
        if len(matches) > 1:
            shown = ", ".join(run.id for run in matches[:5])
            raise ConfigError(f"{what} {ref!r} matches several runs ({shown}); pass a longer id")
        return matches[0] if matches else None

    def list_runs(
        self, experiment: str | None = None, where: Mapping[str, str] | None = None
    ) -> list[RunRecord]:
        """Runs ordered by creation time, then id, optionally of one experiment and filtered.

        Args:
            experiment: Only runs of this experiment.
            where: `key -> value` filters, all of which must match; a key is a run field
                (`algo`, `task`, `seed`, `status`, `run_name`, …), else a flattened config
                key (`algorithm.rho`), else a tag. Values compare as strings, as numbers
                when both parse as numbers, and case-insensitively for true/false/none.

        Raises:
            ConfigError: Unknown experiment or filter key (with the nearest match).
        """
        stmt = select(Run, Experiment.name).join(Experiment, Run.experiment_id == Experiment.id)
        with self._session("list runs", write=False) as session:
            if experiment is not None:
                names = session.scalars(select(Experiment.name)).all()
                if experiment not in names:
                    near = difflib.get_close_matches(experiment, names, n=1)
                    hint = f" (did you mean {near[0]!r}?)" if near else ""
                    raise ConfigError(
                        f"unknown experiment {experiment!r}{hint}; `fedcli list runs` shows them"
                    )
                stmt = stmt.where(Experiment.name == experiment)
            rows = session.execute(stmt.order_by(Run.created_at, Run.id)).all()
            records = [_to_record(run, name) for run, name in rows]
        return _filter_where(records, where) if where else records

    def client_metrics_frame(self, run_ids: Sequence[str], keys: Sequence[str] | None = None) -> pd.DataFrame:
        """Per-client training metrics of full run ids in long form (the clients of each round's cohort).

        Returns:
            Columns `run_id`, `round_idx` (int64), `client_id` (int64: the client's index in the
            run's partition), `key`, `value` (float64), sorted by (run_id, key, round_idx, client_id).
        """
        import pandas as pd

        stmt = select(ClientMetric.run_id, ClientMetric.round_idx, ClientMetric.client_id, ClientMetric.key,
                      ClientMetric.value).where(ClientMetric.run_id.in_(list(run_ids)))
        if keys is not None:
            stmt = stmt.where(ClientMetric.key.in_([check_metric_key(key) for key in keys]))
        with self._session("read client metrics", write=False) as session:
            rows = [tuple(row) for row in session.execute(stmt)]
        frame = pd.DataFrame(rows, columns=["run_id", "round_idx", "client_id", "key", "value"])
        frame = frame.astype({"round_idx": "int64", "client_id": "int64", "value": "float64"})
        return frame.sort_values(["run_id", "key", "round_idx", "client_id"], kind="stable", ignore_index=True)

    def metrics_frame(self, run_ids: Sequence[str], keys: Sequence[str] | None = None) -> pd.DataFrame:
        """Round metrics of full run ids in long form.

        Returns:
            Columns `run_id`, `round_idx` (int64), `key`, `value` (float64), sorted by
            (run_id, key, round_idx), index 0..n-1.
        """
        import pandas as pd

        stmt = select(RoundMetric.run_id, RoundMetric.round_idx, RoundMetric.key, RoundMetric.value).where(
            RoundMetric.run_id.in_(list(run_ids))
        )
        if keys is not None:
            stmt = stmt.where(RoundMetric.key.in_([check_metric_key(key) for key in keys]))
        with self._session("read metrics", write=False) as session:
            rows = [tuple(row) for row in session.execute(stmt)]
        frame = pd.DataFrame(rows, columns=["run_id", "round_idx", "key", "value"])
        frame = frame.astype({"round_idx": "int64", "value": "float64"})
        return frame.sort_values(["run_id", "key", "round_idx"], kind="stable", ignore_index=True)
