"""The researcher's daily loop: list runs, report on them, open the MLflow UI.

`fedcli list runs` is checked on a store filled by hand (crafted ids that share long
prefixes, long names, FedPA runs that differ in rho); `fedcli ui` against a store that a
real two-round `fedcli train` wrote, with the MLflow server actually started and stopped.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedcli.cli.listing import short_ids
from fedcli.cli.main import app
from fedcli.tracking.store.sql_store import SqlStore

RUNNER = CliRunner()


def _add(store: SqlStore, run_id: str, algo: str, rho: float | None, name: str) -> None:
    config = {
        "seed": 0,
        "algorithm": {"name": algo, "hp": {} if rho is None else {"rho": rho, "burn_in_rounds": 4}},
        "data": {"task": "toy"},
        "train": {"rounds": 2},
    }
    store.start_run(
        experiment="a-rather-long-experiment-name",
        run_name=name,
        config=config,
        algo=algo,
        task="toy",
        seed=0,
        tags={},
        fedcli_version="t",
        torch_version="t",
        git_commit=None,
        run_id=run_id,
    )
    for round_idx in (0, 1, 2):
        store.log_round(run_id, round_idx, {"eval/accuracy": 0.25 * round_idx, "eval/loss": 1.0})
    store.end_run(run_id, "finished")


def test_short_ids_are_the_shortest_unique_prefixes_of_at_least_8() -> None:
    ids = ["abcdef0123456789" + "0" * 16, "abcdef0123459999" + "0" * 16, "ffff" + "0" * 28]

    shorts = short_ids(ids)

    assert shorts == {ids[0]: "abcdef0123456", ids[1]: "abcdef0123459", ids[2]: "ffff0000"}


def test_list_runs_fits_80_columns_with_short_ids_and_non_default_hyperparameters(tmp_path: Path) -> None:
    """Two FedPA runs with rho 0.1 (FedPA's default) and 0.3, both with burn_in_rounds=4 (default 100):
    the hp column shows each run's non-default values, wrapped within the column; two ids share
    their first 12 characters, so they show 13; the rest show 8."""
    ids = ["0123456789ab" + "c" * 20, "0123456789ab" + "d" * 20, "9" * 32]
    with SqlStore(f"sqlite:///{tmp_path / 'fedcli.db'}") as store:
        _add(store, ids[0], "fedpa", 0.1, "a-very-long-run-name-that-would-never-fit-in-a-narrow-terminal")
        _add(store, ids[1], "fedpa", 0.3, "short")
        _add(store, ids[2], "fedavg", None, "baseline")

    table = RUNNER.invoke(app, ["list", "runs", "--root", str(tmp_path)], env={"COLUMNS": "80"})
    as_json = RUNNER.invoke(app, ["list", "runs", "--root", str(tmp_path), "--json"])

    assert table.exit_code == 0, table.output
    lines = table.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80
    rows = {
        line.split("│")[1].strip(): line
        for line in lines
        if line.startswith("│") and line.split("│")[1].strip()
    }
    assert sorted(rows) == ["0123456789abc", "0123456789abd", "99999999"]
    assert "burn_in_rounds=4" in rows["0123456789abc"] and "burn_in_rounds=4" in rows["0123456789abd"]
    assert "rho=0.3" in table.stdout and "rho=0.1" not in table.stdout and "…" in rows["0123456789abc"]
    assert as_json.exit_code == 0
    assert [row["id"] for row in json.loads(as_json.stdout)] == ids
    assert all(not key.startswith("_") for row in json.loads(as_json.stdout) for key in row)


def test_list_algos_refuses_root() -> None:
    result = RUNNER.invoke(app, ["list", "algos", "--root", "somewhere"])

    assert result.exit_code == 2 and "--root applies to `fedcli list runs` only" in result.stderr


def test_report_under_root_with_run_length_defaults_and_unfinished_runs_on_request(tmp_path: Path) -> None:
    """Two finished FedPA runs (rho 0.1, 0.3) of 2 rounds and one interrupted FedAvg run:
    the default report covers the finished ones, labelled algorithm first, with W = S = 1
    (2 rounds // 10, at least 1); --include-unfinished adds the interrupted one; --window 50
    is kept and warned about."""
    ids = ["a" * 32, "b" * 32, "c" * 32]
    with SqlStore(f"sqlite:///{tmp_path / 'fedcli.db'}") as store:
        _add(store, ids[0], "fedpa", 0.1, "one")
        _add(store, ids[1], "fedpa", 0.3, "two")
        _add(store, ids[2], "fedavg", None, "three")
        store.end_run(ids[2], "interrupted")

    finished = RUNNER.invoke(app, ["report", "--root", str(tmp_path)])
    everything = RUNNER.invoke(
        app, ["report", "--root", str(tmp_path), "--include-unfinished", "--window", "50"]
    )

    assert finished.exit_code == 0, finished.output
    assert "window 1; smoothing 1" in finished.stdout
    assert "| fedpa rho=0.1 | 1 |" in finished.stdout and "| fedpa rho=0.3 | 1 |" in finished.stdout
    assert ids[2] not in finished.stdout
    assert everything.exit_code == 0, everything.output
    assert (
        "| fedavg | 1 |" in everything.stdout and "did not finish (status interrupted)" in everything.stdout
    )
    assert "Warning: --window 50 exceeds the 2 rounds every run ran" in everything.stdout
    assert (
        f"- command: `fedcli report --window 50 --include-unfinished --root {tmp_path}`" in everything.stdout
    )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _processes_with(text: str) -> list[str]:
    listing = subprocess.run(
        ["ps", "-ww", "-eo", "pid,args"], capture_output=True, text=True, check=True
    ).stdout
    return [line for line in listing.splitlines() if text in line and "ps -ww" not in line]


@pytest.mark.timeout(150)
def test_ui_serves_the_experiments_runs_table_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    """A real 2-round run logs to MLflow; `fedcli ui` prints the runs-table URL of its experiment
    only once the server answers, both the URL and /health answer 200, and SIGTERM stops the
    command and every server process (one worker, MLflow's own process group)."""
    env = {**os.environ, "FEDCLI_STORE": "", "MLFLOW_TRACKING_URI": ""}
    env = {k: v for k, v in env.items() if v}
    trained = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedcli",
            "-q",
            "train",
            "--task",
            "lsq",
            "--rounds",
            "2",
            "--root",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert trained.returncode == 0, trained.stderr
    port = _free_port()
    from mlflow import MlflowClient

    experiment = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_experiment_by_name("default")
    named = RUNNER.invoke(
        app, ["ui", "--root", str(tmp_path), "--port", str(port), "--experiment", "default", "--print-only"]
    )
    unknown = RUNNER.invoke(app, ["ui", "--root", str(tmp_path), "--experiment", "nope", "--print-only"])

    ui = subprocess.Popen(
        [sys.executable, "-m", "fedcli", "ui", "--root", str(tmp_path), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        url = ui.stdout.readline().strip()  # printed only once /health answers
        with (
            urllib.request.urlopen(url, timeout=10) as page,
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as health,
        ):
            statuses = (page.status, health.status)
        assert _processes_with(f"--port {port} --workers 1")
    finally:
        ui.send_signal(signal.SIGTERM)
        code = ui.wait(timeout=30)
    stderr = ui.stderr.read()

    assert url == (
        f"http://127.0.0.1:{port}/#/experiments/{experiment.experiment_id}/runs?workflowType=machine_learning"
        "&viewStateShareKey=fedcli-compare"
    )
    assert named.exit_code == 0 and named.stdout.splitlines()[0] == url
    assert unknown.exit_code == 2 and "--experiment must name an MLflow experiment" in unknown.stderr
    assert statuses == (200, 200)
    assert code == 0 and "starting MLflow UI…" in stderr and "Traceback" not in stderr
    assert _processes_with(f"--port {port}") == []
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0  # nothing listens any more
