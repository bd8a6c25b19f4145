"""A search sweep on `--backend ray` with a PostgreSQL store that has a password (issue 35): the password is
never a Ray argument (fedcli/sweep/ray_runner.py: actors and the pruning hook get the URL masked and read the real
one from FEDCLI_STORE in their own environment), so no file of Ray's session (its logs included), no output
and no row holds it; a cluster whose workers lack FEDCLI_STORE is refused in one line before anything runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedcli.tracking.store.sql_store import SqlStore
from tests.reliability.test_password_forms import ENCODED, PASSWORD, ROLE, env, leaks, password_role  # noqa: F401
from tests.sweeps.test_ray_backend import HEAD_START_S

optuna = pytest.importorskip("optuna")
pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(600)

SPEC = (
    "experiment: ray-secret\n"
    "base: {task: lsq, rounds: 4, clients_per_round: 3, local_epochs: 1, batch_size: 5, eval_every: 1}\n"
    "seeds: [0]\n"
    "search: {sampler: tpe, trials: 3, metric: loss, direction: min, seed: 0,\n"
    "         space: {client_lr: {log_uniform: [0.001, 0.05]}}}\n"
    "pruner: {type: median, warmup: 1, startup_trials: 1}\n"
)


def sweep(spec: Path, store: str, address: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "fedcli",
            "sweep",
            str(spec),
            "--store",
            store,
            "--root",
            str(cwd / "root"),
            "--no-mlflow",
            "--backend",
            "ray",
            "--address",
            address,
            "--workers",
            "1",
        ],
        capture_output=True,
        text=True,
        env=env(),
        cwd=cwd,
        timeout=480,
    )


def test_a_search_sweep_on_ray_keeps_the_store_password_out_of_ray(
    tmp_path: Path,
    pg_server,  # noqa: ANN001
    password_role,  # noqa: ANN001, F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tests.ray_head import ray_head_on_loopback

    address, new_database = password_role
    database = new_database()
    raw = f"postgresql+psycopg://{ROLE}:{PASSWORD.replace('@', '%40')}@{address}/{database}"
    encoded = f"postgresql+psycopg://fed%40cli:{ENCODED}@{address}/{database}"
    spec = tmp_path / "s.yaml"
    spec.write_text(SPEC)
    monkeypatch.setenv(
        "FEDCLI_STORE", encoded
    )  # `ray start` on the node runs with the store in its environment
    before = set(Path("/tmp").glob("rt*"))
    with ray_head_on_loopback(cpus=2, start_s=HEAD_START_S) as head:
        sessions = sorted(set(Path("/tmp").glob("rt*")) - before)
        assert sessions, "the Ray head's temp folder was not found"
        done = sweep(spec, raw, head, tmp_path)
        # another store than the workers' (another database): refused, one line, before any trial
        other = new_database()
        refused = sweep(spec, raw.replace(f"/{database}", f"/{other}"), head, tmp_path)
        ray_files = [p for folder in sessions for p in folder.rglob("*") if p.is_file()]
        ray_leaks = [str(p) for p in ray_files if leaks(p.read_bytes())]
    assert done.returncode == 0, done.stderr[-3000:]
    study = optuna.load_study(study_name="fedcli:ray-secret", storage=encoded)
    trials = [t for t in study.get_trials() if "fedcli.void" not in t.user_attrs]
    assert len(trials) == 3 and {t.state.name for t in trials} <= {"COMPLETE", "PRUNED"}
    assert any(p.parent.name == "logs" for p in ray_files), "no Ray log was read"
    assert ray_leaks == []
    assert leaks(done.stdout + done.stderr) == []
    assert refused.returncode == 2, refused.stderr[-3000:]
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and refused.stderr.strip().endswith(errors[0]), (
        refused.stderr
    )  # after the search's plan
    assert "set FEDCLI_STORE to it where `ray start` runs" in errors[0], errors[0]
    assert leaks(refused.stdout + refused.stderr) == [] and ":***@" in errors[0]
    reader = SqlStore.reader(encoded.replace(f"/{database}", f"/{other}"))
    assert reader is None or reader.list_runs() == []  # nothing ran on the refused store
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert [str(p) for p in written if leaks(p.read_bytes())] == []
    assert os.environ["FEDCLI_STORE"] == encoded  # (the monkeypatch is undone after the test)


def test_what_goes_to_ray_holds_no_password() -> None:
    """The Ray arguments themselves (the Ray session's files did not show task arguments in the test above, with
    or without the masking: this is the check that fails if a password is passed): the actors' environment and
    a trial message with its pruning hook and a resumed trial's overrides, masked; the URLs without one, as given."""
    from fedcli.config.sections import TrackingConfig
    from fedcli.sweep.ray_checks import secret_env
    from fedcli.sweep.ray_runner import masked_message

    url = f"postgresql+psycopg://fed%40cli:{ENCODED}@127.0.0.1:5432/db"
    query = f"postgresql+psycopg://me@127.0.0.1:5432/db?password={ENCODED}"
    message = {
        "resume": "abc",
        "hook": {"storage": url, "study": "fedcli:x", "number": 3},
        "overrides": {"tracking.store": query, "tracking.tracking_uri": url, "train.workers": 2},
    }
    sent = masked_message(message)
    assert leaks(repr(sent)) == [] and leaks(repr(message)) != []
    assert sent["hook"]["storage"] == "postgresql+psycopg://fed%40cli:***@127.0.0.1:5432/db"
    assert sent["overrides"]["train.workers"] == 2 and sent["hook"]["number"] == 3
    plain = {"hook": {"storage": "sqlite:////tmp/x.db"}, "overrides": {"tracking.store": "postgresql://h/db"}}
    assert masked_message(plain) == plain
    track = TrackingConfig(store=url, tracking_uri="http://127.0.0.1:5000", use_mlflow=True)
    assert secret_env(track) == {"FEDCLI_STORE": url}  # the MLflow URI has no password: not a secret
