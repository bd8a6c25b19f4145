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

One writer per run and per trial (docs/operations.md, "Run lifecycle"): the process that
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

The store's other modules (the package's docstring lists them) hold its tables, connection
settings, records and constants; this module holds `SqlStore` whole, in this order: opening a
store; its transactions (one session per call, failures in one line, the retry of a locked or
lost store with the lock holder named, the lease check of every write); starting, ending and
resuming runs, sweep-trial claims, run fields and tags; the writes of rounds, client metrics,
checkpoints and evaluations with their reads by run; finding runs and reading metrics and
evaluations as frames. One class, not mixins: every part uses the attributes `__init__` sets.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import hashlib
import json
import math
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar, cast

from sqlalchemy import delete, func, inspect, select, text
from sqlalchemy import update as sql_update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import CursorResult
from sqlalchemy.exc import DisconnectionError, InterfaceError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session

from fedcli.errors import ConfigError, TrackingError
from fedcli.tracking.keys import check_metric_key, check_metrics
from fedcli.tracking.store.common import (
    BEGIN_OPTION,
    END_STATUSES,
    HEX_RE,
    HOSTNAME,
    RETRY_ENV,
    RETRY_S,
    RUN_ID_RE,
    SETTABLE_RUN_FIELDS,
    SQLITE_BUSY_TIMEOUT_MS,
    STORE_FIX,
    RunTakenOver,
    StoreUnavailable,
    Transient,
    _first_line,
    canonical_json,
    check_round_idx,
    check_str_mapping,
    disk_full,
    env_seconds,
    log,
    utcnow,
)
from fedcli.tracking.store.engine import open_engine, sqlite_lock_holder
from fedcli.tracking.store.liveness import claim_alive, liveness, pid_state, process_start
from fedcli.tracking.store.records import Claim, RunRecord, filter_where, to_record
from fedcli.tracking.store.schema import (
    Base,
    Checkpoint,
    ClientMetric,
    Evaluation,
    Experiment,
    RoundMetric,
    Run,
    TrialClaim,
    schema_current,
    upgrade_schema,
)
from fedcli.tracking.urls import sqlite_path

if TYPE_CHECKING:
    import pandas as pd

_P = ParamSpec("_P")
_R = TypeVar("_R")
_S = TypeVar("_S", bound="SqlStore")


