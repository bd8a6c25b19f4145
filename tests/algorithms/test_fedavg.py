"""FedAvg / FedOpt closed-form checks (Reddi et al. 2021 Alg. 2; FedPA reference §2.1, §7.1)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedcli.algorithms import fedavg
from fedcli.algorithms.base import HyperparameterError, OptimConfig, ServerOptState
from fedcli.algorithms.optim import server_opt_init, server_opt_step
from tests.quadratic import quadratic_context, random_spd, stack_outs


def test_server_sgd_lr_one_is_example_weighted_average_of_client_models() -> None:
    """With server SGD, lr 1: theta' = theta - sum q_i (theta - theta_i) / sum q_i = sum q_i theta_i / sum q_i."""
    g = torch.Generator().manual_seed(0)
    sizes = [3.0, 10.0, 41.0]
    opt = OptimConfig(client_lr=0.2, local_epochs=4, client_momentum=0.6, server_opt="sgd", server_lr=1.0)
    state = fedavg.server_init(
        {"w": torch.randn(2, generator=g, dtype=torch.float64)}, fedavg.FedAvgConfig(), opt
    )
    clients = [(random_spd(2, 0.5, 2.0, g), torch.randn(2, generator=g, dtype=torch.float64)) for _ in sizes]
    outs = [
        fedavg.client_update(
            quadratic_context(a, m, num_epochs=4, steps_per_epoch=1, num_examples=n),
            fedavg.broadcast(state, None),
            None,
            fedavg.FedAvgConfig(),
            opt,
        )
        for (a, m), n in zip(clients, sizes, strict=False)
    ]
    client_models = [state.params["w"] - o.upload["delta"]["w"] for o in outs]
    q = torch.tensor(sizes, dtype=torch.float64)
    new_state, _ = fedavg.server_update(state, stack_outs(outs), q, fedavg.FedAvgConfig(), opt)
    expected = sum(qi * w for qi, w in zip(q, client_models, strict=False)) / q.sum()
    torch.testing.assert_close(new_state.params["w"], expected, rtol=0, atol=1e-14)


def test_local_sgd_with_momentum_matches_heavy_ball_recursion() -> None:
    """Client SGD with momentum m: v_k = m v_{k-1} + g_k, theta_k = theta_{k-1} - lr v_k, v_0 = 0,
    on f = 1/2 (theta - mu)^T A (theta - mu) with g_k = A (theta_{k-1} - mu)."""
    g = torch.Generator().manual_seed(1)
    a, mu = random_spd(3, 0.5, 2.0, g), torch.randn(3, generator=g, dtype=torch.float64)
    lr, m, steps = 0.1, 0.7, 6
    theta, v = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    for _ in range(steps):
        v = m * v + a @ (theta - mu)
        theta = theta - lr * v
    opt = OptimConfig(client_lr=lr, client_momentum=m, local_epochs=2)
    out = fedavg.client_update(
        quadratic_context(a, mu, num_epochs=2, steps_per_epoch=3, num_examples=5.0),
        fedavg.Broadcast(params={"w": torch.zeros(3, dtype=torch.float64)}),
        None,
        fedavg.FedAvgConfig(),
        opt,
    )
    torch.testing.assert_close(out.upload["delta"]["w"], -theta, rtol=0, atol=1e-13)


