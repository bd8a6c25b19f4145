"""The `process` executor: the cohort split across persistent worker processes (CPU).

On a CPU with P cores, P processes with one intra-op thread each keep every core busy on
the client computations without the synchronisation costs of intra-op threading on small
shapes (reference/performance.md §2.6). The main process is one of the P: it trains one
slice of the cohort itself while P - 1 spawned workers train the others.

- Workers are spawned once per run (`spawn` context, daemon processes: they die with the
  parent) and stay alive across rounds. Each builds the run's model functions once from the
  config; the training tensors cross once, by shared memory, so data is loaded once.
- Per round, the cohort is split into P slices of similar step counts (sorted by steps,
  contiguous groups chosen to balance clients x padded steps, as FedJAX's blockify and
  pfl's LPT schedule do); each slice is trimmed to its own longest client. A worker gets
  (broadcast, its slice of the CohortInputs) and returns the stacked ClientOut of its slice,
  both through a per-worker shared-memory arena (one memcpy each way, a few hundred bytes
  of pickled structure through a pipe). The parent reassembles the cohort order.
- Inside a slice the in-process executor runs: vmap (or loop for algorithms without vmap
  support). The per-client plan rows, step keys, noise and states are the parent's, so the
  result equals `loop`'s to float tolerance (tests/engine/test_equivalence.py).

Workers ignore SIGINT, SIGTERM and SIGHUP (a Ctrl-C, a scheduler or a closed terminal may
signal the whole process group: the parent stops the run in order and then its workers) and
exit on EOF when the parent disappears; `ProcessExecutor.close()` stops them at the end of a
run (SIGKILL for one that does not answer).
"""

from __future__ import annotations

import functools
import io
import itertools
import logging
import os
import pickle
import signal
import traceback
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedcli.algorithms.base import Algorithm, ClientOut, OptimConfig
from fedcli.datasets.federated import FederatedData
from fedcli.engine.executors import EXECUTORS, CohortInputs, ModelFunctions, merge_outs, take_clients
from fedcli.errors import ConfigError, FedcliError

log = logging.getLogger(__name__)

_ALIGN = 64  # bytes; every tensor in an arena starts on a cache line (and any dtype's alignment)
_MIN_ARENA = 1 << 20


class WorkerError(FedcliError):
    """A worker process failed or exited; the message carries its traceback."""


