"""One client's update with the local training its algorithm declares (docs/architecture.md §3,
"Local training").

An algorithm with `Algorithm.local = Local(request, finish)` states its local training as a
`LocalSGD` request; the back end decides how to train it (its `Trainer`) and the algorithm's
`finish` turns the result into the client's `ClientOut`:

    request = local.request(ctx, bc, state, hp, opt)      # what to train (no training)
    result  = trainer(ctx, request, opt)                   # autograd, a compiled step, or
                                                           # the fused back end's dense trainer
    out     = local.finish(ctx, bc, state, hp, opt, result)

An algorithm without `local` runs its own `client_update`, on every back end except `fused`.
Trainers here: `optim.train_local` (torch.func.grad: the default, and the only one that runs
under vmap), `eager_train_local` (torch.autograd on leaf copies: the loop back end's trainer, so
also each `process` worker's and `distributed` rank's with the loop) and `CompiledStep` (--compile
with the loop, process and distributed back ends: each client's gradient step compiled once).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fedcli.algorithms.base import Algorithm, Batch, ClientContext, ClientOut, LocalSGD, OptimConfig, Params
from fedcli.algorithms.optim import LocalResult, local_objective, local_sgd, scaled_objective, train_local

Trainer = Callable[[ClientContext, LocalSGD, OptimConfig], LocalResult]


def run_client(
    alg: Algorithm,
    ctx: ClientContext,
    broadcast: Any,
    state: Any,
    hp: Any,
    opt: OptimConfig,
    trainer: Trainer | None = None,
) -> ClientOut:
    """Run one client: request -> trainer (default: autograd) -> finish, or the algorithm's client_update."""
    local = alg.local
    if local is None:
        return alg.client_update(ctx, broadcast, state, hp, opt)
    request = local.request(ctx, broadcast, state, hp, opt)
    result = (trainer or train_local)(ctx, request, opt)
    return local.finish(ctx, broadcast, state, hp, opt, result)


def eager_train_local(ctx: ClientContext, request: LocalSGD, opt: OptimConfig) -> LocalResult:
    """train_local with each step's gradient taken by torch.autograd instead of torch.func.grad.

    Outside vmap the two run the same kernels, so the result is bit-equal (tests/engine/
    test_workers.py), but torch.func.grad wraps every operation of the forward and backward in its
    transform layer: on the CNN (FEMNIST, 10 clients, one thread) the loop's round was 6 % faster
    with this trainer (docs/benchmarks.md, "Back ends: which stay"). The leaves are detached
    aliases of the iterate; the graph is freed by autograd.grad before MaskedSGD updates the
    iterate in place. Never under vmap (the loop back end only).
    """
    objective = scaled_objective(local_objective(ctx.loss_fn, request))
    return local_sgd(
        ctx, request.start, opt, average_epochs=request.average_epochs, grad_step=eager_grad(objective)
    )


class CompiledStep:
    """A Trainer whose gradient step (forward, backward, the -lr * mask scaling) is torch.compile'd.

    The step takes the request's start and linear terms as arguments, not as constants, so one
    compiled graph per (loss function, prox_mu, linear or not) serves every step, client and round
    of a run (batches are padded to the batch size: fixed shapes), for FedAvg, FedProx, SCAFFOLD
    and FedPA alike. Outside vmap only (loop, and inside each process or rank); --compile with
    vmap compiles the whole cohort instead (backends/compiled.py). Equal to train_local to float
    tolerance (inductor reorders sums; tests/engine/test_backends.py).
    """

    def __init__(self, backend: str = "inductor") -> None:
        self.backend = backend
        self.compiled: dict[Hashable, Callable[..., Any]] = {}

    def __call__(self, ctx: ClientContext, request: LocalSGD, opt: OptimConfig) -> LocalResult:
        has_linear = request.linear is not None
        key = (ctx.loss_fn, request.prox_mu, has_linear)
        fn = self.compiled.get(key)
        if fn is None:
            loss_fn, mu = ctx.loss_fn, request.prox_mu

            def step(params: Params, batch: Batch, coef: torch.Tensor, start: Params, linear: Params) -> Any:
                terms = LocalSGD(start=start, prox_mu=mu, linear=linear if has_linear else None)
                return scaled_objective(local_objective(loss_fn, terms))(params, batch, coef)

            fn = self.compiled[key] = torch.compile(
                torch.func.grad(step, has_aux=True), dynamic=False, backend=self.backend
            )
        start, linear = request.start, request.linear or {}
        return local_sgd(
            ctx,
            request.start,
            opt,
            average_epochs=request.average_epochs,
            grad_step=lambda params, batch, coef: fn(params, batch, coef, start, linear),
        )


