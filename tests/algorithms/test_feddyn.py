"""Closed-form tests of the BayesADMM paper's ADMM-style baselines, FedDyn and FedLap, on
least-squares clients with unequal sizes N_k.

Client k holds X_k [N_k, D], y_k; A_k = X_k^T X_k, b_k = X_k^T y_k; the engine's loss is the
batch mean f_k(theta) = 1/(2 N_k) ||X_k theta - y_k||^2 (full batches here), the total loss
l_k = N_k f_k. Local solves are exact: Polyak's optimal heavy ball on a quadratic with known
curvature range contracts by sqrt(momentum) < 0.35 per step, so 30 steps reach ~1e-14.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

from fedcli.algorithms import ALGORITHMS
from fedcli.algorithms.base import Batch, ClientContext, ClientOut, HyperparameterError, OptimConfig

F64 = torch.float64
FEDDYN, FEDLAP, FEDADMM = ALGORITHMS["feddyn"], ALGORITHMS["fedlap"], ALGORITHMS["fedadmm"]
STEPS = 30


def clients_of(
    sizes: tuple[int, ...], seed: int = 0, dim: int = 3
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Heterogeneous least-squares clients whose A_k / N_k have eigenvalues in about [0.7, 1.4]."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, n in enumerate(sizes):
        x = torch.randn(n, dim, generator=g, dtype=F64) * 0.3 + torch.eye(dim, dtype=F64)[k % dim]
        x = x / x.norm(dim=0, keepdim=True) * n**0.5
        w = torch.randn(dim, generator=g, dtype=F64) * (k + 1)
        out.append((x, x @ w + 0.1 * torch.randn(n, generator=g, dtype=F64)))
    return out


def squared_loss(params: dict[str, torch.Tensor], batch: Batch) -> torch.Tensor:
    return 0.5 * (((batch.x @ params["w"] - batch.y) ** 2) * batch.weight).sum() / batch.weight.sum()


def make_ctx(x: torch.Tensor, y: torch.Tensor, round_idx: int = 1) -> ClientContext:
    full = Batch(x=x, y=y, weight=torch.ones(len(y), dtype=F64), key=torch.zeros((), dtype=torch.int64))
    return ClientContext(
        loss_fn=squared_loss,
        apply_fn=lambda p, z: z @ p["w"],
        batch=lambda step: full,
        step_mask=torch.ones(STEPS, dtype=F64),
        num_examples=torch.tensor(float(len(y)), dtype=F64),
        num_epochs=1,
        steps_per_epoch=STEPS,
        round_idx=round_idx,
        noise={},
    )


def exact_opt(clients, per_example_extra: list[float]) -> OptimConfig:
    """Polyak's heavy ball for Hessians A_k/N_k + c_k I (c_k = per_example_extra[k])."""
    eig = torch.cat(
        [
            torch.linalg.eigvalsh(x.T @ x / len(y)) + c
            for (x, y), c in zip(clients, per_example_extra, strict=True)
        ]
    )
    lo, hi = float(eig.min()) ** 0.5, float(eig.max()) ** 0.5
    return OptimConfig(client_lr=4 / (lo + hi) ** 2, client_momentum=((hi - lo) / (hi + lo)) ** 2)


def stack(outs: list[ClientOut]) -> ClientOut:
    return ClientOut(
        *pytree.tree_map(lambda *xs: torch.stack(xs), *[(o.upload, o.state, o.metrics) for o in outs])
    )


def run(alg, hp, opt, clients, cohorts: list[list[int]], params=None, state=None, states=None):
    """Run one round per cohort (client ids into `clients`) from the given or initial states;
    return the final server state."""
    params = params or {"w": torch.zeros(clients[0][0].shape[1], dtype=F64)}
    state = state or alg.server_init(params, hp, opt)
    states = (
        dict(enumerate(states))
        if states
        else {k: alg.init_client_state(params, hp) for k in range(len(clients))}
    )
    for r, cohort in enumerate(cohorts, start=1):
        bc = alg.broadcast(state, hp)
        outs = [alg.client_update(make_ctx(*clients[k], round_idx=r), bc, states[k], hp, opt) for k in cohort]
        states.update({k: o.state for k, o in zip(cohort, outs, strict=True)})
        weights = torch.tensor([float(len(clients[k][1])) for k in cohort], dtype=F64)
        state, _ = alg.server_update(state, stack(outs), weights, hp, opt)
    return state


