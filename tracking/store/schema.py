"""The store's tables (SQLAlchemy 2 typed models) and their set-up and upgrade, secrets masking included.

`upgrade_schema` creates missing tables and columns in one locked transaction and, once per store,
masks the passwords that rows, checkpoints and `model.pt` files written by an older fedcli held
(docs/operations.md, "Security").

Part of the `fedcli.tracking.store` package (docs/architecture.md §6), whose docstring gives the layout.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import zipfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    DateTime,
    Double,
    ForeignKey,
    String,
    Text,
    insert,
    inspect,
    select,
    text,
)
from sqlalchemy import update as sql_update
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from fedcli.tracking.store.common import LOCK_KEY, RUN_STATUSES, canonical_json, log, utcnow
from fedcli.tracking.urls import has_password, mask_url


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
    lease: Mapped[str | None] = mapped_column(
        String(32)
    )  # token of the process that owns the run (one writer)
    pid_start: Mapped[int | None] = mapped_column(
        BigInteger()
    )  # that process's start time (a reused pid differs)


class StoreMeta(Base):
    """Facts about the store itself, key -> value. `secrets_masked_2` (SECRETS_MASKED): when a schema set-up
    masked the passwords that rows, checkpoints and model files written by an older fedcli held
    (`_mask_stored_secrets`, `_mask_run_files`)."""

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


# Columns added after the first release: (table, column, SQL type). `upgrade_schema` adds the
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


def schema_current(conn: Any) -> bool:
    """True when every table and added column exists: a read, which takes no lock (`SqlStore` then
    skips the locked set-up, so readers never wait for, nor take, SQLite's write lock)."""
    inspector = inspect(conn)
    tables = set(inspector.get_table_names())
    if not set(Base.metadata.tables) <= tables:
        return False
    present = {(t, c["name"]) for t in {t for t, _, _ in _ADDED_COLUMNS} for c in inspector.get_columns(t)}
    if not {(table, column) for table, column, _ in _ADDED_COLUMNS} <= present:
        return False
    return _status_check_current(conn) and _secrets_masked(conn)


_OLD_STATUSES = ("running", "finished", "failed", "interrupted")  # the runs.status CHECK before `pruned`


def _status_check_current(conn: Any) -> bool:
    """True when the runs table's status CHECK constraint allows every status of RUN_STATUSES (a read)."""
    if conn.dialect.name == "sqlite":
        sql = conn.scalar(text("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'runs'")) or ""
    elif conn.dialect.name == "postgresql":
        sql = (
            conn.scalar(
                text(
                    "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE conname = 'ck_runs_status'"
                    " AND conrelid = 'runs'::regclass"
                )
            )
            or ""
        )
    else:
        return True
    return all(f"'{status}'" in sql for status in RUN_STATUSES)


def _widen_status_check(conn: Any) -> None:
    """Let an older store's runs.status take the statuses added since (`pruned`), inside `upgrade_schema`'s
    locked transaction. PostgreSQL: drop and add the constraint. SQLite cannot alter a constraint; its
    documented way for a change that leaves the stored rows valid (sqlite.org/lang_altertable.html,
    "Making Other Kinds Of Table Schema Changes") is to edit the table's CREATE statement in
    sqlite_master under `writable_schema` and bump `schema_version`, which this does."""
    if _status_check_current(conn):
        return
    if conn.dialect.name == "postgresql":
        conn.execute(text("ALTER TABLE runs DROP CONSTRAINT IF EXISTS ck_runs_status"))
        conn.execute(
            text(f"ALTER TABLE runs ADD CONSTRAINT ck_runs_status CHECK (status IN {RUN_STATUSES!r})")
        )
    elif conn.dialect.name == "sqlite":
        sql = conn.scalar(text("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'runs'"))
        widened = sql.replace(repr(_OLD_STATUSES), repr(RUN_STATUSES))
        if widened == sql:
            log.warning("store: could not widen the runs.status constraint for %s", ", ".join(RUN_STATUSES))
            return
        version = conn.scalar(text("PRAGMA schema_version"))
        conn.execute(text("PRAGMA writable_schema = ON"))
        conn.execute(
            text("UPDATE sqlite_master SET sql = :sql WHERE type = 'table' AND name = 'runs'"),
            {"sql": widened},
        )
        conn.execute(text(f"PRAGMA schema_version = {int(version) + 1}"))
        conn.execute(text("PRAGMA writable_schema = OFF"))
    log.info(
        "store: runs.status now also takes %s (store made by an older fedcli)",
        ", ".join(s for s in RUN_STATUSES if s not in _OLD_STATUSES),
    )


def upgrade_schema(conn: Any) -> None:
    """Create missing tables and columns, once, however many processes open the store together.

    One transaction under the database's own lock: `BEGIN IMMEDIATE` on SQLite (the write
    lock, taken before reading the schema) and a transaction-scoped advisory lock on
    PostgreSQL (`CREATE TABLE IF NOT EXISTS` alone races on the catalogue). DDL is
    transactional on both, so a process killed half-way leaves no half-made schema.
    """
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": LOCK_KEY})
    Base.metadata.create_all(conn)
    inspector = inspect(conn)
    for table, column, sql_type in _ADDED_COLUMNS:
        if column not in {c["name"] for c in inspector.get_columns(table)}:
            conn.execute(text(f"ALTER TABLE {table} ADD COLUMN {column} {sql_type}"))
            log.info("store: added column %s.%s (store made by an older fedcli)", table, column)
    _widen_status_check(conn)
    if not _secrets_masked(conn):
        if (
            conn.dialect.name == "sqlite"
        ):  # the old rows' bytes overwritten in the file, not left in freed pages
            conn.execute(text("PRAGMA secure_delete = ON"))
        masked = _mask_stored_secrets(conn)
        if conn.dialect.name == "sqlite":
            conn.execute(text("PRAGMA secure_delete = OFF"))
        files = _mask_run_files(conn)
        conn.execute(insert(StoreMeta).values(key=SECRETS_MASKED, value=utcnow().isoformat()))
        if masked or files:
            log.warning(
                "store: masked the passwords of store URLs that %d run(s) and %d checkpoint or model file(s) "
                'written by an older fedcli held in clear (docs/operations.md, "Security")',
                masked,
                files,
            )


# StoreMeta key: the stored rows, checkpoints and model files hold no password (`_mask_stored_secrets`,
# `_mask_run_files`). "secrets_masked" was the key of the first masking, which missed passwords
# holding "/" and `?password=` URLs: a store that has only that key is masked again.
SECRETS_MASKED = "secrets_masked_2"


def _secrets_masked(conn: Any) -> bool:
    """True when the store's rows and files were masked by this fedcli's masker (a read)."""
    return conn.scalar(select(StoreMeta.value).where(StoreMeta.key == SECRETS_MASKED)) is not None


_SECRET_COLUMNS = ("config_json", "requested_json", "tags_json", "failure_reason")


def _mask_stored_secrets(conn: Any) -> int:
    """Mask the passwords that rows written before the secrets fix hold; return how many runs changed.

    fedcli before its first masking stored `--store`/`--tracking-uri` URLs in full in `config_json`,
    `requested_json` (and could quote them in `failure_reason`); tags never held a URL, but are
    checked too. Each JSON value is parsed, every string in it masked (`mask_url`) and written
    back as canonical JSON, so running it twice changes nothing. Runs stored before the config
    hash was passed to the store (fedcli 95fa5be-58e6f55^) have `config_hash` = sha256 of
    `config_json` *with* the tracking section, password included: the column then takes the
    run's `fedcli.config_hash` tag, the hash of the config without the tracking section that
    every newer run's column holds (and what sweeps match on), else the sha256 of the masked
    config. Part of `upgrade_schema`'s transaction, so it is done once, whole, under the lock.
    """
    maybe = [getattr(Run, name).like("%://%") for name in _SECRET_COLUMNS]  # has_password decides
    rows = conn.execute(
        select(Run.id, Run.config_hash, *(getattr(Run, n) for n in _SECRET_COLUMNS)).where(
            maybe[0] | maybe[1] | maybe[2] | maybe[3]
        )
    ).all()
    changed = 0
    for row in rows:
        values: dict[str, str] = {}
        for name in _SECRET_COLUMNS:
            stored = getattr(row, name)
            if not stored or not has_password(stored):
                continue
            values[name] = (
                mask_url(stored) if name == "failure_reason" else canonical_json(_masked(json.loads(stored)))
            )
        if not values:
            continue
        if (
            "config_json" in values
            and row.config_hash == hashlib.sha256(row.config_json.encode("utf-8")).hexdigest()
        ):
            tags = json.loads(values.get("tags_json") or row.tags_json or "{}")
            values["config_hash"] = (
                tags.get("fedcli.config_hash")
                or hashlib.sha256(values["config_json"].encode("utf-8")).hexdigest()
            )
        conn.execute(sql_update(Run).where(Run.id == row.id).values(**values))
        changed += 1
    return changed


def _masked(value: Any) -> Any:
    """`value` (parsed JSON, or a torch file's plain payload) with the password of every URL in every
    string masked; other leaves (numbers, tensors) as they are."""
    if isinstance(value, str):
        return mask_url(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_masked(item) for item in value)
    if isinstance(value, dict):
        return {key: _masked(item) for key, item in value.items()}
    return value


def _run_files(conn: Any) -> list[Path]:
    """The checkpoint and `model.pt` files of every run that exist: the paths the store recorded, and
    the other `.pt` files of the same run folders (`runs/<id>/model.pt`, `runs/<id>/checkpoints/`)."""
    paths = [Path(p) for p in conn.scalars(select(Checkpoint.path))]
    paths += [Path(p) for p in conn.scalars(select(Run.model_path).where(Run.model_path.is_not(None)))]
    folders = {p.parent.parent if p.parent.name == "checkpoints" else p.parent for p in paths}
    for folder in folders:
        paths += [folder / "model.pt", *sorted((folder / "checkpoints").glob("*.pt"))]
    unique = dict.fromkeys(p for p in paths if p.name.endswith(".pt") and not p.name.startswith("."))
    return [p for p in unique if p.is_file()]


def _may_hold_password(path: Path) -> bool:
    """Whether the pickled part of a torch file (`*/data.pkl` in its zip; tensors are apart) holds a URL
    with a password: read without torch; a file that is no zip is checked whole by `_mask_file`."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.endswith("data.pkl")]
            pickled = b"".join(archive.read(n) for n in names)
    except (OSError, zipfile.BadZipFile):
        return True
    return b"://" in pickled and has_password(pickled.decode("utf-8", "replace"))


def _mask_file(path: Path) -> bool:
    """Mask every URL string of a checkpoint or `model.pt` (loaded with weights_only=True: plain tensors and
    strings) and write it back atomically (temporary file beside it, fsync, rename); True when it changed.
    A file that cannot be read or written is left as it is (warned): the run's own reader names it."""
    import torch

    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - unreadable or needing code: not ours to rewrite
        log.warning("store: could not read %s to mask its passwords (%s)", path, type(err).__name__)
        return False
    masked = _masked(payload)
    if _same(masked, payload):
        return False
    fd, tmp = tempfile.mkstemp(
        prefix=f".{path.name}.", dir=path.parent
    )  # the engine's atomic_save temp prefix
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(masked, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        log.warning("store: could not rewrite %s with its passwords masked (%s)", path, err)
        return False
    return True


def _same(a: Any, b: Any) -> bool:
    """Equal as far as masking goes: the same strings (tensors and other leaves compared by identity)."""
    if isinstance(a, str) or isinstance(b, str):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a is b


def _mask_run_files(conn: Any) -> int:
    """Mask the passwords that the checkpoints and `model.pt` files of an older store's runs hold (their
    `config` holds the run's store and MLflow URLs); return how many files changed."""
    return sum(_mask_file(path) for path in _run_files(conn) if _may_hold_password(path))
