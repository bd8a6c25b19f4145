"""No process outlives its command for long (issue 35 part 4), on a machine whose cores are both busy.

Two busy loops at normal priority keep both cores busy, as other work on a shared node does. Before
issue 35 the MLflow mirror ran at SCHED_IDLE: on such a machine it was never scheduled, so every
rejected `fedcli train` left its early mirror behind (alive 37 min later), and a SIGKILLed trainer's
mirror never finished. Now (docs/architecture.md, "Tracking"): the mirror runs at nice 19;
a command that ends without a run ends its early mirror as it exits (`discard_early`, atexit); a
mirror whose training process is gone ends within ORPHAN_WAIT_S (`watch_parent`), and what it did not
copy `fedcli sync` copies from the store. A SIGKILLed `fedcli ui` takes its MLflow server with it.

Real `python -m fedcli` processes and real signals; the processes a command started are found by a
marker in their environment (inherited by every descendant), read from /proc. The trainer runs
without CAP_SYS_NICE (`setpriv`, when the test runs as root), as a user on a cluster node does: its
mirror cannot leave nice 19 once the trainer is gone, so the time bound, not a priority boost, is
what ends it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedcli.tracking.store.sql_store import SqlStore
from tests.tracking.test_mlflow_true import TINY, env

MARKER = "FEDCLI_TEST_ORPHAN"


class BusyCores:
    """Two busy loops at normal priority (nice 0), one per core of a 2-core machine, until the test ends."""

    def __init__(self) -> None:
        self.loops: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        self.loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]

    def stop(self) -> None:
        for loop in self.loops:
            loop.kill()
            loop.wait(timeout=30)


@pytest.fixture
def busy_cores() -> Iterator[BusyCores]:
    cores = BusyCores()
    try:
        yield cores
    finally:
        cores.stop()


def alive_with(marker: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process (not a zombie) whose environment holds `MARKER=marker`."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z":
                found.append(
                    (int(entry.name), (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode())
                )
        except OSError:  # it ended meanwhile
            continue
    return found


def wait_until_none(marker: str, within_s: float) -> tuple[list[tuple[int, str]], float]:
    """Poll until no process carries `marker` or `within_s` passed; (what is left, seconds waited)."""
    began = time.monotonic()
    left = alive_with(marker)
    while left and time.monotonic() - began < within_s:
        time.sleep(0.5)
        left = alive_with(marker)
    return left, time.monotonic() - began


def marked_env(marker: str) -> dict[str, str]:
    return {**env(), MARKER: marker}


def without_sys_nice() -> list[str]:
    """A command prefix that drops CAP_SYS_NICE when this test runs as root (else nothing to drop)."""
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        return []
    return [setpriv, "--inh-caps=-sys_nice", "--bounding-set=-sys_nice"]


def test_five_rejected_train_commands_leave_no_process_behind(tmp_path: Path, busy_cores: BusyCores) -> None:
    """Five `fedcli train` commands that fail validation after their mirror started (exit 2, one line each):
    15 s after the last one exited, no process they started is alive."""
    busy_cores.start()
    marker = uuid.uuid4().hex
    bad = [
        ["--task", "no-such-task"],
        ["--algo", "no-such-algo"],
        ["--hp", "no_such_hp=1"],
        ["--config", str(tmp_path / "missing.yaml")],
        ["--data", str(tmp_path / "missing.npz")],
    ]
    procs = [
        subprocess.Popen(
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
                str(tmp_path / f"root{i}"),
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=marked_env(marker),
        )
        for i, args in enumerate(bad)
    ]
    spawned = 0
    while any(proc.poll() is None for proc in procs):  # a mirror each, alive while its command validates
        spawned = max(spawned, sum("fedcli.tracking.mlflow." in cmd for _, cmd in alive_with(marker)))
        time.sleep(0.1)
    for args, proc in zip(bad, procs, strict=True):
        _, err = proc.communicate()
        lines = [line for line in err.splitlines() if line.strip()]
        assert proc.returncode == 2 and "Traceback" not in err, (args, proc.returncode, err[-2000:])
        assert len(lines) >= 1, (args, err)
    left, waited = wait_until_none(marker, 15.0)
    print(f"mirrors seen alive while the commands ran: {spawned}; none left after {waited:.1f} s")
    assert spawned >= 1, "no mirror was ever started: the test checks nothing"
    assert left == [], f"alive 15 s after the rejected commands exited: {left}"
    assert not any((tmp_path / f"root{i}" / "mlflow.db").exists() for i in range(len(bad)))


def mlflow_steps(root: Path, run_id: str, key: str) -> tuple[str, list[int]]:
    """(MLflow status, sorted steps of metric `key`) of the MLflow run tagged with fedcli run `run_id`."""
    if not (root / "mlflow.db").exists():
        return "absent", []
    with contextlib.closing(
        sqlite3.connect(f"file:{root / 'mlflow.db'}?mode=ro", uri=True, timeout=30)
    ) as conn:
        try:
            found = conn.execute(
                "SELECT r.run_uuid, r.status FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid "
                "AND t.key = 'fedcli.run_id' AND t.value = ?",
                (run_id,),
            ).fetchall()
        except sqlite3.OperationalError:  # MLflow's schema is being set up
            return "absent", []
        if not found:
            return "absent", []
        ((uuid_, status),) = found
        steps = [
            s
            for (s,) in conn.execute(
                "SELECT DISTINCT step FROM metrics WHERE run_uuid = ? AND key = ? ORDER BY step", (uuid_, key)
            )
        ]
    return status, steps


@pytest.mark.parametrize("moment", ["mirror-setting-up", "mirror-set-up"])
def test_a_sigkilled_trainer_leaves_no_mirror_and_sync_completes_mlflow(
    tmp_path: Path, busy_cores: BusyCores, moment: str
) -> None:
    """A trainer SIGKILLed mid-run, both cores busy: within 90 s no process it started is alive (its mirror
    finished or gave up), and `fedcli sync` then gives MLflow every round the store may copy (all up to
    the newest checkpoint: checkpoints every round), the MLflow run KILLED.

    `mirror-setting-up`: the cores are busy from the start, and the mirror, at nice 19, has not set
    MLflow up when the trainer dies (it exits at once, having written nothing). `mirror-set-up`: the
    cores get busy once the mirror created the MLflow run (it holds a run to end: it finishes, or gives
    up after ORPHAN_WAIT_S, unable to leave nice 19)."""
    marker = uuid.uuid4().hex
    if moment == "mirror-setting-up":
        busy_cores.start()
    trainer = subprocess.Popen(
        [
            *without_sys_nice(),
            sys.executable,
            "-m",
            "fedcli",
            "-q",
            "train",
            *TINY,
            "--rounds",
            "100000",
            "--checkpoint-every",
            "1",
            "--root",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=marked_env(marker),
    )
    db = tmp_path / "fedcli.db"
    try:
        deadline, trained, run_id = time.monotonic() + 240, 0, None
        while trained < 5 and time.monotonic() < deadline and trainer.poll() is None:
            time.sleep(0.5)
            if db.exists():
                runs = SqlStore(f"sqlite:///{db}").list_runs()
                if runs:
                    run_id = runs[0].id
                    trained = SqlStore(f"sqlite:///{db}").last_round(run_id) or 0
        assert trained >= 5 and run_id is not None, f"the run never reached round 5: {trainer.poll()}"
        if moment == "mirror-set-up":
            while mlflow_steps(tmp_path, run_id, "eval/loss")[0] == "absent" and time.monotonic() < deadline:
                time.sleep(0.5)
            assert mlflow_steps(tmp_path, run_id, "eval/loss")[0] == "RUNNING", (
                "the mirror never set MLflow up"
            )
            busy_cores.start()
            time.sleep(2)
        mirrors = [pid for pid, cmd in alive_with(marker) if "fedcli.tracking.mlflow." in cmd]
        assert len(mirrors) == 1, alive_with(marker)
    finally:
        trainer.send_signal(signal.SIGKILL)
        trainer.communicate(timeout=60)
    left, waited = wait_until_none(marker, 90.0)
    before = mlflow_steps(tmp_path, run_id, "eval/loss")
    print(
        f"the mirror ended {waited:.1f} s after its trainer was killed; MLflow then: {before[0]} with "
        f"{len(before[1])} steps"
    )
    assert left == [], f"alive 90 s after the trainer was SIGKILLed: {left}"

    done = subprocess.run(
        [sys.executable, "-m", "fedcli", "sync", "--root", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env(),
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, (done.returncode, done.stderr[-2000:])
    store = SqlStore(f"sqlite:///{db}")
    newest = store.checkpoints(run_id)[-1][0]
    rounds = sorted({int(r) for r in store.metrics_frame([run_id])["round_idx"] if int(r) <= newest})
    status, steps = mlflow_steps(tmp_path, run_id, "eval/loss")
    print(f"store: rounds up to checkpoint {newest} ({len(rounds)}); MLflow {status} with {len(steps)} steps")
    assert newest >= 4 and rounds == list(range(newest + 1)), (
        newest,
        rounds,
    )  # round 5 trained, 4 checkpointed
    assert (status, steps) == ("KILLED", rounds)


def test_a_sigkilled_fedcli_ui_leaves_no_mlflow_server(tmp_path: Path) -> None:
    """`fedcli ui` SIGKILLed once its server answers: within 20 s every process of MLflow's server (its CLI,
    uvicorn) is gone and the port is free. The CLI gets SIGTERM from the kernel as its parent dies
    (fedcli.children `die_with_parent`) and stops the rest; started in a session of its own (before), the
    server served on, alive 20 s later. MLflow's job runner is off (its Huey consumers outlived a killed
    server: they end only with the process group, which a SIGKILLed `fedcli ui` cannot stop)."""
    from mlflow import MlflowClient

    marker, database = uuid.uuid4().hex, tmp_path / "mlflow.db"
    MlflowClient(f"sqlite:///{database}").search_experiments()  # an MLflow store for the UI to open
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with open(tmp_path / "ui.err", "w") as err:
        ui = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fedcli",
                "ui",
                "--tracking-uri",
                f"sqlite:///{database}",
                "--port",
                str(port),
            ],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=marked_env(marker),
        )
    try:
        assert ui.stdout is not None
        url = ui.stdout.readline().strip()  # printed once the server answers /health
        servers = [pid for pid, _ in alive_with(marker) if pid != ui.pid]
        assert url.startswith(f"http://127.0.0.1:{port}/") and servers, (
            url,
            (tmp_path / "ui.err").read_text(),
        )
    finally:
        ui.kill()
        ui.wait(timeout=30)
    began = time.monotonic()
    while (left := alive_with(marker)) and time.monotonic() - began < 20:
        time.sleep(0.5)
    waited = time.monotonic() - began
    with socket.socket() as probe:
        serving = probe.connect_ex(("127.0.0.1", port)) == 0
    for pid, _ in alive_with(marker):  # what this test started, by pid
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    print(f"{len(servers)} server processes; {len(left)} alive {waited:.1f} s after fedcli ui was SIGKILLed")
    assert left == [] and not serving, (left, serving)