def feddyn_reference(clients, alpha: float, cohorts: list[list[int]]) -> torch.Tensor:
    """Acar et al. Alg. 1 with exact argmins of f_k - <grad f_k(theta_k^{t-1}), theta> + alpha/2 ||theta - theta^{t-1}||^2:
    theta_k = (A_k/N_k + alpha I)^-1 (b_k/N_k - v_k + alpha theta), v_k += alpha (theta_k - theta) (v_k = -grad),
    h = -(1/m) Sum_k v_k over the m clients seen, theta = Mean_P theta_k - h/alpha."""
    dim = clients[0][0].shape[1]
    theta, v, seen = torch.zeros(dim, dtype=F64), {}, set()
    for cohort in cohorts:
        new = {}
        for k in cohort:
            x, y = clients[k]
            n = len(y)
            vk = v.get(k, torch.zeros(dim, dtype=F64))
            new[k] = torch.linalg.solve(
                x.T @ x / n + alpha * torch.eye(dim, dtype=F64), x.T @ y / n - vk + alpha * theta
            )
            v[k] = vk + alpha * (new[k] - theta)
        seen |= set(cohort)
        theta = sum(new.values()) / len(cohort) + sum(v.values()) / (alpha * len(seen))
    return theta


def test_feddyn_matches_its_recursion_with_partial_participation() -> None:
    """Three rounds with cohorts {0,1}, {1,2}, {0,2} (unequal N_k, alpha = 0.8) equal
    `feddyn_reference`, whose 1/m uses the distinct clients seen so far (2, then 3)."""
    clients, alpha = clients_of((20, 31, 45)), 0.8
    cohorts = [[0, 1], [1, 2], [0, 2]]
    state = run(FEDDYN, FEDDYN.config_cls(alpha=alpha), exact_opt(clients, [alpha] * 3), clients, cohorts)
    torch.testing.assert_close(
        state.params["w"], feddyn_reference(clients, alpha, cohorts), rtol=0, atol=1e-11
    )
    assert float(state.clients_seen) == 3.0


def test_feddyn_fixed_point_is_the_minimiser_of_the_mean_client_loss() -> None:
    """Start at theta = theta* = (Sum_k A_k/N_k)^-1 Sum_k b_k/N_k (the minimiser of (1/m) Sum f_k,
    Acar et al. Eq. 1; not the N_k-weighted one), v_k = -grad f_k(theta*) = (b_k - A_k theta*)/N_k,
    so h = -(1/m) Sum v_k = 0: each client argmin is theta* (its gradient grad f_k + v_k + alpha (theta
    - theta*) vanishes there), v_k is unchanged and the server returns Mean theta* - 0 = theta*."""
    clients, alpha = clients_of((20, 31, 45), seed=2), 0.7
    a = sum(x.T @ x / len(y) for x, y in clients)
    star = torch.linalg.solve(a, sum(x.T @ y / len(y) for x, y in clients))
    hp = FEDDYN.config_cls(alpha=alpha)
    duals = [(x.T @ y - x.T @ x @ star) / len(y) for x, y in clients]
    state = FEDDYN.server_init({"w": star}, hp, OptimConfig())._replace(
        dual_sum={"w": sum(duals)}, clients_seen=torch.tensor(3.0, dtype=F64)
    )
    states = [
        FEDDYN.init_client_state({"w": star}, hp)._replace(v={"w": v}, visited=torch.tensor(1.0, dtype=F64))
        for v in duals
    ]
    out = run(
        FEDDYN, hp, exact_opt(clients, [alpha] * 3), clients, [[0, 1, 2]] * 2, state=state, states=states
    )
    torch.testing.assert_close(out.params["w"], star, rtol=0, atol=1e-12)
    assert float(out.clients_seen) == 3.0


@pytest.mark.slow
def test_feddyn_equals_fedadmm_without_prior_on_equal_clients() -> None:
    """With N_k = N for all k, FedADMM(delta = 0, rho = alpha N) on l_k = N f_k has duals
    v_admm = N v_dyn and the same client argmin and server step, so the iterates coincide."""
    clients, alpha, n = clients_of((30, 30, 30), seed=3), 0.6, 30.0
    opt = exact_opt(clients, [alpha] * 3)
    dyn = run(FEDDYN, FEDDYN.config_cls(alpha=alpha), opt, clients, [[0, 1, 2]] * 3)
    admm = run(FEDADMM, FEDADMM.config_cls(rho=alpha * n, delta=0.0), opt, clients, [[0, 1, 2]] * 3)
    torch.testing.assert_close(dyn.params["w"], admm.params["w"], rtol=0, atol=1e-11)


