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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedcli import children
from fedcli.sweep.plan import RESUME, Plan, trial_config_text, trial_env, trial_secrets
from fedcli.sweep.process import KIND as EARLY_KIND
from fedcli.sweep.scheduler import Scheduler, TrialOutcome, TrialProcess, in_terminal_foreground

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


@dataclass(kw_only=True)
class WorkerTrial(TrialProcess):
    """A trial a worker runs."""

    worker: SweepWorker


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
    """`Scheduler` whose trials run in long-lived worker processes (`SweepWorker`), at most `workers` at once."""

    def __init__(self, plans: Sequence[Plan], **kwargs: Any) -> None:
        super().__init__(plans, **kwargs)
        self.pool: list[SweepWorker] = []
        self._spawned = 0
        self._forward = True  # a stop's SIGTERM goes to the busy workers (not a Ctrl-C that reached them)

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

    def start(self, plan: Plan) -> WorkerTrial:
        worker = self._worker(plan)
        trial = WorkerTrial(plan, worker=worker, run_id=plan.run_id)
        worker.trial = trial
        self.processes.append(trial)
        # `env`: what trial_env puts in a worker's environment (URLs with a password), for a worker started
        # early with the sweep's own environment; over the pipe, never on a command line
        message = {
            **trial_message(plan, self.cores, self.threads, self.source.hook(plan) if self.source else None),
            "env": trial_secrets(plan.trial.config.tracking),
        }
        if not worker.channel.send(message):
            self._died(worker)
        return trial

    def _reap(self) -> bool:
        changed = False
        for worker in list(self.pool):
            while True:
                try:
                    event = worker.events.get_nowait()
                except queue.Empty:
                    break
                if event is None:  # its output ended: it exited (or is about to)
                    changed = self._died(worker) or changed
                    break
                changed = self._event(worker, event) or changed
        return changed

    def _event(self, worker: SweepWorker, event: dict[str, Any]) -> bool:
        trial = worker.trial
        if trial is None or event.get("event") not in ("started", "ended"):
            return False
        trial.run_id = event.get("run_id") or trial.run_id
        if event["event"] == "ended":
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
        said = (  # its last stderr line
            children.own_line(worker.stderr.read_text(errors="replace")) if worker.stderr.exists() else None
        )
        why = f"its sweep worker (pid {worker.proc.pid}) " + children.death(
            worker.proc.returncode, said and said[:300]
        )
        rerun = "; rerun the sweep to resume it" if trial.run_id else ""
        self._end(
            trial, TrialOutcome("interrupted" if trial.stopped else "failed", trial.run_id, why + rerun)
        )
        return True

    def _stop(self) -> None:
        """As the Scheduler's, with SIGTERM to the busy workers and idle ones ended at once.

        A Ctrl-C in the terminal already reached every process of the foreground group, the
        workers included, so a SIGINT is forwarded only when the sweep is not that group.
        """
        if self._forwarded_at is None:
            self._forward = not (self.signum == signal.SIGINT and in_terminal_foreground())
            for worker in self.pool:
                if worker.trial is None:
                    worker.channel.close()
        super()._stop()

    def _ask_stop(self, trial: TrialProcess) -> None:
        if self._forward:
            with contextlib.suppress(ProcessLookupError):
                trial.worker.proc.send_signal(signal.SIGTERM)  # type: ignore[attr-defined]

    def _kill(self, trial: TrialProcess) -> None:
        with contextlib.suppress(ProcessLookupError):
            trial.worker.proc.kill()  # type: ignore[attr-defined]

    def cleanup(self) -> None:
        """End the workers (stdin closed: they exit; killed after END_WAIT_S), then the Scheduler's cleanup."""
        for worker in self.pool:
            worker.channel.close()
        deadline = time.monotonic() + END_WAIT_S
        for worker in self.pool:
            try:
                worker.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    worker.proc.kill()
                worker.proc.wait()
        super().cleanup()
