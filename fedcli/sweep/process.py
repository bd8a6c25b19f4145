"""`spawn_early` for the sweep's worker processes (fedcli/sweep/worker.py): one started before the sweep
imports torch. What every child shares (ending with the sweep, the early-spawn holder) is fedcli/children.py.
Imports nothing of fedcli's but that: `fedcli sweep` calls `spawn_early` first thing.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from fedcli import children

KIND = "worker"  # its key in fedcli.children's early-spawn holder


def spawn_early() -> None:
    """Start one worker now, before the sweep imports torch and reads its spec (`fedcli sweep` calls
    it first thing on the local backend): its own imports of torch and fedcli (~2 s of CPU) run on
    the core the sweep leaves idle meanwhile, instead of after the plan. The
    `WorkerScheduler` adopts it for its first trial (`children.adopt_early(KIND)`), sending what the
    sweep's environment would have given it (`trial_secrets`) with each trial; a sweep that ends without
    a trial (bad input, nothing to do) closes its stdin by exiting, and it exits."""
    children.spawn_early(KIND, _start)


def _start() -> children.Early:
    fd, name = tempfile.mkstemp(prefix="fedcli-worker-", suffix=".stderr")
    with os.fdopen(fd, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fedcli.sweep.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            preexec_fn=children.die_with_parent(os.getpid()),
        )
    atexit.register(Path(name).unlink, missing_ok=True)
    return proc, Path(name)
