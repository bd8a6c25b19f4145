"""What `fedcli train` and `fedcli sweep` print for scripts and for people, as real processes.

- `-q`: stderr carries warnings and errors only (no end-of-run summary), stdout the run id alone.
- The run id is on stdout as soon as the run exists: a run stopped by SIGTERM has printed it,
  so `RUN=$(fedcli -q train …)` can resume it.
- Every hint a run prints (`browse:`, `report:`, the resume command of a stopped run, the rerun
  command of a stopped sweep) works pasted as printed in ANOTHER folder: the runs live under a
  relative `--root` of the folder they were trained in, and each hint runs from a second folder
  (`fedcli ui` with `--print-only`, so that no server starts).

About a minute on 2 busy cores: five `fedcli` processes that train lsq.
"""

from __future__ import annotations

import os
import re
import selectors
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from fedcli.tracking.store.sql_store import SqlStore

ENV = {
    **{k: v for k, v in os.environ.items() if k not in ("FEDCLI_STORE", "MLFLOW_TRACKING_URI", "COLUMNS")},
    "OMP_NUM_THREADS": "1",
}
FEDCLI = [sys.executable, "-m", "fedcli"]
RUN_ID = re.compile(r"[0-9a-f]{32}")


def fedcli(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*FEDCLI, *args], cwd=cwd, capture_output=True, text=True, env=ENV, timeout=timeout)


