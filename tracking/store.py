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

One writer per run and per trial (docs/architecture.md, "Run lifecycle"): the process that
starts or resumes a run holds its **lease** (`runs.lease`, a random token); every write it
makes to that run is an `UPDATE … WHERE lease = <its token>` in the write's own transaction,
so a process whose run was taken over writes nothing more and gets `RunTakenOver`. A run is
taken over only when its owner is gone: on the same host its pid no longer exists (a stopped
process is alive), elsewhere its heartbeat is older than `STALE_S`. Sweep trials are claimed
the same way (`trial_claims`, `claim_trial`).

A stalled process never stalls the others: opening a store only reads its schema (the write
lock is taken only to create or migrate it), reads never lock (WAL), and a write that finds
the file locked, or a PostgreSQL server gone, is retried for `FEDCLI_STORE_RETRY_S` (60 s)
with a line naming the holder ("locked by pid N (running run X)") before it gives up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import errno
import functools
import hashlib
import json
import logging
import math
import os
import re
import socket
import sqlite3
import threading
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
from sqlalchemy import update as sql_update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import CursorResult, Engine
from sqlalchemy.engine.url import URL, make_url
from sqlalchemy.exc import (
    ArgumentError,
    DisconnectionError,
    InterfaceError,
    NoSuchModuleError,
    OperationalError,
    SQLAlchemyError,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column
from sqlalchemy.types import TypeDecorator

from fedcli.errors import ConfigError, TrackingError
from fedcli.tracking.keys import NonFiniteMetricsError, check_metric_key, check_metrics, flatten_config
from fedcli.tracking.urls import has_password, mask_url

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "END_STATUSES",
    "RUN_STATUSES",
    "Base",
    "Checkpoint",
    "Claim",
    "ClientMetric",
    "Evaluation",
    "Experiment",
    "RoundMetric",
    "Run",
    "RunRecord",
    "RunTakenOver",
    "SqlStore",
    "StoreMeta",
    "StoreUnavailable",
    "TrialClaim",
    "canonical_json",
    "config_hash",
    "default_store_url",
]

log = logging.getLogger(__name__)

RUN_STATUSES = ("running", "finished", "failed", "interrupted")
END_STATUSES = ("finished", "failed", "interrupted")
SETTABLE_RUN_FIELDS = frozenset({"model_path", "mlflow_run_id", "git_commit", "mlflow_synced_round"})
SQLITE_BUSY_TIMEOUT_MS = 5_000  # one attempt at SQLite's write lock (at most a quarter of the retry bound)
_WAL_SWITCH_S = 30.0  # how long opening a new file retries its switch to WAL (`_enable_wal`)
HEARTBEAT_S = 10.0  # a live run refreshes runs.heartbeat_at this often (fedcli.engine.lifecycle)
STALE_S = 60.0  # a `running` run of another host whose heartbeat is older than this reads as `interrupted`
RETRY_S = 60.0  # how long a write waits for a locked SQLite file, or any call for a lost PostgreSQL server
STALE_ENV, RETRY_ENV = "FEDCLI_STALE_S", "FEDCLI_STORE_RETRY_S"  # override the two (seconds; tests use short ones)
TAKEN_OVER_EXIT = 75  # exit code of a process whose run another process took over (EX_TEMPFAIL)
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


def _env_seconds(name: str, default: float) -> float:
    """A duration in seconds from the environment variable `name` (default when unset).

    Raises:
        ConfigError: The value is not a number > 0.
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be a number of seconds > 0; got {raw!r}. Unset it to use {default:g} s.")
    return value


def stale_s() -> float:
    """`STALE_S`, or `FEDCLI_STALE_S` when set: heartbeat age after which another host's run is gone."""
    return _env_seconds(STALE_ENV, STALE_S)


def retry_s() -> float:
    """`RETRY_S`, or `FEDCLI_STORE_RETRY_S` when set: how long a locked or unreachable store is retried."""
    return _env_seconds(RETRY_ENV, RETRY_S)


class RunTakenOver(TrackingError):
    """This process lost its lease on a run: another process resumed it. Nothing more was written.

    The CLI exits with `exit_code` (75), distinct from a failure (1) or bad input (2).
    """

    exit_code = TAKEN_OVER_EXIT

    def __init__(self, run_id: str, pid: int | None, host: str | None) -> None:
        super().__init__(f"run {run_id[:8]} was taken over by pid {pid} on host {host}; this process stopped "
                         "writing (its rounds after the takeover are the other process's to log)")
        self.run_id, self.pid, self.host = run_id, pid, host


class StoreUnavailable(TrackingError):
    """The store stayed locked, or its server unreachable, for longer than `retry_s()`."""


