"""SCAFFOLD (Karimireddy et al., ICML 2020, arXiv:1910.06378): closed forms on quadratics.

Client i has f_i(x) = 1/2 (x - a_i)^T A_i (x - a_i) with A_i symmetric positive definite,
so g_i(x) = A_i (x - a_i) exactly (full-batch steps). With weights q_i the global
objective sum_i q_i f_i is minimised at x* = (sum_i q_i A_i)^-1 sum_i q_i A_i a_i. A local
step y <- y - eta (g_i(y) - c_i + c) is affine with fixed point z_i = a_i + A_i^-1 (c_i - c),
so after K steps y_K = z_i + (I - eta A_i)^K (x - z_i).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

from fedcli.algorithms import fedavg, fedlsa, scaffold
from fedcli.algorithms.base import Batch, ClientContext, ClientOut, HyperparameterError, OptimConfig
from fedcli.algorithms.optim import server_opt_init
from fedcli.config.build import build_config
from fedcli.engine.clientstate import ClientStateStore
from fedcli.engine.rounds import Timing, run_round
from fedcli.engine.setup import build

DT = torch.float64
D = 3


def quadratic(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (A [D, D] SPD with eigenvalues in [0.5, 2], a [D]) from the seed."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=DT))
    eig = 0.5 + 1.5 * torch.rand(D, generator=g, dtype=DT)
    return q @ torch.diag(eig) @ q.T, 2.0 * torch.randn(D, generator=g, dtype=DT)


def quad_loss(params: dict[str, torch.Tensor], batch: Batch) -> torch.Tensor:
    """Weighted mean over the batch of 1/2 (w - a_j)^T A_j (w - a_j); x holds A_j, y holds a_j."""
    err = params["w"] - batch.y  # [B, D]
    per_example = 0.5 * torch.einsum("bd,bde,be->b", err, batch.x, err)
    return (per_example * batch.weight).sum() / batch.weight.sum()


def context(batches: list[Batch], epochs: int, mask: list[float] | None = None) -> ClientContext:
    """A ClientContext cycling through `batches` each epoch (step s uses batches[s % K])."""
    k = len(batches)
    step_mask = torch.tensor(mask * epochs if mask else [1.0] * (k * epochs), dtype=DT)
    return ClientContext(
        loss_fn=quad_loss,
        apply_fn=lambda p, v: v,
        batch=lambda s: batches[s % k],
        step_mask=step_mask,
        num_examples=torch.tensor(1.0, dtype=DT),
        num_epochs=epochs,
        steps_per_epoch=k,
        round_idx=1,
        noise={},
    )


def full_batch(a_mat: torch.Tensor, a_vec: torch.Tensor) -> Batch:
    return Batch(
        x=a_mat[None], y=a_vec[None], weight=torch.ones(1, dtype=DT), key=torch.zeros((), dtype=torch.int64)
    )


def stack(outs: list[ClientOut]) -> ClientOut:
    """Stack per-client outputs on a leading client axis, as the executors do."""

    def stacked(field: int) -> object:
        parts = [tuple(o)[field] for o in outs]
        return None if parts[0] is None else pytree.tree_map(lambda *xs: torch.stack(xs), *parts)

    return ClientOut(upload=stacked(0), state=stacked(1), metrics=stacked(2))


def run_rounds(alg_client, alg_server, state, bc_fn, clients, cohorts, states, weights, hp, opt):  # noqa: ANN001, ANN201
    """Run rounds by hand: clients[i] is a ClientContext; states maps i -> client state."""
    history = []
    for cohort in cohorts:
        bc = bc_fn(state, hp)
        outs = [alg_client(clients[i], bc, states.get(i), hp, opt) for i in cohort]
        for i, out in zip(cohort, outs, strict=True):
            states[i] = out.state
        state, _ = alg_server(state, stack(outs), weights[list(cohort)], hp, opt)
        history.append(state)
    return state, history


def scaffold_state(x: torch.Tensor, c: torch.Tensor, weight: float) -> scaffold.ServerState:
    """A server state broadcasting (x, c): control_sum = weight * c over visited weight `weight`."""
    params = {"w": x}
    return scaffold.ServerState(
        params, server_opt_init(params), {"w": weight * c}, torch.tensor(weight, dtype=DT)
    )


@pytest.mark.parametrize("option", ["I", "II"])
def test_one_round_matches_closed_form(option: str) -> None:
    """With c = (0.3, -0.2, 0.1) and c_i = (-0.5, 0.4, 0.2), K = 4 real steps (E = 2 epochs of
    3 slots, the last masked): y_K = z + (I - eta A)^K (x - z), z = a + A^-1 (c_i - c).
    Option II: c_i+ = c_i - c + (x - y_K) / (K eta). Option I: c_i+ = g_i(x) = A (x - a)."""
    a_mat, a_vec = quadratic(1)
    x = torch.tensor([1.0, -2.0, 0.5], dtype=DT)
    c, c_i = torch.tensor([0.3, -0.2, 0.1], dtype=DT), torch.tensor([-0.5, 0.4, 0.2], dtype=DT)
    lr, k = 0.2, 4
    z = a_vec + torch.linalg.solve(a_mat, c_i - c)
    y_k = z + torch.linalg.matrix_power(torch.eye(D, dtype=DT) - lr * a_mat, k) @ (x - z)
    expected_control = c_i - c + (x - y_k) / (k * lr) if option == "II" else a_mat @ (x - a_vec)
    hp = scaffold.ScaffoldConfig(option=option)
    bc = scaffold.broadcast(scaffold_state(x, c, weight=3.0), hp)
    batch = full_batch(a_mat, a_vec)
    ctx = context([batch, batch, batch], epochs=2, mask=[1.0, 1.0, 0.0])

    out = scaffold.client_update(
        ctx, bc, scaffold.ClientState({"w": c_i}, torch.tensor(1.0)), hp, OptimConfig(client_lr=lr)
    )

    torch.testing.assert_close(bc.control["w"], c, rtol=0.0, atol=1e-15)
    torch.testing.assert_close(out.upload["delta"]["w"], x - y_k, rtol=0.0, atol=1e-12)
    torch.testing.assert_close(out.state.control["w"], expected_control, rtol=0.0, atol=1e-12)
    torch.testing.assert_close(out.upload["delta_control"]["w"], expected_control - c_i, rtol=0.0, atol=1e-12)
    assert float(out.upload["first_visit"]) == 0.0


def test_option_one_is_the_full_local_gradient_over_unequal_batches() -> None:
    """A client with 3 examples in batches {0, 1} and {2, pad}: Option I sets
    c_i+ = grad f_i(x) = 1/3 sum_j A_j (x - a_j), the mean over examples, not over batches."""
    quads = [quadratic(s) for s in (2, 3, 4)]
    x = torch.tensor([0.5, 0.5, -1.0], dtype=DT)
    expected = sum(m @ (x - v) for m, v in quads) / 3
    key = torch.zeros((), dtype=torch.int64)
    first = Batch(
        x=torch.stack([quads[0][0], quads[1][0]]),
        y=torch.stack([quads[0][1], quads[1][1]]),
        weight=torch.ones(2, dtype=DT),
        key=key,
    )
    second = Batch(
        x=torch.stack([quads[2][0], quads[2][0]]),
        y=torch.stack([quads[2][1], quads[2][1]]),
        weight=torch.tensor([1.0, 0.0], dtype=DT),
        key=key,
    )
    hp = scaffold.ScaffoldConfig(option="I")
    params = {"w": x}

    out = scaffold.client_update(
        context([first, second], epochs=1),
        scaffold.broadcast(scaffold.server_init(params, hp, OptimConfig()), hp),
        scaffold.init_client_state(params, hp),
        hp,
        OptimConfig(client_lr=0.1),
    )

    torch.testing.assert_close(out.state.control["w"], expected, rtol=0.0, atol=1e-12)
    assert float(out.upload["first_visit"]) == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("option", ["I", "II"])
def test_converges_to_the_global_optimum_where_fedavg_is_biased(option: str) -> None:
    """Exact gradients, K = 5 steps, full participation, q = n = (1, 2, 5). SCAFFOLD's fixed
    point is x = x* with c_i = g_i(x*) and c = sum q_i c_i / sum q_i = grad F(x*) = 0 (a local
    step from x* then moves by -eta (g_i(y) - g_i(x*)) = 0). FedAvg's fixed point is not x*
    when the A_i differ: on quadratics its bias is FedLSA's closed form (fedlsa.md §3.6),
    (I - sum q_i Gamma_i)^-1 sum q_i (I - Gamma_i)(a_i - x*) with Gamma_i = (I - eta A_i)^K,
    checked to be non-zero so that this test can fail."""
    quads = [quadratic(s) for s in (5, 6, 7)]
    n = torch.tensor([1.0, 2.0, 5.0], dtype=DT)
    x_star = torch.linalg.solve(
        sum(q * m for q, (m, _) in zip(n, quads, strict=True)),
        sum(q * m @ v for q, (m, v) in zip(n, quads, strict=True)),
    )
    clients = [context([full_batch(m, v)], epochs=5) for m, v in quads]
    hp, opt = scaffold.ScaffoldConfig(option=option), OptimConfig(client_lr=0.25)
    params = {"w": torch.zeros(D, dtype=DT)}
    states = {i: scaffold.init_client_state(params, hp) for i in range(3)}

    final, _ = run_rounds(
        scaffold.client_update,
        scaffold.server_update,
        scaffold.server_init(params, hp, opt),
        scaffold.broadcast,
        clients,
        [(0, 1, 2)] * 40,
        states,
        n,
        hp,
        opt,
    )
    a_bar = torch.stack([m for m, _ in quads])
    fedavg_bias = fedlsa.fedlsa_bias(a_bar, torch.stack([m @ v for m, v in quads]), 0.25, 5, weights=n)

    torch.testing.assert_close(final.params["w"], x_star, rtol=0.0, atol=1e-10)
    for i, (m, v) in enumerate(quads):
        torch.testing.assert_close(states[i].control["w"], m @ (x_star - v), rtol=0.0, atol=1e-9)
    torch.testing.assert_close(
        scaffold.broadcast(final, hp).control["w"], torch.zeros(D, dtype=DT), rtol=0.0, atol=1e-9
    )
    assert float(fedavg_bias.norm()) > 1e-2


@pytest.mark.parametrize("option", ["I", "II"])
def test_one_local_step_equals_fedavg_sgd(option: str) -> None:
    """K = 1: y_i = x - eta (g_i(x) - c_i + c). Under full participation c = sum q_i c_i / sum q_i,
    so the q-weighted mean of x - y_i is eta sum q_i g_i(x) / sum q_i: FedAvg-SGD's pseudo-gradient,
    every round (here 4 rounds, unequal q = n, server momentum 0.9, client momentum 0.9 which
    one step from zero velocity does not change)."""
    quads = [quadratic(s) for s in (8, 9, 10)]
    n = torch.tensor([3.0, 1.0, 2.0], dtype=DT)
    clients = [context([full_batch(m, v)], epochs=1) for m, v in quads]
    hp = scaffold.ScaffoldConfig(option=option)
    opt = OptimConfig(client_lr=0.2, client_momentum=0.9, server_opt="momentum", server_momentum=0.9)
    params = {"w": torch.tensor([1.0, 2.0, -1.0], dtype=DT)}
    states = {i: scaffold.init_client_state(params, hp) for i in range(3)}

    _, ours = run_rounds(
        scaffold.client_update,
        scaffold.server_update,
        scaffold.server_init(params, hp, opt),
        scaffold.broadcast,
        clients,
        [(0, 1, 2)] * 4,
        states,
        n,
        hp,
        opt,
    )
    _, avg = run_rounds(
        fedavg.client_update,
        fedavg.server_update,
        fedavg.server_init(params, hp, opt),
        fedavg.broadcast,
        clients,
        [(0, 1, 2)] * 4,
        {},
        n,
        hp,
        opt,
    )

    assert float(states[0].control["w"].norm()) > 0.1  # the corrections are really exercised
    for mine, theirs in zip(ours, avg, strict=True):
        torch.testing.assert_close(mine.params["w"], theirs.params["w"], rtol=0.0, atol=1e-12)


@pytest.mark.parametrize("weighting,num_clients", [("examples", 0), ("uniform", 5)])
def test_control_variates_sum_to_zero_under_partial_participation(weighting: str, num_clients: int) -> None:
    """Alg. 1 keeps c = (1/N) sum_i c_i (unvisited c_i = 0): c += (1/N) sum_S Delta c_i with
    --hp num_clients=N, so sum_i (c_i - c) = 0 over all N clients. The default keeps
    c = sum_V q_i c_i / sum_V q_i over visited clients V, so sum_V q_i (c_i - c) = 0. Checked
    after each of 6 rounds with 2 of 5 clients (q = n unequal), K = 3 stochastic-free steps."""
    quads = [quadratic(s) for s in range(11, 16)]
    n = torch.tensor([1.0, 4.0, 2.0, 3.0, 5.0], dtype=DT)
    clients = [context([full_batch(m, v)], epochs=3) for m, v in quads]
    hp, opt = (
        scaffold.ScaffoldConfig(weighting=weighting, num_clients=num_clients),
        OptimConfig(client_lr=0.1),
    )
    params = {"w": torch.zeros(D, dtype=DT)}
    states: dict[int, scaffold.ClientState] = {}
    state = scaffold.server_init(params, hp, opt)
    for cohort in [(0, 1), (2, 3), (1, 4), (0, 2), (3, 4), (1, 2)]:
        for i in cohort:
            states.setdefault(i, scaffold.init_client_state(params, hp))
        state, _ = run_rounds(
            scaffold.client_update,
            scaffold.server_update,
            state,
            scaffold.broadcast,
            clients,
            [cohort],
            states,
            n,
            hp,
            opt,
        )
        c = scaffold.broadcast(state, hp).control["w"]
        if num_clients:
            total = sum(
                states.get(i, scaffold.init_client_state(params, hp)).control["w"] - c for i in range(5)
            )
        else:
            total = sum(n[i] * (s.control["w"] - c) for i, s in states.items())
        assert float(c.norm()) > 1e-2
        torch.testing.assert_close(total, torch.zeros(D, dtype=DT), rtol=0.0, atol=1e-12)


@pytest.mark.parametrize("option", ["I", "II"])
def test_loop_and_vmap_executors_agree(option: str) -> None:
    """The engine's loop (each client on its own K_i) and vmap (padded, masked) executors give the
    same model, server control variate and stored c_i on lsq (unequal n_i, partial participation,
    2 epochs of several minibatches, client momentum 0.5, 2 rounds so c_i crosses rounds)."""
    results = {}
    for executor in ("loop", "vmap"):
        cfg = build_config(
            overrides={
                "algorithm.name": "scaffold",
                "data.task": "lsq",
                "train.executor": executor,
                "train.rounds": 2,
                "train.clients_per_round": 3,
                "train.batch_size": 25,
                "train.local_epochs": 2,
                "train.client_lr": 0.02,
                "train.client_momentum": 0.5,
            },
            hp={"option": option},
        )
        setup = build(cfg)
        state = setup.alg.server_init(setup.init_params, setup.hp, setup.opt)
        store = ClientStateStore(lambda s=setup: s.alg.init_client_state(s.init_params, s.hp))
        for r in (1, 2):
            state, _ = run_round(setup, state, store, r, Timing())
        results[executor] = (state, store.state_dict())
    (loop_state, loop_clients), (vmap_state, vmap_clients) = results["loop"], results["vmap"]
    torch.testing.assert_close(vmap_state.params, loop_state.params, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(vmap_state.control_sum, loop_state.control_sum, rtol=1e-5, atol=1e-5)
    assert sorted(vmap_clients) == sorted(loop_clients) and len(loop_clients) >= 4
    for cid, client in loop_clients.items():
        torch.testing.assert_close(vmap_clients[cid].control, client.control, rtol=1e-5, atol=1e-5)


def test_invalid_hyperparameters_are_refused_with_the_value() -> None:
    """Option must be I or II; the paper's N rule needs uniform weights."""
    with pytest.raises(HyperparameterError, match=r"hp.option must be 'I' or 'II'; got 'III'\."):
        scaffold.ScaffoldConfig(option="III")
    with pytest.raises(
        HyperparameterError, match=r"hp.num_clients must be 0 unless hp.weighting='uniform'; got 5\."
    ):
        scaffold.ScaffoldConfig(num_clients=5)
    with pytest.raises(HyperparameterError, match=r"hp.num_clients must be >= 0; got -1\."):
        scaffold.ScaffoldConfig(weighting="uniform", num_clients=-1)


