"""The training process's side of the MLflow mirror (`MirrorHandle`): spawn, start, check, finish.

tracking/mlflow/mirror.py describes the mirror as a whole; the mirror process itself is
`python -m fedcli.tracking.mlflow.mirror`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from fedcli import children
from fedcli.tracking.urls import mask_url

FINISH_WAIT_S = 120.0  # how long a finished run waits for its mirror before leaving it to finish alone
STOP_POLL_S = 0.1  # how often the wait above looks for a stop signal (`MirrorHandle.stopping`)
STOP_WAIT_S = 1.5  # after a stop signal, how long the run's end still waits for the mirror's copy
MAX_RESTARTS = 3  # a mirror that dies alone is restarted at most this often per run
ORPHAN_WAIT_S = (
    60.0  # how long a mirror whose training process is gone may still copy (`lifeline.watch_parent`)
)
ORPHAN_ENV = "FEDCLI_ORPHAN_WAIT_S"  # overrides ORPHAN_WAIT_S (seconds; tests on a loaded machine give more)
PARENT_ENV = "FEDCLI_MIRROR_PARENT"  # the pid of the process that started a mirror, which it watches
_DISK_FULL = ("database or disk is full", "No space left on device")  # a mirror that died so is not restarted


def orphan_wait_s() -> float:
    """ORPHAN_WAIT_S, or `FEDCLI_ORPHAN_WAIT_S` when set to a number > 0."""
    try:
        value = float(os.environ.get(ORPHAN_ENV, ""))
    except ValueError:
        return ORPHAN_WAIT_S
    return value if value > 0 else ORPHAN_WAIT_S


# --------------------------------------------------------------------------- the training process's side


class MirrorHandle:
    """The training process's handle on its run's mirror: spawn early, start, wait at the end.

    `spawn()` starts the process before the data loads: at nice 19 (it yields a busy core to
    the training process) it imports MLflow while the training process loads data, and
    touches no store. `start(run_id)` then sends it the run and returns at once: the mirror
    opens MLflow (creating its schema under the lock), creates or reattaches the MLflow run
    and answers "ready" while the rounds train, so none of MLflow's set-up delays round 1 or
    competes with a round. `abort()` (the command failed validation) ends it before it wrote
    anything. `check()` (every round) restarts a mirror that died alone (one that failed its
    set-up is not restarted: one warning); `finish()` ends it, restarting it first if it died.

    The store URL and the tracking URI go to the process as the first message on its stdin
    (fedcli.children `Channel`), not as arguments: a password in them would show in `ps`.
    """

    def __init__(
        self,
        *,
        tracking_uri: str,
        experiment: str,
        store_url: str,
        runs_root: Path,
        parent_run_id: str | None = None,
    ) -> None:
        self.tracking_uri, self.experiment, self.store_url = tracking_uri, experiment, store_url
        self.runs_root, self.parent_run_id = runs_root, parent_run_id
        self.run_id: str | None = None
        self.restarts = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._channel: children.Channel | None = None  # framed messages over its stdin and stdout
        # True once a stop signal arrived (`fedcli train` sets it to its GracefulSignals): the wait
        # for the final copy then ends within a second or two
        self.stopping: Callable[[], bool] = lambda: False
        self.ready = False  # the mirror said "ready": MLflow is set up for the run (`_read_ready`)

    def spawn(self, *, run_id: str | None = None) -> MirrorHandle:
        """Start the mirror process (or adopt the one `spawn_early` started); with `run_id`, one
        that takes over the run at once (a restart)."""
        early = children.adopt_early(KIND) if run_id is None else None
        proc = _popen() if early is None else early[0]
        self._proc, self._channel = proc, children.Channel(proc)
        # everything on stdin, nothing on the command line: a password in a URL would show in `ps`;
        # a mirror that died at once: check/finish say why
        self._channel.send(
            {
                "store": self.store_url,
                "tracking_uri": self.tracking_uri,
                "experiment": self.experiment,
                "runs_root": str(self.runs_root),
                "parent_run": self.parent_run_id,
                "run": run_id,
            }
        )
        return self

    def abort(self) -> None:
        """End a spawned mirror that was never started (it has written nothing)."""
        proc, self._proc, channel, self._channel = self._proc, None, self._channel, None
        if proc is not None and channel is not None:
            # SIGTERM: end of file would wait for its imports (seconds of CPU at nice 19)
            if self.run_id is None:
                with contextlib.suppress(OSError):
                    proc.terminate()
            channel.close()
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                proc.communicate(timeout=10)

    def start(self, run_id: str) -> None:
        """Hand the run to the mirror and return at once: round 1 never waits for MLflow.

        The mirror sets MLflow up (schema, the MLflow run) at nice 19 while the run
        trains and answers "ready"; `check` reads that answer. This used to wait for
        "ready" (up to 300 s), which put MLflow's import and schema set-up (2.8 s of a 5 s
        start on 2 cores) before round 1. Whether MLflow can be used is checked before anything
        is written (`preflight`: the URL, the folder, the disk, the server); a set-up that
        fails later is one warning from `check` or `finish`, and the SQL store keeps the run.
        """
        if self._proc is None:
            self.spawn()
        self.run_id = run_id
        assert self._channel is not None
        self._channel.send({"run": run_id})  # False when it died: `check` or `finish` says why

    def _read_ready(self) -> bool:
        """True once the mirror said {"ready": true} (MLflow set up for the run); reads without waiting."""
        if not self.ready and self._channel is not None:
            self.ready = bool((self._channel.receive(timeout_s=0) or {}).get("ready"))
        return self.ready

    def _failed_set_up(self, proc: subprocess.Popen[bytes]) -> str | None:
        """The mirror's own reason when it exited (not killed) before MLflow was set up, else None.

        Such a mirror is not restarted: a new one would fail the same way (a server that refuses
        the password, a disk that filled since `preflight`).
        """
        if proc.poll() is None or self._read_ready() or proc.returncode <= 0:
            return None
        err = children.stderr_of(proc)
        self._proc = self._channel = None
        return _set_up_failed(_own_reason(err) or f"exited with code {proc.returncode}")

    def check(self) -> str | None:
        """If the mirror died while the run trains, restart it; return a warning saying so (else None).

        Costs one `waitpid` when it is alive: the round loop calls it every round. The new
        mirror reattaches to the run's MLflow run and copies from the store what is missing
        (copies are idempotent); after MAX_RESTARTS, or when it died of a full disk, it is left
        dead (`fedcli sync` copies later).
        """
        proc = self._proc
        if proc is None or self.run_id is None or proc.poll() is None:
            return None
        failed = self._failed_set_up(proc)
        if failed is not None:
            return failed
        why = _death(proc)
        if any(
            full in why for full in _DISK_FULL
        ):  # a restart would fail the same way: one warning, not four
            self._proc = None
            return (
                f"MLflow mirror (pid {proc.pid}) {why}; not restarted while the disk is full (the SQL store is "
                "complete; `fedcli sync` copies the run into MLflow once there is space)"
            )
        if self.restarts >= MAX_RESTARTS:
            self._proc = None
            return (
                f"MLflow mirror (pid {proc.pid}) {why}, the {self.restarts + 1}th time; not restarted again "
                "(the SQL store is complete; `fedcli sync` copies the run into MLflow later)"
            )
        self.restarts += 1
        self.spawn(run_id=self.run_id)
        assert self._proc is not None
        return (
            f"MLflow mirror (pid {proc.pid}) {why}; restarted it (pid {self._proc.pid}), which copies what "
            "MLflow misses from the store"
        )

    def finish(self, timeout_s: float = FINISH_WAIT_S) -> str | None:
        """Tell the mirror the run ended (end of file on its stdin) and wait; return a warning, if any.

        A mirror that died since the last `check` is restarted first, so that MLflow gets the
        whole run before this process exits. After a stop signal (`stopping`, before or during
        the wait) the wait is at most STOP_WAIT_S: the mirror, in its own process group, finishes the
        copy in the background, and the warning says what completes it if it cannot.
        """
        restarted = None
        if self._proc is not None and self.run_id is not None:
            failed = self._failed_set_up(self._proc)
            if failed is not None:
                return failed
        if self._proc is not None and self._proc.poll() is not None and self.run_id is not None:
            dead = self._proc
            self.spawn(run_id=self.run_id)
            restarted = f"MLflow mirror (pid {dead.pid}) {_death(dead)}; restarted it at the run's end"
        proc, self._proc = self._proc, None
        if proc is None or self._channel is None:
            return None
        self._channel.close()  # end of file on its stdin: its cue that the run ended
        err, why = wait_ended(proc, timeout_s, self.stopping)
        if why is not None:
            return (
                f"{restarted + '; ' if restarted else ''}the MLflow mirror (pid {proc.pid}) still copies the "
                f"run in the background ({why}), for at most {orphan_wait_s():.0f} s more; the SQL store is "
                "complete, and if MLflow misses part of the run, `fedcli sync` or the next `fedcli train "
                "--resume` completes the copy"
            )
        if proc.returncode > 0 and not restarted and not self._read_ready():
            return _set_up_failed(_own_reason(err or b"") or f"exited with code {proc.returncode}")
        if proc.returncode != 0:
            return (
                f"{restarted + '; then ' if restarted else ''}MLflow mirror (pid {proc.pid}) {_death(proc, err)} "
                "(the SQL store is complete; `fedcli sync` copies the run into MLflow later)"
            )
        return f"{restarted}, which copied the run into MLflow" if restarted else None


def wait_ended(
    proc: subprocess.Popen[bytes], timeout_s: float, stopping: Callable[[], bool] = lambda: False
) -> tuple[bytes, str | None]:
    """Wait for a mirror to exit: (its stderr, None), or (b"", why it still runs) after `timeout_s`, or
    STOP_WAIT_S once `stopping()` (a stop signal arrived, before or during the wait)."""
    deadline, stop_at = time.monotonic() + timeout_s, None
    while True:
        try:
            return proc.communicate(timeout=STOP_POLL_S)[1] or b"", None
        except subprocess.TimeoutExpired:
            now = time.monotonic()
            if stop_at is None and stopping():
                stop_at = now + STOP_WAIT_S
            if now >= deadline or (stop_at is not None and now >= stop_at):
                stopped = "this process was stopped by a signal" if stop_at is not None else None
                return b"", stopped or f"it was not done after {timeout_s:.0f} s"


def _set_up_failed(reason: str) -> str:
    return (
        f"MLflow could not be set up for the run ({mask_url(reason)}); it trains on with the SQL store, which "
        "keeps the whole run: `fedcli sync` copies it into MLflow once MLflow works"
    )


KIND = "mirror"  # its key in fedcli.children's early-spawn holder


def spawn_early() -> None:
    """Start a mirror process now, before this process knows its run or even its config.

    `fedcli train` calls it first thing: the mirror imports MLflow and torch (3 s of CPU) at nice
    19 on the core the training process leaves idle while it imports torch and reads its
    config, instead of after (before, its set-up had ended 2 s after the last round of a
    short run). The run's `MirrorHandle.spawn` adopts it and sends what it needs on its stdin; a
    command that ends without a run (bad input, an exception, `--no-mlflow` in a config file) ends it
    as this process exits (`discard_early`, registered with atexit), and were this process killed,
    the mirror sees its parent gone and exits (`watch_parent`), in both cases having written nothing
    (before, each rejected `fedcli train` left an idle-priority mirror behind for as long as the
    machine stayed busy).
    """
    if children.spawn_early(KIND, lambda: (_popen(), None)):
        atexit.register(discard_early)  # a no-op once a run adopted it


def discard_early() -> None:
    """End the mirror `spawn_early` started when the run turns out to need none (`tracking.use_mlflow:
    false` in a config file, MLflow dropped by `--mlflow-optional`), instead of leaving it idle as
    long as the run trains (fedcli.children.discard_early: SIGTERM, stdin closed)."""
    children.discard_early(KIND)


def _popen() -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "fedcli.tracking.mlflow.mirror"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=parent_env(),
        **children.own_process_group(),  # not its own session: see there
    )


def parent_env() -> dict[str, str]:
    """The environment of a mirror this process starts: its own, and this process's pid, which the
    mirror watches (`fedcli.tracking.mlflow.lifeline.watch_parent`: it ends once this process is gone)."""
    return {**os.environ, PARENT_ENV: str(os.getpid())}


def _own_reason(err: bytes) -> str | None:
    """The mirror's own last error line ("MLflow mirror: ..."), not MLflow's log lines."""
    return children.own_line(err, "MLflow mirror: ")


def _death(proc: subprocess.Popen[bytes], err: bytes | None = None) -> str:
    """How a mirror process ended: "was killed by SIGKILL", "exited with code 1 (reason)"."""
    reason = _own_reason(children.stderr_of(proc) if err is None else err)
    return children.death(proc.returncode, mask_url(reason) if reason else None)
