"""The `fused` executor: local SGD of a whole cohort of dense classifiers, derived by hand.

For the commonest case of the speed workloads (an MLP or a linear classifier trained with
cross-entropy by local SGD: FedAvg and its FedOpt family and FedPA on the task loss, FedProx
with its proximal term, SCAFFOLD with its control-variate correction) the cohort is trained as
stacked tensors with a leading client axis, outside vmap and autograd:

    forward    h_l = act(h_{l-1} W_l^T + b_l)        one bmm (+ bias) per layer for all clients
    loss       L_c = sum_i w_i CE(z_i, y_i) / max(sum_i w_i, 1)     (the task's loss_fn)
    backward   d_L = (softmax(z) - onehot(y)) w / max(sum w, 1)
               d_{l-1} = (d_l W_l) * act'(h_{l-1})    (with W_l before its update)
    update     W_l <- W_l - lr d_l^T h_{l-1}          fused into one in-place baddbmm
               (momentum: u <- m u - lr g; W <- W + u, torch.optim.SGD's heavy ball;
               FedProx adds mu (W - W_start) to g, SCAFFOLD the constant c - c_i)

The gradient-and-update of a layer is a single GEMM that accumulates into the weights, so no
gradient buffer is allocated and the parameters make one pass per step. Clients are sorted by
their number of batches, longest first: at local step k only the clients with more than k
batches are real, and they are a prefix of the sorted cohort, so every step works on views
`W[:n]` of the real clients and no padded (masked) step is computed at all (the engine
plans cohorts longest first, so no rows move). Cohorts larger than a cache-sized block run
block by block (cohort_local_sgd).

The result is `optim.LocalResult` for the cohort (last iterates, IASG epoch means when asked,
mean loss); the algorithm's own `client_update` then runs vmapped over the cohort with it
(ClientContext.local), so everything after local training (deltas, FedPA's DP solve, metrics)
is the algorithm's code. An algorithm opts in with `Algorithm.fused_local`, which states what
its local_sgd call is for a round; `local_sgd` refuses a precomputed result that does not match
the call it answers. tests/engine/test_fused.py checks fused = loop for every opting algorithm.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from fedcli.algorithms.base import Algorithm, ClientOut, LocalRequest, OptimConfig, Params
from fedcli.algorithms.optim import LocalResult
from fedcli.datasets.federated import CohortPlan
from fedcli.engine.executors import (
    CohortInputs,
    ModelFunctions,
    RowIndex,
    client_fn,
    in_chunks,
    run_vmap,
    take_clients,
    vmap_clients,
)


@dataclass(frozen=True)
class DenseSpec:
    """A chain of affine layers with one activation between them, ending in class logits."""

    layers: tuple[tuple[str, str | None], ...]  # (weight name [out, in], bias name [out] or None), input first
    activation: str  # between layers: relu | sigmoid | identity


def dense_spec(model: nn.Module) -> DenseSpec | None:
    """Return the DenseSpec of an MLP, SigmoidMLP or (unsqueezed) Linear model, else None."""
    from fedcli.datasets import models

    if isinstance(model, models.MLP | models.SigmoidMLP):
        names = [f"hidden.{i}" for i in range(len(model.hidden))] + ["out"]
        activation = "relu" if isinstance(model, models.MLP) else "sigmoid"
        return DenseSpec(tuple((f"{n}.weight", f"{n}.bias") for n in names), activation)
    if isinstance(model, models.Linear) and not model.squeeze:
        return DenseSpec((("linear.weight", "linear.bias" if model.linear.bias is not None else None),), "identity")
    return None


def _activate(h: Tensor, activation: str) -> Tensor:
    if activation == "relu":
        return h.relu_()
    if activation == "sigmoid":
        return h.sigmoid_()
    return h


def _backprop_activation(d: Tensor, h: Tensor, activation: str) -> Tensor:
    """d * act'(pre-activation), written with the post-activation output h."""
    if activation == "relu":  # relu's backward (autograd's own kernel): pass where the output is > 0
        return torch.ops.aten.threshold_backward(d, h, 0.0)
    if activation == "sigmoid":
        return d.mul_(h * (1.0 - h))
    return d


