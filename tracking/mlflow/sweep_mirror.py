"""One MLflow mirror per sweep: `python -m fedcli.tracking.mlflow.sweep_mirror` copies each trial's run once it ended.

Sweep workers (fedcli/sweep/worker.py) train with the SQL store only; the sweep starts this one
process, at nice 19 (it yields a busy core to the trials and still progresses: not SCHED_IDLE), and
hands it each trial's run id as the trial ends (`SweepMirror.add`). It copies the run as `fedcli sync`
does (`Mirror.run_once`, in `main`: rounds, files, model, status, nested under the sweep's parent run) and takes
the next. No trial ever waits for it; the sweep's end waits for the copies still to do
(`SweepMirror.finish`, at most FINISH_WAIT_S; after a stop signal STOP_WAIT_S, then it goes on alone
in its own process group); once the sweep's messages end it leaves nice 19 to catch up (where the
system lets it). Once the sweep process is gone (exited, killed) it has ORPHAN_WAIT_S to finish, then
ends (`fedcli.tracking.mlflow.lifeline.watch_parent`). What it could not copy, `fedcli sync` copies
later (the store has it all). The cost: MLflow shows a trial once it ended, not round by round.

It also opens the sweep's MLflow parent run (`parent_run`: the experiment's run carrying the tags the
sweep hands it, so a rerun reuses it) and ends it once every trial is copied, as the sweep's last line
says: the sweep process never imports MLflow, and this module imports nothing of the sweep's.

Its stdin carries JSON messages framed by `multiprocessing.connection.Connection` (fedcli.children
`Channel`, `child_inbox`): first {"store": URL, "tracking_uri": URI, "sweep_spec": {...}, "parent_tags":
{...}} (secrets stay off the command line, docs/operations.md, "Security"), then {"run": RUN_ID} per
ended trial, then {"end": STATUS} (finished, failed, interrupted); end of file: copy what is left, end
the parent run (`interrupted` without an `end` message: the sweep died) and exit.
"""

from __future__ import annotations

import argparse
import json
import logging
import queue
import subprocess
import sys
import threading
from collections.abc import Mapping
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedcli import children
from fedcli.tracking.mlflow.handle import (
    FINISH_WAIT_S,
    STOP_WAIT_S,
    _death,
    _own_reason,
    parent_env,
    wait_ended,
)
from fedcli.tracking.mlflow.lifeline import (
    exit_now,
    low_priority,
    normal_priority,
    quiet_mlflow,
    read_urls,
    watch_parent,
)
from fedcli.tracking.urls import mask_url

if TYPE_CHECKING:
    from fedcli.tracking.mlflow.sink import MlflowSink

log = logging.getLogger(__name__)

PARENT_NOT_ENDED = "MLflow could not end the sweep's run"


