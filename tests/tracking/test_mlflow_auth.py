"""A wrong MLflow password is said before anything is written (issue 35 part 5).

Before: the run trained, exited 0, and MLflow never got it, with no line saying so (the mirror that
would have said it had not run yet). Now `preflight` asks the server for an experiment with the
credentials MLflow's client sends, and a refusal (HTTP 401/403) is one line: exit 2, or with
`--mlflow-optional` a warning and a run in the SQL store, which `fedcli sync` copies once the
password is right (docs/architecture.md, "Tracking").

A real MLflow tracking server with basic auth (`mlflow server --app-name basic-auth`) on loopback;
it needs Flask-WTF (`pip install 'mlflow[auth]'`), and the test is skipped without it.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedcli.tracking.store.sql_store import SqlStore
from tests.tracking.test_mlflow_true import TINY, env

pytest.importorskip(
    "flask_wtf", reason="the MLflow basic-auth server needs Flask-WTF: pip install 'mlflow[auth]'"
)

ADMIN = "admin"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def auth_server(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(URI, the admin's password) of a real MLflow server with basic auth, stopped at the end."""
    password = secrets.token_hex(8)
    folder = tmp_path / "server"
    folder.mkdir()
    (folder / "auth.ini").write_text(
        "[mlflow]\ndefault_permission = READ\n"
        f"database_uri = sqlite:///{folder / 'auth.db'}\n"
        f"admin_username = {ADMIN}\nadmin_password = {password}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
    )
    port = free_port()
    server_env = {
        **env(),
        "MLFLOW_AUTH_CONFIG_PATH": str(folder / "auth.ini"),
        "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16),
    }
    log = (folder / "log").open("wb")  # noqa: SIM115 - the server's, closed at the end
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--app-name",
            "basic-auth",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{folder / 'mlflow.db'}",
            "--default-artifact-root",
            (folder / "artifacts").as_uri(),
        ],
        stdout=subprocess.DEVNULL,
        stderr=log,
        env=server_env,
        start_new_session=True,
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=5):
                    break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, (folder / "log").read_text()[
                    -2000:
                ]
                time.sleep(1)
        yield uri, password
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=60)
        log.close()


def run(*args: str, password: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fedcli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**env(), "MLFLOW_TRACKING_USERNAME": ADMIN, "MLFLOW_TRACKING_PASSWORD": password},
    )


def test_a_wrong_mlflow_password_is_one_line_and_sync_copies_the_run_once_it_is_right(
    tmp_path: Path, auth_server: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    uri, right = auth_server
    wrong = "not-" + right
    refused = run(
        "-q",
        "train",
        *TINY,
        "--rounds",
        "3",
        "--root",
        str(tmp_path / "a"),
        "--tracking-uri",
        uri,
        password=wrong,
    )
    said = " ".join(refused.stderr.split())
    print(f"exit {refused.returncode}: {said}")
    assert refused.returncode == 2 and "Traceback" not in said, (refused.returncode, said)
    assert said.count("refused the credentials") == 1, said
    assert "refused the credentials (HTTP 401" in said and "MLflow would not get the run" in said, said
    assert wrong not in refused.stderr + refused.stdout and right not in refused.stderr + refused.stdout
    assert not (tmp_path / "a" / "fedcli.db").exists(), "something was written before the check"

    root = tmp_path / "b"
    optional = run(
        "-q",
        "train",
        *TINY,
        "--rounds",
        "3",
        "--root",
        str(root),
        "--tracking-uri",
        uri,
        "--mlflow-optional",
        password=wrong,
    )
    said = " ".join(optional.stderr.split())
    print(f"exit {optional.returncode}: {said}")
    assert optional.returncode == 0 and "Traceback" not in said, (optional.returncode, said)
    assert said.count("refused the credentials") == 1 and "fedcli sync" in said, said
    store = SqlStore(f"sqlite:///{root / 'fedcli.db'}")
    (record,) = store.list_runs()
    assert record.status == "finished" and store.last_round(record.id) == 3

    synced = run("sync", "--root", str(root), "--tracking-uri", uri, password=right)
    assert synced.returncode == 0, synced.stderr[-2000:]
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", right)
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (found,) = client.search_runs(
        [e.experiment_id for e in client.search_experiments()],
        filter_string=f"tags.`fedcli.run_id` = '{record.id}'",
    )
    steps = sorted(m.step for m in client.get_metric_history(found.info.run_id, "eval/loss"))
    assert (found.info.status, steps) == ("FINISHED", [0, 1, 2, 3])