def fedlap_reference(clients, delta: float, damping: float, rounds: int) -> torch.Tensor:
    """Exact FedLap: w_k = (A_k + delta I)^-1 (b_k - delta v_k + delta w_g); v_k += damping (w_k - w_g);
    w_g = Sum_k v_k; starting from w_g = 0, v_k = 0 (q_g = the prior N(0, I/delta))."""
    dim = clients[0][0].shape[1]
    w_g, v = torch.zeros(dim, dtype=F64), [torch.zeros(dim, dtype=F64) for _ in clients]
    for _ in range(rounds):
        w = [
            torch.linalg.solve(
                x.T @ x + delta * torch.eye(dim, dtype=F64), x.T @ y - delta * v[k] + delta * w_g
            )
            for k, (x, y) in enumerate(clients)
        ]
        v = [v[k] + damping * (w[k] - w_g) for k in range(len(clients))]
        w_g = sum(v)
    return w_g


@pytest.mark.slow
def test_fedlap_round_one_is_the_mean_of_local_map_solutions() -> None:
    """From w_g = 0 with damping 1/K: w_k = (A_k + delta I)^-1 b_k (local MAP under the prior) and
    w_g = (1/K) Sum_k w_k, the unweighted mean; a second round follows `fedlap_reference`."""
    clients, delta = clients_of((20, 31, 45), seed=4), 4.0
    hp = FEDLAP.config_cls(delta=delta, damping=1 / 3)
    opt = exact_opt(clients, [delta / len(y) for _, y in clients])
    start = {"w": torch.ones(3, dtype=F64)}  # round 1 starts local training here; w_g starts at 0
    one = run(FEDLAP, hp, opt, clients, [[0, 1, 2]], params=start)
    local_map = [torch.linalg.solve(x.T @ x + delta * torch.eye(3, dtype=F64), x.T @ y) for x, y in clients]
    torch.testing.assert_close(one.params["w"], sum(local_map) / 3, rtol=0, atol=1e-11)
    two = run(FEDLAP, hp, opt, clients, [[0, 1, 2]] * 2, params=start)
    torch.testing.assert_close(
        two.params["w"], fedlap_reference(clients, delta, 1 / 3, 2), rtol=0, atol=1e-11
    )


def test_fedlap_fixed_point_is_the_map_estimate() -> None:
    """Start at w_g = w* = (Sum_k A_k + delta I)^-1 Sum_k b_k (the MAP under the prior N(0, I/delta))
    with sites v_k = -grad l_k(w*)/delta = (b_k - A_k w*)/delta, whose sum is w* (delta w* = Sum
    (b_k - A_k w*)): each client argmin of l_k + delta <v_k, w> + delta/2 ||w - w*||^2 is w*, the
    sites do not move and w_g = Sum v_k = w* again (unequal N_k, delta = 4, damping 0.3)."""
    clients, delta = clients_of((20, 31, 45), seed=5), 4.0
    a = sum(x.T @ x for x, _ in clients) + delta * torch.eye(3, dtype=F64)
    star = torch.linalg.solve(a, sum(x.T @ y for x, y in clients))
    hp = FEDLAP.config_cls(delta=delta, damping=0.3)
    state = FEDLAP.server_init({"w": star}, hp, OptimConfig())._replace(params={"w": star})
    states = [
        FEDLAP.init_client_state({"w": star}, hp)._replace(v={"w": (x.T @ y - x.T @ x @ star) / delta})
        for x, y in clients
    ]
    opt = exact_opt(clients, [delta / len(y) for _, y in clients])
    out = run(FEDLAP, hp, opt, clients, [[0, 1, 2]] * 2, state=state, states=states)
    torch.testing.assert_close(out.params["w"], star, rtol=0, atol=1e-12)


def test_baselines_reject_bad_hyperparameters() -> None:
    with pytest.raises(HyperparameterError, match=r"hp.alpha must be > 0; got 0.0"):
        FEDDYN.config_cls(alpha=0.0)
    with pytest.raises(HyperparameterError, match=r"hp.damping must be in \(0, 1\]; got 1.5"):
        FEDLAP.config_cls(damping=1.5)
