"""FedPA studies (Fig. 3 bias/variance, Table 1 timing): smoke reports and the math they rest on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fedcli.algorithms import fedpa
from fedcli.studies import fedpa_bias, fedpa_table1


def test_exact_delta_is_the_full_batch_gradient_of_the_mean_loss() -> None:
    """grad 1/(2n) ||X theta - y||^2 = X^T (X theta - y) / n = A theta - X^T y / n = A (theta - mu),
    because A mu = X^T y / n; so the study's exact delta A (theta - mu) is the client's gradient (Eq. 4)."""
    problems = fedpa_bias.make_problems(fedpa_bias.SMOKE)
    theta = torch.randn(problems.x.shape[-1], generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for p in range(len(problems.sizes)):
        x, y = problems.x[p, : problems.sizes[p]], problems.y[p, : problems.sizes[p]]
        grad = torch.func.grad(lambda w: 0.5 * ((x @ w - y) ** 2).mean())(theta)  # noqa: B023
        got = fedpa_bias.exact_delta(problems.precision[p], problems.optimum[p], theta)
        torch.testing.assert_close(got, grad, rtol=1e-10, atol=1e-10)


def test_dp_delta_on_samples_with_the_exact_moments_tends_to_the_exact_delta() -> None:
    """Samples x = mu +- c v_k, v_k the columns of A^-1/2, c^2 = (l - 1) / 2, l = 2 D, have mean mu and
    unbiased covariance S = 2 c^2 A^-1 / (l - 1) = A^-1 exactly. FedPA's Sigma_hat is then
    rho_l I + (1 - rho_l) A^-1 and Delta_hat = Sigma_hat^-1 (theta - mu), which tends to A (theta - mu),
    the exact delta, as rho -> inf (rho_l -> 0)."""
    problems = fedpa_bias.make_problems(fedpa_bias.SMOKE)
    a, mu = problems.precision[0], problems.optimum[0]
    eig, vec = torch.linalg.eigh(a)
    root_inv = vec * eig.rsqrt()  # columns v_k with sum_k v_k v_k^T = A^-1
    dim = len(mu)
    c = ((2 * dim - 1) / 2) ** 0.5
    samples = [mu + sign * c * root_inv[:, k] for k in range(dim) for sign in (1.0, -1.0)]
    theta = mu + torch.linspace(-2.0, 3.0, dim, dtype=torch.float64)
    exact = fedpa_bias.exact_delta(a, mu, theta)
    for rho in (0.1, 3.0):
        rho_l = 1.0 / (1.0 + (2 * dim - 1) * rho)
        sigma_hat = rho_l * torch.eye(dim, dtype=a.dtype) + (1 - rho_l) * torch.linalg.inv(a)
        want = torch.linalg.solve(sigma_hat, theta - mu)
        torch.testing.assert_close(fedpa.posterior_delta(theta, samples, rho), want, rtol=1e-8, atol=1e-8)
    # The gap to the exact delta shrinks as rho_l (about 1/rho): 100x from rho = 1e4 to 1e6. Past about 1e7 the
    # recursion's rounding (about rho times machine epsilon, and machine-dependent) outgrows it, so rho stays at 1e6.
    gaps = [(fedpa.posterior_delta(theta, samples, rho) - exact).abs().max() for rho in (1e4, 1e6)]
    assert gaps[1] < 1e-5 and gaps[0] / gaps[1] > 50
    assert (theta - mu - exact).norm() > 0.1 * exact.norm()  # the identity covariance (FedAvg) is far off


def test_bias_is_debiased_for_the_number_of_runs_and_variance_is_the_frobenius_norm() -> None:
    """Two runs Delta + b +- e: mean Delta + b, C = 2 e e^T (divisor R - 1 = 1), ||C||_F = 2 ||e||^2,
    tr(C) / R = ||e||^2, so bias = sqrt(||b||^2 - ||e||^2) / ||Delta||, variance = 2 ||e||^2 / ||Delta||^2."""
    exact = torch.tensor([3.0, 4.0], dtype=torch.float64)  # ||Delta|| = 5
    b, e = torch.tensor([2.0, 0.0], dtype=torch.float64), torch.tensor([0.0, 1.0], dtype=torch.float64)
    bias, variance = fedpa_bias.bias_variance(torch.stack([exact + b + e, exact + b - e]), exact)
    torch.testing.assert_close(bias, torch.tensor(3.0, dtype=torch.float64).sqrt() / 5, rtol=1e-12, atol=0.0)
    torch.testing.assert_close(variance, torch.tensor(2.0 / 25, dtype=torch.float64), rtol=1e-12, atol=0.0)


@pytest.mark.slow
def test_bias_study_smoke_writes_tables_figure_and_fedpa_bias_falls(tmp_path: Path) -> None:
    out = tmp_path / "fedpa-bias.md"
    fedpa_bias.run(out, smoke=True)
    text = out.read_text()
    assert text.startswith("# FedPA Fig. 3")
    assert "| local steps S | samples l | FedAvg |" in text and text.count("**Check:**") == 7
    assert (tmp_path / "fedpa-bias-fig3.png").stat().st_size > 0
    assert (tmp_path / "fedpa-bias-fig3.svg").exists()
    assert "![Fig. 3: bias and variance vs local steps and rho](fedpa-bias-fig3.png)" in text
    # the smoke numbers already show FedPA's bias falling with samples, on IASG and on exact samples
    assert "FedPA's bias (rho = 0.1) consistently falls with local steps (Fig. 3b): holds" in text
    assert (
        "On exact posterior samples the DP delta's bias (rho = 0.1) falls as l grows (Theorem 3): "
        "holds" in text
    )


@pytest.mark.slow
def test_table1_study_smoke_writes_tables_figure_and_dp_matches_dense(tmp_path: Path) -> None:
    out = tmp_path / "fedpa-table1.md"
    fedpa_table1.run(out, smoke=True)
    text = out.read_text()
    assert text.startswith("# FedPA Table 1")
    assert (
        "| d | FedAvg | FedPA DP | IASG (no DP) | FedPA exact | DP step alone | DP / FedAvg (min) | "
        "DP / FedAvg (median) |"
    ) in text
    assert "interleaved method by method" in text and "1 torch thread" in text  # issue 24's protocol
    assert "| d | FedPA-DP - FedAvg | IASG - FedAvg | FedPA-DP - IASG |" in text
    assert "| 100 | 72 | 91 +26% | 82 +12% |" in text  # the paper's row, verbatim
    assert (tmp_path / "fedpa-table1-time.png").stat().st_size > 0
    assert (
        "The DP delta equals the dense solve (Theorem 3): relative difference < 1e-4 in float32: "
        "holds" in text
    )
