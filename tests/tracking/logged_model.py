"""A real `fedcli train` that logs its model to MLflow, for the tests that load logged models."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from mlflow.tracking import MlflowClient


def train_and_log(root: Path) -> tuple[MlflowClient, Any, Any, str]:
    """`fedcli train` on mnist (iid, 10 clients, 1 round, MLflow on) under `root`: (the MLflow
    client of root's store, the run's MLflow run, its one logged model, the fedcli run id)."""
    env = {k: v for k, v in os.environ.items() if k not in ("FEDCLI_STORE", "MLFLOW_TRACKING_URI")}
    trained = subprocess.run(
        [sys.executable, "-m", "fedcli", "-q", "train", "--task", "mnist", "--scheme", "iid",
         "--clients", "10", "--rounds", "1", "--root", str(root)],
        capture_output=True,
        text=True,
        env=env,
        timeout=170,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("default")
    (run,) = client.search_runs([experiment.experiment_id])
    (logged,) = client.search_logged_models(experiment_ids=[experiment.experiment_id])
    return client, run, logged, trained.stdout.strip()
