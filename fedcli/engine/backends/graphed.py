"""`vmap + graph` (--graph): the cohort's local training as one program, built once per shape and replayed.

Eager PyTorch pays Python and dispatcher time on every op of every local step. On an H100 a
vmapped CNN round spent several times longer dispatching its kernels from the CPU than the GPU
spent running them, so the GPU idled most of each round (docs/architecture.md §3, "One program
per round"; docs/benchmarks.md, "Figures behind the engine's choices").
This back end takes the dispatch out of the hot path without changing the algorithm contract
(algorithms stay pure per-client functions):

The cohort function is the one the `vmap` back end runs (`client_fn` vmapped over the cohort,
every local step unrolled: forward, backward, update, keyed dropout, step masks) as a function
of the round's flat input tensors (broadcast, plan rows, step keys, noise, client states).

1. **Capture (CUDA).** That function runs eagerly twice on a side stream (warm-up: cuBLAS and
   cuDNN handles, workspaces and algorithm choice happen outside the capture), then once more
   inside `torch.cuda.graph`, over static copies of its inputs: the CUDA graph records every
   kernel of every local step. A round then costs a few copies into the static buffers, one
   `replay()` and a copy of the outputs; Python, torch.func's transforms and the algorithm's
   own code no longer run. Building costs three eager rounds. What a graph cannot hold fails
   the capture instead of being frozen into it: a host sync (`.item()`, a copy to or from
   the host), and inputs on more than one device.
2. **Trace (CPU).** Without a capture, the per-op Python is saved by tracing the function once
   with make_fx (fake inputs, so nothing is computed while tracing) into a flat graph of ATen
   ops, then calling that graph each round. Python branching on tensor values cannot be traced;
   `.item()` becomes an op of the graph, evaluated on each call's inputs. Tracing grows with the
   round's op count (seconds for a multi-epoch round; docs/benchmarks.md, "Figures behind the
   engine's choices"), which is why CUDA captures the eager function instead of a trace.

A program is built per key: cohort (or chunk) size, epochs, padded steps per epoch (K is padded
by `pad_steps`, as `--compile` does, so FEMNIST's uneven writers need a handful of programs),
the tensors' shapes, dtypes and devices, every non-tensor value of the inputs, and the
algorithm's declared round key (backends.round_key: FedPA builds two programs, burn-in and
sampling). A round key that changes every round (FOLA's, which depends on the round itself:
backends.keyed_every_round) would need a program per round, which never pays: such rounds run
eagerly, vmapped, with one warning.

Fallbacks keep a run going and say so once: a key that cannot be traced or captured runs the
eager `vmap` computation. The results equal the `vmap` back end's to float tolerance
(tests/engine/test_graphed.py; the CUDA tests there run the captured graphs where a GPU is).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from fedcli.algorithms.base import ClientOut
from fedcli.engine.backends import (
    BackendInfo,
    BackendSetup,
    InProcess,
    Workload,
    keyed_every_round,
    round_key,
)
from fedcli.engine.cohort import CohortJob, client_fn, in_chunks, job_client_fn, pad_steps, vmap_clients

log = logging.getLogger(__name__)

WARMUP_RUNS = 2  # before a capture: cuBLAS/cuDNN handles, workspaces and algorithm choice happen outside it


class Untraceable(Exception):
    """The cohort function cannot become one static program (the reason is the message)."""


@dataclass
class Program:
    """One cohort function over the round's flat input tensors (a traced GraphModule, or the eager
    function itself) and, on CUDA, its captured graph with static input/output buffers.

    `spec` and `static` say where the function's outputs go: their pytree, and the non-tensor
    outputs (None, Python numbers) that are constants of the program (under tracing and capture
    they cannot depend on tensor values), kept beside it instead of returned by it. Filled by the
    function's first call."""

    module: Callable[..., list[Tensor]]
    spec: pytree.TreeSpec | None = None
    static: list[tuple[int, Any]] = field(default_factory=list)
    graph: Any = None  # torch.cuda.CUDAGraph
    static_in: list[Tensor] | None = None
    static_out: list[Tensor] | None = None

    def __call__(self, tensors: list[Tensor]) -> Any:
        if self.graph is None:
            outs = list(self.module(*tensors))
        else:
            assert self.static_in is not None and self.static_out is not None
            for buffer, t in zip(self.static_in, tensors, strict=True):
                buffer.copy_(t, non_blocking=True)
            self.graph.replay()
            # the next replay overwrites static_out (and an output may be a static input passed through)
            outs = [t.clone() for t in self.static_out]
        for position, value in self.static:
            outs.insert(position, value)
        assert self.spec is not None, "filled by the trace, the warm-up or the call above"
        return pytree.tree_unflatten(outs, self.spec)


