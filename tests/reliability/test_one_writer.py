"""One writer per run and per trial, checked with real processes and real signals (issue 23, rows 3-4).

- Two `fedcli sweep` of one spec on one store, started together (SQLite and PostgreSQL; 2 and
  5 s apart in the soak): each trial runs once (trials are claimed in the store, `trial_claims`), both sweeps exit 0, and
  no claim is left behind.
- A training process stopped by SIGSTOP past the staleness limit (`FEDCLI_STALE_S=2`, so the
  test does not wait 60 s) cannot be taken over on its own host: `--resume` is refused and
  says the process is stopped. When its owner cannot be seen (the run's host column says
  another machine, as for a laptop suspended elsewhere), the resume takes the lease; the old
  process, continued with SIGCONT, writes nothing more (the store's rounds and checkpoints
  are byte-identical before and after it ran again), says who took the run over and exits 75;
  the resumed run finishes with exactly one MLflow point per (metric, round). The old owner's MLflow
  mirror stops without ending the MLflow run (before: it marked it KILLED while the resumer trained).

Both processes are stopped only outside a store transaction (a process stopped holding the
store's write lock is the stalled-store case of test_stalled_store.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import text

from fedcli.tracking.store.common import TAKEN_OVER_EXIT
from fedcli.tracking.store.engine import sqlite_lock_holder
from fedcli.tracking.store.sql_store import SqlStore

pytestmark = pytest.mark.timeout(600)
START_S = 240.0  # a process's start-up on a loaded 2-core box (importing torch, MLflow)


STARTED: list[subprocess.Popen[str]] = []  # this test's processes, ended after it (`_end_started`)


@pytest.fixture(autouse=True)
def _end_started() -> Iterator[None]:
    """A test that fails midway leaves no process behind (a SIGSTOPped trainer would live on for good)."""
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.communicate()


def spawn(args: list[str], cwd: Path, **env: str) -> subprocess.Popen[str]:
    """`python -m fedcli ARGS` with output captured; FEDCLI_STORE/MLFLOW_TRACKING_URI from the caller dropped."""
    base = {k: v for k, v in os.environ.items() if k not in ("FEDCLI_STORE", "MLFLOW_TRACKING_URI")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedcli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env={**base, "OMP_NUM_THREADS": "1", "COLUMNS": "200", **env},
    )
    STARTED.append(proc)
    return proc


def wait_for(what: str, probe: Callable[[], object], timeout: float = START_S) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def in_transaction(store_url: str, pid: int) -> bool:
    """True when process `pid` may be inside a store transaction (SQLite: it holds the write lock;
    PostgreSQL: some session of the database is in a transaction or running a statement)."""
    if store_url.startswith("sqlite"):
        return sqlite_lock_holder(Path(store_url.removeprefix("sqlite:///"))) == pid
    with SqlStore(store_url, setup_schema=False)._engine.connect() as conn:  # noqa: SLF001 - a test probe
        busy = conn.execute(
            text(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND state <> 'idle'"
            )
        ).scalar_one()
    return bool(busy)


def stop_outside_transaction(proc: subprocess.Popen[str], store_url: str) -> None:
    """SIGSTOP `proc` at a moment it holds no store transaction (retried within a few ms otherwise)."""
    for _ in range(2000):
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(0.02)  # the stop takes effect
        if not in_transaction(store_url, proc.pid):
            return
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.003)
    raise AssertionError(f"pid {proc.pid} was always inside a store transaction")


def mirror_of(pid: int) -> int | None:
    """The MLflow mirror process that training process `pid` spawned (from /proc), if it runs."""
    for entry in Path("/proc").iterdir():
        try:
            if (
                entry.name.isdigit()
                and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid
                and b"fedcli.tracking.mlflow." in (entry / "cmdline").read_bytes()
            ):
                return int(entry.name)
        except OSError:
            continue
    return None


def gone(pid: int) -> bool:
    """True when `pid` no longer runs (absent, or a zombie)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def store_snapshot(db: SqlStore, run_id: str) -> tuple[list[tuple], list[tuple]]:
    """Everything a round writes: the round rows with their logging times, and the checkpoint rows."""
    return db.round_rows(run_id, -1, 10**9), db.checkpoints(run_id)


# --------------------------------------------------------------------------- two sweeps of one spec


def write_spec(folder: Path, seeds: list[int]) -> Path:
    """2 lsq trials per seed, of 2 rounds: seconds each, mostly the trial process's start-up."""
    path = folder / "spec.yaml"
    path.write_text(
        "experiment: twice\nbase: {task: lsq, rounds: 2, clients_per_round: 4}\n"
        f"grid: {{server_opt: [sgd, adam]}}\nseeds: {seeds}\n"
    )
    return path


def two_sweeps(tmp_path: Path, store_url: str, apart_s: float, seeds: list[int]) -> None:
    """Before the claims: every trial ran twice (8 runs for 4 trials, both sweeps exit 0)."""
    spec = write_spec(tmp_path, seeds)
    args = ["sweep", str(spec), "--root", str(tmp_path / "root"), "--store", store_url, "--no-mlflow"]
    first = spawn(args, tmp_path)
    time.sleep(apart_s)
    second = spawn(args, tmp_path)
    outs = [proc.communicate(timeout=500) for proc in (first, second)]
    assert [first.returncode, second.returncode] == [0, 0], [err[-2000:] for _, err in outs]
    db = SqlStore(store_url)
    runs = db.list_runs()
    hashes = [r.config_hash for r in runs]
    trials = 2 * len(seeds)
    assert len(runs) == trials and len(set(hashes)) == trials, (
        f"{len(runs)} runs for {len(set(hashes))} trials"
    )
    assert {r.status for r in runs} == {"finished"}
    for _, err in outs:
        assert "sweep done:" in err and "Traceback" not in err
    with db._engine.connect() as conn:  # noqa: SLF001 - every claim was given back
        assert conn.execute(text("SELECT count(*) FROM trial_claims")).scalar_one() == 0


