"""FedProx (Li et al., MLSys 2020, arXiv:1812.06127): closed forms on least squares.

Client k holds (X_k, y_k) with the mean loss F_k(w) = 1/(2 n_k) ||X_k w - y_k||^2, so
grad F_k(w) = A_k w - b_k with A_k = X_k^T X_k / n_k and b_k = X_k^T y_k / n_k. FedProx
minimises h_k(w) = F_k(w) + mu/2 ||w - w0||^2 (Eq. 2), whose unique minimiser is
w* = (A_k + mu I)^-1 (b_k + mu w0), and every local step is linear in the error w - w*.
"""

from __future__ import annotations

import pytest
import torch

from fedcli.algorithms import fedavg, fedprox
from fedcli.algorithms.base import Batch, ClientContext, ClientOut, HyperparameterError, OptimConfig
from fedcli.config.build import build_config
from fedcli.config.checks import make_hyperparameters
from fedcli.engine.clientstate import ClientStateStore
from fedcli.engine.rounds import Timing, run_round
from fedcli.engine.setup import build

DT = torch.float64


def lsq_client(n: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return a client's (X [n, d], y [n]) in float64 from its own generator."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=DT) + 0.3
    return x, x @ torch.randn(d, generator=g, dtype=DT) + 0.1 * torch.randn(n, generator=g, dtype=DT)


def full_batch_ctx(x: torch.Tensor, y: torch.Tensor, epochs: int, steps: int) -> ClientContext:
    """A ClientContext whose every step is one full-batch gradient step on F_k."""

    def loss_fn(params: dict[str, torch.Tensor], batch: Batch) -> torch.Tensor:
        return 0.5 * ((batch.x @ params["w"] - batch.y) ** 2 * batch.weight).sum() / batch.weight.sum()

    batch = Batch(x=x, y=y, weight=torch.ones(len(y), dtype=DT), key=torch.zeros((), dtype=torch.int64))
    return ClientContext(
        loss_fn=loss_fn,
        apply_fn=lambda p, v: v @ p["w"],
        batch=lambda s: batch,
        step_mask=torch.ones(epochs * steps, dtype=DT),
        num_examples=torch.tensor(len(y), dtype=DT),
        num_epochs=epochs,
        steps_per_epoch=steps,
        round_idx=1,
        noise={},
    )


def moments(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return A = X^T X / n and b = X^T y / n."""
    return x.T @ x / len(y), x.T @ y / len(y)


def test_local_gd_matches_closed_form_proximal_recursion() -> None:
    """GD with rate eta on h: w' - w* = (I - eta (A + mu I)) (w - w*). From w0 after S steps
    w_S = w* + (I - eta (A + mu I))^S (w0 - w*); the upload is Delta = w0 - w_S."""
    x, y = lsq_client(n=7, d=3, seed=1)
    w0 = torch.tensor([0.5, -1.0, 2.0], dtype=DT)
    mu, lr, epochs, steps = 0.5, 0.1, 2, 3
    a, b = moments(x, y)
    eye = torch.eye(3, dtype=DT)
    w_star = torch.linalg.solve(a + mu * eye, b + mu * w0)
    w_s = w_star + torch.linalg.matrix_power(eye - lr * (a + mu * eye), epochs * steps) @ (w0 - w_star)

    out = fedprox.client_update(
        full_batch_ctx(x, y, epochs, steps),
        fedavg.Broadcast(params={"w": w0}),
        None,
        fedprox.FedProxConfig(mu=mu),
        OptimConfig(client_lr=lr, local_epochs=epochs),
    )

    torch.testing.assert_close(out.upload["delta"]["w"], w0 - w_s, rtol=0.0, atol=1e-12)
    torch.testing.assert_close(
        out.metrics["fedprox_prox_term"], 0.5 * mu * ((w_s - w0) ** 2).sum(), rtol=1e-12, atol=1e-12
    )


def test_heavy_ball_reaches_the_proximal_solution() -> None:
    """Heavy ball v' = m v + H e, e' = e - eta v' with H = A + mu I and e = w - w*:
    (e', v') = M (e, v), M = [[I - eta H, -eta m I], [H, m I]], v_0 = 0. Its S-step closed form
    M^S (w0 - w*, 0) converges to e = 0, i.e. the local solution is w* = (A + mu I)^-1 (b + mu w0)."""
    x, y = lsq_client(n=9, d=3, seed=2)
    w0 = torch.tensor([1.0, 0.0, -1.0], dtype=DT)
    mu, lr, m, steps = 0.5, 0.3, 0.5, 60
    a, b = moments(x, y)
    eye = torch.eye(3, dtype=DT)
    h = a + mu * eye
    w_star = torch.linalg.solve(h, b + mu * w0)
    big = torch.cat([torch.cat([eye - lr * h, -lr * m * eye], 1), torch.cat([h, m * eye], 1)], 0)
    error = (torch.linalg.matrix_power(big, steps) @ torch.cat([w0 - w_star, torch.zeros(3, dtype=DT)]))[:3]

    out = fedprox.client_update(
        full_batch_ctx(x, y, 2, steps // 2),
        fedavg.Broadcast(params={"w": w0}),
        None,
        fedprox.FedProxConfig(mu=mu),
        OptimConfig(client_lr=lr, client_momentum=m, local_epochs=2),
    )

    w_local = w0 - out.upload["delta"]["w"]
    torch.testing.assert_close(w_local, w_star + error, rtol=0.0, atol=1e-10)
    torch.testing.assert_close(w_local, w_star, rtol=0.0, atol=1e-7)  # rho(M)^60 ~ 1e-9


def test_two_rounds_average_proximal_iterates_with_server_momentum() -> None:
    """Unequal clients (n = 5, 11; different step counts), mu = 0.7, GD. Client k from w_t ends at
    w_k = w*_k + (I - eta (A_k + mu I))^S_k (w_t - w*_k), w*_k = (A_k + mu I)^-1 (b_k + mu w_t).
    Server momentum (beta = 0.9, lr 1): g_t = sum_k n_k (w_t - w_k) / sum n, u_t = beta u_{t-1} + g_t,
    w_{t+1} = w_t - u_t."""
    clients = [lsq_client(5, 2, seed=3), lsq_client(11, 2, seed=4)]
    steps = [2, 4]
    mu, lr, beta = 0.7, 0.2, 0.9
    hp, opt = (
        fedprox.FedProxConfig(mu=mu),
        OptimConfig(client_lr=lr, server_opt="momentum", server_momentum=beta),
    )
    eye = torch.eye(2, dtype=DT)
    weights = torch.tensor([5.0, 11.0], dtype=DT)
    w, u = torch.tensor([0.2, -0.4], dtype=DT), torch.zeros(2, dtype=DT)
    state = fedprox.ALGORITHM.server_init({"w": w}, hp, opt)
    for _ in range(2):
        local = []
        for (x, y), s in zip(clients, steps, strict=True):
            a, b = moments(x, y)
            w_star = torch.linalg.solve(a + mu * eye, b + mu * w)
            local.append(w_star + torch.linalg.matrix_power(eye - lr * (a + mu * eye), s) @ (w - w_star))
        u = beta * u + sum(n * (w - wk) for n, wk in zip(weights, local, strict=True)) / weights.sum()
        w = w - u

        bc = fedprox.ALGORITHM.broadcast(state, hp)
        outs = [
            fedprox.client_update(full_batch_ctx(x, y, 1, s), bc, None, hp, opt)
            for (x, y), s in zip(clients, steps, strict=True)
        ]
        stacked = ClientOut(
            upload={"delta": {"w": torch.stack([o.upload["delta"]["w"] for o in outs])}},
            state=None,
            metrics={},
        )
        state, _ = fedprox.ALGORITHM.server_update(state, stacked, weights, hp, opt)

    torch.testing.assert_close(state.params["w"], w, rtol=0.0, atol=1e-12)


def run_rounds(algo: str, hp: dict[str, float], executor: str, rounds: int = 2) -> tuple[dict, list[dict]]:
    """Run `rounds` rounds of `algo` on the lsq task; return the global params and metrics."""
    cfg = build_config(
        overrides={
            "algorithm.name": algo,
            "data.task": "lsq",
            "train.executor": executor,
            "train.local_epochs": 2,
            "train.client_momentum": 0.9,
            "train.client_lr": 0.02,
            "train.clients_per_round": 5,
            "train.batch_size": 16,
        },
        hp=hp,
    )
    setup = build(cfg)
    state = setup.alg.server_init(setup.init_params, setup.hp, setup.opt)
    store, history = ClientStateStore(None), []
    for r in range(1, rounds + 1):
        state, metrics = run_round(setup, state, store, r, Timing())
        history.append({k: v for k, v in metrics.items() if not k.startswith("client/fedprox")})
    return setup.alg.global_params(state), history


def test_mu_zero_is_fedavg_bit_for_bit() -> None:
    """mu = 0: grad h_k = grad F_k + 0 * (w - w0) = grad F_k exactly in floating point, so the
    same seed gives FedAvg's iterates, losses and byte counts bit for bit (2 rounds, momentum 0.9)."""
    avg_params, avg_metrics = run_rounds("fedavg", {}, "vmap")
    prox_params, prox_metrics = run_rounds("fedprox", {"mu": 0.0}, "vmap")
    assert all(torch.equal(avg_params[k], prox_params[k]) for k in avg_params)
    assert [{k: v for k, v in m.items() if k != "time/round_s"} for m in avg_metrics] == [
        {k: v for k, v in m.items() if k != "time/round_s"} for m in prox_metrics
    ]


def test_mu_positive_changes_the_iterates_and_loop_equals_vmap() -> None:
    """mu = 1 pulls clients toward w_t, so the model differs from FedAvg's; the loop and the
    vmap executors run the same function on the same seed and agree to float32 tolerance."""
    avg_params, _ = run_rounds("fedavg", {}, "vmap")
    loop_params, _ = run_rounds("fedprox", {"mu": 1.0}, "loop")
    vmap_params, _ = run_rounds("fedprox", {"mu": 1.0}, "vmap")
    assert not torch.allclose(avg_params["linear.weight"], vmap_params["linear.weight"], atol=1e-4)
    torch.testing.assert_close(loop_params, vmap_params, rtol=1e-5, atol=1e-6)


def test_mu_defaults_to_a_grid_value_and_is_validated() -> None:
    """The paper tunes mu per data set from {0.001, 0.01, 0.1, 1}; fedprox runs without --hp at 0.1
    (issue 24: it used to exit 2 with Python's "missing 1 required keyword-only argument"); mu < 0 is
    rejected."""
    assert make_hyperparameters("fedprox", {}).mu == 0.1
    with pytest.raises(HyperparameterError, match=r"hp.mu must be >= 0; got -0.1\."):
        fedprox.FedProxConfig(mu=-0.1)
