"""Closed-form tests of FedADMM (Möllenhoff et al., Fig. 2a / App. C.1) on ridge-regression clients.

Client k holds X_k [N_k, D], y_k [N_k]; the engine's loss is the batch mean
f_k(theta) = 1/(2 N_k) ||X_k theta - y_k||^2, so the client's total loss is l_k = N_k f_k with
A_k = X_k^T X_k and b_k = X_k^T y_k. Clients have unequal sizes so that the unweighted client
mean of the server step matters.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

from fedcli.algorithms import ALGORITHMS
from fedcli.algorithms.base import Batch, ClientContext, ClientOut, HyperparameterError, OptimConfig

F64 = torch.float64
FEDADMM = ALGORITHMS["fedadmm"]
SIZES = (20, 31, 45)


def ridge_clients(seed: int = 0, dim: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Well-conditioned heterogeneous least-squares clients (A_k / N_k close to I)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, n in enumerate(SIZES):
        x = torch.randn(n, dim, generator=g, dtype=torch.float64) * 0.3 + torch.eye(dim, dtype=F64)[k % dim]
        x = x / x.norm(dim=0, keepdim=True) * n**0.5  # columns of norm sqrt(N_k)
        w = torch.randn(dim, generator=g, dtype=torch.float64) * (k + 1)
        out.append((x, x @ w + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)))
    return out


def squared_loss(params: dict[str, torch.Tensor], batch: Batch) -> torch.Tensor:
    residual = batch.x @ params["w"] - batch.y
    return 0.5 * ((residual**2) * batch.weight).sum() / batch.weight.sum()


def make_ctx(
    x: torch.Tensor, y: torch.Tensor, steps: int, loss_fn=squared_loss, noise=None, round_idx: int = 1
) -> ClientContext:
    """A full-batch client context: every step sees all N_k examples."""
    full = Batch(x=x, y=y, weight=torch.ones(len(y), dtype=F64), key=torch.zeros((), dtype=torch.int64))
    return ClientContext(
        loss_fn=loss_fn,
        apply_fn=lambda p, z: z @ p["w"],
        batch=lambda step: full,
        step_mask=torch.ones(steps, dtype=F64),
        num_examples=torch.tensor(float(len(y)), dtype=F64),
        num_epochs=1,
        steps_per_epoch=steps,
        round_idx=round_idx,
        noise=noise or {},
    )


def stack(outs: list[ClientOut]) -> ClientOut:
    """Stack per-client outputs on a leading client axis, as the executors do."""
    return ClientOut(
        *pytree.tree_map(lambda *xs: torch.stack(xs), *[(o.upload, o.state, o.metrics) for o in outs])
    )


def run_rounds(alg, hp, opt, params, clients, rounds: int, steps: int, make=make_ctx):
    """Run full-participation rounds by hand (clients in order); return the final server state."""
    state = alg.server_init(params, hp, opt)
    states = [alg.init_client_state(params, hp) for _ in clients]
    weights = torch.tensor([float(len(y)) for _, y in clients], dtype=F64)
    for r in range(1, rounds + 1):
        bc = alg.broadcast(state, hp)
        outs = [
            alg.client_update(make(x, y, steps, round_idx=r), bc, s, hp, opt)
            for (x, y), s in zip(clients, states, strict=True)
        ]
        states = [o.state for o in outs]
        state, _ = alg.server_update(state, stack(outs), weights, hp, opt)
    return state


def exact_opt(clients, prox: float) -> OptimConfig:
    """Polyak's optimal heavy ball for the clients' per-example objectives A_k/N_k + prox/N_k I:
    lr = 4/(sqrt(L) + sqrt(mu))^2, momentum = ((sqrt(L) - sqrt(mu))/(sqrt(L) + sqrt(mu)))^2; the error
    contracts by sqrt(momentum) per step (< 0.3 here), so STEPS = 30 steps solve to ~1e-15."""
    eig = torch.cat(
        [
            torch.linalg.eigvalsh((x.T @ x + prox * torch.eye(x.shape[1], dtype=F64)) / len(y))
            for x, y in clients
        ]
    )
    lo, hi = float(eig.min()) ** 0.5, float(eig.max()) ** 0.5
    return OptimConfig(client_lr=4 / (lo + hi) ** 2, client_momentum=((hi - lo) / (hi + lo)) ** 2)


STEPS = 30


def admm_reference(
    clients, rho: float, delta: float, gamma: float, rounds: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fig. 2a with exact client argmins on l_k = 1/2 ||X_k theta - y_k||^2:
    theta_k = (A_k + rho I)^-1 (b_k - v_k + rho theta_bar);  v_k += gamma (theta_k - theta_bar);
    theta_bar = (rho K Mean theta_k + Sum v_k) / (delta + rho K). Returns (theta_bar, Sum v_k)."""
    dim = clients[0][0].shape[1]
    theta_bar, v = torch.zeros(dim, dtype=F64), [torch.zeros(dim, dtype=F64) for _ in clients]
    for _ in range(rounds):
        thetas = [
            torch.linalg.solve(x.T @ x + rho * torch.eye(dim, dtype=F64), x.T @ y - v[k] + rho * theta_bar)
            for k, (x, y) in enumerate(clients)
        ]
        v = [v[k] + gamma * (t - theta_bar) for k, t in enumerate(thetas)]
        theta_bar = (rho * sum(thetas) + sum(v)) / (delta + rho * len(clients))
    return theta_bar, sum(v)


