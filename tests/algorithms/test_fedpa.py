"""FedPA closed-form checks (Al-Shedivat et al. 2021; reference/fedpa.md §2.5-2.8, §7)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedcli.algorithms import fedavg, fedpa
from fedcli.algorithms.base import OptimConfig
from fedcli.config.build import build_config
from fedcli.errors import ConfigError
from tests.quadratic import quadratic_context, random_spd, stack_outs


def dense_delta(x0: torch.Tensor, samples: torch.Tensor, rho: float) -> torch.Tensor:
    """Sigma_hat^-1 (x0 - mean) with Sigma_hat = rho_l I + (1 - rho_l) S_hat (Theorem 3), by a dense solve."""
    num, dim = samples.shape
    mean = samples.mean(dim=0)
    cov = torch.cov(samples.T, correction=1) if num > 1 else torch.zeros(dim, dim, dtype=samples.dtype)
    rho_l = 1.0 / (1.0 + (num - 1) * rho)
    sigma = rho_l * torch.eye(dim, dtype=samples.dtype) + (1.0 - rho_l) * cov
    return torch.linalg.solve(sigma, x0 - mean)


@pytest.mark.parametrize(
    ("dim", "num", "rho"),
    [(5, 2, 0.5), (20, 5, 0.1), (50, 8, 1.0), (7, 10, 100.0), (300, 4, 0.01), (3, 6, 0.0)],
)
def test_dp_delta_equals_dense_shrinkage_solve(dim: int, num: int, rho: float) -> None:
    """The O(l^2 d) Sherman-Morrison DP (Eqs. 21-28) equals the dense solve
    Sigma_hat^-1 (theta - mu_hat) of the shrinkage estimator to 1e-8 relative in float64."""
    g = torch.Generator().manual_seed(dim * 100 + num)
    samples = torch.randn(num, dim, generator=g, dtype=torch.float64) * torch.rand(
        dim, generator=g, dtype=torch.float64
    )
    x0 = torch.randn(dim, generator=g, dtype=torch.float64)
    got = fedpa.posterior_delta(x0, list(samples), rho)
    torch.testing.assert_close(got, dense_delta(x0, samples, rho), rtol=1e-8, atol=1e-10)


def test_rho_zero_and_single_sample_give_iterate_mean_delta() -> None:
    """rho = 0 gives rho_l = 1, Sigma_hat = I, so Delta = theta - mean(samples); l = 1 gives theta - x_1."""
    g = torch.Generator().manual_seed(1)
    samples = torch.randn(4, 9, generator=g, dtype=torch.float64)
    x0 = torch.randn(9, generator=g, dtype=torch.float64)
    torch.testing.assert_close(
        fedpa.posterior_delta(x0, list(samples), 0.0), x0 - samples.mean(0), rtol=0, atol=1e-12
    )
    torch.testing.assert_close(fedpa.posterior_delta(x0, [samples[0]], 0.7), x0 - samples[0], rtol=0, atol=0)


def numpy_shrinkage_delta(x0: np.ndarray, samples: np.ndarray, rho: float) -> np.ndarray:
    """Theorem 3 in numpy: Sigma_hat = rho_l I + (1 - rho_l) S, rho_l = 1 / (1 + (l - 1) rho), S the
    unbiased sample covariance (1/(l - 1)) sum (x_j - mean)(x_j - mean)^T; Delta = Sigma_hat^-1 (x0 - mean)."""
    num, dim = samples.shape
    mean = samples.mean(0)
    centred = samples - mean
    cov = centred.T @ centred / (num - 1) if num > 1 else np.zeros((dim, dim))
    rho_l = 1.0 / (1.0 + (num - 1) * rho)
    return np.linalg.solve(rho_l * np.eye(dim) + (1.0 - rho_l) * cov, x0 - mean)


@pytest.mark.parametrize(
    ("hp", "epochs", "first"),
    [
        (fedpa.FedPAConfig(rho=0.1, burn_in_rounds=1), 4, 1),  # default: the TFF code's l = E - 1
        (fedpa.FedPAConfig(rho=0.5, burn_in_rounds=1, burn_in_epochs=0), 4, 0),  # the paper text's l = E
        (fedpa.FedPAConfig(rho=0.3, burn_in_rounds=1, burn_in_epochs=2), 5, 2),
        (fedpa.FedPAConfig(rho=0.1, burn_in_rounds=1), 1, 0),  # E = 1: the one epoch is the sample (TFF)
    ],
)
def test_client_delta_is_the_shrinkage_solve_on_the_sampled_epochs(
    hp: fedpa.FedPAConfig, epochs: int, first: int
) -> None:
    """On a quadratic client, E epochs of K = 3 GD steps (momentum 0.6: u_k = m u_{k-1} + g_k,
    theta_k = theta_{k-1} - lr u_k). Sample e is the mean of epoch e's 3 post-step iterates (Alg. 4);
    epochs first..E-1 are samples (l = E - burn_in_epochs), and the upload is Theorem 3's
    Sigma_hat^-1 (theta_0 - mean), solved densely in numpy from the iterates recomputed here."""
    g = torch.Generator().manual_seed(2)
    a, mu = random_spd(3, 0.5, 2.0, g), torch.randn(3, generator=g, dtype=torch.float64)
    theta0, lr, m, steps = torch.randn(3, generator=g, dtype=torch.float64), 0.1, 0.6, 3
    ctx = quadratic_context(a, mu, num_epochs=epochs, steps_per_epoch=steps, num_examples=10.0, round_idx=5)
    opt = OptimConfig(client_lr=lr, client_momentum=m, local_epochs=epochs)

    out = fedpa.client_update(ctx, fedavg.Broadcast(params={"w": theta0}), None, hp, opt)

    a_np, mu_np, theta, u, iterates = a.numpy(), mu.numpy(), theta0.numpy().copy(), np.zeros(3), []
    for _ in range(epochs * steps):
        u = m * u + a_np @ (theta - mu_np)
        theta = theta - lr * u
        iterates.append(theta)
    epoch_means = np.array(iterates).reshape(epochs, steps, 3).mean(1)
    expected = numpy_shrinkage_delta(theta0.numpy(), epoch_means[first:], hp.rho)
    assert fedpa.num_samples(hp, opt) == epochs - first
    torch.testing.assert_close(out.upload["delta"]["w"], torch.from_numpy(expected), rtol=1e-10, atol=1e-12)


def exact_moment_samples(mean: torch.Tensor, sigma: torch.Tensor, rho: float) -> list[torch.Tensor]:
    """Samples whose shrinkage estimate Sigma_hat equals sigma exactly and whose mean is `mean`.

    With l = d + 1 samples x_j = mean + L z_j, where the z_j are centred with (1/(l-1)) sum z z^T = I,
    the sample covariance is S = L L^T; choosing S = (sigma - rho_l I) / (1 - rho_l) makes
    rho_l I + (1 - rho_l) S = sigma (needs sigma > rho_l I)."""
    dim = len(mean)
    num = dim + 1
    rho_l = 1.0 / (1.0 + (num - 1) * rho)
    centred = torch.eye(num, dtype=torch.float64) - 1.0 / num  # columns span the centred subspace
    u, s, _ = torch.linalg.svd(centred)
    z = (u[:, :dim] * math.sqrt(num - 1)).T  # [d, l], rows orthonormal and orthogonal to ones
    chol = torch.linalg.cholesky((sigma - rho_l * torch.eye(dim, dtype=torch.float64)) / (1.0 - rho_l))
    return list((mean[:, None] + chol @ z).T)


@pytest.mark.slow
def test_fedpa_with_exact_moments_converges_to_global_optimum_fedavg_is_biased() -> None:
    """Least-squares clients f_i = 1/2 (theta - mu_i)^T A_i (theta - mu_i), weights q_i = n_i (unequal).
    With exact moments the FedPA client delta is A_i (theta - mu_i) (Prop. 2), so the server iteration is
    gradient descent on sum q_i f_i and converges to Eq. 3: theta* = (sum q_i A_i)^-1 sum q_i A_i mu_i.
    FedAvg with K local GD steps instead has the fixed point (sum q_i M_i)^-1 sum q_i M_i mu_i with
    M_i = I - (I - lr A_i)^K (FedPA §1.5, derived), measurably different from theta*."""
    g = torch.Generator().manual_seed(3)
    dim, sizes = 3, [5.0, 20.0, 60.0]
    precisions = [random_spd(dim, 0.6, 3.0, g) for _ in sizes]
    means = [3.0 * torch.randn(dim, generator=g, dtype=torch.float64) for _ in sizes]
    q = torch.tensor(sizes, dtype=torch.float64)
    optimum = torch.linalg.solve(
        sum(qi * a for qi, a in zip(q, precisions, strict=False)),
        sum(qi * a @ m for qi, a, m in zip(q, precisions, means, strict=False)),
    )
    rho, opt = 1.0, OptimConfig(server_opt="sgd", server_lr=0.3)
    hp = fedpa.FedPAConfig(rho=rho, burn_in_rounds=0)
    state = fedpa.server_init({"w": torch.zeros(dim, dtype=torch.float64)}, hp, opt)
    client_samples = [
        exact_moment_samples(m, torch.linalg.inv(a), rho) for a, m in zip(precisions, means, strict=False)
    ]
    for _ in range(300):
        theta = state.params["w"]
        deltas = [fedpa.posterior_delta(theta, samples, rho) for samples in client_samples]
        outs = stack_outs(
            [fedavg.ClientOut(upload={"delta": {"w": d}}, state=None, metrics={}) for d in deltas]
        )
        state, _ = fedpa.server_update(state, outs, q, hp, opt)
    torch.testing.assert_close(state.params["w"], optimum, rtol=1e-9, atol=1e-9)

    lr, steps = 0.1, 20
    avg_opt = OptimConfig(client_lr=lr, local_epochs=steps, server_opt="sgd", server_lr=1.0)
    avg_state = fedavg.server_init(
        {"w": torch.zeros(dim, dtype=torch.float64)}, fedavg.FedAvgConfig(), avg_opt
    )
    for _ in range(120):
        outs = stack_outs(
            [
                fedavg.client_update(
                    quadratic_context(a, m, num_epochs=steps, steps_per_epoch=1, num_examples=n),
                    fedavg.broadcast(avg_state, None),
                    None,
                    fedavg.FedAvgConfig(),
                    avg_opt,
                )
                for a, m, n in zip(precisions, means, sizes, strict=False)
            ]
        )
        avg_state, _ = fedavg.server_update(avg_state, outs, q, fedavg.FedAvgConfig(), avg_opt)
    eye = torch.eye(dim, dtype=torch.float64)
    ms = [eye - torch.linalg.matrix_power(eye - lr * a, steps) for a in precisions]
    fedavg_fixed_point = torch.linalg.solve(
        sum(qi * m for qi, m in zip(q, ms, strict=False)),
        sum(qi * m @ mu for qi, m, mu in zip(q, ms, means, strict=False)),
    )
    torch.testing.assert_close(avg_state.params["w"], fedavg_fixed_point, rtol=1e-8, atol=1e-8)
    # the bias (~0.04 here) is 10^6 times the tolerance both fixed points were checked to
    assert torch.linalg.vector_norm(fedavg_fixed_point - optimum) > 0.01


def test_burn_in_rounds_are_fedavg_exactly() -> None:
    """During rounds 1..T_burn the FedPA client runs FedAvg's update (footnote 11), so on the same seed
    the global model after 2 burn-in rounds is bit-identical to FedAvg's (real engine, least squares)."""
    from fedcli.engine.clientstate import ClientStateStore
    from fedcli.engine.rounds import Timing, run_round
    from fedcli.engine.setup import build

    finals = {}
    for name, hp in (("fedavg", {}), ("fedpa", {"burn_in_rounds": 2})):
        cfg = build_config(
            overrides={
                "algorithm.name": name,
                "data.task": "lsq",
                "train.clients_per_round": 3,
                "train.local_epochs": 2,
                "train.client_momentum": 0.9,
                "train.server_opt": "momentum",
            },
            hp=hp,
        )
        setup = build(cfg)
        state = setup.alg.server_init(setup.init_params, setup.hp, setup.opt)
        for round_idx in (1, 2):
            state, _ = run_round(setup, state, ClientStateStore(None), round_idx, Timing())
        finals[name] = setup.alg.global_params(state)
    for key in finals["fedavg"]:
        assert torch.equal(finals["fedavg"][key], finals["fedpa"][key]), key


