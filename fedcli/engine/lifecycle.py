"""A run's life as the store sees it: heartbeats while it trains, signals that end it in order.

- `Heartbeat`: a daemon thread that refreshes `runs.heartbeat_at` every `HEARTBEAT_S`
  seconds (rounds refresh it too), so that a run whose process was killed reads as
  `interrupted` everywhere once the heartbeat is older than `STALE_S` (at once on the
  same host, where the store checks the pid); see docs/operations.md, "Run lifecycle".
- `graceful_signals`: SIGTERM (what schedulers and `kill` send) and SIGHUP (a closed
  terminal) end a run like Ctrl-C: the handler records the signal, the round loop stops at
  its next safe point (between rounds, clients or cohort chunks: `GracefulSignals.check`),
  the round in flight is abandoned, the last completed round is checkpointed, the run is
  marked `interrupted` and the process exits non-zero (128 + the signal number). Inside
  `critical()` (aggregation, which changes the server state and the client states
  together) nothing stops, so a checkpoint never mixes two rounds.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

from fedcli.tracking.store.common import HEARTBEAT_S, RunTakenOver, stale_s
from fedcli.tracking.store.protocol import RunStore

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
    """Refresh a run's heartbeat from a daemon thread until `stop()`.

    Every `every_s` seconds (`HEARTBEAT_S`, at most a quarter of `stale_s()`, so a short
    `FEDCLI_STALE_S` in tests still sees live runs alive). A beat is a lease-checked write:
    once another process has taken the run over the thread stops and keeps the
    `RunTakenOver` in `lost` (the round loop's next write raises it too).
    """

    def __init__(self, store: RunStore, run_id: str, every_s: float = HEARTBEAT_S) -> None:
        self._store, self._run_id, self._every = store, run_id, min(every_s, stale_s() / 4)
        self.lost: RunTakenOver | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="fedcli-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self._every):
            try:
                self._store.heartbeat(self._run_id)
            except RunTakenOver as err:  # not ours any more: never touch the new owner's heartbeat
                self.lost = err
                return
            except Exception as err:  # a busy store must not end the run; the next beat retries
                log.debug("heartbeat of run %s failed: %s", self._run_id, err)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class GracefulSignals:
    """SIGINT/SIGTERM/SIGHUP ask the run to stop; the run stops at its next safe point.

    The handler only records the signal (`pending`): it never raises inside library code,
    where an exception can break a library's own bookkeeping (a SIGTERM raised inside
    `torch.vmap`'s entry left its layer stack inconsistent and the run `failed` with an
    internal assertion instead of `interrupted`). The round loop calls `check()` at safe
    points, in its own code between library calls: before round 0, between rounds, between
    the clients (`loop`) or cohort chunks (`--cohort-chunk`) of a round, and after the
    cohort's local training; `check()` raises `RunInterrupted` there. Inside `critical()`
    (aggregation, evaluation, logging and the checkpoint of one round) `check()` does
    nothing, so a checkpoint never mixes two rounds.

    With `immediate=True` (a command's set-up, before it has written anything) the handler
    raises `RunInterrupted` at once instead: nothing is left to keep consistent, and the
    command exits as soon as it can; `defer()` switches to recording before the first write.
    A second signal while a stop is pending or under way is ignored (with a warning), so it
    cannot cut the final checkpoint short; SIGKILL stops at once. How long a stop may take:
    docs/operations.md, "Run lifecycle".
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, *, immediate: bool = False) -> None:
        self.pending: int | None = None  # the first stop signal received, until the process ends
        self._immediate = immediate
        self._depth = 0
        self._stopping = False  # RunInterrupted was raised: the run is on its way out
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.pending is not None:  # a second Ctrl-C/SIGTERM must not cut the orderly stop short
            log.warning(
                "already stopping (%s): the run stops at its next safe point and checkpoints; "
                "SIGKILL stops at once",
                signal.Signals(self.pending).name,
            )
            return
        self.pending = signum
        if self._immediate:  # set-up: nothing written yet, nothing to keep consistent
            self._stopping = True
            raise RunInterrupted(signum)

    def check(self) -> None:
        """Raise `RunInterrupted` if a stop signal arrived; call only at safe points, outside `critical()`."""
        if self.pending is not None and self._depth == 0 and not self._stopping:
            self._stopping = True
            raise RunInterrupted(self.pending)

    def defer(self) -> None:
        """End the set-up phase: from now on signals are recorded, not raised (call before the first write).

        Raises:
            RunInterrupted: a signal arrived during the set-up and was not raised yet (e.g. a
                library turned it into another exception that was handled).
        """
        self._immediate = False
        self.check()  # the set-up runs outside critical()

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
        """A block that must finish once started: `check()` inside it does nothing (the next check after it stops)."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1


@contextlib.contextmanager
def graceful_signals(installed: GracefulSignals | None = None) -> Iterator[GracefulSignals]:
    """Install `GracefulSignals` for the duration of a run and restore the previous handlers after;
    or use `installed`, handlers the caller installed already (`fedcli train` does, before its set-up)."""
    if installed is not None:
        installed.defer()
        yield installed
        return
    handlers = GracefulSignals()
    handlers.install()
    try:
        yield handlers
    finally:
        handlers.restore()


def signal_name(signum: int) -> str:
    """SIGTERM, SIGINT, ... for a signal number."""
    return signal.Signals(signum).name
