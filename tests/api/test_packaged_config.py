"""The configs shipped inside the package (`fedcli train --config demo`, `fedcli demo`) and the typed
request the CLI and the Python API share (fedcli/runs/request.py `TrainOptions`)."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from fedcli.cli.train import train
from fedcli.configs import config_names, packaged_config
from fedcli.errors import ConfigError
from fedcli.runs.request import TrainOptions
from fedcli.runs.run import config_file, resolve_config

ROOT = Path(__file__).resolve().parents[2]


def test_the_packaged_demo_is_the_examples_copy_and_resolves_by_name(tmp_path: Path, monkeypatch) -> None:
    assert "demo" in config_names()
    assert packaged_config("demo").read_text() == (ROOT / "examples" / "fedpa-femnist-demo.yaml").read_text()
    monkeypatch.chdir(tmp_path)
    assert config_file("demo") == packaged_config("demo")
    (tmp_path / "demo").write_text("seed: 3\n")  # a file of that name in the working folder wins
    assert config_file("demo") == tmp_path / "demo"
    with pytest.raises(
        ConfigError, match=r"--config 'nope.yaml' is neither a YAML file nor a config shipped"
    ):
        config_file("nope.yaml")
    cfg, resume = resolve_config(TrainOptions(rounds=2), config=packaged_config("demo"))
    assert (cfg.algorithm.name, cfg.data.task, cfg.train.rounds, cfg.tracking.experiment, resume) == (
        "fedpa",
        "femnist",
        2,
        "demo",
        None,
    )


def test_every_option_of_fedcli_train_that_sets_a_config_key_is_an_api_setting() -> None:
    params = set(inspect.signature(train).parameters)
    not_keys = {
        "ctx",
        "config",
        "hp",
        "resume",
        "mlflow_optional",
        "parent_run",
        "trust_code",
    }  # arguments of their own
    fields = {f.name for f in dataclasses.fields(TrainOptions)}
    assert params - not_keys == fields & params
    assert fields - params <= {"augment"}  # API-only settings
    assert TrainOptions(no_mlflow=True, compile=False, root=Path("x")).overrides() == {
        "tracking.use_mlflow": False,  # a switch set to False is not given
        "tracking.root": "x",
    }


def test_fedcli_demo_runs_the_packaged_config(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "fedcli", "-q", "demo", "--rounds", "1", "--root", "r", "--no-mlflow"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    from fedcli.tracking.store.sql_store import SqlStore

    (run,) = SqlStore(f"sqlite:///{tmp_path / 'r' / 'fedcli.db'}").list_runs()
    assert (run.algo, run.experiment, run.status, run.config["train"]["rounds"]) == (
        "fedpa",
        "demo",
        "finished",
        1,
    )
    assert out.stdout.strip() == run.id
