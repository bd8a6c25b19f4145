"""A round's cohort as every back end receives it, and the pieces back ends share.

`CohortJob` is one round's local training: the algorithm, the model functions, the broadcast and
the cohort's `CohortInputs` (plan rows, step keys, noise, stacked client states). A back end
returns the cohort's stacked `ClientOut` in cohort order (engine/backends/). Shared here:
one client's function (`client_fn`, which composes declared local training through
engine/local.py), vmapping it, slicing a cohort into groups and merging their results
(`take_clients`, `merge_outs`, `split_cohort`, `balanced_groups`), chunks (`in_chunks`),
padding steps (`pad_steps`), and the new states a streamed round spills to a file (`SpilledStates`;
engine/streaming.py streams a round).
"""

from __future__ import annotations

import copy
import itertools
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from fedcli.algorithms.base import (
    Algorithm,
    Batch,
    ClientContext,
    ClientOut,
    OptimConfig,
)
from fedcli.datasets.federated import CohortPlan
from fedcli.engine.clientstate import state_write_error
from fedcli.engine.local import CarryingStats, Trainer, eager_train_local, run_client
from fedcli.engine.model import ModelFunctions


@dataclass(frozen=True)
class CohortInputs:
    """Everything per client that a back end slices: the plan, keys, noise, states."""

    plan: CohortPlan
    keys: Tensor  # [C, S] int64
    noise: dict[str, Tensor]  # name -> [C, S, ...]
    states: Any  # stacked per-client state pytree, or None
    # each client's BatchNorm running statistics at the start of the round, name -> [C, ...] (train.bn_stats
    # aggregate: the global ones; engine/model.py ClientStats); None: the model has none, or they are estimated
    buffers: dict[str, Tensor] | None = None


@dataclass(frozen=True)
class RoundPlan:
    """What a round's local training needs that depends only on the seed and the round (not on
    the model state): the cohort, its CohortPlan and its step keys (rounds.plan_round)."""

    cohort: np.ndarray  # [C] client ids, largest local data first
    plan: CohortPlan
    keys: Tensor  # [C, S] int64


@dataclass(frozen=True)
class CohortJob:
    """One round's local training: what `CohortBackend.run` receives."""

    alg: Algorithm
    fns: ModelFunctions
    broadcast: Any  # the algorithm's Broadcast pytree (the same for every client)
    inputs: CohortInputs
    hp: Any  # the algorithm's hyperparameter dataclass
    opt: OptimConfig
    round_idx: int
    chunk_size: int | None = None  # --cohort-chunk: at most this many clients at once
    interrupt: Callable[[], None] | None = None  # a safe point between clients and chunks: raises to abandon
    # the round when a stop signal arrived (engine/lifecycle.py, GracefulSignals.check)

    def at_safe_point(self) -> None:
        """Raise here if the run was asked to stop (between clients or chunks of a round)."""
        if self.interrupt is not None:
            self.interrupt()


def make_context(
    fns: ModelFunctions,
    index: Tensor,
    weight: Tensor,
    step_mask: Tensor,
    keys: Tensor,
    num_examples: Tensor,
    noise: dict[str, Tensor],
    num_epochs: int,
    steps_per_epoch: int,
    round_idx: int,
) -> ClientContext:
    """Build one client's ClientContext; batches are gathered lazily by index."""

    augment = getattr(
        fns, "augment", None
    )  # None unless data.augment: no extra work then (any ModelFunctions-like fns)

    def batch(step: int) -> Batch:
        ix = index[step]  # [B]
        x = fns.prepare(fns.data.x[ix])
        if augment is not None:  # per-example crop / flip drawn from the step key (datasets/augment.py)
            x = augment(x, keys[step])
        return Batch(x=x, y=fns.data.y[ix], weight=weight[step], key=keys[step])

    return ClientContext(
        loss_fn=fns.loss_fn,
        apply_fn=fns.apply_fn,
        batch=batch,
        step_mask=step_mask,
        num_examples=num_examples,
        num_epochs=num_epochs,
        steps_per_epoch=steps_per_epoch,
        round_idx=round_idx,
        noise=noise,
    )


ClientFn = Callable[
    ..., tuple[Any, Any, Any]
]  # (index, weight, step_mask, keys, num_examples, noise, state[, buffers])
STATS_PREFIX = "bn_stats/"  # a client's final BatchNorm statistics ride in its metrics under this prefix
# (every back end stacks, slices and gathers metrics already); engine/rounds.py takes them out first


