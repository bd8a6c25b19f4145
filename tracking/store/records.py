"""Runs and claims as read from the store (RunRecord, Claim), the row -> record conversion, `where` filters.

Part of the `fedcli.tracking.store` package (docs/architecture.md §6), whose docstring gives the layout.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from fedcli.errors import ConfigError
from fedcli.tracking.keys import flatten_config
from fedcli.tracking.store.common import utcnow
from fedcli.tracking.store.liveness import liveness
from fedcli.tracking.store.schema import Run


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


def to_record(run: Run, experiment: str, now: datetime | None = None) -> RunRecord:
    status, reason = liveness(run, now or utcnow())
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


def filter_where(records: list[RunRecord], where: Mapping[str, str]) -> list[RunRecord]:
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
