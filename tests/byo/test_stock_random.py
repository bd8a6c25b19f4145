"""Random ops in a user model's forward draw from the step's key (datasets/stock_random.py; issue 37).

In process: each op is a pure function of the key (same key, same draw; torch's global generator
untouched), vmapped over clients' keys it equals the per-key calls, and the draws have the right
distribution. Through the CLI: a model that injects noise with torch.randn_like and drops a block
with torch.rand trains on vmap (PyTorch refuses random ops under vmap's default randomness) and
gives bit-identical runs for the same seed on the loop and on vmap.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fedcli.datasets.stock_layers import StockLayers
from tests.byo.test_stock_layers_engine import setup_folder, twice_on_loop_and_vmap

X = torch.linspace(-1.0, 1.0, 24).reshape(4, 6)
OPS: dict[str, Callable[[], torch.Tensor]] = {
    "rand": lambda: torch.rand(4, 6),
    "rand(size)": lambda: torch.rand((4, 6), dtype=torch.float64),
    "randn": lambda: torch.randn(4, 6),
    "rand_like": lambda: torch.rand_like(X),
    "randn_like": lambda: torch.randn_like(X),
    "randint": lambda: torch.randint(3, 9, (4, 6)).float(),
    "randint(high)": lambda: torch.randint(5, (4, 6)).float(),
    "randint_like": lambda: torch.randint_like(X, 7),
    "bernoulli": lambda: torch.bernoulli(torch.full((4, 6), 0.3)),
    "Tensor.bernoulli": lambda: torch.full((4, 6), 0.3).bernoulli(),
    "normal(tensor)": lambda: torch.normal(X, 0.5),
    "normal(float, size)": lambda: torch.normal(2.0, 3.0, size=(4, 6)),
    "uniform_": lambda: torch.empty(4, 6).uniform_(-2.0, 2.0),
    "normal_": lambda: torch.empty(4, 6).normal_(1.0, 0.1),
    "bernoulli_": lambda: torch.empty(4, 6).bernoulli_(0.5),
}


@pytest.mark.parametrize("name", list(OPS))
def test_every_random_op_is_keyed_and_runs_under_vmap_alike(name: str) -> None:
    """Same key: the same draw; another key: another one; torch's generator is not drawn from; the
    n-th call of a forward differs from the first; vmapped over three keys = the three calls."""
    op = OPS[name]

    def call(key: torch.Tensor) -> torch.Tensor:
        with StockLayers(key):
            return torch.stack([op(), op()])

    state = torch.get_rng_state()
    one, again, other = call(torch.tensor(5)), call(torch.tensor(5)), call(torch.tensor(6))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(one, again) and not torch.equal(one, other)
    assert not torch.equal(one[0], one[1])  # two calls of one forward: two streams
    if name.endswith("_"):
        return  # in-place fills of an unbatched tensor with per-client draws cannot run under vmap
    keys = torch.tensor([5, 6, 7])
    batched = torch.func.vmap(call, randomness="error")(keys)
    for c in range(3):
        assert torch.equal(batched[c], call(keys[c]))


def test_the_draws_have_the_distributions_they_name() -> None:
    with StockLayers(torch.tensor(17)):
        u = torch.rand(200_000)
        z = torch.randn(200_000)
        b = torch.bernoulli(torch.full((200_000,), 0.2))
        k = torch.randint(3, 8, (200_000,))
        n = torch.normal(torch.full((200_000,), 2.0), 0.5)
    assert 0.0 <= u.min().item() and u.max().item() < 1.0 and abs(u.mean().item() - 0.5) < 0.005
    assert abs(z.mean().item()) < 0.01 and abs(z.std().item() - 1.0) < 0.01
    assert (
        abs((z.abs() < 1.96).float().mean().item() - 0.95) < 0.005
    )  # the normal's tails, not just its moments
    assert abs(b.mean().item() - 0.2) < 0.005 and set(b.unique().tolist()) == {0.0, 1.0}
    assert k.min().item() == 3 and k.max().item() == 7 and k.dtype == torch.int64
    assert torch.bincount(k - 3).float().div(len(k)).sub(0.2).abs().max().item() < 0.005
    assert abs(n.mean().item() - 2.0) < 0.01 and abs(n.std().item() - 0.5) < 0.01


def test_an_explicit_generator_and_calls_without_a_key_use_torch() -> None:
    """generator= is the user's stream (kept); without a key (evaluation) torch's generator draws."""
    with StockLayers(torch.tensor(5)):
        mine = torch.rand(8, generator=torch.Generator().manual_seed(1))
        keyed = torch.rand(8)
    assert torch.equal(mine, torch.rand(8, generator=torch.Generator().manual_seed(1)))
    assert not torch.equal(mine, keyed)
    torch.manual_seed(3)
    expected = torch.randn(8)
    torch.manual_seed(3)
    with StockLayers(None):
        assert torch.equal(torch.randn(8), expected)


NOISY = """
import torch
from torch import nn


