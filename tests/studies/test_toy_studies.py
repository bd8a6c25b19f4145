"""The FOLA and BayesADMM toy studies: smoke runs write their reports, and the math under them holds.

fola_toy: Eq. 9's product of Gaussians q_n = N(mu_n, diag(1/P_n)) with weights a_n is
theta = (sum a_n P_n)^-1 sum a_n P_n mu_n, the stationary point of sum a_n log q_n (gradient
sum a_n P_n (mu_n - theta)); with P_n = c for every n it is FedAvg's sum a_n mu_n.
bayesadmm_toys: full-covariance BayesADMM with exact client solves on a ridge problem follows, in
natural parameters (n = S m, S) with duals (v, V), gamma = rho:
  S_k = S_bar + (A_k - V_k)/rho, n_k = n_bar + (b_k - v_k)/rho;  V_k += rho (S_k - S_bar), v_k += rho (n_k - n_bar);
  S_bar = (1 - alpha) Mean S_k + alpha (delta I + Sum V_k),  alpha = 1/(1 + rho K).
With rho = 1/K (alpha = 1/2) and S_bar = delta I at the start, round 1 gives V_k = A_k and S_bar = (S_bar +
Sum A_k)/2 + (delta I + Sum A_k)/2 = delta I + Sum A_k, the exact posterior precision (Prop. 3.2). From
S_bar = I instead, S_bar - S* = (1 - delta)/2 I after round 1, and from then on every round halves it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedcli.algorithms import bayesadmm_full, fedadmm
from fedcli.algorithms.base import OptimConfig
from fedcli.studies import bayesadmm_toys, fola_toy
from fedcli.studies.bayesadmm_toys_fig3b import ridge_optimum, ridge_problem, run_ridge_bayes
from fedcli.studies.bayesadmm_toys_fig4 import (
    admm_client,
    boundary_disagreement,
    fig4_clients,
    map_estimate,
    relative_error,
    sigmoid,
    vb_estimate,
    von_client,
)
from fedcli.studies.bayesadmm_toys_shared import full_batch_context, pad_cohort

F64 = torch.float64


def logistic_mean_loss(params, batch):
    """Mean binary cross-entropy softplus(x.theta) - y x.theta (the Fig. 4 loss / N_k)."""
    f = batch.x @ params["w"]
    return ((torch.nn.functional.softplus(f) - batch.y * f) * batch.weight).sum() / batch.weight.sum()


# ------------------------------------------------------------------------------ fola_toy


@pytest.mark.slow
def test_fola_toy_smoke_writes_the_report_and_every_check_holds(tmp_path) -> None:
    out = tmp_path / "fola-toy.md"

    fola_toy.run(out, smoke=True)

    text = out.read_text()
    assert text.startswith("# FOLA Fig. 1")
    assert text.count("**Check:**") == 6 and "does not hold" not in text
    assert (tmp_path / "fola-toy-mixtures.png").stat().st_size > 0
    assert (tmp_path / "fola-toy-mixtures.svg").stat().st_size > 0


def test_fola_equal_precisions_give_fedavg_and_unequal_ones_the_precision_weighted_mean() -> None:
    """P_n = c for all n: (sum a_n c)^-1 sum a_n c mu_n = sum a_n mu_n (a sums to 1). Unequal P_n: the product
    point is (sum a_n P_n)^-1 sum a_n P_n mu_n, where the gradient sum a_n P_n (mu_n - theta) of
    sum a_n log q_n vanishes; FedAvg's mean then differs."""
    rng = np.random.default_rng(0)
    means, alpha = rng.normal(size=(3, 2)), np.array([0.2, 0.3, 0.5])
    equal = fola_toy.Case("eq", means, np.full((3, 2), 0.7), alpha, (-1, 1, -1, 1))
    unequal = fola_toy.Case("ne", means, rng.uniform(0.1, 3.0, size=(3, 2)), alpha, (-1, 1, -1, 1))

    eq, ne = fola_toy.aggregates(equal), fola_toy.aggregates(unequal)

    torch.testing.assert_close(eq["product"], (alpha[:, None] * means).sum(0), rtol=0, atol=1e-15)
    torch.testing.assert_close(eq["fedavg"], (alpha[:, None] * means).sum(0), rtol=0, atol=1e-15)
    prec = 1.0 / unequal.variances
    expected = (alpha[:, None] * prec * means).sum(0) / (alpha[:, None] * prec).sum(0)
    torch.testing.assert_close(ne["product"], expected, rtol=0, atol=1e-14)
    gradient = (alpha[:, None] * prec * (means - ne["product"])).sum(0)
    torch.testing.assert_close(gradient, np.zeros(2), rtol=0, atol=1e-12)
    assert np.abs(ne["product"] - ne["fedavg"]).max() > 1e-3


