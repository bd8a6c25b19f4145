"""Runs you can trust, with real processes: parallel starts, kills, SIGTERM, resume, MLflow in line.

Every test starts `python -m fedcli train` processes on a fresh `--root` (SQLite stores and
a real SQLite-backed MLflow store), kills or signals them for real, and reads the stores
back with sqlite3 / the SQL store. The long soak (8 processes at once, twice) is marked
`soak`; `make test` runs the rest, CI runs both.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fedcli.tracking.store.sql_store import SqlStore

TINY = ["--task", "lsq", "--clients-per-round", "4"]  # 20 clients, 11 parameters: rounds take milliseconds


def fedcli(root: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "fedcli", "-q", "train", "--root", str(root), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def store(root: Path) -> SqlStore:
    return SqlStore(f"sqlite:///{root / 'fedcli.db'}")


def wait_for_round(root: Path, at_least: int, timeout: float = 90.0) -> str:
    """Poll the store until some run has logged round >= at_least; return its id."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (root / "fedcli.db").exists():
            db = store(root)
            for run in db.list_runs():
                if (db.last_round(run.id) or 0) >= at_least:
                    return run.id
        time.sleep(0.05)
    raise AssertionError(f"no run reached round {at_least} in {timeout} s")


def mlflow_points(root: Path) -> tuple[int, int, dict[str, str]]:
    """(metric rows, distinct (run, key, step), MLflow run status by fedcli run id) of the MLflow store."""
    with sqlite3.connect(root / "mlflow.db") as conn:
        rows, distinct = conn.execute(
            "SELECT count(*), count(DISTINCT run_uuid || '|' || key || '|' || step) FROM metrics"
        ).fetchone()
        status = dict(
            conn.execute(
                "SELECT t.value, r.status FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid AND t.key = 'fedcli.run_id'"
            ).fetchall()
        )
    return rows, distinct, status


def final_params(root: Path, run_id: str) -> dict[str, torch.Tensor]:
    return torch.load(root / "runs" / run_id / "model.pt", weights_only=True)["params"]


def test_parallel_starts_on_a_fresh_root_all_finish(tmp_path: Path) -> None:
    """4 runs started together on a fresh root: all finish, each MLflow point exactly once."""
    procs = [fedcli(tmp_path, *TINY, "--rounds", "3", "--seed", str(seed)) for seed in range(4)]
    outs = [proc.communicate(timeout=300) for proc in procs]
    assert [proc.returncode for proc in procs] == [0] * 4, [err for _, err in outs]
    runs = store(tmp_path).list_runs()
    assert sorted(r.status for r in runs) == ["finished"] * 4
    rows, distinct, status = mlflow_points(tmp_path)
    assert rows == distinct > 0
    assert sorted(status) == sorted(r.id for r in runs) and set(status.values()) == {"FINISHED"}


@pytest.mark.soak
@pytest.mark.parametrize("attempt", [1, 2])
def test_eight_parallel_starts_soak(tmp_path: Path, attempt: int) -> None:
    procs = [fedcli(tmp_path, *TINY, "--rounds", "3", "--seed", str(seed)) for seed in range(8)]
    outs = [proc.communicate(timeout=600) for proc in procs]
    assert [proc.returncode for proc in procs] == [0] * 8, [err for _, err in outs]
    assert sorted(r.status for r in store(tmp_path).list_runs()) == ["finished"] * 8
    rows, distinct, status = mlflow_points(tmp_path)
    assert rows == distinct and set(status.values()) == {"FINISHED"} and len(status) == 8