@pytest.mark.slow
def test_fedadmm_two_rounds_match_the_admm_recursion() -> None:
    """Two rounds of FedADMM with rho = 3, delta = 2, gamma = 0.5 rho (damping 0.5) equal
    `admm_reference` (exact argmins, prior-delta server form, unweighted client mean)."""
    clients = ridge_clients()
    hp = FEDADMM.config_cls(rho=3.0, delta=2.0, dual_damping=0.5)
    state = run_rounds(
        FEDADMM, hp, exact_opt(clients, 3.0), {"w": torch.zeros(3, dtype=F64)}, clients, rounds=2, steps=STEPS
    )
    expected, dual_sum = admm_reference(clients, rho=3.0, delta=2.0, gamma=1.5, rounds=2)
    torch.testing.assert_close(state.params["w"], expected, rtol=0, atol=1e-10)
    torch.testing.assert_close(state.dual_sum["w"], dual_sum, rtol=0, atol=1e-10)


def ridge_solution(clients, delta: float) -> torch.Tensor:
    """theta* = (Sum_k A_k + delta I)^-1 Sum_k b_k, the minimiser of Sum_k l_k + delta/2 ||theta||^2."""
    a = sum(x.T @ x for x, _ in clients) + delta * torch.eye(clients[0][0].shape[1], dtype=F64)
    return torch.linalg.solve(a, sum(x.T @ y for x, y in clients))


@pytest.mark.slow
def test_fedadmm_ridge_solution_is_a_fixed_point() -> None:
    """At theta_bar = theta*, v_k = -grad l_k(theta*) = b_k - A_k theta* (so Sum v_k = delta theta*):
    the client argmin is theta* (its gradient A_k theta - b_k + v_k + rho (theta - theta*) vanishes
    there), the dual increment is 0 and the server returns (rho K theta* + delta theta*)/(delta + rho K)
    = theta*. Two rounds must leave theta_bar at theta* (unequal N_k, rho = 7, delta = 5)."""
    clients, delta, rho = ridge_clients(seed=1), 5.0, 7.0
    star = ridge_solution(clients, delta)
    hp = FEDADMM.config_cls(rho=rho, delta=delta)
    opt = exact_opt(clients, rho)
    state = FEDADMM.server_init({"w": star}, hp, opt)._replace(dual_sum={"w": delta * star})
    duals = [
        FEDADMM.init_client_state({"w": star}, hp)._replace(v={"w": x.T @ y - x.T @ x @ star})
        for x, y in clients
    ]
    for r in (1, 2):
        outs = [
            FEDADMM.client_update(
                make_ctx(x, y, STEPS, round_idx=r), FEDADMM.broadcast(state, hp), cs, hp, opt
            )
            for (x, y), cs in zip(clients, duals, strict=True)
        ]
        duals = [o.state for o in outs]
        state, _ = FEDADMM.server_update(state, stack(outs), torch.ones(3, dtype=F64), hp, opt)
    torch.testing.assert_close(state.params["w"], star, rtol=0, atol=1e-12)


@pytest.mark.slow
def test_fedadmm_converges_to_the_exact_ridge_solution() -> None:
    """From theta_bar = 0 and v_k = 0, ADMM converges linearly to theta*; `admm_reference` shows an
    error of 2.8e-5 after 15 rounds at rho = 40 on these clients, so FedADMM must be within 1e-4."""
    clients, delta, rho = ridge_clients(seed=1), 5.0, 40.0
    hp = FEDADMM.config_cls(rho=rho, delta=delta)
    state = run_rounds(
        FEDADMM,
        hp,
        exact_opt(clients, rho),
        {"w": torch.zeros(3, dtype=F64)},
        clients,
        rounds=15,
        steps=STEPS,
    )
    torch.testing.assert_close(state.params["w"], ridge_solution(clients, delta), rtol=0, atol=1e-4)


def test_fedadmm_masked_steps_are_no_ops() -> None:
    """A client with 40 real steps followed by 20 masked ones returns what 40 steps return."""
    (x, y), *_ = ridge_clients()
    hp = FEDADMM.config_cls(rho=3.0, delta=1.0)
    opt = exact_opt([(x, y)], 3.0)
    bc = FEDADMM.broadcast(FEDADMM.server_init({"w": torch.ones(3, dtype=F64)}, hp, opt), hp)
    cs = FEDADMM.init_client_state({"w": torch.ones(3, dtype=F64)}, hp)
    short = FEDADMM.client_update(make_ctx(x, y, 40), bc, cs, hp, opt)
    padded_ctx = make_ctx(x, y, 60)._replace(
        step_mask=torch.cat([torch.ones(40, dtype=F64), torch.zeros(20, dtype=F64)])
    )
    padded = FEDADMM.client_update(padded_ctx, bc, cs, hp, opt)
    torch.testing.assert_close(padded.upload["params"]["w"], short.upload["params"]["w"], rtol=0, atol=0)
    torch.testing.assert_close(padded.metrics["train_loss"], short.metrics["train_loss"], rtol=0, atol=1e-15)


def test_fedadmm_refuses_a_server_optimizer() -> None:
    """The server step is closed form, so --server-opt adam would be silently ignored: refuse."""
    with pytest.raises(HyperparameterError, match=r"train.server_opt must be sgd for fedadmm"):
        FEDADMM.server_init(
            {"w": torch.zeros(2, dtype=F64)}, FEDADMM.config_cls(), OptimConfig(server_opt="adam")
        )


def test_fedadmm_rejects_bad_hyperparameters() -> None:
    with pytest.raises(HyperparameterError, match=r"hp.rho must be > 0; got -1.0"):
        FEDADMM.config_cls(rho=-1.0)