def test_fola_mixture_density_matches_the_gaussian_pdf_and_case_a_mode_is_the_product_point() -> None:
    """log q_mix(theta) = log sum_n a_n N(theta; mu_n, Sigma_n), checked against torch.distributions at random
    points. Case A is symmetric under swapping the coordinates, so at the product point (on the diagonal) the
    responsibilities are equal and the fixed point theta = (sum r_n P_n)^-1 sum r_n P_n mu_n is the product
    point: it is a critical point of q_mix and the mode the study finds."""
    case = fola_toy.CASES[0]
    points = np.random.default_rng(1).uniform(-1, 2, size=(5, 2))
    comps = [
        torch.distributions.MultivariateNormal(torch.tensor(m), torch.diag(torch.tensor(v)))
        for m, v in zip(case.means, case.variances, strict=True)
    ]
    pts = torch.tensor(points)
    expected = torch.logsumexp(
        torch.stack([c.log_prob(pts) + np.log(a) for c, a in zip(comps, case.alpha, strict=True)]), 0
    )

    torch.testing.assert_close(fola_toy.log_mixture(case, points), expected.numpy(), rtol=0, atol=1e-12)
    product = fola_toy.aggregates(case)["product"]
    torch.testing.assert_close(fola_toy.gradient_log_mixture(case, product), np.zeros(2), rtol=0, atol=1e-12)
    torch.testing.assert_close(fola_toy.mixture_mode(case, 41), product, rtol=0, atol=1e-12)


# ------------------------------------------------------------------------------ bayesadmm_toys


@pytest.mark.slow
def test_bayesadmm_toys_smoke_writes_the_report_and_figures(tmp_path) -> None:
    out = tmp_path / "bayesadmm-toys.md"

    bayesadmm_toys.run(out, smoke=True)

    text = out.read_text()
    assert text.startswith("# BayesADMM toys")
    for section in ("## Fig. 3b", "## Fig. 4", "## Fig. 3a"):
        assert section in text
    assert "is exact after one round (Prop. 3.2): holds" in text
    for name in ("fig3b", "fig4", "fig3a"):
        assert (tmp_path / f"bayesadmm-toys-{name}.png").stat().st_size > 0


def test_full_covariance_bayesadmm_solves_ridge_in_one_round_only_from_the_prior() -> None:
    """Module docstring: from S_bar = delta I one round of exact client solves gives S* = delta I + Sum A_k and
    m_bar = W*; from S_bar = I the precision error is (1 - delta)/2 after round 1 and halves every round."""
    problem = ridge_problem(120, 3)
    w_star = ridge_optimum(problem)
    gram = problem.x.T @ problem.x
    s_star = torch.kron(torch.eye(10, dtype=F64), gram) + problem.delta * torch.eye(90, dtype=F64)

    ((prior_mean, prior_prec),) = run_ridge_bayes(problem, 1, problem.delta)
    from_eye = run_ridge_bayes(problem, 3, 1.0)

    torch.testing.assert_close(prior_prec, s_star, rtol=1e-12, atol=1e-9)
    torch.testing.assert_close(prior_mean, w_star, rtol=0, atol=1e-10)
    errors = [s - s_star for _, s in from_eye]
    eye = torch.eye(90, dtype=F64)
    for r, error in enumerate(errors):
        torch.testing.assert_close(error, (1 - problem.delta) / 2 / 2**r * eye, rtol=0, atol=1e-9)


def fig4_client_problem(seed: int):
    """Client 1 of Fig. 4 and a server q_bar = N(m_bar, S_bar^-1) with duals (v, V) as after some rounds."""
    rng = np.random.default_rng(seed)
    x, y = fig4_clients()[0]
    a, b = rng.normal(size=(3, 3)), rng.normal(size=(3, 3))
    return x, y, 0.3 * rng.normal(size=3), a @ a.T + 2 * np.eye(3), rng.normal(size=3), 0.3 * b @ b.T, rng


