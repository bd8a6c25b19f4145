"""Quadratic clients f_i(theta) = 1/2 (theta - mu_i)^T A_i (theta - mu_i) for closed-form tests.

`quadratic_context` builds a ClientContext whose loss ignores the batch, so each local
step is one exact gradient-descent step on f_i: grad f_i(theta) = A_i (theta - mu_i).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fedcli.algorithms.base import Batch, ClientContext, ClientOut, Params


def quadratic_context(
    a: Tensor,
    mu: Tensor,
    *,
    num_epochs: int,
    steps_per_epoch: int,
    num_examples: float,
    round_idx: int = 1,
    key: str = "w",
) -> ClientContext:
    """Return a context whose loss is 1/2 (p[key] - mu)^T a (p[key] - mu) at every step."""
    dtype = mu.dtype
    num_steps = num_epochs * steps_per_epoch
    dummy = Batch(
        x=torch.zeros(1, dtype=dtype),
        y=torch.zeros(1, dtype=dtype),
        weight=torch.ones(1, dtype=dtype),
        key=torch.zeros((), dtype=torch.int64),
    )

    def loss_fn(params: Params, batch: Batch) -> Tensor:
        d = params[key] - mu
        return 0.5 * d @ (a @ d)

    return ClientContext(
        loss_fn=loss_fn,
        apply_fn=lambda p, x: x,
        batch=lambda s: dummy,
        step_mask=torch.ones(num_steps, dtype=dtype),
        num_examples=torch.tensor(num_examples, dtype=dtype),
        num_epochs=num_epochs,
        steps_per_epoch=steps_per_epoch,
        round_idx=round_idx,
        noise={},
    )


def stack_outs(outs: list[ClientOut]) -> ClientOut:
    """Stack per-client outputs along a new leading client axis (what executors return)."""
    from torch.utils import _pytree as pytree

    upload = pytree.tree_map(lambda *xs: torch.stack(xs), *[o.upload for o in outs])
    metrics = pytree.tree_map(lambda *xs: torch.stack(xs), *[o.metrics for o in outs])
    return ClientOut(upload=upload, state=None, metrics=metrics)


def random_spd(d: int, low: float, high: float, generator: torch.Generator) -> Tensor:
    """Return a random symmetric matrix with eigenvalues uniform in [low, high] (float64)."""
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64))
    eig = low + (high - low) * torch.rand(d, generator=generator, dtype=torch.float64)
    return q @ torch.diag(eig) @ q.T