def client_fn(
    alg: Algorithm,
    fns: ModelFunctions,
    broadcast: Any,
    hp: Any,
    opt: OptimConfig,
    num_epochs: int,
    steps_per_epoch: int,
    round_idx: int,
    trainer: Trainer | None = None,
) -> ClientFn:
    """One client's update (run_client: the declared local training with `trainer`, or client_update)
    as a function of its plan slices, returning (upload, state or {}, metrics).

    With `buffers` (the client's BatchNorm statistics at the start of the round, CohortInputs.buffers)
    the local training carries them (engine/local.py CarryingStats) and the metrics return the
    client's final statistics under STATS_PREFIX.
    """

    def one(
        index: Tensor,
        weight: Tensor,
        step_mask: Tensor,
        keys: Tensor,
        num_examples: Tensor,
        noise: dict[str, Tensor],
        state: Any,
        buffers: dict[str, Tensor] | None = None,
    ) -> tuple[Any, Any, Any]:
        ctx = make_context(
            fns, index, weight, step_mask, keys, num_examples, noise, num_epochs, steps_per_epoch, round_idx
        )
        carrier = (
            None
            if buffers is None
            else CarryingStats(fns.client_stats, buffers, trainer is eager_train_local)
        )
        out = run_client(alg, ctx, broadcast, state, hp, opt, trainer if carrier is None else carrier)
        metrics = (
            out.metrics
            if carrier is None
            else {**out.metrics, **{STATS_PREFIX + k: v for k, v in carrier.buffers.items()}}
        )
        return out.upload, ({} if out.state is None else out.state), metrics

    return one


def job_client_fn(job: CohortJob, trainer: Trainer | None = None) -> ClientFn:
    """client_fn for the job's cohort as planned (its padded steps per epoch)."""
    plan = job.inputs.plan
    return client_fn(
        job.alg,
        job.fns,
        job.broadcast,
        job.hp,
        job.opt,
        plan.num_epochs,
        plan.steps_per_epoch,
        job.round_idx,
        trainer,
    )


def vmap_clients(
    one: Callable[..., tuple[Any, Any, Any]], inputs: CohortInputs, *extra: Any, chunk_size: int | None = None
) -> ClientOut:
    """vmap a client function over the cohort's plan, keys, noise, states (and extra batched inputs)."""
    plan, state_dim = inputs.plan, None if inputs.states is None else 0
    if (
        inputs.buffers is not None
    ):  # each client's own BatchNorm statistics (batched: the update is per client)
        extra = (inputs.buffers, *extra)
    batched = torch.func.vmap(
        one, in_dims=(0, 0, 0, 0, 0, 0, state_dim) + (0,) * len(extra), chunk_size=chunk_size
    )
    upload, state, metrics = batched(
        plan.index,
        plan.weight,
        plan.step_mask,
        inputs.keys,
        plan.num_examples,
        inputs.noise,
        inputs.states,
        *extra,
    )
    return ClientOut(upload=upload, state=None if inputs.states is None else state, metrics=metrics)


def in_chunks(job: CohortJob, run: Callable[[CohortJob], ClientOut]) -> ClientOut | None:
    """Run `run` on chunks of chunk_size similar-length clients (longest first) and merge the
    results in cohort order; None when the cohort fits in one chunk."""
    inputs, chunk_size = job.inputs, job.chunk_size
    num_clients = len(inputs.plan.num_examples)
    if chunk_size is None or chunk_size >= num_clients:
        return None
    order = np.argsort(-inputs.plan.steps_per_client, kind="stable")
    groups = [order[start : start + chunk_size] for start in range(0, num_clients, chunk_size)]
    outs = []
    for rows in groups:
        job.at_safe_point()
        outs.append(run(replace(job, inputs=take_clients(inputs, rows), chunk_size=None)))
    return merge_outs(groups, outs)


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
        return trim_steps(take(t), epochs, padded, own, dim=1)

    sliced = CohortPlan(
        index=cut(plan.index),
        weight=cut(plan.weight),
        step_mask=cut(plan.step_mask),
        num_examples=take(plan.num_examples),
        steps_per_client=plan.steps_per_client[rows],
        num_epochs=epochs,
        steps_per_epoch=own,
    )
    states = None if inputs.states is None else pytree.tree_map(take, inputs.states)
    buffers = None if inputs.buffers is None else {k: take(v) for k, v in inputs.buffers.items()}
    return CohortInputs(
        plan=sliced,
        keys=cut(inputs.keys),
        noise={k: cut(v) for k, v in inputs.noise.items()},
        states=states,
        buffers=buffers,
    )


