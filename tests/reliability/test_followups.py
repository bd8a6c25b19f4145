"""Issue 23 follow-ups, checked with real processes, real signals and real stores.

- A stop signal to `fedcli sweep` while a trial trains and another waits: the sweep stops the
  running trial (it checkpoints), never starts the waiting one, exits 128 + the signal, and a
  rerun finishes both (before: "1/2 done; 1 waiting" forever).
- A resume that falls back to an older checkpoint (the newer ones unreadable) after the whole
  job was SIGKILLed, its MLflow mirror too: MLflow still holds one point per (metric, step)
  (before: the rounds trained again were logged a second time; `Mirror.held`).
- MLflow's store on a full disk at the run's start: the error names the full disk
  (before: "no answer in 300 s").
- MLflow's set-up held (here by the mirror's schema lock) delays no round; a stop signal while
  `fedcli train` waits at its end for MLflow (its set-up held, or the final copy held by a SQLite
  write lock on MLflow's store) ends the process within seconds with one warning line, and the
  mirror completes MLflow in the background (before: the waits ran their full 300 s / 120 s;
  `MirrorHandle.stopping`).
- `fedcli sweep --dry-run` writes nothing on any store: no table in a fresh PostgreSQL
  database, no SQLite file, no schema upgrade of an older store (`SqlStore.reader`).
- A store written by an older fedcli whose rows hold a password: opening it masks them once,
  with one warning, and keeps the config hashes, so a sweep rerun trains nothing.

- A store or MLflow URL with a password that does not parse: one masked line, exit 2, nothing
  written.

The old owner's mirror after a takeover is checked in test_one_writer.py, the password grep of
every file a run writes in test_files_and_secrets.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from sqlalchemy import create_engine, inspect

from fedcli.tracking.store.sql_store import SqlStore
from tests.reliability.test_disk_full import disk, fill  # noqa: F401 - `disk` is a fixture
from tests.reliability.test_one_writer import gone, mirror_of

T = TypeVar("T")
pytestmark = pytest.mark.timeout(600)
START_S = 240.0  # a process's start-up on a loaded 2-core box (importing torch, MLflow)
TINY = ["--task", "lsq", "--clients-per-round", "4"]  # 11 parameters: rounds take milliseconds
PASSWORD = "Pl4nted-S3cret"


def env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in ("FEDCLI_STORE", "MLFLOW_TRACKING_URI")}
    return {**base, "OMP_NUM_THREADS": "1", "COLUMNS": "200", **extra}


def spawn(*args: str, cwd: Path | None = None, **extra: str) -> subprocess.Popen[str]:
    """`python -m fedcli ARGS`, output captured; `extra`: environment variables to set."""
    return subprocess.Popen(
        [sys.executable, "-m", "fedcli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(**extra),
        cwd=cwd,
    )


def fedcli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fedcli", *args], capture_output=True, text=True, env=env(), timeout=timeout
    )


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = START_S) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def sqlite_store(root: Path) -> SqlStore:
    return SqlStore(f"sqlite:///{root / 'fedcli.db'}")


def the_run(root: Path) -> str | None:
    """The id of the one run of root's store, once there is one."""
    if not (root / "fedcli.db").exists():
        return None
    runs = sqlite_store(root).list_runs()
    return runs[0].id if runs else None


def mlflow_rows(db: Path, sql: str) -> list[tuple]:
    """Rows of a read-only query on an MLflow SQLite store ([] while it has no such table yet)."""
    if not db.exists():
        return []
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5) as conn:
            return conn.execute(sql).fetchall()
    except sqlite3.OperationalError:
        return []