class SweepMirror:
    """The sweep's handle on its one mirror process: `spawn`, `add(run_id)` per ended trial, `finish`."""

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
        self.added: list[str] = []
        self._proc: subprocess.Popen[bytes] | None = None
        self._channel: children.Channel | None = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def spawn(
        self, spec: Mapping[str, Any] | None = None, tags: Mapping[str, str] | None = None
    ) -> SweepMirror:
        """Start the mirror; with the sweep's `spec` and the `tags` that find its MLflow parent run
        (`fedcli.sweep.rows.parent_tags`), it opens (or reuses) that run itself and nests the trials
        under it (`parent_run`): the sweep never imports MLflow."""
        if spec is not None and not tags:  # no tag to search by would find any run of the experiment
            raise ValueError("SweepMirror.spawn: a sweep's spec comes with the tags that find its parent run")
        command = [
            sys.executable,
            "-m",
            "fedcli.tracking.mlflow.sweep_mirror",
            "--experiment",
            self.experiment,
            "--runs-root",
            str(self.runs_root),
        ]
        if self.parent_run_id:
            command += ["--parent-run", self.parent_run_id]
        # its own process group: a Ctrl-C in the terminal stops the sweep; the mirror finishes its copies
        # (not its own session: see fedcli.children.own_process_group)
        self._proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=parent_env(),
            **children.own_process_group(),
        )
        self._channel = children.Channel(self._proc)
        first: dict[str, Any] = {"store": self.store_url, "tracking_uri": self.tracking_uri}
        if spec is not None and tags:  # JSON-able as the spec's YAML reads back (dates as text)
            first["sweep_spec"], first["parent_tags"] = (
                json.loads(json.dumps(dict(spec), default=str)),
                dict(tags),
            )
        self._send(first)
        return self

    def _send(self, message: Mapping[str, Any]) -> bool:
        return self._channel is not None and self._channel.send(message)

    def add(self, run_id: str) -> None:
        """Hand an ended trial's run to the mirror (it copies it in the background)."""
        if run_id not in self.added:
            self.added.append(run_id)
            self._send({"run": run_id})

    def finish(
        self, stopping: bool = False, timeout_s: float = FINISH_WAIT_S, status: str | None = None
    ) -> str | None:
        """End its messages (the sweep's end) and wait for the copies still to do; return a warning, if any.

        `status`: how the sweep ended (`finished`, `failed`, `interrupted`), which the mirror sets on the
        sweep's MLflow parent run once every trial is copied (without one: `interrupted`).
        """
        if status is not None:
            self._send({"end": status})
        proc, self._proc, channel, self._channel = self._proc, None, self._channel, None
        if proc is None or channel is None:
            return None
        channel.close()
        err, late = wait_ended(proc, STOP_WAIT_S if stopping else timeout_s)
        if late is not None:
            return (
                f"the sweep's MLflow mirror (pid {proc.pid}) still copies trials in the background; the SQL "
                "store is complete, and `fedcli sync` copies into MLflow what it misses"
            )
        if proc.returncode != 0:
            parent = _own_reason(err or b"")
            if parent is not None and parent.startswith(
                PARENT_NOT_ENDED
            ):  # the trials are copied: its own line
                return parent
            return (
                f"the sweep's MLflow mirror (pid {proc.pid}) {_death(proc, err)}; the SQL store is complete, "
                "`fedcli sync` copies the trials into MLflow later"
            )
        return None


def _quoted(value: str) -> str:
    """`value` inside single quotes of an MLflow search filter."""
    return value.replace("\\", "\\\\").replace("'", "\\'")


def parent_run(tracking_uri: str, spec: Mapping[str, Any], tags: Mapping[str, str]) -> MlflowSink:
    """Open the sweep's MLflow parent run: the experiment's run carrying every one of `tags`, else a new one
    with `tags`, `fedcli.kind=sweep` and the spec as `sweep.yaml`.

    Raises:
        TrackingError: MLflow cannot be opened or written.
    """
    import yaml
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from fedcli.errors import TrackingError
    from fedcli.tracking.mlflow.checks import schema_lock
    from fedcli.tracking.mlflow.sink import MlflowSink

    experiment = spec["experiment"]
    with schema_lock(tracking_uri):  # N processes on a fresh root set MLflow's schema up once
        sink = MlflowSink(tracking_uri, experiment)
    match = " AND ".join(f"tags.`{key}` = '{_quoted(value)}'" for key, value in tags.items())
    try:
        found = MlflowClient(tracking_uri=tracking_uri).search_runs(
            [sink.experiment_id], filter_string=match, order_by=["attributes.start_time ASC"], max_results=1
        )
    except MlflowException as err:
        raise TrackingError(
            f"MLflow store {mask_url(tracking_uri)!r} could not be searched: {mask_url(str(err))}; "
            "pass --tracking-uri with a reachable MLflow store or use --no-mlflow"
        ) from err
    if found:
        sink.attach(found[0].info.run_id)
        return sink
    sink.start_run(run_name=f"sweep {experiment}", params={}, tags={**tags, "fedcli.kind": "sweep"})
    sink.log_text(yaml.safe_dump(dict(spec), sort_keys=False), "sweep.yaml")
    return sink


