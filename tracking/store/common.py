"""The store's constants, JSON and hash helpers, durations from the environment, exceptions, argument checks.

Part of the `fedcli.tracking.store` package (docs/architecture.md §6), whose docstring gives the layout.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import re
import socket
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fedcli.errors import ConfigError, TrackingError

log = logging.getLogger("fedcli.tracking.store")  # one logger for the store's modules

# `pruned`: a search trial stopped early by its pruner (docs/sweeps.md, "Pruning"); added after the first
# release, so an older store's CHECK constraint is widened when it is opened (schema._widen_status_check)
RUN_STATUSES = ("running", "finished", "failed", "interrupted", "pruned")
END_STATUSES = ("finished", "failed", "interrupted", "pruned")
SETTABLE_RUN_FIELDS = frozenset({"model_path", "mlflow_run_id", "git_commit", "mlflow_synced_round"})
SQLITE_BUSY_TIMEOUT_MS = 5_000  # one attempt at SQLite's write lock (at most a quarter of the retry bound)
WAL_SWITCH_S = 30.0  # how long opening a new file retries its switch to WAL (`_enable_wal`)
HEARTBEAT_S = 10.0  # a live run refreshes runs.heartbeat_at this often (fedcli.engine.lifecycle)
STALE_S = 60.0  # a `running` run of another host whose heartbeat is older than this reads as `interrupted`
RETRY_S = 60.0  # how long a write waits for a locked SQLite file, or any call for a lost PostgreSQL server
STALE_ENV, RETRY_ENV = (
    "FEDCLI_STALE_S",
    "FEDCLI_STORE_RETRY_S",
)  # override the two (seconds; tests use short ones)
TAKEN_OVER_EXIT = 75  # exit code of a process whose run another process took over (EX_TEMPFAIL)
HOSTNAME = socket.gethostname()
LOCK_KEY = 0x66656463  # "fedc": the PostgreSQL advisory-lock key of schema setup
BEGIN_OPTION = "fedcli_sqlite_begin"  # execution option read by the SQLite "begin" hook
RUN_ID_RE = re.compile(r"^[0-9a-f]{32}$")
HEX_RE = re.compile(r"^[0-9a-f]+$")
STORE_FIX = "pass --store with a writable path or set FEDCLI_STORE"


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


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def env_seconds(name: str, default: float) -> float:
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
        raise ConfigError(
            f"{name} must be a number of seconds > 0; got {raw!r}. Unset it to use {default:g} s."
        )
    return value


def stale_s() -> float:
    """`STALE_S`, or `FEDCLI_STALE_S` when set: heartbeat age after which another host's run is gone."""
    return env_seconds(STALE_ENV, STALE_S)


class RunTakenOver(TrackingError):
    """This process lost its lease on a run: another process resumed it. Nothing more was written.

    The CLI exits with `exit_code` (75), distinct from a failure (1) or bad input (2).
    """

    exit_code = TAKEN_OVER_EXIT

    def __init__(self, run_id: str, pid: int | None, host: str | None) -> None:
        super().__init__(
            f"run {run_id[:8]} was taken over by pid {pid} on host {host}; this process stopped "
            "writing (its rounds after the takeover are the other process's to log)"
        )
        self.run_id, self.pid, self.host = run_id, pid, host


class StoreUnavailable(TrackingError):
    """The store stayed locked, or its server unreachable, for longer than its `retry_s` (`FEDCLI_STORE_RETRY_S`, else `RETRY_S`)."""


class Transient(TrackingError):
    """A failure worth retrying: `kind` is "locked" (SQLite's write lock) or "lost" (the server connection)."""

    def __init__(self, kind: str, what: str, err: BaseException) -> None:
        super().__init__(_first_line(err))
        self.kind, self.what = kind, what


def _first_line(err: BaseException) -> str:
    orig = getattr(err, "orig", None)
    text = str(orig if orig is not None else err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def check_round_idx(round_idx: int) -> int:
    if isinstance(round_idx, bool) or not isinstance(round_idx, int) or round_idx < 0:
        raise ValueError(f"round_idx must be an int >= 0; got {round_idx!r}.")
    return round_idx


def check_str_mapping(name: str, mapping: Mapping[str, str]) -> dict[str, str]:
    bad = {
        key: value for key, value in mapping.items() if not isinstance(key, str) or not isinstance(value, str)
    }
    if bad:
        raise ValueError(f"{name} must map str to str; got {bad!r}.")
    return dict(mapping)


def disk_full(err: BaseException) -> bool:
    """True when an error (OSError or a database error) means the disk is full."""
    if isinstance(err, OSError) and err.errno == errno.ENOSPC:
        return True
    return "disk is full" in str(getattr(err, "orig", None) or err).lower()