def dense_local_sgd(spec: DenseSpec, data_x: Tensor, data_y: Tensor, prepare: Callable[[Tensor], Tensor],
                    start: Params, plan: CohortPlan, opt: OptimConfig, *, average_epochs: bool,
                    prox_mu: float = 0.0, linear: Params | None = None) -> LocalResult:
    """Run E epochs of local SGD(+momentum) for every client of `plan` from `start`; see the module doc.

    With `prox_mu` > 0 the objective is FedProx's loss + mu/2 ||theta - start||^2 (its gradient
    mu (theta - start) joins the update; the reported loss stays the data loss, as in
    fedprox.proximal_objective); `linear` ([C, ...] per client, plan order) is added to every
    gradient (SCAFFOLD's c - c_i, scaffold.corrected_objective). Returns the LocalResult of
    every client stacked on a leading axis in the plan's client order (epoch means only with
    `average_epochs`); rows move only if the plan is not already longest first. Matches
    optim.local_sgd on ctx.loss_fn client by client to float tolerance.
    """
    steps = np.asarray(plan.steps_per_client)
    order = np.argsort(-steps, kind="stable")  # longest first: the real clients of step k are a prefix
    sorted_steps = steps[order]
    in_order = bool(np.all(order == np.arange(len(order))))  # the engine plans cohorts longest first
    rows = RowIndex(order)  # indices on each tensor's own device
    index, weight = (plan.index, plan.weight) if in_order else (rows(plan.index), rows(plan.weight))
    num_clients, num_epochs, padded = len(order), plan.num_epochs, plan.steps_per_epoch
    lr, momentum = opt.client_lr, opt.client_momentum
    features = start[spec.layers[0][0]].shape[1]
    prox = (prox_mu, start) if prox_mu != 0.0 else None
    if linear is not None and not in_order:
        linear = {k: rows(v) for k, v in linear.items()}
    # each client's own copy of the start (copy_ of a broadcast runs on all intra-op threads; repeat does not)
    params = {k: v.new_empty((num_clients, *v.shape)).copy_(v.expand(num_clients, *v.shape)) for k, v in start.items()}
    velocity = {k: torch.zeros_like(v) for k, v in params.items()} if momentum != 0.0 else {}
    loss_sum = torch.zeros(num_clients, dtype=plan.weight.dtype, device=plan.weight.device)
    epoch_means: list[Params] = []
    active = [int((sorted_steps > k).sum()) for k in range(padded)]
    count = torch.as_tensor(sorted_steps, dtype=loss_sum.dtype, device=loss_sum.device).clamp_min(1.0)
    for epoch in range(num_epochs):
        running = {k: torch.zeros_like(v) for k, v in params.items()} if average_epochs else {}
        for k in range(padded):
            n, step = active[k], epoch * padded + k
            ix = index[:n, step].reshape(-1)
            x = prepare(data_x.index_select(0, ix)).reshape(n, -1, features).to(loss_sum.dtype)
            y = data_y.index_select(0, ix).reshape(n, -1)
            loss = _step(spec, params, velocity, x, y, weight[:n, step], n, lr, momentum, prox, linear)
            loss_sum[:n] += loss
            for name, total in running.items():
                total[:n] += params[name][:n]
        if average_epochs:
            epoch_means.append({k: v / count.reshape(-1, *([1] * (v.dim() - 1))) for k, v in running.items()})
    result = LocalResult(params=params, epoch_means=epoch_means, mean_loss=loss_sum / (count * num_epochs))
    if in_order:
        return result
    return pytree.tree_map(RowIndex(np.argsort(order, kind="stable")), result)


def _step(spec: DenseSpec, params: Params, velocity: Params, x: Tensor, y: Tensor, w: Tensor, n: int,
          lr: float, momentum: float, prox: tuple[float, Params] | None = None,
          linear: Params | None = None) -> Tensor:
    """One SGD step of the first n clients in place; returns their minibatch losses [n]."""
    hs = [x]  # inputs of each layer
    for i, (wname, bname) in enumerate(spec.layers):
        z = torch.bmm(hs[-1], params[wname][:n].transpose(1, 2))  # bmm + add_ beats baddbmm's broadcast bias
        if bname is not None:
            z.add_(params[bname][:n].unsqueeze(1))
        hs.append(z if i == len(spec.layers) - 1 else _activate(z, spec.activation))
    logits = hs.pop()  # [n, B, classes]
    target = logits.gather(-1, y.unsqueeze(-1)).squeeze(-1)  # z_y
    top = logits.amax(dim=-1, keepdim=True)
    d = logits.sub_(top).exp_()  # exp(z - max), in place of the logits
    total = d.sum(dim=-1, keepdim=True)
    lse = total.log().add_(top).squeeze(-1)  # [n, B] log-sum-exp
    scale = w / w.sum(dim=1, keepdim=True).clamp_min(1.0)  # [n, B]: the loss is sum_i scale_i CE_i
    loss = ((lse - target) * scale).sum(dim=1)
    d.div_(total)  # softmax
    d.scatter_add_(-1, y.unsqueeze(-1), torch.full_like(target, -1.0).unsqueeze(-1))
    d.mul_(scale.unsqueeze(-1))
    for i in range(len(spec.layers) - 1, -1, -1):
        wname, bname = spec.layers[i]
        h = hs[i]
        d_prev = (_backprop_activation(torch.bmm(d, params[wname][:n]), h, spec.activation) if i > 0 else None)
        _update(params, velocity, wname, n, d.transpose(1, 2), h, lr, momentum, prox, linear)
        if bname is not None:
            _update(params, velocity, bname, n, d, None, lr, momentum, prox, linear)
        if d_prev is not None:
            d = d_prev
    return loss


