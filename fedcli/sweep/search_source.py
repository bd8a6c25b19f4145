"""`SearchSource`: a search's trials, asked of its Optuna study, as the sweep's trial source (docs/sweeps.md,
"How a search runs").

The sweep's `Scheduler` consumes it: `ask()` the next trial as a `Plan` (a complete fedcli run: own id,
config hash, claim), `tell(plan, outcome)` its end, `hook(plan)` the pruning hook's spec. The study
lives in the store's own SQL database (Optuna's RDBStorage on the store URL, study
`fedcli:<experiment>`), so a search resumes after a kill (a trial left RUNNING by a dead sweep is
adopted: its run resumed, or started) and several sweep processes share one study (each trial claimed
in the store before it runs). The study's set-up, the space and the pruning hook are in
fedcli/sweep/search.py.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any, Literal

from fedcli.errors import ConfigError
from fedcli.sweep.plan import DIVERGED, NEW, RESUME, SKIP, Plan, hash_of, plan_trials, run_of
from fedcli.sweep.search import (
    make_pruner,
    make_sampler,
    search_metric,
    storage,
    study_name,
    suggest_params,
    trial_of,
    unnamed_code,
)
from fedcli.sweep.spec import Trial
from fedcli.sweep.spec_keys import budget
from fedcli.tracking.urls import connect_url

TRIAL_TAG, STUDY_TAG = "fedcli.search_trial", "fedcli.search_study"
POLL_S = 1.0  # how often a source with nothing to hand out looks at the study again
ORPHAN_S = 60.0  # a RUNNING Optuna trial with no fedcli config this old was asked by a sweep that died


class SearchSource:
    """The trials of a `search:` sweep, asked of an Optuna study in the store's database.

    `ask()` first adopts a trial a dead sweep left RUNNING (its run is resumed, or started), then asks
    the study for a new one while the budget (`search.trials`) lasts; a sampled config that a run
    already holds (the same config hash) is told that run's result at once, without training.
    `tell(plan, outcome)` records a finished (its final `metric`), pruned or failed trial; an
    interrupted one stays RUNNING for the next sweep. `hook(plan)` is the pruning hook's spec.
    """

    def __init__(
        self, spec: Mapping[str, Any], tracking: Mapping[str, Any], db: Any, *, create: bool = True
    ) -> None:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.spec, self.search, self.tracking, self.db = spec, spec["search"], dict(tracking), db
        self.metric = search_metric(self.search, spec)
        self.maximize = self.search.get("direction", "max") == "max"
        self.budget = budget(self.search)
        self.experiment = spec["experiment"]
        self.storage = storage(connect_url(db))
        name = study_name(self.experiment)
        direction: Literal["maximize", "minimize"] = "maximize" if self.maximize else "minimize"
        try:
            existing = optuna.load_study(study_name=name, storage=self.storage)
        except KeyError:
            existing = None
        if existing is not None and existing.direction.name.lower() != direction:
            raise ConfigError(
                f"study {name} was started with direction {existing.direction.name.lower()[:3]}; "
                f"got search.direction {self.search.get('direction', 'max')}. Keep the direction, or "
                "use a new experiment name."
            )
        self.seed = self.search.get("seed", 0)
        self.study = optuna.create_study(
            study_name=name,
            storage=self.storage,
            direction=direction,
            sampler=make_sampler(self.search, self.seed),
            pruner=make_pruner(spec.get("pruner")),
            load_if_exists=True,
        )
        self.study.set_user_attr("fedcli.metric", self.metric)
        self.in_flight: dict[str, int] = {}  # config hash -> Optuna trial number, trials this process runs
        self._ids: dict[int, int] = {}  # trial number -> trial id
        self._exhausted: tuple[float, bool] | None = None  # (when read, the answer)
        self.adopted: set[int] = set()  # trial numbers adopted from a dead sweep (not asked here)
        from fedcli.tracking.store.common import HOSTNAME

        self._owner = f"{HOSTNAME}:{os.getpid()}"  # user attribute fedcli.owner: who runs a RUNNING trial
        self._idle_until = 0.0  # after an ask that found nothing: the next look at the study

    # ------------------------------------------------------------------ the study's state
    def _trials(self) -> list[Any]:
        return self.study.get_trials(deepcopy=False)

    def used(self) -> int:
        """Trials that count against the budget: all but those a duplicate or an overrun ended, and those
        enqueued by hand (`study.enqueue_trial`, WAITING) which the next asks take first."""
        import optuna

        return sum(
            1
            for t in self._trials()
            if "fedcli.void" not in t.user_attrs and t.state != optuna.trial.TrialState.WAITING
        )

    @property
    def exhausted(self) -> bool:
        """True once the budget is spent and no dead sweep's trial is left to adopt (read at most once a
        second: the scheduler asks every step)."""
        now = time.monotonic()
        if self._exhausted is None or now - self._exhausted[0] >= POLL_S:
            self._exhausted = (now, self.used() >= self.budget and not self._orphans())
        return self._exhausted[1]

    def _orphans(self) -> list[Any]:
        """RUNNING trials with a config that no live process runs (their sweep died): adopt them."""
        import optuna

        running = [
            t
            for t in self._trials()
            if t.state == optuna.trial.TrialState.RUNNING and t.number not in self.in_flight.values()
        ]
        if not running:
            return []
        from fedcli.tracking.store.common import HOSTNAME
        from fedcli.tracking.store.liveness import pid_alive

        claims = self.db.live_claims(self.experiment)
        alive = {hash_of(r) for r in self._runs() if r.is_alive}
        out = []
        for t in running:
            key, owner = t.user_attrs.get("fedcli.config_hash"), str(t.user_attrs.get("fedcli.owner", ":"))
            old = t.datetime_start is not None and time.time() - t.datetime_start.timestamp() > ORPHAN_S
            host, _, pid = owner.rpartition(":")
            if key is None:
                if old:
                    self._void(t.number, "asked by a sweep that ended before it built the trial")
                continue
            if key in claims or key in alive:
                continue
            # the sweep that asked (or adopted) it: on this host, gone; elsewhere, no claim nor run for ORPHAN_S
            if not pid_alive(int(pid)) if host == HOSTNAME and pid.isdigit() else old:
                out.append(t)
        return out

    def _runs(self) -> list[Any]:
        from fedcli.sweep.rows import experiment_runs

        return experiment_runs(self.db, self.experiment)

    def _set_attr(self, number: int, key: str, value: Any) -> bool:
        """Set a user attribute of a trial; False when it ended meanwhile (another sweep told it)."""
        import optuna

        try:
            self.study._storage.set_trial_user_attr(self._trial_id(number), key, value)
        except optuna.exceptions.UpdateFinishedTrialError:
            return False
        return True

    def _void(self, number: int, why: str) -> None:
        import optuna

        if self._set_attr(number, "fedcli.void", why):
            self.study.tell(number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)

    def _trial_id(self, number: int) -> int:
        if number not in self._ids:
            self._ids[number] = self.study._storage.get_trial_id_from_study_id_trial_number(
                self.study._study_id, number
            )
        return self._ids[number]

    # ------------------------------------------------------------------ the trial source
    def ask(self) -> Plan | None:
        """The next trial to run now, or None (budget spent, or only trials other sweeps run)."""
        if time.monotonic() < self._idle_until:
            return None
        plan = self._ask()
        self._idle_until = 0.0 if plan is not None else time.monotonic() + POLL_S
        return plan

    def _ask(self) -> Plan | None:
        for orphan in self._orphans():
            unnamed = unnamed_code(self.spec, orphan.params)
            if (
                unnamed is not None
            ):  # a trial the spec could not have asked: its code is not the user's to run
                logging.getLogger(__name__).warning(
                    "trial #%d of study %s is not adopted: its parameter %s names code the sweep's spec does not "
                    "name (datasets/yours/trust.py)",
                    orphan.number,
                    study_name(self.experiment),
                    unnamed,
                )
                self._void(
                    orphan.number, f"its parameter {unnamed} names code the sweep's spec does not name"
                )
                continue
            self._set_attr(orphan.number, "fedcli.owner", self._owner)
            plan = self._plan(trial_of(self.spec, orphan.params, orphan.number, self.tracking), orphan.number)
            if plan is not None:
                self.adopted.add(orphan.number)
                return plan
        self._drop_lost()
        while self.used() < self.budget:
            # the sampler's seed for this draw: the search's seed and the trials so far, so one process drawing from
            # start to end is reproducible, and a rerun or a second sweep process does not repeat earlier draws
            self.study.sampler = make_sampler(
                self.search, (self.seed * 1_000_003 + len(self._trials()) * 7919) % 2**31
            )
            trial = self.study.ask()
            if trial.number >= self.budget + 1000:  # a space whose every config runs now: try again later
                self._void(trial.number, "over budget")
                return None
            if self.used() > self.budget:  # another sweep asked the last trial at the same time
                self._void(trial.number, "over budget (asked together with another sweep)")
                return None
            params = suggest_params(trial, self.search["space"])
            unnamed = unnamed_code(
                self.spec, params
            )  # a trial enqueued by hand may fix a value outside the space
            if unnamed is not None:
                self._void(trial.number, f"its parameter {unnamed} names code the sweep's spec does not name")
                continue
            built = trial_of(self.spec, params, trial.number, self.tracking)
            trial.set_user_attr("fedcli.owner", self._owner)
            trial.set_user_attr("fedcli.config_hash", built.config.config_hash)
            trial.set_user_attr("fedcli.run_name", built.name)
            plan = self._plan(built, trial.number)
            if plan is not None:
                return plan
        return None

    def _drop_lost(self) -> None:
        """Trials this process asked whose config another sweep process claimed first (the scheduler then
        planned them "running elsewhere"): not ours to end; voided, that process runs the config."""
        from fedcli.tracking.store.common import HOSTNAME

        claims = self.db.live_claims(self.experiment)
        for key, number in list(self.in_flight.items()):
            claim = claims.get(key)
            if claim is not None and (claim.host, claim.pid) != (HOSTNAME, os.getpid()):
                del self.in_flight[key]
                if (
                    number in self.adopted
                ):  # another sweep adopted the same dead sweep's trial first: its trial now
                    self.adopted.discard(number)
                else:  # a config this process drew that another process runs as its own trial
                    self._void(number, f"its config was {claim}")

    def _plan(self, trial: Trial, number: int) -> Plan | None:
        """Plan an asked or adopted trial against the store's runs; a config already run is told its result."""
        if self.in_flight.get(trial.config.config_hash, number) != number:  # the same config runs here now
            self._void(number, f"its config runs now as trial #{self.in_flight[trial.config.config_hash]}")
            return None
        plan = plan_trials([trial], self._runs())[0]
        if plan.action == NEW and trial.config.config_hash in self.db.live_claims(self.experiment):
            self._void(number, "its config is claimed by another sweep process")  # about to run there
            return None
        if plan.action in (NEW, RESUME):
            self.in_flight[trial.config.config_hash] = number
            self._ids.setdefault(number, self._trial_id(number))
            return plan
        if plan.action in (SKIP, DIVERGED) and plan.run_id is not None:
            # the same config ran before: its result, no training (one that diverged diverges again: a failure)
            status = self.db.get_run(plan.run_id).status if plan.action == SKIP else "failed"
            self._tell_run(number, status, plan.run_id)
            return None
        self._void(number, f"duplicate of a trial {plan.action} ({plan.note})")  # running now: not counted
        return None

    def hook(self, plan: Plan) -> dict[str, Any] | None:
        """The pruning hook's spec for `make_on_eval` (holds the store URL: keep it in memory and pipes)."""
        number = self.in_flight.get(plan.trial.config.config_hash)
        if number is None:
            return None
        return {
            "storage": connect_url(self.db),
            "study": study_name(self.experiment),
            "trial_id": self._trial_id(number),
            "number": number,
            "metric": self.metric,
            "pruner": dict(self.spec.get("pruner") or {}),
        }

    def tell(self, plan: Plan, outcome: Any) -> None:
        """A trial ended: finished -> its final metric, pruned -> PRUNED, failed -> FAIL; interrupted or
        run elsewhere: left RUNNING (the next sweep, or the one that runs it, ends it)."""
        self._idle_until, self._exhausted = 0.0, None  # a slot is free: look at the study again now
        number = self.in_flight.pop(plan.trial.config.config_hash, None)
        status, run_id = getattr(outcome, "status", None), getattr(outcome, "run_id", None)
        if number is None or status not in ("finished", "pruned", "failed"):
            return
        # a trial that ended before the scheduler learnt its run: the store knows it
        if run_id is None and (last := run_of(plan.trial, self._runs())) is not None:
            run_id, status = last.id, last.status
        if run_id is not None:
            self._tell_run(number, status, run_id)
        else:
            self._void(number, getattr(outcome, "reason", "") or "failed before its run started")

    def _tell_run(self, number: int, status: str, run_id: str) -> None:
        import optuna

        if not self._set_attr(number, "fedcli.run_id", run_id):
            return  # told already (by the sweep that ran it)
        self.db.set_tags(run_id, {STUDY_TAG: study_name(self.experiment), TRIAL_TAG: str(number)})
        if status == "pruned":
            self.study.tell(number, state=optuna.trial.TrialState.PRUNED, skip_if_finished=True)
            return
        value = final_value(self.db, run_id, self.metric) if status == "finished" else None
        if value is None:
            self.study.tell(number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
        else:
            self.study.tell(number, value, skip_if_finished=True)


def final_value(db: Any, run_id: str, metric: str) -> float | None:
    """The run's `metric` at its last logged round (None when it never logged it)."""
    frame = db.metrics_frame([run_id], [metric])
    if frame.empty:
        return None
    return float(frame.sort_values("round_idx")["value"].iloc[-1])
