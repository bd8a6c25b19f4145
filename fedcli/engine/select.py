"""Choosing the back end: the request checked against the workload, and `auto`'s pick, with why.

The registry `BACKENDS` lists every back end (engine/backends/, one module each). A requested
executor is checked by its `refuses` (one line with the fix, a ConfigError, before anything is
written); `--compile` and `--graph` pick the compiled or graphed form of `vmap` (and `--compile`
the compiled per-client step of loop, process and distributed). `auto` takes the first
in-process back end, in IN_PROCESS order (fused, loop, vmap), that does not refuse the workload
and whose rule `prefers` it; on a CPU with two or more cores for the cohort, a convolutional
model the loop took runs on `process` (loop inside each worker: `_spreads`). The other back ends
(distributed, vmap + compile, vmap + graph, process elsewhere) are opt-in. The choice and its reason are logged and recorded
(`train.executor` in the resolved config, tags fedcli.executor and fedcli.executor_reason).
Which back ends `auto` may choose is in docs/architecture.md §3, "Which back ends stay"; the figures
behind each decision in docs/benchmarks.md, "Back ends: which stay, and auto's CPU rules".
"""

from __future__ import annotations

import logging
from dataclasses import replace
from types import MappingProxyType
from typing import NamedTuple

from fedcli.datasets.yours.model import vmap_obstacle
from fedcli.engine.backends import (
    BackendInfo,
    BackendSetup,
    CohortBackend,
    Workload,
    compiled,
    distributed,
    graphed,
    process,
)
from fedcli.engine.backends.inprocess import IN_PROCESS
from fedcli.engine.footprint import vmap_too_big
from fedcli.errors import ConfigError

log = logging.getLogger(__name__)

BACKENDS: MappingProxyType[str, BackendInfo] = MappingProxyType(
    {
        **IN_PROCESS,
        **{info.name: info for info in (process.INFO, distributed.INFO, compiled.INFO, graphed.INFO)},
    }
)


class Choice(NamedTuple):
    """The back end chosen for a run."""

    backend: str  # a key of BACKENDS
    executor: str  # what train.executor records: the back end's --executor value
    inner: str | None  # process, distributed: the in-process back end of each worker or rank
    why: str  # one line, logged and tagged (fedcli.executor_reason)


def in_process(w: Workload) -> tuple[str, str]:
    """auto's in-process back end for the workload and why: the first of IN_PROCESS that takes it.

    A model whose training step vmap cannot run (your own model: the model check ran one vmapped
    step of a cohort on a real batch when it was built, datasets/yours/model.py) runs on the loop,
    with the reason found, before anything is written. Where vmap would be chosen on a CPU but the
    cohort's estimated step (w.client_bytes x the cohort, engine/footprint.py) exceeds
    VMAP_CPU_BUDGET, the loop runs it, one client at a time, and the reason says so."""
    obstacle = vmap_obstacle(w.model)
    if obstacle is not None and IN_PROCESS["fused"].refuses(w) is not None:
        return "loop", f"the model cannot run under vmap: {obstacle}"
    for name, info in IN_PROCESS.items():
        why = None if info.refuses(w) is not None or info.prefers is None else info.prefers(w)
        if why is not None:
            too_big = vmap_too_big(w.client_bytes, w.clients_per_round, w.device) if name == "vmap" else None
            return ("loop", too_big) if too_big is not None else (name, why)
    raise AssertionError(
        "vmap or loop takes every workload"
    )  # loop refuses nothing, vmap prefers every other


