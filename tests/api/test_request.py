"""The typed run request (fedcli/runs/request.py `TrainOptions`): every field sets a real config key,
the CLI passes each of its options to the field of its name, and the Python API's settings are checked
in the order given, with the CLI's lines."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import fedcli
from fedcli.cli.common import Scheme
from fedcli.config.sections import SECTIONS
from fedcli.errors import ConfigError
from fedcli.runs.request import TrainOptions

ROOT = Path(__file__).resolve().parents[2]


def test_every_field_names_a_config_key_of_its_section() -> None:
    keys = []
    for f in dataclasses.fields(TrainOptions):
        assert f.default is None, f.name  # None = not given
        key = f.metadata["key"]
        keys.append(key)
        if key == "seed":
            continue
        section, _, name = key.partition(".")
        assert name in {g.name for g in dataclasses.fields(SECTIONS[section])}, (f.name, key)
    assert len(keys) == len(set(keys))  # no two options set one key


def test_the_cli_passes_each_option_to_its_own_field() -> None:
    """fedcli/cli/train.py builds the request explicitly: `rounds=rounds`, never another parameter."""
    tree = ast.parse((ROOT / "fedcli" / "cli" / "train.py").read_text())
    (call,) = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "TrainOptions"
    ]
    passed = {k.arg: k.value.id if isinstance(k.value, ast.Name) else None for k in call.keywords}
    assert all(name == value for name, value in passed.items()), passed
    assert set(passed) == {f.name for f in dataclasses.fields(TrainOptions)} - {"augment"}


def test_overrides_are_the_options_given_as_config_keys() -> None:
    options = TrainOptions(
        rounds=3,
        scheme=Scheme.dirichlet,  # the CLI's choice: its value
        partition=Path("p.json"),  # a path setting: its text
        balanced=True,
        download=False,  # a switch set to False: not given
        no_mlflow=True,
        augment=["flip"],
    )
    assert options.overrides() == {
        "train.rounds": 3,
        "partition.scheme": "dirichlet",
        "partition.file": "p.json",
        "partition.balanced": True,
        "tracking.use_mlflow": False,
        "data.augment": ["flip"],
    }
    assert TrainOptions().overrides() == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.rounds = 4  # type: ignore[misc]


def test_settings_are_checked_in_the_order_given() -> None:
    with pytest.raises(ConfigError) as first:
        TrainOptions.from_settings({"no_mlflow": "no", "roundz": 1})
    assert str(first.value) == "no_mlflow must be True or False; got str 'no'."
    with pytest.raises(ConfigError) as second:
        TrainOptions.from_settings({"roundz": 1, "no_mlflow": "no"})
    assert str(second.value) == (
        "unknown setting 'roundz' (did you mean 'rounds'?); the settings are `fedcli train`'s options "
        '(docs/python-api.md, "Settings").'
    )
    with pytest.raises(ConfigError, match=r"^experiment must be str, not a path; got PosixPath 'e'\.$"):
        TrainOptions.from_settings({"experiment": Path("e")})
    assert TrainOptions.from_settings({"rounds": 2, "root": Path("r")}) == TrainOptions(
        rounds=2, root=Path("r")
    )


def test_fedcli_train_names_the_closest_setting_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        fedcli.train(task="lsq", clients_per_rond=4, root="runs", no_mlflow=True)
    assert str(info.value) == (
        "unknown setting 'clients_per_rond' (did you mean 'clients_per_round'?); the settings are "
        '`fedcli train`\'s options (docs/python-api.md, "Settings").'
    )
    assert list(tmp_path.iterdir()) == []
