"""A round's cohort a group of clients at a time, so that its memory is one group's, not the cohort's.

`stream_group` picks how many clients' inputs a round makes at once (the loop: as many as fit
`STREAM_BUDGET`; vmap/fused/graph: `--cohort-chunk`); `stream_cohort` runs the cohort in those
groups, each group's noise and client states made only when it runs, its uploads summed as it ends
where the algorithm declares `upload_sums`, and (disk store) its new states spilled to a file
(`SpilledStates`) rather than held; `scatter_states` stores them after aggregation
(docs/scaling.md, "Client state"; docs/architecture.md, "Back ends").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from fedcli.algorithms.base import ClientOut, UploadSums, tree_nbytes
from fedcli.engine.backends.fused import FusedBackend
from fedcli.engine.backends.graphed import GraphedVmap
from fedcli.engine.backends.loop import LoopBackend
from fedcli.engine.backends.vmap import VmapBackend
from fedcli.engine.clientstate import ClientStateStore
from fedcli.engine.cohort import (
    CohortJob,
    RowIndex,
    SpilledStates,
    finite_rows,
    merge_outs,
    take_clients,
    take_rows,
    trim_steps,
)
from fedcli.engine.setup import Setup

STREAM_BUDGET = (
    64 * 2**20
)  # bytes: the loop makes a round's per-client inputs and outputs this many at a time


def stream_group(
    setup: Setup, store: ClientStateStore, params: dict[str, torch.Tensor], num_clients: int, num_steps: int
) -> int | None:
    """How many clients' noise and states a round makes at once (stream_cohort), or None: the
    whole cohort's, the back end's own path. --cohort-chunk N on the in-process back ends that chunk
    (vmap, fused, graph): N, their own chunks, so results are unchanged; the loop (whose clients run
    one by one, so any grouping gives the same results): N, or else as many clients as fit
    STREAM_BUDGET when the whole cohort's do not (a client's noise, e.g. BayesADMM's IVON draws of
    S steps x the model, twice its state and one model of upload)."""
    chunk, backend = setup.cfg.train.cohort_chunk, setup.backend
    group: int | None
    if isinstance(backend, LoopBackend):
        shapes = setup.alg.noise_shapes(params, setup.hp, num_steps) if setup.alg.noise_shapes else {}
        state = (
            0
            if store.layout is None
            else sum(
                int(np.prod(s)) * d.itemsize
                for s, d in zip(store.layout.shapes, store.layout.dtypes, strict=True)
            )
        )
        per_client = 4 * sum(int(np.prod(s)) for s in shapes.values()) + 2 * state + tree_nbytes(params)
        group = chunk or max(1, STREAM_BUDGET // max(per_client, 1))
    elif isinstance(backend, VmapBackend | FusedBackend | GraphedVmap):
        group = chunk
    else:  # compiled vmap (chunks inside one program), worker processes: the back end's own path
        return None
    return group if group is not None and group < num_clients else None


def stream_cohort(
    job: CohortJob,
    run: Callable[[CohortJob], ClientOut],
    group_size: int,
    noise_of: Callable[[np.ndarray], dict[str, Tensor]],
    states_of: Callable[[np.ndarray], Any],
    spill_dir: Path | None = None,
    reduce: Callable[[Any, Tensor], Any] | None = None,
) -> ClientOut:
    """The cohort's local training in groups of `group_size` similar-length clients (longest first:
    in_chunks' groups), each group's noise and client states made only when it runs.

    `job.inputs` carries the plan and keys (noise {} and states None); `noise_of(rows)` draws the
    noise of cohort rows `rows` at the cohort's padded length and `states_of(rows)` gathers their
    states. Each group's outputs go into one [C, ...] tensor per uploaded leaf and metric (no
    merge copy; the group's own tensors are freed as it ends); with `spill_dir` the new client
    states are written to an unlinked file there (SpilledStates) instead of RAM. Results equal
    in_chunks' (the same groups, inputs and per-group back-end calls), and the loop's
    whatever the groups. Bounds a round's memory to one group's inputs plus the cohort's uploads.

    With `reduce(uploads, weights)` (the algorithm's upload_sums on this round's broadcast; weights the
    group's examples per client, aggregate's) each group's uploads are
    summed as the group ends, its non-finite clients left out (finite_rows, as aggregate does), and
    the upload returned is an UploadSums: O(group) of uploads instead of O(cohort). Sums over groups
    differ from one sum over the cohort by float rounding only (summation order).
    """
    inputs, plan = job.inputs, job.inputs.plan
    num_clients, epochs, padded = len(plan.num_examples), plan.num_epochs, plan.steps_per_epoch
    order = np.argsort(-plan.steps_per_client, kind="stable")
    merged: list[Tensor | None] | None = None
    spec: Any = None
    sums: Any = None
    finite, nbytes = np.ones(num_clients, dtype=bool), 0.0
    states: SpilledStates | list[tuple[np.ndarray, Any]] = (
        [] if spill_dir is None else SpilledStates(spill_dir)
    )
    for start in range(0, num_clients, group_size):
        rows = order[start : start + group_size]
        job.at_safe_point()
        sub = take_clients(inputs, rows)  # plan, keys (and what else rides per client) of the group
        own = sub.plan.steps_per_epoch
        noise = {k: trim_steps(v, epochs, padded, own, dim=1) for k, v in noise_of(rows).items()}
        sub = replace(sub, noise=noise, states=states_of(rows))
        del noise
        out = run(replace(job, inputs=sub, chunk_size=None))
        weights = sub.plan.num_examples  # the group's [G] aggregation weights (aggregate's, per client)
        del sub
        if reduce is not None:
            keep = finite_rows(out.upload, len(rows))
            finite[rows] = keep
            nbytes += float(
                job.alg.upload_nbytes(out.upload) if job.alg.upload_nbytes else tree_nbytes(out.upload)
            )
            if keep.any():
                kept = torch.from_numpy(np.flatnonzero(keep))
                part = (
                    reduce(out.upload, weights)
                    if keep.all()
                    else reduce(take_rows(out.upload, kept), weights[kept.to(weights.device)])
                )
                sums = part if sums is None else pytree.tree_map(torch.add, sums, part)
                del part
            out = out._replace(upload={})
        leaves, spec = pytree.tree_flatten((out.upload, out.metrics))
        if merged is None:
            merged = [
                None
                if leaf is None
                else torch.empty((num_clients, *leaf.shape[1:]), dtype=leaf.dtype, device=leaf.device)
                for leaf in leaves
            ]
        take = RowIndex(rows)
        for into, leaf in zip(merged, leaves, strict=True):
            if into is not None:
                into.index_copy_(0, take.on(into.device), leaf)
        if out.state is not None:
            if isinstance(states, SpilledStates):
                states.write(rows, out.state)
            else:
                states.append((rows, out.state))
        del out, leaves
    assert merged is not None
    upload, metrics = pytree.tree_unflatten(merged, spec)
    if reduce is not None:
        upload = UploadSums(sums=sums, count=int(finite.sum()), finite=finite, nbytes=nbytes)
    if not states:  # a stateless algorithm
        return ClientOut(upload=upload, state=None, metrics=metrics)
    if isinstance(states, SpilledStates):
        return ClientOut(upload=upload, state=states, metrics=metrics)
    state = merge_outs([r for r, _ in states], [s for _, s in states])
    return ClientOut(upload=upload, state=state, metrics=metrics)


def scatter_states(store: Any, cohort: np.ndarray, states: Any, group: int = 8) -> None:
    """store.scatter the cohort's new states; SpilledStates are read back and stored `group` clients at a
    time (the store's cache then never holds more than its budget plus one group)."""
    if not isinstance(states, SpilledStates):
        store.scatter(cohort, states)
        return
    for start in range(0, len(cohort), group):
        rows = np.arange(start, min(start + group, len(cohort)))
        store.scatter(cohort[rows], states.rows(rows))
