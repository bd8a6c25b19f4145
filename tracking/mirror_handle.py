"""The training process's side of the MLflow mirror (`MirrorHandle`): spawn, start, check, finish.

Split out of tracking/mirror.py (issue 25: no module over ~500 lines), which describes the
mirror as a whole and re-exports every name here; the mirror process itself is
`python -m fedcli.tracking.mirror`.
"""

from __future__ import annotations

import contextlib
import json
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from fedcli.errors import TrackingError
from fedcli.tracking.urls import mask_url

FINISH_WAIT_S = 120.0  # how long a finished run waits for its mirror before leaving it to finish alone
READY_WAIT_S = 300.0  # how long a run waits for MLflow's set-up before its first round
STOP_POLL_S = 0.1  # how often the two waits above look for a stop signal (`MirrorHandle.stopping`)
STOP_WAIT_S = 1.5  # after a stop signal, how long the run's end still waits for the mirror's copy
MAX_RESTARTS = 3  # a mirror that dies alone is restarted at most this often per run
_DISK_FULL = ("database or disk is full", "No space left on device")  # a mirror that died so is not restarted


# --------------------------------------------------------------------------- the training process's side


class MirrorHandle:
    """The training process's handle on its run's mirror: spawn early, start, wait at the end.

    `spawn()` starts the process before the data loads: it imports MLflow (seconds of CPU)
    while the training process loads data, and touches no store. `start(run_id)` then sends
    it the run; it opens MLflow (creating its schema under the lock), creates or reattaches
    the MLflow run and answers "ready", which `start` waits for, so that all of MLflow's
    set-up happens before round 1 and none of it competes with a round. `abort()` (the
    command failed validation) ends it before it wrote anything. `check()` (every round)
    restarts a mirror that died alone; `finish()` ends it, restarting it first if it died.

    The store URL and the tracking URI go to the process as the first line of its stdin
    (JSON), not as arguments: a password in them would show in `ps`.
    """

    def __init__(self, *, tracking_uri: str, experiment: str, store_url: str, runs_root: Path,
                 parent_run_id: str | None = None) -> None:
        self.tracking_uri, self.experiment, self.store_url = tracking_uri, experiment, store_url
        self.runs_root, self.parent_run_id = runs_root, parent_run_id
        self.run_id: str | None = None
        self.restarts = 0
        self._proc: subprocess.Popen[bytes] | None = None
        # True once a stop signal arrived (`fedcli train` sets it to its GracefulSignals): the wait
        # for MLflow's set-up and the one for the final copy then end within a second or two
        self.stopping: Callable[[], bool] = lambda: False
        self._left_alone = False  # a stop signal cut `start` short: the mirror finishes on its own

    def spawn(self, *, run_id: str | None = None) -> MirrorHandle:
        """Start the mirror process; with `run_id`, one that takes over the run at once (a restart)."""
        command = [sys.executable, "-m", "fedcli.tracking.mirror", "--experiment", self.experiment,
                   "--runs-root", str(self.runs_root)]
        if self.parent_run_id:
            command += ["--parent-run", self.parent_run_id]
        if run_id is not None:
            command += ["--run", run_id, "--restart"]
        # its own session: a Ctrl-C in the terminal stops the training, while the mirror
        # finishes copying and marks the MLflow run as the store says
        self._proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, start_new_session=True)
        assert self._proc.stdin is not None
        secrets = json.dumps({"store": self.store_url, "tracking_uri": self.tracking_uri})
        with contextlib.suppress(OSError):  # it died at once: start/finish say why
            self._proc.stdin.write(f"{secrets}\n".encode())
            self._proc.stdin.flush()
        return self

    def abort(self) -> None:
        """End a spawned mirror that was never started (it has written nothing)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                proc.communicate(timeout=10)

    def start(self, run_id: str, timeout_s: float = READY_WAIT_S) -> str | None:
        """Hand the run to the mirror and wait until MLflow is set up for it; return a warning, if any.

        A stop signal during the wait (`stopping`) ends it within STOP_POLL_S: the mirror goes on
        in the background (it sets MLflow up, then copies the run as the store says once the run
        has ended), and the warning says so.

        Raises:
            TrackingError: the mirror could not open MLflow: its own reason, or how it ended
                (exit code, signal); or it did not answer within `timeout_s`.
        """
        if self._proc is None:
            self.spawn()
        self.run_id = run_id
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(f"{run_id}\n".encode())
            proc.stdin.flush()
        except OSError:
            pass  # it died: the read below says why
        deadline, line = time.monotonic() + timeout_s, None
        while line is None and time.monotonic() < deadline:
            readable, _, _ = select.select([proc.stdout], [], [], STOP_POLL_S)
            if readable:
                raw = proc.stdout.readline()
                line = "" if not raw else "ready" if raw.strip() == b"ready" else None  # "": it exited
            elif self.stopping():
                self._left_alone = True  # `finish` then only closes its stdin: this warning says it all
                return (f"stopped while MLflow was being set up for the run; its MLflow mirror (pid {proc.pid}) "
                        "copies the run in the background (the SQL store has it all; if MLflow misses it, "
                        "`fedcli sync` or the next `fedcli train --resume` completes the copy)")
        if line != "ready":
            self._proc = None
            try:  # end of file: the mirror is exiting (read its last words); else it is silent: end it
                _, err = proc.communicate(timeout=5 if line is not None else 0.1)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            if line is not None:
                raise TrackingError(mask_url(_own_reason(err) or f"the MLflow mirror (pid {proc.pid}) "
                                             f"{_death(proc, err)} before MLflow was set up for the run"))
            raise TrackingError(f"the MLflow mirror (pid {proc.pid}) did not set MLflow up for the run within "
                                f"{timeout_s:.0f} s; ended it")
        return None

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
        why = _death(proc)
        if any(full in why for full in _DISK_FULL):  # a restart would fail the same way: one warning, not four
            self._proc = None
            return (f"MLflow mirror (pid {proc.pid}) {why}; not restarted while the disk is full (the SQL store is "
                    "complete; `fedcli sync` copies the run into MLflow once there is space)")
        if self.restarts >= MAX_RESTARTS:
            self._proc = None
            return (f"MLflow mirror (pid {proc.pid}) {why}, the {self.restarts + 1}th time; not restarted again "
                    "(the SQL store is complete; `fedcli sync` copies the run into MLflow later)")
        self.restarts += 1
        self.spawn(run_id=self.run_id)
        assert self._proc is not None
        return (f"MLflow mirror (pid {proc.pid}) {why}; restarted it (pid {self._proc.pid}), which copies what "
                "MLflow misses from the store")

    def finish(self, timeout_s: float = FINISH_WAIT_S) -> str | None:
        """Tell the mirror the run ended (close its stdin) and wait; return a warning, if any.

        A mirror that died since the last `check` is restarted first, so that MLflow gets the
        whole run before this process exits. After a stop signal (`stopping`, before or during
        the wait) the wait is at most STOP_WAIT_S: the mirror, in its own session, finishes the
        copy in the background, and the warning says what completes it if it cannot. After a
        stop during `start` (which warned already) it does not wait at all and returns None.
        """
        restarted = None
        if self._proc is not None and self._proc.poll() is not None and self.run_id is not None:
            dead = self._proc
            self.spawn(run_id=self.run_id)
            restarted = f"MLflow mirror (pid {dead.pid}) {_death(dead)}; restarted it at the run's end"
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if self._left_alone:  # stopped during MLflow's set-up: `start` warned already; no wait, no second line
            with contextlib.suppress(OSError):
                if proc.stdin is not None:
                    proc.stdin.close()  # its cue that the run ended
            return None
        deadline, stop_at = time.monotonic() + timeout_s, None
        while True:
            try:  # communicate closes the mirror's stdin: its cue that the run ended
                _, err = proc.communicate(timeout=STOP_POLL_S)
                break
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if stop_at is None and self.stopping():
                    stop_at = now + STOP_WAIT_S
                if now < deadline and (stop_at is None or now < stop_at):
                    continue
                why = "this process was stopped by a signal" if stop_at is not None else \
                    f"it was not done after {timeout_s:.0f} s"
                return (f"{restarted + '; ' if restarted else ''}the MLflow mirror (pid {proc.pid}) still copies the "
                        f"run in the background ({why}); the SQL store is complete, and if MLflow misses part of the "
                        "run, `fedcli sync` or the next `fedcli train --resume` completes the copy")
        if proc.returncode != 0:
            return (f"{restarted + '; then ' if restarted else ''}MLflow mirror (pid {proc.pid}) {_death(proc, err)} "
                    "(the SQL store is complete; `fedcli sync` copies the run into MLflow later)")
        return f"{restarted}, which copied the run into MLflow" if restarted else None


def _own_reason(err: bytes) -> str | None:
    """The mirror's own last error line ("MLflow mirror: ..."), not MLflow's log lines."""
    lines = [x.strip() for x in err.decode(errors="replace").splitlines() if x.strip()]
    own = [x.removeprefix("MLflow mirror: ") for x in lines if x.startswith("MLflow mirror: ")]
    return own[-1] if own else None


def _death(proc: subprocess.Popen[bytes], err: bytes | None = None) -> str:
    """How a mirror process ended: "was killed by SIGKILL", "exited with code 1 (reason)"."""
    if err is None:
        try:
            _, err = proc.communicate(timeout=5)  # a dead process: only its stderr left to read
        except (OSError, ValueError, subprocess.TimeoutExpired):
            err = b""
    code = proc.returncode
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    reason = _own_reason(err or b"")
    return f"exited with code {code}" + (f" ({mask_url(reason)})" if reason else "")