class NoisyNet(nn.Module):
    def __init__(self, num_classes, input_shape):
        super().__init__()
        self.inp = nn.Linear(input_shape[-1], 16)
        self.block = nn.Linear(16, 16)
        self.out = nn.Linear(16, num_classes)

    def forward(self, x):
        h = torch.relu(self.inp(x.reshape(len(x), *x.shape[-2:]).mean(1)))
        if self.training:
            h = h + 0.1 * torch.randn_like(h)  # noise injection
            keep = (torch.rand(()) >= 0.3).to(h.dtype)  # stochastic depth: the block is dropped 30 % of steps
            h = h + keep * torch.relu(self.block(h))
        else:
            h = h + 0.7 * torch.relu(self.block(h))
        return self.out(h)
"""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_model_with_random_ops_trains_on_vmap_and_repeats_bit_for_bit(tmp_path: Path) -> None:
    """Same command, same seed, twice, on the loop and on vmap: bit-identical metrics and model
    (the draws come from the run's keys); loop and vmap agree within 1e-5 (the same draws)."""
    data = setup_folder(tmp_path)
    (tmp_path / "noisy.py").write_text(NOISY)
    runs = twice_on_loop_and_vmap(tmp_path, data, "noisy.py:NoisyNet", "4")
    (ml, pl), (mv, pv) = runs["loop", 1], runs["vmap", 1]
    assert ml.keys() == mv.keys()
    for key in ml:
        assert ml[key] == pytest.approx(mv[key], rel=1e-5, abs=1e-5), key
    for k in pl:
        torch.testing.assert_close(pv[k], pl[k], atol=1e-5, rtol=1e-5)


class _InPlaceNoise(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(9, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(len(x), 32, 9).mean(1)
        noise = torch.empty(
            h.shape[-1]
        ).normal_()  # a fill of a tensor made in the forward, not from the data
        return self.lin(
            h + noise + torch.empty_like(h).normal_()
        )  # (empty_like of the data is per client: fine)


class _Permuted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(9, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(len(x), 32, 9).mean(1)
        return self.lin(h[torch.randperm(len(h))])


class _Keyed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(9, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(len(x), 32, 9).mean(1)
        return self.lin(h + 0.1 * torch.randn_like(h))


def test_the_model_check_sends_what_vmap_cannot_key_to_the_loop() -> None:
    """The vmapped cohort step of the model check passes keyed random ops and names the ones it
    cannot run (an in-place fill of a tensor made without the data, torch.randperm): auto then takes the loop."""
    from tests.byo.test_stock_layers_engine import _check

    assert _check(_Keyed()) is None
    assert "does not run under torch.func.vmap" in (_check(_InPlaceNoise()) or "")
    assert "does not run under torch.func.vmap" in (_check(_Permuted()) or "")
