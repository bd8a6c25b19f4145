"""What a sweep does with each trial (`Plan`: new, resume, skip, running elsewhere, diverged) and the config and environment that run it.

Part of fedcli.sweep; fedcli/sweep/__init__.py describes how a sweep owns its trials and the
package's layout.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import yaml

from fedcli.tracking.urls import has_password

if TYPE_CHECKING:
    from fedcli.tracking.store.records import RunRecord

from fedcli.sweep.spec import Trial

# --------------------------------------------------------------------------- what each trial needs


NEW, RESUME, SKIP, ELSEWHERE, DIVERGED = "new", "resume", "skip", "running elsewhere", "diverged"


@dataclass(frozen=True)
class Plan:
    """What a sweep does with one trial: `action` is NEW, RESUME (run `run_id`), SKIP, ELSEWHERE or DIVERGED."""

    trial: Trial
    action: str
    run_id: str | None = None
    note: str = ""  # e.g. "interrupted: stopped by SIGTERM during round 4"


def plan_trials(trials: Sequence[Trial], records: Sequence[RunRecord]) -> list[Plan]:
    """Match each trial to the runs of its config hash (`records`: the experiment's runs, oldest first).

    A live run wins (never train a config twice at once), then a finished one, then the
    newest interrupted or failed run, which is resumed; a run that diverged is not retried
    (the same config and seed diverge again at the same round).
    """
    by_hash: dict[str, list[RunRecord]] = {}
    for record in records:
        by_hash.setdefault(hash_of(record), []).append(record)
    plans = []
    for trial in trials:
        runs = by_hash.get(trial.config.config_hash, [])
        alive = [r for r in runs if r.is_alive]
        done = [r for r in runs if r.status in ("finished", "pruned")]  # pruned: a search's pruner stopped it
        if alive:
            plans.append(Plan(trial, ELSEWHERE, alive[-1].id, f"pid {alive[-1].pid} on {alive[-1].host}"))
        elif done:
            plans.append(Plan(trial, SKIP, done[-1].id, f"{done[-1].status} before"))
        elif runs and runs[-1].diverged_at_round is not None:
            plans.append(
                Plan(trial, DIVERGED, runs[-1].id, f"diverged at round {runs[-1].diverged_at_round}")
            )
        elif runs:
            last = runs[-1]
            plans.append(
                Plan(trial, RESUME, last.id, f"{last.status}: {last.failure_reason or 'no reason stored'}")
            )
        else:
            plans.append(Plan(trial, NEW))
    return plans


def hash_of(record: RunRecord) -> str:
    """The config hash a run trains: its tag fedcli.config_hash, else its row's."""
    return record.tags.get("fedcli.config_hash") or record.config_hash


def run_of(trial: Trial, records: Sequence[RunRecord]) -> RunRecord | None:
    """The newest run of the trial's config hash among `records` (oldest first), if any."""
    same = [r for r in records if hash_of(r) == trial.config.config_hash]
    return same[-1] if same else None


SETTLE_S = 5.0  # how long a sweep waits for runs alive elsewhere to end before it plans them as running


def plan_settled(
    trials: Sequence[Trial], read_runs: Callable[[], list[RunRecord]], settle_s: float = SETTLE_S
) -> list[Plan]:
    """`plan_trials`, giving runs alive in another process up to `settle_s` seconds to end first.

    A sweep killed a moment ago leaves its trials a second or two to checkpoint and read
    `interrupted`; a rerun started right away should resume them, not skip them as running.
    """
    deadline = time.monotonic() + settle_s
    while True:
        plans = plan_trials(trials, read_runs())
        if time.monotonic() >= deadline or not any(p.action == ELSEWHERE for p in plans):
            return plans
        time.sleep(0.5)


def trial_config_text(plan: Plan, cores: int, threads: int | None = None) -> str:
    """The YAML config of a new trial, as `fedcli train --config` reads it."""
    body = plan.trial.config.to_dict()
    if plan.trial.config.recommended:  # which values were recommended: the trial's tag fedcli.recommended
        body["recommended"] = dict(plan.trial.config.recommended)
    body["train"]["workers"] = plan.trial.config.train.workers or cores
    if threads is not None:
        body["train"]["threads"] = plan.trial.config.train.threads or threads
    return yaml.safe_dump(body, sort_keys=True)


def trial_env(track: Any) -> dict[str, str] | None:
    """The environment of a trial process: this one's, plus FEDCLI_STORE / MLFLOW_TRACKING_URI where the
    sweep's URLs carry a password, which the trial's config holds masked
    (docs/operations.md, "Security"); None (inherit) when neither does."""
    extra = trial_secrets(track)
    return {**os.environ, **extra} if extra else None


def trial_secrets(track: Any) -> dict[str, str]:
    """FEDCLI_STORE / MLFLOW_TRACKING_URI for the sweep's URLs that carry a password (what `trial_env` adds)."""
    return {
        name: url
        for name, url in (("FEDCLI_STORE", track.store_url), ("MLFLOW_TRACKING_URI", track.mlflow_uri))
        if has_password(url)
    }
