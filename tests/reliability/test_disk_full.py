"""A disk that fills up under a sweep: one line, exit 2, nothing from MLflow's own logs, and a rerun
continues once there is space again. Real disks: a small tmpfs mounted for the test (root only;
skipped where mounting is not allowed), filled to its last byte while the sweep runs.

`fedcli train` alone on a full disk is tests/reliability/test_lifecycle.py
(test_disk_full_while_checkpointing_says_so_in_one_line_and_resumes).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedcli.tracking.store.sql_store import SqlStore

SPEC = """experiment: full
base: {task: lsq, rounds: 300, clients_per_round: 4}
grid: {algo: [fedavg, fedprox], hp.mu: [0.01]}
seeds: [0]
"""


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A 32 MB tmpfs, unmounted (lazily: a trial's MLflow mirror may still hold a file) after the test."""
    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if made.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({made.stderr.strip() or 'not root'}); the disk-full tests need root"
        )
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(folder: Path) -> Path:
    """Write zeros into folder/fill until the file system has no byte left (unbuffered, in halving chunks)."""
    path = folder / "fill"
    handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        chunk = 1 << 20
        while chunk:
            try:
                os.write(handle, b"\0" * chunk)
            except OSError:
                chunk //= 2
    finally:
        os.close(handle)
    return path


def sweep(spec: Path, root: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("FEDCLI_STORE", "MLFLOW_TRACKING_URI")}
    return subprocess.Popen(
        [sys.executable, "-m", "fedcli", "sweep", str(spec), "--root", str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**env, "OMP_NUM_THREADS": "1", "COLUMNS": "200"},
    )


@pytest.mark.timeout(1500)
def test_a_disk_filling_up_under_a_sweep_is_one_line_exit_2_and_a_rerun_continues(
    disk: Path, tmp_path: Path
) -> None:
    """The sweep's root (its store, MLflow store, checkpoints) fills up while its first trial trains:
    the sweep stops with exit 2 and one `error:` line naming the full disk, with no traceback and
    no log record of MLflow's (it ends the sweep's MLflow run quietly on the way out). With the
    space back, the same command resumes the stopped trial and runs the others: each trial once."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    root = disk / "runs"
    proc = sweep(spec, root)
    deadline = time.monotonic() + 300
    while not any((root / "runs").glob("*")) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    time.sleep(1.0)  # into the first trial's rounds
    filler = fill(disk)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 2, err[-3000:]
    assert "Traceback" not in err and " ERROR " not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "no space left on device" in errors[0], err[-3000:]
    tail = err[err.index("error:") :]
    assert tail.strip() == errors[0].strip() or " ".join(tail.split()) == " ".join(errors[0].split()), tail

    filler.unlink()
    rerun = sweep(spec, root)
    out, err = rerun.communicate(timeout=900)
    assert rerun.returncode == 0, err[-3000:]
    runs = SqlStore(f"sqlite:///{root / 'fedcli.db'}").list_runs()
    assert sorted(r.status for r in runs) == ["finished"] * 2, [
        (r.run_name, r.status, r.failure_reason) for r in runs
    ]
    assert (
        len({r.config_hash for r in runs}) == 2
    )  # each trial once: the stopped one was resumed, not restarted


def test_ending_the_sweeps_mlflow_run_on_a_full_disk_is_one_warning_line(disk: Path, tmp_path: Path) -> None:
    """MLflow logs its store's failure to end a run as ERROR with two tracebacks (the issue saw 145
    lines); the sweep says it in one warning line, and a rerun of the sweep ends that run. The sweep's
    mirror process opens and ends the parent run (issue 27): a real one here, its disk filled after
    it opened the run."""
    import sqlite3

    from fedcli.sweep.rows import parent_tags
    from fedcli.tracking.mlflow.sweep_mirror import SweepMirror

    SqlStore(f"sqlite:///{tmp_path / 'fedcli.db'}")  # the trials' store (none to copy here)
    mirror = SweepMirror(
        tracking_uri=f"sqlite:///{disk / 'mlflow.db'}",
        experiment="full",
        store_url=f"sqlite:///{tmp_path / 'fedcli.db'}",
        runs_root=tmp_path / "runs",
    )
    spec = {"experiment": "full", "grid": {"algo": ["fedavg"]}}
    mirror.spawn(spec, parent_tags(spec))
    deadline, opened = time.monotonic() + 120, []
    while not opened and time.monotonic() < deadline:
        time.sleep(0.2)
        try:
            with sqlite3.connect(disk / "mlflow.db", timeout=5) as conn:
                opened = conn.execute("SELECT value FROM tags WHERE key = 'fedcli.kind'").fetchall()
        except sqlite3.Error:  # not created yet
            continue
    assert opened == [("sweep",)], "the mirror did not open the sweep's MLflow run"
    fill(disk)
    warning = mirror.finish(status="finished")
    assert warning == (
        "MLflow could not end the sweep's run (database or disk is full); it stays open, and "
        "rerunning the sweep ends it."
    ), warning