def point_counts(tracking_uri: str) -> Counter[tuple[str, int]]:
    """(metric, step) -> how many points the experiment's one MLflow run holds, via MlflowClient."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    counts: Counter[tuple[str, int]] = Counter()
    for key in run.data.metrics:
        counts.update((key, m.step) for m in client.get_metric_history(run.info.run_id, key))
    return counts


# --------------------------------------------------------------------------- 1. a sweep stopped with trials waiting


@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.soak)])
def test_a_stop_signal_with_trials_waiting_ends_the_sweep_and_a_rerun_finishes(
    tmp_path: Path, signum: int
) -> None:
    """2 trials, 1 worker: a stop signal while the first trains ends the sweep with 128 + signum,
    the first trial interrupted and checkpointed, the second never started; the rerun resumes the
    first under its id and runs the second (before: the sweep printed "1/2 done; 1 waiting" forever)."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "experiment: stop\nbase: {task: lsq, rounds: 20, clients_per_round: 4, local_epochs: 2, "
        "batch_size: 5}\ngrid: {server_opt: [sgd, adam]}\nseeds: [0]\n"
    )
    args = ["sweep", str(spec), "--root", str(tmp_path), "--no-mlflow"]
    proc = spawn(*args, cwd=tmp_path)

    def at_round_2() -> str | None:
        run_id = the_run(tmp_path)
        return run_id if run_id and (sqlite_store(tmp_path).last_round(run_id) or 0) >= 2 else None

    first = wait_for("the first trial at round 2", at_round_2)
    proc.send_signal(signum)
    began = time.monotonic()
    try:
        _, err = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(
            f"the sweep did not end within 90 s of {signal.Signals(signum).name}: {err[-600:]}"
        ) from None
    print(
        f"sweep ended {time.monotonic() - began:.1f} s after {signal.Signals(signum).name}, exit {proc.returncode}"
    )
    assert proc.returncode == 128 + signum, err[-3000:]
    assert f"sweep stopped by {signal.Signals(signum).name}" in err and "Traceback" not in err, err[-3000:]
    db = sqlite_store(tmp_path)
    (stopped,) = db.list_runs()  # the waiting trial never started
    assert stopped.id == first and stopped.stored_status == "interrupted"
    assert db.checkpoints(first)[-1][0] == db.last_round(first) < 20

    rerun = spawn(*args, cwd=tmp_path)
    _, err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, err[-3000:]
    runs = sqlite_store(tmp_path).list_runs()
    assert len(runs) == 2 and {r.status for r in runs} == {"finished"}, [(r.id, r.status) for r in runs]
    assert first in {r.id for r in runs} and len({r.config_hash for r in runs}) == 2  # resumed, not restarted


# --------------------------------------------------------------------------- 2. a fallback resume and MLflow points


def test_a_resume_from_an_older_checkpoint_logs_no_mlflow_point_twice(tmp_path: Path) -> None:
    """The job (training process and its MLflow mirror) is SIGKILLed once MLflow holds round >= 3;
    every checkpoint after round M-2 (M: MLflow's newest step) is made unreadable; the resume falls
    back to round <= M-2 and trains rounds MLflow holds already. MlflowClient.get_metric_history
    then shows exactly one point per (metric, step), for every step 0..M+3."""
    root = tmp_path / "root"
    mlflow_db = root / "mlflow.db"
    proc = spawn(
        "-q",
        "train",
        *TINY,
        "--rounds",
        "100000",
        "--checkpoint-every",
        "1",
        "--keep-checkpoints",
        "100000",
        "--root",
        str(root),
    )
    newest = "SELECT max(step) FROM metrics WHERE key = 'eval/loss'"
    wait_for(
        "MLflow holding round 3", lambda: ((mlflow_rows(mlflow_db, newest) or [(None,)])[0][0] or 0) >= 3
    )
    mirror = mirror_of(proc.pid)
    assert mirror is not None
    os.kill(mirror, signal.SIGSTOP)  # the whole job dies at once: the mirror writes nothing more
    proc.kill()
    os.kill(mirror, signal.SIGKILL)
    proc.communicate()
    wait_for("the mirror's end", lambda: gone(mirror), timeout=30)
    run_id = str(the_run(root))
    held = mlflow_rows(mlflow_db, newest)[0][0]
    spoiled = [
        p
        for p in (root / "runs" / run_id / "checkpoints").glob("round-*.pt")
        if int(p.stem.split("-")[1]) > held - 2
    ]
    assert spoiled, "no checkpoint after MLflow's newest round - 2"
    for path in spoiled:
        path.write_bytes(b"not a checkpoint")
    resumed = fedcli("-q", "train", "--resume", run_id[:8], "--rounds", str(held + 3), "--root", str(root))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "tryinganolderone" in "".join(resumed.stderr.split())  # it did fall back
    counts = point_counts(f"sqlite:///{mlflow_db}")
    twice = {point: n for point, n in counts.items() if n > 1}
    print(
        f"MLflow held round {held}; {len(spoiled)} checkpoints spoiled; {sum(counts.values())} points, "
        f"{len(twice)} (metric, step) logged more than once"
    )
    assert twice == {}, f"{len(twice)} duplicate (metric, step): {sorted(twice)[:6]}"
    assert {step for key, step in counts if key == "eval/loss"} == set(range(held + 4))


