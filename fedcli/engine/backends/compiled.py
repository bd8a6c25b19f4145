"""`vmap + compile` (--compile): the vmapped cohort compiled by torch.compile, one graph per key.

Key: cohort (or chunk) size, epochs, padded steps per epoch, chunking, whether client states
exist, and the algorithm's round key (backends.round_key: FedPA's burn-in, BayesADMM's lr
schedule position, FOLA's round). K is padded (cohort.pad_steps) to the federation's longest
client where that is cheap, else up to a multiple of `bucket`, so few graphs are compiled. The
local loop is unrolled, so compiling takes tens of seconds to minutes (docs/benchmarks.md,
"Last full run"); the time is logged and kept in `compile_s`. Inductor's on-disk cache
(TORCHINDUCTOR_CACHE_DIR, by default under the system temp folder) makes later runs of the same
shapes compile faster. Opt-in: it stays slower than `fused` on the MLP even after its
compilation (docs/benchmarks.md, "Back ends: which stay").

Each graph is compiled from its own copy of the cohort function's code object: dynamo keeps its
cache per code object with a limit of 8 entries (torch._dynamo.config.recompile_limit), so
graphs sharing one would make the 9th key (e.g. round 9 of FOLA) fall back to eager for the
rest of the run. `backend` is torch.compile's (tests count graphs with "eager").
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor

from fedcli.algorithms.base import ClientOut
from fedcli.engine.backends import BackendInfo, BackendSetup, InProcess, Workload, round_key
from fedcli.engine.cohort import CohortJob, client_fn, pad_steps

log = logging.getLogger(__name__)


class CompiledVmap(InProcess):
    """The `vmap` back end with each key's cohort function compiled once (see the module doc)."""

    name = "vmap + compile"

    def __init__(self, bucket: int = 4, max_steps: int | None = None, backend: str = "inductor") -> None:
        self.bucket, self.max_steps, self.backend = bucket, max_steps, backend
        self.compiled: dict[tuple[Hashable, ...], Callable[..., Any]] = {}
        self.compile_s = 0.0

    def run(self, job: CohortJob) -> ClientOut:
        inputs = pad_steps(job.inputs, self.bucket, self.max_steps)
        plan, chunk_size = inputs.plan, job.chunk_size
        stateful = inputs.states is not None
        key = (
            len(plan.num_examples),
            plan.num_epochs,
            plan.steps_per_epoch,
            chunk_size or 0,
            int(stateful),
            round_key(job.alg, job.hp, job.round_idx),
        )
        first = key not in self.compiled
        if first:
            alg, fns, hp, opt, round_no = (
                job.alg,
                job.fns,
                job.hp,
                job.opt,
                job.round_idx,
            )  # constants of the graph
            epochs, steps = plan.num_epochs, plan.steps_per_epoch

            def cohort(
                bc: Any,
                index: Tensor,
                weight: Tensor,
                step_mask: Tensor,
                keys: Tensor,
                num_examples: Tensor,
                noise: dict[str, Tensor],
                states: Any,
            ) -> Any:
                one = client_fn(alg, fns, bc, hp, opt, epochs, steps, round_no)
                return torch.func.vmap(
                    one, in_dims=(0, 0, 0, 0, 0, 0, 0 if stateful else None), chunk_size=chunk_size
                )(index, weight, step_mask, keys, num_examples, noise, states)

            self.compiled[key] = torch.compile(own_code(cohort), dynamic=False, backend=self.backend)
        start = time.perf_counter()
        upload, state, metrics = self.compiled[key](
            job.broadcast,
            plan.index,
            plan.weight,
            plan.step_mask,
            inputs.keys,
            plan.num_examples,
            inputs.noise,
            inputs.states,
        )
        if first:
            seconds = time.perf_counter() - start
            self.compile_s += seconds
            log.info(
                "compiled the client update for %d clients x %d steps per epoch in %.1f s",
                key[0],
                key[2],
                seconds,
            )
        return ClientOut(upload=upload, state=state if stateful else None, metrics=metrics)


def own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Return fn with a copy of its code object, so that dynamo's per-code cache (and its
    recompile limit) is this function's alone, not shared with every closure of the same def."""
    copy = types.FunctionType(
        fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )
    copy.__kwdefaults__, copy.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    return copy


def refuses(w: Workload) -> str | None:
    """The vmapped cohort's refusals; BatchNorm (refused for --compile as a whole by engine/select.py)."""
    if not w.alg.supports_vmap:
        return f"{w.alg.name} does not run vmapped, which --compile with --executor vmap needs; use --executor loop."
    return None


def build(setup: BackendSetup) -> CompiledVmap:
    """One compiled graph per key; K padded towards the largest client's batch count."""
    return CompiledVmap(max_steps=-(-int(setup.fed.sizes.max(initial=1)) // setup.cfg.train.batch_size))


INFO = BackendInfo(
    name="vmap + compile",
    summary="the vmapped cohort compiled by torch.compile, one graph per shape "
    "and round key (opt-in: --compile)",
    refuses=refuses,
    prefers=None,
    build=build,
)
