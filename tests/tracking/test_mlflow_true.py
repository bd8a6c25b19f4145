"""MLflow stays true to the store (issue 23): `fedcli sync` keeps the store's times and is silent with
nothing to do; a mirror process that dies alone is restarted and MLflow still gets every round.

Real `fedcli` processes, a real SQLite-backed MLflow store read back with sqlite3, real SIGKILLs.
docs/operations.md, "The MLflow mirror" says what these check.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedcli.tracking.mlflow.handle import MirrorHandle
from fedcli.tracking.mlflow.sink import default_tracking_uri
from fedcli.tracking.sinks import Tracker
from fedcli.tracking.store.sql_store import SqlStore

TINY = ["--task", "lsq", "--clients-per-round", "4"]


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k not in ("FEDCLI_STORE", "MLFLOW_TRACKING_URI")}
    return {**out, "OMP_NUM_THREADS": "1"}


def fedcli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fedcli", *args], capture_output=True, text=True, timeout=300, env=env()
    )


def mlflow_runs(root: Path) -> dict[str, tuple[str, int, int | None, int, int]]:
    """fedcli run id -> (MLflow status, start ms, end ms, metric rows, distinct (key, step)) from mlflow.db."""
    with sqlite3.connect(root / "mlflow.db") as conn:
        rows = conn.execute(
            "SELECT t.value, r.status, r.start_time, r.end_time, "
            "(SELECT count(*) FROM metrics m WHERE m.run_uuid = r.run_uuid), "
            "(SELECT count(DISTINCT m.key || '|' || m.step) FROM metrics m WHERE m.run_uuid = r.run_uuid) "
            "FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid AND t.key = 'fedcli.run_id'"
        ).fetchall()
    return {row[0]: tuple(row[1:]) for row in rows}  # type: ignore[misc]


def logged_models(root: Path) -> int:
    with sqlite3.connect(root / "mlflow.db") as conn:
        return int(conn.execute("SELECT count(*) FROM logged_models").fetchone()[0])


def ms(moment: object) -> int:
    return int(moment.timestamp() * 1000)  # type: ignore[attr-defined]


def test_sync_keeps_the_stores_times_and_a_second_sync_is_silent(tmp_path: Path) -> None:
    """Two runs trained with --no-mlflow, synced 3 s after they ended: each MLflow run starts and ends
    when the store says (to the millisecond), so the UI's duration is the run's, not the time to the
    sync; finished, with every point once and one logged model. A second sync prints nothing, adds
    no point, no model and no artifact, and leaves the times alone."""
    for seed in ("0", "1"):
        done = fedcli(
            "-q", "train", *TINY, "--rounds", "3", "--seed", seed, "--root", str(tmp_path), "--no-mlflow"
        )
        assert done.returncode == 0, done.stderr
    time.sleep(3)
    first = fedcli("sync", "--root", str(tmp_path))
    assert first.returncode == 0 and "pickle" not in first.stderr.lower(), first.stderr
    assert [line for line in first.stderr.splitlines() if line.strip()] == [
        f"2 run(s) copied into MLflow at sqlite:///{tmp_path / 'mlflow.db'}"
    ]
    db = SqlStore(f"sqlite:///{tmp_path / 'fedcli.db'}")
    runs = mlflow_runs(tmp_path)
    for record in db.list_runs():
        status, start, end, points, distinct = runs[record.id]
        assert record.ended_at is not None
        assert (status, start, end) == ("FINISHED", ms(record.created_at), ms(record.ended_at))
        assert points == distinct == len(db.metrics_frame([record.id]))
    assert logged_models(tmp_path) == 2
    artifacts = sorted(p.relative_to(tmp_path) for p in (tmp_path / "mlartifacts").rglob("*") if p.is_file())

    second = fedcli("sync", "--root", str(tmp_path))
    assert second.returncode == 0 and second.stdout == "" and second.stderr == "", second.stderr
    assert mlflow_runs(tmp_path) == runs and logged_models(tmp_path) == 2
    assert (
        sorted(p.relative_to(tmp_path) for p in (tmp_path / "mlartifacts").rglob("*") if p.is_file())
        == artifacts
    )


def test_a_run_with_mlflow_ends_there_when_the_store_says(tmp_path: Path) -> None:
    """A run trained with its mirror: the MLflow run's start and end are the store's, to the millisecond."""
    done = fedcli("-q", "train", *TINY, "--rounds", "3", "--root", str(tmp_path))
    assert done.returncode == 0, done.stderr
    record = SqlStore(f"sqlite:///{tmp_path / 'fedcli.db'}").list_runs()[0]
    status, start, end, points, distinct = mlflow_runs(tmp_path)[record.id]
    assert record.ended_at is not None
    assert (status, start, end) == ("FINISHED", ms(record.created_at), ms(record.ended_at))
    assert points == distinct > 0


def test_a_mirror_killed_during_the_run_is_restarted_and_mlflow_gets_every_round(tmp_path: Path) -> None:
    """SIGKILL to the MLflow mirror alone while the run trains: the run goes on and exits 0; its
    warning says the mirror was killed by SIGKILL and restarted; the MLflow run ends FINISHED with
    every point of the store exactly once and the final model."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedcli", "-q", "train", *TINY, "--rounds", "400", "--root", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(),
    )
    mirror = None
    deadline = time.monotonic() + 200
    while mirror is None and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
        if not (tmp_path / "fedcli.db").exists():
            continue
        try:
            with contextlib.closing(sqlite3.connect(tmp_path / "fedcli.db", timeout=30)) as conn:
                (logged,) = conn.execute("SELECT count(DISTINCT round_idx) FROM round_metrics").fetchone()
        except sqlite3.OperationalError:  # the schema is being set up
            continue
        if logged < 20:  # rounds are in the store: the mirror runs and has copied some
            continue
        for child in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split():
            if b"fedcli.tracking.mlflow.mirror" in Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0"):
                mirror = int(child)
    assert mirror is not None, "the mirror process was not found while the run trained"
    os.kill(mirror, signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    said = " ".join(err.split())
    assert f"MLflow mirror (pid {mirror}) was killed by SIGKILL; restarted it" in said, err
    run_id = out.strip().splitlines()[-1]
    db = SqlStore(f"sqlite:///{tmp_path / 'fedcli.db'}")
    status, _, end, points, distinct = mlflow_runs(tmp_path)[run_id]
    assert (status, points, distinct) == ("FINISHED", len(db.metrics_frame([run_id])), points)
    assert end == ms(db.get_run(run_id).ended_at) and logged_models(tmp_path) == 1


@pytest.mark.timeout(240)
def test_a_mirror_killed_after_the_last_round_is_restarted_before_the_run_exits(
    store: SqlStore, tmp_path: Path
) -> None:
    """The mirror dies after the last round was logged (no round left to notice it): `Tracker.finish`
    restarts it, waits for it, and warns with the signal; MLflow gets every round and FINISHED."""
    uri = default_tracking_uri(tmp_path)
    mirror = MirrorHandle(
        tracking_uri=uri,
        experiment="killed",
        store_url=store.url.replace("***", ""),
        runs_root=tmp_path / "runs",
    )
    tracker = Tracker(store, mirror.spawn())
    run_id = tracker.start(
        experiment="killed",
        run_name=None,
        config={"seed": 0},
        algo="fedavg",
        task="lsq",
        seed=0,
        dataset="lsq",
        partitioner="natural",
        fedcli_version="t",
        torch_version="t",
    )
    for round_idx in range(4):
        tracker.log_round(round_idx, {"eval/loss": 1.0 / (round_idx + 1)})
    first = mirror._proc
    assert first is not None
    os.kill(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    tracker.finish("finished")
    assert len(tracker.warnings) == 1, tracker.warnings
    assert tracker.warnings[0].startswith(
        f"MLflow mirror (pid {first.pid}) was killed by SIGKILL; restarted it at "
        "the run's end, which copied the run into MLflow"
    )
    with sqlite3.connect(tmp_path / "mlflow.db") as conn:
        (status,) = conn.execute(
            "SELECT r.status FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid AND "
            "t.key = 'fedcli.run_id' WHERE t.value = ?",
            (run_id,),
        ).fetchone()
        steps = [s for (s,) in conn.execute("SELECT step FROM metrics WHERE key = 'eval/loss' ORDER BY step")]
    assert (status, steps) == ("FINISHED", [0, 1, 2, 3])
