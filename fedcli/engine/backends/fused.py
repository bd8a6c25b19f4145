"""`fused`: the declared local SGD of a whole cohort of dense classifiers, derived by hand.

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
               LocalSGD.prox_mu adds mu (W - W_start) to g, LocalSGD.linear a per-client constant)

The gradient-and-update of a layer is a single GEMM that accumulates into the weights, so no
gradient buffer is allocated and the parameters make one pass per step. Clients are sorted by
their number of batches, longest first: at local step k only the clients with more than k
batches are real, and they are a prefix of the sorted cohort, so every step works on views
`W[:n]` of the real clients and no padded (masked) step is computed at all (the engine
plans cohorts longest first, so no rows move). Cohorts larger than a cache-sized block run
block by block (cohort_local_sgd).

It trains what the algorithm declares (`Algorithm.local`, engine/local.py): the cohort's
`LocalSGD` requests are taken in one vmapped call (`cohort_request`), the cohort is trained
here, and the algorithm's `finish` runs vmapped over the results, so everything after local
training (deltas, FedPA's DP solve, control variates, metrics) is the algorithm's own code.
tests/engine/test_fused.py checks fused = loop for every algorithm that declares its local SGD.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from fedcli.algorithms.base import ClientOut, LocalSGD, OptimConfig, Params
from fedcli.algorithms.optim import LocalResult
from fedcli.datasets.federated import CohortPlan
from fedcli.engine.backends import BackendInfo, BackendSetup, InProcess, Workload
from fedcli.engine.cohort import (
    CohortInputs,
    CohortJob,
    RowIndex,
    in_chunks,
    make_context,
    take_clients,
    vmap_clients,
)
from fedcli.engine.model import ModelFunctions


@dataclass(frozen=True)
class DenseSpec:
    """A chain of affine layers with one activation between them, ending in class logits."""

    layers: tuple[
        tuple[str, str | None], ...
    ]  # (weight name [out, in], bias name [out] or None), input first
    activation: str  # between layers: relu | sigmoid | identity


def dense_spec(model: nn.Module) -> DenseSpec | None:
    """Return the DenseSpec of an MLP, SigmoidMLP or (unsqueezed) Linear model, else None."""
    from fedcli.datasets import models

    if isinstance(model, models.MLP):  # SigmoidMLP too
        names = [f"hidden.{i}" for i in range(len(model.hidden))] + ["out"]
        return DenseSpec(tuple((f"{n}.weight", f"{n}.bias") for n in names), model.activation)
    if isinstance(model, models.Linear) and not model.squeeze:
        return DenseSpec(
            (("linear.weight", "linear.bias" if model.linear.bias is not None else None),), "identity"
        )
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


def dense_local_sgd(
    spec: DenseSpec,
    data_x: Tensor,
    data_y: Tensor,
    prepare: Callable[[Tensor], Tensor],
    start: Params,
    plan: CohortPlan,
    opt: OptimConfig,
    *,
    average_epochs: bool,
    prox_mu: float = 0.0,
    linear: Params | None = None,
) -> LocalResult:
    """Run E epochs of local SGD(+momentum) for every client of `plan` from `start`; see the module doc.

    `start` holds each client's starting point ([C, ...] in plan order; an expanded view when
    the cohort shares it). With `prox_mu` > 0 the objective is FedProx's loss
    + mu/2 ||theta - start||^2 (its gradient mu (theta - start) joins the update; the reported
    loss stays the data loss, as optim.local_objective's); `linear` ([C, ...] per client, plan
    order) is added to every gradient (SCAFFOLD's c - c_i). Returns the LocalResult of every
    client stacked on a leading axis in the plan's client order (epoch means only with
    `average_epochs`); rows move only if the plan is not already longest first. Matches
    optim.train_local on ctx.loss_fn client by client to float tolerance.
    """
    steps = np.asarray(plan.steps_per_client)
    order = np.argsort(-steps, kind="stable")  # longest first: the real clients of step k are a prefix
    sorted_steps = steps[order]
    in_order = bool(np.all(order == np.arange(len(order))))  # the engine plans cohorts longest first
    rows = RowIndex(order)  # indices on each tensor's own device
    index, weight = (plan.index, plan.weight) if in_order else (rows(plan.index), rows(plan.weight))
    num_clients, num_epochs, padded = len(order), plan.num_epochs, plan.steps_per_epoch
    lr, momentum = opt.client_lr, opt.client_momentum
    features = start[spec.layers[0][0]].shape[2]
    if not in_order:
        start = {k: rows(v) for k, v in start.items()}
        linear = None if linear is None else {k: rows(v) for k, v in linear.items()}
    prox = (prox_mu, start) if prox_mu != 0.0 else None
    # each client's own copy of the start (copy_ of a broadcast runs on all intra-op threads; repeat does not)
    params = {k: v.new_empty(v.shape).copy_(v) for k, v in start.items()}
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


def _step(
    spec: DenseSpec,
    params: Params,
    velocity: Params,
    x: Tensor,
    y: Tensor,
    w: Tensor,
    n: int,
    lr: float,
    momentum: float,
    prox: tuple[float, Params] | None = None,
    linear: Params | None = None,
) -> Tensor:
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
        d_prev = _backprop_activation(torch.bmm(d, params[wname][:n]), h, spec.activation) if i > 0 else None
        _update(params, velocity, wname, n, d.transpose(1, 2), h, lr, momentum, prox, linear)
        if bname is not None:
            _update(params, velocity, bname, n, d, None, lr, momentum, prox, linear)
        if d_prev is not None:
            d = d_prev
    return loss


def _update(
    params: Params,
    velocity: Params,
    name: str,
    n: int,
    d: Tensor,
    h: Tensor | None,
    lr: float,
    momentum: float,
    prox: tuple[float, Params] | None = None,
    linear: Params | None = None,
) -> None:
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
            target.add_(theta - anchor[name][:n], alpha=-lr * mu)
        else:
            target.mul_(1.0 - lr * mu).add_(anchor[name][:n], alpha=lr * mu)
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

    On the FEMNIST MLP blocks of about this size were the fastest, against one call over the whole
    cohort and against larger blocks (docs/benchmarks.md, "Figures behind the engine's choices").
    """
    copies = 1 + int(momentum) + int(average_epochs)
    per_client = copies * sum(v.numel() * v.element_size() for v in params.values())
    return max(1, BLOCK_BYTES // max(per_client, 1))


def cohort_local_sgd(
    spec: DenseSpec, fns: ModelFunctions, request: LocalSGD, inputs: CohortInputs, opt: OptimConfig
) -> LocalResult:
    """dense_local_sgd for the cohort's request (start and linear [C, ...]), in blocks of similar-length
    clients that fit in cache.

    Each block runs all its local steps before the next starts, so its weights are read by
    the forward pass and updated by the backward pass while still in cache; a whole cohort of
    MLPs (42 MB for 50 FEMNIST clients) would stream from memory three times per step. Rows
    are written straight to their cohort slots.
    """
    plan = inputs.plan

    def train(sub: CohortPlan, start: Params, linear: Params | None) -> LocalResult:
        return dense_local_sgd(
            spec,
            fns.data.x,
            fns.data.y,
            fns.prepare,
            start,
            sub,
            opt,
            average_epochs=request.average_epochs,
            prox_mu=request.prox_mu,
            linear=linear,
        )

    one = {k: v[0] for k, v in request.start.items()}
    size, num_clients = (
        block_size(one, momentum=opt.client_momentum != 0.0, average_epochs=request.average_epochs),
        len(plan.num_examples),
    )
    if num_clients <= size:
        return train(plan, request.start, request.linear)
    order = np.argsort(
        -plan.steps_per_client, kind="stable"
    )  # each block is longest first: no rows move in it
    out: Any = None
    for first in range(0, num_clients, size):
        rows = order[first : first + size]
        take = RowIndex(rows)  # indices on each tensor's own device
        linear = None if request.linear is None else {k: take(v) for k, v in request.linear.items()}
        part = train(take_clients(inputs, rows).plan, {k: take(v) for k, v in request.start.items()}, linear)
        if out is None:
            out = pytree.tree_map(lambda t: t.new_empty((num_clients, *t.shape[1:])), part)
        pytree.tree_map(lambda dst, src, take=take: dst.index_copy_(0, take.on(dst.device), src), out, part)
    return out


def cohort_request(job: CohortJob) -> LocalSGD:
    """The cohort's LocalSGD requests as one: `start` and `linear` stacked [C, ...] (an expanded view
    where every client's is the same), the static fields (prox_mu, average_epochs) taken once."""
    local = job.alg.local
    assert local is not None, "the fused back end refuses algorithms without Algorithm.local"
    inputs, plan = job.inputs, job.inputs.plan
    seen: list[LocalSGD] = []

    def one(
        index: Tensor,
        weight: Tensor,
        step_mask: Tensor,
        keys: Tensor,
        num_examples: Tensor,
        noise: dict[str, Tensor],
        state: Any,
    ) -> tuple[Params, Params]:
        ctx = make_context(
            job.fns,
            index,
            weight,
            step_mask,
            keys,
            num_examples,
            noise,
            plan.num_epochs,
            plan.steps_per_epoch,
            job.round_idx,
        )
        request = local.request(ctx, job.broadcast, state, job.hp, job.opt)
        seen.append(request)
        return request.start, ({} if request.linear is None else request.linear)

    start, linear = torch.func.vmap(one, in_dims=(0, 0, 0, 0, 0, 0, None if inputs.states is None else 0))(
        plan.index, plan.weight, plan.step_mask, inputs.keys, plan.num_examples, inputs.noise, inputs.states
    )
    static = seen[0]
    return LocalSGD(
        start=start,
        prox_mu=static.prox_mu,
        linear=None if static.linear is None else linear,
        average_epochs=static.average_epochs,
    )


class FusedBackend(InProcess):
    """request (vmapped) -> cohort_local_sgd -> finish (vmapped over the results)."""

    name = "fused"

    def __init__(self, spec: DenseSpec) -> None:
        self.spec = spec

    def run(self, job: CohortJob) -> ClientOut:
        chunked = in_chunks(job, self.run)
        if chunked is not None:
            return chunked
        local = job.alg.local
        assert local is not None, "the fused back end refuses algorithms without Algorithm.local"
        plan = job.inputs.plan
        result = cohort_local_sgd(self.spec, job.fns, cohort_request(job), job.inputs, job.opt)

        def one(
            index: Tensor,
            weight: Tensor,
            step_mask: Tensor,
            keys: Tensor,
            num_examples: Tensor,
            noise: dict[str, Tensor],
            state: Any,
            trained: LocalResult,
        ) -> tuple[Any, Any, Any]:
            ctx = make_context(
                job.fns,
                index,
                weight,
                step_mask,
                keys,
                num_examples,
                noise,
                plan.num_epochs,
                plan.steps_per_epoch,
                job.round_idx,
            )
            out = local.finish(ctx, job.broadcast, state, job.hp, job.opt, trained)
            return out.upload, ({} if out.state is None else out.state), out.metrics

        return vmap_clients(one, job.inputs, result)


FUSED_MODELS = "dense classifiers (mlp, logreg, linear) in fp32"
CUDA_FUSED_MAX_CLIENTS = 32  # on CUDA, fused up to this cohort size, vmap above (see `prefers`)


def refuses(w: Workload) -> str | None:
    """What the dense trainer cannot train: custom local loops, other models, losses, bf16."""
    if not w.alg.supports_vmap:
        return f"{w.alg.name} does not support --executor fused; use --executor loop or auto."
    if w.augment:
        return (
            "--executor fused gathers its own batches and does not augment them; drop data.augment or use "
            "--executor auto (or vmap, loop)."
        )
    if w.alg.local is None:
        why = f"{w.alg.name} trains its own local objective (no Algorithm.local)"
    elif (
        w.has_batchnorm
        or w.task.kind != "classification"
        or w.task.example_loss is not None  # not cross-entropy, the task's own loss
        or dense_spec(w.model) is None
        or w.precision == "bf16"
    ):
        why = "this model/task is not a dense classifier with cross-entropy (or --precision is bf16)"
    else:
        return None
    return (
        f"--executor fused trains {FUSED_MODELS} for algorithms that declare their local SGD; {why}. "
        "Use --executor auto (or vmap)."
    )


def prefers(w: Workload) -> str | None:
    """auto: wherever it applies on a CPU (faster than vmap on the MLP workloads of make bench,
    docs/benchmarks.md, "Last full run"); on CUDA up to CUDA_FUSED_MAX_CLIENTS clients.

    On an H100 (FEMNIST MLP) fused's round time grows almost in proportion to the cohort (its
    CPU-cache-sized blocks of clients, BLOCK_BYTES, run one after another) and vmap's hardly
    grows, so vmap wins above about 33 clients (docs/benchmarks.md, "Figures behind the engine's choices").
    """
    if w.device.type == "cuda" and w.clients_per_round > CUDA_FUSED_MAX_CLIENTS:
        return None
    where = "on the GPU" if w.device.type != "cpu" else "(all cores as threads)"
    return (
        "dense classifier: the cohort's local SGD in stacked GEMMs, each layer's gradient fused into its update, "
        f"no padded steps {where}"
    )


def build(setup: BackendSetup) -> FusedBackend:
    """The back end for the run's model (refuses() let only dense classifiers through)."""
    spec = dense_spec(setup.model)
    assert spec is not None, "refused before: the model is not a dense classifier"
    return FusedBackend(spec)


INFO = BackendInfo(
    name="fused",
    summary="dense classifiers: the cohort's declared local SGD as hand-derived stacked "
    "GEMMs, no padded steps, then the algorithm's finish vmapped",
    refuses=refuses,
    prefers=prefers,
    build=build,
)
