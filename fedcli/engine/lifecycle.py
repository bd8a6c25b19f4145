"""A run's life as the store sees it: heartbeats while it trains, signals that end it in order.

- `Heartbeat`: a daemon thread that refreshes `runs.heartbeat_at` every `HEARTBEAT_S`
  seconds (rounds refresh it too), so that a run whose process was killed reads as
  `interrupted` everywhere once the heartbeat is older than `STALE_S` (at once on the
  same host, where the store checks the pid); see docs/architecture.md, "Run lifecycle".
- `graceful_signals`: SIGTERM (what schedulers and `kill` send) and SIGHUP (a closed
  terminal) end a run like Ctrl-C: the round in flight is abandoned, the last completed
  round is checkpointed, the run is marked `interrupted` and the process exits non-zero
  (128 + the signal number). Inside `critical()` (aggregation, which changes the server
  state and the client states together) a signal waits until the section ends, so a
  checkpoint never mixes two rounds.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

from fedcli.tracking.store import HEARTBEAT_S, SqlStore

log = logging.getLogger(__name__)


class RunInterrupted(KeyboardInterrupt):
    """The run was asked to stop (Ctrl-C, SIGTERM, SIGHUP); `signum` says by which signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by a signal: 128 + its number."""
        return 128 + self.signum


class Heartbeat:
    """Refresh a run's heartbeat from a daemon thread until `stop()`."""

    def __init__(self, store: SqlStore, run_id: str, every_s: float = HEARTBEAT_S) -> None:
        self._store, self._run_id, self._every = store, run_id, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="fedcli-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self._every):
            try:
                self._store.heartbeat(self._run_id)
            except Exception as err:  # a busy store must not end the run; the next beat retries
                log.debug("heartbeat of run %s failed: %s", self._run_id, err)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class GracefulSignals:
    """SIGINT/SIGTERM/SIGHUP raise `RunInterrupted` in the main thread, deferred inside `critical()`."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self._pending: int | None = None
        self._depth = 0
        self._stopping = False
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, _frame: Any) -> None:
        if self._stopping:  # a second Ctrl-C/SIGTERM must not cut the checkpoint of the orderly stop
            log.warning("already stopping: writing the last checkpoint (SIGKILL stops at once)")
            return
        if self._depth > 0:
            self._pending = self._pending or signum
            return
        self._stopping = True
        raise RunInterrupted(signum)

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread (e.g. tests in threads)
        for signum in self.SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    @contextlib.contextmanager
    def critical(self) -> Iterator[None]:
        """Hold signals back while the block runs; raise the first one after it."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if self._depth == 0 and self._pending is not None:
            signum, self._pending = self._pending, None
            self._stopping = True
            raise RunInterrupted(signum)


@contextlib.contextmanager
def graceful_signals() -> Iterator[GracefulSignals]:
    """Install `GracefulSignals` for the duration of a run; restore the previous handlers after."""
    handlers = GracefulSignals()
    handlers.install()
    try:
        yield handlers
    finally:
        handlers.restore()