class _Transient(TrackingError):
    """A failure worth retrying: `kind` is "locked" (SQLite's write lock) or "lost" (the server connection)."""

    def __init__(self, kind: str, what: str, err: BaseException) -> None:
        super().__init__(_first_line(err))
        self.kind, self.what = kind, what


# --------------------------------------------------------------------------- processes


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of a process from /proc/PID/stat; None
    when /proc does not show it (no such process, no /proc, or hidden: `hidepid`)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])  # fields 3 (state) and 22 (starttime) of proc(5)
    except (OSError, IndexError, ValueError):
        return None


def process_start(pid: int | None = None) -> int | None:
    """The start time (clock ticks since boot) of process `pid` (default: this one); None off Linux.

    Stored with the pid (`runs.pid_start`, `trial_claims.pid_start`) so that a pid the kernel
    reused for another process does not pass for the owner.
    """
    stat = _proc_stat(os.getpid() if pid is None else pid)
    return None if stat is None else stat[1]


def _pid_state(pid: int, started: int | None = None) -> str:
    """"alive", "stopped" (SIGSTOP, a suspended job: alive) or "gone" (absent, a zombie, a reused pid).

    From /proc when it shows the process; else (no /proc, or another user's process hidden by
    `hidepid`) the kernel's answer to signal 0 decides, without the start-time check.
    """
    stat = _proc_stat(pid)
    if stat is None:
        return "alive" if _pid_alive(pid) else "gone"
    if stat[0] in ("Z", "X") or (started is not None and stat[1] != started):
        return "gone"
    return "stopped" if stat[0] in ("T", "t") else "alive"


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
    lease: Mapped[str | None] = mapped_column(String(32))  # token of the process that owns the run (one writer)
    pid_start: Mapped[int | None] = mapped_column(BigInteger())  # that process's start time (a reused pid differs)


class StoreMeta(Base):
    """Facts about the store itself, key -> value. `secrets_masked`: when a schema set-up masked the
    passwords that rows written by a fedcli before the secrets fix held (`_mask_stored_secrets`)."""

    __tablename__ = "store_meta"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class TrialClaim(Base):
    """A sweep trial (experiment, config hash) claimed by the sweep process that starts it.

    Taken atomically right before the trial starts (`SqlStore.claim_trial`) and released
    when its process exits, so two sweeps of one spec split the trials between them. A
    claim whose owner is gone (pid gone on this host, heartbeat older than `STALE_S`
    elsewhere) is taken over.
    """

    __tablename__ = "trial_claims"

    experiment: Mapped[str] = mapped_column(String(250), primary_key=True)
    config_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int]
    pid_start: Mapped[int | None] = mapped_column(BigInteger())
    claimed_at: Mapped[datetime] = mapped_column(UtcDateTime())
    heartbeat_at: Mapped[datetime] = mapped_column(UtcDateTime())


@dataclasses.dataclass(frozen=True)
class Claim:
    """A live claim on a sweep trial held by another process (`claim_trial`'s answer)."""

    experiment: str
    config_hash: str
    host: str
    pid: int
    claimed_at: datetime

    def __str__(self) -> str:
        return f"claimed by the sweep pid {self.pid} on {self.host}"


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
    pid_start: int | None = None  # start time of process `pid` (a reused pid differs), see `process_start`
    stored_status: str = ""  # the status column as written; `status` is what it means now
    requested: dict[str, Any] | None = None  # the config as asked for (auto, None); `config` is as it ran

    @property
    def is_alive(self) -> bool:
        """True while the run's process is (as far as the store can tell) still training it."""
        return self.status == "running"


def _liveness(run: Run, now: datetime) -> tuple[str, str | None]:
    """(status, reason) of a run as it stands now: a `running` run whose process is gone is `interrupted`.

    On this host the process decides: the run is alive while its pid exists with the start
    time recorded (a process stopped by SIGSTOP, or a suspended laptop, is alive however old
    its heartbeat), and gone, at once, when it does not. A run of another host is gone when
    its heartbeat is older than `stale_s()` (`STALE_S`, 60 s).
    """
    if run.status != "running":
        return run.status, run.failure_reason
    if run.host == HOSTNAME and run.pid is not None:
        if _pid_state(run.pid, run.pid_start) == "gone":
            return "interrupted", f"process {run.pid} on {run.host} is gone (killed)"
        return "running", None
    age = (now - (run.heartbeat_at or run.created_at)).total_seconds()
    if age > stale_s():
        return "interrupted", f"no heartbeat for {age:.0f} s (process killed or machine down)"
    return "running", None


