"""`fedcli sweep --backend ray` against a real Ray head on 127.0.0.1, started and stopped here.

- a 2 algorithms x 2 seeds sweep of federated least squares through the CLI finishes 4 runs
  with their configs, one MLflow parent run with 4 nested children, and a rerun trains nothing;
- SIGINT to the sweep cancels its Ray tasks: the trials checkpoint and read `interrupted`, the
  sweep exits 130, and a rerun resumes each run under its id from its checkpoint;
- an unreachable --address, Ray missing, and Ray options without --backend ray exit 2 with one
  line and write nothing; a multi-node cluster refuses SQLite stores (fake node lists).

The head (`ray start --head --block`, 2 CPUs, no dashboard) runs in its own process group,
which the fixture ends with SIGTERM (then SIGKILL): `ray stop` would stop every Ray instance
of the machine, not only this one. Tests that need Ray skip where it is not installed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from typer.testing import CliRunner

from fedcli.cli.main import app
from fedcli.config.sections import TrackingConfig
from fedcli.errors import ConfigError
from fedcli.sweep.ray_checks import check_cluster, use_token_if_there
from fedcli.sweep.ray_runner import RayCluster
from fedcli.tracking.store.records import RunRecord
from fedcli.tracking.store.sql_store import SqlStore
from tests.ray_head import free_port, ray_head_on_loopback

T = TypeVar("T")
pytestmark = pytest.mark.timeout(300)
HEAD_START_S = 120.0  # a Ray head on a busy 2-core box
RAY_MISSING = "Ray is not installed (pip install 'fedcli[ray]'); the Ray backend tests need a Ray head"


def wait_for(what: str, probe: Callable[[], T | None], timeout: float) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


@pytest.fixture(scope="module")
def ray_head() -> Iterator[str]:
    """HOST:PORT of a 2-CPU Ray head on loopback, for this module's tests."""
    pytest.importorskip("ray", reason=RAY_MISSING)
    with ray_head_on_loopback(cpus=2, start_s=HEAD_START_S) as address:
        yield address


def write_spec(
    folder: Path, experiment: str, rounds: int, algos: str, seeds: str, local_epochs: int = 1
) -> Path:
    path = folder / f"{experiment}.yaml"
    path.write_text(
        f"experiment: {experiment}\n"
        f"base: {{task: lsq, rounds: {rounds}, clients_per_round: 4, local_epochs: {local_epochs}, "
        f"batch_size: 5}}\ngrid: {{algo: [{algos}]{', hp.mu: [0.1]' if 'fedprox' in algos else ''}}}\n"
        f"seeds: [{seeds}]\n"
    )  # hp.mu without fedprox would sweep nothing: refused (fedcli.sweep)
    return path


