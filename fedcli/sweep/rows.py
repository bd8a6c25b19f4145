"""What the store says about a sweep's trials (the live table's rows) and the sweep's MLflow parent run.

Part of fedcli.sweep; fedcli/sweep/__init__.py describes how a sweep owns its trials and the
package's layout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fedcli.errors import ConfigError

if TYPE_CHECKING:
    from fedcli.tracking.store.records import RunRecord

from fedcli.sweep.plan import DIVERGED, ELSEWHERE, NEW, RESUME, SKIP, Plan, run_of
from fedcli.sweep.scheduler import TrialProcess
from fedcli.sweep.spec import spec_hash

# --------------------------------------------------------------------------- what the store says


METRIC_KEYS = ("eval/accuracy", "eval/dist_to_opt", "eval/loss")  # shown when the spec names no report metric


@dataclass(frozen=True)
class TrialRow:
    """One line of the sweep's live and final tables."""

    name: str
    status: str  # finished, failed, interrupted, running, waiting, running elsewhere, diverged, not started
    round_idx: int | None  # last round logged
    rounds: int
    metric: float | None  # latest value of the table's metric
    elapsed_s: float | None  # of this sweep's process; None for trials it did not run
    run_id: str | None
    note: str = ""


def trial_rows(
    store: Any,
    experiment: str,
    plans: Sequence[Plan],
    processes: Sequence[TrialProcess],
    metric_keys: Sequence[str],
    stopped: bool = False,
) -> tuple[list[TrialRow], str]:
    """Rows of every planned trial, rounds and metric read from the store; and the metric key shown."""
    records = experiment_runs(store, experiment)
    for started in processes:
        if started.run_id is None:  # a new run its worker did not name yet: the only run of its config hash
            started.run_id = getattr(run_of(started.plan.trial, records), "id", None)
    by_plan = {id(p.plan): p for p in processes}
    elsewhere = {
        id(p): run_of(p.trial, records) for p in plans if p.action == ELSEWHERE and id(p) not in by_plan
    }
    ids = [
        i
        for i in (
            by_plan[id(p)].run_id
            if id(p) in by_plan
            else getattr(elsewhere.get(id(p)), "id", None) or p.run_id
            for p in plans
        )
        if i
    ]
    frame = store.metrics_frame(ids, keys=list(metric_keys)) if ids else None
    key = next((k for k in metric_keys if frame is not None and (frame["key"] == k).any()), metric_keys[0])
    latest = {} if frame is None else frame[frame["key"] == key].groupby("run_id")["value"].last().to_dict()
    rows = []
    for plan in plans:
        process = by_plan.get(id(plan))
        run_id = process.run_id if process else plan.run_id
        status, note = _row_status(plan, process, stopped)
        other = elsewhere.get(id(plan))
        if other is not None:  # the run another process trains for this trial: how it stands now
            run_id = other.id
            status = ELSEWHERE if other.is_alive else f"{other.status} elsewhere"
        rows.append(
            TrialRow(
                plan.trial.name,
                status,
                store.last_round(run_id) if run_id else None,
                plan.trial.config.train.rounds,
                latest.get(run_id),
                None if process is None else process.elapsed_s,
                run_id,
                note,
            )
        )
    return rows, key


def experiment_runs(store: Any, experiment: str) -> list[RunRecord]:
    """The experiment's runs, oldest first; none for an experiment the store does not know yet."""
    try:
        return list(store.list_runs(experiment=experiment))
    except ConfigError:  # unknown experiment: a new sweep
        return []


def _row_status(plan: Plan, process: TrialProcess | None, stopped: bool) -> tuple[str, str]:
    if process is not None:
        status = process.status
        return status, process.last_error() if status in ("failed", "interrupted") else (
            "resumed" if plan.action == RESUME else ""
        )
    if plan.action in (NEW, RESUME):
        return ("not started" if stopped else "waiting"), ("to resume" if plan.action == RESUME else "")
    return {SKIP: "finished (skip)", ELSEWHERE: ELSEWHERE, DIVERGED: "diverged (skip)"}[
        plan.action
    ], plan.note


# --------------------------------------------------------------------------- the MLflow parent run


SWEEP_TAG, SPEC_HASH_TAG = "fedcli.sweep", "fedcli.sweep_spec_hash"


def parent_tags(spec: Mapping[str, Any]) -> dict[str, str]:
    """The tags that find the sweep's MLflow parent run (the sweep's name and its spec's hash).

    The sweep's MLflow mirror (tracking/mlflow/sweep_mirror.py `parent_run`) opens the experiment's run
    carrying these tags, else a new one with them: a rerun of the same spec reuses its parent run.
    """
    return {SWEEP_TAG: spec["experiment"], SPEC_HASH_TAG: spec_hash(spec)}