class GraphedVmap(InProcess):
    """The `vmap` back end with each key's cohort function traced once and (CUDA) captured, then
    replayed (`--graph`); see the module docstring. `programs` maps keys to Programs (None for a
    key that runs eagerly); `build_s` is the time spent tracing and capturing."""

    name = "vmap + graph"

    def __init__(
        self,
        device: torch.device,
        bucket: int = 4,
        max_steps: int | None = None,
        capture: bool | None = None,
        trace: bool | None = None,
    ) -> None:
        self.device, self.bucket, self.max_steps = device, bucket, max_steps
        self.capture = device.type == "cuda" if capture is None else capture
        # a capture records the eager function's kernels directly (one eager run, not a trace of
        # thousands of ops); without one, the traced program is what saves the per-op Python
        self.trace = not self.capture if trace is None else trace
        self.programs: dict[Hashable, Program | None] = {}
        self.build_s = 0.0
        self.warned: set[str] = set()

    def run(self, job: CohortJob) -> ClientOut:
        chunked = in_chunks(job, self.run)
        if chunked is not None:
            return chunked
        alg = job.alg
        if keyed_every_round(alg, job.hp, job.round_idx):
            self._warn_once(
                f"{alg.name}'s round_key changes every round, so each round would need its own "
                "program; --graph runs those rounds eagerly (vmap) instead"
            )
            return vmap_clients(job_client_fn(job), job.inputs)
        inputs = pad_steps(job.inputs, self.bucket, self.max_steps)
        plan = inputs.plan
        stateful = inputs.states is not None
        args = (
            job.broadcast,
            plan.index,
            plan.weight,
            plan.step_mask,
            inputs.keys,
            plan.num_examples,
            inputs.noise,
            inputs.states,
        )
        leaves, spec = pytree.tree_flatten(args)
        slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
        tensors = [leaves[i] for i in slots]
        statics = tuple((i, _hashable(leaf)) for i, leaf in enumerate(leaves) if not isinstance(leaf, Tensor))
        key = (
            str(spec),
            statics,
            tuple((tuple(t.shape), t.dtype, t.device) for t in tensors),
            plan.num_epochs,
            plan.steps_per_epoch,
            stateful,
            round_key(alg, job.hp, job.round_idx),
        )
        if key not in self.programs:
            self.programs[key] = self._build(
                job, leaves, slots, spec, stateful, plan.num_epochs, plan.steps_per_epoch, tensors
            )
        program = self.programs[key]
        if program is None:
            return vmap_clients(job_client_fn(job), job.inputs)
        upload, state, metrics = program(tensors)
        return ClientOut(upload=upload, state=state if stateful else None, metrics=metrics)

    def _build(
        self,
        job: CohortJob,
        leaves: list[Any],
        slots: list[int],
        spec: pytree.TreeSpec,
        stateful: bool,
        epochs: int,
        steps: int,
        tensors: list[Tensor],
    ) -> Program | None:
        alg, fns, hp, opt, round_idx = job.alg, job.fns, job.hp, job.opt, job.round_idx

        def cohort(*inputs: Tensor) -> list[Tensor]:
            flat = list(leaves)
            for slot, t in zip(slots, inputs, strict=True):
                flat[slot] = t
            bc, index, weight, step_mask, keys, num_examples, noise, states = pytree.tree_unflatten(
                flat, spec
            )
            one = client_fn(alg, fns, bc, hp, opt, epochs, steps, round_idx)
            upload, state, metrics = torch.func.vmap(
                one, in_dims=(0, 0, 0, 0, 0, 0, 0 if stateful else None)
            )(index, weight, step_mask, keys, num_examples, noise, states)
            outs, program.spec = pytree.tree_flatten((upload, state if stateful else None, metrics))
            program.static = [(i, leaf) for i, leaf in enumerate(outs) if not isinstance(leaf, Tensor)]
            return [leaf for leaf in outs if isinstance(leaf, Tensor)]

        program = Program(cohort)  # the eager function, or (self.trace) its trace

        where = f"{len(job.inputs.plan.num_examples)} clients x {epochs} epoch(s) x {steps} steps"
        start = time.perf_counter()
        ops = ""
        if self.trace:
            try:
                program.module = trace(cohort, tensors)
            except Exception as error:  # noqa: BLE001 - any failure to trace means: run this key eagerly
                self._warn_once(
                    f"--graph: {alg.name}'s client update could not be traced into one program "
                    f"({type(error).__name__}: {_first_line(error)}); running it eagerly (vmap)"
                )
                return None
            ops = f", {sum(1 for n in program.module.graph.nodes if n.op == 'call_function')} ops"  # type: ignore[attr-defined]
        if self.capture:
            try:
                capture(program, tensors)
            except Exception as error:  # noqa: BLE001 - without a graph: the traced program, or eager vmap
                program.graph = program.static_in = program.static_out = None
                fallback = (
                    "replaying the traced program uncaptured" if self.trace else "running it eagerly (vmap)"
                )
                self._warn_once(
                    f"--graph: the {alg.name} cohort update could not be captured in a CUDA graph "
                    f"({type(error).__name__}: {_first_line(error)}); {fallback}"
                )
                if not self.trace:
                    return None
        seconds = time.perf_counter() - start
        self.build_s += seconds
        log.info(
            "--graph: built the %s program for %s (%s%s) in %.1f s",
            alg.name,
            where,
            "traced" if self.trace else "eager",
            ops + (", captured" if program.graph is not None else ""),
            seconds,
        )
        return program

    def _warn_once(self, message: str) -> None:
        if message not in self.warned:
            self.warned.add(message)
            log.warning(message)