# --------------------------------------------------------------------------- 4. a full disk under MLflow's set-up


@pytest.fixture
def no_inode_left(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs with room for 64 files, all taken: creating any file there fails with ENOSPC."""
    mount = tmp_path / "inodes"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m,nr_inodes=64", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({made.stderr.strip() or 'not root'}); the disk-full tests need root"
        )
    try:
        for i in range(64):
            (mount / f"f{i}").touch()
    except OSError:
        pass
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_under_mlflows_store_at_set_up_is_named_in_one_line(
    no_inode_left: Path, tmp_path: Path
) -> None:
    """`--tracking-uri` on a file system where no file can be created: one error line before anything
    is written, "No space left on device" (before: "no answer in 300 s", printed although the mirror
    had died at once). Since round 1 no longer waits for MLflow's set-up (issue 27), `preflight`
    finds it (statvfs: no free inode), not the mirror."""
    began = time.monotonic()
    done = fedcli(
        "-q",
        "train",
        *TINY,
        "--rounds",
        "2",
        "--root",
        str(tmp_path / "root"),
        "--tracking-uri",
        f"sqlite:///{no_inode_left / 'mlflow.db'}",
        timeout=400,
    )
    took = time.monotonic() - began
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    print(f"exit {done.returncode} after {took:.1f} s: {lines}")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert len(lines) == 1 and "No space left on device" in lines[0] and "no answer" not in lines[0], lines
    assert "--no-mlflow" in lines[0]  # and how to go on


@pytest.mark.soak
def test_a_full_disk_under_an_existing_mlflow_store_is_named_and_not_retried_soak(
    disk: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    """MLflow's store exists (an earlier run) and its disk is full when the next run starts: the
    warning quotes SQLite's "database or disk is full", not the note on autoflush MLflow wraps it
    in, in one line (the mirror is not restarted to fail again), and the mirror does not retry it
    for RETRY_S (before: the run waited ~60 s at its end)."""
    uri = f"sqlite:///{disk / 'mlflow.db'}"
    first = fedcli(
        "-q", "train", *TINY, "--rounds", "2", "--root", str(tmp_path / "root"), "--tracking-uri", uri
    )
    assert first.returncode == 0, first.stderr
    fill(disk)
    began = time.monotonic()
    done = fedcli(
        "-q", "train", *TINY, "--rounds", "2", "--root", str(tmp_path / "root"), "--tracking-uri", uri
    )
    took = time.monotonic() - began
    said = " ".join(done.stderr.split())
    print(f"exit {done.returncode} after {took:.1f} s: {records(done.stderr)}")
    assert done.returncode == 0 and "Traceback" not in said, said
    assert "database or disk is full" in said and "autoflush" not in said, said
    assert len(records(done.stderr)) == 1 and "not restarted while the disk is full" in said, said  # one line
    assert took < 50.0


# --------------------------------------------------------------------------- 5. a stop while waiting for MLflow


def records(err: str) -> list[str]:
    """stderr's log records and messages, one string each: rich wraps a record onto lines indented by its
    time and level columns (20 characters), and starts a record of the same second as the last with
    blanks instead of the time."""
    out: list[str] = []
    for line in err.splitlines():
        if line[:20].strip() or not out:
            out.append(line.strip())
        elif line.strip():
            out[-1] += " " + line.strip()
    return [" ".join(line.split()) for line in out if line]


def holds_open(pid: int, path: str) -> bool:
    """True when process `pid` has the file `path` open (its /proc fd links)."""
    try:
        return any(os.readlink(fd) == path for fd in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False


def stop_and_time(proc: subprocess.Popen[str], limit_s: float = 30.0) -> tuple[float, str]:
    """SIGTERM `proc`; return (seconds until it exited, its stderr); fail if it takes over `limit_s`."""
    proc.send_signal(signal.SIGTERM)
    began = time.monotonic()
    try:
        _, err = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"still running {limit_s:.0f} s after SIGTERM: {err[-600:]}") from None
    return time.monotonic() - began, err


def test_mlflows_set_up_held_delays_no_round_and_a_stop_then_ends_train_at_once(tmp_path: Path) -> None:
    """MLflow's set-up is held (this test holds the mirror's schema lock, as a slow or busy MLflow
    store would): the run still trains every round (round 1 never waits for MLflow, issue 27; before,
    it waited for the mirror's "ready"). SIGTERM while `fedcli train` then waits for the mirror's
    copy ends it within seconds with one MLflow warning line, the run finished in the store. Once the
    lock is released the mirror, left running on its own, copies the run: MLflow FINISHED, every round."""
    root = tmp_path / "root"
    root.mkdir()
    with open(root / "mlflow.db.lock", "a+") as lock:  # mirror.schema_lock's file
        fcntl.flock(lock, fcntl.LOCK_EX)
        # the mirror's set-up and copy after the run ended take well under a minute alone, longer beside
        # other tests (parallel workers): the bound is not what this checks
        proc = spawn("-q", "train", *TINY, "--rounds", "5", "--root", str(root), FEDCLI_ORPHAN_WAIT_S="300")
        run_id = wait_for("the run in the store", lambda: the_run(root))
        mirror = wait_for("the mirror", lambda: mirror_of(proc.pid))
        # at nice 19 beside other tests the mirror may still be importing when the run ends; one whose trainer
        # is gone before its set-up began writes nothing, by design: wait until it waits on the lock
        wait_for("the mirror at MLflow's schema lock", lambda: holds_open(int(mirror), lock.name))
        wait_for(
            "every round trained while MLflow's set-up is held",
            lambda: sqlite_store(root).get_run(run_id).stored_status == "finished",
        )
        assert not (root / "mlflow.db").exists()  # MLflow was not set up for any of them
        time.sleep(1.0)  # into the final wait for the mirror
        took, err = stop_and_time(proc)
        fcntl.flock(lock, fcntl.LOCK_UN)
    lines = records(err)
    print(f"exit {proc.returncode} {took:.1f} s after SIGTERM; stderr: {lines}")
    assert "Traceback" not in err and took < 5.0, (took, err)
    mlflow_lines = [line for line in lines if "MLflow" in line]
    assert len(mlflow_lines) == 1 and "still copies the run in the background" in mlflow_lines[0], err
    assert "(this process was stopped by a signal)" in mlflow_lines[0], err
    assert set(lines) - set(mlflow_lines) <= {
        "WARNING SIGTERM arrived after the last round; the run finished"
    }, lines
    assert sqlite_store(root).get_run(run_id).stored_status == "finished"
    wait_for("the mirror to finish alone", lambda: gone(mirror), timeout=120)
    assert mlflow_rows(root / "mlflow.db", "SELECT status FROM runs") == [("FINISHED",)]
    counts = point_counts(f"sqlite:///{root / 'mlflow.db'}")
    assert max(counts.values()) == 1 and {s for k, s in counts if k == "eval/loss"} == set(range(6))


def test_a_stop_during_the_final_mlflow_copy_ends_train_at_once(tmp_path: Path) -> None:
    """MLflow's SQLite store is write-locked by this test while the run trains, so the final copy
    waits; SIGTERM during that wait ends `fedcli train` within seconds with one warning line, the
    run stays finished in the store, and once the lock is gone the mirror completes MLflow:
    FINISHED, one point per (metric, step), every round."""
    root = tmp_path / "root"
    mlflow_db = root / "mlflow.db"
    proc = spawn("-q", "train", *TINY, "--rounds", "30", "--root", str(root))
    wait_for("the MLflow run", lambda: mlflow_rows(mlflow_db, "SELECT run_uuid FROM runs"))
    mirror = mirror_of(proc.pid)
    assert mirror is not None
    blocker = sqlite3.connect(mlflow_db, timeout=30, isolation_level=None)
    try:
        blocker.execute("BEGIN EXCLUSIVE")  # MLflow cannot write until this test lets it
        wait_for(
            "the run's end in the store",
            lambda: sqlite_store(root).get_run(str(the_run(root))).stored_status == "finished",
        )
        time.sleep(1.0)  # into the final wait for the mirror
        took, err = stop_and_time(proc)
    finally:
        blocker.rollback()
        blocker.close()
    lines = records(err)
    print(f"exit {proc.returncode} {took:.1f} s after SIGTERM; stderr: {lines}")
    assert "Traceback" not in err and took < 5.0, (took, err)
    mlflow_lines = [line for line in lines if "MLflow" in line]
    assert len(mlflow_lines) == 1 and "still copies the run in the background" in mlflow_lines[0], err
    assert "(this process was stopped by a signal)" in mlflow_lines[0], err
    assert set(lines) - set(mlflow_lines) <= {
        "WARNING SIGTERM arrived after the last round; the run finished"
    }, lines
    assert sqlite_store(root).get_run(str(the_run(root))).stored_status == "finished"
    wait_for("the mirror to finish alone", lambda: gone(mirror), timeout=120)
    assert mlflow_rows(mlflow_db, "SELECT status FROM runs") == [("FINISHED",)]
    counts = point_counts(f"sqlite:///{mlflow_db}")
    assert max(counts.values()) == 1 and {s for k, s in counts if k == "eval/loss"} == set(range(31))


# --------------------------------------------------------------------------- 6. a dry run writes nothing


def dry_run_spec(folder: Path) -> Path:
    spec = folder / "spec.yaml"
    spec.write_text(
        "experiment: dry\nbase: {task: lsq, rounds: 2, clients_per_round: 4}\n"
        "grid: {server_opt: [sgd, adam]}\nseeds: [0]\n"
    )
    return spec


def test_a_dry_run_creates_no_table_in_a_fresh_postgresql_database(tmp_path: Path, pg_url: str) -> None:
    """Before: `sweep --dry-run --store postgresql+psycopg://…` created fedcli's tables."""
    done = fedcli(
        "sweep", str(dry_run_spec(tmp_path)), "--dry-run", "--store", pg_url, "--root", str(tmp_path / "r")
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert (done.stdout + done.stderr).count("to run") == 2, done.stdout + done.stderr
    engine = create_engine(pg_url)
    try:
        tables = inspect(engine).get_table_names()
    finally:
        engine.dispose()
    assert tables == [], tables
    assert not (tmp_path / "r").exists()


def test_a_dry_run_creates_no_sqlite_file_and_upgrades_no_older_store(tmp_path: Path) -> None:
    """No SQLite file appears for a store that is not there (exit 0, the plan shown)."""
    fresh = tmp_path / "fresh"
    done = fedcli("sweep", str(dry_run_spec(tmp_path)), "--dry-run", "--root", str(fresh))
    assert done.returncode == 0 and (done.stdout + done.stderr).count("to run") == 2, (
        done.stdout + done.stderr
    )
    assert not fresh.exists(), list(fresh.rglob("*"))


# --------------------------------------------------------------------------- 7. passwords a store already holds


def test_an_older_store_holding_passwords_is_read_as_is_by_a_dry_run_then_masked_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A store as an older fedcli left it, made with raw SQL from a real sweep's: no `store_meta`,
    `trial_claims` or `runs.pid_start`; a tracking URI with its password in config_json and
    requested_json; one run's config_hash the sha256 of that config_json (fedcli before the hash
    left the tracking section out).

    `sweep --dry-run` reads it as it is: both trials planned as skipped, the file byte-identical
    (before: the dry run upgraded the schema). The real rerun: one warning, the rows masked
    (none left in the file's free pages either), config hashes as the sweep matches them, every
    trial skipped (none trains). Opening the store again neither warns nor changes a row."""
    spec = dry_run_spec(tmp_path)
    root = tmp_path / "root"
    made = fedcli("sweep", str(spec), "--root", str(root), "--no-mlflow")
    assert made.returncode == 0, made.stderr
    uri = f"postgresql+psycopg://me:{PASSWORD}@db.example/mlflow"
    db_file = root / "fedcli.db"
    with contextlib.closing(sqlite3.connect(db_file)) as conn:
        conn.execute("DROP TABLE IF EXISTS store_meta")
        conn.execute("DROP TABLE trial_claims")
        conn.execute("ALTER TABLE runs DROP COLUMN pid_start")
        rows = conn.execute(
            "SELECT id, config_json, requested_json, tags_json FROM runs ORDER BY id"
        ).fetchall()
        for i, (run_id, config_json, requested_json, _) in enumerate(rows):
            config, requested = json.loads(config_json), json.loads(requested_json or "{}")
            config["tracking"]["tracking_uri"] = uri
            requested.setdefault("tracking", {})["tracking_uri"] = uri
            config_json = json.dumps(config, sort_keys=True, separators=(",", ":"))
            conn.execute(
                "UPDATE runs SET config_json = ?, requested_json = ? WHERE id = ?",
                (config_json, json.dumps(requested, sort_keys=True, separators=(",", ":")), run_id),
            )
            if i == 0:  # the oldest kind: the column hashed the whole config, password included
                conn.execute(
                    "UPDATE runs SET config_hash = ? WHERE id = ?",
                    (hashlib.sha256(config_json.encode()).hexdigest(), run_id),
                )
        conn.commit()  # and closed: its WAL folded into the file, so that the bytes compare
    tags = {run_id: json.loads(tags_json)["fedcli.config_hash"] for run_id, _, _, tags_json in rows}
    before, files = hashlib.sha256(db_file.read_bytes()).hexdigest(), sorted(p.name for p in root.iterdir())

    dry = fedcli("sweep", str(spec), "--dry-run", "--root", str(root))
    assert dry.returncode == 0 and "Traceback" not in dry.stderr, dry.stderr
    assert (dry.stdout + dry.stderr).count("finished (skip)") == 2, dry.stdout + dry.stderr
    assert hashlib.sha256(db_file.read_bytes()).hexdigest() == before, "the dry run wrote the store"
    assert sorted(p.name for p in root.iterdir()) == files

    rerun = fedcli("sweep", str(spec), "--root", str(root), "--no-mlflow")
    assert rerun.returncode == 0, rerun.stderr
    warned = [line for line in records(rerun.stderr) if "masked the passwords" in line]
    print(f"rerun: {len(warned)} warning(s): {warned}")
    assert len(warned) == 1 and "2 run(s)" in " ".join(rerun.stderr.split()), rerun.stderr
    assert "sweep done: 2 finished (skip)." in " ".join(rerun.stderr.split()), rerun.stderr
    with contextlib.closing(sqlite3.connect(db_file)) as conn:
        stored = conn.execute("SELECT id, config_json, requested_json, config_hash FROM runs").fetchall()
    assert len(stored) == 2
    for run_id, config_json, requested_json, config_hash in stored:
        assert PASSWORD not in config_json + requested_json
        assert (
            json.loads(config_json)["tracking"]["tracking_uri"]
            == "postgresql+psycopg://me:***@db.example/mlflow"
        )
        assert config_hash == tags[run_id]  # what sweeps and `report` group by
    assert PASSWORD.encode() not in db_file.read_bytes()

    with caplog.at_level("WARNING"):
        SqlStore(f"sqlite:///{db_file}").close()
    assert [r for r in caplog.records if "masked" in r.getMessage()] == []
    with contextlib.closing(sqlite3.connect(db_file)) as conn:
        assert (
            conn.execute("SELECT id, config_json, requested_json, config_hash FROM runs").fetchall() == stored
        )


# --------------------------------------------------------------------------- 8. URLs that do not parse


@pytest.mark.parametrize(
    ("option", "url"),
    [
        ("--store", f"postgresql+psycopg//me:{PASSWORD}@127.0.0.1/db"),  # no ":" after the scheme
        ("--store", f"postgresql+psycopg://me:{PASSWORD}@127.0.0.1:abc/db"),  # a port that is not a number
        ("--tracking-uri", f"postgresql+psycopg://me:{PASSWORD}@127.0.0.1:abc/db"),
    ],
)
def test_a_url_that_does_not_parse_is_one_masked_line_and_nothing_is_written(
    tmp_path: Path, option: str, url: str
) -> None:
    """Before: the first printed the password in clear (mask_url needs a well-formed "scheme://"),
    the second was a 72-line traceback (exit 1), the third left a `failed` run in the store."""
    done = fedcli("-q", "train", *TINY, "--rounds", "1", "--root", str(tmp_path / "root"), option, url)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert PASSWORD not in done.stdout + done.stderr and "me:***@127.0.0.1" in lines[0], lines
    assert not (tmp_path / "root").exists()
