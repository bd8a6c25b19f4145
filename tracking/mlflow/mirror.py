"""The MLflow mirror: a low-priority process that brings a run's MLflow copy in line with the SQL store.

Why a process (docs/architecture.md, "Tracking"): MLflow on the training thread or on a
thread of the training process cost 30-46 % of a round on 2 cores (its import, its
schema set-up and every `log_batch` compete for the GIL and the cores), and its schema
migrations raced when several runs started at once. The SQL store is the source of
truth; MLflow is a copy that this process keeps up to date:

- the training process writes rounds to the SQL store only and starts
  `python -m fedcli.tracking.mlflow.mirror`, which runs at nice 19 from its first line (not SCHED_IDLE, which
  starved on a busy machine: `low_priority`); nothing waits on MLflow, neither round 1 nor any round
  after it;
- the mirror opens MLflow under an inter-process lock (`schema_lock`: a lock file beside a
  SQLite database, an advisory lock on PostgreSQL), so N runs starting together on a fresh
  root set its schema up once; creates (or, on `--resume`, reattaches to) the MLflow run
  with the stored config as params;
- it copies rounds up to the newest checkpoint (all of them once the run has finished), with
  the time each round was logged as MLflow's timestamp. A round after the newest checkpoint
  is trained again on resume, so MLflow never gets it twice; and a round copied twice (the
  mirror killed between its write and its bookkeeping) is the same point twice, which
  MLflow's SQL store keeps once (identical key, value, step and timestamp);
- when the run ends it uploads the run's files (config, partition, model), sets the status,
  the tags and the store's end time and exits; when the training process dies without
  ending the run (SIGKILL: the mirror's stdin closes) it marks the MLflow run KILLED;
- once its training process is gone (exited, killed) it ends within a bounded time (`watch_parent`):
  at once if it has not begun MLflow's set-up (the command ended without a run), else after at most
  ORPHAN_WAIT_S of copying (a schema set-up in progress is finished first); what it did not copy,
  `fedcli sync` or `--resume` copies from the store;
- a mirror that dies alone (killed, out of memory) is restarted by the training process at
  its next round, and once more at the run's end if it died after the last round
  (`MirrorHandle.check`, `finish`), with a warning naming the signal or exit code;
- the store and MLflow URLs reach it over its stdin, never on its command line: a password
  in them would be visible to every user in `ps` (docs/operations.md, "Security").

`MirrorHandle` (tracking/mlflow/handle.py) is the training process's side; `preflight`
(tracking/mlflow/checks.py, with `schema_lock` and `mlflow_params`) checks a tracking URI
cheaply (no MLflow import) before anything is written; this module is the mirror process.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from fedcli import children
from fedcli.errors import TrackingError
from fedcli.tracking.mlflow.checks import causes, first_cause_line, mlflow_params, schema_lock
from fedcli.tracking.mlflow.lifeline import (
    Lifeline,
    exit_now,
    low_priority,
    quiet_mlflow,
    read_urls,
    watch_parent,
)
from fedcli.tracking.store.common import HOSTNAME, canonical_json, disk_full
from fedcli.tracking.urls import mask_url

__all__ = ["Mirror", "main"]

log = logging.getLogger(__name__)

POLL_S = 10.0  # how often the mirror looks for new rounds (the run's end wakes it at once)
RETRY_S = 60.0  # how long a failing MLflow write is retried (a busy SQLite file, a restarting server)


# --------------------------------------------------------------------------- the mirror process


def _retry(what: str, call: Any) -> Any:
    """Call `call()`, retrying transient failures for up to RETRY_S seconds (a full disk is not
    retried: it does not clear in seconds, and the training process would wait for it at its end)."""
    deadline, delay = time.monotonic() + RETRY_S, 0.2
    while True:
        try:
            return call()
        except TrackingError as err:
            if time.monotonic() > deadline or any(disk_full(cause) for cause in causes(err)):
                raise
            log.debug("mirror: %s failed; retrying", what)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


class Mirror:
    """Copy one run from the SQL store into MLflow (runs inside the mirror process).

    Only while the store names its training process as the run's owner: after a takeover
    (another process resumed the run, docs/operations.md, "Run lifecycle"), that process's
    mirror keeps MLflow in line, and this one stops without ending the MLflow run.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        from fedcli.tracking.mlflow.sink import MlflowSink
        from fedcli.tracking.store.sql_store import SqlStore

        self.args = args
        if getattr(args, "run_dir", None) is None:
            args.run_dir = str(Path(args.runs_root) / args.run)
        # never take the store's write lock while the run trains: at nice 19 the mirror
        # could be descheduled holding it, and the training process's next round would wait
        self.store = SqlStore(args.store, setup_schema=False)
        lifeline = getattr(args, "lifeline", None) or Lifeline()  # `fedcli sync`: no process to outlive
        with lifeline.mlflow_set_up(), schema_lock(args.tracking_uri):
            self.sink = MlflowSink(args.tracking_uri, args.experiment)
        self.record = self.store.get_run(args.run)
        self.synced = -1  # the store's rows of rounds <= synced were copied (or found in MLflow)
        self.held: dict[str, int] = {}  # metric key -> highest step MLflow held when this mirror attached
        self.mlflow_run_id: str | None = None

    def owns(self, record: Any) -> bool:
        """True while the store names this mirror's training process as the run's owner.

        `args.owner`: (pid, start time) of the process that spawned the mirror (None for
        `fedcli sync`, which copies ended runs only).
        """
        owner = getattr(self.args, "owner", None)
        if owner is None:
            return True
        pid, started = owner
        same = (record.host, record.pid) == (HOSTNAME, pid)
        return same and (
            None in (record.pid_start, started) or record.pid_start == started
        )  # not a reused pid

    def open_run(self, running: bool = True) -> None:
        """Create the MLflow run, or reattach to the one the store names (resume, `fedcli sync`, a restart).

        `running`: set a reattached run back to RUNNING (a run that trains again); `fedcli sync`
        leaves its status alone until it sets the store's.
        """
        record = self.record
        known = record.mlflow_run_id or self.sink.find_run(
            record.id
        )  # recorded, or made by a mirror killed early
        if known is not None and self.sink.exists(known):
            _retry("reattach", lambda: self.sink.attach(known, running=running))
            self.mlflow_run_id = known
            # start after the round a mirror that ended in order recorded; and never log a
            # (metric, step) MLflow holds already: a resume from an older checkpoint (the newest
            # unreadable) trains rounds MLflow may hold again, to the same values but at a new
            # time, which MLflow would keep as a second point (docs/architecture.md §6)
            self.synced = -1 if record.mlflow_synced_round is None else record.mlflow_synced_round
            self.held = _retry("read", self.sink.logged_steps)
            return
        tags = {
            **record.tags,
            "fedcli.algorithm": record.algo,
            "fedcli.task": record.task,
            "fedcli.version": record.fedcli_version,
            "fedcli.run_id": record.id,
            "fedcli.config_hash": record.config_hash,
        }
        if record.git_commit:
            tags["mlflow.source.git.commit"] = record.git_commit
        run_id = _retry(
            "start",
            lambda: self.sink.start_run(
                run_name=record.run_name,
                params=mlflow_params(record.config),
                tags=tags,
                parent_run_id=self.args.parent_run,
                start_ms=int(record.created_at.timestamp() * 1000),
            ),
        )
        self.mlflow_run_id = run_id  # written to the store when the run ends (no store writes before)
        _retry("config", lambda: self.sink.log_text(canonical_json(record.config), "config.json"))

    def safe_round(self, status: str) -> int:
        """The last round MLflow may get now: all once finished or failed, else the newest checkpoint.

        A failed run's curve up to the failure is what one wants to see; an interrupted or
        running one gets only rounds that a resume will not train again.
        """
        if status in ("finished", "failed", "pruned"):
            return self.store.last_round(self.record.id) or 0
        points = self.store.checkpoints(self.record.id)
        return points[-1][0] if points else -1

    def copy(self, upto: int) -> None:
        if upto <= self.synced:
            return
        rows = [
            row
            for row in self.store.round_rows(self.record.id, self.synced, upto)
            if row[0] > self.held.get(row[1], -1)
        ]
        if rows:
            _retry("log rounds", lambda: self.sink.log_rows(rows))
        self.synced = upto

    def finish(self, status: str) -> None:
        """Upload the run's files, set the outcome, end the MLflow run at the store's end time; record it.

        Files MLflow already holds at the same size are not uploaded again, and the model is
        logged once per final round, so a second `fedcli sync` adds nothing.
        """
        record = self.store.get_run(self.record.id)
        if not self.owns(record):
            self._taken_over(record)
            return
        held = self.sink.artifact_sizes()
        for path in sorted(Path(self.args.run_dir).glob("*")):
            if path.is_file() and held.get(path.name) != path.stat().st_size:
                _retry("artifact", lambda p=path: self.sink.log_artifact(p))
        last = self.store.last_round(record.id) or 0
        if status == "finished" and last not in self.sink.model_steps():
            self.log_model(last)
        tags = {"fedcli.status": status}
        if record.failure_reason:
            tags["fedcli.failure_reason"] = record.failure_reason
        if record.diverged_at_round is not None:
            tags["fedcli.diverged_at_round"] = str(record.diverged_at_round)
        _retry("tags", lambda: self.sink.set_tags(tags))
        _retry("end", lambda: self.sink.end_run(status, end_ms=end_ms(record)))
        if (record.mlflow_run_id, record.mlflow_synced_round) != (self.mlflow_run_id, self.synced):
            _retry(
                "record",
                lambda: self.store.set_run_fields(
                    self.record.id, mlflow_run_id=self.mlflow_run_id, mlflow_synced_round=self.synced
                ),
            )

    def in_line(self) -> bool:
        """True when MLflow already holds the ended run as the store says: nothing for `fedcli sync` to do.

        The recorded MLflow run exists with the store's status and end time, the mirror that
        ended it copied every round MLflow may have, and a finished run's model is logged.
        """
        record = self.record
        if record.mlflow_run_id is None or record.mlflow_synced_round is None or record.status == "running":
            return False
        from fedcli.tracking.mlflow.sink import MLFLOW_STATUS

        state = self.sink.run_state(record.mlflow_run_id)
        if state != (MLFLOW_STATUS[record.status], end_ms(record)):
            return False
        self.mlflow_run_id = record.mlflow_run_id
        last = self.store.last_round(record.id) or 0
        return record.mlflow_synced_round >= self.safe_round(record.status) and (
            record.status != "finished"
            or not (Path(self.args.run_dir) / "model.pt").is_file()
            or last in self.sink.model_steps(record.mlflow_run_id)
        )

    def log_model(self, step: int) -> None:
        """Log the final model as an MLflow model (tracking/served.py); a warning if it cannot be.

        The run's results do not depend on it: `model.pt` is already among its artifacts.
        """
        path = Path(self.args.run_dir) / "model.pt"
        if not path.is_file():
            return
        try:
            import tempfile

            import torch

            from fedcli import __version__
            from fedcli.tracking.served import load_served, read_model_file, write_served

            saved = read_model_file(path)  # weights_only: a file that needs code is refused, not run
            example = saved.get("example") if isinstance(saved.get("example"), torch.Tensor) else None
            requirements = [f"torch=={torch.__version__.split('+')[0]}", f"fedcli=={__version__}"]
            with tempfile.TemporaryDirectory(prefix="fedcli-model-") as folder:
                weights = Path(folder) / "served.pt"
                write_served(saved, weights)
                # the parameters fit the task's model; user code it names: a run's own mirror runs what its train
                # command named (trust_code absent); `fedcli sync` passes its --trust-code (datasets/yours/trust.py)
                module = load_served(
                    weights,
                    trust=getattr(self.args, "trust_code", True),
                    fix="pass --trust-code to fedcli sync if you trust it",
                )
                with torch.no_grad():
                    output = None if example is None else module(example)
                _retry(
                    "model",
                    lambda: self.sink.log_model(
                        weights, example=example, output=output, step=step, requirements=requirements
                    ),
                )
        except Exception as err:  # noqa: BLE001 - any failure here leaves the run complete
            log.warning(
                "the final model was not logged as an MLflow model (%s); model.pt is among the "
                "run's artifacts",
                str(err).splitlines()[0] if str(err) else type(err).__name__,
            )

    def run_once(self) -> int:
        """Copy an ended (or dead) run once and end its MLflow run as the store says (`fedcli sync`)."""
        record = self.store.get_run(self.record.id)
        if record.status == "running":
            raise TrackingError(f"run {record.id[:8]} is still training; its own mirror keeps MLflow in line")
        self.record = record
        if self.in_line():
            return 0
        self.open_run(running=False)
        self.copy(self.safe_round(record.status))
        self.finish(record.status)
        return 1

    def run(self, inbox: Connection, outbox: Connection) -> int:
        """Keep MLflow in line with the run while it trains (the mirror process, `main`): `inbox` ends when
        its training process ended the run or died; `outbox` carries {"ready": true} once MLflow is set up."""
        self.open_run()  # a few small writes: latency, not CPU
        if not self.args.restart:  # MirrorHandle.check reads it: a later death is not a set-up's
            children.send(outbox, {"ready": True})  # False: the training process is gone; copy anyway
        parent_gone = False
        while True:
            record = self.store.get_run(self.record.id)
            if not self.owns(record):
                self._taken_over(record)
                return 0
            status = record.stored_status
            self.copy(self.safe_round(status))
            if status != "running":
                self.finish(status)
                return 0
            if parent_gone:  # the training process died without ending the run (SIGKILL)
                self.finish("interrupted")
                return 0
            if inbox.poll(POLL_S) and children.receive(inbox) is None:
                parent_gone = True  # end of file: re-read the status once more before deciding

    def _taken_over(self, record: Any) -> None:
        log.warning(
            "run %s was taken over by pid %s on %s; its mirror keeps MLflow in line, this one stops "
            "without ending the MLflow run",
            record.id[:8],
            record.pid,
            record.host,
        )


