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

`SqlStore` is one class in three parts, each a module: session.py (`StoreSession`: opening a store,
its transactions, retries and lease checks), writes.py (`RunWrites`: runs, claims, fields and tags,
rounds, checkpoints and evaluations) and queries.py (`RunQueries`: a run's rounds and checkpoints,
finding runs, frames). Both parts derive from `StoreSession`, so each uses what `__init__` sets.
"""

from __future__ import annotations

from sqlalchemy import inspect
from sqlalchemy.exc import SQLAlchemyError

from fedcli.errors import TrackingError
from fedcli.tracking.store.common import STORE_FIX, _first_line
from fedcli.tracking.store.queries import RunQueries
from fedcli.tracking.store.schema import Experiment, Run
from fedcli.tracking.store.writes import RunWrites
from fedcli.tracking.urls import sqlite_path


class SqlStore(RunWrites, RunQueries):
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

    def __enter__(self) -> SqlStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