def _read_messages(inbox: Connection, messages: queue.Queue[dict[str, Any] | None], nice: int) -> None:
    """Queue the messages the sweep sends ({"run": ...}, {"end": ...}), then None at the end of its stdin."""
    while (message := children.receive(inbox)) is not None:
        messages.put(message)
    # no trial trains any more, and the sweep's end waits for these copies: back to the sweep's nice value
    # now (every thread: Linux schedules threads), where the system lets it, not after the copies queued
    normal_priority(nice)
    messages.put(None)


def main(argv: list[str] | None = None) -> int:
    """The sweep's mirror process (module docstring)."""
    parser = argparse.ArgumentParser(
        prog="python -m fedcli.tracking.mlflow.sweep_mirror",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    parser.add_argument("--experiment", required=True)
    parser.add_argument("--runs-root", required=True)
    parser.add_argument("--parent-run")
    args = parser.parse_args(argv)
    from fedcli.tracking.mlflow.checks import first_cause_line
    from fedcli.tracking.mlflow.mirror import Mirror

    args.lifeline = watch_parent()  # the sweep gone: at most ORPHAN_WAIT_S to copy what it can, then it ends
    nice = low_priority()  # even MLflow's import yields a core the trials want
    logging.basicConfig(level=logging.WARNING, format="fedcli sweep mirror: %(message)s")
    inbox = children.child_inbox()
    # None: spawned for a sweep that ended before it sent anything; read_urls says so
    if not read_urls(args, children.receive(inbox)):
        return 2
    import fedcli.tracking.mlflow.sink  # noqa: F401 - the slow import, while the first trials train

    quiet_mlflow()
    parent = None
    if (
        args.sweep_spec is not None
    ):  # the sweep's MLflow run: opened here, not in the sweep (2.3 s before trial 1)
        try:
            with (
                args.lifeline.mlflow_set_up()
            ):  # the schema, under its lock: never cut short by `watch_parent`
                parent = parent_run(args.tracking_uri, args.sweep_spec, args.parent_tags)
        except Exception as err:  # noqa: BLE001 - one line the sweep quotes; the SQL store has every trial
            print(
                f"MLflow mirror: the sweep's MLflow run could not be opened ({type(err).__name__}: "
                f"{first_cause_line(err)}); pass --tracking-uri with a writable MLflow store or use --no-mlflow",
                file=sys.stderr,
            )
            return 1
        args.parent_run = parent.run_id
    messages: queue.Queue[dict[str, Any] | None] = queue.Queue()
    threading.Thread(target=_read_messages, args=(inbox, messages, nice), daemon=True).start()
    failed, status = 0, "interrupted"  # no `end` message: the sweep died
    # None: the sweep ended (or died); the reader left nice 19 then (it waits for these)
    while (message := messages.get()) is not None:
        if message.get("end"):
            status = str(message["end"])
        if not message.get("run"):
            continue
        run_id = str(message["run"])
        try:  # copied as `fedcli sync` does, nested under the sweep's parent run
            Mirror(argparse.Namespace(**vars(args), run=run_id)).run_once()  # its folder: runs_root/run
        except Exception as err:  # noqa: BLE001 - one run's failure leaves the others to copy
            failed += 1
            print(
                f"MLflow mirror: run {run_id[:8]}: {type(err).__name__}: {first_cause_line(err)}",
                file=sys.stderr,
            )
    if parent is not None:
        try:
            parent.end_run(status)
        except Exception as err:  # noqa: BLE001 - the trials are copied; the parent stays open: one line
            print(
                f"MLflow mirror: {PARENT_NOT_ENDED} ({first_cause_line(err)}); it stays open, and rerunning the sweep "
                "ends it.",
                file=sys.stderr,
            )
            return 1
    return 1 if failed else 0  # exit_now flushes stdout and stderr


if __name__ == "__main__":
    exit_now(main())  # all copied: skip the interpreter's teardown (1.4 s the sweep would wait for)