def split_cohort(steps: np.ndarray, parts: int) -> list[np.ndarray]:
    """Split cohort rows into at most `parts` groups balancing (clients x longest steps).

    Rows are sorted by steps (descending) and cut into contiguous groups, so each group's
    clients have similar step counts (little padding). The largest group cost is minimised
    by a binary search on the cost cap with a greedy fill. Returns row indices per group.
    """
    order = np.argsort(-steps, kind="stable")
    sorted_steps = steps[order].astype(np.int64)

    def fill(cap: int) -> list[int]:
        cuts, start = [], 0
        while start < len(order):
            take = max(1, cap // max(int(sorted_steps[start]), 1))
            start = min(len(order), start + take)
            cuts.append(start)
        return cuts

    low, high = int(sorted_steps.max(initial=1)), int(sorted_steps.max(initial=1)) * len(order)
    while low < high:  # smallest cap that needs at most `parts` groups
        mid = (low + high) // 2
        if len(fill(mid)) <= parts:
            high = mid
        else:
            low = mid + 1
    bounds = [0, *fill(low)]
    return [order[a:b] for a, b in itertools.pairwise(bounds) if b > a]


def balanced_groups(steps: np.ndarray, parts: int) -> list[np.ndarray]:
    """Split rows into at most `parts` groups of near-equal total steps (longest first, each to the
    lightest group: the LPT rule, within 4/3 of the best split). Returns sorted row indices per group.

    The cost model of executors that compute no padded step (loop, fused): a group costs the
    sum of its clients' steps, where split_cohort's contiguous groups can leave one process
    20 % more work than the other.
    """
    loads = [0] * parts
    groups: list[list[int]] = [[] for _ in range(parts)]
    for row in np.argsort(-steps, kind="stable"):
        lightest = loads.index(min(loads))
        groups[lightest].append(int(row))
        loads[lightest] += int(steps[row])
    return [np.array(sorted(g), dtype=np.int64) for g in groups if g]


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


def trim_steps(t: Tensor, num_epochs: int, padded: int, own: int, dim: int = 0) -> Tensor:
    """Keep the first `own` of `padded` steps per epoch of the epoch-major step axis `dim` (E * padded
    long): of a [S, ...] tensor (dim 0) or a [C, S, ...] one (dim 1)."""
    if own == padded:
        return t
    return t.unflatten(dim, (num_epochs, padded)).narrow(dim + 1, 0, own).flatten(dim, dim + 1)


def pad_steps(inputs: CohortInputs, multiple: int, max_steps: int | None = None) -> CohortInputs:
    """Round K (steps per epoch) up with masked no-op steps: to `max_steps` (the federation's
    longest client) when that costs at most 1.5 K, else to a multiple of `multiple`.

    Real steps keep their plan rows, keys and noise; the added steps have weight 0 and mask 0.
    Programs built once per shape (--compile, --graph) then serve rounds of different K.
    """
    plan = inputs.plan
    epochs, k = plan.num_epochs, plan.steps_per_epoch
    target = -(-k // multiple) * multiple
    if max_steps is not None and k <= max_steps <= 1.5 * k:
        target = max_steps
    if target == k:
        return inputs

    def pad(t: Tensor) -> Tensor:  # [C, E*K, ...] -> [C, E*K', ...]
        t = t.reshape(t.shape[0], epochs, k, *t.shape[2:])
        extra = torch.zeros(t.shape[0], epochs, target - k, *t.shape[3:], dtype=t.dtype, device=t.device)
        return torch.cat([t, extra], dim=2).reshape(t.shape[0], epochs * target, *t.shape[3:])

    padded = replace(
        plan,
        index=pad(plan.index),
        weight=pad(plan.weight),
        step_mask=pad(plan.step_mask),
        steps_per_epoch=target,
    )
    return CohortInputs(
        plan=padded,
        keys=pad(inputs.keys),
        noise={n: pad(v) for n, v in inputs.noise.items()},
        states=inputs.states,
        buffers=inputs.buffers,
    )


def finite_rows(upload: Any, num_clients: int) -> np.ndarray:
    """[C] bool: True for clients whose every uploaded tensor is finite.

    A row's sum is finite exactly when all its entries are, unless finite entries overflow
    float32 when summed; rows whose sum is not finite are checked entry by entry, so the answer
    is exact. One pass of reductions instead of a [C, N] boolean per leaf, which on the FEMNIST MLP
    cost a sizeable share of a fused round (docs/benchmarks.md, "Figures behind the engine's choices").
    One host sync for the whole upload.
    """
    leaves = [
        leaf.reshape(num_clients, -1)
        for leaf in pytree.tree_leaves(upload)
        if isinstance(leaf, Tensor)
        and leaf.dim() > 0
        and leaf.shape[0] == num_clients
        and leaf.is_floating_point()
    ]
    if not leaves:
        return np.ones(num_clients, dtype=bool)
    sums = torch.stack([leaf.sum(dim=1, dtype=torch.float32) for leaf in leaves])  # [L, C]
    finite = torch.isfinite(sums).cpu()
    for i, j in zip(*torch.nonzero(~finite, as_tuple=True), strict=True):  # NaN/inf, or an overflowing sum
        finite[i, j] = bool(torch.isfinite(leaves[int(i)][int(j)]).all())
    return finite.all(dim=0).numpy()


def take_rows(tree: Any, rows: Tensor) -> Any:
    """The pytree with only `rows` of every tensor's leading (client) axis (and of SpilledStates)."""
    return pytree.tree_map(
        lambda t: (
            t.index_select(0, rows.to(t.device))
            if isinstance(t, Tensor) and t.dim() > 0
            else t.take(rows)
            if isinstance(t, SpilledStates)
            else t
        ),
        tree,
    )


class SpilledStates:
    """A round's new client states, group by group, in an unlinked file (not in RAM) until they are
    stored: ClientOut.state of stream_cohort with a spill folder (the disk state store's).

    `rows(r)` reads cohort rows `r` back as a stacked state pytree (CPU tensors); `take(r)` is
    the states of rows `r` only (take_rows: clients dropped as non-finite).
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self.file = tempfile.TemporaryFile(dir=folder)  # noqa: SIM115  # closed with this object
        except OSError as err:
            raise state_write_error(err, folder) from err
        self.spec: Any = None
        self.meta: list[
            tuple[torch.dtype, tuple[int, ...], int]
        ] = []  # per leaf: dtype, row shape, row bytes
        self.where: dict[int, list[int]] = {}  # cohort row -> file offset of each leaf's row
        self.order: np.ndarray | None = None  # take(): positions into the original rows

    def write(self, rows: np.ndarray, stacked: Any) -> None:
        leaves, self.spec = pytree.tree_flatten(stacked)
        if not self.meta:
            self.meta = [
                (leaf.dtype, tuple(leaf.shape[1:]), leaf[0].numel() * leaf.element_size()) for leaf in leaves
            ]
        offset = self.file.seek(0, os.SEEK_END)
        for j, row in enumerate(rows):
            self.where[int(row)] = [
                offset + sum(m[2] for m in self.meta[:i]) * len(rows) + j * self.meta[i][2]
                for i in range(len(leaves))
            ]
        try:  # a full disk here is one line, exit 2 (the round is lost, the last checkpoint intact)
            for leaf in leaves:
                self.file.write(
                    leaf.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
                )
            self.file.flush()
        except OSError as err:
            raise state_write_error(err, self.folder) from err

    def __len__(self) -> int:
        return len(self.where) if self.order is None else len(self.order)

    def take(self, rows: Tensor | np.ndarray) -> SpilledStates:
        view = copy.copy(self)
        view.order = np.asarray(rows.cpu() if isinstance(rows, Tensor) else rows, dtype=np.int64)
        return view

    def rows(self, rows: np.ndarray) -> Any:
        """Cohort rows `rows` (after any take) as a stacked state pytree."""
        source = [int(self.order[r]) if self.order is not None else int(r) for r in rows]
        fd = self.file.fileno()
        leaves = []
        for i, (dtype, shape, nbytes) in enumerate(self.meta):
            parts = [
                torch.frombuffer(bytearray(os.pread(fd, nbytes, self.where[r][i])), dtype=dtype).reshape(
                    shape
                )
                if nbytes
                else torch.empty(shape, dtype=dtype)
                for r in source
            ]
            leaves.append(torch.stack(parts))
        return pytree.tree_unflatten(leaves, self.spec)
