"""Executors: run `Algorithm.client_update` for a cohort, client by client or vmapped.

Both take the same inputs and return the same stacked `ClientOut` (leading client axis C).
`loop` is the reference: each client runs alone, with only its own K_c steps per epoch.
`vmap` runs the cohort as one batched computation with torch.func.vmap over the padded
plan (masked steps are exact no-ops), optionally in chunks of similar-length clients to bound
memory. The two agree to float tolerance on the same seed (tests/engine/test_equivalence.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from fedcli.algorithms.base import Algorithm, Batch, ClientContext, ClientOut, OptimConfig, Params
from fedcli.datasets.federated import CohortPlan, FederatedData
from fedcli.datasets.tasks import Task, per_example_loss


@dataclass(frozen=True)
class ModelFunctions:
    """The stateless model functions a ClientContext exposes."""

    apply_fn: Callable[[Params, Tensor], Tensor]  # eval mode
    loss_fn: Callable[[Params, Batch], Tensor]  # weighted mean loss, dropout keyed by batch.key
    data: FederatedData
    prepare: Callable[[Tensor], Tensor]
    compile_step: bool = False  # --compile with the loop/process executors: compiled per-client steps
    dense: Any = None  # dense.DenseSpec where the `fused` executor can train the model (MLP/linear, cross-entropy)
    interrupt: Callable[[], None] | None = None  # called between clients (loop) and cohort chunks: raises to
    # abandon the round when a stop signal arrived (engine/lifecycle.py, GracefulSignals.check)


def model_functions(task: Task, model: nn.Module, data: FederatedData) -> ModelFunctions:
    """Build apply/loss functions around `model` with torch.func.functional_call."""

    def apply_fn(params: Params, x: Tensor) -> Tensor:
        return torch.func.functional_call(model, params, (x,))

    def loss_fn(params: Params, batch: Batch) -> Tensor:
        output = torch.func.functional_call(model, params, (batch.x,), {"key": batch.key})
        losses = per_example_loss(task, output, batch.x, batch.y)  # [B]
        return (losses * batch.weight).sum() / batch.weight.sum().clamp_min(1.0)

    from fedcli.engine.dense import dense_spec

    dense = dense_spec(model) if task.kind == "classification" and task.example_loss is None else None
    return ModelFunctions(apply_fn=apply_fn, loss_fn=loss_fn, data=data, prepare=task.prepare, dense=dense)


@dataclass(frozen=True)
class CohortInputs:
    """Everything per client that an executor slices: the plan, keys, noise, states."""

    plan: CohortPlan
    keys: Tensor  # [C, S] int64
    noise: dict[str, Tensor]  # name -> [C, S, ...]
    states: Any  # stacked per-client state pytree, or None


def make_context(fns: ModelFunctions, index: Tensor, weight: Tensor, step_mask: Tensor, keys: Tensor,
                 num_examples: Tensor, noise: dict[str, Tensor], num_epochs: int, steps_per_epoch: int,
                 round_idx: int, compile_step: bool = False) -> ClientContext:
    """Build one client's ClientContext; batches are gathered lazily by index."""

    def batch(step: int) -> Batch:
        ix = index[step]  # [B]
        return Batch(x=fns.prepare(fns.data.x[ix]), y=fns.data.y[ix], weight=weight[step], key=keys[step])

    return ClientContext(loss_fn=fns.loss_fn, apply_fn=fns.apply_fn, batch=batch, step_mask=step_mask,
                         num_examples=num_examples, num_epochs=num_epochs, steps_per_epoch=steps_per_epoch,
                         round_idx=round_idx, noise=noise, compile_step=compile_step)


