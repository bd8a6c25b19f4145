"""A search on `--backend ray` (docs/sweeps.md, "Search", "Ray"): trials asked of the study in the store run in Ray
actors, the pruning hook reaches their training there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fedcli.tracking.store.sql_store import SqlStore
from tests.sweeps.test_ray_backend import ray_head  # noqa: F401 - the module-scoped Ray head fixture
from tests.sweeps.test_search import BASE, finish, study_of

optuna = pytest.importorskip("optuna")
pytestmark = pytest.mark.timeout(400)


def test_search_with_pruning_on_ray(tmp_path: Path, ray_head: str) -> None:  # noqa: F811
    url = f"sqlite:///{tmp_path / 'fedcli.db'}"
    study = optuna.create_study(study_name="fedcli:ray-search", storage=url, direction="minimize")
    for lr in (0.05, 0.03, 1e-6):  # run first, in order (one trial at a time): the last barely learns
        study.enqueue_trial({"client_lr": lr})
    spec = tmp_path / "s.yaml"
    spec.write_text(
        f"experiment: ray-search\nbase: {BASE % (6, 1)}\n"
        "search: {sampler: random, trials: 4, metric: loss, direction: min,\n"
        "         space: {client_lr: {log_uniform: [0.000001, 0.1]}}}\n"
        "pruner: {type: median, warmup: 1, startup_trials: 2}\n"
    )
    env = {
        k: v for k, v in os.environ.items() if k not in ("FEDCLI_STORE", "MLFLOW_TRACKING_URI", "RAY_ADDRESS")
    }
    env.update(OMP_NUM_THREADS="1", COLUMNS="200")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fedcli",
            "sweep",
            str(spec),
            "--root",
            str(tmp_path),
            "--no-mlflow",
            "--backend",
            "ray",
            "--address",
            ray_head,
            "--workers",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    code, err = finish(proc, 360)
    assert code == 0, err
    trials = {t.number: t for t in study_of(url, "ray-search")}
    assert len(trials) == 4 and trials[2].state.name == "PRUNED", {n: t.state.name for n, t in trials.items()}
    db = SqlStore(url)
    runs = db.list_runs(experiment="ray-search")
    assert len(runs) == len({r.tags["fedcli.config_hash"] for r in runs}) == 4
    assert db.get_run(trials[2].user_attrs["fedcli.run_id"]).status == "pruned"
