"""A client whose upload is not finite is dropped from its round, in the engine, for every algorithm."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils import _pytree as pytree

from fedcli.config.build import build_config
from fedcli.engine.clientstate import ClientStateStore
from fedcli.engine.rounds import DivergenceError, Timing, aggregate, train_cohort
from fedcli.engine.setup import build


def _setup(algo: str):  # noqa: ANN202
    cfg = build_config(
        overrides={
            "algorithm.name": algo,
            "data.task": "lsq",
            "train.clients_per_round": 4,
            "train.device": "cpu",
            "train.executor": "loop",
        }
    )
    setup = build(cfg)
    state = setup.alg.server_init(setup.init_params, setup.hp, setup.opt)
    init = None
    if setup.alg.init_client_state is not None:
        init = lambda: setup.alg.init_client_state(setup.init_params, setup.hp)  # noqa: E731
    return setup, state, ClientStateStore(init)


def _poison(outs, row: int):  # noqa: ANN001, ANN202
    """The cohort's outputs with client `row`'s upload set to NaN."""

    def nan_row(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point() or t.dim() == 0:
            return t
        t = t.clone()
        t[row] = math.nan
        return t

    return outs._replace(upload=pytree.tree_map(nan_row, outs.upload))


@pytest.mark.parametrize("algo", ["fedavg", "scaffold", "fedpa", "fedadmm"])
def test_a_nan_client_is_left_out_as_if_it_had_not_been_sampled(algo: str) -> None:
    """Aggregating a cohort whose client 1 uploads NaN equals aggregating the other three clients alone:
    the same server state (weights renormalised over the rest), client 1's state untouched, one drop counted."""
    setup, state, store = _setup(algo)
    trained = train_cohort(setup, state, store, round_idx=1)
    poisoned = trained.__class__(**{**trained.__dict__, "outs": _poison(trained.outs, 1)})
    new_state, metrics = aggregate(setup, state, store, poisoned, 1, Timing())

    keep = torch.tensor([0, 2, 3])
    subset = pytree.tree_map(
        lambda t: t.index_select(0, keep) if isinstance(t, torch.Tensor) and t.dim() else t, trained.outs
    )
    expected, _ = setup.alg.server_update(state, subset, trained.plan.num_examples[keep], setup.hp, setup.opt)
    for got, want in zip(pytree.tree_leaves(new_state), pytree.tree_leaves(expected), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert metrics["client/dropped_nonfinite"] == 1.0
    assert all(math.isfinite(v) for v in metrics.values())
    if store.layout is not None:  # a stateful algorithm (the store has a slot layout)
        assert int(trained.cohort[1]) not in store.state_dict() and len(store) == 3


def test_a_round_where_every_client_is_nan_is_a_divergence() -> None:
    setup, state, store = _setup("fedavg")
    trained = train_cohort(setup, state, store, round_idx=1)
    outs = trained.outs
    for row in range(len(trained.cohort)):
        outs = _poison(outs, row)
    with pytest.raises(DivergenceError, match="every client's upload is NaN/inf"):
        aggregate(setup, state, store, trained.__class__(**{**trained.__dict__, "outs": outs}), 1, Timing())


def test_a_run_whose_cohort_is_all_nan_ends_failed_with_its_round(tmp_path) -> None:  # noqa: ANN001
    """Through the real CLI: a client lr of 1e30 makes every upload non-finite in round 1; the run exits 2
    and is stored `failed` with diverged_at_round = 1 (it was left `running`)."""
    import subprocess
    import sys

    from fedcli.tracking.store.sql_store import SqlStore

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedcli",
            "-q",
            "train",
            "--task",
            "lsq",
            "--client-lr",
            "1e30",
            "--local-epochs",
            "5",
            "--rounds",
            "3",
            "--root",
            str(tmp_path),
            "--no-mlflow",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    record = SqlStore(f"sqlite:///{tmp_path / 'fedcli.db'}").list_runs()[0]
    assert (record.stored_status, record.diverged_at_round) == ("failed", 1)


def test_finite_rows_is_exact_when_finite_entries_overflow_their_sum() -> None:
    """finite_rows sums each client's row and checks only non-finite sums entry by entry: a row of huge
    finite values (sum = inf in float32) is kept; NaN, +inf, -inf and inf - inf (sum NaN) rows are dropped;
    leaves that are not per-client (0-d, other leading size, integer) are ignored."""
    from fedcli.engine.cohort import finite_rows

    big = torch.finfo(torch.float32).max
    weights = torch.zeros(6, 3, 2)
    weights[1] = big  # finite, its row sum overflows
    weights[2, 0, 0] = math.nan
    weights[3, 1, 1] = math.inf
    weights[4, 2, 0] = -math.inf
    bias = torch.zeros(6, 4, dtype=torch.float64)
    bias[5, 0], bias[5, 1] = math.inf, -math.inf  # the row sums to NaN
    upload = {
        "w": weights,
        "b": bias,
        "scalar": torch.tensor(math.nan),
        "count": torch.full((6,), 7),
        "other": torch.full((2, 3), math.nan),
    }
    assert finite_rows(upload, 6).tolist() == [True, True, False, False, False, False]
    assert finite_rows({"none": torch.tensor(1.0)}, 3).tolist() == [True, True, True]
