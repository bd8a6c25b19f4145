"""The example plugin (examples/plugin) installs offline and trains through fedcli's entry point.

docs/adding-an-algorithm.md tells plugin authors to expose an `Algorithm` record in the
`fedcli.algorithms` entry-point group. This test does what such an author does, without a
network and without touching the shared virtual environment: it builds and installs a copy
of examples/plugin with pip into a temporary folder (`--target`, `--no-index`,
`--no-build-isolation`: the venv's setuptools builds it), puts that folder on PYTHONPATH of
child processes (importlib.metadata then finds the package's entry point), and runs the
real CLI and the plugin's own closed-form tests there.
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

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ROOT / "examples" / "plugin"
NAME = "fedavg-clipped"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """(the plugin's source copy, an environment whose PYTHONPATH holds the installed plugin)."""
    base = tmp_path_factory.mktemp("plugin")
    source, site = base / "src", base / "site"
    # build from a copy: setuptools writes build/ and *.egg-info into the source folder
    shutil.copytree(
        PLUGIN, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".pytest_cache")
    )
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
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
    assert list(site.glob("fedcli_clipped-*.dist-info")), sorted(p.name for p in site.iterdir())
    env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])
    return source, env


def fedcli(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fedcli", *args], capture_output=True, text=True, timeout=240, env=env, cwd=cwd
    )


def test_list_algos_shows_the_plugin(installed: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    _, env = installed
    done = fedcli(env, tmp_path, "list", "algos", "--json")
    assert done.returncode == 0, done.stderr
    algos = {row["name"]: row for row in json.loads(done.stdout)}
    assert NAME in algos and "fedavg" in algos  # the plugin joins the built-in records
    assert algos[NAME]["hyperparameters"] == {"clip_norm": 1.0}
    assert "arXiv:1710.06963" in algos[NAME]["paper"]


def test_train_runs_the_plugin_through_the_cli(
    installed: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    _, env = installed
    root = tmp_path / "runs"
    done = fedcli(
        env,
        tmp_path,
        "train",
        "--algo",
        NAME,
        "--task",
        "lsq",
        "--rounds",
        "2",
        "--no-mlflow",
        "--root",
        str(root),
        "--hp",
        "clip_norm=0.5",
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    with SqlStore(f"sqlite:///{root / 'fedcli.db'}") as store:
        (run,) = store.list_runs()
        rounds = store.metrics_frame([run.id], ["client/clipped"])
    assert (run.algo, run.status, run.config["algorithm"]["hp"]) == (NAME, "finished", {"clip_norm": 0.5})
    assert sorted(rounds["round_idx"]) == [1, 2]  # the plugin's client metric, averaged by the engine


def test_a_bad_hyperparameter_is_one_line_and_exit_2(
    installed: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """The plugin's own validation (`require` in __post_init__) reaches the user like a built-in's."""
    _, env = installed
    done = fedcli(
        env,
        tmp_path,
        "train",
        "--algo",
        NAME,
        "--task",
        "lsq",
        "--rounds",
        "1",
        "--no-mlflow",
        "--root",
        str(tmp_path / "runs"),
        "--hp",
        "clip_norm=-1",
    )
    assert done.returncode == 2, done.stderr
    assert "hp.clip_norm must be > 0; got -1.0." in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "runs").exists()  # validated before anything is written


def test_the_plugins_own_tests_pass_against_the_installed_copy(
    installed: tuple[Path, dict[str, str]],
) -> None:
    source, env = installed
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", "-q", "tests"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=source,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "3 passed" in done.stdout