def _claim_alive(claim: TrialClaim, now: datetime) -> bool:
    """A claim's owner is alive: its pid on this host, else a heartbeat younger than `stale_s()`."""
    if claim.host == HOSTNAME:
        return _pid_state(claim.pid, claim.pid_start) != "gone"
    return (now - claim.heartbeat_at).total_seconds() <= stale_s()


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
        pid_start=run.pid_start,
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


def _sqlite_connect_hook(busy_ms: int) -> Any:
    """The engine's "connect" listener: `_on_sqlite_connect` with this busy timeout (ms)."""
    return lambda dbapi_connection, connection_record: _on_sqlite_connect(dbapi_connection, connection_record,
                                                                          busy_ms)


def _on_sqlite_connect(dbapi_connection: Any, connection_record: Any, busy_ms: int = SQLITE_BUSY_TIMEOUT_MS) -> None:
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
    deadline = time.monotonic() + _WAL_SWITCH_S
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


def _sqlite_file(url: URL) -> Path | None:
    """The database file of a SQLite URL, or None for in-memory and `file:` URI databases."""
    database = url.database
    if not database or database == ":memory:" or url.query.get("uri") or database.startswith("file:"):
        return None
    return Path(database).expanduser()


def _pg_session_args(parsed: URL, busy_ms: int) -> dict[str, str]:
    """libpq session settings of a PostgreSQL store (psycopg drivers), unless the URL sets them:
    `lock_timeout` (a row lock held by a stopped process is waited for `busy_ms`, then retried
    like SQLite's write lock, instead of forever) and an `application_name` naming this
    process, which `SqlStore._holder` reads back from pg_stat_activity."""
    if parsed.get_driver_name() not in ("psycopg", "psycopg2"):
        return {}
    args = {"options": f"-c lock_timeout={busy_ms}", "application_name": f"fedcli pid {os.getpid()} on {HOSTNAME}"[:63]}
    return {key: value for key, value in args.items() if key not in parsed.query}


def _create_engine(url: str, busy_ms: int = SQLITE_BUSY_TIMEOUT_MS) -> tuple[Engine, str]:
    """Parse `url`, prepare a SQLite file's directory, build the engine with its hooks
    (`busy_ms`: SQLite's busy timeout of one attempt at its write lock)."""
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
    try:  # pool_pre_ping: a connection that a restarted server dropped is replaced before use
        engine = create_engine(parsed, connect_args={"timeout": busy_ms / 1000}) if is_sqlite \
            else create_engine(parsed, pool_pre_ping=True, connect_args=_pg_session_args(parsed, busy_ms))
    except (ArgumentError, NoSuchModuleError, ImportError) as err:
        raise TrackingError(f"store {shown!r} cannot be used: {_first_line(err)}; {_STORE_FIX}") from err
    if is_sqlite:
        event.listen(engine, "connect", _sqlite_connect_hook(busy_ms))
        event.listen(engine, "begin", _on_sqlite_begin)
    else:  # psycopg's own warning about a lost connection repeats the store's one line (`SqlStore._retry`)
        logging.getLogger("psycopg").setLevel(logging.ERROR)
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
    ("runs", "lease", "VARCHAR(32)"),
    ("runs", "pid_start", "BIGINT"),
)


def _schema_current(conn: Any) -> bool:
    """True when every table and added column exists: a read, which takes no lock (`SqlStore` then
    skips the locked set-up, so readers never wait for, nor take, SQLite's write lock)."""
    inspector = inspect(conn)
    tables = set(inspector.get_table_names())
    if not set(Base.metadata.tables) <= tables:
        return False
    columns: dict[str, set[str]] = {}
    for table, column, _ in _ADDED_COLUMNS:
        if table not in columns:
            columns[table] = {c["name"] for c in inspector.get_columns(table)}
        if column not in columns[table]:
            return False
    return True


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
    if conn.scalar(select(StoreMeta.value).where(StoreMeta.key == SECRETS_MASKED)) is None:
        masked = _mask_stored_secrets(conn)
        conn.execute(StoreMeta.__table__.insert().values(key=SECRETS_MASKED, value=_utcnow().isoformat()))
        if masked:
            log.warning("store: masked the passwords of store URLs that %d run(s) written by an older fedcli held "
                        "in clear (docs/architecture.md, \"Security\")", masked)


SECRETS_MASKED = "secrets_masked"  # StoreMeta key: the stored rows hold no password (`_mask_stored_secrets`)
_SECRET_COLUMNS = ("config_json", "requested_json", "tags_json", "failure_reason")


