"""`StoreWrites`: the store's writes of rounds, per-client metrics, checkpoints and evaluations, and their
reads by run (round rows, last round, checkpoints).

Part of the `fedcli.tracking.store` package (docs/architecture.md §6), whose docstring gives the layout.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from sqlalchemy import delete, func, select
from sqlalchemy import update as sql_update
from sqlalchemy.engine import CursorResult

from fedcli.tracking.keys import NonFiniteMetricsError, check_metric_key, check_metrics
from fedcli.tracking.store.common import canonical_json, check_round_idx, log, utcnow
from fedcli.tracking.store.schema import Checkpoint, ClientMetric, Evaluation, RoundMetric, Run
from fedcli.tracking.store.session import StoreSession, retrying


class StoreWrites(StoreSession):
    """Writes of rounds, client metrics, checkpoints and evaluations, and reads by run: `SqlStore` inherits them."""

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
    def log_client_metrics(self, run_id: str, round_idx: int, rows: Iterable[tuple[int, str, float]]) -> None:
        """Write per-client metrics of one round, rows of `(client_id, key, value)`, in one transaction."""
        check_round_idx(round_idx)
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
