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

The store's other modules (the package's docstring lists them) hold its tables, sessions,
writes and queries; this module holds `SqlStore` itself: opening a store, starting, ending and
resuming runs, sweep-trial claims, run fields and tags.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import Any, cast

from sqlalchemy import delete, inspect, select
from sqlalchemy import update as sql_update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import CursorResult
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from fedcli.errors import ConfigError, TrackingError
from fedcli.tracking.store.common import (
    BEGIN_OPTION,
    END_STATUSES,
    HOSTNAME,
    RETRY_ENV,
    RETRY_S,
    RUN_ID_RE,
    SETTABLE_RUN_FIELDS,
    SQLITE_BUSY_TIMEOUT_MS,
    STORE_FIX,
    Transient,
    _first_line,
    canonical_json,
    check_str_mapping,
    env_seconds,
    log,
    utcnow,
)
from fedcli.tracking.store.engine import open_engine
from fedcli.tracking.store.liveness import claim_alive, liveness, pid_state, process_start
from fedcli.tracking.store.queries import StoreQueries
from fedcli.tracking.store.records import Claim
from fedcli.tracking.store.schema import (
    Experiment,
    Run,
    TrialClaim,
    schema_current,
    upgrade_schema,
)
from fedcli.tracking.store.session import retrying
from fedcli.tracking.store.writes import StoreWrites
from fedcli.tracking.urls import sqlite_path


class SqlStore(StoreWrites, StoreQueries):
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

    @staticmethod
    def _me() -> dict[str, Any]:
        return {"host": HOSTNAME, "pid": os.getpid(), "pid_start": process_start()}

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
        now, me = utcnow(), self._me()
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
        me = self._me()
        with self._session("release a sweep trial", write=True) as session:
            session.execute(
                delete(TrialClaim).where(
                    TrialClaim.experiment == experiment,
                    TrialClaim.config_hash == config_hash,
                    TrialClaim.host == me["host"],
                    TrialClaim.pid == me["pid"],
                )
            )

    @retrying
    def refresh_claims(self, experiment: str) -> None:
        """Refresh the heartbeat of this process's claims (what tells other hosts it is alive)."""
        me = self._me()
        with self._session("refresh sweep claims", write=True) as session:
            session.execute(
                sql_update(TrialClaim)
                .where(
                    TrialClaim.experiment == experiment,
                    TrialClaim.host == me["host"],
                    TrialClaim.pid == me["pid"],
                )
                .values(heartbeat_at=utcnow())
                .execution_options(synchronize_session=False)
            )

    @retrying
    def live_claims(self, experiment: str) -> dict[str, Claim]:
        """Config hash -> the live claim of another process, for the trials of an experiment."""
        now, me = utcnow(), self._me()
        with self._session("read sweep claims", write=False) as session:
            rows = session.scalars(select(TrialClaim).where(TrialClaim.experiment == experiment)).all()
            return {
                c.config_hash: Claim(c.experiment, c.config_hash, c.host, c.pid, c.claimed_at)
                for c in rows
                if (c.host, c.pid) != (me["host"], me["pid"]) and claim_alive(c, now)
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