def retrying(method: Callable[Concatenate[_S, _P], _R]) -> Callable[Concatenate[_S, _P], _R]:
    """A public `SqlStore` method, retried whole while the store is locked or its server gone (`_retry`);
    typed as the method itself, so that mypy checks its callers (and `RunStore`, tracking/store/protocol.py)."""

    @functools.wraps(method)
    def retried(self: _S, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        return cast("_R", self._retry(method.__name__, lambda: method(self, *args, **kwargs)))

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

    retry_s: float  # declared for `RunStore` (tests/test_layering.py compares the two)

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

    @classmethod
    def reader(cls, url: str) -> SqlStore | None:
        """Open the store at `url` to read it, writing nothing, not even its schema (a dry run).

        Returns None when nothing is stored there yet: no SQLite file, or a database without
        fedcli's tables (opening it as a writer would create them). A store made by an older
        fedcli is read as it is: `list_runs` reads the columns it has, the others read as empty.

        Raises:
            TrackingError: The URL is malformed or the database cannot be read.
        """
        db_file = sqlite_path(url)  # None for a malformed URL too: the constructor names it
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
            raise TrackingError(
                f"store {store.url!r} cannot be read: {_first_line(err)}; {STORE_FIX}"
            ) from err
        if not {c.name for c in Run.__table__.columns} <= present:
            store._read_columns = [c for c in Run.__table__.columns if c.name in present]
        return store

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

    def __enter__(self) -> SqlStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

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
        if run_id is not None and not RUN_ID_RE.match(run_id):
            raise ValueError(f"run_id must be 32 lowercase hex characters; got {run_id!r}.")
        run_id, token = run_id or uuid.uuid4().hex, uuid.uuid4().hex  # both kept across retries
        config_text, now = canonical_json(config), utcnow()
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
            tags_json=canonical_json(check_str_mapping("tags", tags)),
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

    @retrying
    def end_run(
        self, run_id: str, status: str, *, reason: str | None = None, diverged_at_round: int | None = None
    ) -> None:
        """Mark a run ended.

        Args:
            run_id: Full run id.
            status: One of `finished`, `failed`, `interrupted`, `pruned` (a search trial its pruner stopped).
            reason: Why it failed or stopped (one line), if it did.
            diverged_at_round: The round whose metrics were non-finite, if any.
        """
        if status not in END_STATUSES:
            raise ValueError(f"status must be one of {', '.join(END_STATUSES)}; got {status!r}.")
        with self._session(f"end run {run_id}", write=True) as session:
            run = self._own(session, run_id)
            run.status, run.ended_at = status, utcnow()
            run.failure_reason, run.diverged_at_round = reason, diverged_at_round

    @retrying
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
            now = utcnow()
            status, _ = liveness(run, now)
            if status == "running" and not (run.host == HOSTNAME and run.pid == os.getpid()):
                stopped = run.host == HOSTNAME and run.pid is not None and pid_state(run.pid) == "stopped"
                how = (
                    f"; the process is stopped: `kill -CONT {run.pid}` continues it, `kill {run.pid}` ends it"
                    if stopped
                    else ""
                )
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

    @retrying
    def heartbeat(self, run_id: str) -> None:
        """Record that the run's process is alive now (`fedcli.engine.lifecycle` calls it every few s)."""
        with self._session(f"heartbeat run {run_id}", write=True) as session:
            run = self._own(session, run_id)
            run.heartbeat_at = utcnow()

    @retrying
    def claim_trial(self, experiment: str, config_hash: str) -> Claim | None:
        """Claim the sweep trial (experiment, config hash) for this process, atomically.

        One transaction under the write lock (SQLite) or the row's lock (PostgreSQL): a new
        claim is inserted; a claim of this process is kept; a claim whose owner is gone (pid
        gone on this host, heartbeat older than `stale_s()` elsewhere) is taken over.

        Returns:
            None when the trial is this process's to run now, else the live claim of the
            process that runs it ("running elsewhere").
        """
        now, me = utcnow(), {"host": HOSTNAME, "pid": os.getpid(), "pid_start": process_start()}
        row = {
            "experiment": experiment,
            "config_hash": config_hash,
            **me,
            "claimed_at": now,
            "heartbeat_at": now,
        }
        with self._session("claim a sweep trial", write=True) as session:
            insert = (sqlite if self._sqlite else postgresql).insert(TrialClaim).values(**row)
            inserted = session.execute(
                insert.on_conflict_do_nothing(index_elements=["experiment", "config_hash"])
            )
            if cast("CursorResult[Any]", inserted).rowcount == 1:
                return None
            claim = session.scalars(
                select(TrialClaim)
                .where(TrialClaim.experiment == experiment, TrialClaim.config_hash == config_hash)
                .with_for_update()
            ).one()
            if (claim.host, claim.pid, claim.pid_start) != (
                me["host"],
                me["pid"],
                me["pid_start"],
            ) and claim_alive(claim, now):
                return Claim(experiment, config_hash, claim.host, claim.pid, claim.claimed_at)
            for name, value in row.items():  # ours already, or its owner is gone: take it
                setattr(claim, name, value)
        return None

    @retrying
    def release_trial(self, experiment: str, config_hash: str) -> None:
        """Drop this process's claim on a sweep trial (its process ended, or it was not started)."""
        with self._session("release a sweep trial", write=True) as session:
            session.execute(
                delete(TrialClaim).where(
                    TrialClaim.experiment == experiment,
                    TrialClaim.config_hash == config_hash,
                    TrialClaim.host == HOSTNAME,
                    TrialClaim.pid == os.getpid(),
                )
            )

    @retrying
    def refresh_claims(self, experiment: str) -> None:
        """Refresh the heartbeat of this process's claims (what tells other hosts it is alive)."""
        with self._session("refresh sweep claims", write=True) as session:
            session.execute(
                sql_update(TrialClaim)
                .where(
                    TrialClaim.experiment == experiment,
                    TrialClaim.host == HOSTNAME,
                    TrialClaim.pid == os.getpid(),
                )
                .values(heartbeat_at=utcnow())
                .execution_options(synchronize_session=False)
            )

    @retrying
    def live_claims(self, experiment: str) -> dict[str, Claim]:
        """Config hash -> the live claim of another process, for the trials of an experiment."""
        now = utcnow()
        with self._session("read sweep claims", write=False) as session:
            rows = session.scalars(select(TrialClaim).where(TrialClaim.experiment == experiment)).all()
            return {
                c.config_hash: Claim(c.experiment, c.config_hash, c.host, c.pid, c.claimed_at)
                for c in rows
                if (c.host, c.pid) != (HOSTNAME, os.getpid()) and claim_alive(c, now)
            }

    @retrying
    def update_config(
        self, run_id: str, config: Mapping[str, Any], hash_: str, requested: Mapping[str, Any] | None = None
    ) -> None:
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

    @retrying
    def set_run_fields(self, run_id: str, **fields: str | int | None) -> None:
        """Set some of `model_path`, `mlflow_run_id`, `git_commit`, `mlflow_synced_round` (an int) on a run."""
        unknown = sorted(set(fields) - SETTABLE_RUN_FIELDS)
        if unknown:
            raise ValueError(f"set_run_fields accepts {sorted(SETTABLE_RUN_FIELDS)}; got {unknown}.")
        with self._session(f"update run {run_id}", write=True) as session:
            run = self._own(session, run_id)
            for name, value in fields.items():
                setattr(run, name, value)

    @retrying
    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        """Add or overwrite string tags of a run."""
        new_tags = check_str_mapping("tags", tags)
        with self._session(f"tag run {run_id}", write=True) as session:
            run = self._own(session, run_id)
            run.tags_json = canonical_json({**json.loads(run.tags_json), **new_tags})

    @retrying
    def log_round(
        self,
        run_id: str,
        round_idx: int,
        metrics: Mapping[str, float],
        clients: Iterable[tuple[int, str, float]] = (),
    ) -> None:
        """Write one round's metrics, and its per-client rows `(client_id, key, value)`, in one
        transaction; existing rows of the same keys are overwritten. A client value that is not
        finite is left out (that client's round metrics are not a divergence of the run).

        Raises:
            ValueError: Bad key or round index.
            NonFiniteMetricsError: Some round value is NaN/inf; nothing was written.
        """
        values = check_metrics(metrics, check_round_idx(round_idx))
        now = utcnow()
        logged_ms = int(now.timestamp() * 1000)
        rows = [
            {"run_id": run_id, "round_idx": round_idx, "key": key, "value": value, "logged_ms": logged_ms}
            for key, value in values.items()
        ]
        client_rows = [
            {
                "run_id": run_id,
                "round_idx": round_idx,
                "client_id": int(client),
                "key": check_metric_key(key),
                "value": float(value),
            }
            for client, key, value in clients
            if math.isfinite(value)
        ]
        with self._session(f"log round {round_idx} of run {run_id}", write=True) as session:
            if run_id in self._leases:
                self._own(session, run_id, now)  # first: a run taken over gets none of this round
            else:
                session.execute(
                    sql_update(Run)
                    .where(Run.id == run_id)
                    .values(heartbeat_at=now)
                    .execution_options(synchronize_session=False)
                )
            self._upsert(session, RoundMetric, rows, update=("value", "logged_ms"))
            if client_rows:
                self._upsert(session, ClientMetric, client_rows, update=("value",))

    @retrying
    def round_rows(self, run_id: str, after: int, upto: int) -> list[tuple[int, str, float, int | None]]:
        """Rows `(round_idx, key, value, logged_ms)` of rounds in (after, upto], by round then key."""
        stmt = (
            select(RoundMetric.round_idx, RoundMetric.key, RoundMetric.value, RoundMetric.logged_ms)
            .where(RoundMetric.run_id == run_id, RoundMetric.round_idx > after, RoundMetric.round_idx <= upto)
            .order_by(RoundMetric.round_idx, RoundMetric.key)
        )
        with self._session(f"read run {run_id}", write=False) as session:
            return [tuple(row) for row in session.execute(stmt)]  # type: ignore[misc]

    @retrying
    def last_round(self, run_id: str) -> int | None:
        """The highest round with logged metrics, or None if there is none."""
        with self._session(f"read run {run_id}", write=False) as session:
            return session.scalar(select(func.max(RoundMetric.round_idx)).where(RoundMetric.run_id == run_id))

    @retrying
    def delete_rounds_after(self, run_id: str, round_idx: int) -> int:
        """Drop round metrics, client metrics and checkpoint rows with round > `round_idx` (resume).

        `round_idx = -1` drops every round (a run resumed from scratch: killed before its first
        checkpoint).

        Returns:
            The number of round-metric rows deleted.
        """
        if round_idx != -1:
            check_round_idx(round_idx)
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

    @retrying
    def add_checkpoint(self, run_id: str, round_idx: int, path: str | Path) -> None:
        """Record (or replace) the checkpoint file written after `round_idx`."""
        row = {
            "run_id": run_id,
            "round_idx": check_round_idx(round_idx),
            "path": str(path),
            "created_at": utcnow(),
        }
        with self._session(f"record checkpoint {round_idx} of run {run_id}", write=True) as session:
            if run_id in self._leases:
                self._own(session, run_id)
            self._upsert(session, Checkpoint, [row], update=("path", "created_at"))

    @retrying
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

    @retrying
    def checkpoints(self, run_id: str) -> list[tuple[int, str]]:
        """All checkpoints of a run as `(round_idx, path)`, by round."""
        stmt = select(Checkpoint.round_idx, Checkpoint.path).where(Checkpoint.run_id == run_id)
        with self._session(f"read checkpoints of run {run_id}", write=False) as session:
            return [(row.round_idx, row.path) for row in session.execute(stmt.order_by(Checkpoint.round_idx))]

    @retrying
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
        options_text, now = canonical_json(dict(options or {})), utcnow()
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

    @retrying
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

    @retrying
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
                run = self._unique_match(
                    session, ref, select(Run).where(Run.mlflow_run_id == ref), "MLflow run id"
                )
            if run is None and HEX_RE.match(ref.lower()):
                run = self._unique_match(
                    session, ref, select(Run).where(Run.id.startswith(ref.lower())), "run id prefix"
                )
            if run is None:
                raise ConfigError(f"unknown run {ref!r}; `fedcli list runs` shows the ids")
            return to_record(run, session.get_one(Experiment, run.experiment_id).name)

    @staticmethod
    def _unique_match(session: Session, ref: str, stmt: Any, what: str) -> Run | None:
        matches = session.scalars(stmt.order_by(Run.created_at, Run.id).limit(6)).all()
        if len(matches) > 1:
            shown = ", ".join(run.id for run in matches[:5])
            raise ConfigError(f"{what} {ref!r} matches several runs ({shown}); pass a longer id")
        return matches[0] if matches else None

    @retrying
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
            rows: Sequence[tuple[Run, str]]
            if self._read_columns is None:  # tuples(): the same rows, typed as (Run, experiment name)
                rows = session.execute(stmt.order_by(Run.created_at, Run.id)).tuples().all()
            else:  # an older store, read without upgrading it (`reader`): its columns, as transient rows
                older = stmt.with_only_columns(*self._read_columns, Experiment.name)  # same join and filter
                rows = [
                    (
                        Run(**{c.name: value for c, value in zip(self._read_columns, row[:-1], strict=True)}),
                        row[-1],
                    )
                    for row in session.execute(older.order_by(Run.created_at, Run.id))
                ]
            records = [to_record(run, name) for run, name in rows]
        return filter_where(records, where) if where else records

    @retrying
    def client_metrics_frame(self, run_ids: Sequence[str], keys: Sequence[str] | None = None) -> pd.DataFrame:
        """Per-client training metrics of full run ids in long form (the clients of each round's cohort).

        Returns:
            Columns `run_id`, `round_idx` (int64), `client_id` (int64: the client's index in the
            run's partition), `key`, `value` (float64), sorted by (run_id, key, round_idx, client_id).
        """
        columns = ["run_id", "round_idx", "client_id", "key", "value"]
        return self._long_frame(ClientMetric, columns, run_ids, keys, "read client metrics")

    @retrying
    def metrics_frame(self, run_ids: Sequence[str], keys: Sequence[str] | None = None) -> pd.DataFrame:
        """Round metrics of full run ids in long form.

        Returns:
            Columns `run_id`, `round_idx` (int64), `key`, `value` (float64), sorted by
            (run_id, key, round_idx), index 0..n-1.
        """
        return self._long_frame(
            RoundMetric, ["run_id", "round_idx", "key", "value"], run_ids, keys, "read metrics"
        )

    def _long_frame(
        self,
        model: type[RoundMetric] | type[ClientMetric],
        columns: list[str],
        run_ids: Sequence[str],
        keys: Sequence[str] | None,
        what: str,
    ) -> pd.DataFrame:
        """`columns` of `model`'s rows of these runs (and `keys`), the integer columns int64 and `value`
        float64, sorted by run id, key, then the integer columns, index 0..n-1."""
        import pandas as pd

        stmt = select(*(getattr(model, name) for name in columns)).where(model.run_id.in_(list(run_ids)))
        if keys is not None:
            stmt = stmt.where(model.key.in_([check_metric_key(key) for key in keys]))
        with self._session(what, write=False) as session:
            rows = [tuple(row) for row in session.execute(stmt)]
        indices = [name for name in columns if name not in ("run_id", "key", "value")]
        frame = pd.DataFrame(rows, columns=columns).astype(
            {**dict.fromkeys(indices, "int64"), "value": "float64"}
        )
        return frame.sort_values(["run_id", "key", *indices], kind="stable", ignore_index=True)
