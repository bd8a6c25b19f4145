"""The MLflow mirror: a low-priority process that brings a run's MLflow copy in line with the SQL store.

Why a process (docs/architecture.md, "Tracking"): MLflow on the training thread or on a
thread of the training process cost 30-46 % of a round on 2 cores (its import, its
schema set-up and every `log_batch` compete for the GIL and the cores), and its schema
migrations raced when several runs started at once. The SQL store is the source of
truth; MLflow is a copy that this process keeps up to date:

- the training process writes rounds to the SQL store only and starts
  `python -m fedcli.tracking.mirror`, which runs at nice 19 from its first line (not SCHED_IDLE, which
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
  in them would be visible to every user in `ps` (docs/architecture.md, "Security").

`MirrorHandle` (tracking/mirror_handle.py) is the training process's side; `preflight`
(tracking/mirror_checks.py, with `schema_lock` and `mlflow_params`) checks a tracking URI
cheaply (no MLflow import) before anything is written; this module is the mirror process and
re-exports both.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import select
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fedcli.errors import TrackingError
from fedcli.tracking.mirror_checks import (
    half_migrated_tables,
    mlflow_params,
    preflight,
    schema_lock,
    sqlite_path,
)
from fedcli.tracking.mirror_handle import (
    FINISH_WAIT_S,
    MAX_RESTARTS,
    ORPHAN_WAIT_S,
    PARENT_ENV,
    STOP_POLL_S,
    STOP_WAIT_S,
    MirrorHandle,
)
from fedcli.tracking.urls import mask_url

__all__ = ["FINISH_WAIT_S", "MAX_RESTARTS", "ORPHAN_WAIT_S", "STOP_POLL_S", "STOP_WAIT_S", "Mirror", "MirrorHandle",
           "exit_now", "first_cause_line", "half_migrated_tables", "low_priority", "main", "mlflow_params",
           "mlflow_set_up", "normal_priority", "preflight", "quiet_mlflow", "schema_lock", "sqlite_path", "watch_parent"]

log = logging.getLogger(__name__)

POLL_S = 10.0  # how often the mirror looks for new rounds (the run's end wakes it at once)
RETRY_S = 60.0  # how long a failing MLflow write is retried (a busy SQLite file, a restarting server)


# --------------------------------------------------------------------------- the mirror process


def _retry(what: str, call: Any) -> Any:
    """Call `call()`, retrying transient failures for up to RETRY_S seconds (a full disk is not
    retried: it does not clear in seconds, and the training process would wait for it at its end)."""
    from fedcli.tracking.store import disk_full

    deadline, delay = time.monotonic() + RETRY_S, 0.2
    while True:
        try:
            return call()
        except TrackingError as err:
            if time.monotonic() > deadline or any(disk_full(cause) for cause in _causes(err)):
                raise
            log.debug("mirror: %s failed; retrying", what)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def _causes(err: BaseException) -> Iterator[BaseException]:
    """`err` and the chain of exceptions it was raised from (a database error under MLflow's)."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        orig = getattr(current, "orig", None)
        current = orig if isinstance(orig, BaseException) else current.__cause__


def first_cause_line(err: BaseException) -> str:
    """The first line of the innermost cause of `err`, masked: SQLite's "database or disk is full",
    not the note on autoflush that MLflow's SQLAlchemy session wraps it in."""
    *_, inner = _causes(err)
    lines = str(inner).strip().splitlines()
    return mask_url(lines[0] if lines else type(inner).__name__)


class Mirror:
    """Copy one run from the SQL store into MLflow (runs inside the mirror process).

    Only while the store names its training process as the run's owner: after a takeover
    (another process resumed the run, docs/architecture.md "Run lifecycle"), that process's
    mirror keeps MLflow in line, and this one stops without ending the MLflow run.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        from fedcli.tracking.mlflow_sink import MlflowSink
        from fedcli.tracking.store import SqlStore

        self.args = args
        if args.run is None:  # spawned early: MLflow is imported; wait for the run (EOF: never started)
            line = sys.stdin.readline().strip()
            if not line:
                raise SystemExit(0)
            args.run = line
        if getattr(args, "run_dir", None) is None:
            args.run_dir = str(Path(args.runs_root) / args.run)
        # never take the store's write lock while the run trains: at nice 19 the mirror
        # could be descheduled holding it, and the training process's next round would wait
        self.store = SqlStore(args.store, setup_schema=False)
        with mlflow_set_up(), schema_lock(args.tracking_uri):
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
        from fedcli.tracking.store import HOSTNAME

        pid, started = owner
        same = (record.host, record.pid) == (HOSTNAME, pid)
        return same and (None in (record.pid_start, started) or record.pid_start == started)  # not a reused pid

    def open_run(self, running: bool = True) -> None:
        """Create the MLflow run, or reattach to the one the store names (resume, `fedcli sync`, a restart).

        `running`: set a reattached run back to RUNNING (a run that trains again); `fedcli sync`
        leaves its status alone until it sets the store's.
        """
        record = self.record
        known = record.mlflow_run_id or self.sink.find_run(record.id)  # recorded, or made by a mirror killed early
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
        tags = {**record.tags, "fedcli.algorithm": record.algo, "fedcli.task": record.task,
                "fedcli.version": record.fedcli_version, "fedcli.run_id": record.id,
                "fedcli.config_hash": record.config_hash}
        if record.git_commit:
            tags["mlflow.source.git.commit"] = record.git_commit
        run_id = _retry("start", lambda: self.sink.start_run(
            run_name=record.run_name, params=mlflow_params(record.config), tags=tags,
            parent_run_id=self.args.parent_run, start_ms=int(record.created_at.timestamp() * 1000)))
        self.mlflow_run_id = run_id  # written to the store when the run ends (no store writes before)
        from fedcli.tracking.store import canonical_json

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
        rows = [row for row in self.store.round_rows(self.record.id, self.synced, upto)
                if row[0] > self.held.get(row[1], -1)]
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
            _retry("record", lambda: self.store.set_run_fields(
                self.record.id, mlflow_run_id=self.mlflow_run_id, mlflow_synced_round=self.synced))

    def in_line(self) -> bool:
        """True when MLflow already holds the ended run as the store says: nothing for `fedcli sync` to do.

        The recorded MLflow run exists with the store's status and end time, the mirror that
        ended it copied every round MLflow may have, and a finished run's model is logged.
        """
        record = self.record
        if record.mlflow_run_id is None or record.mlflow_synced_round is None or record.status == "running":
            return False
        from fedcli.tracking.mlflow_sink import MLFLOW_STATUS

        state = self.sink.run_state(record.mlflow_run_id)
        if state != (MLFLOW_STATUS[record.status], end_ms(record)):
            return False
        self.mlflow_run_id = record.mlflow_run_id
        last = self.store.last_round(record.id) or 0
        return record.mlflow_synced_round >= self.safe_round(record.status) and (
            record.status != "finished" or not (Path(self.args.run_dir) / "model.pt").is_file()
            or last in self.sink.model_steps(record.mlflow_run_id))

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
                # command named (trust_code absent); `fedcli sync` passes its --trust-code (datasets/code_trust.py)
                module = load_served(weights, trust=getattr(self.args, "trust_code", True),
                                     fix="pass --trust-code to fedcli sync if you trust it")
                with torch.no_grad():
                    output = None if example is None else module(example)
                _retry("model", lambda: self.sink.log_model(weights, example=example, output=output, step=step,
                                                            requirements=requirements))
        except Exception as err:  # noqa: BLE001 - any failure here leaves the run complete
            log.warning("the final model was not logged as an MLflow model (%s); model.pt is among the "
                        "run's artifacts", str(err).splitlines()[0] if str(err) else type(err).__name__)

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

    def run(self) -> int:
        if self.args.once:
            self.run_once()
            return 0
        self.open_run()  # a few small writes: latency, not CPU
        if not getattr(self.args, "restart", False):  # MirrorHandle.check reads it: a later death is not a set-up's
            try:
                print("ready", flush=True)
            except BrokenPipeError:  # the training process is gone (stopped during the set-up): copy anyway
                sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the rest of this process
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
            readable, _, _ = select.select([sys.stdin], [], [], POLL_S)
            if readable and not os.read(sys.stdin.fileno(), 4096):
                parent_gone = True  # EOF: re-read the status once more before deciding

    def _taken_over(self, record: Any) -> None:
        log.warning("run %s was taken over by pid %s on %s; its mirror keeps MLflow in line, this one stops "
                    "without ending the MLflow run", record.id[:8], record.pid, record.host)


def quiet_mlflow() -> None:
    """Keep MLflow's and Alembic's INFO lines (schema set-up, input-example validation) off stderr.

    Called after MLflow is imported: importing it sets its logger's level again.
    """
    for noisy in ("alembic", "mlflow"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def end_ms(record: Any) -> int:
    """The run's end in MLflow's unit (ms since the epoch) as the store says: `ended_at`, else (a
    process that died without ending it) its last heartbeat, else now."""
    ended = record.ended_at or record.heartbeat_at
    return int(ended.timestamp() * 1000) if ended is not None else int(time.time() * 1000)


PARENT_POLL_S = 0.5  # how often the mirror looks whether the process that started it is still alive


def low_priority() -> int:
    """Lower this thread (and the threads it starts) to nice 19; return the nice value it had.

    Nice 19 (SCHED_OTHER), not SCHED_IDLE (before issue 35): an idle-priority task runs only when a
    core would otherwise idle, so on a machine kept busy by other work it never ran (8 runs that
    ended with 0 of 8 in MLflow; mirrors left behind for hours by commands long gone). At nice 19 it
    has 1.5 % of a core against one busy task at nice 0, and always progresses. The cost on round
    time is measured in docs/architecture.md, "Tracking" (the MLflow mirror).
    """
    try:
        before = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, 0, 19)  # Linux: this thread; threads started later inherit it
    except (AttributeError, OSError):
        return 0
    return before


def normal_priority(nice: int = 0) -> None:
    """Back to `nice` from nice 19 for every thread of this process, where the system lets it (root, or an
    RLIMIT_NICE that allows it); else nothing changes, and the time bound of `watch_parent` still holds."""
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for thread in threads:
        with contextlib.suppress(AttributeError, OSError):
            os.setpriority(os.PRIO_PROCESS, thread, nice)


class _Lifeline:
    """What the mirror may still do once the process that started it is gone (`watch_parent`)."""

    lock = threading.RLock()
    parent_gone = False
    begun = False  # MLflow's set-up began: from here on the mirror may have written to MLflow
    setting_up = False  # inside MLflow's schema set-up, which must not be cut short
    give_up = False  # the time ran out during the set-up: exit once it is done


@contextlib.contextmanager
def mlflow_set_up() -> Iterator[None]:
    """Mark MLflow's set-up (its schema, created or migrated under `schema_lock`) for `watch_parent`.

    A mirror whose training process is gone exits before it (nothing written), and not during it: a
    store cut mid-migration is left half-migrated, which `preflight` then refuses until it is moved
    aside. The time bound (ORPHAN_WAIT_S) ends such a mirror as soon as the set-up is done.
    """
    with _Lifeline.lock:
        if _Lifeline.parent_gone and not _Lifeline.begun:  # (the watcher exits such a mirror too, at its next look)
            exit_now(0)
        _Lifeline.begun = _Lifeline.setting_up = True
    try:
        yield
    finally:
        with _Lifeline.lock:
            _Lifeline.setting_up = False
            if _Lifeline.give_up:
                exit_now(3)


def watch_parent(wait_s: float = ORPHAN_WAIT_S) -> None:
    """Start a thread that ends this mirror within a bounded time once the process that started it is gone.

    The process that started it: `PARENT_ENV` (set by the spawning process), else the parent now.
    Once it is gone (exited, or killed by SIGKILL: this process's parent changes), a mirror that has
    not begun MLflow's set-up (`mlflow_set_up`: e.g. the command ended without a run, or was killed
    while the mirror imported MLflow) exits at once, having written nothing; one that has goes back to
    the nice value this thread has now (before `low_priority`) where the system lets it, and has `wait_s`
    seconds to finish its copy (ending the MLflow run KILLED), then exits, at once or as soon as a schema
    set-up in progress is done. What it has not copied, `fedcli sync` or `fedcli train --resume` copies:
    the SQL store has the whole run. Issue 35: mirrors of rejected or killed commands lived on for hours
    (at SCHED_IDLE on a busy machine they were never scheduled).
    """
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        parent = int(os.environ.get(PARENT_ENV) or os.getppid())
    except ValueError:
        parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        with _Lifeline.lock:
            _Lifeline.parent_gone = True
            if not _Lifeline.begun:
                os._exit(0)
        normal_priority(nice)
        time.sleep(wait_s)
        with _Lifeline.lock:
            if not _Lifeline.setting_up:
                os._exit(3)
            _Lifeline.give_up = True  # `mlflow_set_up` exits once the schema is set up

    threading.Thread(target=watch, name="fedcli-mirror-parent", daemon=True).start()


def read_urls(args: argparse.Namespace, line: str | None = None) -> bool:
    """Set args.store and args.tracking_uri (and experiment, runs_root, parent_run where the command
    line left them unset) from stdin's first line, or `line`: JSON, never the command line, where
    `ps` would show a password. False, after one line on stderr, when it holds no store and URI."""
    try:
        secrets = json.loads((sys.stdin.readline() if line is None else line) or "{}")
        args.store, args.tracking_uri = str(secrets["store"]), str(secrets["tracking_uri"])
    except (ValueError, KeyError, TypeError):
        print("MLflow mirror: no store and tracking URI on stdin (the first line: JSON with store and "
              "tracking_uri)", file=sys.stderr)
        return False
    for name in ("experiment", "runs_root", "parent_run"):
        if getattr(args, name, None) is None and secrets.get(name) is not None:
            setattr(args, name, str(secrets[name]))
    args.sweep_spec = secrets.get("sweep_spec")  # the sweep's mirror opens the sweep's parent run (mirror_sweep)
    return True


def main(argv: list[str] | None = None) -> int:
    """The mirror process. Its first stdin line is JSON {"store": URL, "tracking_uri": URI, "experiment",
    "runs_root", "parent_run"} (secrets stay off the command line); then, unless --run is given, the
    run id. End of file before the first line: spawned early (`spawn_early`) for a command that
    ended without a run; it exits 0, having written nothing."""
    parser = argparse.ArgumentParser(prog="python -m fedcli.tracking.mirror", description=__doc__.splitlines()[0])
    parser.add_argument("--run", help="the run; default: read its id from stdin (spawned early)")
    parser.add_argument("--experiment", help="default: from stdin's first line")
    parser.add_argument("--run-dir")
    parser.add_argument("--runs-root")
    parser.add_argument("--parent-run")
    parser.add_argument("--once", action="store_true", help="copy an ended run once and exit (fedcli sync)")
    parser.add_argument("--restart", action="store_true", help="take over a run that trains already (its mirror died)")
    args = parser.parse_args(argv)
    if not args.once:  # the training process that spawned it: the run's owner while the store says so
        # the watcher first, at the training process's priority: it ends this mirror once that process is gone
        watch_parent()
        from fedcli.tracking.store import process_start

        args.owner = (os.getppid(), process_start(os.getppid()))
        # the run trains (or is about to): MLflow's import and set-up must not compete with its rounds;
        # they take the cores the training process leaves idle (its own imports, the data load)
        low_priority()
    logging.basicConfig(level=logging.WARNING, format="fedcli mirror: %(message)s")
    # the slow imports first (spawned early, while the training process imports torch and reads its
    # config): MLflow, and torch for the final model (`log_model`)
    import fedcli.tracking.mlflow_sink  # noqa: F401
    import fedcli.tracking.served  # noqa: F401

    quiet_mlflow()
    first = sys.stdin.readline()
    if not first.strip():
        return 0  # never adopted: the command ended without a run
    if not read_urls(args, first):
        return 2
    if args.experiment is None:
        print("MLflow mirror: no experiment (--experiment, or in stdin's first line)", file=sys.stderr)
        return 2
    try:
        return Mirror(args).run()
    except TrackingError as err:
        print(f"MLflow mirror: {mask_url(str(err))}", file=sys.stderr)
        return 1
    except Exception as err:  # noqa: BLE001 - one line the training process quotes, not a traceback
        print(f"MLflow mirror: {type(err).__name__}: {first_cause_line(err)}; pass --tracking-uri with a "
              "writable MLflow store or use --no-mlflow", file=sys.stderr)
        return 1


def exit_now(code: int) -> None:
    """End the mirror process without the interpreter's teardown.

    Everything is written by then (each SQL write committed, MLflow's queue flushed by
    `end_run`, artifacts copied), and the teardown (MLflow's exit hooks, freeing torch's and
    MLflow's modules) took 1.4 s, which the training process waited for at its end (issue 27).
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