def test_masked_steps_change_nothing() -> None:
    """A step with mask 0 leaves parameters and momentum unchanged: masking the last 2 of 5 steps
    equals running 3 steps."""
    g = torch.Generator().manual_seed(2)
    a, mu = random_spd(2, 0.5, 2.0, g), torch.randn(2, generator=g, dtype=torch.float64)
    opt = OptimConfig(client_lr=0.1, client_momentum=0.9)
    bc = fedavg.Broadcast(params={"w": torch.ones(2, dtype=torch.float64)})
    masked = quadratic_context(a, mu, num_epochs=1, steps_per_epoch=5, num_examples=4.0)
    masked = masked._replace(step_mask=torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0], dtype=torch.float64))
    short = quadratic_context(a, mu, num_epochs=1, steps_per_epoch=3, num_examples=4.0)
    got = fedavg.client_update(masked, bc, None, fedavg.FedAvgConfig(), opt).upload["delta"]["w"]
    want = fedavg.client_update(short, bc, None, fedavg.FedAvgConfig(), opt).upload["delta"]["w"]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def reddi_alg2(
    kind: str, grads: list[float], lr: float, beta: float, b1: float, b2: float, tau: float
) -> float:
    """Scalar server loop of Reddi et al. (ICLR 2021) Alg. 2 as printed, from x = 1.

    The paper's Delta_t is new minus old, the negated pseudo-gradient: Delta_t = -g.
      m_t = b1 m_{t-1} + (1 - b1) Delta_t;  x_{t+1} = x_t + eta m_t / (sqrt(v_t) + tau), with
      FedAdagrad v_t = v_{t-1} + Delta_t^2;  FedAdam v_t = b2 v_{t-1} + (1 - b2) Delta_t^2;
      FedYogi v_t = v_{t-1} - (1 - b2) Delta_t^2 sign(v_{t-1} - Delta_t^2);  m_{-1} = v_{-1} = 0.
    Not in Alg. 2: sgd x += eta Delta (Alg. 1 with SGD), FedAvgM u = beta u + Delta, x += eta u.
    """
    x, m, v = 1.0, 0.0, 0.0
    for g in grads:
        delta = -g
        if kind == "sgd":
            x += lr * delta
            continue
        if kind == "momentum":
            m = beta * m + delta
            x += lr * m
            continue
        m = b1 * m + (1 - b1) * delta
        if kind == "adagrad":
            v = v + delta**2
        elif kind == "adam":
            v = b2 * v + (1 - b2) * delta**2
        else:
            v = v - (1 - b2) * delta**2 * float(np.sign(v - delta**2))
        x += lr * m / (math.sqrt(v) + tau)
    return x


@pytest.mark.parametrize(
    ("kind", "adagrad_beta1"),
    [("sgd", 0.0), ("momentum", 0.0), ("adam", 0.0), ("adagrad", 0.0), ("adagrad", 0.6), ("yogi", 0.0)],
)
def test_server_optimisers_match_reddi_alg_2(kind: str, adagrad_beta1: float) -> None:
    """Three server steps on pseudo-gradients 0.5, -2, 1.5 equal Alg. 2 written out for a scalar.
    FedAdagrad with train.server_adagrad_beta1 = a1 is Alg. 2 with b1 = a1; a1 = 0 (the default,
    Keras' Adagrad in Reddi et al.'s code) is Alg. 2 with b1 = 0."""
    opt = OptimConfig(
        server_opt=kind,
        server_lr=0.3,
        server_momentum=0.8,
        server_beta1=0.6,
        server_beta2=0.9,
        server_tau=0.01,
        server_adagrad_beta1=adagrad_beta1,
    )
    params = {"w": torch.tensor([1.0], dtype=torch.float64)}
    state: ServerOptState = server_opt_init(params)
    grads = [0.5, -2.0, 1.5]
    for value in grads:
        params, state = server_opt_step(params, {"w": torch.tensor([value], dtype=torch.float64)}, state, opt)
    b1 = adagrad_beta1 if kind == "adagrad" else 0.6
    expected = reddi_alg2(kind, grads, 0.3, 0.8, b1, 0.9, 0.01)
    assert state.step.item() == 3
    torch.testing.assert_close(
        params["w"], torch.tensor([expected], dtype=torch.float64), rtol=1e-12, atol=1e-14
    )


@pytest.mark.parametrize("kind", ["momentum", "adam", "adagrad"])
def test_server_optimisers_match_torch_optim(kind: str) -> None:
    """Against PyTorch's own optimisers on the pseudo-gradient, 4 steps on a vector:
    momentum = SGD(momentum=beta, dampening=0); bias-corrected adam = Adam(betas, eps=tau);
    adagrad (a1 = 0) = Adagrad(initial_accumulator_value=0, eps=tau)."""
    opt = OptimConfig(
        server_opt=kind,
        server_lr=0.2,
        server_momentum=0.7,
        server_beta1=0.8,
        server_beta2=0.95,
        server_tau=1e-3,
        server_bias_correction=kind == "adam",
    )
    g = torch.Generator().manual_seed(9)
    start = torch.randn(3, generator=g, dtype=torch.float64)
    shadow = torch.nn.Parameter(start.clone())
    reference = {
        "momentum": lambda: torch.optim.SGD([shadow], lr=0.2, momentum=0.7),
        "adam": lambda: torch.optim.Adam([shadow], lr=0.2, betas=(0.8, 0.95), eps=1e-3),
        "adagrad": lambda: torch.optim.Adagrad([shadow], lr=0.2, eps=1e-3),
    }[kind]()
    params, state = {"w": start}, server_opt_init({"w": start})
    for _ in range(4):
        grad = torch.randn(3, generator=g, dtype=torch.float64)
        shadow.grad = grad.clone()
        reference.step()
        params, state = server_opt_step(params, {"w": grad}, state, opt)
    torch.testing.assert_close(params["w"], shadow.detach(), rtol=1e-12, atol=1e-14)