@pytest.mark.parametrize("weighting", ["examples", "uniform"])
def test_server_step_from_group_sums_is_the_closed_form(weighting: str) -> None:
    """A streamed round (engine/streaming.py stream_cohort) passes server_update the uploads summed a group at a
    time (upload_sums, groups {0, 1}, {2, 3}, {4}); the step must be Alg. 1 lines 16-17 all the same:
    x+ = x - eta_g sum_i q_i d_i / sum_i q_i (server sgd), control_sum+ = control_sum + sum_i q_i Delta c_i,
    visited+ = visited + sum_i q_i first_i, with q_i = n_i ("examples") or 1 ("uniform"); and equal (float64
    rounding) to the step from the stacked uploads."""
    from fedcli.algorithms.base import UploadSums

    g = torch.Generator().manual_seed(3)
    num = 5
    delta, dc = torch.randn(num, D, generator=g, dtype=DT), torch.randn(num, D, generator=g, dtype=DT)
    first = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0], dtype=DT)
    upload = {"delta": {"w": delta}, "delta_control": {"w": dc}, "first_visit": first}
    examples = torch.tensor([3.0, 1.0, 4.0, 1.0, 5.0], dtype=DT)
    q = examples if weighting == "examples" else torch.ones(num, dtype=DT)
    hp, opt = scaffold.ScaffoldConfig(weighting=weighting), OptimConfig(server_lr=0.7)
    x, c = torch.tensor([1.0, -2.0, 0.5], dtype=DT), torch.tensor([0.3, -0.2, 0.1], dtype=DT)
    state = scaffold_state(x, c, weight=2.0)
    bc = scaffold.broadcast(state, hp)
    sums = None
    for rows in ([0, 1], [2, 3], [4]):
        idx = torch.tensor(rows)
        part = scaffold.upload_sums(
            pytree.tree_map(lambda t, i=idx: t.index_select(0, i), upload), examples[idx], bc, hp
        )
        sums = part if sums is None else pytree.tree_map(torch.add, sums, part)
    reduced = ClientOut(upload=UploadSums(sums, num, None, 0.0), state=None, metrics={})
    got, _ = scaffold.server_update(state, reduced, examples, hp, opt)
    want, _ = scaffold.server_update(
        state, ClientOut(upload=upload, state=None, metrics={}), examples, hp, opt
    )

    closed_x = x - 0.7 * (q[:, None] * delta).sum(0) / q.sum()
    torch.testing.assert_close(got.params["w"], closed_x, rtol=0.0, atol=1e-12)
    torch.testing.assert_close(got.control_sum["w"], 2.0 * c + (q[:, None] * dc).sum(0), rtol=0.0, atol=1e-12)
    torch.testing.assert_close(got.visited_weight, torch.tensor(2.0, dtype=DT) + (q * first).sum())
    for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(want), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