def client_fn(alg: Algorithm, fns: ModelFunctions, broadcast: Any, hp: Any, opt: OptimConfig,
              num_epochs: int, steps_per_epoch: int, round_idx: int,
              compile_step: bool = False, local_request: Any = None) -> Callable[..., tuple[Any, Any, Any]]:
    """One client's update as a function of its plan slices (and, with local_request, the
    `fused` executor's precomputed LocalResult as an eighth argument)."""

    def one(index: Tensor, weight: Tensor, step_mask: Tensor, keys: Tensor, num_examples: Tensor,
            noise: dict[str, Tensor], state: Any, local: Any = None) -> tuple[Any, Any, Any]:
        ctx = make_context(fns, index, weight, step_mask, keys, num_examples, noise, num_epochs,
                           steps_per_epoch, round_idx, compile_step)
        if local_request is not None:
            ctx = ctx._replace(local=local, local_request=local_request)
        out = alg.client_update(ctx, broadcast, state, hp, opt)
        return out.upload, ({} if out.state is None else out.state), out.metrics

    return one


def vmap_clients(one: Callable[..., tuple[Any, Any, Any]], inputs: CohortInputs, *extra: Any) -> ClientOut:
    """vmap a client_fn over the cohort's plan, keys, noise, states (and extra batched inputs)."""
    plan, state_dim = inputs.plan, None if inputs.states is None else 0
    batched = torch.func.vmap(one, in_dims=(0, 0, 0, 0, 0, 0, state_dim) + (0,) * len(extra))
    upload, state, metrics = batched(plan.index, plan.weight, plan.step_mask, inputs.keys,
                                     plan.num_examples, inputs.noise, inputs.states, *extra)
    return ClientOut(upload=upload, state=None if inputs.states is None else state, metrics=metrics)


def in_chunks(run: Callable[..., ClientOut], alg: Algorithm, fns: ModelFunctions, broadcast: Any,
              inputs: CohortInputs, hp: Any, opt: OptimConfig, round_idx: int,
              chunk_size: int | None) -> ClientOut | None:
    """Run `run` on chunks of chunk_size similar-length clients (longest first) and merge the
    results in cohort order; None when the cohort fits in one chunk."""
    num_clients = len(inputs.plan.num_examples)
    if chunk_size is None or chunk_size >= num_clients:
        return None
    order = np.argsort(-inputs.plan.steps_per_client, kind="stable")
    groups = [order[start : start + chunk_size] for start in range(0, num_clients, chunk_size)]
    outs = []
    for rows in groups:
        interrupt_point(fns)
        outs.append(run(alg, fns, broadcast, take_clients(inputs, rows), hp, opt, round_idx))
    return merge_outs(groups, outs)


def interrupt_point(fns: ModelFunctions) -> None:
    """A safe point between clients or chunks of a round: raises if the run was asked to stop."""
    if fns.interrupt is not None:
        fns.interrupt()


def take_clients(inputs: CohortInputs, rows: np.ndarray) -> CohortInputs:
    """Return the CohortInputs of `rows`, trimmed to the slice's longest client per epoch.

    The plan is epoch-major [C, E * K, ...]; keeping the first k <= K steps of every epoch
    keeps each client's real steps, keys and noise exactly (masked steps are no-ops).
    """
    plan = inputs.plan
    epochs, padded = plan.num_epochs, plan.steps_per_epoch
    own = int(plan.steps_per_client[rows].max())
    take = RowIndex(rows)

    def cut(t: Tensor) -> Tensor:  # [C, E*K, ...] -> [c, E*k, ...]
        t = take(t)
        t = t.reshape(len(rows), epochs, padded, *t.shape[2:])[:, :, :own]
        return t.reshape(len(rows), epochs * own, *t.shape[3:])

    sliced = CohortPlan(index=cut(plan.index), weight=cut(plan.weight), step_mask=cut(plan.step_mask),
                        num_examples=take(plan.num_examples),
                        steps_per_client=plan.steps_per_client[rows], num_epochs=epochs, steps_per_epoch=own)
    states = None if inputs.states is None else pytree.tree_map(take, inputs.states)
    return CohortInputs(plan=sliced, keys=cut(inputs.keys), noise={k: cut(v) for k, v in inputs.noise.items()},
                        states=states)


