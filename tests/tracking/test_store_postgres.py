"""The SQL results store on a real PostgreSQL server (the `pg_url` fixture, tests/pg.py), and on
one restarted mid-run (a private cluster, `PgServer.restart`).

Skipped, with the reason, when PostgreSQL or the psycopg driver is not installed; see
docs/testing.md.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from fedcli.tracking.store.sql_store import SqlStore
from tests.pg import PgServer, PgUnavailable

CONFIG = {"seed": 1, "algorithm": {"name": "fedpa", "rho": 0.1}}


def _start(store: SqlStore, **overrides: Any) -> str:
    arguments: dict[str, Any] = {
        "experiment": "exp",
        "run_name": None,
        "config": CONFIG,
        "algo": "fedpa",
        "task": "femnist",
        "seed": 0,
        "tags": {},
        "fedcli_version": "x",
        "torch_version": "y",
        "git_commit": None,
    }
    arguments.update(overrides)
    return store.start_run(**arguments)


def test_run_round_trip_on_postgres(pg_url: str) -> None:
    """Start a run, log three rounds, end it, read everything back."""
    with SqlStore(pg_url) as store:
        run_id = _start(store, run_name="pg-run", seed=3)
        for round_idx in range(3):
            store.log_round(
                run_id,
                round_idx,
                {"eval/accuracy": 0.5 + round_idx / 10, "train/loss": 1.0 / (1 + round_idx)},
            )
        store.end_run(run_id, "finished")

    with SqlStore(pg_url) as store:  # a second open on an existing schema
        runs = store.list_runs()
        frame = store.metrics_frame([run_id])

    assert [(run.id, run.run_name, run.seed, run.status) for run in runs] == [
        (run_id, "pg-run", 3, "finished")
    ]
    accuracy = frame[frame["key"] == "eval/accuracy"]
    assert accuracy["round_idx"].tolist() == [0, 1, 2]
    assert accuracy["value"].tolist() == pytest.approx([0.5, 0.6, 0.7])
    assert len(frame) == 6


def test_each_test_gets_a_new_empty_database(pg_url: str, pg_database: Callable[[], str]) -> None:
    """`pg_url` and every `pg_database()` call are distinct, empty databases."""
    other = pg_database()
    assert other != pg_url
    with SqlStore(pg_url) as first, SqlStore(other) as second:
        _start(first)
        assert len(first.list_runs()) == 1
        assert second.list_runs() == []


def _open_and_write(
    url: str, worker: int, experiments: list[str], together: str, barrier: Any, results: Any
) -> None:
    """Child process: open the store, write one run of 10 rounds in each of `experiments`.

    `together` is the step all workers take at the same moment: "open" (the store, once) or
    "start_run" (each run, so that several new experiments are created concurrently)."""
    try:
        if together == "open":
            barrier.wait(timeout=60)
        store = SqlStore(url)
        for experiment in experiments:
            if together == "start_run":
                barrier.wait(timeout=60)
            run_id = _start(
                store, experiment=experiment, run_name=f"{experiment}-worker-{worker}", seed=worker
            )
            for round_idx in range(10):
                store.log_round(run_id, round_idx, {"eval/accuracy": worker + round_idx / 100})
            store.end_run(run_id, "finished")
        store.close()
        results.put((worker, None))
    except BaseException as err:  # reported to the parent, which shows every worker's error
        barrier.abort()  # the others stop waiting for this worker at their next barrier
        results.put((worker, f"{type(err).__name__}: {err}"))


def _four_writers(url: str, experiments: list[list[str]], together: str) -> None:
    """Run four `_open_and_write` processes (worker w writes in `experiments[w]`); assert every
    run and round landed."""
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(4), context.Queue()
    processes = [
        context.Process(
            target=_open_and_write, args=(url, worker, experiments[worker], together, barrier, results)
        )
        for worker in range(4)
    ]
    for process in processes:
        process.start()
    outcomes: dict[int, str | None] = {}
    for _ in processes:
        try:
            worker, error = results.get(timeout=120)
        except queue.Empty:
            break
        outcomes[worker] = error
    for process in processes:
        process.join(timeout=30)
        if process.is_alive():
            process.kill()

    errors = {worker: error for worker, error in sorted(outcomes.items()) if error is not None}
    assert not errors, f"concurrent writers failed: {errors}"
    assert sorted(outcomes) == [0, 1, 2, 3], f"workers that reported: {sorted(outcomes)}"
    with SqlStore(url) as store:
        runs = store.list_runs()
        frame = store.metrics_frame([run.id for run in runs])
    expected = sorted(f"{experiment}-worker-{w}" for w in range(4) for experiment in experiments[w])
    assert sorted(run.run_name for run in runs) == expected
    assert {run.experiment for run in runs} == {e for names in experiments for e in names}
    assert {run.status for run in runs} == {"finished"}
    assert len(frame) == 10 * len(expected)


def test_four_processes_open_a_fresh_postgres_database_at_once(pg_url: str) -> None:
    """A sweep's four workers open the same fresh database at the same moment (schema creation
    races) and each write a run, in four different experiments."""
    _four_writers(pg_url, [[f"exp-{worker}"] for worker in range(4)], together="open")


def test_four_processes_start_runs_in_one_new_experiment_at_once(pg_url: str) -> None:
    """Four workers, each with the store open, start runs in the same not-yet-existing experiment
    at the same moment, three times over (three chances for the race)."""
    _four_writers(pg_url, [["sweep-a", "sweep-b", "sweep-c"]] * 4, together="start_run")


# --------------------------------------------------------------------------- the server restarts mid-run


@pytest.fixture
def private_pg() -> Iterator[PgServer]:
    """A throwaway PostgreSQL cluster of this test alone (it is restarted: never the session's server)."""
    try:
        server = PgServer.start()
    except PgUnavailable as err:
        pytest.skip(str(err))
    try:
        yield server
    finally:
        server.stop()


def _train(store_url: str, root: Path, *args: str, **env: str) -> subprocess.Popen[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("FEDCLI_STORE", "MLFLOW_TRACKING_URI")}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fedcli",
            "-q",
            "train",
            "--store",
            store_url,
            "--root",
            str(root),
            "--no-mlflow",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**base, "OMP_NUM_THREADS": "1", **env},
    )


