"""Closed-form tests of fedavg-clipped on quadratic clients (float64).

Client k has f_k(x) = 1/2 ||x - m_k||^2, so one full-batch gradient step with rate eta is
x' - m_k = (1 - eta)(x - m_k), and after s steps from x_t

    x_k = m_k + (1 - eta)^s (x_t - m_k),   Delta_k = x_t - x_k = (1 - (1 - eta)^s)(x_t - m_k).

The upload is ClipFn(Delta_k, S) = Delta_k min(1, S / ||Delta_k||), and the server (SGD, rate 1)
moves to x_t - sum_k n_k ClipFn(Delta_k, S) / sum_k n_k.
"""

from __future__ import annotations

# fedcli's registry before this plugin's module: the registry imports the module through its entry
# point, and a module imported half-way has no ALGORITHM yet (docs/adding-an-algorithm.md, step 6)
from fedcli.algorithms import ALGORITHMS  # isort: skip

import torch
from fedcli_clipped import fedavg_clipped as fc

from fedcli.algorithms.base import Batch, ClientContext, ClientOut, OptimConfig

DT = torch.float64


def quadratic_context(m: torch.Tensor, *, steps: int, num_examples: float) -> ClientContext:
    """A ClientContext whose every step is one exact gradient step on 1/2 ||x - m||^2."""
    batch = Batch(x=torch.zeros(1, dtype=DT), y=torch.zeros(1, dtype=DT), weight=torch.ones(1, dtype=DT),
                  key=torch.zeros((), dtype=torch.int64))

    def loss_fn(params: dict[str, torch.Tensor], b: Batch) -> torch.Tensor:
        return 0.5 * ((params["w"] - m) ** 2).sum()

    return ClientContext(loss_fn=loss_fn, apply_fn=lambda p, x: x, batch=lambda s: batch,
                         step_mask=torch.ones(steps, dtype=DT), num_examples=torch.tensor(num_examples, dtype=DT),
                         num_epochs=1, steps_per_epoch=steps, round_idx=1, noise={})


def test_round_matches_the_clipped_weighted_mean() -> None:
    """Two clients of unequal size, one update longer than S (clipped) and one shorter (kept)."""
    x_t = torch.tensor([1.0, -2.0, 0.5], dtype=DT)
    means = [torch.tensor([4.0, 2.0, -3.0], dtype=DT), torch.tensor([1.2, -1.9, 0.4], dtype=DT)]
    sizes = [3.0, 11.0]
    eta, steps, clip_norm = 0.1, 4, 1.5
    hp, opt = fc.ClippedConfig(clip_norm=clip_norm), OptimConfig(client_lr=eta, server_lr=1.0)
    shrink = 1 - (1 - eta) ** steps
    deltas = [shrink * (x_t - m) for m in means]
    clipped = [d * min(1.0, clip_norm / float(d.norm())) for d in deltas]
    assert float(deltas[0].norm()) > clip_norm > float(deltas[1].norm())  # the setting can fail

    state = fc.ALGORITHM.server_init({"w": x_t}, hp, opt)
    bc = fc.ALGORITHM.broadcast(state, hp)
    outs = [fc.client_update(quadratic_context(m, steps=steps, num_examples=n), bc, None, hp, opt)
            for m, n in zip(means, sizes, strict=True)]
    stacked = ClientOut(upload={"delta": {"w": torch.stack([o.upload["delta"]["w"] for o in outs])}},
                        state=None, metrics={})
    new_state, _ = fc.ALGORITHM.server_update(state, stacked, torch.tensor(sizes, dtype=DT), hp, opt)

    for out, want in zip(outs, clipped, strict=True):
        torch.testing.assert_close(out.upload["delta"]["w"], want, rtol=0.0, atol=1e-12)
    expected = x_t - (sizes[0] * clipped[0] + sizes[1] * clipped[1]) / sum(sizes)
    torch.testing.assert_close(fc.ALGORITHM.global_params(new_state)["w"], expected, rtol=0.0, atol=1e-12)


def test_clip_under_vmap_equals_client_by_client() -> None:
    """clip has no Python branch on the norm: vmapped over clients it gives each client's own result,
    including a zero update (factor min(1, S / 0) = 1)."""
    deltas = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]], dtype=DT)  # norms 5, 0.5, 0
    batched, norms = torch.func.vmap(lambda d: fc.clip({"w": d}, 1.0))(deltas)
    for row in range(3):
        one, norm = fc.clip({"w": deltas[row]}, 1.0)
        torch.testing.assert_close(batched["w"][row], one["w"], rtol=0.0, atol=0.0)
        torch.testing.assert_close(norms[row], norm, rtol=0.0, atol=0.0)
    torch.testing.assert_close(batched["w"][0], torch.tensor([0.6, 0.8], dtype=DT), rtol=0.0, atol=1e-15)


def test_registered_through_the_entry_point() -> None:
    """The installed package's entry point puts the record in fedcli's registry under its name."""
    assert ALGORITHMS["fedavg-clipped"] is fc.ALGORITHM