def paste(hint: str, cwd: Path, *extra: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """Run a printed command line as a shell would, in `cwd` (its program is the printed one)."""
    return subprocess.run(
        [*shlex.split(hint), *extra], cwd=cwd, capture_output=True, text=True, env=ENV, timeout=timeout
    )


def hint(stderr: str, after: str) -> str:
    """The command printed after `after` on one line of `stderr` (a line is never wrapped: no terminal)."""
    (line,) = [line for line in stderr.splitlines() if after in line]
    return line.split(after, 1)[1].strip()


def first_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        assert sel.select(timeout_s), f"nothing on stdout within {timeout_s} s"
    return proc.stdout.readline()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def folders(tmp_path: Path) -> tuple[Path, Path]:
    here, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    return here, elsewhere


def test_quiet_prints_warnings_only_and_the_run_id(tmp_path: Path) -> None:
    """A clean run prints nothing on stderr under -q; a degenerate one keeps its warning line."""
    clean = fedcli(
        "-q", "train", "--task", "lsq", "--rounds", "3", "--root", "runs", "--no-mlflow", cwd=tmp_path
    )
    warned = fedcli(
        "-q",
        "train",
        "--task",
        "lsq",
        "--algo",
        "fedprox",
        "--hp",
        "mu=0",
        "--rounds",
        "2",
        "--root",
        "runs",
        "--no-mlflow",
        cwd=tmp_path,
    )

    assert clean.returncode == 0, clean.stderr
    assert clean.stderr == "" and RUN_ID.fullmatch(clean.stdout.strip())
    assert warned.returncode == 0, warned.stderr
    assert [line.split(":")[0] for line in warned.stderr.splitlines()] == ["warning"]
    assert "hp.mu=0 removes the proximal term" in warned.stderr and RUN_ID.fullmatch(warned.stdout.strip())


@pytest.mark.timeout(400)
@pytest.mark.parametrize("root", ["runs", None], ids=["relative-root", "default-root"])
def test_train_hints_work_pasted_in_another_folder(tmp_path: Path, root: str | None) -> None:
    """`browse:` and `report:` of a run trained under the relative root `runs`, or the default
    `./fedcli-runs` (whose hints were `fedcli ui` and `fedcli report --runs ID` without a store:
    exit 2, "no MLflow store at <elsewhere>/fedcli-runs/mlflow.db"), pasted elsewhere."""
    here, elsewhere = folders(tmp_path)
    trained = fedcli("train", "--task", "lsq", "--rounds", "3", *(["--root", root] if root else []), cwd=here)
    assert trained.returncode == 0, trained.stderr
    run_id = trained.stdout.strip()
    port = str(free_port())

    browse = paste(hint(trained.stderr, "browse:"), elsewhere, "--print-only", "--port", port)
    report = paste(hint(trained.stderr, "report:"), elsewhere)

    assert browse.returncode == 0, browse.stderr
    url, command = browse.stdout.splitlines()
    assert re.fullmatch(
        rf"http://127\.0\.0\.1:{port}/#/experiments/\d+/runs\?workflowType=machine_learning"
        r"&viewStateShareKey=fedcli-compare",
        url,
    ), url
    assert (
        f"--backend-store-uri sqlite:///{here.resolve() / (root or 'fedcli-runs') / 'mlflow.db'} " in command
    )
    assert report.returncode == 0, report.stderr
    assert run_id[:8] in (elsewhere / "report.md").read_text()
    assert not (elsewhere / "fedcli-runs").exists() and not (elsewhere / "runs").exists()


@pytest.mark.timeout(400)
def test_a_stopped_run_printed_its_id_and_its_resume_hint_works_elsewhere(tmp_path: Path) -> None:
    """`RUN=$(fedcli -q train …)` then SIGTERM: the id was on stdout before the stop (and nothing
    else is), the run is interrupted, and the printed resume command finishes it from elsewhere."""
    here, elsewhere = folders(tmp_path)
    proc = subprocess.Popen(
        [
            *FEDCLI,
            "-q",
            "train",
            "--task",
            "lsq",
            "--rounds",
            "100000",
            "--checkpoint-every",
            "1",
            "--root",
            "runs",
            "--no-mlflow",
        ],
        cwd=here,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    try:
        printed = first_line(proc, 180).strip()
        store = SqlStore(f"sqlite:///{here / 'runs' / 'fedcli.db'}")
        deadline = time.monotonic() + 120
        while (store.last_round(printed) or 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    (run,) = store.list_runs()
    last = store.last_round(run.id) or 0

    assert printed == run.id and rest == "", (printed, rest)
    assert proc.returncode == 143 and run.stored_status == "interrupted", (proc.returncode, err[-2000:])
    resumed = paste(hint(err, "Continue it with:"), elsewhere, "--rounds", str(last + 2))
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.strip() == run.id
    assert store.get_run(run.id).stored_status == "finished" and store.last_round(run.id) == last + 2
    assert not (elsewhere / "fedcli-runs").exists()


@pytest.mark.timeout(400)
def test_a_stopped_sweeps_rerun_hint_works_elsewhere(tmp_path: Path) -> None:
    """A sweep of a relative spec under the relative root `runs`, stopped by SIGTERM in its first
    trial: the printed rerun command, pasted in another folder, finishes that trial."""
    here, elsewhere = folders(tmp_path)
    (here / "spec.yaml").write_text(
        yaml.safe_dump(
            {
                "experiment": "hints",
                "base": {"task": "lsq", "rounds": 300},
                "grid": {"algo": ["fedavg"]},
                "seeds": [0],
            }
        )
    )
    proc = subprocess.Popen(
        [*FEDCLI, "sweep", "spec.yaml", "--root", "runs", "--no-mlflow"],
        cwd=here,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    db = here / "runs" / "fedcli.db"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            runs = SqlStore(f"sqlite:///{db}").list_runs() if db.exists() else []
            if runs and (SqlStore(f"sqlite:///{db}").last_round(runs[0].id) or 0) >= 1:
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()

    assert proc.returncode == 143, err[-2000:]
    rerun = hint(err, "continue with:")
    assert rerun.split()[1:3] == ["sweep", str((here / "spec.yaml").resolve())], rerun
    again = paste(rerun, elsewhere)
    assert again.returncode == 0, again.stderr[-2000:]
    (run,) = SqlStore(f"sqlite:///{db}").list_runs()
    assert run.stored_status == "finished" and SqlStore(f"sqlite:///{db}").last_round(run.id) == 300
    assert not (elsewhere / "fedcli-runs").exists() and not (elsewhere / "runs").exists()
