"""`Tracker`: one per run; writes every round to the SQL store and keeps MLflow in line with it.

docs/style.md rule 15 sketches a `Sink` protocol. The two stores have different duties here:
the SQL store is the source of truth (rounds, client metrics, checkpoints, the run's life)
and is written by the training process, one transaction per round; MLflow is a copy made
by a separate low-priority process (`fedcli.tracking.mlflow.mirror`), so that MLflow never
delays a round, never races its schema set-up, and never gets a round twice after a
resume. The fan-out is this one small class with both as explicit arguments (no global
current run, rule 9).

Usage by the engine::

    tracker = Tracker(SqlStore(store_url), MirrorHandle(...) or None)
    run_id = tracker.start(experiment=..., config=cfg_dict, algo=..., ...)
    for round_idx in ...:
        tracker.log_round(round_idx, metrics)      # NonFiniteMetricsError on NaN/inf
    tracker.finish("finished")                     # or "failed" / "interrupted", with a reason
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedcli.tracking.store.records import RunRecord

if TYPE_CHECKING:
    from fedcli.tracking.mlflow.handle import MirrorHandle
    from fedcli.tracking.store.protocol import RunStore

__all__ = ["Tracker"]

log = logging.getLogger(__name__)


class Tracker:
    """Fan-out of one run's tracking to the SQL store and (optionally) its MLflow mirror.

    Args:
        store: The results store (source of truth for reports): what the run needs of it
            (`RunStore`, tracking/store/protocol.py), e.g. a `SqlStore`.
        mirror: Starts and ends the run's MLflow mirror, or None for `--no-mlflow`.

    `on_run`, when set, is called with the run id as soon as the run exists in the store
    (started or resumed), before anything else can fail or be interrupted: `fedcli train`
    prints the id on stdout there, so `RUN=$(fedcli -q train …)` has it even for a run that
    is stopped.
    """

    def __init__(self, store: RunStore, mirror: MirrorHandle | None = None) -> None:
        self.store = store
        self.mirror = mirror
        self._run_id: str | None = None
        self.on_run: Callable[[str], None] | None = None
        self.warnings: list[str] = []

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
        run_id: str | None = None,
        requested: Mapping[str, Any] | None = None,
        config_hash: str | None = None,
    ) -> str:
        """Start the run in the SQL store (status `running`, heartbeat now), then its MLflow mirror.

        The arguments are those of `SqlStore.start_run` plus `dataset`/`partitioner` (tags
        `fedcli.dataset`/`fedcli.partitioner`). Returns the fedcli run id.
        """
        sql_tags = {**(tags or {}), "fedcli.dataset": dataset, "fedcli.partitioner": partitioner}
        self._run_id = self.store.start_run(
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
            requested=requested,
            config_hash=config_hash,
        )
        if self.on_run is not None:
            self.on_run(self._run_id)
        self._start_mirror()
        return self._run_id

    def _start_mirror(self) -> None:
        """Hand the run to its MLflow mirror; nothing waits for MLflow's set-up (`MirrorHandle.start`)."""
        if self.mirror is not None:
            self.mirror.start(self.run_id)

    def resume(
        self,
        run_ref: str,
        *,
        from_round: int | None = None,
        config: Mapping[str, Any] | None = None,
        config_hash: str | None = None,
        requested: Mapping[str, Any] | None = None,
    ) -> RunRecord:
        """Reattach to an existing run: status back to `running` in this process, MLflow mirror restarted.

        Args:
            run_ref: Run id, unique id prefix, run name or MLflow run id.
            from_round: The checkpoint round training restarts after (-1: from scratch); SQL
                rows of later rounds (metrics, client metrics, checkpoints) are deleted and
                logged afresh. MLflow never received them (the mirror copies only rounds up to
                a checkpoint until the run finishes), so it keeps one point per round.
            config, config_hash: The config this resume runs (e.g. more rounds), stored in
                place of the old one.

        Raises:
            ConfigError: The run is still alive in another process.
        """
        record = self.store.get_run(run_ref)
        self.store.mark_running(record.id)
        if from_round is not None:
            self.store.delete_rounds_after(record.id, from_round)
        if config is not None and config_hash is not None:
            self.store.update_config(record.id, config, config_hash, requested)
        self._run_id = record.id
        if self.on_run is not None:
            self.on_run(record.id)
        self._start_mirror()
        log.info("run %s resumed%s", record.id, "" if from_round is None else f" after round {from_round}")
        return self.store.get_run(record.id)

    def log_round(
        self, round_idx: int, metrics: Mapping[str, float], clients: Iterable[tuple[int, str, float]] = ()
    ) -> None:
        """Write one round, with its per-client `(client_id, key, value)` rows, to the store in one
        transaction (the mirror copies the round metrics to MLflow later; client rows stay in SQL).

        Raises:
            NonFiniteMetricsError: (a `ValueError`) if any round value is NaN/inf; nothing is written.
            ValueError: For a malformed metric key.
        """
        self.store.log_round(self.run_id, round_idx, metrics, clients)  # which checks keys and values
        if self.mirror is not None:  # one waitpid: a mirror that died alone is restarted, never waited for
            self._warn(self.mirror.check())

    def checkpoint(self, round_idx: int, path: str | Path) -> None:
        """Record a checkpoint written after `round_idx` (MLflow may now copy rounds up to it)."""
        self.store.add_checkpoint(self.run_id, round_idx, path)

    def finish(self, status: str, reason: str | None = None, diverged_at_round: int | None = None) -> None:
        """End the run in the SQL store, then let the mirror copy the rest and end the MLflow run.

        Args:
            status: `finished`, `failed`, `interrupted` or `pruned`.
            reason: One-line cause for failed/interrupted runs (MLflow tag `fedcli.failure_reason`).
            diverged_at_round: Round with non-finite metrics (MLflow tag `fedcli.diverged_at_round`).
        """
        self.store.end_run(self.run_id, status, reason=reason, diverged_at_round=diverged_at_round)
        if self.mirror is not None:
            self._warn(self.mirror.finish())
        log.info("run %s %s", self.run_id, status)

    def _warn(self, warning: str | None) -> None:
        if warning:
            self.warnings.append(warning)
            log.warning("MLflow: %s", warning)
