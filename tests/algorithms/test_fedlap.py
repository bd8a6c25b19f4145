"""FedLap's run defaults (issue 36): the released configs' 10 local epochs and damping 1/C.

With E = 1 FedLap trailed FedAvg by 4-7 points at 25 rounds (synthetic-iid 40.3 vs 46.9 %, vehicle
82.8 vs 86.9 %): its server step w_g = Sum_k v_k with damping 1/C is the cohort's unweighted mean of
clients that barely moved. Every released FedLap config trains 10 local epochs.
"""

from __future__ import annotations

import pytest

from fedcli.algorithms import ALGORITHMS
from fedcli.algorithms.base import RunFacts
from fedcli.config.build import build_config, run_tags


def test_fedlap_recommends_the_released_local_epochs_and_damping() -> None:
    advice = ALGORITHMS["fedlap"].recommend(
        RunFacts(task="vehicle", kind="classification", model="logreg", rounds=25, clients_per_round=8)
    )
    assert advice["train.local_epochs"].value == 10
    assert advice["hp.damping"].value == pytest.approx(1 / 8)
    cfg = build_config(overrides={"algorithm.name": "fedlap"})
    assert (cfg.train.local_epochs, cfg.algorithm.hp["damping"]) == (10, pytest.approx(0.1))
    assert set(cfg.recommended) == {"train.local_epochs", "hp.damping"}
    assert "train.local_epochs=10" in run_tags(cfg)["fedcli.recommended"]


def test_fedlap_keeps_the_local_epochs_the_user_sets() -> None:
    cfg = build_config(overrides={"algorithm.name": "fedlap", "train.local_epochs": 1})
    assert cfg.train.local_epochs == 1
    assert set(cfg.recommended) == {"hp.damping"}
