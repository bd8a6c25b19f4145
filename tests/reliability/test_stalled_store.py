"""A stalled process never stalls the others (issue 23, row 5), with real processes and real locks.

A real process takes SQLite's write lock (`BEGIN IMMEDIATE` and a write) and stops itself with
SIGSTOP, as a training process stopped mid-transaction would. Then:

- readers (`fedcli list runs`, `fedcli report`) answer at once: opening a current store only
  reads its schema, and WAL reads take no lock (before: both failed after 37-80 s with
  "is not writable: database is locked");
- a writer waits, says so naming the holder ("locked by pid N (python, stopped)"), gives up
  after `FEDCLI_STORE_RETRY_S` with one line that names the pid and the fix, exit 2, and writes
  nothing; a writer whose holder continues within the bound carries on and finishes;
- the auto checkpoint cadence ignores the stalled write: a checkpoint write held up by the
  locked store (its row waits for the lock) does not space the next checkpoints out.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from fedcli.config.build import build_config
from fedcli.engine.checkpoint_writer import AUTO_BUDGET, CheckpointWriter
from fedcli.tracking.store.sql_store import SqlStore

pytestmark = pytest.mark.timeout(300)

HOLD = r"""
import os, signal, sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
conn.execute("UPDATE experiments SET name = name")
print("locked", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
conn.execute("COMMIT")
"""


def hold_write_lock(db_file: Path) -> subprocess.Popen[str]:
    """A process that holds the store's write lock mid-transaction, stopped (SIGCONT lets it commit and exit)."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(db_file)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    deadline = time.monotonic() + 10
    while Path(f"/proc/{holder.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, "the holder did not stop"
        time.sleep(0.01)
    return holder


def fedcli(*args: str, **env: str) -> subprocess.Popen[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("FEDCLI_STORE", "MLFLOW_TRACKING_URI")}
    return subprocess.Popen(
        [sys.executable, "-m", "fedcli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**base, "OMP_NUM_THREADS": "1", "COLUMNS": "200", **env},
    )


def finished_run(db: SqlStore) -> str:
    run_id = db.start_run(
        experiment="stall",
        run_name="kept",
        config={"seed": 0},
        algo="fedavg",
        task="lsq",
        seed=0,
        tags={},
        fedcli_version="x",
        torch_version="y",
        git_commit=None,
    )
    for round_idx in range(3):
        db.log_round(run_id, round_idx, {"eval/loss": 1.0 / (round_idx + 1)})
    db.end_run(run_id, "finished")
    return run_id


def test_readers_answer_and_writers_wait_with_a_true_message_while_a_writer_is_stopped(
    tmp_path: Path,
) -> None:
    root = tmp_path / "root"
    url = f"sqlite:///{root / 'fedcli.db'}"
    run_id = finished_run(SqlStore(url))
    holder = hold_write_lock(root / "fedcli.db")
    try:
        start = time.monotonic()
        listing = fedcli("list", "runs", "--root", str(root), "--json")
        report = fedcli("report", "--runs", run_id, "--store", url, "--format", "json")
        out, err = listing.communicate(timeout=120)
        assert listing.returncode == 0, err
        assert run_id in out and "locked" not in err
        out, err = report.communicate(timeout=120)
        assert report.returncode == 0, err
        assert run_id[:8] in out
        readers_s = time.monotonic() - start
        assert readers_s < 60, f"readers took {readers_s:.0f} s"  # before: they failed after 37-80 s

        writer = fedcli(
            "-q",
            "train",
            "--task",
            "lsq",
            "--rounds",
            "2",
            "--no-mlflow",
            "--root",
            str(root),
            FEDCLI_STORE_RETRY_S="4",
        )
        _, err = writer.communicate(timeout=120)
        lines = [line for line in err.splitlines() if line.strip()]
        assert writer.returncode == 2, err
        assert "Traceback" not in err
        assert any(
            f"is locked by pid {holder.pid} (python, stopped); waiting up to 4 s" in line for line in lines
        ), err
        assert (
            lines[-1].startswith("error: ")
            and f"locked by pid {holder.pid}" in lines[-1]
            and f"kill -CONT {holder.pid}" in lines[-1]
            and "not writable" not in lines[-1]
        ), err
        assert [r.id for r in SqlStore(url).list_runs()] == [run_id]  # the refused writer wrote nothing

        waiter = fedcli("-q", "train", "--task", "lsq", "--rounds", "2", "--no-mlflow", "--root", str(root))
        assert waiter.stderr is not None
        for line in waiter.stderr:  # it says it waits, then the holder goes on
            if "waiting up to" in line:
                break
        os.kill(holder.pid, signal.SIGCONT)
        rest = waiter.communicate(timeout=120)[1]
        assert waiter.returncode == 0, rest
        assert "answers again after" in rest
        assert sorted(r.status for r in SqlStore(url).list_runs()) == ["finished", "finished"]
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_a_checkpoint_write_stalled_by_a_locked_store_does_not_switch_checkpoints_off(tmp_path: Path) -> None:
    """Rounds of 1 s (as the round loop reports them), checkpoints written and recorded in a real
    store; one record waits 3 s for the write lock held by a stopped process. The last-write
    cadence then spaced checkpoints 100 rounds apart (3 s / 3 % of 1 s); the median one goes on
    writing after every round, as before the stall."""
    root = tmp_path / "root"
    db = SqlStore(f"sqlite:///{root / 'fedcli.db'}")
    run_id = db.start_run(
        experiment="cadence",
        run_name=None,
        config={},
        algo="fedavg",
        task="lsq",
        seed=0,
        tags={},
        fedcli_version="x",
        torch_version="y",
        git_commit=None,
    )
    writer = CheckpointWriter(
        root / "runs" / run_id,
        record=lambda r, p: db.add_checkpoint(run_id, r, p),
        forget=lambda rounds: db.delete_checkpoints(run_id, rounds),
        existing=[],
        every=None,
        keep=1000,
    )
    state, config = {"w": torch.zeros(10)}, build_config(overrides={"data.task": "lsq"}).to_dict()
    written: list[int] = []
    stalled_round, slowest = 20, 0.0
    for round_idx in range(1, 201):
        if round_idx == stalled_round:
            holder = hold_write_lock(root / "fedcli.db")
            threading.Timer(3.0, os.kill, (holder.pid, signal.SIGCONT)).start()
        if writer.due(round_idx, 1.0):
            writer.submit(round_idx, state, {}, config, 0)
            written.append(round_idx)
        slowest = max(slowest, writer._write_s or 0.0)  # noqa: SLF001 - what the cadence was told
    writer.close()
    holder.wait(timeout=30)
    assert stalled_round in written and slowest >= 3.0  # the stall was measured as a write time
    after = [r for r in written if r > stalled_round]
    assert len(after) >= 170, f"only {len(after)} checkpoints in the 180 rounds after the stall: {after[:10]}"
    assert max(b - a for a, b in zip([stalled_round, *after], after, strict=False)) <= 2
    assert [r for r, _ in db.checkpoints(run_id)] == written


def test_the_auto_cadence_measures_again_when_the_first_write_stalled(tmp_path: Path) -> None:
    """A stalled first write is the only sample: the cap of MAX_GAP_S seconds of rounds still brings
    the next checkpoint (which measures again) instead of none for 33 000 rounds."""
    writer = CheckpointWriter(
        tmp_path, record=lambda r, p: None, forget=lambda rounds: None, existing=[], every=None, keep=3
    )
    writer._write_s = 1000.0  # noqa: SLF001 - what the writer thread stores after a write stalled 1000 s
    assert not writer.due(1, 1.0) or writer.interval == 1
    assert writer.interval == min(
        int(CheckpointWriter.MAX_GAP_S / 1.0), int(1000.0 / (AUTO_BUDGET * 1.0)) + 1
    )
    assert writer.interval == 600
    writer.close()