def test_server_adagrad_beta1_is_validated() -> None:
    """Messages name the key, the constraint and the value (STYLE rule 11)."""
    with pytest.raises(
        HyperparameterError, match=r"train.server_adagrad_beta1 must be in \[0, 1\); got 1.0\."
    ):
        OptimConfig(server_adagrad_beta1=1.0)


@pytest.mark.slow
def test_fedavg_on_least_squares_converges_to_its_fixed_point() -> None:
    """FedAvg with K local GD steps on f_i = 1/2 (theta - mu_i)^T A_i (theta - mu_i) and server SGD
    lr 1 has the fixed point theta_bar = (sum q_i M_i)^-1 sum q_i M_i mu_i, M_i = I - (I - lr A_i)^K,
    because the mean delta sum q_i M_i (theta - mu_i) / sum q_i vanishes there."""
    g = torch.Generator().manual_seed(4)
    sizes = [7.0, 30.0, 12.0, 90.0]
    clients = [
        (random_spd(3, 0.3, 2.5, g), 2 * torch.randn(3, generator=g, dtype=torch.float64)) for _ in sizes
    ]
    lr, steps = 0.1, 8
    opt = OptimConfig(client_lr=lr, local_epochs=steps, server_opt="sgd", server_lr=1.0)
    state = fedavg.server_init({"w": torch.zeros(3, dtype=torch.float64)}, fedavg.FedAvgConfig(), opt)
    q = torch.tensor(sizes, dtype=torch.float64)
    for _ in range(150):
        outs = [
            fedavg.client_update(
                quadratic_context(a, m, num_epochs=steps, steps_per_epoch=1, num_examples=n),
                fedavg.broadcast(state, None),
                None,
                fedavg.FedAvgConfig(),
                opt,
            )
            for (a, m), n in zip(clients, sizes, strict=False)
        ]
        state, _ = fedavg.server_update(state, stack_outs(outs), q, fedavg.FedAvgConfig(), opt)
    eye = torch.eye(3, dtype=torch.float64)
    ms = [eye - torch.linalg.matrix_power(eye - lr * a, steps) for a, _ in clients]
    fixed = torch.linalg.solve(
        sum(qi * m for qi, m in zip(q, ms, strict=False)),
        sum(qi * m @ mu for qi, m, (_, mu) in zip(q, ms, clients, strict=False)),
    )
    torch.testing.assert_close(state.params["w"], fixed, rtol=1e-10, atol=1e-10)


def test_aggregation_is_invariant_to_client_order() -> None:
    """The weighted mean of deltas does not depend on the order clients arrive in."""
    g = torch.Generator().manual_seed(5)
    deltas = torch.randn(5, 4, generator=g, dtype=torch.float64)
    q = torch.tensor([1.0, 4.0, 2.0, 9.0, 3.0], dtype=torch.float64)
    perm = torch.tensor([3, 0, 4, 1, 2])
    opt = OptimConfig()
    state = fedavg.server_init({"w": torch.zeros(4, dtype=torch.float64)}, fedavg.FedAvgConfig(), opt)
    a, _ = fedavg.server_update(
        state, fedavg.ClientOut({"delta": {"w": deltas}}, None, {}), q, fedavg.FedAvgConfig(), opt
    )
    b, _ = fedavg.server_update(
        state, fedavg.ClientOut({"delta": {"w": deltas[perm]}}, None, {}), q[perm], fedavg.FedAvgConfig(), opt
    )
    torch.testing.assert_close(a.params["w"], b.params["w"], rtol=0, atol=1e-15)


def test_bias_corrected_server_adam_first_step_is_lr_times_sign() -> None:
    """With bias correction, m_hat_1 = g and v_hat_1 = g^2, so the first Adam step is lr * g / (|g| + tau)."""
    opt = OptimConfig(server_opt="adam", server_lr=0.1, server_tau=1e-3, server_bias_correction=True)
    params = {"w": torch.tensor([1.0, -2.0], dtype=torch.float64)}
    g = torch.tensor([0.5, -3.0], dtype=torch.float64)
    new, _ = server_opt_step(params, {"w": g}, server_opt_init(params), opt)
    torch.testing.assert_close(new["w"], params["w"] - 0.1 * g / (g.abs() + 1e-3), rtol=1e-12, atol=1e-14)


def test_numbers_without_a_dot_parse_as_floats() -> None:
    """YAML 1.1 reads `5e-5` as a string; float fields still accept it."""
    from fedcli.config.build import build_config

    assert build_config(overrides={"train.client_lr": "5e-3"}).train.client_lr == 5e-3