def eager_grad(fn: Callable[..., Any]) -> Callable[..., Any]:
    """torch.func.grad(fn, has_aux=True) for fn(params, *rest) -> (value, aux), by torch.autograd on
    detached leaf copies of params (outside any torch.func transform only)."""

    def grad(params: Params, *rest: Any) -> tuple[Params, Any]:
        leaves = {k: p.detach().requires_grad_(True) for k, p in params.items()}
        with torch.enable_grad():
            value, aux = fn(leaves, *rest)
            grads = torch.autograd.grad(value, list(leaves.values()))
        return dict(zip(leaves, grads, strict=True)), pytree.tree_map(
            lambda t: t.detach() if isinstance(t, torch.Tensor) else t, aux
        )

    return grad


class CarryingStats:
    """A Trainer that carries one client's BatchNorm running statistics through its local SGD.

    `stats` (engine/model.py ClientStats) is the run's; `buffers` the client's statistics at the
    start of the round (under vmap: batched, one copy per client). Each step's gradient is taken
    by torch.func.grad of a function that receives the statistics as an input, clones them and
    lets BatchNorm's momentum update write the clone during the step's forward (torch.func
    refuses writes to tensors captured from outside the transform); the clone leaves as an
    auxiliary output and becomes the client's statistics after the step, unless the step is a
    masked no-op (a padded step: its batch has weight 0). The gradient is the same as without
    the statistics (training normalises by the batch's own statistics either way). After the
    training, `buffers` holds the client's final statistics. `eager` (the loop back end, whose
    trainer is `eager_train_local`): the gradient comes from torch.autograd on leaf copies
    instead, as there (bit-equal outside vmap, and cheaper: on a BatchNorm CNN torch.func.grad made the
    loop's round markedly slower, docs/benchmarks.md, "Figures behind the engine's choices").
    """

    def __init__(self, stats: Any, buffers: dict[str, torch.Tensor], eager: bool = False) -> None:
        self.stats, self.buffers, self.eager = stats, buffers, eager

    def __call__(self, ctx: ClientContext, request: LocalSGD, opt: OptimConfig) -> LocalResult:
        objective = scaled_objective(local_objective(ctx.loss_fn, request))
        stats = self.stats

        def carried(
            params: Params, batch: Batch, coef: torch.Tensor, buffers: dict[str, torch.Tensor]
        ) -> Any:
            own = {k: v.clone() for k, v in buffers.items()}
            stats.client = own
            try:
                scaled, loss = objective(params, batch, coef)
            finally:
                stats.client = None
            return scaled, (loss, own)

        grad = eager_grad(carried) if self.eager else torch.func.grad(carried, has_aux=True)
        steps = [0]  # steps taken: a momentum=None BatchNorm's factor (real steps come first in every epoch)

        def grad_step(params: Params, batch: Batch, coef: torch.Tensor) -> tuple[Params, torch.Tensor]:
            with stats.cumulative_momenta(steps[0]):
                grads, (loss, own) = grad(params, batch, coef, self.buffers)
            if stats.cumulative:
                own = stats.cumulative_fix(self.buffers, own, steps[0])
            steps[0] += 1
            real = batch.weight.sum() > 0
            self.buffers = {k: torch.where(real, own[k], v) for k, v in self.buffers.items()}
            return grads, loss

        return local_sgd(ctx, request.start, opt, average_epochs=request.average_epochs, grad_step=grad_step)
