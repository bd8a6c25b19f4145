"""Is a run's or a claim's process still there: /proc start times, signal 0, heartbeats (docs/operations.md,
"Run lifecycle").

Part of the `fedcli.tracking.store` package (docs/architecture.md §6), whose docstring gives the layout.
"""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path

from fedcli.tracking.store.common import HOSTNAME, stale_s
from fedcli.tracking.store.schema import Run, TrialClaim


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of a process from /proc/PID/stat; None
    when /proc does not show it (no such process, no /proc, or hidden: `hidepid`)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])  # fields 3 (state) and 22 (starttime) of proc(5)
    except (OSError, IndexError, ValueError):
        return None


def process_start(pid: int | None = None) -> int | None:
    """The start time (clock ticks since boot) of process `pid` (default: this one); None off Linux.

    Stored with the pid (`runs.pid_start`, `trial_claims.pid_start`) so that a pid the kernel
    reused for another process does not pass for the owner.
    """
    stat = _proc_stat(os.getpid() if pid is None else pid)
    return None if stat is None else stat[1]


def pid_state(pid: int, started: int | None = None) -> str:
    """ "alive", "stopped" (SIGSTOP, a suspended job: alive) or "gone" (absent, a zombie, a reused pid).

    From /proc when it shows the process; else (no /proc, or another user's process hidden by
    `hidepid`) the kernel's answer to signal 0 decides, without the start-time check.
    """
    stat = _proc_stat(pid)
    if stat is None:
        return "alive" if pid_alive(pid) else "gone"
    if stat[0] in ("Z", "X") or (started is not None and stat[1] != started):
        return "gone"
    return "stopped" if stat[0] in ("T", "t") else "alive"


def liveness(run: Run, now: datetime) -> tuple[str, str | None]:
    """(status, reason) of a run as it stands now: a `running` run whose process is gone is `interrupted`.

    On this host the process decides: the run is alive while its pid exists with the start
    time recorded (a process stopped by SIGSTOP, or a suspended laptop, is alive however old
    its heartbeat), and gone, at once, when it does not. A run of another host is gone when
    its heartbeat is older than `stale_s()` (`STALE_S`, 60 s).
    """
    if run.status != "running":
        return run.status, run.failure_reason
    if run.host == HOSTNAME and run.pid is not None:
        if pid_state(run.pid, run.pid_start) == "gone":
            return "interrupted", f"process {run.pid} on {run.host} is gone (killed)"
        return "running", None
    age = (now - (run.heartbeat_at or run.created_at)).total_seconds()
    if age > stale_s():
        return "interrupted", f"no heartbeat for {age:.0f} s (process killed or machine down)"
    return "running", None


def claim_alive(claim: TrialClaim, now: datetime) -> bool:
    """A claim's owner is alive: its pid on this host, else a heartbeat younger than `stale_s()`."""
    if claim.host == HOSTNAME:
        return pid_state(claim.pid, claim.pid_start) != "gone"
    return (now - claim.heartbeat_at).total_seconds() <= stale_s()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