class RowIndex:
    """Cohort rows as an int64 index built on each tensor's own device (once per device):
    index_select and index_copy_ refuse a CPU index for a CUDA tensor. Calling it takes the rows."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = np.asarray(rows, dtype=np.int64)
        self.cache: dict[torch.device, Tensor] = {}

    def on(self, device: torch.device) -> Tensor:
        index = self.cache.get(device)
        if index is None:
            index = self.cache[device] = torch.as_tensor(self.rows, device=device)
        return index

    def __call__(self, t: Tensor) -> Tensor:
        return t.index_select(0, self.on(t.device))


def merge_outs(groups: list[np.ndarray], outs: list[ClientOut]) -> ClientOut:
    """Concatenate per-group ClientOuts and restore the cohort order (on the outputs' device)."""
    take = RowIndex(np.argsort(np.concatenate(groups), kind="stable"))
    return pytree.tree_map(lambda *xs: None if xs[0] is None else take(torch.cat(xs)), *outs)


def run_vmap(alg: Algorithm, fns: ModelFunctions, broadcast: Any, inputs: CohortInputs, hp: Any,
             opt: OptimConfig, round_idx: int, chunk_size: int | None = None) -> ClientOut:
    """Run the whole cohort as one vmapped computation, or in chunks of chunk_size clients.

    Chunks group clients of similar length (sorted by steps per epoch, longest first) and each
    chunk is padded only to its own longest client, so chunking bounds memory and also cuts
    the masked no-op steps a cohort of uneven clients would otherwise compute.
    """
    chunked = in_chunks(run_vmap, alg, fns, broadcast, inputs, hp, opt, round_idx, chunk_size)
    if chunked is not None:
        return chunked
    plan = inputs.plan
    return vmap_clients(client_fn(alg, fns, broadcast, hp, opt, plan.num_epochs, plan.steps_per_epoch, round_idx),
                        inputs)


def run_loop(alg: Algorithm, fns: ModelFunctions, broadcast: Any, inputs: CohortInputs, hp: Any,
             opt: OptimConfig, round_idx: int, chunk_size: int | None = None) -> ClientOut:
    """Run clients one by one, each on its own unpadded plan; stack the results."""
    plan = inputs.plan
    results = []
    for c in range(len(plan.num_examples)):
        interrupt_point(fns)
        own = plan.for_client(c)
        k = own.steps_per_epoch
        one = client_fn(alg, fns, broadcast, hp, opt, plan.num_epochs, k, round_idx, fns.compile_step)
        noise = {name: trim_steps(v[c], plan.num_epochs, plan.steps_per_epoch, k) for name, v in inputs.noise.items()}
        keys = trim_steps(inputs.keys[c], plan.num_epochs, plan.steps_per_epoch, k)
        state = None if inputs.states is None else pytree.tree_map(lambda t, c=c: t[c], inputs.states)
        results.append(one(own.index[0], own.weight[0], own.step_mask[0], keys, own.num_examples[0], noise, state))
    upload, state, metrics = pytree.tree_map(lambda *xs: torch.stack(xs), *results)
    return ClientOut(upload=upload, state=None if inputs.states is None else state, metrics=metrics)


def trim_steps(t: Tensor, num_epochs: int, padded: int, own: int) -> Tensor:
    """Keep the first `own` of `padded` steps per epoch of a [S, ...] tensor."""
    t = t.reshape(num_epochs, padded, *t.shape[1:])[:, :own]
    return t.reshape(num_epochs * own, *t.shape[2:])


def run_fused(alg: Algorithm, fns: ModelFunctions, broadcast: Any, inputs: CohortInputs, hp: Any,
              opt: OptimConfig, round_idx: int, chunk_size: int | None = None) -> ClientOut:
    """The cohort's local SGD of a dense classifier derived by hand (engine/dense.py); else vmap."""
    from fedcli.engine.dense import run_fused as fused

    return fused(alg, fns, broadcast, inputs, hp, opt, round_idx, chunk_size)


EXECUTORS: dict[str, Callable[..., ClientOut]] = {"loop": run_loop, "vmap": run_vmap, "fused": run_fused}