def test_fedpa_needs_a_sample_per_round() -> None:
    """l = E - burn_in_epochs must be >= 1; the engine reports it as a config error."""
    from fedcli.engine.setup import build

    cfg = build_config(
        overrides={"algorithm.name": "fedpa", "data.task": "lsq", "train.local_epochs": 2},
        hp={"burn_in_epochs": 2},
    )
    setup = build(cfg)
    with pytest.raises(Exception, match=r"hp.burn_in_epochs must be < train.local_epochs=2"):
        setup.alg.server_init(setup.init_params, setup.hp, setup.opt)
    with pytest.raises(ConfigError, match=r"hp.rho must be >= 0; got -1"):
        build_config(overrides={"algorithm.name": "fedpa"}, hp={"rho": -1})


@pytest.mark.parametrize("dim", [100, 2_048, 209_662, 1_000_000])
def test_float32_dot_products_of_the_dp_are_accurate_to_float32_rounding(dim: int) -> None:
    """fedpa._dot on float32 vectors (blocks of float32 products summed in float64, no float64
    copies) is within 1e-7 * sum |a_i b_i| of the exact float64 dot: the rounding of the
    float32 products and block sums, not an error that grows with d."""
    from fedcli.algorithms.fedpa import _dot

    g = torch.Generator().manual_seed(dim)
    a, b = torch.randn(dim, generator=g), torch.randn(dim, generator=g) + 0.3
    exact = torch.dot(a.double(), b.double())
    scale = (a.double() * b.double()).abs().sum()
    assert _dot(a, b).dtype == torch.float64
    assert float((_dot(a, b) - exact).abs()) <= 1e-7 * float(scale)


@pytest.mark.slow
def test_float32_dp_delta_matches_the_float64_dp() -> None:
    """posterior_delta on the float32 samples of an MLP-sized client (d = 209,662, l = 4) equals
    the same DP run on their float64 copies to 1e-5 relative (the float32 path is what training runs)."""
    g = torch.Generator().manual_seed(3)
    dim = 209_662
    samples = [torch.randn(dim, generator=g) * 0.01 for _ in range(4)]
    x0 = torch.randn(dim, generator=g) * 0.01
    fp32 = fedpa.posterior_delta(x0, samples, 0.1)
    fp64 = fedpa.posterior_delta(x0.double(), [s.double() for s in samples], 0.1)
    assert fp32.dtype == torch.float32
    torch.testing.assert_close(fp32.double(), fp64, rtol=1e-5, atol=1e-5 * float(fp64.abs().max()))
