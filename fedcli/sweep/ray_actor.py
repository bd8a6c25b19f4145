"""What runs on a Ray node for `fedcli sweep --backend ray`: `TrialActor`, a long-lived sweep worker per actor.

`fedcli sweep --backend ray` (fedcli/sweep/ray_runner.py, docs/scaling.md) creates at most `--workers`
actors and sends each its trials one at a time; an actor runs them in one sweep worker process
(fedcli/sweep/worker.py) on its node, which dies with the actor (PR_SET_PDEATHSIG:
fedcli.children.die_with_parent).

Standard library only (and fedcli.children, which is too): a Ray worker imports this module
to create the actor, and importing the sweep's planning (torch) there would cost every worker
seconds and memory for nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from typing import Any

from fedcli.children import Channel, death, die_with_parent, own_line


class TrialActor:
    """A long-lived Ray actor: one sweep worker process on its node (`python -m
    fedcli.sweep.worker`, fedcli/sweep/worker.py) that runs many trials, one `run` call each.

    Created with `max_concurrency=2`, so that `stop` (SIGTERM to the worker: its trial checkpoints
    and reads `interrupted`) runs while `run` waits for the trial. The worker dies with the actor
    (PR_SET_PDEATHSIG), the actor with the sweep's driver.
    """

    def __init__(self, cwd: str, env: Mapping[str, str]) -> None:
        # a masked URL (`user:***@host`; fedcli.sweep.ray_runner never sends a password through Ray) is this node's own
        env = {k: v for k, v in env.items() if not (_masked(v) and os.environ.get(k))}
        # an unnamed file: Ray ends actors with ray.kill, so a folder made here was never removed (one
        # per actor was left in /tmp); it is freed with this process
        self.stderr = tempfile.TemporaryFile(prefix="fedcli-worker-")  # noqa: SIM115 - lives with the actor
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fedcli.sweep.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            cwd=cwd if os.path.isdir(cwd) else None,
            env={**os.environ, **env},
            preexec_fn=die_with_parent(os.getpid()),
        )
        self.channel = Channel(self.proc)  # framed messages over its stdin and stdout

    def run(self, message: Mapping[str, Any]) -> dict[str, Any]:
        """Run one trial; return the worker's `ended` event (with `host`), or how the worker died."""
        hook = message.get("hook")
        if isinstance(hook, Mapping) and _masked(hook.get("storage")) and os.environ.get("FEDCLI_STORE"):
            message = {
                **message,
                "hook": {**hook, "storage": os.environ["FEDCLI_STORE"]},
            }  # through a pipe only
        run_id = message.get("resume")
        self.channel.send(message)  # False: it died, the read below says how
        while (event := self.channel.receive()) is not None:
            if event.get("event") == "started":
                run_id = event.get("run_id") or run_id
            elif event.get("event") == "ended":
                return {**event, "host": socket.gethostname(), "pid": self.proc.pid}
        code = self.proc.wait()
        reason = own_line(_tail_of(self.stderr))
        return {
            "event": "died",
            "status": "failed",
            "run_id": run_id,
            "round": None,
            "metrics": {},
            "reason": f"its sweep worker (pid {self.proc.pid} on {socket.gethostname()}) "
            + death(code, reason[:300] if reason else None),
            "host": socket.gethostname(),
            "pid": self.proc.pid,
        }

    def stop(self) -> None:
        """SIGTERM to the worker: its trial stops in order (checkpointed, `interrupted`) and it exits."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)


def _masked(value: object) -> bool:
    """A URL whose password was masked by fedcli.tracking.urls.mask_url (`:***@`, `password=***`)."""
    return isinstance(value, str) and ("***" in value or "%2A%2A%2A" in value.upper())


def _tail_of(file: Any) -> bytes:
    """The last 64 KiB of an open file another process writes (pread: its shared offset stays put)."""
    size = os.fstat(file.fileno()).st_size
    start = max(0, size - 65536)
    return os.pread(file.fileno(), size - start, start)