def sweep(root: Path, spec: Path, *args: str, cwd: Path | None = None) -> subprocess.Popen[str]:
    """Start `fedcli sweep SPEC --root ROOT ARGS` as its own process in `cwd` (default ROOT), output captured."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("FEDCLI_STORE", "MLFLOW_TRACKING_URI", "RAY_ADDRESS")
    }
    env.update(OMP_NUM_THREADS="1", COLUMNS="200")
    return subprocess.Popen(
        [sys.executable, "-m", "fedcli", "sweep", str(spec), "--root", str(root), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd or root,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 240.0) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def runs(root: Path) -> list[RunRecord]:
    return SqlStore(f"sqlite:///{root / 'fedcli.db'}").list_runs() if (root / "fedcli.db").exists() else []


def test_ray_sweep_runs_trials_as_mlflow_children_and_a_rerun_trains_nothing(
    tmp_path: Path, ray_head: str
) -> None:
    """2 algorithms x 2 seeds, 2 rounds, on a 2-CPU head: 4 finished runs whose stored configs are
    the grid's, the MLflow parent run of the sweep with the 4 runs as its children; the rerun
    skips all 4 and adds no run to either store."""
    from mlflow.tracking import MlflowClient

    spec = write_spec(tmp_path, "rayx", rounds=2, algos="fedavg, fedprox", seeds="0, 1")
    code, err = finish(sweep(tmp_path, spec, "--backend", "ray", "--address", ray_head))
    assert code == 0, err
    assert "sweep done: 4 finished." in err and "Traceback" not in err
    records = runs(tmp_path)
    got = sorted(
        (r.config["algorithm"]["name"], r.config["seed"], r.config["train"]["rounds"], r.status)
        for r in records
    )
    assert got == [(a, s, 2, "finished") for a in ("fedavg", "fedprox") for s in (0, 1)]
    assert {
        r.config["algorithm"]["hp"].get("mu") for r in records if r.config["algorithm"]["name"] == "fedprox"
    } == {0.1}
    assert {r.config["train"]["workers"] for r in records} == {
        1
    }  # one CPU per trial (--cpus-per-trial default)

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("rayx").experiment_id
    parents = client.search_runs([experiment], "tags.`fedcli.sweep` = 'rayx'")
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    kids = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parents[0].info.run_id}'")
    assert sorted(k.data.tags["fedcli.run_id"] for k in kids) == sorted(r.id for r in records)
    assert {k.info.status for k in kids} == {"FINISHED"}

    code, err = finish(sweep(tmp_path, spec, "--backend", "ray", "--address", ray_head))
    assert code == 0 and "sweep done: 4 finished (skip)." in err, err
    assert sorted(r.id for r in runs(tmp_path)) == sorted(r.id for r in records)
    assert len(client.search_runs([experiment], "")) == 5  # parent + 4 children: nothing new


def test_sigint_cancels_the_ray_trials_and_a_rerun_resumes_them(tmp_path: Path, ray_head: str) -> None:
    """SIGINT once both trials logged round 2: the sweep cancels their tasks, each trial gets
    SIGTERM, checkpoints and reads `interrupted`, and the sweep exits 130. The rerun resumes
    both runs under their ids from their checkpoints (round 1 keeps its first rows) and
    finishes them: one run per trial, every round 0..R logged once."""
    rounds = 300
    spec = write_spec(tmp_path, "rayint", rounds=rounds, algos="fedavg", seeds="0, 1", local_epochs=2)
    proc = sweep(tmp_path, spec, "--backend", "ray", "--address", ray_head, "--no-mlflow")
    db = lambda: SqlStore(f"sqlite:///{tmp_path / 'fedcli.db'}")  # noqa: E731

    def both_at_round_two() -> list[RunRecord] | None:
        live = [r for r in runs(tmp_path) if r.is_alive and (db().last_round(r.id) or 0) >= 2]
        return live if len(live) == 2 else None

    started = wait_for("both trials at round 2", both_at_round_two, timeout=180)
    round_one = {r.id: db().round_rows(r.id, 0, 1) for r in started}
    proc.send_signal(signal.SIGINT)
    code, err = finish(proc, timeout=120)

    assert code == 130, err
    assert "sweep stopped by SIGINT" in err and "--backend ray" in err  # the rerun hint keeps the backend
    stopped = runs(tmp_path)
    assert {r.status for r in stopped} == {"interrupted"}, [(r.status, r.failure_reason) for r in stopped]
    assert all("stopped by SIG" in (r.failure_reason or "") and db().checkpoints(r.id) for r in stopped), [
        r.failure_reason for r in stopped
    ]
    assert all((db().last_round(r.id) or 0) < rounds for r in stopped)

    code, err = finish(sweep(tmp_path, spec, "--backend", "ray", "--address", ray_head, "--no-mlflow"))
    assert code == 0, err
    after = runs(tmp_path)
    assert sorted(r.id for r in after) == sorted(round_one) and {r.status for r in after} == {"finished"}
    for run_id, rows in round_one.items():
        assert f"resume {run_id[:8]}" in err
        assert db().round_rows(run_id, 0, 1) == rows  # continued from a checkpoint: round 1 not trained again
        assert sorted(set(db().metrics_frame([run_id])["round_idx"])) == list(range(rounds + 1))


def test_unreachable_address_exits_2_with_one_line_and_writes_nothing(tmp_path: Path) -> None:
    pytest.importorskip("ray", reason=RAY_MISSING)
    spec = write_spec(tmp_path, "nowhere", rounds=2, algos="fedavg", seeds="0")
    root = tmp_path / "runs"
    code, err = finish(
        sweep(root, spec, "--backend", "ray", "--address", f"127.0.0.1:{free_port()}", cwd=tmp_path),
        timeout=60,
    )
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: the Ray cluster at '127.0.0.1:") and "cannot be reached" in lines[0]
    assert not root.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["nowhere.yaml"]


def test_without_ray_the_ray_backend_exits_2_naming_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = write_spec(tmp_path, "noray", rounds=2, algos="fedavg", seeds="0")
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    result = CliRunner().invoke(
        app, ["sweep", str(spec), "--root", str(tmp_path / "runs"), "--backend", "ray"]
    )
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.stderr.strip().splitlines() == [
        "error: --backend ray needs Ray, which is not installed; install it with: pip install 'fedcli[ray]'"
    ]
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "flag", [["--address", "auto"], ["--cpus-per-trial", "2"], ["--gpus-per-trial", "1"]]
)
def test_ray_options_need_the_ray_backend(tmp_path: Path, flag: list[str]) -> None:
    spec = write_spec(tmp_path, "local", rounds=2, algos="fedavg", seeds="0")
    result = CliRunner().invoke(app, ["sweep", str(spec), "--root", str(tmp_path / "runs"), *flag])
    assert result.exit_code == 2 and f"{flag[0]} applies to --backend ray" in result.stderr
    assert not (tmp_path / "runs").exists()


def nodes(*cpus_gpus: tuple[float, float]) -> list[dict[str, object]]:
    """Alive nodes as `ray.nodes()` lists them."""
    return [
        {
            "NodeID": f"n{i}",
            "Alive": True,
            "NodeManagerHostname": f"host{i}",
            "Resources": {"CPU": c, "GPU": g},
        }
        for i, (c, g) in enumerate(cpus_gpus)
    ]


def test_multi_node_cluster_refuses_sqlite_stores_and_local_mlflow(tmp_path: Path) -> None:
    """One node: the default SQLite stores under --root are fine. Two nodes: the default store,
    an explicit SQLite store, and a SQLite or file MLflow URI are each refused naming the fix;
    PostgreSQL with an MLflow server (or --no-mlflow) passes."""
    pg, server = "postgresql+psycopg://me@db/fedcli", "http://mlflow:5000"
    check_cluster(nodes((2, 0)), TrackingConfig(root=str(tmp_path)), cpus=1, gpus=0)
    two = nodes((8, 0), (8, 0))
    with pytest.raises(
        ConfigError, match=r"is a SQLite file, but the trials run on the 2 nodes .* --store postgresql"
    ):
        check_cluster(two, TrackingConfig(root=str(tmp_path)), cpus=1, gpus=0)
    with pytest.raises(ConfigError, match=r"SQLite file"):
        check_cluster(
            two, TrackingConfig(store=f"sqlite:///{tmp_path / 'x.db'}", tracking_uri=server), cpus=1, gpus=0
        )
    for uri in (f"sqlite:///{tmp_path / 'm.db'}", f"file://{tmp_path / 'mlruns'}", str(tmp_path / "mlruns")):
        with pytest.raises(
            ConfigError, match=r"MLflow tracking URI .* is a local file, .* --tracking-uri http"
        ):
            check_cluster(two, TrackingConfig(store=pg, tracking_uri=uri), cpus=1, gpus=0)
    check_cluster(two, TrackingConfig(store=pg, tracking_uri=server), cpus=1, gpus=0)
    check_cluster(two, TrackingConfig(store=pg, use_mlflow=False, root=str(tmp_path)), cpus=1, gpus=0)


def test_trial_resources_must_fit_a_node_and_set_the_default_workers() -> None:
    """Default --workers: per node floor(CPU / cpus) (and floor(GPU / gpus)), summed."""
    cluster, shared = (
        nodes((4, 2), (2, 0)),
        TrackingConfig(store="postgresql+psycopg://db/f", use_mlflow=False),
    )
    check_cluster(cluster, shared, cpus=4, gpus=2)
    with pytest.raises(ConfigError, match=r"--cpus-per-trial 8 --gpus-per-trial 0 fits no node .* 4 CPUs"):
        check_cluster(cluster, shared, cpus=8, gpus=0)
    with pytest.raises(ConfigError, match=r"--gpus-per-trial 4 fits no node"):
        check_cluster(cluster, shared, cpus=1, gpus=4)
    assert RayCluster(None, cluster, cpus=1, gpus=0).default_workers() == 4 + 2
    assert (
        RayCluster(None, cluster, cpus=1, gpus=0.5).default_workers() == 4
    )  # GPUs: 2 / 0.5 on node 0, none on 1
    assert RayCluster(None, cluster, cpus=3, gpus=0).default_workers() == 1


def test_a_saved_ray_token_is_used_and_an_explicit_auth_mode_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray >= 2.60's `ray start --head` turns token auth on and saves ~/.ray/auth_token, but a driver
    sends it only with RAY_AUTH_MODE=token (without it both Ray sweep tests failed with
    InvalidAuthToken). The sweep sets the mode, never the token, and only when the mode is unset."""
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        # set, then delete: monkeypatch then restores the variable as it was before the test, also where
        # use_token_if_there sets it behind monkeypatch's back (a RAY_AUTH_MODE=token left in the session
        # made every later `ray start --head` look for a token that the test's HOME had taken along)
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path))
    use_token_if_there()
    assert "RAY_AUTH_MODE" not in os.environ  # no token anywhere: Ray's own default
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("secret-token")
    use_token_if_there()
    assert os.environ["RAY_AUTH_MODE"] == "token"
    assert "secret-token" not in "".join(os.environ.values())
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    use_token_if_there()
    assert os.environ["RAY_AUTH_MODE"] == "disabled"
