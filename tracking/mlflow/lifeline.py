"""The mirror processes' own life (`python -m fedcli.tracking.mlflow.mirror`, `...sweep_mirror`).

What both mirror processes do around their copying: the URLs from stdin's first message (`read_urls`:
never the command line, where `ps` would show a password), nice 19 while the training or the sweep
needs the cores (`low_priority`, `normal_priority`), a bounded life once the process that started
them is gone (`watch_parent`, with `Lifeline.mlflow_set_up` marking MLflow's schema set-up, which is
never cut short), MLflow's INFO lines off (`quiet_mlflow`), and an exit without the interpreter's teardown
(`exit_now`). The process that starts a mirror is in tracking/mlflow/handle.py.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from fedcli.tracking.mlflow.handle import PARENT_ENV, orphan_wait_s


def quiet_mlflow() -> None:
    """Keep MLflow's and Alembic's INFO lines (schema set-up, input-example validation) off stderr.

    Called after MLflow is imported: importing it sets its logger's level again.
    """
    for noisy in ("alembic", "mlflow"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


PARENT_POLL_S = 0.5  # how often the mirror looks whether the process that started it is still alive


def low_priority() -> int:
    """Lower this thread (and the threads it starts) to nice 19; return the nice value it had.

    Nice 19 (SCHED_OTHER), not SCHED_IDLE (as it was first): an idle-priority task runs only when a
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


class Lifeline:
    """What a mirror process may still do once the process that started it is gone (`watch_parent`).

    One per mirror process, made by `watch_parent` (or unwatched, for `fedcli sync`'s copy) and handed
    to its `Mirror`s, which mark MLflow's set-up with `mlflow_set_up`.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.parent_gone = False
        self.begun = False  # MLflow's set-up began: from here on the mirror may have written to MLflow
        self.setting_up = False  # inside MLflow's schema set-up, which must not be cut short
        self.give_up = False  # the time ran out during the set-up: exit once it is done

    @contextlib.contextmanager
    def mlflow_set_up(self) -> Iterator[None]:
        """Mark MLflow's set-up (its schema, created or migrated under `schema_lock`) for `watch_parent`.

        A mirror whose training process is gone exits before it (nothing written), and not during it: a
        store cut mid-migration is left half-migrated, which `preflight` then refuses until it is moved
        aside. The time bound (ORPHAN_WAIT_S) ends such a mirror as soon as the set-up is done.
        """
        with self.lock:
            if self.parent_gone and not self.begun:  # (the watcher exits such a mirror too, at its next look)
                exit_now(0)
            self.begun = self.setting_up = True
        try:
            yield
        finally:
            with self.lock:
                self.setting_up = False
                if self.give_up:
                    exit_now(3)


def watch_parent(wait_s: float | None = None) -> Lifeline:
    """Start a thread that ends this mirror within a bounded time once the process that started it is
    gone; return the `Lifeline` it watches.

    The process that started it: `PARENT_ENV` (set by the spawning process), else the parent now.
    Once it is gone (exited, or killed by SIGKILL: this process's parent changes), a mirror that has
    not begun MLflow's set-up (`Lifeline.mlflow_set_up`: e.g. the command ended without a run, or was
    killed while the mirror imported MLflow) exits at once, having written nothing; one that has goes
    back to the nice value this thread has now (before `low_priority`) where the system lets it, and
    has `wait_s` seconds (default `orphan_wait_s()`) to finish its copy (ending the MLflow run KILLED),
    then exits, at once or as soon as a schema set-up in progress is done. What it has not copied, `fedcli sync` or `fedcli train
    --resume` copies: the SQL store has the whole run. Without it, mirrors of rejected or killed
    commands lived on for hours.
    """
    bound = orphan_wait_s() if wait_s is None else wait_s
    life = Lifeline()
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        parent = int(os.environ.get(PARENT_ENV) or os.getppid())
    except ValueError:
        parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        with life.lock:
            life.parent_gone = True
            if not life.begun:
                os._exit(0)
        normal_priority(nice)
        time.sleep(bound)
        with life.lock:
            if not life.setting_up:
                os._exit(3)
            life.give_up = True  # `mlflow_set_up` exits once the schema is set up

    threading.Thread(target=watch, name="fedcli-mirror-parent", daemon=True).start()
    return life


def read_urls(args: argparse.Namespace, message: dict[str, Any] | None) -> bool:
    """Set args.store and args.tracking_uri (and experiment, runs_root, parent_run where the command line
    left them unset) from the mirror's first message (fedcli.children framing), never the command line,
    where `ps` would show a password. False, after one line on stderr, when it holds no store and URI."""
    if message is None or not {"store", "tracking_uri"} <= message.keys():
        print(
            "MLflow mirror: no store and tracking URI on stdin (its first message: store and tracking_uri)",
            file=sys.stderr,
        )
        return False
    args.store, args.tracking_uri = str(message["store"]), str(message["tracking_uri"])
    for name in ("experiment", "runs_root", "parent_run"):
        if getattr(args, name, None) is None:
            setattr(args, name, None if message.get(name) is None else str(message[name]))
    args.sweep_spec = message.get("sweep_spec")  # the sweep's mirror opens the sweep's parent run
    args.parent_tags = message.get("parent_tags") or {}  # the tags that find it (the sweep computes them)
    return True


def exit_now(code: int) -> None:
    """End the mirror process without the interpreter's teardown.

    Everything is written by then (each SQL write committed, MLflow's queue flushed by
    `end_run`, artifacts copied), and the teardown (MLflow's exit hooks, freeing torch's and
    MLflow's modules) took 1.4 s, which the training process waited for at its end.
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
