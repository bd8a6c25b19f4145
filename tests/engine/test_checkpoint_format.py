"""Checkpoint format 2 (fedcli/engine/checkpoint.py): plain containers read with weights_only=True,
rebuilt with the run's own state types, checked against the run's row; and URL masking
(fedcli/tracking/urls.py). In-process, each test well under a second."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

from fedcli.algorithms import ALGORITHMS
from fedcli.algorithms.base import OptimConfig
from fedcli.config.build import build_config
from fedcli.config.checks import make_hyperparameters
from fedcli.engine import checkpoint as ckpt
from fedcli.engine.plain import from_plain, to_plain
from fedcli.errors import CheckpointError
from fedcli.tracking.urls import has_password, is_masked, mask_url

PARAMS = {"linear.weight": torch.zeros(2, 3), "linear.bias": torch.zeros(2)}
LSA_PARAMS = {"lsa_theta": torch.zeros(4)}  # fedlsa and scafflsa run on LSA tasks only


def states(name: str, seed: int) -> tuple[Any, Any]:
    """(server state, client state or None) of algorithm `name` on random parameters of a task it runs on."""
    generator = torch.Generator().manual_seed(seed)
    shapes = LSA_PARAMS if name in ("fedlsa", "scafflsa") else PARAMS
    params = {k: torch.randn(v.shape, generator=generator) for k, v in shapes.items()}
    alg = ALGORITHMS[name]
    hp = make_hyperparameters(name, {})
    server = alg.server_init(params, hp, OptimConfig(client_lr=0.1))
    client = None if alg.init_client_state is None else alg.init_client_state(params, hp)
    return server, client


def through_file(obj: Any) -> Any:
    """torch.save, then torch.load(weights_only=True): what a reader of a file gets."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def assert_same_tree(a: Any, b: Any) -> None:
    leaves_a, spec_a = pytree.tree_flatten(a)
    leaves_b, spec_b = pytree.tree_flatten(b)
    assert spec_a == spec_b
    for x, y in zip(leaves_a, leaves_b, strict=True):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_algorithms_states_round_trip_through_a_weights_only_file(name: str) -> None:
    """to_plain -> file -> weights_only load -> from_plain with a fresh state of the same algorithm as
    the template gives the state back, types included (every NamedTuple rebuilt)."""
    server, client = states(name, seed=1)
    template, client_template = states(name, seed=2)
    assert_same_tree(from_plain(through_file(to_plain(server)), template, "f"), server)
    if client is not None:
        assert_same_tree(from_plain(through_file(to_plain(client)), client_template, "f"), client)


def test_a_state_of_another_algorithm_or_model_is_refused() -> None:
    """A fedavg state given scaffold's template names a type scaffold does not have; a state of other
    shapes names the shapes; neither is half-used."""
    fedavg, _ = states("fedavg", 0)
    scaffold, _ = states("scaffold", 0)
    with pytest.raises(CheckpointError, match="fedavg.ServerState'.*does not have"):
        from_plain(to_plain(fedavg), scaffold, "f")
    bigger = ALGORITHMS["fedavg"].server_init(
        {"linear.weight": torch.zeros(2, 4), "linear.bias": torch.zeros(2)},
        make_hyperparameters("fedavg", {}),
        OptimConfig(client_lr=0.1),
    )
    with pytest.raises(
        CheckpointError, match=r"a tensor of \(2, 4\) torch.float32 where the run has \(2, 3\)"
    ):
        from_plain(to_plain(bigger), fedavg, "f")