@pytest.mark.parametrize("kill_at", [0, 3])
def test_sigkill_then_resume_equals_uninterrupted_run(tmp_path: Path, kill_at: int) -> None:
    """SIGKILL (round 1 in flight, or later), then --resume: bit-exact result, one MLflow point per round.

    kill_at = 0 kills before the first checkpoint: the run restarts from round 0 under its id.
    """
    rounds = "150"
    reference = fedcli(tmp_path / "ref", *TINY, "--rounds", rounds, "--no-mlflow")
    assert reference.wait(timeout=300) == 0, reference.stderr.read() if reference.stderr else ""
    ref_id = store(tmp_path / "ref").list_runs()[0].id

    root = tmp_path / "killed"
    victim = fedcli(root, *TINY, "--rounds", rounds)
    run_id = wait_for_round(root, kill_at)
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=30)
    killed = store(root).get_run(run_id)
    assert killed.status == "interrupted"  # the store tells a killed run from a live one at once
    assert (store(root).last_round(run_id) or 0) < int(rounds)
    report = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedcli",
            "report",
            "--runs",
            run_id,
            "--store",
            f"sqlite:///{root / 'fedcli.db'}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 2 and "--include-unfinished" in " ".join(report.stderr.split())

    resumed = subprocess.run(
        [sys.executable, "-m", "fedcli", "-q", "train", "--root", str(root), "--resume", run_id[:8]],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.strip().splitlines()[-1] == run_id  # the same run, continued
    for name, tensor in final_params(tmp_path / "ref", ref_id).items():
        assert torch.equal(final_params(root, run_id)[name], tensor), name
    db = store(root)
    assert db.get_run(run_id).status == "finished"
    assert sorted(set(db.metrics_frame([run_id])["round_idx"])) == list(range(int(rounds) + 1))
    rows, distinct, status = mlflow_points(root)
    assert rows == distinct, f"{rows - distinct} duplicate MLflow points"
    with sqlite3.connect(root / "mlflow.db") as conn:
        steps = [s for (s,) in conn.execute("SELECT DISTINCT step FROM metrics WHERE key = 'eval/loss'")]
    assert sorted(steps) == list(range(int(rounds) + 1)) and status[run_id] == "FINISHED"


def test_sigterm_checkpoints_marks_interrupted_and_exits_143(tmp_path: Path) -> None:
    proc = fedcli(tmp_path, *TINY, "--rounds", "400", "--no-mlflow")
    run_id = wait_for_round(tmp_path, 3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "Traceback" not in err and f"--resume {run_id[:8]}" in err
    db = store(tmp_path)
    record = db.get_run(run_id)
    assert (record.status, record.stored_status) == ("interrupted", "interrupted")
    assert "SIGTERM" in (record.failure_reason or "")
    last = db.last_round(run_id)
    assert db.checkpoints(run_id)[-1][0] == last  # the last completed round is checkpointed


def test_checkpoints_are_kept_three_at_a_time_and_temp_files_cleaned(tmp_path: Path) -> None:
    run_dir_probe = tmp_path / "runs"
    proc = fedcli(tmp_path, *TINY, "--rounds", "12", "--no-mlflow", "--checkpoint-every", "1")
    assert proc.wait(timeout=300) == 0
    run_id = store(tmp_path).list_runs()[0].id
    folder = run_dir_probe / run_id / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == [f"round-0000{r:02d}.pt" for r in (10, 11, 12)]
    assert [r for r, _ in store(tmp_path).checkpoints(run_id)] == [10, 11, 12]
    (folder / ".round-000013.pt.abc123").write_bytes(b"half a checkpoint")  # a write cut by a kill
    resumed = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedcli",
            "-q",
            "train",
            "--root",
            str(tmp_path),
            "--resume",
            run_id,
            "--rounds",
            "14",
            "--no-mlflow",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(p.name for p in folder.iterdir()) == [f"round-0000{r:02d}.pt" for r in (12, 13, 14)]
    record = store(tmp_path).get_run(run_id)
    assert record.config["train"]["rounds"] == 14  # the stored config says what it ran


def test_unreachable_mlflow_server_fails_before_anything_is_written(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedcli",
            "train",
            *TINY,
            "--root",
            str(tmp_path / "r"),
            "--tracking-uri",
            "http://127.0.0.1:9",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "not reachable" in proc.stderr and "Traceback" not in proc.stderr
    assert len([line for line in proc.stderr.splitlines() if line.strip()]) == 1
    assert not (tmp_path / "r").exists()
    optional = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedcli",
            "-q",
            "train",
            *TINY,
            "--rounds",
            "2",
            "--root",
            str(tmp_path / "r"),
            "--tracking-uri",
            "http://127.0.0.1:9",
            "--mlflow-optional",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert optional.returncode == 0 and "SQL store only" in " ".join(optional.stderr.split())


def test_stored_config_is_what_ran_and_resume_uses_the_request(tmp_path: Path) -> None:
    """The run's config holds the resolved model, device, executor, threads and clients (not auto/None);
    the request is kept beside it, and the config hash is the request's (so sweeps match trials)."""
    from fedcli.config.build import build_config

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedcli",
            "-q",
            "train",
            *TINY,
            "--rounds",
            "2",
            "--root",
            str(tmp_path),
            "--no-mlflow",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    record = store(tmp_path).list_runs()[0]
    train = record.config["train"]
    assert (record.config["data"]["model"], train["device"], train["executor"]) == ("linear", "cpu", "vmap")
    assert train["threads"] >= 1 and record.config["partition"]["num_clients"] == 20
    assert record.requested is not None and record.requested["train"]["executor"] == "auto"
    assert record.requested["data"]["model"] is None
    overrides = {
        "data.task": "lsq",
        "train.clients_per_round": 4,
        "train.rounds": 2,
        "tracking.root": str(tmp_path),
        "tracking.use_mlflow": False,
    }
    assert record.config_hash == build_config(overrides=overrides).config_hash


def test_sync_copies_runs_into_mlflow_once_however_often_it_runs(tmp_path: Path) -> None:
    """A run trained with --no-mlflow is copied by `fedcli sync`; a second sync adds nothing."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedcli",
            "-q",
            "train",
            *TINY,
            "--rounds",
            "3",
            "--root",
            str(tmp_path),
            "--no-mlflow",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    run_id = store(tmp_path).list_runs()[0].id
    for _ in range(2):
        synced = subprocess.run(
            [sys.executable, "-m", "fedcli", "sync", "--root", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert synced.returncode == 0, synced.stderr
        rows, distinct, status = mlflow_points(tmp_path)
        assert rows == distinct == len(store(tmp_path).metrics_frame([run_id]))
        assert status == {run_id: "FINISHED"}


@pytest.fixture
def small_disk(tmp_path: Path):  # noqa: ANN201 - a generator fixture
    """A 3 MB tmpfs (root only); resized with `remount`. Skipped where mounting is not allowed."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if made.returncode != 0:
        pytest.skip(
            f"cannot mount a small tmpfs here ({made.stderr.strip() or 'not root'}); "
            "the disk-full test needs root (CI runs as root)"
        )
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_full_while_checkpointing_says_so_in_one_line_and_resumes(small_disk: Path) -> None:
    """FEMNIST MLP checkpoints (0.8 MB each) fill a 3 MB disk: one line naming 'no space left on device',
    no traceback, the store consistent; with space again the run resumes and finishes."""
    root = small_disk / "runs"
    args = [
        "--algo",
        "fedavg",
        "--task",
        "femnist",
        "--rounds",
        "12",
        "--clients-per-round",
        "3",
        "--no-mlflow",
        "--checkpoint-every",
        "1",
        "--keep-checkpoints",
        "3",
    ]
    proc = fedcli(root, *args)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "no space left on device" in " ".join(err.split()) and "Traceback" not in err, err
    assert len([line for line in err.splitlines() if line.strip()]) <= 3, (
        err
    )  # one message (rich may wrap it)
    record = store(root).list_runs()[0]
    assert record.status in ("failed", "interrupted")
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    resumed = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedcli",
            "-q",
            "train",
            "--root",
            str(root),
            "--resume",
            record.id,
            "--no-mlflow",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert store(root).get_run(record.id).status == "finished" and store(root).last_round(record.id) == 12


def test_parallel_starts_on_fresh_postgresql_databases(tmp_path: Path, pg_database) -> None:  # noqa: ANN001
    """4 runs started together with the results store AND MLflow on fresh PostgreSQL databases: all finish
    (MLflow's schema set-up and fedcli's table creation each happen once, under advisory locks)."""
    store_url, mlflow_url = pg_database(), pg_database()
    procs = [
        fedcli(
            tmp_path,
            *TINY,
            "--rounds",
            "3",
            "--seed",
            str(seed),
            "--store",
            store_url,
            "--tracking-uri",
            mlflow_url,
        )
        for seed in range(4)
    ]
    outs = [proc.communicate(timeout=600) for proc in procs]
    assert [proc.returncode for proc in procs] == [0] * 4, [err for _, err in outs]
    runs = SqlStore(store_url).list_runs()
    assert sorted(r.status for r in runs) == ["finished"] * 4
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_url)
    for run in runs:
        mlflow_run = client.get_run(run.mlflow_run_id)
        assert mlflow_run.info.status == "FINISHED"
        steps = [m.step for m in client.get_metric_history(run.mlflow_run_id, "eval/loss")]
        assert sorted(steps) == [0, 1, 2, 3]


def test_an_mlflow_store_left_half_migrated_is_named_with_its_fix(tmp_path: Path) -> None:
    """A process killed inside MLflow's schema migration leaves alembic's temporary table behind;
    the next run says so in one line, with the fix, before writing anything."""
    tmp_path.mkdir(exist_ok=True)
    with sqlite3.connect(tmp_path / "mlflow.db") as conn:
        conn.execute("CREATE TABLE _alembic_tmp_params (key TEXT)")
    before = sorted(p.name for p in tmp_path.iterdir())
    proc = subprocess.run(
        [sys.executable, "-m", "fedcli", "train", *TINY, "--root", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    message = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "half-migrated" in message and "_alembic_tmp_params" in message
    assert "mv " in message and "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_an_mlflow_set_up_under_way_is_not_taken_for_a_half_migrated_store(tmp_path: Path) -> None:
    """Alembic's temporary tables exist while another run's mirror migrates the store (it holds the schema
    lock): `preflight` lets the run start (its mirror waits on the lock), and names the store half-migrated
    only once no process holds the lock. Before, a run or resume started during another's set-up was refused
    with the half-migrated line (seen with two test workers: a resume refused for the wrong reason)."""
    import fcntl

    from fedcli.errors import ConfigError
    from fedcli.tracking.mlflow.checks import preflight

    store = tmp_path / "mlflow.db"
    with sqlite3.connect(store) as conn:
        conn.execute("CREATE TABLE _alembic_tmp_params (key TEXT)")
    with open(f"{store}.lock", "a+") as lock:  # schema_lock's file, held as a migrating mirror holds it
        fcntl.flock(lock, fcntl.LOCK_EX)
        preflight(f"sqlite:///{store}")
        fcntl.flock(lock, fcntl.LOCK_UN)
    with pytest.raises(ConfigError, match="half-migrated"):
        preflight(f"sqlite:///{store}")
