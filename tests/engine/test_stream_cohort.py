"""A round's inputs made a group of clients at a time (engine/streaming.py stream_cohort): the same
results bit for bit as the whole cohort's, and the new states of a disk-store run kept out of RAM.

The loop trains clients one by one, so any grouping must give its exact numbers; `--cohort-chunk`
on vmap/fused streams the same groups as the back end's own chunks (in_chunks), so it must give
exactly what in_chunks gave. States spilled to a file (SpilledStates) must read back unchanged,
in any dtype, and after clients are dropped as non-finite.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils import _pytree as pytree

from fedcli.algorithms.base import UploadSums
from fedcli.config.build import build_config
from fedcli.engine.clientstate import ClientStateStore
from fedcli.engine.cohort import CohortInputs, CohortJob, SpilledStates, take_rows
from fedcli.engine.rounds import Timing, draw_noise, plan_round, run_round, train_cohort
from fedcli.engine.setup import build
from fedcli.engine.streaming import stream_group
from tests.engine.test_equivalence import required_hyperparameters


def make(algo: str, executor: str, extra: dict, task: str = "lsq") -> tuple:
    hp = required_hyperparameters(algo)
    cfg = build_config(
        overrides={
            "algorithm.name": algo,
            "data.task": task,
            "train.executor": executor,
            "train.device": "cpu",
            "train.clients_per_round": 5,
            "train.local_epochs": 2,
            "train.batch_size": 16,
            "train.client_lr": 0.01,
            "train.rounds": 2,
            **extra,
        },
        hp=hp,
    )
    setup = build(cfg)
    init = setup.alg.init_client_state
    return setup, (None if init is None else (lambda: init(setup.init_params, setup.hp)))


def two_rounds(algo: str, executor: str, extra: dict, folder: Path | None = None) -> tuple[dict, dict, list]:
    setup, init = make(algo, executor, extra)
    store = ClientStateStore(init, folder=folder, cache_mb=0)
    state = setup.alg.server_init(setup.init_params, setup.hp, setup.opt)
    assert stream_group(setup, store, setup.init_params, 5, 4) == extra.get(
        "train.cohort_chunk"
    )  # None: whole
    history = []
    for round_idx in (1, 2):
        state, metrics = run_round(setup, state, store, round_idx, Timing())
        history.append({k: v for k, v in metrics.items() if not k.startswith("time/")})
    states = store.state_dict()
    store.close(remove=True)
    return setup.alg.global_params(state), states, history


def assert_equal_trees(a: object, b: object) -> None:
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert (x is None and y is None) if x is None else torch.equal(x, y), (x, y)


@pytest.mark.parametrize("algo", ["scaffold", "bayesadmm", "feddyn"])
@pytest.mark.parametrize("store", ["ram", "disk"])
def test_streamed_loop_equals_the_whole_cohort(algo: str, store: str, tmp_path: Path) -> None:
    """loop without --cohort-chunk (the cohort's noise and states at once) against groups of 2 of a
    cohort of 5 (SCAFFOLD: control variates; BayesADMM: IVON noise and duals; FedDyn: gradient state),
    both state stores. FedDyn's must be bit for bit. SCAFFOLD's and BayesADMM's streamed server steps
    sum their uploads a group at a time (Algorithm.upload_sums): the same up to float32 summation
    order, so within 1e-5 relative, not bit for bit."""
    folder = None if store == "ram" else tmp_path / "cs"
    whole = two_rounds(algo, "loop", {}, folder)
    streamed = two_rounds(
        algo, "loop", {"train.cohort_chunk": 2}, None if folder is None else tmp_path / "cs2"
    )
    reduced = algo != "feddyn"  # upload_sums
    same = assert_close_trees if reduced else assert_equal_trees
    same(whole[0], streamed[0])
    assert whole[1].keys() == streamed[1].keys() and len(whole[1]) > 5  # states of clients from both rounds
    for client in whole[1]:
        same(whole[1][client], streamed[1][client])
    if not reduced:
        assert whole[2] == streamed[2]
    else:
        assert whole[2][0].keys() == streamed[2][0].keys()
        for a, b in zip(whole[2], streamed[2], strict=True):
            assert all(a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7, nan_ok=True) for k in a), (a, b)


def assert_close_trees(a: object, b: object) -> None:
    """Equal up to float32 summation order: within 1e-5 relative, or 1e-6 of the tensor's largest magnitude
    (a sum reordered errs by a few ulps of its largest terms, not of each element: 1.9e-6 on an element of a
    sum whose largest is 39 on this session's CPU)."""
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        if x is None:
            assert y is None
            continue
        atol = max(1e-7, 1e-6 * float(y.abs().max())) if y.numel() else 1e-7
        assert torch.allclose(x, y, rtol=1e-5, atol=atol), ((x - y).abs().max(), y.abs().max())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("algo", "executor", "task"),
    [("scaffold", "vmap", "lsq"), ("fedpa", "vmap", "lsq"), ("scaffold", "fused", "synthetic-1-1")],
)
def test_streamed_chunks_equal_in_chunks(algo: str, executor: str, task: str) -> None:
    """--cohort-chunk 2 on vmap/fused: train_cohort's streamed groups give exactly the outputs of the
    back end's own in_chunks over the whole cohort's inputs (the path before streaming): the states
    and metrics bit for bit; SCAFFOLD's uploads are summed a group at a time (upload_sums), equal to
    upload_sums of in_chunks' stacked uploads up to float32 summation order."""
    setup, init = make(algo, executor, {"train.cohort_chunk": 2}, task)
    store = ClientStateStore(init)
    state = setup.alg.server_init(setup.init_params, setup.hp, setup.opt)
    params = setup.alg.global_params(state)
    planned = plan_round(setup, 1)
    plan, steps = planned.plan, planned.plan.num_epochs * planned.plan.steps_per_epoch
    assert stream_group(setup, store, params, len(planned.cohort), steps) == 2
    inputs = CohortInputs(
        plan=plan,
        keys=planned.keys,
        noise=draw_noise(setup, params, planned.cohort, 1, steps),
        states=store.gather(planned.cohort, setup.device),
    )
    before = setup.backend.run(
        CohortJob(
            setup.alg, setup.fns, setup.alg.broadcast(state, setup.hp), inputs, setup.hp, setup.opt, 1, 2
        )
    )
    streamed = train_cohort(setup, state, store, 1)
    assert np.array_equal(streamed.cohort, planned.cohort)
    if setup.alg.upload_sums is None:
        assert_equal_trees(before, streamed.outs)
        return
    got = streamed.outs.upload
    assert isinstance(got, UploadSums) and got.count == len(planned.cohort)
    want = setup.alg.upload_sums(before.upload, plan.num_examples, streamed.broadcast, setup.hp)
    assert_close_trees(got.sums, want)
    assert_equal_trees(before.state, streamed.outs.state)
    assert_equal_trees(before.metrics, streamed.outs.metrics)


def test_loop_streams_when_the_noise_is_large() -> None:
    """The loop picks a group from STREAM_BUDGET: whole cohort for a small model, fewer clients when
    each client's pre-drawn noise is large (BayesADMM, many steps)."""
    setup, init = make("bayesadmm", "loop", {})
    store = ClientStateStore(init)
    params = setup.init_params
    assert stream_group(setup, store, params, 5, 10) is None  # lsq: a few bytes a client
    per_step = sum(p.numel() for p in params.values()) * 4
    steps = (256 * 2**20) // per_step  # 256 MiB of noise per client
    assert stream_group(setup, store, params, 5, steps) == 1


def test_spilled_states_read_back_exactly(tmp_path: Path) -> None:
    """SpilledStates: groups written in any order read back row by row, in every dtype (bf16, bool,
    int64, 0-dim rows), and take() (non-finite clients dropped) keeps the right rows."""
    gen = torch.Generator().manual_seed(0)
    full = {
        "w": torch.randn(7, 3, 4, generator=gen),
        "h": torch.randn(7, 5, generator=gen).to(torch.bfloat16),
        "mask": torch.rand(7, 2, generator=gen) > 0.5,
        "n": torch.arange(7, dtype=torch.int64) * 3,
        "empty": torch.zeros(7, 0),
    }
    spilled = SpilledStates(tmp_path)
    for rows in (np.array([4, 0, 6]), np.array([2, 5]), np.array([1, 3])):
        spilled.write(rows, {k: v[torch.as_tensor(rows)] for k, v in full.items()})
    assert list(tmp_path.iterdir()) == []  # the file is unlinked: nothing left behind
    assert_equal_trees(spilled.rows(np.arange(7)), full)
    keep = torch.tensor([0, 2, 3, 6])
    kept = take_rows({"s": spilled}, keep)["s"]
    assert len(kept) == 4
    assert_equal_trees(kept.rows(np.arange(4)), {k: v[keep] for k, v in full.items()})
    assert_equal_trees(kept.rows(np.array([3, 1])), {k: v[torch.tensor([6, 2])] for k, v in full.items()})


def test_spilled_states_of_a_dropped_client_are_not_stored(tmp_path: Path) -> None:
    """Disk store + streamed loop: the new states are SpilledStates; a client whose upload is NaN
    is dropped and the others' states are stored exactly as the whole-cohort RAM path stores them."""
    import math

    from fedcli.engine.rounds import aggregate

    def nan_row(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point() or t.dim() == 0:
            return t
        t = t.clone()
        t[1] = math.nan
        return t

    stored = []
    for extra, folder in (({"train.cohort_chunk": 2}, tmp_path / "cs"), ({}, None)):
        setup, init = make("feddyn", "loop", extra)  # stateful; its uploads are not reduced per group
        store = ClientStateStore(init, folder=folder, cache_mb=0)
        state = setup.alg.server_init(setup.init_params, setup.hp, setup.opt)
        trained = train_cohort(setup, state, store, 1)
        assert isinstance(trained.outs.state, SpilledStates) == (folder is not None)
        poisoned = trained.outs._replace(upload=pytree.tree_map(nan_row, trained.outs.upload))
        _, metrics = aggregate(
            setup, state, store, type(trained)(**{**trained.__dict__, "outs": poisoned}), 1, Timing()
        )
        assert metrics["client/dropped_nonfinite"] == 1.0
        stored.append((trained.cohort, store.state_dict()))
        store.close(remove=True)
    (cohort, spilled), (_, whole) = stored
    assert int(cohort[1]) not in spilled and spilled.keys() == whole.keys() and len(spilled) == 4
    for client in whole:
        assert_equal_trees(spilled[client], whole[client])
