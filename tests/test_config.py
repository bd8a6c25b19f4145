"""RunConfig: validation at the boundary with messages that carry the key, the value and a fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedcli.config.build import build_config, resume_config
from fedcli.config.checks import parse_assignments
from fedcli.errors import ConfigError


def test_defaults_resolve_hyperparameters_and_hash_is_stable() -> None:
    a = build_config(overrides={"algorithm.name": "fedpa"})
    b = build_config(overrides={"algorithm.name": "fedpa", "tracking.experiment": "other"})
    assert a.algorithm.hp == {
        "rho": 0.1,
        "burn_in_rounds": 4,
        "burn_in_epochs": 1,
    }  # ceil(50 / 15): FedPA's advice
    assert a.config_hash == b.config_hash  # tracking does not change results
    assert a.config_hash != build_config(overrides={"algorithm.name": "fedpa", "seed": 1}).config_hash


def test_adding_train_graph_left_every_stored_config_hash_unchanged() -> None:
    """`train.graph` (--graph) came after runs were stored: at its default it is left out of the hash,
    so sweeps still find their earlier runs. The two hashes below are main's before the key existed
    (default config; scaffold with the vmap executor); with --graph the hash differs, like --compile."""
    assert build_config().config_hash == "273f0734dc2c261d9123e9b7f71523d5baeb3dcd2fa83544fbbc7c9bcca6e82e"
    scaffold = {"algorithm.name": "scaffold", "train.executor": "vmap"}
    assert build_config(overrides=scaffold).config_hash == (
        "6f08191a5c36723a11a90a59d783ba568c7d14ad2c568e0a5904f51b1422fb3c"
    )
    assert build_config(overrides={**scaffold, "train.graph": True}).config_hash != (
        "6f08191a5c36723a11a90a59d783ba568c7d14ad2c568e0a5904f51b1422fb3c"
    )


def test_yaml_file_is_overridden_by_cli(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("seed: 3\ntrain: {rounds: 7, client_lr: 0.2}\nalgorithm: {name: fedpa, hp: {rho: 0.5}}\n")
    cfg = build_config(file=path, overrides={"train.rounds": 9}, hp={"burn_in_rounds": 4})
    assert (cfg.seed, cfg.train.rounds, cfg.train.client_lr) == (3, 9, 0.2)
    assert cfg.algorithm.hp["rho"] == 0.5 and cfg.algorithm.hp["burn_in_rounds"] == 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"overrides": {"algorithm.name": "fedpx"}}, r"unknown algorithm 'fedpx'.*choose one of"),
        ({"overrides": {"data.task": "femnst"}}, r"unknown task 'femnst' \(did you mean 'femnist'\?\)"),
        (
            {"overrides": {"algorithm.name": "fedpa"}, "hp": {"rhoo": 1}},
            r"unknown hyperparameter 'hp.rhoo' for fedpa \(did you mean 'rho'\?\)",
        ),
        (
            {"overrides": {"algorithm.name": "fedpa"}, "hp": {"rho": "high"}},
            r"hp.rho must be float; got 'high'",
        ),
        ({"overrides": {"train.rounds": 0}}, r"train.rounds must be >= 1; got 0"),
        ({"overrides": {"train.client_lr": -1.0}}, r"train.client_lr must be > 0; got -1.0"),
        ({"overrides": {"train.server_opt": "lion"}}, r"train.server_opt must be one of sgd, momentum"),
        ({"overrides": {"train.device": "tpu"}}, r"train.device must be auto, cpu, cuda"),
        ({"overrides": {"data.model": "resnet"}}, r"data.model must be one of mlp, cnn for task femnist"),
        ({"overrides": {"seed": -2}}, r"seed must be an integer >= 0; got -2"),
    ],
)
def test_invalid_values_name_key_value_and_fix(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_config(**kwargs)


def test_unknown_yaml_key_gets_a_suggestion(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("train: {round: 3}\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'train.round' \(did you mean 'rounds'\?\)"):
        build_config(file=path)
    path.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match=r"is not valid YAML"):
        build_config(file=path)


def test_hp_assignments_are_typed_and_malformed_ones_rejected() -> None:
    assert parse_assignments(["rho=0.01", "burn_in_rounds=5"], "--hp") == {"rho": 0.01, "burn_in_rounds": 5}
    with pytest.raises(ConfigError, match=r"--hp must be KEY=VALUE; got 'rho'"):
        parse_assignments(["rho"], "--hp")


def test_resume_refuses_to_change_results() -> None:
    stored = build_config(overrides={"algorithm.name": "fedpa"}).to_dict()
    assert resume_config(stored, {"train.rounds": 80}).train.rounds == 80
    with pytest.raises(ConfigError, match=r"train.client_lr cannot change"):
        resume_config(stored, {"train.client_lr": 0.5})
