"""The SQL store's reads: a run's rounds and checkpoints, finding runs (by id, prefix, name or
MLflow id; filtered lists) and metrics, client metrics and evaluations as frames. Reads take no lock.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from fedcli.errors import ConfigError
from fedcli.tracking.keys import check_metric_key
from fedcli.tracking.store.common import HEX_RE
from fedcli.tracking.store.records import RunRecord, filter_where, to_record
from fedcli.tracking.store.schema import Checkpoint, ClientMetric, Evaluation, Experiment, RoundMetric, Run

if TYPE_CHECKING:
    import pandas as pd

from fedcli.tracking.store.session import StoreSession, retrying


class RunQueries(StoreSession):
    """The store's read methods (`SqlStore`'s)."""

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
    def checkpoints(self, run_id: str) -> list[tuple[int, str]]:
        """All checkpoints of a run as `(round_idx, path)`, by round."""
        stmt = select(Checkpoint.round_idx, Checkpoint.path).where(Checkpoint.run_id == run_id)
        with self._session(f"read checkpoints of run {run_id}", write=False) as session:
            return [(row.round_idx, row.path) for row in session.execute(stmt.order_by(Checkpoint.round_idx))]

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