def end_ms(record: Any) -> int:
    """The run's end in MLflow's unit (ms since the epoch) as the store says: `ended_at`, else (a
    process that died without ending it) its last heartbeat, else now."""
    ended = record.ended_at or record.heartbeat_at
    return int(ended.timestamp() * 1000) if ended is not None else int(time.time() * 1000)


def main() -> int:
    """The mirror process. Its stdin carries messages framed by fedcli.children (`child_channel`), never
    its command line (a password in a URL would show in `ps`): first {"store": URL, "tracking_uri": URI,
    "experiment", "runs_root", "parent_run", "run"}, where "run" is set only for a mirror that takes over
    a run that trains already (its mirror died); else the run comes next, {"run": RUN_ID}. End of file
    before the run: spawned early (`spawn_early`) for a command that ended without a run; it exits 0,
    having written nothing. End of file later: the run ended, or its training process died."""
    inbox, outbox = children.child_channel()
    args = argparse.Namespace()
    # the watcher first, at the training process's priority: it ends this mirror once that process is gone
    args.lifeline = watch_parent()
    from fedcli.tracking.store.liveness import process_start

    # the training process that spawned it: the run's owner while the store says so
    args.owner = (os.getppid(), process_start(os.getppid()))
    # the run trains (or is about to): MLflow's import and set-up must not compete with its rounds;
    # they take the cores the training process leaves idle (its own imports, the data load)
    low_priority()
    logging.basicConfig(level=logging.WARNING, format="fedcli mirror: %(message)s")
    # the slow imports first (spawned early, while the training process imports torch and reads its
    # config): MLflow, and torch for the final model (`log_model`)
    import fedcli.tracking.mlflow.sink  # noqa: F401
    import fedcli.tracking.served  # noqa: F401

    quiet_mlflow()
    first = children.receive(inbox)
    if first is None:
        return 0  # never adopted: the command ended without a run
    if not read_urls(args, first):
        return 2
    args.restart = first.get("run") is not None
    run = first if args.restart else children.receive(inbox)  # spawned early: wait for the run
    if run is None or not run.get("run"):
        return 0  # end of file: the command ended before its run started
    args.run = str(run["run"])
    try:
        return Mirror(args).run(inbox, outbox)
    except TrackingError as err:
        print(f"MLflow mirror: {mask_url(str(err))}", file=sys.stderr)
        return 1
    except Exception as err:  # noqa: BLE001 - one line the training process quotes, not a traceback
        print(
            f"MLflow mirror: {type(err).__name__}: {first_cause_line(err)}; pass --tracking-uri with a "
            "writable MLflow store or use --no-mlflow",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    exit_now(main())