def _mask_stored_secrets(conn: Any) -> int:
    """Mask the passwords that rows written before the secrets fix hold; return how many runs changed.

    fedcli before issue 23 stored `--store`/`--tracking-uri` URLs in full in `config_json`,
    `requested_json` (and could quote them in `failure_reason`); tags never held a URL, but are
    checked too. Each JSON value is parsed, every string in it masked (`mask_url`) and written
    back as canonical JSON, so running it twice changes nothing. Runs stored before the config
    hash was passed to the store (fedcli 95fa5be-58e6f55^) have `config_hash` = sha256 of
    `config_json` *with* the tracking section, password included: the column then takes the
    run's `fedcli.config_hash` tag, the hash of the config without the tracking section that
    every newer run's column holds (and what sweeps match on), else the sha256 of the masked
    config. Part of `_setup_schema`'s transaction, so it is done once, whole, under the lock.
    """
    maybe = [getattr(Run, name).like("%://%:%@%") for name in _SECRET_COLUMNS]
    rows = conn.execute(select(Run.id, Run.config_hash, *(getattr(Run, n) for n in _SECRET_COLUMNS))
                        .where(maybe[0] | maybe[1] | maybe[2] | maybe[3])).all()
    changed = 0
    for row in rows:
        values: dict[str, str] = {}
        for name in _SECRET_COLUMNS:
            stored = getattr(row, name)
            if not stored or not has_password(stored):
                continue
            values[name] = mask_url(stored) if name == "failure_reason" else canonical_json(_masked(json.loads(stored)))
        if not values:
            continue
        if "config_json" in values and row.config_hash == hashlib.sha256(row.config_json.encode("utf-8")).hexdigest():
            tags = json.loads(values.get("tags_json") or row.tags_json or "{}")
            values["config_hash"] = tags.get("fedcli.config_hash") or \
                hashlib.sha256(values["config_json"].encode("utf-8")).hexdigest()
        conn.execute(sql_update(Run).where(Run.id == row.id).values(**values))
        changed += 1
    return changed


def _masked(value: Any) -> Any:
    """`value` (parsed JSON) with the password of every URL in every string masked."""
    if isinstance(value, str):
        return mask_url(value)
    if isinstance(value, list):
        return [_masked(item) for item in value]
    if isinstance(value, dict):
        return {key: _masked(item) for key, item in value.items()}
    return value


def disk_full(err: BaseException) -> bool:
    """True when an error (OSError or a database error) means the disk is full."""
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return True
    return "disk is full" in str(getattr(err, "orig", None) or err).lower()


# --------------------------------------------------------------------------- the store


def _retried(method: Any) -> Any:
    """A public `SqlStore` method, retried whole while the store is locked or its server gone (`_retry`)."""

    @functools.wraps(method)
    def retried(self: SqlStore, *args: Any, **kwargs: Any) -> Any:
        return self._retry(method.__name__, lambda: method(self, *args, **kwargs))

    return retried


