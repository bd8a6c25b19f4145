"""The appended models: published parameter counts, the vmap-able LSTM, vmap over clients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedcli.datasets import models
from fedcli.datasets.bundled.stackoverflow import bag_of_words


@pytest.mark.parametrize(
    "build, count",
    [
        (lambda: models.MLP(784, (200, 200), 10), 199_210),  # McMahan et al. 2017: 2NN
        (lambda: models.McMahanCNN(10), 1_663_370),  # McMahan et al. 2017: CNN
        (lambda: models.WordLSTM(10004), 4_050_748),  # Reddi et al. 2021 Table 7: Stack Overflow NWP
        (lambda: models.LeNet5(10), 62_006),
    ],
)
def test_published_parameter_counts(build, count: int) -> None:  # noqa: ANN001
    assert models.num_parameters(build()) == count


def test_stacked_lstm_equals_torch_lstm() -> None:
    """Same weights (torch's two biases summed into ours) -> same outputs as nn.LSTM."""
    torch.manual_seed(0)
    ours = models.StackedLSTM(5, 7, 2).double()
    reference = nn.LSTM(5, 7, num_layers=2, batch_first=True).double()
    with torch.no_grad():
        for layer in range(2):
            w_ih, w_hh, bias = ours.weights[3 * layer : 3 * layer + 3]
            getattr(reference, f"weight_ih_l{layer}").copy_(w_ih)
            getattr(reference, f"weight_hh_l{layer}").copy_(w_hh)
            getattr(reference, f"bias_ih_l{layer}").copy_(bias)
            getattr(reference, f"bias_hh_l{layer}").zero_()
    x = torch.randn(3, 4, 5, dtype=torch.float64)
    torch.testing.assert_close(ours(x), reference(x)[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "build, make_x",
    [
        (lambda: models.CharLSTM(80, hidden=16), lambda g: torch.randint(0, 80, (2, 3, 6), generator=g)),
        (lambda: models.HarCNN(6), lambda g: torch.randn(2, 3, 128, 9, generator=g)),
        (lambda: models.ZenkeCNN(10), lambda g: torch.rand(2, 3, 3, 32, 32, generator=g)),
    ],
)
def test_vmap_over_clients_equals_loop(build, make_x) -> None:  # noqa: ANN001
    """functional_call vmapped over 2 clients' params and batches = each client alone, with
    dropout keyed identically (key = 11 + client)."""
    torch.manual_seed(1)
    model = build()
    params = {k: v.detach() for k, v in model.named_parameters()}
    cohort = {k: torch.stack([v, v + 0.01]) for k, v in params.items()}
    x = make_x(torch.Generator().manual_seed(2))  # [C, B, ...]
    keys = torch.tensor([11, 12])

    def run(p: dict[str, torch.Tensor], xb: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, p, (xb,), {"key": key})

    batched = torch.func.vmap(run)(cohort, x, keys)
    looped = torch.stack([run({k: v[c] for k, v in cohort.items()}, x[c], keys[c]) for c in range(2)])
    torch.testing.assert_close(batched, looped, rtol=1e-5, atol=1e-5)


def test_bag_of_words_prepare_under_vmap() -> None:
    ids = torch.tensor([[[0, 1, 1, -1], [2, 10000, -1, -1]], [[3, 3, 3, 3], [0, -1, -1, -1]]])  # [C, B, L]
    batched = torch.func.vmap(bag_of_words)(ids)
    torch.testing.assert_close(batched, torch.stack([bag_of_words(ids[0]), bag_of_words(ids[1])]))
    assert float(batched[0, 1, 2]) == pytest.approx(0.5)  # OOV counts in the mean, then is dropped


def test_keyed_uniform_is_uniform_deterministic_and_keyed() -> None:
    """The dropout source (splitmix64 of (key, position)): 1e6 draws in [0, 1) with mean 1/2 and
    variance 1/12 (within 5 standard errors), equal-width bins within 5 sigma of n/20, no lag-1 or
    neighbouring-key correlation beyond 5/sqrt(n); the same key gives the same draws."""
    n = 1_000_000
    u = models.keyed_uniform(torch.tensor(7), torch.Size([n]), torch.device("cpu")).double()
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 5 * (1 / 12) ** 0.5 / n**0.5
    assert abs(float(u.var()) - 1 / 12) < 5 * (1 / 180) ** 0.5 / n**0.5  # var of (U - 1/2)^2 is 1/180
    counts = torch.histc(u, 20, 0.0, 1.0)
    assert float((counts - n / 20).abs().max()) < 5 * (n / 20 * (1 - 1 / 20)) ** 0.5
    bound = 5 / n**0.5
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < bound
    v = models.keyed_uniform(torch.tensor(8), torch.Size([n]), torch.device("cpu")).double()
    assert abs(float(torch.corrcoef(torch.stack([u, v]))[0, 1])) < bound
    assert torch.equal(
        u, models.keyed_uniform(torch.tensor(7), torch.Size([n]), torch.device("cpu")).double()
    )


def test_keyed_dropout_under_vmap_equals_per_key_calls() -> None:
    """vmap over keys gives each client the mask it gets alone (what makes loop = vmap with dropout);
    the kept fraction is 1 - p and kept units are scaled by 1 / (1 - p)."""
    h = torch.ones(50, 40)
    keys = torch.arange(5, dtype=torch.int64) * 1000 + 3
    batched = torch.func.vmap(lambda k: models.keyed_dropout(h, k, 0.25, salt=1))(keys)
    alone = torch.stack([models.keyed_dropout(h, k, 0.25, salt=1) for k in keys])
    assert torch.equal(batched, alone)
    kept = alone != 0
    assert abs(float(kept.double().mean()) - 0.75) < 5 * (0.75 * 0.25 / kept.numel()) ** 0.5
    assert torch.allclose(alone[kept], torch.tensor(1 / 0.75))


@pytest.mark.parametrize(
    "build",
    [
        lambda: models.CharLSTM(hidden=16),
        lambda: models.WordLSTM(vocab_size=50, embed_dim=8, hidden=16),
        lambda: models.TextLSTM(vocab_size=50, embed_dim=8, hidden=16),
    ],
    ids=["char", "word", "text"],
)
def test_the_loop_back_ends_autograd_reaches_every_lstm_weight(build) -> None:  # noqa: ANN001
    """The loop back end differentiates `functional_call(model, leaves)` with torch.autograd.grad
    (engine/local.py): every parameter must get a gradient. StackedLSTM sliced its ParameterList,
    which wraps the substituted leaves in new Parameters, and `fedcli train --task shakespeare
    --executor loop` failed at its first step ("differentiated Tensor ... not used")."""
    model = build()
    leaves = {k: p.detach().requires_grad_(True) for k, p in model.named_parameters()}
    out = torch.func.functional_call(model, leaves, (torch.randint(0, 50, (3, 7)),))
    grads = torch.autograd.grad(out.square().mean(), list(leaves.values()), allow_unused=True)
    assert [k for k, g in zip(leaves, grads, strict=True) if g is None or not g.abs().sum() > 0] == []
