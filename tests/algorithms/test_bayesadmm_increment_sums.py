"""BayesADMM's server step sums the cohort's dual increments one [C, ...] temporary at a time
(increment_sums, issue 32): the sums must equal dual_increments(...).sum(0) bit for bit."""

from __future__ import annotations

import pytest
import torch

from fedcli.algorithms import bayesadmm


@pytest.mark.parametrize("coordinates", ["natural", "expectation"])
def test_increment_sums_equal_the_stacked_increments(coordinates: str) -> None:
    gen = torch.Generator().manual_seed(3)
    shapes = {"w": (37, 11), "b": (11,), "s": ()}
    m = {k: torch.randn(9, *sh, generator=gen) for k, sh in shapes.items()}
    s = {k: torch.rand(9, *sh, generator=gen) * 5 + 0.1 for k, sh in shapes.items()}
    m_bar = {k: torch.randn(sh, generator=gen) for k, sh in shapes.items()}
    s_bar = {k: torch.rand(sh, generator=gen) * 3 + 0.2 for k, sh in shapes.items()}
    before = {k: (m[k].clone(), s[k].clone()) for k in m}
    dv, du = bayesadmm.dual_increments(m, s, m_bar, s_bar, 0.1, coordinates)
    dv_sum, du_sum = bayesadmm.increment_sums(m, s, m_bar, s_bar, 0.1, coordinates)
    for k in shapes:
        assert torch.equal(dv_sum[k], dv[k].sum(0)), k
        assert torch.equal(du_sum[k], du[k].sum(0)), k
        assert torch.equal(m[k], before[k][0]) and torch.equal(
            s[k], before[k][1]
        )  # the uploads are not changed
    assert not torch.equal(dv_sum["w"], torch.zeros_like(dv_sum["w"]))
