"""Sweeps own their trials, checked with real processes: `python -m fedcli sweep` on a fresh `--root`,
its trials real `fedcli train` children, killed and signalled for real, the stores read back.

- a 2x1 sweep with --workers 2 finishes every trial, as nested MLflow children of one parent
  run; a rerun skips them, and a rerun that has a trial to resume reuses that parent;
- SIGKILL of the sweep stops its trials in order (PR_SET_PDEATHSIG: they checkpoint, read
  `interrupted`, and no process is left); a rerun started at once resumes each from its
  checkpoint under the same run id (round 1 is not trained again), one run per config hash;
- a rerun while a trial is alive in another process does not start it again; SIGTERM to the
  sweep stops it with exit code 143 and checkpointed, interrupted trials.

Trials are federated least squares (11 parameters): slow enough to kill only through their
number of rounds, and the trial processes' start-up (importing torch) dominates the runtime.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from fedcli.tracking.store.records import RunRecord
from fedcli.tracking.store.sql_store import SqlStore

T = TypeVar("T")
ROUNDS_NEVER_REACHED = 100_000  # a trial that is stopped, never finished
START_S = 240.0  # how long a sweep may take to get its trials going on a busy 2-core box
pytestmark = pytest.mark.timeout(600)


def write_spec(
    folder: Path, experiment: str, rounds: int, server_opts: list[str], local_epochs: int = 1
) -> Path:
    """lsq trials: ~25 ms a round; 2 local epochs of batch 5 make it ~50-150 ms (time to kill mid-way)."""
    path = folder / f"{experiment}.yaml"
    path.write_text(
        f"experiment: {experiment}\n"
        f"base: {{task: lsq, rounds: {rounds}, clients_per_round: 4, local_epochs: {local_epochs}, "
        f"batch_size: 5}}\n"
        f"grid: {{server_opt: [{', '.join(server_opts)}]}}\nseeds: [0]\n"
    )
    return path


def sweep(root: Path, spec: Path, *args: str) -> subprocess.Popen[str]:
    """Start `fedcli sweep SPEC --root ROOT ARGS` as its own process (output captured)."""
    env = {k: v for k, v in os.environ.items() if k not in ("FEDCLI_STORE", "MLFLOW_TRACKING_URI")}
    env.update(OMP_NUM_THREADS="1", COLUMNS="200")  # wide tables: no status cut across lines
    return subprocess.Popen(
        [sys.executable, "-m", "fedcli", "sweep", str(spec), "--root", str(root), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=root,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 300.0) -> tuple[int, str]:
    """Wait for a sweep; return (exit code, stderr)."""
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def store(root: Path) -> SqlStore:
    return SqlStore(f"sqlite:///{root / 'fedcli.db'}")


def runs(root: Path) -> list[RunRecord]:
    return store(root).list_runs() if (root / "fedcli.db").exists() else []


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = START_S) -> T:
    """Poll `probe` until it returns something truthy; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def run_at_round(root: Path, at_least: int) -> Callable[[], RunRecord | None]:
    """A probe: some live run of the store has logged round >= at_least."""

    def probe() -> RunRecord | None:
        db = store(root) if (root / "fedcli.db").exists() else None
        return next(
            (
                r
                for r in (db.list_runs() if db else [])
                if r.is_alive and (db.last_round(r.id) or 0) >= at_least
            ),
            None,
        )

    return probe


def children(pid: int) -> list[int]:
    """Process ids whose parent is `pid` (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def gone(pid: int) -> bool:
    """True when `pid` no longer runs (absent, or a zombie waiting to be reaped)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def one_run_per_hash(records: list[RunRecord]) -> dict[str, RunRecord]:
    by_hash = {r.tags["fedcli.config_hash"]: r for r in records}
    assert len(by_hash) == len(records), "a trial was started twice"
    return by_hash