def _wait_round(store_url: str, at_least: int, timeout: float = 240.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with SqlStore(store_url) as store:
            found = [r.id for r in store.list_runs() if (store.last_round(r.id) or 0) >= at_least]
        if found:
            return found[0]
        time.sleep(0.1)
    raise AssertionError(f"no run reached round {at_least} in {timeout:.0f} s")


@pytest.mark.timeout(600)
def test_a_postgresql_restart_of_6_s_mid_run_is_retried_and_the_run_finishes(
    private_pg: PgServer, tmp_path: Path
) -> None:
    """`fedcli train` on a PostgreSQL store whose server restarts for 6 s at round >= 10: the lost
    connection is retried (one warning line, one when it answers again) and the run finishes, every
    round stored once (before: exit 2 at once, "could not end run …: connection failed")."""
    url = private_pg.new_database()
    proc = _train(url, tmp_path, "--task", "lsq", "--clients-per-round", "4", "--rounds", "400")
    run_id = _wait_round(url, 10)
    private_pg.restart(down_s=6.0)
    _, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err
    assert (
        "lost the connection to the store" in err and "answers again after" in err and "Traceback" not in err
    )
    with SqlStore(url) as store:
        assert store.get_run(run_id).status == "finished"
        assert sorted(set(store.metrics_frame([run_id])["round_idx"])) == list(range(401))


@pytest.mark.timeout(600)
def test_a_postgresql_server_down_past_the_retry_bound_stops_the_run_resumable(
    private_pg: PgServer, tmp_path: Path
) -> None:
    """Down for 12 s with FEDCLI_STORE_RETRY_S=3: the run stops after ~3 s with one `error:` line that
    says so and how to resume, exit 2, no traceback; once the server is back the run reads
    `interrupted` and `--resume` finishes it under the same id."""
    url = private_pg.new_database()
    proc = _train(
        url,
        tmp_path,
        "--task",
        "lsq",
        "--clients-per-round",
        "4",
        "--rounds",
        "600",
        FEDCLI_STORE_RETRY_S="3",
    )
    run_id = _wait_round(url, 10)
    private_pg.restart(down_s=12.0)
    _, err = proc.communicate(timeout=120)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 2, err
    assert "Traceback" not in err and lines[-1].startswith("error: ")
    assert "did not come back within 3 s" in lines[-1] and f"--resume {run_id[:8]}" in lines[-1], err
    with SqlStore(url) as store:
        assert store.get_run(run_id).status == "interrupted"
    resumed = _train(url, tmp_path, "--resume", run_id[:8])
    out, err = resumed.communicate(timeout=400)
    assert resumed.returncode == 0, err
    assert out.strip().splitlines()[-1] == run_id
    with SqlStore(url) as store:
        assert store.get_run(run_id).status == "finished"
        assert sorted(set(store.metrics_frame([run_id])["round_idx"])) == list(range(601))
