"""`Tracker`: one per run, writes every round to the SQL store and, if enabled, to MLflow.

STYLE.md rule 15 sketches a `Sink` protocol. With exactly two concrete sinks whose
duties differ (the SQL store is the source of truth and also holds client metrics,
checkpoints and resume state; MLflow holds params, tags and artifacts) a protocol would
force both to fake each other's methods, so the fan-out is this one small class with
both sinks as explicit arguments (no global current run, rule 9).

Usage by the engine::

    tracker = Tracker(SqlStore(store_url), MlflowSink(tracking_uri, experiment) or None)
    run_id = tracker.start(experiment=..., config=cfg_dict, algo=..., ...)
    try:
        for round_idx in ...:
            tracker.log_round(round_idx, metrics)      # NonFiniteMetricsError on NaN/inf
    except NonFiniteMetricsError as err:
        tracker.finish("failed", reason=str(err), diverged_at_round=err.round_idx)
    else:
        tracker.finish("finished")
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedcli.errors import TrackingError
from fedcli.tracking.keys import check_metrics, flatten_config
from fedcli.tracking.store import RunRecord, SqlStore, canonical_json, config_hash

if TYPE_CHECKING:
    from fedcli.tracking.mlflow_sink import MlflowSink

__all__ = ["CONFIG_ARTIFACT", "BackgroundMlflow", "Tracker"]

log = logging.getLogger(__name__)

CONFIG_ARTIFACT = "config.json"


class BackgroundMlflow:
    """An `MlflowSink` opened and driven on one background thread, so MLflow never delays a round.

    Importing MLflow (about 2 s) and opening its store (alembic migrations on a fresh
    SQLite file: about 3 s more) used to sit between `fedcli train` and the first round.
    Here the constructor only queues the sink's creation; every later call is queued in
    order behind it on the same thread (`ThreadPoolExecutor(max_workers=1)`), and calls
    that return something return a `Future`. Nothing is lost: `flush()` waits for every
    queued call and raises the first failure as the sink raised it (a one-line
    `TrackingError`), and the `Tracker` flushes at every checkpoint and at the end of the run.
    A failure is also raised by the first `check()` after it happened (`Tracker.log_round`
    calls it, without waiting).
    """

    def __init__(self, tracking_uri: str, experiment: str) -> None:
        self.tracking_uri, self.experiment = tracking_uri, experiment
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedcli-mlflow")
        self._queued: list[Future[Any]] = []
        self._sink: Future[MlflowSink] = self._thread.submit(self._open)

    def _open(self) -> MlflowSink:
        from fedcli.tracking.mlflow_sink import MlflowSink

        return MlflowSink(self.tracking_uri, self.experiment)

    def _queue(self, method: str, *args: Any, **kwargs: Any) -> Future[Any]:
        def call() -> Any:
            return getattr(self._sink.result(), method)(*args, **kwargs)  # re-raises a failed open

        future = self._thread.submit(call)
        self._queued.append(future)
        return future

    def start_run(self, **kwargs: Any) -> Future[str]:
        """Queue `MlflowSink.start_run`; the future holds the MLflow run id."""
        return self._queue("start_run", **kwargs)

    def attach(self, run_id: str) -> None:
        self._queue("attach", run_id)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        self._queue("set_tags", dict(tags))

    def log_round(self, round_idx: int, metrics: Mapping[str, float]) -> None:
        self._queue("log_round", round_idx, dict(metrics))

    def log_text(self, text: str, artifact_file: str) -> None:
        self._queue("log_text", text, artifact_file)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self._queue("log_artifact", path, artifact_path)

    def check(self) -> None:
        """Raise the first failure among the calls done so far (never waits)."""
        done = [f for f in self._queued if f.done()]
        self._queued = [f for f in self._queued if not f.done()]
        for future in done:
            future.result()

    def flush(self) -> None:
        """Wait for every queued call and for MLflow's own queued batches; raise the first failure."""
        self._queue("flush")
        queued, self._queued = self._queued, []
        for future in queued:
            future.result()

    def end_run(self, status: str) -> None:
        """Queue the end of the run, wait for everything, and stop the thread."""
        self._queue("end_run", status)
        try:
            self.flush()
        finally:
            self._thread.shutdown(wait=True)


