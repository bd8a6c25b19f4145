"""The task-and-model plugin example (examples/plugin-task) installs offline and trains through the CLI.

Done as tests/test_plugin_example.py does for the algorithm plugin: pip installs a copy of the
example into a temporary folder (`--target`, `--no-index`, `--no-build-isolation`), which goes on
PYTHONPATH of `python -m fedcli` child processes, where importlib.metadata finds the entry
points of the groups `fedcli.tasks` and `fedcli.models` (docs/bring-your-own.md, "Plugins").
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fedcli.tracking.store.sql_store import SqlStore

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = ROOT / "examples" / "plugin-task"


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An environment whose PYTHONPATH holds the installed example plugin."""
    base = tmp_path_factory.mktemp("plugin-task")
    source, site = base / "src", base / "site"
    shutil.copytree(PLUGIN, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("FEDCLI_STORE", "MLFLOW_TRACKING_URI")},
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_NO_INPUT": "1",
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            "--no-build-isolation",
            "--target",
            str(site),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=base,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def fedcli(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fedcli", *args], capture_output=True, text=True, timeout=300, env=env, cwd=cwd
    )


def test_list_tasks_and_models_name_the_plugin_package(env: dict[str, str], tmp_path: Path) -> None:
    tasks = fedcli(env, tmp_path, "list", "tasks", "--json")
    models = fedcli(env, tmp_path, "list", "models", "--json")
    assert tasks.returncode == 0 and models.returncode == 0, tasks.stderr + models.stderr
    by_task = {row["name"]: row for row in json.loads(tasks.stdout)}
    by_model = {(row["name"], row["package"]): row for row in json.loads(models.stdout)}
    assert by_task["sines"]["package"] == "fedcli-sines" and by_task["femnist"]["package"] == "fedcli"
    assert by_model[("sine-cnn", "fedcli-sines")]["reference"] == "fedcli_sines.model:SineCNN"
    assert by_model[("linear", "fedcli-sines")]["tasks"] == "sines"  # the task plugin's own model


def test_train_the_plugin_task_with_the_plugin_model(env: dict[str, str], tmp_path: Path) -> None:
    """`--task sines --model sine-cnn` by fedpa on vmap: the run records the model by its reference and
    source hash, the task by its own name; `fedcli evaluate` rebuilds both."""
    root = tmp_path / "runs"
    done = fedcli(
        env,
        tmp_path,
        "train",
        "--task",
        "sines",
        "--model",
        "sine-cnn",
        "--algo",
        "fedpa",
        "--rounds",
        "2",
        "--clients-per-round",
        "4",
        "--executor",
        "vmap",
        "--no-mlflow",
        "--root",
        str(root),
    )
    assert done.returncode == 0, done.stderr
    with SqlStore(f"sqlite:///{root / 'fedcli.db'}") as store:
        (run,) = store.list_runs()
    assert (run.task, run.status, run.config["train"]["executor"]) == ("sines", "finished", "vmap")
    assert run.config["data"]["model"] == "fedcli_sines.model:SineCNN"
    assert len(run.config["data"]["model_sha256"]) == 64
    assert run.config["data"]["model_args"] == '{"input_shape": [1, 64], "num_classes": 4}'
    evaluated = fedcli(env, tmp_path, "evaluate", run.id[:8], "--root", str(root), "--json")
    assert evaluated.returncode == 0, evaluated.stderr
    assert 0.0 <= json.loads(evaluated.stdout)["metrics"]["test/accuracy"] <= 1.0


def test_a_plugin_model_name_unknown_without_the_plugin(tmp_path: Path) -> None:
    """Without the plugin installed, `--model sine-cnn` is one line naming the models there are, exit 2."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedcli",
            "train",
            "--task",
            "femnist",
            "--model",
            "sine-cnn",
            "--no-mlflow",
            "--root",
            str(tmp_path / "r"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "data.model must be one of mlp, cnn" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "r").exists()