def test_two_sweeps_of_one_spec_started_together_run_each_trial_once_sqlite(tmp_path: Path) -> None:
    two_sweeps(tmp_path, f"sqlite:///{tmp_path / 'root' / 'fedcli.db'}", apart_s=0.0, seeds=[0])


def test_two_sweeps_of_one_spec_started_together_run_each_trial_once_postgresql(
    tmp_path: Path, pg_url: str
) -> None:
    two_sweeps(tmp_path, pg_url, apart_s=0.0, seeds=[0])


@pytest.mark.soak
@pytest.mark.parametrize("apart_s", [2.0, 5.0])
def test_two_sweeps_of_one_spec_seconds_apart_run_each_trial_once_soak(
    tmp_path: Path, apart_s: float
) -> None:
    two_sweeps(tmp_path, f"sqlite:///{tmp_path / 'root' / 'fedcli.db'}", apart_s=apart_s, seeds=[0, 1])


# --------------------------------------------------------------------------- a stopped run


def stopped_run_is_never_written_twice(tmp_path: Path, store_url: str) -> None:
    root = tmp_path / "root"
    mlflow_uri = f"sqlite:///{root / 'mlflow.db'}"
    common = ["--root", str(root), "--store", store_url, "--tracking-uri", mlflow_uri]
    env = {"FEDCLI_STALE_S": "2"}
    old = spawn(
        ["-q", "train", "--task", "lsq", "--clients-per-round", "4", "--rounds", "300", *common],
        tmp_path,
        **env,
    )
    db = SqlStore(store_url)
    run_id = str(
        wait_for(
            "round 5", lambda: next((r.id for r in db.list_runs() if (db.last_round(r.id) or 0) >= 5), None)
        )
    )
    stop_outside_transaction(old, store_url)
    # its mirror, found now: after the takeover below it may see the lease gone and end on its own
    # before the old owner is continued (a full suite on a loaded machine saw it gone)
    old_mirror = mirror_of(old.pid)
    assert old_mirror is not None
    time.sleep(3.0)  # the heartbeat is now older than FEDCLI_STALE_S
    assert db.get_run(run_id).status == "running"  # stopped is alive on its own host

    refused = spawn(["-q", "train", "--resume", run_id[:8], *common], tmp_path, **env)
    _, err = refused.communicate(timeout=300)
    assert refused.returncode == 2, err
    assert f"still running (pid {old.pid} on {socket.gethostname()}" in err and "kill -CONT" in err, err

    # the owner cannot be seen any more: its host column says another machine, its heartbeat is stale
    with db._engine.begin() as conn:  # noqa: SLF001
        conn.execute(text("UPDATE runs SET host = 'another-machine' WHERE id = :id"), {"id": run_id})
    resumer = spawn(["-q", "train", "--resume", run_id[:8], *common], tmp_path, **env)
    wait_for(
        "the resumed run's first round",
        lambda: (
            db.get_run(run_id).pid == resumer.pid
            and db.round_rows(run_id, -1, 10**9)
            and resumer.poll() is None
        ),
    )
    stop_outside_transaction(resumer, store_url)
    before = store_snapshot(db, run_id)

    os.kill(old.pid, signal.SIGCONT)
    _, err = old.communicate(timeout=120)
    assert old.returncode == TAKEN_OVER_EXIT, err
    assert (
        f"was taken over by pid {resumer.pid} on host {socket.gethostname()}; this process stopped writing"
        in " ".join(err.split())
    ), err
    assert "Traceback" not in err
    assert store_snapshot(db, run_id) == before  # not one row more, changed or dropped by the old owner
    wait_for("the old owner's mirror to end", lambda: gone(old_mirror), timeout=120)
    with sqlite3.connect(
        f"file:{root / 'mlflow.db'}?mode=ro", uri=True
    ) as conn:  # the old mirror ended nothing
        assert conn.execute("SELECT status, end_time FROM runs").fetchall() == [("RUNNING", None)]
        assert conn.execute("SELECT value FROM tags WHERE key = 'fedcli.status'").fetchall() == []

    os.kill(resumer.pid, signal.SIGCONT)
    out, err = resumer.communicate(timeout=300)
    assert resumer.returncode == 0, err
    record = db.get_run(run_id)
    assert record.status == "finished" and record.pid == resumer.pid
    assert sorted(set(db.metrics_frame([run_id])["round_idx"])) == list(range(301))
    with sqlite3.connect(root / "mlflow.db") as conn:
        rows, distinct = conn.execute(
            "SELECT count(*), count(DISTINCT run_uuid || '|' || key || '|' || step) FROM metrics"
        ).fetchone()
        steps = {s for (s,) in conn.execute("SELECT DISTINCT step FROM metrics WHERE key = 'eval/loss'")}
        status = conn.execute("SELECT status FROM runs").fetchall()
    assert rows == distinct, f"{rows - distinct} duplicate MLflow points"
    assert steps == set(range(301)) and status == [("FINISHED",)]


def test_a_stopped_run_is_refused_then_a_taken_over_owner_stops_writing_sqlite(tmp_path: Path) -> None:
    stopped_run_is_never_written_twice(tmp_path, f"sqlite:///{tmp_path / 'root' / 'fedcli.db'}")


@pytest.mark.soak
def test_a_stopped_run_is_refused_then_a_taken_over_owner_stops_writing_postgresql_soak(
    tmp_path: Path, pg_url: str
) -> None:
    stopped_run_is_never_written_twice(tmp_path, pg_url)
