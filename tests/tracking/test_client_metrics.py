"""Per-client training metrics: every round writes each aggregated client's local metrics to the
store's `client_metrics` table, in the transaction of the round's metrics (docs/architecture.md §6).

Checked against the round metrics they are averaged into: the round's `train/loss` is the
example-weighted mean of the cohort's per-client `train/loss` (weights `client/num_examples`),
and each round's cohort is `clients_per_round` distinct clients of the partition.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from fedcli.cli.main import app
from fedcli.tracking.store.sql_store import SqlStore


def test_each_round_stores_its_clients_and_their_weighted_mean_is_the_round_metric(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        app,
        [
            "-q",
            "train",
            "--task",
            "lsq",
            "--algo",
            "fedprox",
            "--hp",
            "mu=0.1",
            "--rounds",
            "3",
            "--clients-per-round",
            "4",
            "--no-mlflow",
            "--root",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 0, result.output
    store = SqlStore(f"sqlite:///{tmp_path / 'fedcli.db'}")
    run_id = result.stdout.split()[-1]
    clients = store.client_metrics_frame([run_id])
    rounds = store.metrics_frame([run_id], keys=["train/loss"]).set_index("round_idx")["value"]
    cohort_means = store.metrics_frame([run_id]).pivot(index="round_idx", columns="key", values="value")
    assert {"client/num_examples", "train/loss", "client/fedprox_drift"} <= set(clients["key"])
    assert sorted(set(clients["round_idx"])) == [1, 2, 3]
    for round_idx in (1, 2, 3):
        rows = clients[clients["round_idx"] == round_idx].pivot(
            index="client_id", columns="key", values="value"
        )
        assert len(rows) == 4 and rows.index.is_unique and (rows.index < 20).all()  # lsq: 20 clients
        weights = rows["client/num_examples"].to_numpy()
        assert (weights > 0).all() and np.allclose(weights, np.round(weights))
        mean = float(np.average(rows["train/loss"].to_numpy(), weights=weights))
        assert mean == pytest.approx(rounds[round_idx], rel=1e-6)
        drift = float(np.average(rows["client/fedprox_drift"].to_numpy(), weights=weights))
        assert drift == pytest.approx(cohort_means.loc[round_idx, "client/fedprox_drift"], rel=1e-6)
    assert store.client_metrics_frame([run_id], keys=["client/num_examples"])["key"].unique().tolist() == [
        "client/num_examples"
    ]