class Tracker:
    """Fan-out of one run's tracking to the SQL store and (optionally) MLflow.

    Args:
        store: The results store (source of truth for reports).
        mlflow: An MLflow sink for this run, or None for `--no-mlflow`.
    """

    def __init__(self, store: SqlStore, mlflow: MlflowSink | BackgroundMlflow | None = None) -> None:
        self.store = store
        self.mlflow = mlflow
        self._run_id: str | None = None
        self._started: str | Future[str] | None = None  # the MLflow run id, until stored on the SQL run

    @property
    def run_id(self) -> str:
        """The fedcli run id (32 hex characters) of the started or resumed run."""
        if self._run_id is None:
            raise RuntimeError("Tracker has no run; call start or resume first")
        return self._run_id

    def start(
        self,
        *,
        experiment: str,
        run_name: str | None,
        config: Mapping[str, Any],
        algo: str,
        task: str,
        seed: int,
        dataset: str,
        partitioner: str,
        fedcli_version: str,
        torch_version: str,
        git_commit: str | None = None,
        tags: Mapping[str, str] | None = None,
        flat_params: Mapping[str, str] | None = None,
        run_id: str | None = None,
        mlflow_parent_run_id: str | None = None,
    ) -> str:
        """Start the SQL run, then the MLflow run; store the MLflow run id on the SQL run.

        The arguments are those of `SqlStore.start_run` plus: `dataset`/`partitioner`
        (tags `fedcli.dataset`/`fedcli.partitioner`, kept in the SQL tags too),
        `flat_params` (MLflow params, default `flatten_config(config)`) and
        `mlflow_parent_run_id` (a sweep's parent MLflow run; makes this run nested).
        MLflow also gets the tags `fedcli.algorithm`, `fedcli.task`, `fedcli.config_hash`,
        `fedcli.version`, `fedcli.run_id`, `mlflow.source.git.commit` and the artifact
        `config.json` (the canonical config). Returns the fedcli run id.

        Raises:
            TrackingError: If either store fails; a run whose MLflow side failed is
                marked `failed` in the SQL store before the error propagates.
        """
        sql_tags = {**(tags or {}), "fedcli.dataset": dataset, "fedcli.partitioner": partitioner}
        run_id = self.store.start_run(
            experiment=experiment,
            run_name=run_name,
            config=config,
            algo=algo,
            task=task,
            seed=seed,
            tags=sql_tags,
            fedcli_version=fedcli_version,
            torch_version=torch_version,
            git_commit=git_commit,
            run_id=run_id,
        )
        self._run_id = run_id
        if self.mlflow is not None:
            mlflow_tags = {
                **sql_tags,
                "fedcli.algorithm": algo,
                "fedcli.task": task,
                "fedcli.version": fedcli_version,
            }
            if git_commit:
                mlflow_tags["mlflow.source.git.commit"] = git_commit
            params = flatten_config(config) if flat_params is None else flat_params
            self._start_mlflow(self.mlflow, config, params, mlflow_tags, mlflow_parent_run_id)
        return run_id

    def _start_mlflow(
        self,
        mlflow: MlflowSink | BackgroundMlflow,
        config: Mapping[str, Any],
        params: Mapping[str, str],
        tags: dict[str, str],
        parent_run_id: str | None,
    ) -> None:
        """Start and link the MLflow run of the already started SQL run."""
        run_id = self.run_id
        tags.setdefault("fedcli.config_hash", config_hash(config))  # the engine passes its own hash
        tags["fedcli.run_id"] = run_id
        try:
            started = mlflow.start_run(
                run_name=self.store.get_run(run_id).run_name, params=params, tags=tags, parent_run_id=parent_run_id
            )
            self._started = started
            mlflow.log_text(canonical_json(config), CONFIG_ARTIFACT)
            if not isinstance(started, Future):
                self._sync_mlflow(wait=True)
        except TrackingError as err:
            self.mlflow = None
            self.store.end_run(run_id, "failed", reason=str(err))
            raise

    def _sync_mlflow(self, *, wait: bool) -> None:
        """Store the MLflow run id once known; raise queued MLflow failures (waiting if `wait`).

        After a failure MLflow is dropped for the rest of the run and the `TrackingError`
        propagates; the engine then ends the run `failed` with that reason.
        """
        if self.mlflow is None:
            return
        try:
            if isinstance(self.mlflow, BackgroundMlflow):
                if wait:
                    self.mlflow.flush()
                else:
                    self.mlflow.check()
            started = self._started
            if started is not None and (not isinstance(started, Future) or started.done()):
                self._started = None
                mlflow_run_id = started.result() if isinstance(started, Future) else started
                self.store.set_run_fields(self.run_id, mlflow_run_id=mlflow_run_id)
                log.info("run %s started (MLflow run %s)", self.run_id, mlflow_run_id)
        except TrackingError:
            self.mlflow = None
            raise

    def resume(self, run_ref: str, *, from_round: int | None = None) -> RunRecord:
        """Reattach to an existing run: status back to `running`, MLflow run back to RUNNING.

        Args:
            run_ref: Run id, unique id prefix or run name.
            from_round: The checkpoint round training restarts after; SQL rows of later
                rounds (metrics, client metrics, checkpoints) are deleted so that they are
                logged afresh. MLflow keeps its history: re-logged steps get a second point
                with a newer timestamp.

        Returns:
            The run as stored after reopening.
        """
        record = self.store.get_run(run_ref)
        if from_round is not None:
            self.store.delete_rounds_after(record.id, from_round)
        self.store.mark_running(record.id)
        self._run_id = record.id
        if self.mlflow is not None:
            if record.mlflow_run_id is None:
                log.warning("run %s was started without MLflow; resuming it without MLflow", record.id)
                self.mlflow = None
            else:
                self.mlflow.attach(record.mlflow_run_id)
        log.info("run %s resumed%s", record.id, "" if from_round is None else f" after round {from_round}")
        return self.store.get_run(record.id)

    def log_round(self, round_idx: int, metrics: Mapping[str, float]) -> None:
        """Write one round to the store (one transaction) and queue it for MLflow.

        Raises:
            NonFiniteMetricsError: (a `ValueError`) if any value is NaN/inf; it lists the
                keys and nothing of this round is written to either store.
            ValueError: For a malformed metric key.
        """
        values = check_metrics(metrics, round_idx)
        self.store.log_round(self.run_id, round_idx, values)
        if self.mlflow is not None:
            self.mlflow.log_round(round_idx, values)
            self._sync_mlflow(wait=False)

    def log_client_metrics(self, round_idx: int, rows: Iterable[tuple[int, str, float]]) -> None:
        """Write per-client `(client_id, key, value)` rows of one round (SQL store only)."""
        self.store.log_client_metrics(self.run_id, round_idx, rows)

    def checkpoint(self, round_idx: int, path: str | Path) -> None:
        """Record a checkpoint written after `round_idx` and flush queued MLflow metrics."""
        self.store.add_checkpoint(self.run_id, round_idx, path)
        if self.mlflow is not None:
            self.mlflow.flush()
            self._sync_mlflow(wait=True)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        """Upload a file to the MLflow run (no-op without MLflow)."""
        if self.mlflow is not None:
            self.mlflow.log_artifact(path, artifact_path)

    def finish(self, status: str, reason: str | None = None, diverged_at_round: int | None = None) -> None:
        """End the run in both stores (SQL first, the source of truth; then MLflow, flushed).

        Args:
            status: `finished`, `failed` or `interrupted`.
            reason: One-line cause for failed/interrupted runs (MLflow tag `fedcli.failure_reason`).
            diverged_at_round: Round with non-finite metrics (MLflow tag `fedcli.diverged_at_round`).
        """
        try:
            self._sync_mlflow(wait=True)
        except TrackingError as err:  # the run ends failed, with MLflow's reason
            self.store.end_run(self.run_id, "failed", reason=f"{reason + '; ' if reason else ''}{err}",
                               diverged_at_round=diverged_at_round)
            raise
        self.store.end_run(self.run_id, status, reason=reason, diverged_at_round=diverged_at_round)
        if self.mlflow is None:
            return
        tags = {"fedcli.status": status}
        if reason is not None:
            tags["fedcli.failure_reason"] = reason
        if diverged_at_round is not None:
            tags["fedcli.diverged_at_round"] = str(diverged_at_round)
        try:
            self.mlflow.set_tags(tags)
        finally:
            self.mlflow.end_run(status)
        log.info("run %s %s", self.run_id, status)
