"""A sweep's trials: claims in the store, the `Scheduler` both backends share (it starts the trials and stops them).

Part of fedcli.sweep; fedcli/sweep/__init__.py describes how a sweep owns its trials and the
package's layout.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from fedcli.tracking.store.records import Claim

from fedcli.sweep.plan import ELSEWHERE, NEW, RESUME, Plan

# --------------------------------------------------------------------------- the trial processes


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
KILL_AFTER_S = 180.0  # a stopped trial still running this long after SIGTERM is killed (it reads interrupted)


@dataclass
class TrialProcess:
    """A started (or ended) trial, as the live table and the result rows read it: its plan, its run and
    how it ended. Each backend's kind adds what runs it (fedcli.sweep.worker_pool.WorkerTrial: its sweep
    worker; fedcli.sweep.ray_runner.RayTrial: its Ray actor and call)."""

    plan: Plan
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    run_id: str | None = None
    stopped: bool = False  # ended by the sweep's stop
    outcome: TrialOutcome | None = None  # set when it ended (`Scheduler._end`)

    @property
    def elapsed_s(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    @property
    def status(self) -> str:
        return "running" if self.outcome is None else self.outcome.status

    def last_error(self) -> str:
        """Why the trial ended (its outcome's reason), else its status."""
        return self.outcome.reason if self.outcome is not None and self.outcome.reason else self.status


@dataclass(frozen=True)
class TrialOutcome:
    """How a trial ended, as a `TrialSource` is told (docs/sweeps.md, "The trial source").

    `status`: finished, failed, interrupted or pruned; `round`: its last completed round (pruned:
    the round it was pruned at), None when unknown; `metrics`: the run's final metrics (empty
    when it did not finish).
    """

    status: str
    run_id: str | None
    reason: str = ""
    round: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)


class TrialSource(Protocol):
    """Where a scheduler takes its trials from when not from the grid plan (a `search:` block)."""

    @property
    def exhausted(self) -> bool:
        """True once `ask` will never return another trial."""

    def ask(self) -> Plan | None:
        """The next trial to start now (action NEW or RESUME), or None when none is ready yet."""

    def tell(self, plan: Plan, outcome: TrialOutcome) -> None:
        """A trial this scheduler started has ended (once per trial, from the sweep's main thread)."""

    def hook(self, plan: Plan) -> dict[str, Any] | None:
        """The JSON-able spec of the trial's per-round pruning hook (sweep workers), or None."""


class TrialClaims:
    """A sweep's claims on its trials in the store: one process runs each trial at a time.

    `take` claims a trial right before it starts (`SqlStore.claim_trial`, atomic); `release`
    gives it back when the trial's process has ended; `refresh` renews the claims' heartbeat
    every `HEARTBEAT_S` (what tells a sweep on another host that this one is alive). Both
    backends use it through `Scheduler`: the claims are the sweep process's, wherever the
    trial runs.
    """

    def __init__(self, store: Any, experiment: str) -> None:
        self.store, self.experiment = store, experiment
        self.held: set[str] = set()  # config hashes this sweep holds
        self._refreshed = time.monotonic()

    def take(self, plan: Plan) -> Claim | None:
        """Claim the trial: None when it is this sweep's now, else the live claim of another process."""
        key = plan.trial.config.config_hash
        other = self.store.claim_trial(self.experiment, key)
        if other is None:
            self.held.add(key)
        return other

    def release(self, plan: Plan) -> None:
        """Give the trial back (its process ended, or it needs no run); a no-op when not held."""
        key = plan.trial.config.config_hash
        if key in self.held:
            self.held.discard(key)
            self.store.release_trial(self.experiment, key)

    def refresh(self) -> None:
        """Renew this sweep's claims every HEARTBEAT_S seconds (cheap to call often)."""
        from fedcli.tracking.store.common import HEARTBEAT_S, stale_s

        if self.held and time.monotonic() - self._refreshed >= min(HEARTBEAT_S, stale_s() / 4):
            self._refreshed = time.monotonic()
            self.store.refresh_claims(self.experiment)

    def release_all(self) -> None:
        for key in sorted(self.held):
            self.store.release_trial(self.experiment, key)
        self.held.clear()


