"""Round 1 never waits for MLflow (issue 27): the mirror starts first thing, sets MLflow up while the run
trains, and a set-up that fails after `preflight` is one warning, not a failed run.

Real `fedcli` processes and mirror processes, a real SQLite MLflow store read back with sqlite3.
docs/operations.md, "The MLflow mirror" describes the behaviour checked here.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from fedcli import children
from fedcli.tracking.mlflow import handle as mirror_handle
from fedcli.tracking.mlflow.handle import MirrorHandle
from fedcli.tracking.mlflow.sink import default_tracking_uri
from fedcli.tracking.store.sql_store import SqlStore
from tests.tracking.test_mlflow_true import TINY, fedcli, mlflow_runs


def test_a_mirror_started_early_and_never_adopted_exits_0_in_silence() -> None:
    """`spawn_early` (what `fedcli train` calls first): end of file on its stdin (the command ended
    without a run, e.g. bad input) ends it with exit 0 and nothing on stderr (it knows no store to
    write: the URLs come with the first line, which never came)."""
    mirror_handle.spawn_early()
    proc = children.early(mirror_handle.KIND)
    assert proc is not None
    children._EARLY.pop(mirror_handle.KIND)
    assert proc.stdin is not None
    proc.stdin.close()
    assert proc.wait(timeout=120) == 0
    assert proc.stderr is not None and proc.stderr.read() == b""


def test_a_run_adopts_the_early_mirror_and_mlflow_gets_the_run(tmp_path: Path) -> None:
    """`MirrorHandle.spawn` takes the process `spawn_early` started (the same pid), hands it the URLs
    and the experiment on stdin (not its command line, which holds no URL), and that mirror copies
    the run into MLflow: FINISHED, the store's points."""
    mirror_handle.spawn_early()
    early = children.early(mirror_handle.KIND)
    store = SqlStore(f"sqlite:///{tmp_path / 'fedcli.db'}")
    handle = MirrorHandle(
        tracking_uri=default_tracking_uri(tmp_path),
        experiment="early",
        store_url=store.url,
        runs_root=tmp_path / "runs",
    ).spawn()
    assert early is not None and handle._proc is early and children.early(mirror_handle.KIND) is None
    cmdline = Path(f"/proc/{early.pid}/cmdline").read_bytes().split(b"\0")
    assert not any(b"sqlite" in part for part in cmdline), cmdline
    run_id = store.start_run(
        experiment="early",
        run_name=None,
        config={"seed": 0},
        algo="fedavg",
        task="lsq",
        seed=0,
        tags={},
        fedcli_version="t",
        torch_version="t",
        git_commit=None,
    )
    handle.start(run_id)
    for round_idx in range(3):
        store.log_round(run_id, round_idx, {"eval/loss": 1.0 / (round_idx + 1)}, ())
    store.end_run(run_id, "finished")
    assert handle.finish() is None
    status, _, _, points, _ = mlflow_runs(tmp_path)[run_id]
    assert (status, points) == ("FINISHED", 3)


def test_mlflow_set_up_failing_after_the_check_is_one_warning_and_the_run_trains_on(tmp_path: Path) -> None:
    """MLflow's store is a file that is not a database: `preflight` lets it through (it exists, no
    half-migrated table can be read), the mirror's set-up fails. The run trains every round anyway
    (round 1 does not wait for MLflow), exits 0 with one MLflow warning quoting the mirror's reason
    and naming `fedcli sync`, the mirror is not restarted (one warning, not four), and the SQL store
    holds the whole run (before issue 27: the run ended `failed` before round 1, exit 2)."""
    (tmp_path / "mlflow.db").write_bytes(b"this is not an SQLite database" * 100)
    began = time.monotonic()
    done = fedcli("-q", "train", *TINY, "--rounds", "4", "--root", str(tmp_path))
    took = time.monotonic() - began
    said = " ".join(done.stderr.split())
    print(f"exit {done.returncode} after {took:.1f} s: {said}")
    assert done.returncode == 0 and "Traceback" not in said, said
    assert said.count("MLflow could not be set up for the run") == 1, said
    assert "file is not a database" in said and "fedcli sync" in said and "restarted" not in said, said
    db = SqlStore(f"sqlite:///{tmp_path / 'fedcli.db'}")
    (run,) = db.list_runs()
    assert run.status == "finished" and db.last_round(run.id) == 4
    assert sorted(set(db.metrics_frame([run.id])["round_idx"])) == list(range(5))


def test_a_config_without_mlflow_ends_the_mirror_train_started_before_it_read_the_config(
    tmp_path: Path,
) -> None:
    """`fedcli train` starts its mirror before it reads `--config`; a config with `tracking.use_mlflow:
    false` ends that mirror (`discard_early`) instead of leaving it idle while the run trains."""
    import os
    import signal
    import sys

    (tmp_path / "run.yaml").write_text("tracking: {use_mlflow: false}\n")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fedcli",
            "-q",
            "train",
            *TINY,
            "--rounds",
            "100000",
            "--config",
            str(tmp_path / "run.yaml"),
            "--root",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )

    def mirrors() -> list[int]:  # live mirror children (not zombies waiting to be reaped)
        found = []
        for kid in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split():
            try:
                state = Path(f"/proc/{kid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z" and b"fedcli.tracking.mlflow." in Path(f"/proc/{kid}/cmdline").read_bytes():
                    found.append(int(kid))
            except OSError:  # it ended meanwhile
                continue
        return found

    try:
        deadline, trained = time.monotonic() + 120, 0
        while trained < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            if (tmp_path / "fedcli.db").exists():
                db = SqlStore(f"sqlite:///{tmp_path / 'fedcli.db'}")
                trained = max((db.last_round(r.id) or 0 for r in db.list_runs()), default=0)
        assert trained >= 3, "the run never reached round 3"
        deadline = time.monotonic() + 60
        while mirrors() and time.monotonic() < deadline:  # it exits once its imports are done
            time.sleep(0.2)
        assert mirrors() == [] and proc.poll() is None
        assert not (tmp_path / "mlflow.db").exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)


def test_a_sweep_mirror_is_not_started_without_the_tags_of_its_parent_run(tmp_path: Path) -> None:
    """The sweep hands its mirror the tags that find its MLflow parent run (`fedcli.sweep.rows.parent_tags`):
    a spec without them would search by no tag and nest the trials under any run of the experiment."""
    from fedcli.tracking.mlflow.sweep_mirror import SweepMirror

    mirror = SweepMirror(
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
        experiment="x",
        store_url=f"sqlite:///{tmp_path / 'fedcli.db'}",
        runs_root=tmp_path / "runs",
    )
    with pytest.raises(ValueError, match="the tags that find its parent run"):
        mirror.spawn({"experiment": "x", "grid": {"algo": ["fedavg"]}})
    assert mirror.pid is None  # nothing was started
