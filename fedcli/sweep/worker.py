"""A long-lived sweep worker: `python -m fedcli.sweep.worker` runs many trials of one sweep, in-process.

Why: a trial as its own `fedcli train` process paid Python + torch imports, the
data load and an MLflow mirror process per trial, 92 % of a 6-trial FEMNIST sweep's wall
time. A worker imports once, keeps each task's data (`Worker.data`, passed to run_config, keyed
by the task and every loader option) and calls `fedcli.api.run_config` (what `fedcli train`
runs: validation, set-up, the engine's `train`) for each trial with a store-only `Tracker`; each
trial is still a complete run in the store (own id, config hash, lifecycle, checkpoints,
resume, stop signals, leases) exactly as `fedcli train --config` would make it.

The protocol (the sweep's side is fedcli/sweep/worker_pool.py), one JSON object per message, each framed by
`multiprocessing.connection.Connection` (fedcli.children `Channel`, `child_channel`; stdout is the
protocol's alone: what else a trial prints goes to stderr):

- stdin, one per trial: `{"config": YAML text, "run_name": NAME}` (a new run: `fedcli train --config
  FILE --run-name NAME`) or
  `{"resume": RUN_ID, "overrides": {dotted key: value}}` (`fedcli train --resume`), plus
  `"hook"` (None, or the pruning hook's spec: fedcli.sweep.search.make_on_eval, the sweep
  interface of docs/sweeps.md). Store and MLflow URLs travel in the pipe (never argv).
- stdout: `{"event": "started", "run_id": ID}` once the run exists, then `{"event": "ended",
  "status": finished|failed|interrupted|pruned, "run_id", "reason", "round", "metrics"}`.

Between trials the worker puts back the process-global state a trial may change
(`ProcessState`: intra-op threads, RNG states, TF32/deterministic flags, signal handlers), so
trial k sees the process as trial 1 did: its results equal the same trial run alone
(tests/sweeps/test_workers.py checks bit-equality with `fedcli train`).

Signals: while a trial trains, SIGTERM/SIGINT/SIGHUP stop it as they stop `fedcli train` (the
run checkpoints and reads `interrupted`); the worker then reports it and exits 128 + signal.
Idle, a stop signal ends the worker at once. It dies with the sweep (PR_SET_PDEATHSIG, set by
the sweep at spawn).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import sys
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from fedcli.children import child_channel

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
log = logging.getLogger("fedcli.sweep.worker")


@dataclass
class ProcessState:
    """What a trial may change in the process and the next trial must not inherit (captured at start-up)."""

    threads: int
    interop: int
    rng: Any
    np_rng: Any
    py_rng: Any
    flags: dict[str, Any] = field(default_factory=dict)
    handlers: dict[int, Any] = field(default_factory=dict)

    @classmethod
    def capture(cls) -> ProcessState:
        import numpy as np
        import torch

        return cls(
            torch.get_num_threads(),
            torch.get_num_interop_threads(),
            torch.get_rng_state(),
            np.random.get_state(),
            random.getstate(),
            {
                "matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
                "cudnn_tf32": torch.backends.cudnn.allow_tf32,
                "cudnn_deterministic": torch.backends.cudnn.deterministic,
                "cudnn_benchmark": torch.backends.cudnn.benchmark,
                "matmul_precision": torch.get_float32_matmul_precision(),
                "deterministic": torch.are_deterministic_algorithms_enabled(),
                "deterministic_warn": torch.is_deterministic_algorithms_warn_only_enabled(),
            },
            {s: signal.getsignal(s) for s in STOP_SIGNALS},
        )

    def restore(self) -> None:
        import numpy as np
        import torch

        torch.set_num_threads(self.threads)
        torch.set_rng_state(self.rng)
        np.random.set_state(self.np_rng)
        random.setstate(self.py_rng)
        torch.backends.cuda.matmul.allow_tf32 = self.flags["matmul_tf32"]
        torch.backends.cudnn.allow_tf32 = self.flags["cudnn_tf32"]
        torch.backends.cudnn.deterministic = self.flags["cudnn_deterministic"]
        torch.backends.cudnn.benchmark = self.flags["cudnn_benchmark"]
        torch.set_float32_matmul_precision(self.flags["matmul_precision"])
        if (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ) != (
            self.flags["deterministic"],
            self.flags["deterministic_warn"],
        ):  # the call imports torch._inductor (s)
            torch.use_deterministic_algorithms(
                self.flags["deterministic"], warn_only=self.flags["deterministic_warn"]
            )
        for signum, handler in self.handlers.items():
            signal.signal(signum, handler)


class Worker:
    """Runs trials one after another in this process; one SqlStore per store URL."""

    def __init__(self, channel: tuple[Connection, Connection]) -> None:
        self.inbox, self.outbox = channel  # the sweep's messages, and this worker's (fedcli.children.Channel)
        import fedcli.api  # noqa: F401 - what each trial runs: imported before the first (spawn_early)

        # a task's data, loaded once per worker (keyed by every loader option): run_config(data_cache=...)
        self.data: dict[tuple[Any, ...], Any] = {}
        self.stores: dict[str, Any] = {}
        self.state = ProcessState.capture()
        self.stop: int | None = None  # a stop signal that arrived while idle

    def _idle_signal(self, signum: int, _frame: object) -> None:
        self.stop = signum

    def serve(self) -> int:
        """Read and run trials until stdin ends (0) or a stop signal (128 + signal)."""
        while True:
            for signum in STOP_SIGNALS:
                signal.signal(signum, self._idle_signal)
            message = self._next_message()
            if message is None:
                return 0 if self.stop is None else 128 + self.stop
            outcome = self.run_trial(json.loads(message))
            self.send({"event": "ended", **outcome})
            if outcome.get("signal"):  # the sweep is stopping: this worker ends with the trial
                return 128 + int(outcome["signal"])

    def _next_message(self) -> bytes | None:
        """The sweep's next message; None at the end of its stdin or once a stop signal arrived (idle)."""
        with contextlib.suppress(EOFError):  # a signal does not interrupt poll (PEP 475): it sets self.stop
            while self.stop is None:
                if self.inbox.poll(0.2):
                    return self.inbox.recv_bytes()
        return None

    def send(self, event: dict[str, Any]) -> None:
        """One message to the sweep."""
        self.outbox.send_bytes(json.dumps(event).encode())

    def store(self, url: str) -> Any:
        from fedcli.tracking.store.sql_store import SqlStore

        if url not in self.stores:
            self.stores[url] = SqlStore(url)
        return self.stores[url]

    def run_trial(self, message: dict[str, Any]) -> dict[str, Any]:
        """Run one trial as `fedcli train` would; return the `ended` event's fields."""
        from fedcli.engine.lifecycle import GracefulSignals
        from fedcli.errors import FedcliError

        self.state.restore()  # every trial starts from the process as it was before the first
        os.environ.update(
            message.get("env") or {}
        )  # a worker started early: the URLs' passwords (trial_secrets)
        signals = GracefulSignals(immediate=True)  # set-up writes nothing: a stop there ends at once
        signals.install()
        tracker = None
        try:
            cfg, resume_id = self._config(message)
            from fedcli.api import run_config
            from fedcli.tracking.sinks import Tracker

            tracker = Tracker(
                self.store(cfg.tracking.store_url), None
            )  # MLflow: the sweep's one mirror copies it
            from fedcli.sweep.search import make_on_eval  # type: ignore[import-not-found, unused-ignore]

            hook = message.get("hook")
            # fedcli train's own path (fedcli/runs/run.py): validate and build, then train under preserved_state
            result = run_config(
                cfg,
                resume_run_id=resume_id,
                tracker=tracker,
                signals=signals,
                on_run=lambda run_id: self.send({"event": "started", "run_id": run_id}),
                data_cache=self.data,
                on_eval=None if hook is None else make_on_eval(hook),
            )
            return {
                "status": result.status,
                "run_id": result.run_id,
                "reason": "",
                "round": result.rounds_completed,
                "metrics": {k: float(v) for k, v in result.final_metrics.items()},
            }
        except (
            KeyboardInterrupt
        ) as stop:  # RunInterrupted: the run (if it started) is checkpointed, interrupted
            signum = getattr(stop, "signum", int(signal.SIGINT))
            return _ended("interrupted", tracker, f"stopped by {signal.Signals(signum).name}", signal=signum)
        except FedcliError as err:  # the line `fedcli train` would end with
            return _ended(
                "failed", tracker, "error: " + (str(err).splitlines()[0] if str(err) else type(err).__name__)
            )
        except Exception as err:  # noqa: BLE001 - a trial's crash costs that trial only; train() marked it failed
            log.debug("trial failed", exc_info=True)
            return _ended("failed", tracker, f"{type(err).__name__}: {err}"[:500])
        finally:
            signals.restore()
            self.state.restore()

    def _config(self, message: dict[str, Any]) -> tuple[Any, str | None]:
        """The trial's RunConfig (and the run it resumes), as `fedcli train --config | --resume` builds it."""
        import yaml

        from fedcli.config.build import build_config, resume_config
        from fedcli.runs.run import resumed_code

        if message.get("resume"):
            overrides = dict(message.get("overrides") or {})
            root = {
                k.split(".", 1)[1]: v
                for k, v in overrides.items()
                if k.startswith("tracking.") and v is not None
            }
            from fedcli.config.checks import build_section
            from fedcli.config.sections import TrackingConfig

            track = build_section("tracking", TrackingConfig, root)
            record = self.store(track.store_url).get_run(message["resume"])
            stored = record.requested or record.config
            # user code the run's row names runs only when the sweep's spec names the same (datasets/yours/trust.py)
            overrides = resumed_code(
                record.id,
                stored,
                record.config,
                overrides,
                trust=False,
                fix="the sweep's spec does not name it; resume that run yourself to allow it",
            )
            return resume_config(stored, overrides), record.id
        return build_config(
            doc=yaml.safe_load(message["config"]), overrides={"tracking.run_name": message.get("run_name")}
        ), None


def _ended(status: str, tracker: Any, reason: str, **extra: Any) -> dict[str, Any]:
    """The `ended` event's fields of a trial that did not finish (its run, if it started, is the tracker's)."""
    run_id = getattr(tracker, "_run_id", None)
    return {"status": status, "run_id": run_id, "reason": reason, "round": None, "metrics": {}, **extra}


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="fedcli worker: %(message)s", stream=sys.stderr)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    worker = Worker(child_channel())
    try:
        return worker.serve()
    finally:
        for store in worker.stores.values():
            with contextlib.suppress(Exception):  # noqa: BLE001 - closing only: every write is committed
                store.close()


if __name__ == "__main__":
    from fedcli.tracking.mlflow.lifeline import exit_now

    exit_now(
        main()
    )  # every trial written and its stores closed: skip the teardown the sweep's end waited for