def _update(params: Params, velocity: Params, name: str, n: int, d: Tensor, h: Tensor | None, lr: float,
            momentum: float, prox: tuple[float, Params] | None = None, linear: Params | None = None) -> None:
    """theta <- theta - lr g (or heavy ball) with g = d h (a weight, [n, out, B] x [n, B, in]) or sum_B d (a
    bias), plus mu (theta - anchor) under FedProx's proximal term (theta before this step) and the
    per-client constant linear_c under SCAFFOLD's correction."""
    heavy_ball = momentum != 0.0
    theta = params[name][:n]
    target = velocity[name][:n] if heavy_ball else theta  # u = -lr v, or theta itself
    if heavy_ball:
        target.mul_(momentum)
    if prox is not None:  # -lr mu (theta - anchor), from the pre-step theta
        mu, anchor = prox
        if heavy_ball:
            target.add_(theta - anchor[name], alpha=-lr * mu)
        else:
            target.mul_(1.0 - lr * mu).add_(anchor[name], alpha=lr * mu)
    if linear is not None:
        target.add_(linear[name][:n], alpha=-lr)
    if h is not None:
        target.baddbmm_(d, h, alpha=-lr)
    else:
        target.add_(d.sum(dim=1), alpha=-lr)
    if heavy_ball:
        theta += target


BLOCK_BYTES = 8 * 2**20  # per block of clients: parameters, velocity and epoch sums that stay in cache


def block_size(params: Params, *, momentum: bool, average_epochs: bool) -> int:
    """Clients per block: as many as keep about BLOCK_BYTES of per-client tensors (at least one).

    Measured on the FEMNIST MLP (838 KB per client), 50 clients, 2 threads: one call over the
    whole cohort 0.080-0.085 s, blocks of 4 / 6 / 8 / 10 / 13 / 17 / 25 clients 0.080 / 0.075 /
    0.070 / 0.066 / 0.067-0.077 / 0.067-0.10 / 0.095-0.12 s (tests/benchmarks, 2026-11-25).
    """
    copies = 1 + int(momentum) + int(average_epochs)
    per_client = copies * sum(v.numel() * v.element_size() for v in params.values())
    return max(1, BLOCK_BYTES // max(per_client, 1))


def cohort_local_sgd(fns: ModelFunctions, request: LocalRequest, inputs: CohortInputs, opt: OptimConfig
                     ) -> LocalResult:
    """dense_local_sgd for the cohort, in blocks of similar-length clients that fit in cache.

    Each block runs all its local steps before the next starts, so its weights are read by
    the forward pass and updated by the backward pass while still in cache; a whole cohort of
    MLPs (42 MB for 50 FEMNIST clients) would stream from memory three times per step. Rows
    are written straight to their cohort slots.
    """
    plan = inputs.plan

    def train(sub: CohortPlan, linear: Params | None) -> LocalResult:
        return dense_local_sgd(fns.dense, fns.data.x, fns.data.y, fns.prepare, request.params, sub, opt,
                               average_epochs=request.average_epochs, prox_mu=request.prox_mu, linear=linear)

    size, num_clients = block_size(request.params, momentum=opt.client_momentum != 0.0,
                                   average_epochs=request.average_epochs), len(plan.num_examples)
    if num_clients <= size:
        return train(plan, request.linear)
    order = np.argsort(-plan.steps_per_client, kind="stable")  # each block is longest first: no rows move in it
    out: Any = None
    for first in range(0, num_clients, size):
        rows = order[first : first + size]
        take = RowIndex(rows)  # indices on each tensor's own device
        linear = None if request.linear is None else {k: take(v) for k, v in request.linear.items()}
        part = train(take_clients(inputs, rows).plan, linear)
        if out is None:
            out = pytree.tree_map(lambda t: t.new_empty((num_clients, *t.shape[1:])), part)
        pytree.tree_map(lambda dst, src, take=take: dst.index_copy_(0, take.on(dst.device), src), out, part)
    return out


def run_fused(alg: Algorithm, fns: ModelFunctions, broadcast: Any, inputs: CohortInputs, hp: Any,
              opt: OptimConfig, round_idx: int, chunk_size: int | None = None) -> ClientOut:
    """Train the cohort with dense_local_sgd, then vmap the algorithm's client_update over it.

    Falls back to run_vmap for a round the algorithm does not fuse (fused_local absent or None)
    or a model without a DenseSpec.
    """
    if fns.dense is None or alg.fused_local is None:
        return run_vmap(alg, fns, broadcast, inputs, hp, opt, round_idx, chunk_size)
    chunked = in_chunks(run_fused, alg, fns, broadcast, inputs, hp, opt, round_idx, chunk_size)
    if chunked is not None:
        return chunked
    request = alg.fused_local(broadcast, inputs.states, hp, round_idx)  # once per chunk, for its clients
    if request is None:
        return run_vmap(alg, fns, broadcast, inputs, hp, opt, round_idx)
    plan = inputs.plan
    one = client_fn(alg, fns, broadcast, hp, opt, plan.num_epochs, plan.steps_per_epoch, round_idx,
                    local_request=request)
    return vmap_clients(one, inputs, cohort_local_sgd(fns, request, inputs, opt))