def capture(program: Program, tensors: list[Tensor]) -> None:
    """Capture `program` into a CUDA graph over static copies of `tensors` (torch.cuda.graphs:
    warm-up on a side stream, then capture on it); sets graph, static_in and static_out."""
    devices = {t.device for t in tensors}
    constants = (
        {t.device for t in _constants(program.module)}
        if isinstance(program.module, torch.fx.GraphModule)
        else set()
    )
    if any(d.type != "cuda" for d in devices | constants) or len(devices | constants) != 1:
        raise Untraceable(
            f"its tensors live on {sorted(map(str, devices | constants))}; "
            "a CUDA graph replays the work of one GPU"
        )
    with torch.cuda.device(devices.pop()):
        static_in = [t.clone() for t in tensors]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                program.module(*static_in)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = list(program.module(*static_in))
    program.graph, program.static_in, program.static_out = graph, static_in, static_out


def trace(cohort: Callable[..., list[Tensor]], tensors: list[Tensor]) -> torch.fx.GraphModule:
    """make_fx of the cohort function over fake copies of `tensors` (nothing computed while
    tracing; the data and other tensors it closes over stay real constants of the program),
    without the per-node stack traces, which cost half of a trace."""
    from torch.fx.experimental.proxy_tensor import make_fx

    config = torch.fx.config
    saved = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        return make_fx(cohort, tracing_mode="fake", _allow_non_fake_inputs=True)(*tensors)
    finally:
        config.do_not_emit_stack_traces = saved


def _constants(module: torch.fx.GraphModule) -> list[Tensor]:
    """The tensors a traced program holds as attributes (the federated data, constant tables),
    except 0-d ones (scalars, passed to kernels by value)."""
    values = (getattr(module, str(node.target)) for node in module.graph.nodes if node.op == "get_attr")
    return [value for value in values if isinstance(value, Tensor) and value.dim() > 0]


def _hashable(value: Any) -> Hashable:
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else ""


def refuses(w: Workload) -> str | None:
    """What a vmapped cohort program cannot hold (--compile and the executor are checked by engine/select.py)."""
    if not w.alg.supports_vmap:
        return f"{w.alg.name} does not run vmapped, which --graph needs; drop --graph."
    if w.has_batchnorm:
        return (
            "the model has BatchNorm layers, whose running statistics vmap (and so --graph) cannot keep per "
            "client; use GroupNorm in the model, or drop --graph."
        )
    return None


def build(setup: BackendSetup) -> GraphedVmap:
    """Programs keyed by shape and round key; K padded towards the largest client's batch count."""
    return GraphedVmap(
        setup.device, max_steps=-(-int(setup.fed.sizes.max(initial=1)) // setup.cfg.train.batch_size)
    )


INFO = BackendInfo(
    name="vmap + graph",
    summary="the vmapped cohort built once per shape and replayed: a CUDA graph "
    "on CUDA, a traced ATen graph on a CPU (opt-in: --graph)",
    refuses=refuses,
    prefers=None,
    build=build,
)