@pytest.mark.parametrize("mc", [False, True])
def test_numpy_von_client_takes_bayesadmm_full_client_updates_steps(mc: bool) -> None:
    """von_client (the study's fast Fig. 4 client) and bayesadmm_full.client_update run the same recursion:
    20 VON steps with separate mean/precision rates (b_m = 2 b_S, decayed 1/(1 + 0.1 t)), rho = 0.2, from a
    non-trivial (m_bar, S_bar, v, V); with the delta method and with one MC sample (the same draws eps_t)."""
    x, y, m_bar, s_bar, v, V, rng = fig4_client_problem(seed=3)
    hp = bayesadmm_full.BayesADMMFullConfig(
        rho=0.2,
        dual_damping=1.0,
        delta=0.2,
        tau=1.0,
        step_size=0.02,
        step_decay=0.1,
        mean_step_ratio=2.0,
        mc_samples=int(mc),
    )
    noise = rng.normal(size=(20, 1, 1, 3)) * float(mc)
    xt, yt = torch.tensor(x), torch.tensor(y)
    ctx = full_batch_context(
        xt, yt, logistic_mean_loss, 20, 1, noise={"von": torch.tensor(noise[:, 0])} if mc else None
    )
    bc = bayesadmm_full.Broadcast(mean={"w": torch.tensor(m_bar)}, precision=torch.tensor(s_bar))

    m, s = von_client(
        pad_cohort([(xt, yt)]),
        m_bar[None],
        s_bar[None],
        v[None, None],
        V[None, None],
        hp,
        noise,
    )
    out = bayesadmm_full.client_update(
        ctx, bc, bayesadmm_full.ClientState(v=torch.tensor(v), V=torch.tensor(V)), hp, OptimConfig()
    )

    torch.testing.assert_close(torch.tensor(m[0, 0]), out.upload["mean"], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(torch.tensor(s[0, 0]), out.upload["precision"], rtol=1e-9, atol=1e-9)


def test_numpy_admm_client_takes_fedadmm_client_updates_steps() -> None:
    """admm_client runs heavy ball on the summed objective with rate lr; fedadmm.client_update minimises the
    objective / N_k, so client_lr = lr N_k gives the same iterates (50 steps, no early stop; the two
    accumulate float64 rounding differently, ~1e-9 relative after 50 momentum steps)."""
    x, y, _, _, v, _, rng = fig4_client_problem(seed=4)
    theta_bar = 0.2 * rng.normal(size=3)
    hp = fedadmm.FedADMMConfig(rho=0.2, delta=0.2)
    ctx = full_batch_context(torch.tensor(x), torch.tensor(y), logistic_mean_loss, 50, 1)

    theta, steps = admm_client(x, y, theta_bar, v, 0.2, 1e-3, 0.8, 50, 0.0)
    out = fedadmm.client_update(
        ctx,
        fedadmm.Broadcast(params={"w": torch.tensor(theta_bar)}),
        fedadmm.ClientState(v={"w": torch.tensor(v)}),
        hp,
        OptimConfig(client_lr=1e-3 * len(y), client_momentum=0.8),
    )

    assert steps == 50
    torch.testing.assert_close(torch.tensor(theta), out.upload["params"]["w"], rtol=1e-8, atol=0)


@pytest.mark.slow
def test_vb_estimate_is_stationary_under_monte_carlo() -> None:
    """The Gaussian VB optimum satisfies E_q[grad] + delta m = 0 and S = E_q[Hessian] + delta I (summed loss,
    q = N(m, S^-1)); checked with 100,000 independent draws in 5 chunks (Hessian standard error ~0.03; the
    Laplace precision at the MAP differs from S by up to 0.35)."""
    clients = fig4_clients()
    x, y = np.vstack([c[0] for c in clients]), np.concatenate([c[1] for c in clients])
    m, s = vb_estimate(clients, 0.2)
    rng, chol = np.random.default_rng(5), np.linalg.cholesky(np.linalg.inv(s))

    grad, curvature = np.zeros(3), np.zeros(len(y))
    for _ in range(5):
        p = sigmoid((m + rng.normal(size=(20_000, 3)) @ chol.T) @ x.T)  # [M, N]
        grad, curvature = grad + ((p - y) @ x).mean(0) / 5, curvature + (p * (1 - p)).mean(0) / 5

    assert np.linalg.norm(grad + 0.2 * m) < 1e-3 * np.linalg.norm(x.T @ y)
    torch.testing.assert_close((x.T * curvature) @ x + 0.2 * np.eye(3), s, rtol=0, atol=0.1)
    assert relative_error(m, map_estimate(clients, 0.2)) > 0.01


def test_boundary_disagreement_compares_lines_not_scales() -> None:
    """sign(c theta^T x) = sign(theta^T x) for c > 0, so scaling changes nothing; -theta flips every point."""
    theta = np.array([-2.0, -2.5, -2.3])

    assert boundary_disagreement(3.0 * theta, theta) == 0.0
    assert boundary_disagreement(-theta, theta) == 1.0
    assert 0.0 < boundary_disagreement(theta + np.array([0.0, 0.0, 1.0]), theta) < 1.0
