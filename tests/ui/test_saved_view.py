"""`fedcli ui` writes the saved view its URL opens (tracking/mlflow/view.py), from the runs' own keys.

Real `fedcli train` runs fill a real MLflow store; `fedcli ui --print-only` writes the experiment
tag `mlflow.sharedViewState.fedcli-compare` in MLflow's saved-view envelope. Its state shows the
metrics the runs logged and the params they are compared by (the hyperparameters, the keys that
differ between runs, never paths or resources). A second `fedcli ui` with nothing new keeps the
tag as it was; a new run with another key refreshes it, keeping its creation time. The browser
side (MLflow opening the view) is tests/ui/test_mlflow_ui.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow import MlflowClient
from typer.testing import CliRunner

from fedcli.cli.main import app
from fedcli.tracking.mlflow.view import TAG_PREFIX, VIEW_ID, VIEW_NAME, has_saved_views

RUNNER = CliRunner()


def train(root: Path, *args: str) -> None:
    result = RUNNER.invoke(app, ["-q", "train", "--task", "lsq", "--rounds", "2", "--root", str(root), *args])
    assert result.exit_code == 0, result.output


def view(root: Path) -> dict:
    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "default"]
    return json.loads(experiment.tags[TAG_PREFIX + VIEW_ID])


@pytest.mark.slow
def test_ui_writes_a_view_of_the_runs_keys_and_refreshes_it_only_when_they_change(tmp_path: Path) -> None:
    assert has_saved_views(), "the installed MLflow predates saved views (3.15)"
    train(tmp_path, "--algo", "fedprox", "--hp", "mu=0.01")
    train(tmp_path, "--algo", "fedprox", "--hp", "mu=0.01", "--client-lr", "0.05")

    printed = RUNNER.invoke(app, ["ui", "--root", str(tmp_path), "--print-only"])
    first = view(tmp_path)
    again = RUNNER.invoke(app, ["ui", "--root", str(tmp_path), "--print-only"])
    unchanged = view(tmp_path)
    train(tmp_path, "--algo", "fedavg", "--batch-size", "10")
    RUNNER.invoke(app, ["ui", "--root", str(tmp_path), "--print-only"])
    refreshed = view(tmp_path)

    assert printed.exit_code == 0 and again.exit_code == 0, printed.output
    assert printed.stdout.splitlines()[0].endswith(
        "/runs?workflowType=machine_learning&viewStateShareKey=fedcli-compare"
    )
    assert f"The URL opens the view '{VIEW_NAME}'" in printed.stderr and "Assistant" in printed.stderr
    assert first["name"] == VIEW_NAME and isinstance(first["createdAt"], int)
    columns = json.loads(first["state"])["selectedColumns"]
    assert columns[:3] == ["metrics.`eval/dist_to_opt`", "metrics.`eval/loss`", "metrics.`train/loss`"]
    assert {
        "params.`algorithm.name`",
        "params.`data.task`",
        "params.`hp.mu`",
        "params.`train.client_lr`",
    } <= set(columns)
    assert not any("tracking." in c or "threads" in c or "data_dir" in c for c in columns)
    assert unchanged == first
    assert refreshed["createdAt"] == first["createdAt"] and refreshed["updatedAt"] >= first["updatedAt"]
    assert "params.`train.batch_size`" not in columns
    assert "params.`train.batch_size`" in json.loads(refreshed["state"])["selectedColumns"]
