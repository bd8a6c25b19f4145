"""What fedcli's child processes share: ending with their parent, their own process group, the child
spawned before the command parsed its input, why one died, and framed messages over its pipes.

The sweep's workers (fedcli/sweep/worker_pool.py, process.py, ray_actor.py), the run's MLflow mirror
(tracking/mlflow/handle.py), the sweep's (tracking/mlflow/sweep_mirror.py) and `fedcli ui`'s server
(fedcli/cli/ui.py) start theirs with it (docs/architecture.md, "Child processes"). Standard library only, and nothing of fedcli: `fedcli sweep`
and `fedcli train` call `spawn_early` first thing, before they import torch, and a Ray worker imports it.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

PR_SET_PDEATHSIG = 1  # linux/prctl.h

Early = tuple[subprocess.Popen[bytes], Path | None]  # a child and the file its stderr goes to (if any)


def die_with_parent(parent_pid: int) -> Callable[[], None]:
    """A `preexec_fn`: the child gets SIGTERM when its parent dies, even by SIGKILL (Linux; no-op elsewhere).

    The signal is tied to the thread that forks, so children are started from the main thread.
    libc is loaded here, before the fork, so the child only makes two system calls.
    """
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None

    def preexec() -> None:
        if libc is None:
            return
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def own_process_group() -> dict[str, Any]:
    """Popen arguments that start a child in its own process group of this session.

    Its own group: a Ctrl-C in the terminal (sent to the foreground group) stops the training,
    while an MLflow mirror finishes copying and marks the MLflow run as the store says. Not its own
    session (`start_new_session`, as before): Linux's autogroup scheduler
    (`/proc/sys/kernel/sched_autogroup_enabled`) shares the CPU equally between sessions first,
    so a SCHED_IDLE mirror (as before; now nice 19) in a session of its own took a full share
    while it imported MLflow:
    20 MLP rounds trained in 1.3-2.6 s instead of 0.5 s.
    """
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"preexec_fn": os.setpgrp}  # pragma: no cover - Python 3.10


# ------------------------------------------------------------------ a child started before its command knew its input

_EARLY: dict[str, Early] = {}  # kind ("worker", "mirror") -> the child `spawn_early` started, not adopted yet


def spawn_early(kind: str, start: Callable[[], Early]) -> bool:
    """Start a child of `kind` now (`start()`), before the command parsed its input, unless one is held
    already; True when this call started it. The command adopts it later (`adopt_early`) or ends it
    (`discard_early`)."""
    if kind in _EARLY:
        return False
    _EARLY[kind] = start()
    return True


def early(kind: str) -> subprocess.Popen[bytes] | None:
    """The child of `kind` that `spawn_early` started and nothing adopted yet (it stays held)."""
    held = _EARLY.get(kind)
    return None if held is None else held[0]


def adopt_early(kind: str) -> Early | None:
    """Take the child of `kind` that `spawn_early` started (and its stderr file), if it is still alive;
    else None. Either way none is held any more."""
    held = _EARLY.pop(kind, None)
    return held if held is not None and held[0].poll() is None else None


def discard_early(kind: str) -> None:
    """End the child of `kind` that `spawn_early` started and nothing adopted: SIGTERM (it has read nothing
    and written nothing; end of file alone would wait for its imports), its stdin closed."""
    held = _EARLY.pop(kind, None)
    if held is not None:
        with contextlib.suppress(OSError):
            held[0].terminate()
            if held[0].stdin is not None:
                held[0].stdin.close()


# ------------------------------------------------------------------ why a child died


def own_line(err: bytes | str, prefix: str = "") -> str | None:
    """The last non-empty line of a child's stderr that starts with `prefix` (its own words, not a library's
    log lines), `prefix` removed; None when there is none."""
    text = err.decode(errors="replace") if isinstance(err, bytes) else err
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    own = [x.removeprefix(prefix) for x in lines if x.startswith(prefix)]
    return own[-1] if own else None


def death(code: int | None, reason: str | None = None) -> str:
    """How a child ended: "was killed by SIGKILL", "exited with code 1 (reason)"; `reason` (its last own
    stderr line, `own_line`) is quoted only for an exit with a code above 0."""
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}" + (f" ({reason})" if reason and code else "")


def stderr_of(proc: subprocess.Popen[bytes], timeout_s: float = 5.0) -> bytes:
    """What is left on the stderr pipe of a child that ended (b"" when none can be read)."""
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        err = b""
    return err or b""


# ------------------------------------------------------------------ messages over a child's stdin and stdout


class Channel:
    """The parent's side of a child's messages: JSON objects over its stdin and stdout, each one framed
    (length-prefixed) by `multiprocessing.connection.Connection`, so no line is ever read by hand. The
    Connections own copies of the pipes' descriptors (the Popen's own pipe objects are closed and
    dropped): `close` is the child's end of file."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdin is not None
        self._out = Connection(os.dup(proc.stdin.fileno()), readable=False)
        self._in = None if proc.stdout is None else Connection(os.dup(proc.stdout.fileno()), writable=False)
        proc.stdin.close()
        if proc.stdout is not None:
            proc.stdout.close()
        proc.stdin = proc.stdout = None  # the Connections' now (`communicate` reads its stderr alone)

    def send(self, message: Mapping[str, Any]) -> bool:
        """Send one message; False when the child is gone (or the channel closed)."""
        return send(self._out, message)

    def receive(self, timeout_s: float | None = None) -> dict[str, Any] | None:
        """The child's next message (`receive`); None also when its stdout was no pipe (a child that only
        reads)."""
        return None if self._in is None else receive(self._in, timeout_s)

    def close(self) -> None:
        """End of file on the child's stdin (an idle sweep worker exits)."""
        with contextlib.suppress(OSError):
            self._out.close()


def send(conn: Connection, message: Mapping[str, Any]) -> bool:
    """Send one JSON message over `conn`; False when the other side is gone (or `conn` closed)."""
    try:
        conn.send_bytes(json.dumps(dict(message)).encode())
        return True
    except (OSError, ValueError):
        return False


def receive(conn: Connection, timeout_s: float | None = None) -> dict[str, Any] | None:
    """The next JSON message on `conn` (waits for it, or at most `timeout_s`); None at its end of file
    (the other side closed it or exited), or when none came within `timeout_s`."""
    try:
        if timeout_s is not None and not conn.poll(timeout_s):
            return None
        return dict(json.loads(conn.recv_bytes()))
    except (EOFError, OSError):
        return None


def child_inbox() -> Connection:
    """A child's side of a `Channel` it only reads (its stdout is not the parent's)."""
    return Connection(os.dup(0), writable=False)


def child_channel() -> tuple[Connection, Connection]:
    """A child's side of its `Channel`: (what it reads from its stdin, what it writes to its stdout). Its
    file descriptor 1 then goes to stderr, so that nothing else written to stdout (a `print` in a trial, a
    C library's output) can break a message."""
    out = os.dup(1)
    os.dup2(2, 1)
    return child_inbox(), Connection(out, readable=False)
