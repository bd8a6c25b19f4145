"""The sweep's side of its long-lived workers (`WorkerScheduler`): trials at the cost of their training.

`fedcli sweep` (local backend) starts at most `--workers` worker processes
(`python -m fedcli.sweep.worker`, fedcli/sweep/worker.py, which describes the protocol) and
hands each its trials one at a time; a worker lives for the whole sweep. Everything else is
the `Scheduler`'s (fedcli/sweep/scheduler.py): claims, rechecks, the trial source, stop
signals, the live table.

- A worker is started like a trial process was: from the sweep's main thread, in its process
  group, with PR_SET_PDEATHSIG=SIGTERM and the environment of `trial_env` (URLs with a password
  travel there, never on a command line); its messages (fedcli.children `Channel`) are read by one thread per worker.
- A trial that raises is marked failed by the engine and reported; the worker goes on. A worker
  that dies (SIGKILL, out of memory, a crash in C) costs the trial it ran: the trial reads
  `failed` with how the worker ended (its run reads `interrupted` in the store and a rerun
  resumes it), the next trial gets a new worker, and the sweep goes on.
- A stop signal is forwarded to the busy workers as SIGTERM once (their trials checkpoint
  and read `interrupted`), idle workers are ended, nothing new starts.
- Each ended trial's run goes to the sweep's one MLflow mirror (`SweepMirror`,
  tracking/mlflow/sweep_mirror.py), which copies it in the background: no trial waits for MLflow.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedcli import children
from fedcli.sweep.plan import RESUME, Plan, trial_config_text, trial_env, trial_secrets
from fedcli.sweep.process import KIND as EARLY_KIND
from fedcli.sweep.scheduler import (
    KILL_AFTER_S,
    Scheduler,
    TrialOutcome,
    in_terminal_foreground,
    with_suppressed_lookup,
)

END_WAIT_S = 10.0  # how long the sweep's end waits for an idle worker to exit after its stdin closed


class SweepWorker:
    """One worker process and the events it printed (a reader thread fills `events`)."""

    def __init__(
        self, env: dict[str, str] | None, stderr: Path, proc: subprocess.Popen[bytes] | None = None
    ) -> None:
        if proc is None:
            with open(stderr, "wb") as err:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "fedcli.sweep.worker"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    preexec_fn=children.die_with_parent(os.getpid()),
                    env=env,
                )
        self.proc = proc  # one started early (fedcli.sweep.process.spawn_early), whose stderr is `stderr`
        self.stderr = stderr
        self.channel = children.Channel(self.proc)  # framed messages over its stdin and stdout
        self.trial: WorkerTrial | None = None
        self.events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.reader = threading.Thread(target=self._read, name=f"sweep-worker-{self.proc.pid}", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while (event := self.channel.receive()) is not None:
            self.events.put(event)
        self.events.put(None)  # end of its output: it exited

    def send(self, message: dict[str, Any]) -> bool:
        """Hand the worker a trial; False when it is gone."""
        return self.channel.send(message)

    def close(self) -> None:
        """Its stdin closed: an idle worker exits."""
        self.channel.close()

    def death(self) -> str:
        """How the ended worker process ended, with its last stderr line."""
        reason = children.own_line(self.stderr.read_text(errors="replace")) if self.stderr.exists() else None
        return children.death(self.proc.returncode, reason[:300] if reason else None)


@dataclass
class WorkerTrial:
    """A trial a worker runs (the attributes of `TrialProcess` that the live table and the rows read)."""

    plan: Plan
    worker: SweepWorker
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None
    run_id: str | None = None
    stopped: bool = False
    outcome: TrialOutcome | None = None

    @property
    def elapsed_s(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    @property
    def status(self) -> str:
        return "running" if self.outcome is None else self.outcome.status

    def last_error(self) -> str:
        return self.outcome.reason if self.outcome is not None and self.outcome.reason else self.status

    def locate(self, records: Sequence[Any]) -> str | None:
        return self.run_id  # the worker said which run it trains


def trial_message(plan: Plan, cores: int, threads: int | None, hook: dict[str, Any] | None) -> dict[str, Any]:
    """What a worker needs to run the trial as `fedcli train --config | --resume` would (fedcli/sweep/worker.py).

    `cores`, `threads`: the trial's train.workers and train.threads unless its config sets them.
    """
    from fedcli.datasets.yours.trust import recorded_code

    cfg = plan.trial.config
    if plan.action == RESUME:
        track = cfg.tracking
        overrides = {
            "train.workers": cfg.train.workers or cores,
            "train.threads": cfg.train.threads or threads,
            "tracking.root": track.root,
            "tracking.store": track.store,
            "tracking.tracking_uri": track.tracking_uri,
            "tracking.use_mlflow": None if track.use_mlflow else False,
        }
        # the user code the spec names, named again: the resumed run's recorded code runs only if it is the same
        overrides.update(
            {
                "data.model" if code.what == "model" else "data.file": code.ref
                for code in recorded_code({"model": cfg.data.model, "file": cfg.data.file})
            }
        )
        return {"resume": plan.run_id, "overrides": overrides, "hook": hook}
    return {"config": trial_config_text(plan, cores, threads), "run_name": plan.trial.name, "hook": hook}


class WorkerScheduler(Scheduler):
    """`Scheduler` whose trials run in long-lived worker processes (`SweepWorker`), at most `workers` at once.

    `mirror`: the sweep's MLflow mirror (tracking/mlflow/sweep_mirror.py `SweepMirror`): each ended
    trial's run is handed to it; None with --no-mlflow.
    """

    def __init__(self, plans: Sequence[Plan], *, mirror: Any = None, **kwargs: Any) -> None:
        super().__init__(plans, **kwargs)
        self.mirror = mirror
        self.pool: list[SweepWorker] = []
        self._env: dict[str, str] | None = None
        self._spawned = 0

    @property
    def running(self) -> list[WorkerTrial]:  # type: ignore[override]
        return [p for p in self.processes if p.outcome is None]  # type: ignore[attr-defined, misc]

    def _worker(self, plan: Plan) -> SweepWorker:
        """An idle live worker, else a new one."""
        for worker in self.pool:
            if worker.trial is None and worker.proc.poll() is None:
                return worker
        self._spawned += 1
        early = children.adopt_early(EARLY_KIND)
        if early is not None and early[1] is not None:  # started before the sweep imported torch (its
            worker = SweepWorker(None, early[1], proc=early[0])  # secrets come with each trial)
        else:
            worker = SweepWorker(
                trial_env(plan.trial.config.tracking), self._tmp / f"worker-{self._spawned}.stderr"
            )
        self.pool.append(worker)
        return worker

    def start(self, plan: Plan) -> WorkerTrial:  # type: ignore[override]
        worker = self._worker(plan)
        trial = WorkerTrial(plan, worker, run_id=plan.run_id)
        worker.trial = trial
        self.processes.append(trial)  # type: ignore[arg-type]
        if not worker.send(self.message(plan)):
            self._died(worker)
        return trial

    def message(self, plan: Plan) -> dict[str, Any]:
        # `env`: what trial_env puts in a worker's environment (URLs with a password), for a worker started
        # early with the sweep's own environment; over the pipe, never on a command line
        return {
            **trial_message(plan, self.cores, self.threads, self.source.hook(plan) if self.source else None),
            "env": trial_secrets(plan.trial.config.tracking),
        }

    def _reap(self) -> bool:
        changed = False
        for worker in list(self.pool):
            while True:
                try:
                    event = worker.events.get_nowait()
                except queue.Empty:
                    break
                if event is None:  # its output ended: it exited (or is about to)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        worker.proc.wait(timeout=5)
                    changed = self._died(worker) or changed
                    break
                changed = self._event(worker, event) or changed
        return changed

    def _event(self, worker: SweepWorker, event: dict[str, Any]) -> bool:
        trial = worker.trial
        if trial is None:
            return False
        if event.get("event") == "started":
            trial.run_id = event.get("run_id") or trial.run_id
            return True
        if event.get("event") == "ended":
            trial.run_id = event.get("run_id") or trial.run_id
            self._end(
                trial,
                TrialOutcome(
                    str(event.get("status")),
                    trial.run_id,
                    str(event.get("reason") or ""),
                    event.get("round"),
                    dict(event.get("metrics") or {}),
                ),
            )
            worker.trial = None
            return True
        return False

    def _died(self, worker: SweepWorker) -> bool:
        """The worker exited: its trial (if any) ends with how it died; the pool loses it."""
        if worker.proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.proc.wait(timeout=5)
        if worker in self.pool:
            self.pool.remove(worker)
        trial, worker.trial = worker.trial, None
        if trial is None:
            return False
        why = f"its sweep worker (pid {worker.proc.pid}) {worker.death()}"
        status = "interrupted" if trial.stopped else "failed"
        self._end(
            trial,
            TrialOutcome(
                status, trial.run_id, why + ("; rerun the sweep to resume it" if trial.run_id else "")
            ),
        )
        return True

    def _end(self, trial: WorkerTrial, outcome: TrialOutcome) -> None:
        trial.outcome, trial.ended = outcome, time.monotonic()
        self._told(trial.plan, outcome)
        if self.mirror is not None and trial.run_id is not None:
            self.mirror.add(trial.run_id)

    def _stop(self) -> None:
        """Forward SIGTERM to the busy workers once (not a Ctrl-C that reached them already); end idle ones."""
        now = time.monotonic()
        if self._forwarded_at is None:
            self._forwarded_at = now
            forward = not (self.signum == signal.SIGINT and in_terminal_foreground())
            for worker in self.pool:
                if worker.trial is None:
                    worker.close()
                    continue
                worker.trial.stopped = True
                if forward:
                    with_suppressed_lookup(worker.proc.send_signal, signal.SIGTERM)
        elif now - self._forwarded_at > KILL_AFTER_S:
            for worker in self.pool:
                if worker.trial is not None:
                    with_suppressed_lookup(worker.proc.kill)

    def cleanup(self) -> None:
        """End the workers (stdin closed: they exit; killed after END_WAIT_S), then the Scheduler's cleanup."""
        for worker in self.pool:
            worker.close()
        deadline = time.monotonic() + END_WAIT_S
        for worker in self.pool:
            try:
                worker.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with_suppressed_lookup(worker.proc.kill)
                worker.proc.wait()
        super().cleanup()
