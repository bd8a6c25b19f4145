"""The SQL store's writes: starting, ending and resuming runs, sweep-trial claims, run fields and
tags, and the writes of rounds, client metrics, checkpoints and evaluations (one transaction each,
under the run's lease: tracking/store/sql_store.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import uuid
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, cast

from sqlalchemy import delete, select
from sqlalchemy import update as sql_update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import CursorResult
from sqlalchemy.orm import Session

from fedcli.errors import ConfigError
from fedcli.tracking.keys import check_metric_key, check_metrics
from fedcli.tracking.store.common import (
    END_STATUSES,
    HOSTNAME,
    RUN_ID_RE,
    SETTABLE_RUN_FIELDS,
    canonical_json,
    check_round_idx,
    check_str_mapping,
    log,
    utcnow,
)
from fedcli.tracking.store.liveness import claim_alive, liveness, pid_state, process_start
from fedcli.tracking.store.records import Claim
from fedcli.tracking.store.schema import (
    Checkpoint,
    ClientMetric,
    Evaluation,
    Experiment,
    RoundMetric,
    Run,
    TrialClaim,
)
from fedcli.tracking.store.session import StoreSession, retrying


class RunWrites(StoreSession):
    """The store's write methods (`SqlStore`'s)."""

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