def choose(w: Workload, requested: str, *, launched: bool = False) -> Choice:
    """Check `requested` (train.executor) and the flags against the workload, or pick for `auto`.

    `launched`: this process joined a torchrun group (--executor distributed under torchrun).

    Raises:
        ConfigError: a combination that cannot run, with the fix.
    """
    if w.has_batchnorm and w.compile:
        raise ConfigError(
            "--compile does not handle BatchNorm layers (their running statistics are mutable "
            "state); use GroupNorm in the model, or drop --compile."
        )
    obstacle = vmap_obstacle(w.model)
    if obstacle is not None and (w.graph or requested == "vmap"):
        flag = "--graph" if w.graph else "--executor vmap"
        raise ConfigError(
            f"{flag} cannot run this model: {obstacle}. Use --executor loop (or auto), or fix the "
            "model's forward (no .item() or branch on a tensor's value, no packed sequences, no random "
            'op other than dropout; docs/bring-your-own.md, "Stock layers").'
        )
    if w.graph:
        return _graph(w, requested)
    if requested != "auto":
        refusal = BACKENDS[requested].refuses(w)
        if refusal is not None:
            raise ConfigError(refusal)
    if requested in ("process", "distributed"):
        inner = "loop" if w.compile else in_process(w)[0]  # --compile: each client's step compiled
        if requested == "distributed" and not launched:  # `evaluate` / `report` rebuild a distributed run
            return Choice(inner, inner, None, "a distributed run rebuilt in one process (no process group)")
        return Choice(requested, requested, inner, f"requested ({inner} inside each process)")
    if requested == "vmap" and w.compile:
        return Choice(compiled.INFO.name, "vmap", None, "requested, compiled")
    if requested != "auto":
        return Choice(requested, requested, None, "requested")
    if w.compile and compiled.INFO.refuses(w) is None and obstacle is None:
        return Choice(
            compiled.INFO.name, "vmap", None, "--compile: the cohort vmapped and compiled in the main process"
        )
    name, why = in_process(w)
    if w.device.type != "cpu":
        why = f"{w.device.type}: the whole cohort on one device ({why})"
    elif name == "loop" and _spreads(w, obstacle):
        return Choice(
            process.INFO.name,
            process.INFO.name,
            "loop",
            f"{why}; one single-threaded process per core ({w.slots}) trains the clients side by side",
        )
    elif name == "loop" and w.slots >= 2 and w.has_conv and (script := process.unguarded_main_script()):
        why = (
            f'{why}; in one process, not one per core: {script} has no `if __name__ == "__main__":` guard, '
            "which worker processes need (they re-run the script)"
        )
    return Choice(name, name, None, why)


def _spreads(w: Workload, obstacle: str | None) -> bool:
    """auto's one use of the process back end: the loop chosen for convolutions on a CPU with two or
    more cores for the cohort (train.workers or the usable cores, at most the cohort), where one
    single-threaded process per core beat the loop with intra-op threads, and the plain PyTorch loop,
    on the CNN round of `make bench` on 2 cores (docs/benchmarks.md, "Back ends: which stay").
    BatchNorm too (each worker trains its clients on batch statistics, as the loop does). Never for an
    algorithm without vmap or a model vmap cannot run: the loop chose itself for those, and they stay
    in one process."""
    return (
        w.slots >= 2
        and w.has_conv
        and w.alg.supports_vmap
        and obstacle is None
        and process.INFO.refuses(w) is None
    )


def _graph(w: Workload, requested: str) -> Choice:
    """--graph: the vmapped cohort as one program, where it can run."""
    if w.compile:
        raise ConfigError(
            "--graph and --compile are two ways to build the round's program; choose one of them."
        )
    if requested not in ("auto", "vmap"):
        raise ConfigError(
            f"--graph replays the vmapped cohort update; it does not apply to --executor {requested}. "
            "Use --executor vmap (or auto) with --graph, or drop --graph."
        )
    refusal = graphed.INFO.refuses(w)
    if refusal is not None:
        raise ConfigError(refusal)
    why = (
        "requested"
        if requested == "vmap"
        else (
            "--graph: the cohort vmapped, built once per shape and replayed as "
            + ("one CUDA graph" if w.device.type == "cuda" else "a traced ATen graph")
        )
    )
    return Choice(graphed.INFO.name, "vmap", None, why)


def build(choice: Choice, setup: BackendSetup) -> CohortBackend:
    """Build the chosen back end (with its in-process back end named) and log the choice."""
    backend = BACKENDS[choice.backend].build(replace(setup, inner=choice.inner))
    log.debug("back end: %s (%s)", backend.name, choice.why)
    return backend