class SqlStore:
    """The fedcli results store on any SQLAlchemy URL.

    Every public method is one transaction, retried whole for up to `retry_s` seconds while
    SQLite's write lock is held by another process or the PostgreSQL server is unreachable.
    Methods that take a `run_id` want the full id (use `get_run` to resolve a prefix or a run
    name first). The process that starts or resumes a run holds its lease: its later writes to
    that run raise `RunTakenOver` once another process has resumed it.

    Args:
        url: A SQLAlchemy URL, e.g. `default_store_url(Path("fedcli-runs"))`,
            `sqlite:////abs/path/fedcli.db` or `postgresql+psycopg://user@host/db`.
        setup_schema: Create or migrate the schema when it is missing or outdated (checked
            with a read first, so opening a current store takes no lock); False for a reader
            that must never write.
        retry_s: How long a locked or unreachable store is retried, in seconds. Default:
            `FEDCLI_STORE_RETRY_S`, else `RETRY_S` (60).

    Raises:
        TrackingError: If the URL is malformed, its driver is missing, or the database
            cannot be created or written (one line naming the URL and the fix).
    """

    def __init__(self, url: str, *, setup_schema: bool = True, retry_s: float | None = None) -> None:
        self.retry_s = _env_seconds(RETRY_ENV, RETRY_S) if retry_s is None else retry_s
        self._engine, self.url = _create_engine(url, int(min(SQLITE_BUSY_TIMEOUT_MS, self.retry_s * 250)))
        self._write_engine = self._engine.execution_options(**{_BEGIN_OPTION: "IMMEDIATE"})
        self._sqlite = self._engine.dialect.name == "sqlite"
        self._db_file = _sqlite_file(self._engine.url) if self._sqlite else None
        self._leases: dict[str, str] = {}  # run id -> the lease token this process holds on it
        self._local = threading.local()  # per thread: inside a retried call (no nested retries)
        self._announced = -math.inf  # when a wait for this store was last announced (one warning per outage)
        self._read_columns: list[Any] | None = None  # `reader` of an older store: the runs columns it has
        if not setup_schema:  # a reader of an existing store (the MLflow mirror): take no write lock
            return
        try:
            with self._engine.connect() as conn:  # a read: no lock, answered while a writer is stopped
                current = _schema_current(conn)
            if not current:
                self._retry("set up the store", self._setup_schema, kinds=("locked",))
        except SQLAlchemyError as err:
            self._engine.dispose()
            raise TrackingError(f"store {self.url!r} cannot be opened: {_first_line(err)}; {_STORE_FIX}") from err
        except TrackingError:
            self._engine.dispose()
            raise
        log.debug("opened store %s", self.url)

    @classmethod
    def reader(cls, url: str) -> SqlStore | None:
        """Open the store at `url` to read it, writing nothing, not even its schema (a dry run).

        Returns None when nothing is stored there yet: no SQLite file, or a database without
        fedcli's tables (opening it as a writer would create them). A store made by an older
        fedcli is read as it is: `list_runs` reads the columns it has, the others read as empty.

        Raises:
            TrackingError: The URL is malformed or the database cannot be read.
        """
        try:
            db_file = _sqlite_file(make_url(url)) if make_url(url).get_backend_name() == "sqlite" else None
        except ArgumentError:
            db_file = None  # the constructor names the malformed URL
        if db_file is not None and not db_file.exists():
            return None
        store = cls(url, setup_schema=False)
        try:
            with store._engine.connect() as conn:
                inspector = inspect(conn)
                if not {Run.__tablename__, Experiment.__tablename__} <= set(inspector.get_table_names()):
                    store.close()
                    return None
                present = {c["name"] for c in inspector.get_columns(Run.__tablename__)}
        except SQLAlchemyError as err:
            store.close()
            raise TrackingError(f"store {store.url!r} cannot be read: {_first_line(err)}; {_STORE_FIX}") from err
        if not {c.name for c in Run.__table__.columns} <= present:
            store._read_columns = [c for c in Run.__table__.columns if c.name in present]
        return store

    def _setup_schema(self) -> None:
        try:
            with self._write_engine.begin() as conn:
                _setup_schema(conn)
        except SQLAlchemyError as err:
            kind = self._transient(err)
            if kind is not None:
                raise _Transient(kind, "set up the store", err) from err
            raise TrackingError(f"store {self.url!r} is not writable: {_first_line(err)}; {_STORE_FIX}") from err

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
        """One transaction; database failures become `TrackingError` naming `what` (`_Transient`
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
                raise _Transient(kind, what, err) from err
            raise TrackingError(f"store {self.url!r} could not {what}: {_first_line(err)}") from err

    def _transient(self, err: SQLAlchemyError) -> str | None:
        """"locked" (SQLite's write lock is held elsewhere), "lost" (the server connection), else None."""
        if self._sqlite:
            message = str(getattr(err, "orig", None) or err).lower()
            return "locked" if isinstance(err, OperationalError) and ("locked" in message or "busy" in message) \
                else None
        if getattr(getattr(err, "orig", None), "sqlstate", None) == "55P03":  # lock_timeout: a row lock held
            return "locked"
        if isinstance(err, (OperationalError, InterfaceError, DisconnectionError)) \
                or getattr(err, "connection_invalidated", False):
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
                except _Transient as err:
                    if err.kind not in kinds:
                        raise TrackingError(f"store {self.url!r} could not {err.what}: {err}; {_STORE_FIX}") from err
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
                name = conn.execute(text(
                    "SELECT application_name FROM pg_stat_activity WHERE datname = current_database() "
                    "AND pid <> pg_backend_pid() AND state LIKE 'idle in transaction%' "
                    "AND application_name LIKE 'fedcli pid %' ORDER BY xact_start LIMIT 1")).scalar()
                words = str(name or "").split()
                if len(words) >= 5:
                    pid, host = int(words[2]), words[4]
            if pid is not None and host != HOSTNAME:
                return pid, f"pid {pid} on {host}"
        if pid is None:
            return None, "another process"
        what: str | None = None
        with contextlib.suppress(Exception), Session(self._engine) as session:  # a read: the lock does not block it
            found = session.scalars(select(Run.id).where(Run.host == HOSTNAME, Run.pid == pid,
                                                        Run.status == "running")).first()
            what = f"running run {found[:8]}" if found else None
        if what is None:  # the program's name only: a command line may hold a password
            with contextlib.suppress(OSError):
                what = Path(f"/proc/{pid}/comm").read_text().strip() or None
        details = ", ".join(x for x in (what, "stopped" if _pid_state(pid) == "stopped" else None) if x)
        return pid, f"pid {pid}" + (f" ({details})" if details else "")

    def _waiting(self, err: _Transient) -> str:
        if err.kind == "locked":
            return (f"store {self.url} is locked by {self._holder()[1]}; waiting up to {self.retry_s:.0f} s to "
                    f"{err.what}")
        return f"lost the connection to the store {self.url} ({err}); retrying for up to {self.retry_s:.0f} s"

    def _gave_up(self, err: _Transient, waited: float) -> str:
        if err.kind == "locked":
            pid, holder = self._holder()
            who = "PID" if pid is None else str(pid)
            return (f"store {self.url} is locked by {holder} and stayed locked for {waited:.0f} s, so this "
                    f"process could not {err.what}; let that process finish (`kill -CONT {who}` if it is stopped) "
                    f"or end it, then retry ({RETRY_ENV} sets how long to wait)")
        return (f"the store {self.url} cannot be reached ({err}) and did not come back within {waited:.0f} s, so "
                f"this process could not {err.what}; check the database server, then retry ({RETRY_ENV} sets "
                "how long to wait)")

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
            sql_update(Run).where(Run.id == run_id, Run.lease == token).values(heartbeat_at=now or _utcnow())
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
        run_id, token = run_id or uuid.uuid4().hex, uuid.uuid4().hex  # both kept across retries
        config_text, now = canonical_json(config), _utcnow()
        fields = dict(
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
            pid_start=process_start(),
            lease=token,
        )

        def insert() -> None:
            with self._session("start a run", write=True) as session:
                if session.scalar(select(Run.lease).where(Run.id == run_id)) == token:
                    return  # a retry after a commit whose answer was lost
                session.add(Run(**fields, experiment_id=self._experiment_id(session, experiment, now)))

        self._retry("start_run", insert)
        self._leases[run_id] = token
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

    @_retried
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
            run = self._own(session, run_id)
            run.status, run.ended_at = status, _utcnow()
            run.failure_reason, run.diverged_at_round = reason, diverged_at_round

    @_retried
    def mark_running(self, run_id: str) -> None:
        """Take the run over for `--resume`: status back to `running`, owned (leased) by this process.

        Refused while the run's process is alive: on this host while its pid exists, even
        stopped (SIGSTOP) with an old heartbeat; elsewhere while its heartbeat is younger than
        `stale_s()`. The check and the takeover are one transaction (the row locked on
        PostgreSQL), so two resumes of one run cannot both succeed; the previous owner, if it
        wakes up, gets `RunTakenOver` at its next write.

        Raises:
            ConfigError: The run is alive in another process.
        """
        token = uuid.uuid4().hex
        with self._session(f"reopen run {run_id}", write=True) as session:
            run = session.scalars(select(Run).where(Run.id == run_id).with_for_update()).first()
            if run is None:
                raise ConfigError(f"unknown run {run_id!r}; `fedcli list runs` shows the ids")
            now = _utcnow()
            status, _ = _liveness(run, now)
            if status == "running" and not (run.host == HOSTNAME and run.pid == os.getpid()):
                stopped = run.host == HOSTNAME and run.pid is not None and _pid_state(run.pid) == "stopped"
                how = (f"; the process is stopped: `kill -CONT {run.pid}` continues it, `kill {run.pid}` ends it"
                       if stopped else "")
                raise ConfigError(
                    f"run {run_id[:8]} is still running (pid {run.pid} on {run.host}, heartbeat "
                    f"{(now - (run.heartbeat_at or now)).total_seconds():.0f} s ago{how}); stop it first "
                    "or wait for it to end"
                )
            run.status, run.ended_at = "running", None
            run.failure_reason, run.diverged_at_round = None, None
            run.heartbeat_at, run.host, run.pid, run.pid_start = now, HOSTNAME, os.getpid(), process_start()
            run.lease = token
        self._leases[run_id] = token

    @_retried
    def heartbeat(self, run_id: str) -> None:
        """Record that the run's process is alive now (`fedcli.engine.lifecycle` calls it every few s)."""
        with self._session(f"heartbeat run {run_id}", write=True) as session:
            run = self._own(session, run_id)
            run.heartbeat_at = _utcnow()

    # ----------------------------------------------------------------- sweep trial claims

    @staticmethod
    def _me() -> dict[str, Any]:
        return {"host": HOSTNAME, "pid": os.getpid(), "pid_start": process_start()}

    @_retried
    def claim_trial(self, experiment: str, config_hash: str) -> Claim | None:
        """Claim the sweep trial (experiment, config hash) for this process, atomically.

        One transaction under the write lock (SQLite) or the row's lock (PostgreSQL): a new
        claim is inserted; a claim of this process is kept; a claim whose owner is gone (pid
        gone on this host, heartbeat older than `stale_s()` elsewhere) is taken over.

        Returns:
            None when the trial is this process's to run now, else the live claim of the
            process that runs it ("running elsewhere").
        """
        now, me = _utcnow(), self._me()
        row = {"experiment": experiment, "config_hash": config_hash, **me, "claimed_at": now, "heartbeat_at": now}
        with self._session("claim a sweep trial", write=True) as session:
            insert = (sqlite if self._sqlite else postgresql).insert(TrialClaim).values(**row)
            inserted = session.execute(insert.on_conflict_do_nothing(index_elements=["experiment", "config_hash"]))
            if cast("CursorResult[Any]", inserted).rowcount == 1:
                return None
            claim = session.scalars(select(TrialClaim).where(TrialClaim.experiment == experiment,
                                                             TrialClaim.config_hash == config_hash)
                                    .with_for_update()).one()
            if (claim.host, claim.pid, claim.pid_start) != (me["host"], me["pid"], me["pid_start"]) \
                    and _claim_alive(claim, now):
                return Claim(experiment, config_hash, claim.host, claim.pid, claim.claimed_at)
            for name, value in row.items():  # ours already, or its owner is gone: take it
                setattr(claim, name, value)
        return None

    @_retried
    def release_trial(self, experiment: str, config_hash: str) -> None:
        """Drop this process's claim on a sweep trial (its process ended, or it was not started)."""
        me = self._me()
        with self._session("release a sweep trial", write=True) as session:
            session.execute(delete(TrialClaim).where(
                TrialClaim.experiment == experiment, TrialClaim.config_hash == config_hash,
                TrialClaim.host == me["host"], TrialClaim.pid == me["pid"]))

    @_retried
    def refresh_claims(self, experiment: str) -> None:
        """Refresh the heartbeat of this process's claims (what tells other hosts it is alive)."""
        me = self._me()
        with self._session("refresh sweep claims", write=True) as session:
            session.execute(sql_update(TrialClaim).where(
                TrialClaim.experiment == experiment, TrialClaim.host == me["host"], TrialClaim.pid == me["pid"])
                .values(heartbeat_at=_utcnow()).execution_options(synchronize_session=False))

    @_retried
    def live_claims(self, experiment: str) -> dict[str, Claim]:
        """Config hash -> the live claim of another process, for the trials of an experiment."""
        now, me = _utcnow(), self._me()
        with self._session("read sweep claims", write=False) as session:
            rows = session.scalars(select(TrialClaim).where(TrialClaim.experiment == experiment)).all()
            return {c.config_hash: Claim(c.experiment, c.config_hash, c.host, c.pid, c.claimed_at) for c in rows
                    if (c.host, c.pid) != (me["host"], me["pid"]) and _claim_alive(c, now)}

    @_retried
    def update_config(self, run_id: str, config: Mapping[str, Any], hash_: str,
                      requested: Mapping[str, Any] | None = None) -> None:
        """Replace a run's stored config and hash (a resume that changes what the run trains, e.g. rounds)."""
        with self._session(f"update run {run_id}", write=True) as session:
            run = self._own(session, run_id)
            run.config_json, run.config_hash = canonical_json(config), hash_
            if requested is not None:
                run.requested_json = canonical_json(requested)
            tags = json.loads(run.tags_json)
            if "fedcli.config_hash" in tags:
                tags["fedcli.config_hash"] = hash_
                run.tags_json = canonical_json(tags)

    @_retried
    def set_run_fields(self, run_id: str, **fields: str | None) -> None:
        """Set some of `model_path`, `mlflow_run_id`, `git_commit` on a run."""
        unknown = sorted(set(fields) - SETTABLE_RUN_FIELDS)
        if unknown:
            raise ValueError(f"set_run_fields accepts {sorted(SETTABLE_RUN_FIELDS)}; got {unknown}.")
        with self._session(f"update run {run_id}", write=True) as session:
            run = self._own(session, run_id)
            for name, value in fields.items():
                setattr(run, name, value)

    @_retried
    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        """Add or overwrite string tags of a run."""
        new_tags = _check_str_mapping("tags", tags)
        with self._session(f"tag run {run_id}", write=True) as session:
            run = self._own(session, run_id)
            run.tags_json = canonical_json({**json.loads(run.tags_json), **new_tags})

    # ----------------------------------------------------------------- metrics

    @_retried
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
            if run_id in self._leases:
                self._own(session, run_id, now)  # first: a run taken over gets none of this round
            else:
                session.execute(sql_update(Run).where(Run.id == run_id).values(heartbeat_at=now)
                                .execution_options(synchronize_session=False))
            self._upsert(session, RoundMetric, rows, update=("value", "logged_ms"))
            if client_rows:
                self._upsert(session, ClientMetric, client_rows, update=("value",))

    @_retried
    def round_rows(self, run_id: str, after: int, upto: int) -> list[tuple[int, str, float, int | None]]:
        """Rows `(round_idx, key, value, logged_ms)` of rounds in (after, upto], by round then key."""
        stmt = (
            select(RoundMetric.round_idx, RoundMetric.key, RoundMetric.value, RoundMetric.logged_ms)
            .where(RoundMetric.run_id == run_id, RoundMetric.round_idx > after, RoundMetric.round_idx <= upto)
            .order_by(RoundMetric.round_idx, RoundMetric.key)
        )
        with self._session(f"read run {run_id}", write=False) as session:
            return [tuple(row) for row in session.execute(stmt)]  # type: ignore[misc]

    @_retried
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
            if run_id in self._leases:
                self._own(session, run_id)
            self._upsert(session, ClientMetric, records, update=("value",))

    @_retried
    def last_round(self, run_id: str) -> int | None:
        """The highest round with logged metrics, or None if there is none."""
        with self._session(f"read run {run_id}", write=False) as session:
            return session.scalar(select(func.max(RoundMetric.round_idx)).where(RoundMetric.run_id == run_id))

    @_retried
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
            self._own(session, run_id)
            result = session.execute(
                delete(RoundMetric).where(RoundMetric.run_id == run_id, RoundMetric.round_idx > round_idx)
            )
            deleted = cast("CursorResult[Any]", result).rowcount
            for model in (ClientMetric, Checkpoint):
                session.execute(delete(model).where(model.run_id == run_id, model.round_idx > round_idx))
        log.debug("store: dropped %d metric rows of run %s after round %d", deleted, run_id, round_idx)
        return deleted

    # ----------------------------------------------------------------- checkpoints, evaluations

    @_retried
    def add_checkpoint(self, run_id: str, round_idx: int, path: str | Path) -> None:
        """Record (or replace) the checkpoint file written after `round_idx`."""
        row = {
            "run_id": run_id,
            "round_idx": _check_round_idx(round_idx),
            "path": str(path),
            "created_at": _utcnow(),
        }
        with self._session(f"record checkpoint {round_idx} of run {run_id}", write=True) as session:
            if run_id in self._leases:
                self._own(session, run_id)
            self._upsert(session, Checkpoint, [row], update=("path", "created_at"))

    @_retried
    def delete_checkpoints(self, run_id: str, rounds: Sequence[int]) -> None:
        """Forget the checkpoints of these rounds (retention; the files are removed by the caller)."""
        if not rounds:
            return
        with self._session(f"prune checkpoints of run {run_id}", write=True) as session:
            if run_id in self._leases:  # before the caller removes the files: a new owner's are not ours
                self._own(session, run_id)
            session.execute(
                delete(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.round_idx.in_(list(rounds)))
            )

    @_retried
    def checkpoints(self, run_id: str) -> list[tuple[int, str]]:
        """All checkpoints of a run as `(round_idx, path)`, by round."""
        stmt = select(Checkpoint.round_idx, Checkpoint.path).where(Checkpoint.run_id == run_id)
        with self._session(f"read checkpoints of run {run_id}", write=False) as session:
            return [(row.round_idx, row.path) for row in session.execute(stmt.order_by(Checkpoint.round_idx))]

    @_retried
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

    @_retried
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

    @_retried
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

    @_retried
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
            if self._read_columns is None:
                rows = session.execute(stmt.order_by(Run.created_at, Run.id)).all()
            else:  # an older store, read without upgrading it (`reader`): its columns, as transient rows
                older = select(*self._read_columns, Experiment.name).join(Experiment, Run.experiment_id == Experiment.id)
                if experiment is not None:
                    older = older.where(Experiment.name == experiment)
                rows = [(Run(**{c.name: value for c, value in zip(self._read_columns, row[:-1], strict=True)}), row[-1])
                        for row in session.execute(older.order_by(Run.created_at, Run.id))]
            records = [_to_record(run, name) for run, name in rows]
        return _filter_where(records, where) if where else records

    @_retried
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

    @_retried
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