class TrialRunner(Protocol):
    """What `fedcli sweep`'s driver (fedcli/cli/sweep_run.py `run_plans`) uses of whatever runs its trials:
    the local `WorkerScheduler` (fedcli/sweep/worker_pool.py) or a Ray cluster's `RayScheduler`
    (fedcli/sweep/ray_runner.py), both `Scheduler`s. tests/test_layering.py checks both against it."""

    @property
    def plans(self) -> list[Plan]:
        """Every trial's plan, as planned or asked, each replaced by its recheck when its turn came."""

    @property
    def processes(self) -> Sequence[Any]:
        """The trials started (running or ended), as the live table and the result rows read them."""

    @property
    def signum(self) -> int | None:
        """The stop signal that arrived, else None."""

    def run(self, tick: Callable[[list[TrialProcess]], None], tick_s: float = 1.0) -> int | None:
        """Run the trials, calling `tick(processes)` as they change; return the stop signal, else None."""

    def cleanup(self) -> None:
        """End what is left of the trials' processes and give back their claims and temporary files."""


class Scheduler:
    """Run planned trials, at most `workers` at once, from this (main) thread; each backend's subclass
    starts them (`start`), notes their ends (`_reap`, then `_end`) and stops them (`_ask_stop`, `_kill`).

    `run(tick)` calls `tick(processes)` about every `tick_s` seconds and after each start
    and exit. A stop signal asks the running trials to stop (once; each then checkpoints its
    last round and reads `interrupted`), starts nothing new and returns the signal number once
    every trial has ended. With `claims`, each trial is claimed
    before it starts (then `recheck`ed) and released when its process ends; a trial another
    live sweep claimed is planned ELSEWHERE and not started. With `source` (a `TrialSource`),
    the trials come from its `ask` instead of the plans, and each ended one is `tell`-ed back.
    `threads`: each trial's intra-op threads (train.threads unless its config sets it), recorded
    in its resolved config; None leaves it to `fedcli train` (all the process's cores).
    `mirror`: the sweep's MLflow mirror (tracking/mlflow/sweep_mirror.py `SweepMirror`): each ended
    trial's run is handed to it; None with --no-mlflow.
    """

    plans: list[Plan]  # what a `TrialRunner` reads (set in __init__)
    processes: list[TrialProcess]
    signum: int | None
    kill_after_s = KILL_AFTER_S  # a stop's wait before the trials still running are killed

    def __init__(
        self,
        plans: Sequence[Plan],
        *,
        workers: int,
        cores: int,
        recheck: Callable[[Plan], Plan] | None = None,
        claims: TrialClaims | None = None,
        source: TrialSource | None = None,
        threads: int | None = None,
        mirror: Any = None,
    ) -> None:
        self.plans = list(plans)  # as planned, each replaced by its recheck when its turn comes
        self.pending = [p for p in plans if p.action in (NEW, RESUME)]
        self.source, self.threads, self.mirror = source, threads, mirror
        self.recheck = (
            recheck  # plans a trial again right before it starts (another process may have taken it)
        )
        self.claims = claims
        self.workers, self.cores = workers, cores
        self.processes = []
        self.signum = None
        self._forwarded_at: float | None = None
        self._killed = False
        self._tmp = Path(tempfile.mkdtemp(prefix="fedcli-sweep-"))

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.signum = self.signum or signum

    def start(self, plan: Plan) -> TrialProcess:
        """Start the trial (each backend's own)."""
        raise NotImplementedError

    def run(self, tick: Callable[[list[TrialProcess]], None], tick_s: float = 1.0) -> int | None:
        in_main = threading.current_thread() is threading.main_thread()  # only it may set handlers
        previous = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS} if in_main else {}
        try:
            last_tick = 0.0
            # after a stop, pending trials never start: wait for the running ones only (before: a
            # stop with trials still waiting looped forever, printing "sweep: 1/2 done; 1 waiting")
            while self.running or (self._more() and self.signum is None):
                changed = self._step()
                if changed or time.monotonic() - last_tick >= tick_s:
                    tick(self.processes)
                    last_tick = time.monotonic()
                time.sleep(0.1)
            tick(self.processes)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return self.signum

    @property
    def running(self) -> list[TrialProcess]:
        return [p for p in self.processes if p.ended is None]

    def _step(self) -> bool:
        """Reap exited trials, forward a stop, start pending trials; True when something changed."""
        changed = self._reap()
        if self.claims is not None:
            for process in self.processes:
                if process.ended is not None:
                    self.claims.release(process.plan)
            self.claims.refresh()
        if self.signum is not None:
            self._stop()
            return changed
        while self._more() and len(self.running) < self.workers:
            plan = self._next()
            if plan is None:  # the source has none ready now
                break
            fresh = self._take(plan)
            self.plans[self.plans.index(plan)] = plan = fresh
            if plan.action in (NEW, RESUME):
                self.start(plan)
            changed = True
        return changed

    def _more(self) -> bool:
        """True while trials are left to start."""
        return bool(self.pending) if self.source is None else not self.source.exhausted

    def _next(self) -> Plan | None:
        if self.source is None:
            return self.pending.pop(0)
        plan = self.source.ask()
        if plan is not None:
            self.plans.append(plan)
        return plan

    def _end(self, trial: TrialProcess, outcome: TrialOutcome) -> None:
        """The trial ended: the source is told, its run goes to the sweep's MLflow mirror."""
        trial.outcome, trial.ended = outcome, time.monotonic()
        if self.source is not None:
            self.source.tell(trial.plan, outcome)
        if self.mirror is not None and trial.run_id is not None:
            self.mirror.add(trial.run_id)

    def _take(self, plan: Plan) -> Plan:
        """The trial's plan right before it starts: claimed first (claims), then planned again
        against the store (recheck), so a trial that another process took meanwhile is not
        started twice; a trial that needs no run gives its claim back."""
        if self.claims is not None:
            other = self.claims.take(plan)
            if other is not None:
                return Plan(plan.trial, ELSEWHERE, None, str(other))
        fresh = self.recheck(plan) if self.recheck is not None else plan
        if self.claims is not None and fresh.action not in (NEW, RESUME):
            self.claims.release(fresh)
        return fresh

    def _reap(self) -> bool:
        """Note the trials that ended since the last step (`_end`); True when one did (each backend's own)."""
        return False

    def _stop(self) -> None:
        """Ask the running trials to stop once (a second signal while a trial checkpoints would cut its
        checkpoint short); kill those still running `kill_after_s` later."""
        if self._forwarded_at is None:
            self._forwarded_at = time.monotonic()
            for trial in self.running:
                trial.stopped = True
                self._ask_stop(trial)
        elif time.monotonic() - self._forwarded_at > self.kill_after_s and not self._killed:
            self._killed = True
            for trial in self.running:
                self._kill(trial)

    def _ask_stop(self, trial: TrialProcess) -> None:
        """Ask a running trial to stop in order (each backend's own)."""

    def _kill(self, trial: TrialProcess) -> None:
        """End a trial that did not stop in time (each backend's own)."""

    def cleanup(self) -> None:
        """Give back the claims still held; remove the sweep's temporary files (its workers' stderr)."""
        import shutil

        if self.claims is not None:
            from fedcli.errors import TrackingError

            try:
                self.claims.release_all()
            except TrackingError as err:  # the claims are dead-owner claims once this process exits
                import logging

                logging.getLogger(__name__).warning("could not release the sweep's trial claims: %s", err)
        shutil.rmtree(self._tmp, ignore_errors=True)


def in_terminal_foreground() -> bool:
    """True when this process's group is the foreground group of its controlling terminal."""
    try:
        with open("/dev/tty", "rb", buffering=0) as tty:
            return os.tcgetpgrp(tty.fileno()) == os.getpgrp()
    except OSError:
        return False