def test_a_checkpoint_must_be_its_runs_rounds_and_configs() -> None:
    """check_identity: missing keys, another run id, another round and another configuration are
    refused, each naming the difference; a checkpoint written before a resume that added rounds
    (another hash, a config that differs only in what --resume may change) is the run's."""
    cfg = build_config(overrides={"data.task": "lsq", "train.rounds": 6})
    longer = build_config(overrides={"data.task": "lsq", "train.rounds": 9})
    other = build_config(overrides={"data.task": "lsq", "train.rounds": 6, "seed": 1})
    server, _ = states("fedavg", 0)
    payload = ckpt.checkpoint_payload(
        round_idx=4, server_state=server, client_states={}, config=cfg.to_dict(), seed=0, run_id="a" * 32
    )
    assert payload["config_hash"] == cfg.config_hash

    def check(body: dict[str, Any], **row: Any) -> None:
        expect = {
            "run_id": "a" * 32,
            "config_hash": cfg.config_hash,
            "requested": cfg.to_dict(),
            "round_idx": 4,
        }
        ckpt.check_identity(body, "f", ckpt.CHECKPOINT_KEYS, **{**expect, **row})

    check(payload)
    check(payload, config_hash=longer.config_hash, requested=longer.to_dict())  # resumed with more rounds
    with pytest.raises(CheckpointError, match="lacks 'client_states'"):
        check({k: v for k, v in payload.items() if k != "client_states"})
    with pytest.raises(CheckpointError, match="belongs to run bbbbbbbb, not aaaaaaaa"):
        check({**payload, "run_id": "b" * 32})
    with pytest.raises(CheckpointError, match="holds round 4, not 5"):
        check(payload, round_idx=5)
    with pytest.raises(CheckpointError, match=f"config hash {cfg.config_hash[:10]}.*another configuration"):
        check(payload, config_hash=other.config_hash, requested=other.to_dict())
    with pytest.raises(CheckpointError, match="format 4"):
        check({**payload, "format_version": 4})


def test_load_checkpoint_refuses_a_file_that_needs_code_and_runs_none(tmp_path: Path) -> None:
    """A payload whose unpickling would create a file: refused in one line naming the pickled global
    and the conversion command; the file is not created."""
    marker = tmp_path / "marker"

    class Payload:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "round-000001.pt"
    torch.save({"format_version": 2, "server_state": Payload()}, path)
    server, _ = states("fedavg", 0)
    with pytest.raises(CheckpointError) as err:
        ckpt.load_checkpoint(
            path,
            "checkpoint of round 1",
            server_template=server,
            client_template=None,
            run_id="a" * 32,
            config_hash="h",
            requested=None,
            round_idx=1,
        )
    assert (
        "needs code to load" in str(err.value) and "system" in str(err.value) and "\n" not in str(err.value)
    )
    assert f"python -m fedcli.engine.checkpoint --trust {path}" in str(err.value)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("text", "shown", "secret"),
    [
        ("postgresql+psycopg://user:PW@host:5432/db", "postgresql+psycopg://user:***@host:5432/db", True),
        ("http://u:p@ss@mlflow:5000/", "http://u:***@mlflow:5000/", True),
        ("sqlite:////tmp/fedcli.db", "sqlite:////tmp/fedcli.db", False),
        ("postgresql://user@host/db", "postgresql://user@host/db", False),
        ("http://host:5000", "http://host:5000", False),
        (
            "fedcli report --store 'postgresql://u:s%40cret@h/db' --x http://a:b@c",
            "fedcli report --store 'postgresql://u:***@h/db' --x http://a:***@c",
            True,
        ),
    ],
)
def test_mask_url_hides_every_password_and_nothing_else(text: str, shown: str, secret: bool) -> None:
    assert mask_url(text) == shown
    assert has_password(text) is secret and has_password(shown) is False
    assert is_masked(shown) is secret


def test_a_stored_config_holds_urls_masked_and_the_hash_is_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    """to_dict masks the store and tracking URLs' passwords (the config hash leaves tracking out, so it
    does not change); a config rebuilt from the stored form takes the password from FEDCLI_STORE, and
    without it says how to give it."""
    from fedcli.config.build import resume_config
    from fedcli.errors import ConfigError

    url = "postgresql+psycopg://me:PW@db/runs"
    cfg = build_config(overrides={"data.task": "lsq", "tracking.store": url})
    assert cfg.to_dict()["tracking"]["store"] == "postgresql+psycopg://me:***@db/runs"
    assert cfg.tracking.store_url == url
    assert cfg.config_hash == build_config(overrides={"data.task": "lsq"}).config_hash
    rebuilt = resume_config(cfg.to_dict(), {})
    monkeypatch.delenv("FEDCLI_STORE", raising=False)
    with pytest.raises(
        ConfigError, match=r"tracking.store must carry its password.*--store, or set FEDCLI_STORE"
    ):
        _ = rebuilt.tracking.store_url
    monkeypatch.setenv("FEDCLI_STORE", url)
    assert rebuilt.tracking.store_url == url
