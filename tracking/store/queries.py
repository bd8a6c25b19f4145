"""`StoreQueries`: finding runs (`get_run`, `list_runs`) and reading metrics and evaluations as frames.

Part of the `fedcli.tracking.store` package (docs/architecture.md §6), whose docstring gives the layout.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from fedcli.errors import ConfigError
from fedcli.tracking.keys import check_metric_key
from fedcli.tracking.store.common import HEX_RE
from fedcli.tracking.store.records import RunRecord, filter_where, to_record
from fedcli.tracking.store.schema import ClientMetric, Evaluation, Experiment, RoundMetric, Run
from fedcli.tracking.store.session import StoreSession, retrying

if TYPE_CHECKING:
    import pandas as pd


class StoreQueries(StoreSession):
    """Finding runs and reading metrics and evaluations as frames: `SqlStore` inherits them."""

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
                older = select(*self._read_columns, Experiment.name).join(
                    Experiment, Run.experiment_id == Experiment.id
                )
                if experiment is not None:
                    older = older.where(Experiment.name == experiment)
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
        import pandas as pd

        stmt = select(
            ClientMetric.run_id,
            ClientMetric.round_idx,
            ClientMetric.client_id,
            ClientMetric.key,
            ClientMetric.value,
        ).where(ClientMetric.run_id.in_(list(run_ids)))
        if keys is not None:
            stmt = stmt.where(ClientMetric.key.in_([check_metric_key(key) for key in keys]))
        with self._session("read client metrics", write=False) as session:
            rows = [tuple(row) for row in session.execute(stmt)]
        frame = pd.DataFrame(rows, columns=["run_id", "round_idx", "client_id", "key", "value"])
        frame = frame.astype({"round_idx": "int64", "client_id": "int64", "value": "float64"})
        return frame.sort_values(
            ["run_id", "key", "round_idx", "client_id"], kind="stable", ignore_index=True
        )

    @retrying
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
