"""Starting sweep worker processes (fedcli/sweep/worker.py) so that they end with the sweep: `die_with_parent`,
and `spawn_early`, which starts one before the sweep imports torch. Imports nothing of fedcli: `fedcli
sweep` calls `spawn_early` first thing, and the scheduler, the worker pool and fedcli.sweep import it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent_pid: int) -> Callable[[], None]:
    """A `preexec_fn`: the child gets SIGTERM when the sweep dies, even by SIGKILL (Linux; no-op elsewhere).

    The signal is tied to the thread that forks, so trials are started from the main thread.
    libc is loaded here, before the fork, so the child only makes two system calls.
    """
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None

    def preexec() -> None:
        if libc is None:
            return
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent_pid:  # the sweep died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


_EARLY: list[tuple[subprocess.Popen[bytes], Path]] = []  # a worker `spawn_early` started, and its stderr file


def spawn_early() -> None:
    """Start one worker now, before the sweep imports torch and reads its spec (`fedcli sweep` calls
    it first thing on the local backend): its own imports of torch and fedcli (~2 s of CPU) run on
    the core the sweep leaves idle meanwhile, instead of after the plan (issue 27). The
    `WorkerScheduler` adopts it for its first trial (`adopt_early`), sending what the sweep's
    environment would have given it (`trial_secrets`) with each trial; a sweep that ends without
    a trial (bad input, nothing to do) closes its stdin by exiting, and it exits."""
    if _EARLY:
        return
    fd, name = tempfile.mkstemp(prefix="fedcli-worker-", suffix=".stderr")
    with os.fdopen(fd, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fedcli.sweep.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            preexec_fn=die_with_parent(os.getpid()),
        )
    _EARLY.append((proc, Path(name)))
    atexit.register(_remove, Path(name))


def adopt_early() -> tuple[subprocess.Popen[bytes], Path] | None:
    """The worker `spawn_early` started (and its stderr file), if it is still alive; else None."""
    early = _EARLY.pop() if _EARLY else None
    return early if early is not None and early[0].poll() is None else None


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()