def test_sweep_finishes_all_trials_as_mlflow_children_and_rerun_skips_or_reuses_parent(
    tmp_path: Path,
) -> None:
    """2 trials, --workers 2, real SQLite MLflow store: both finish as children of one parent run
    tagged with the sweep; a rerun skips both; after one run is marked interrupted a rerun resumes
    it under the same MLflow child and parent (no second parent)."""
    from mlflow.tracking import MlflowClient

    spec = write_spec(tmp_path, "mlf", rounds=2, server_opts=["sgd", "adam"])
    code, err = finish(sweep(tmp_path, spec, "--workers", "2"))
    assert code == 0, err
    assert "sweep done: 2 finished." in err and sorted(r.status for r in runs(tmp_path)) == ["finished"] * 2
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("mlf").experiment_id
    parents = client.search_runs([experiment], "tags.`fedcli.sweep` = 'mlf'")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    kids = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parents[0].info.run_id}'")
    assert sorted(k.data.tags["mlflow.runName"] for k in kids) == [
        "fedavg server_opt=adam s0",
        "fedavg server_opt=sgd s0",
    ]
    assert {k.info.status for k in kids} == {"FINISHED"}

    code, err = finish(sweep(tmp_path, spec))
    assert code == 0 and "sweep done: 2 finished (skip)." in err, err

    victim = runs(tmp_path)[0]
    store(tmp_path).end_run(victim.id, "interrupted", reason="test: stopped")
    code, err = finish(sweep(tmp_path, spec))
    assert code == 0, err
    assert [r.status for r in runs(tmp_path)] == ["finished"] * 2 and len(runs(tmp_path)) == 2
    assert len(client.search_runs([experiment], "tags.`fedcli.sweep` = 'mlf'")) == 1
    assert len(client.search_runs([experiment], "")) == 3  # parent + 2 children: nothing new


def test_sigkilled_sweep_stops_its_trials_and_an_immediate_rerun_resumes_them(tmp_path: Path) -> None:
    """SIGKILL the sweep once a trial is at round >= 2 and rerun it at once: every trial process
    ends within seconds, stopped by SIGTERM (PR_SET_PDEATHSIG) and so stored `interrupted` with a
    checkpoint, which the rerun's plan shows; the rerun continues each run under its id from its
    checkpoint (round 1's rows keep their first logging time), one run per config hash, and finishes."""
    spec = write_spec(tmp_path, "kill", rounds=60, server_opts=["sgd", "adam"], local_epochs=2)
    proc = sweep(tmp_path, spec, "--no-mlflow", "--workers", "2")
    wait_for("a trial at round 2", run_at_round(tmp_path, 2))
    trials = children(proc.pid)
    db = store(tmp_path)
    round_one = {r.id: db.round_rows(r.id, 0, 1) for r in db.list_runs() if (db.last_round(r.id) or 0) >= 2}
    assert len(trials) == 2 and round_one

    proc.kill()
    rerun = sweep(tmp_path, spec, "--no-mlflow", "--workers", "2")
    wait_for("the killed sweep's trials to end", lambda: all(gone(pid) for pid in trials), timeout=60)
    code, err = finish(rerun)

    assert code == 0, err
    assert "running elsewhere" not in err
    after = one_run_per_hash(runs(tmp_path))
    assert len(after) == 2 and {r.status for r in after.values()} == {"finished"}
    for run_id, rows in round_one.items():
        assert f"resume {run_id[:8]}" in err and "stopped by SIGTERM" in err  # the same run, continued
        assert store(tmp_path).round_rows(run_id, 0, 1) == rows  # from its checkpoint: round 1 not redone
    for record in after.values():
        assert sorted(set(store(tmp_path).metrics_frame([record.id])["round_idx"])) == list(range(61))


def test_rerun_leaves_a_live_trial_alone_and_sigterm_stops_the_sweep_with_143(tmp_path: Path) -> None:
    """While sweep A trains its trial, sweep B with the same spec shows it running elsewhere and
    starts nothing; SIGTERM to A is forwarded, A exits 143, the trial is interrupted and checkpointed."""
    spec = write_spec(tmp_path, "live", rounds=ROUNDS_NEVER_REACHED, server_opts=["sgd"])
    first = sweep(tmp_path, spec, "--no-mlflow")
    live = wait_for("the trial at round 2", run_at_round(tmp_path, 2))

    code, err = finish(sweep(tmp_path, spec, "--no-mlflow"))
    assert code == 0 and "running elsewhere" in err, err
    assert [r.id for r in runs(tmp_path)] == [live.id] and store(tmp_path).get_run(live.id).is_alive

    first.send_signal(signal.SIGTERM)
    code, err = finish(first, timeout=120)
    assert code == 143, err
    assert "sweep stopped by SIGTERM" in err and "fedcli sweep" in err  # the rerun hint
    stopped = store(tmp_path).get_run(live.id)
    assert stopped.stored_status == "interrupted" and "SIGTERM" in (stopped.failure_reason or "")
    assert (
        store(tmp_path).checkpoints(live.id)[-1][0]
        == store(tmp_path).last_round(live.id)
        < ROUNDS_NEVER_REACHED
    )
