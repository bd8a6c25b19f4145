"""The scafflsa-garnet study: its smoke report, and the math its simulation must reproduce."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedcli.studies import load_study
from fedcli.studies.scafflsa_garnet import Setup, simulate

TINY = Setup(agents=(100,), local_steps=(1, 1000), budget=10_000, min_rounds=10, reps=2)


@pytest.mark.slow
def test_smoke_run_writes_the_report_and_its_figure(tmp_path: Path) -> None:
    out = tmp_path / "scafflsa.md"

    load_study("scafflsa_garnet")(out, smoke=True)

    text = out.read_text()
    assert (tmp_path / "scafflsa-mse-vs-h.png").stat().st_size > 0
    assert (tmp_path / "scafflsa-mse-vs-h.svg").stat().st_size > 0
    assert "](scafflsa-mse-vs-h.png)" in text
    checks = [line for line in text.splitlines() if line.startswith("**Check:**")]
    assert len(checks) == 6 and all(": holds (" in c or ": does not hold (" in c for c in checks)
    assert "fedcli sweep --recipe scafflsa-garnet --smoke" in text


@pytest.mark.slow
def test_fedlsa_sits_on_its_closed_form_bias_and_scafflsa_has_none() -> None:
    """H = 1: Theorem 4.1's rho = (1/N) sum_c eta Abar^c (theta*^c - theta*) = eta (mean_c bbar^c - Abar theta*) = 0,
    so the bias is 0; and SCAFFLSA's round theta - eta mean_c (A^c theta - b^c - xi^c) equals FedLSA's because
    sum_c xi^c = 0, so on the shared sample stream both MSEs agree up to rounding.
    H = 1000 (N = 100): ||bias||^2 = 1.24 dwarfs the noise floor (~2e-3), so FedLSA's MSE = ||bias||^2 + floor
    lies within a factor 2 of ||bias||^2, while SCAFFLSA, unbiased, stays at the floor, below ||bias||^2 / 10,
    and so does FedLSA's error around theta* + bias."""
    rows = {r["H"]: r for r in simulate(100, TINY)}

    one, many = rows[1], rows[1000]
    assert one["bias2"] <= 1e-20
    assert one["scafflsa"] == pytest.approx(one["fedlsa"], rel=1e-8)
    assert 0.5 <= many["fedlsa"] / many["bias2"] <= 2
    assert many["scafflsa"] <= many["bias2"] / 10
    assert many["debiased"] <= many["bias2"] / 10


def test_simulation_depends_only_on_the_setup_and_seed() -> None:
    setup = Setup(agents=(10,), local_steps=(1, 10), budget=2_000, min_rounds=5, reps=2)

    first, again = simulate(10, setup), simulate(10, setup)
    other = simulate(10, Setup(agents=(10,), local_steps=(1, 10), budget=2_000, min_rounds=5, reps=2, seed=1))

    assert first == again
    assert [r["fedlsa"] for r in other] != [r["fedlsa"] for r in first]