def available_cores() -> int:
    """Return the number of CPU cores this process may use: its affinity, capped by a cgroup CPU quota.

    A container or a batch job limited to 1.5 CPUs by `cpu.max` gets 1 (rounded down, at least
    1), however many cores the machine has; intra-op threads beyond that only wait on each other.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    return max(1, min(cores, int(quota))) if quota is not None else cores


def _cgroup_cpu_quota() -> float | None:
    """CPUs allowed by the cgroup (v2 `cpu.max`, v1 `cpu.cfs_quota_us`), or None when unlimited."""
    for quota_file, period_file in (("/sys/fs/cgroup/cpu.max", None),
                                    ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us")):
        try:
            text = open(quota_file).read().split()
            if period_file is None:
                quota, period = text[0], text[1]
            else:
                quota, period = text[0], open(period_file).read().strip()
        except (OSError, IndexError):
            continue
        if quota in ("max", "-1"):
            return None
        return float(quota) / float(period)
    return None


# ----------------------------------------------------------------------------- slicing the cohort


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


# ----------------------------------------------------------------------------- shared-memory transport


class _Packer(pickle.Pickler):
    """Pickle a message with its tensors replaced by (offset, dtype, shape) into an arena."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[tuple[int, Tensor]] = []
        self.size = 0

    def persistent_id(self, obj: object) -> tuple[int, torch.dtype, tuple[int, ...]] | None:
        if not isinstance(obj, Tensor):
            return None
        offset = -(-self.size // _ALIGN) * _ALIGN
        self.tensors.append((offset, obj))
        self.size = offset + obj.numel() * obj.element_size()
        return (offset, obj.dtype, tuple(obj.shape))


class _Unpacker(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, arena: Tensor, copy: bool) -> None:
        super().__init__(file)
        self.arena, self.copy = arena, copy

    def persistent_load(self, pid: tuple[int, torch.dtype, tuple[int, ...]]) -> Tensor:
        offset, dtype, shape = pid
        numel = int(np.prod(shape, dtype=np.int64))
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        t = self.arena.narrow(0, offset, nbytes).view(dtype).view(shape)
        return t.clone() if self.copy else t


def pack(obj: Any, arena: Tensor | None) -> tuple[Tensor | None, Tensor, bytes]:
    """Write obj's tensors into `arena` (a new, larger one if needed). Returns (new arena or None, arena, bytes)."""
    buffer = io.BytesIO()
    packer = _Packer(buffer)
    packer.dump(obj)
    new = None
    if arena is None or arena.numel() < packer.size:
        new = arena = torch.empty(max(_MIN_ARENA, packer.size * 3 // 2), dtype=torch.uint8).share_memory_()
    for offset, t in packer.tensors:
        nbytes = t.numel() * t.element_size()
        arena.narrow(0, offset, nbytes).view(t.dtype).view(t.shape).copy_(t.detach())
    return new, arena, buffer.getvalue()


def unpack(data: bytes, arena: Tensor, copy: bool) -> Any:
    """Rebuild a packed message; tensors are views of `arena` unless copy."""
    return _Unpacker(io.BytesIO(data), arena, copy).load()


# ----------------------------------------------------------------------------- the worker process


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its model functions (sent once per run)."""

    cfg: Any  # RunConfig
    x: Tensor  # training examples (shared memory)
    y: Tensor
    client_indices: list[np.ndarray]
    inner: str  # in-process executor for a slice: fused | vmap | loop


def worker_functions(spec: WorkerSpec) -> tuple[Algorithm, ModelFunctions, Any, OptimConfig]:
    """Build (algorithm, model functions, hyperparameters, optimiser settings) from a spec."""
    from fedcli.algorithms import ALGORITHMS
    from fedcli.config import make_hyperparameters
    from fedcli.datasets.registry import resolve_task
    from fedcli.engine.executors import model_functions

    cfg = spec.cfg
    task = resolve_task(cfg.data.task, cfg.data.model, cfg.data.file)
    model = task.models[cfg.data.model or task.default_model]()  # parameters come with each broadcast
    fed = FederatedData(spec.x, spec.y, spec.client_indices, torch.device("cpu"))
    fns = with_precision(model_functions(task, model, fed), cfg.train.precision, torch.device("cpu"))
    if cfg.train.compile and spec.inner == "loop":
        fns = replace(fns, compile_step=True)
    return (ALGORITHMS[cfg.algorithm.name], fns, make_hyperparameters(cfg.algorithm.name, cfg.algorithm.hp),
            cfg.train.optim(task.client_lr))


def _worker_main(conn: Any) -> None:
    """Serve bind / run messages until the parent sends None or disappears."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # the parent stops the run, then us
        signal.signal(signum, signal.SIG_IGN)
    torch.set_num_threads(1)
    bound: tuple[Algorithm, ModelFunctions, Any, OptimConfig] | None = None
    inner = "vmap"
    arena_in: Tensor | None = None
    arena_out: Tensor | None = None
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        try:
            if message[0] == "bind":
                spec: WorkerSpec = message[1]
                bound, inner = worker_functions(spec), spec.inner
                conn.send(("ok", None, b""))
                continue
            _, new_in, data = message
            arena_in = new_in if new_in is not None else arena_in
            assert arena_in is not None, "the first run message carries the arena"
            bc, inputs, round_idx, chunk = unpack(data, arena_in, copy=False)
            alg, fns, hp, opt = bound  # type: ignore[misc]
            out = EXECUTORS[inner](alg, fns, bc, inputs, hp, opt, round_idx, chunk)
            new_out, arena_out, reply = pack(out, arena_out)
            conn.send(("ok", new_out, reply))
        except Exception:  # noqa: BLE001 - reported to the parent, which raises WorkerError
            conn.send(("error", None, traceback.format_exc().encode()))


class _Worker:
    def __init__(self, context: Any) -> None:
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child,), daemon=True, name="fedcli-worker")
        self.process.start()
        child.close()
        self.arena_in: Tensor | None = None
        self.arena_out: Tensor | None = None

    def receive(self) -> tuple[str, Tensor | None, bytes]:
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            self.process.join(timeout=1.0)
            raise WorkerError(f"worker process {self.process.pid} exited unexpectedly (exit code "
                              f"{self.process.exitcode}); rerun with --executor vmap to see the error "
                              "in the main process.") from None

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.process.join(timeout=5.0)
        if self.process.is_alive():
            self.process.kill()  # it ignores SIGTERM
            self.process.join(timeout=5.0)
        self.conn.close()


class WorkerPool:
    """P - 1 persistent worker processes; reusable across runs (rebinds on a new spec)."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers = num_workers
        self.workers: list[_Worker] = []
        self.bound_token: object | None = None

    def start(self) -> WorkerPool:
        """Spawn the workers (returns at once; they import torch in the background)."""
        if not self.workers and self.num_workers > 0:
            context = torch.multiprocessing.get_context("spawn")
            self.workers = [_Worker(context) for _ in range(self.num_workers)]
        return self

    def bind(self, spec: WorkerSpec, token: object) -> None:
        """Send every worker the run's spec (data by shared memory) and wait until built."""
        self.start()
        for worker in self.workers:
            worker.conn.send(("bind", spec))
        for worker in self.workers:
            status, _, text = worker.receive()
            if status != "ok":
                raise WorkerError(f"a worker failed to build the run:\n{text.decode()}")
        self.bound_token = token

    def close(self) -> None:
        """Stop every worker (idempotent)."""
        for worker in self.workers:
            worker.stop()
        self.workers = []
        self.bound_token = None

    def __enter__(self) -> WorkerPool:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextmanager
def intra_op_threads(count: int) -> Iterator[None]:
    """Run the block with `count` intra-op threads, then restore the previous count."""
    previous = torch.get_num_threads()
    if previous != count:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if previous != count:
            torch.set_num_threads(previous)


class ProcessExecutor:
    """Callable like `run_vmap`: trains the cohort on `workers` processes (the main one included).

    Workers start on the first call (or on `start()`), so building a Setup spawns nothing.
    """

    _tokens = itertools.count()

    def __init__(self, cfg: Any, fed: FederatedData, *, workers: int, inner: str,
                 pool: WorkerPool | None = None) -> None:
        self.cfg, self.fed, self.inner = cfg, fed, inner
        self.slots = max(1, workers)
        self.own_pool = pool is None
        self.pool = pool if pool is not None else WorkerPool(self.slots - 1)
        self.slots = min(self.slots, self.pool.num_workers + 1)
        self.token = (os.getpid(), next(self._tokens))

    def start(self) -> None:
        """Spawn the workers now (they import torch while the caller goes on)."""
        self.pool.start()

    def _ensure_bound(self) -> None:
        if self.pool.bound_token == self.token:
            return
        cfg = replace(self.cfg, train=replace(self.cfg.train, executor=self.inner, workers=1))
        spec = WorkerSpec(cfg=cfg, x=self.fed.x.share_memory_(), y=self.fed.y.share_memory_(),
                          client_indices=self.fed.client_indices, inner=self.inner)
        self.pool.bind(spec, self.token)

    def __call__(self, alg: Algorithm, fns: ModelFunctions, broadcast: Any, inputs: CohortInputs, hp: Any,
                 opt: OptimConfig, round_idx: int, chunk_size: int | None = None) -> ClientOut:
        run_inner: Callable[..., ClientOut] = EXECUTORS[self.inner]
        split = split_cohort if self.inner == "vmap" else balanced_groups  # padded cost vs sum of steps
        groups = split(inputs.plan.steps_per_client, self.slots)
        if len(groups) == 1:
            return run_inner(alg, fns, broadcast, inputs, hp, opt, round_idx, chunk_size)
        self._ensure_bound()
        remote = self.pool.workers[: len(groups) - 1]
        for worker, rows in zip(remote, groups[1:], strict=True):
            message = (broadcast, take_clients(inputs, rows), round_idx, chunk_size)
            new, worker.arena_in, data = pack(message, worker.arena_in)
            worker.conn.send(("run", new, data))
        try:
            with intra_op_threads(1):
                outs = [run_inner(alg, fns, broadcast, take_clients(inputs, groups[0]), hp, opt, round_idx,
                                  chunk_size)]
        except BaseException:  # an error, or a stop signal between the main process's clients or chunks
            self._receive(remote)  # keep the pipes in step (killing a worker mid-transfer breaks fd sharing)
            raise
        failures, replies = self._receive(remote)
        if failures:
            raise WorkerError(f"a worker process failed in round {round_idx}:\n{failures[0]}")
        return merge_outs(groups, outs + replies)

    @staticmethod
    def _receive(remote: list[_Worker]) -> tuple[list[str], list[ClientOut]]:
        """Receive every worker's reply (even after a failure): (error tracebacks, ClientOuts)."""
        failures, replies = [], []
        for worker in remote:
            status, new, data = worker.receive()
            if status != "ok":
                failures.append(data.decode())
                continue
            worker.arena_out = new if new is not None else worker.arena_out
            assert worker.arena_out is not None, "the first reply carries the arena"
            replies.append(unpack(data, worker.arena_out, copy=True))
        return failures, replies

    def close(self) -> None:
        """Stop the workers this executor started (a shared pool is left to its owner)."""
        if self.own_pool:
            self.pool.close()


# ----------------------------------------------------------------------------- choosing an executor

PROCESS_MIN_GFLOP = 5.0  # per round; below it the pipe round trip and the spawn (~2 s once) do not pay off


def round_gflop(model: torch.nn.Module, fns: ModelFunctions, cfg: Any, fed: FederatedData) -> float:
    """Estimate one round's training GFLOP: 6 x forward MACs per example x examples x epochs x cohort.

    Forward MACs are counted by hooks on Linear and Conv layers for one example (at least the
    parameter count, for models that multiply raw parameters); backward = 2 x forward.
    """
    macs = 0.0

    def count(module: torch.nn.Module, _: Any, output: Tensor) -> None:
        nonlocal macs
        if isinstance(module, torch.nn.Linear):
            macs += output.numel() * module.in_features
        elif isinstance(module, torch.nn.modules.conv._ConvNd):
            macs += output.numel() * module.in_channels // module.groups * int(np.prod(module.kernel_size))

    hooks = [m.register_forward_hook(count) for m in model.modules()]
    try:
        with torch.no_grad():
            model(fns.prepare(fed.x[:1]))
    finally:
        for hook in hooks:
            hook.remove()
    macs = max(macs, float(sum(p.numel() for p in model.parameters())))
    mean_examples = float(np.mean(fed.sizes)) if len(fed.sizes) else 0.0
    return 6.0 * macs * mean_examples * cfg.train.local_epochs * cfg.train.clients_per_round / 1e9


CUDA_FUSED_MAX_CLIENTS = 32  # on CUDA, fused up to this cohort size, vmap above (see in_process_executor)


def in_process_executor(alg: Algorithm, device: torch.device, has_conv: bool, has_batchnorm: bool = False,
                        dense: bool = False, clients: int | None = None) -> str:
    """Return the faster in-process executor for the device type: fused, vmap or loop.

    `fused` (engine/dense.py) needs a dense classifier (`dense`, the model functions'
    DenseSpec) and an algorithm that declares its local SGD (Algorithm.fused_local).

    BatchNorm forces loop on every device: its running statistics are buffers updated in
    place, which vmap cannot carry per client (torch.func "Patching Batch Norm"); models here
    use GroupNorm.

    CPU: fused wherever it applies (it ran the MLP workloads of `make bench` 2x faster than
    vmap, README "Benchmarks"); convolutional models client by client (loop): under vmap a
    convolution over per-client weights becomes one grouped convolution, which CPU kernels run
    slower than the clients' own convolutions one after another (Reddi CNN, 10 clients,
    1 thread: vmap 3.7 s, loop 2.6 s per round); else vmap.

    CUDA (`clients`: the cohort size): vmap, and fused only for cohorts of at most
    CUDA_FUSED_MAX_CLIENTS. Measured on an H100 (FEMNIST MLP, per round): 10 clients fused
    0.015 s, vmap 0.042 s; 100 clients fused 0.128 s, vmap 0.052 s. fused grew 8.5x with the
    cohort (presumably because its CPU-cache-sized blocks of clients, dense.BLOCK_BYTES, run one
    after another) and vmap 1.2x, so the straight lines through the two points cross near 33
    clients. Convolutional models run vmapped (one grouped convolution is what a GPU does well).
    make bench's GPU table also times fused as one block, to retune this where it wins.
    """
    if not alg.supports_vmap or has_batchnorm or (has_conv and device.type == "cpu"):
        return "loop"
    if not (dense and alg.fused_local is not None):
        return "vmap"
    if device.type == "cuda" and clients is not None and clients > CUDA_FUSED_MAX_CLIENTS:
        return "vmap"
    return "fused"


def choose_executor(cfg: Any, alg: Algorithm, device: torch.device, gflop: Callable[[], float],
                    has_conv: bool = False, has_batchnorm: bool = False, dense: bool = False) -> tuple[str, str]:
    """Return (executor, why) for train.executor (auto: the fastest for the model, cohort, device).

    Rule (measured by tests/benchmarks/run.py on 2 cores, README "Speed"): P processes with one
    thread each win for convolutional models with >= PROCESS_MIN_GFLOP per round (Reddi CNN,
    10 clients: 1.4 s against 2.2-5.9 s for vmap with 2 threads and 2.4 s client by client);
    for dense models the cohort vmapped in the main process wins (MLP, 10 clients: 0.060 s
    against 0.081 s for 2 processes: the per-round pipe and copy costs are not repaid).
    On a GPU the cohort runs in the main process, never in worker processes: fused for dense
    classifiers up to CUDA_FUSED_MAX_CLIENTS clients, else vmap (in_process_executor, measured
    on an H100). With --compile the cohort runs vmapped and compiled in the main process; with
    --compile and --executor loop or process each client's step is compiled instead.
    """
    requested = cfg.train.executor
    inner = in_process_executor(alg, device, has_conv, has_batchnorm, dense, cfg.train.clients_per_round)
    if requested in ("vmap", "fused") and not alg.supports_vmap:
        raise ConfigError(f"{alg.name} does not support --executor {requested}; use --executor loop or auto.")
    if requested == "fused" and (not dense or alg.fused_local is None):
        raise ConfigError(f"--executor fused trains dense classifiers (mlp, logreg, linear) in fp32 with "
                          f"{', '.join(fused_algorithms())}; {describe_unfusable(alg, dense)}. "
                          "Use --executor auto (or vmap).")
    if has_batchnorm and cfg.train.compile:
        raise ConfigError("--compile does not handle BatchNorm layers (their running statistics are mutable "
                          "state); use GroupNorm in the model, or drop --compile.")
    if has_batchnorm and requested == "vmap":
        raise ConfigError("the model has BatchNorm layers, whose running statistics vmap cannot keep per "
                          "client; use GroupNorm in the model, or --executor loop (or auto).")
    if cfg.train.graph:
        why = graph_refusal(cfg, alg, requested, has_batchnorm)
        if why is not None:
            raise ConfigError(why)
        return "vmap", ("requested" if requested == "vmap" else
                        "--graph: the cohort vmapped, built once per shape and replayed"
                        + (" as one CUDA graph" if device.type == "cuda" else " as a traced ATen graph"))
    if requested == "process" and device.type != "cpu":
        raise ConfigError(f"train.executor='process' splits the cohort over CPU processes; got device "
                          f"{device}. Use --executor vmap (or auto) on a GPU.")
    if requested != "auto":
        return requested, "requested"
    if cfg.train.compile and alg.supports_vmap:
        return "vmap", "--compile: the cohort vmapped and compiled in the main process"
    if inner == "fused":
        where = "on the GPU" if device.type != "cpu" else "(all cores as threads)"
        return "fused", ("dense classifier: the cohort's local SGD in stacked GEMMs, each layer's gradient fused "
                         f"into its update, no padded steps {where}")
    if has_batchnorm:
        why = "BatchNorm: its running statistics need the clients one by one"
    elif inner == "loop" and alg.supports_vmap:
        why = "convolutions run faster client by client than as vmap's grouped convolutions on a CPU"
    else:
        why = "the whole cohort in one vmapped computation" if inner == "vmap" else f"{alg.name} has no vmap"
    if device.type != "cpu":
        if inner == "vmap" and dense and alg.fused_local is not None:
            why = (f"{cfg.train.clients_per_round} clients > {CUDA_FUSED_MAX_CLIENTS}: vmap outruns fused on a "
                   "GPU for large cohorts")
        return inner, f"{device.type}: the whole cohort on one device ({why})"
    slots = min(cfg.train.workers or available_cores(), cfg.train.clients_per_round)
    if slots < 2:
        return inner, f"one core (or one client per round); {why}"
    if not has_conv:
        return inner, f"dense model: {why} (worker processes do not repay their copies)"
    work = gflop()
    if work < PROCESS_MIN_GFLOP:
        return inner, f"~{work:.2g} GFLOP per round: too little to pay for worker processes; {why}"
    return "process", f"{slots} processes x 1 thread ({inner} inside each): ~{work:.3g} GFLOP per round"


def graph_refusal(cfg: Any, alg: Algorithm, requested: str, has_batchnorm: bool) -> str | None:
    """Why --graph cannot run this configuration (one line with the fix), or None."""
    if cfg.train.compile:
        return "--graph and --compile are two ways to build the round's program; choose one of them."
    if requested not in ("auto", "vmap"):
        return (f"--graph replays the vmapped cohort update; it does not apply to --executor {requested}. "
                "Use --executor vmap (or auto) with --graph, or drop --graph.")
    if not alg.supports_vmap:
        return f"{alg.name} does not run vmapped, which --graph needs; drop --graph."
    if has_batchnorm:
        return ("the model has BatchNorm layers, whose running statistics vmap (and so --graph) cannot keep per "
                "client; use GroupNorm in the model, or drop --graph.")
    return None


def fused_algorithms() -> list[str]:
    """Names of the registered algorithms that the `fused` executor can train."""
    from fedcli.algorithms import ALGORITHMS

    return sorted(name for name, alg in ALGORITHMS.items() if alg.fused_local is not None)


def describe_unfusable(alg: Algorithm, dense: bool) -> str:
    """Say why the fused executor cannot run `alg` on this model."""
    if alg.fused_local is None:
        return f"{alg.name} trains its own local objective"
    return "this model/task is not a dense classifier with cross-entropy (or --precision is bf16)"


def speed_setup(cfg: Any, alg: Algorithm, device: torch.device, fed: FederatedData, fns: ModelFunctions,
                model: torch.nn.Module, peers: Any = None) -> tuple[ModelFunctions, str, str, Any]:
    """Apply train.precision, choose the executor and build its runner (None = EXECUTORS[name]).

    Returns (model functions, executor name, why, runner). Called once by `train.build`;
    `peers` (engine/distributed.py) is the process group of `--executor distributed`.
    """
    fns = with_precision(fns, cfg.train.precision, device)
    has_conv = any(isinstance(m, torch.nn.modules.conv._ConvNd) for m in model.modules())
    has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    dense = fns.dense is not None
    executor, why = choose_executor(cfg, alg, device, lambda: round_gflop(model, fns, cfg, fed), has_conv, has_bn,
                                    dense)
    runner: Any = None
    if cfg.train.compile and executor in ("loop", "process", "distributed"):  # compiled per-client steps
        fns = replace(fns, compile_step=True)
    if executor == "distributed":  # the cohort split over the ranks, the in-process executor inside each
        from fedcli.engine.distributed import DistributedExecutor

        inner = "loop" if cfg.train.compile else in_process_executor(alg, device, has_conv, has_bn, dense,
                                                                     cfg.train.clients_per_round)
        if peers is None:  # `fedcli evaluate` / `report` rebuild a distributed run's data and model in one process
            executor, why = inner, "a distributed run rebuilt in one process (no process group)"
        else:
            runner = DistributedExecutor(cfg, inner, peers)
            why = f"{peers.world_size} ranks x {torch.get_num_threads()} thread(s) ({inner} inside each)"
    elif executor == "process":
        slots = min(cfg.train.workers or available_cores(), cfg.train.clients_per_round)
        inner = "loop" if cfg.train.compile else in_process_executor(alg, device, has_conv, has_bn, dense)
        runner = ProcessExecutor(cfg, fed, workers=slots, inner=inner)
    elif executor == "vmap" and (cfg.train.compile or cfg.train.graph):
        max_steps = -(-int(fed.sizes.max(initial=1)) // cfg.train.batch_size)  # the largest client's batches
        if cfg.train.compile:
            runner = CompiledVmap(max_steps=max_steps)
        else:
            from fedcli.engine.graphed import GraphedVmap

            runner = GraphedVmap(device, max_steps=max_steps)
    return fns, executor, why, runner


def close_runner(runner: Any) -> None:
    """Stop a runner's worker processes, if it has any (idempotent)."""
    if runner is not None and hasattr(runner, "close"):
        runner.close()


# ----------------------------------------------------------------------------- precision and compile


def with_precision(fns: ModelFunctions, precision: str, device: torch.device) -> ModelFunctions:
    """Return model functions for train.precision: fp32 (as is), tf32 (CUDA), bf16 (autocast).

    Parameters, optimiser state and aggregation stay float32 in every mode; bf16 runs the
    model's forward (and so its backward) under torch.autocast. On a CUDA device the process's
    TF32 flags (process-wide in PyTorch) follow the precision (cuda_tf32_flags).
    """
    if precision == "tf32" and device.type != "cuda":
        raise ConfigError(f"train.precision='tf32' needs a CUDA device; got device {device}. "
                          "Use --precision bf16 on a CPU, or fp32.")
    if device.type == "cuda":
        cuda_tf32_flags(precision)
    if precision in ("fp32", "tf32"):
        return fns
    fns = replace(fns, dense=None)  # bf16: the fused dense trainer is fp32 only
    if device.type == "cpu" and not _native_bf16_cpu():
        log.warning("train.precision='bf16' on a CPU without native bf16 (no avx512_bf16/amx_bf16 flag): "
                    "PyTorch emulates it, and its convolutions fall back to a slow reference kernel (8x slower "
                    "than fp32 in make bench on such a CPU); use --precision fp32 here.")
    loss_fn, apply_fn = fns.loss_fn, fns.apply_fn

    def bf16_loss(params: dict[str, Tensor], batch: Any) -> Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return loss_fn(params, batch).float()

    def bf16_apply(params: dict[str, Tensor], x: Tensor) -> Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return apply_fn(params, x).float()

    return replace(fns, loss_fn=bf16_loss, apply_fn=bf16_apply)


def cuda_tf32_flags(precision: str) -> None:
    """Set the CUDA matmul and cuDNN TF32 flags for train.precision: on for tf32, off otherwise.

    PyTorch's defaults are matmul off but cuDNN on, so without this `--precision fp32` still ran
    convolutions in TF32 (10-bit mantissa) on Ampere and later GPUs. bf16 turns both off too:
    the float32 work outside autocast is then float32. The flags are process-wide, so the last
    run built in a process sets them for every run in it.
    """
    tf32 = precision == "tf32"
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32


def _native_bf16_cpu() -> bool:
    """True when /proc/cpuinfo lists avx512_bf16 or amx_bf16 (True where it cannot be read)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    return "avx512_bf16" in flags or "amx_bf16" in flags


def pad_steps(inputs: CohortInputs, multiple: int, max_steps: int | None = None) -> CohortInputs:
    """Round K (steps per epoch) up with masked no-op steps: to `max_steps` (the federation's
    longest client) when that costs at most 1.5 K, else to a multiple of `multiple`.

    Real steps keep their plan rows, keys and noise; the added steps have weight 0 and mask 0.
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

    padded = replace(plan, index=pad(plan.index), weight=pad(plan.weight), step_mask=pad(plan.step_mask),
                     steps_per_epoch=target)
    return CohortInputs(plan=padded, keys=pad(inputs.keys), noise={n: pad(v) for n, v in inputs.noise.items()},
                        states=inputs.states)


class CompiledVmap:
    """`run_vmap` with the cohort's client update compiled by torch.compile (--compile).

    One compiled graph per (cohort size, padded steps per epoch, chunk): K is padded to the
    federation's longest client where that is cheap, else up to a multiple of `bucket`, so
    few graphs are compiled. The local loop is unrolled, so compiling takes tens of seconds to
    minutes (MLP, 10 clients x 9 steps: ~60 s on 2 cores); the time is logged and kept in
    `compile_s`. Inductor's on-disk cache (TORCHINDUCTOR_CACHE_DIR, by default
    under the system temp folder) makes later runs of the same shapes compile faster.

    The round enters the key through program_round_key: FedPA's burn-in and BayesADMM's
    learning-rate schedule through their Algorithm.round_key (two graphs for FedPA, however long
    the run), FOLA's 1/r prior as the round itself (its client code reads `.round_idx`:
    reads_round_idx); for the others one graph serves every round. Each graph is compiled from
    its own copy of the cohort function's code object: dynamo keeps its cache per code object
    with a limit of 8 entries (torch._dynamo.config.recompile_limit), so graphs sharing one
    would make the 9th key (e.g. round 9 of FedPA) fall back to eager for the rest of the run.
    `backend` is torch.compile's (tests count graphs with "eager", which compiles nothing).
    """

    def __init__(self, bucket: int = 4, max_steps: int | None = None, backend: str = "inductor") -> None:
        self.bucket, self.max_steps, self.backend = bucket, max_steps, backend
        self.compiled: dict[tuple[Hashable, ...], Callable[..., Any]] = {}
        self.compile_s = 0.0

    def __call__(self, alg: Algorithm, fns: ModelFunctions, broadcast: Any, inputs: CohortInputs, hp: Any,
                 opt: OptimConfig, round_idx: int, chunk_size: int | None = None) -> ClientOut:
        import time

        from fedcli.engine.executors import client_fn

        inputs = pad_steps(inputs, self.bucket, self.max_steps)
        plan = inputs.plan
        stateful = inputs.states is not None
        # round_idx is a static Python value of the client update: a new key is a new graph
        round_key = program_round_key(alg, hp, round_idx)
        key = (len(plan.num_examples), plan.num_epochs, plan.steps_per_epoch, chunk_size or 0, int(stateful),
               round_key)
        fn = self.compiled.get(key)
        first = fn is None
        if fn is None:
            epochs, steps, round_no = plan.num_epochs, plan.steps_per_epoch, round_idx

            def cohort(bc: Any, index: Tensor, weight: Tensor, step_mask: Tensor, keys: Tensor,
                       num_examples: Tensor, noise: dict[str, Tensor], states: Any) -> Any:
                one = client_fn(alg, fns, bc, hp, opt, epochs, steps, round_no)
                return torch.func.vmap(one, in_dims=(0, 0, 0, 0, 0, 0, 0 if stateful else None),
                                       chunk_size=chunk_size)(index, weight, step_mask, keys, num_examples,
                                                              noise, states)

            fn = self.compiled[key] = torch.compile(own_code(cohort), dynamic=False, backend=self.backend)
        start = time.perf_counter()
        upload, state, metrics = fn(broadcast, plan.index, plan.weight, plan.step_mask, inputs.keys,
                                    plan.num_examples, inputs.noise, inputs.states)
        if first:
            seconds = time.perf_counter() - start
            self.compile_s += seconds
            log.info("compiled the client update for %d clients x %d steps per epoch in %.1f s",
                     key[0], key[2], seconds)
        return ClientOut(upload=upload, state=state if stateful else None, metrics=metrics)


def own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Return fn with a copy of its code object, so that dynamo's per-code cache (and its
    recompile limit) is this function's alone, not shared with every closure of the same def."""
    import types

    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    return copy


def program_round_key(alg: Algorithm, hp: Any, round_idx: int) -> Hashable:
    """What a program built from the client update (compiled, traced, captured) is keyed by across
    rounds: the algorithm's round_key (FedPA: past burn-in or not), else the round itself where
    the client code reads ctx.round_idx (FOLA's 1/r prior), else one value for every round."""
    if alg.round_key is not None:
        return ("key", alg.round_key(hp, round_idx))
    return round_idx if reads_round_idx(alg) else -1


def reads_round_idx(alg: Algorithm) -> bool:
    """True when the client code may read `.round_idx` (its client update may branch on it).

    Looks for an attribute access `<x>.round_idx` in the syntax tree of the client update's
    module and of every module of the same package it refers to (docstrings, comments and
    parameters named round_idx, such as fused_local's, do not count); True where a source
    cannot be read.
    """
    return _code_reads_round_idx(alg.client_update)


@functools.cache
def _code_reads_round_idx(client_update: Callable[..., Any]) -> bool:
    import ast
    import inspect
    import sys

    module = inspect.getmodule(client_update)
    if module is None:
        return True
    package = module.__name__.split(".")[0]
    seen: set[str] = set()
    todo = [module]
    while todo:
        mod = todo.pop()
        if mod.__name__ in seen:
            continue
        seen.add(mod.__name__)
        try:
            tree = ast.parse(inspect.getsource(mod))
        except (OSError, TypeError, SyntaxError):
            return True
        if any(isinstance(node, ast.Attribute) and node.attr == "round_idx" for node in ast.walk(tree)):
            return True
        for value in vars(mod).values():
            name = value.__name__ if inspect.ismodule(value) else getattr(value, "__module__", None)
            if isinstance(name, str) and name.split(".")[0] == package and name in sys.modules:
                todo.append(sys.modules[name])
    return False
