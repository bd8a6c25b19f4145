"""`process`: the cohort split across persistent worker processes (CPU); opt-in.

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
- Inside a slice an in-process back end runs (backends/inprocess.py: fused, loop or vmap, as
  engine/select.py picks). The per-client plan rows, step keys, noise and states are the
  parent's, so the result equals `loop`'s to float tolerance (tests/engine/test_equivalence.py).

auto picks it for convolutional models on a CPU with two or more cores for the cohort
(engine/select.py, `_spreads`), where one single-threaded worker per core beat the loop with
intra-op threads; elsewhere it is opt-in. With --compile or bf16 it was the fastest CNN
configuration (timings in docs/benchmarks.md, "Last full run"; docs/architecture.md §3, "Which
back ends stay").

Workers ignore SIGINT, SIGTERM and SIGHUP (a Ctrl-C, a scheduler or a closed terminal may
signal the whole process group: the parent stops the run in order and then its workers) and
exit on EOF when the parent disappears; `ProcessBackend.close()` stops them at the end of a
run (SIGKILL for one that does not answer).
"""

from __future__ import annotations

import io
import itertools
import os
import pickle
import signal
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from fedcli.algorithms.base import ClientOut
from fedcli.children import death
from fedcli.datasets import augment as augmentation
from fedcli.datasets.federated import MemoryData
from fedcli.datasets.yours.data import shipped
from fedcli.engine.backends import BackendInfo, BackendSetup, Workload
from fedcli.engine.backends.inprocess import IN_PROCESS
from fedcli.engine.cohort import (
    CohortInputs,
    CohortJob,
    balanced_groups,
    merge_outs,
    split_cohort,
    take_clients,
)
from fedcli.engine.machine import intra_op_threads
from fedcli.engine.model import model_functions, with_precision
from fedcli.errors import FedcliError

if TYPE_CHECKING:
    from fedcli.config.sections import RunConfig

_ALIGN = 64  # bytes; every tensor in an arena starts on a cache line (and any dtype's alignment)
_MIN_ARENA = 1 << 20


class WorkerError(FedcliError):
    """A worker process failed or exited; the message carries its traceback."""


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
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
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
        arena.narrow(0, offset, t.nbytes).view(t.dtype).view(t.shape).copy_(t.detach())
    return new, arena, buffer.getvalue()


def unpack(data: bytes, arena: Tensor, copy: bool) -> Any:
    """Rebuild a packed message; tensors are views of `arena` unless copy."""
    return _Unpacker(io.BytesIO(data), arena, copy).load()


# ----------------------------------------------------------------------------- the worker process


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its model functions (sent once per run)."""

    cfg: RunConfig
    x: Tensor  # training examples (shared memory)
    y: Tensor
    client_indices: Sequence[np.ndarray]
    inner: str  # the in-process back end for a slice: fused | vmap | loop
    user_data: Any = (
        None  # a data object's or function's tensors (datasets/yours/data.py); None for a file or task
    )


def worker_functions(spec: WorkerSpec) -> Callable[[Any, CohortInputs, int, int | None], ClientOut]:
    """Build the algorithm, model functions, hyperparameters, optimiser settings and back end of a spec;
    return what trains a slice: (broadcast, its CohortInputs, round, chunk size) -> its ClientOut."""
    from fedcli.algorithms import ALGORITHMS
    from fedcli.config.checks import make_hyperparameters
    from fedcli.datasets.registry import resolve_task

    cfg, cpu = spec.cfg, torch.device("cpu")
    if (
        spec.user_data is not None
    ):  # the parent's materialised data: never reloaded, never a Python object here
        from fedcli.datasets.yours.data import register

        assert cfg.data.file is not None  # user_data is shipped only for a data reference (_ensure_bound)
        register(cfg.data.file, spec.user_data)
    task = resolve_task(cfg.data.task, cfg.data.model, cfg.data.file, cfg.data.model_args)
    transforms = augmentation.parse(cfg.data.augment)  # as the parent's set-up (engine/setup.py build)
    task = augmentation.with_normalisation(task, transforms)
    model = task.models[cfg.data.model or task.default_model]()  # parameters come with each broadcast
    fed = MemoryData(spec.x, spec.y, spec.client_indices, cpu)
    fns = with_precision(model_functions(task, model, fed, cfg.train.bn_stats), cfg.train.precision, cpu)
    if transforms.random:
        fns = replace(fns, augment=augmentation.augmenter(transforms))
    backend = IN_PROCESS[spec.inner].build(BackendSetup(cfg=cfg, model=model, fed=fed, device=cpu))
    alg, hp = ALGORITHMS[cfg.algorithm.name], make_hyperparameters(cfg.algorithm.name, cfg.algorithm.hp)
    opt = cfg.train.optim(task.client_lr)

    def train_slice(bc: Any, inputs: CohortInputs, round_idx: int, chunk: int | None) -> ClientOut:
        return backend.run(CohortJob(alg, fns, bc, inputs, hp, opt, round_idx, chunk))

    return train_slice


def _worker_main(conn: Any) -> None:
    """Serve bind / run messages until the parent sends None or disappears."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # the parent stops the run, then us
        signal.signal(signum, signal.SIG_IGN)
    torch.set_num_threads(1)
    train_slice: Callable[[Any, CohortInputs, int, int | None], ClientOut] | None = None
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
                train_slice = worker_functions(spec)
                conn.send(("ok", None, b""))
                continue
            _, new_in, data = message
            arena_in = new_in if new_in is not None else arena_in
            assert arena_in is not None, "the first run message carries the arena"
            bc, inputs, round_idx, chunk = unpack(data, arena_in, copy=False)
            assert train_slice is not None, "the parent binds a run before its first round"
            new_out, arena_out, reply = pack(train_slice(bc, inputs, round_idx, chunk), arena_out)
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
            raise WorkerError(
                f"worker process {self.process.pid} exited unexpectedly ({death(self.process.exitcode)}); "
                "rerun with --executor vmap to see the error in the main process."
            ) from None

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


class ProcessBackend:
    """Trains the cohort on `setup.workers` processes (the main one included), each running the
    in-process back end `setup.inner` on its slice. Workers start on the first round (or on
    `start()`), so building a Setup spawns nothing; `pool` shares one pool between runs (tests)."""

    _tokens = itertools.count()

    def __init__(self, setup: BackendSetup, pool: WorkerPool | None = None) -> None:
        assert setup.inner is not None, "engine/select.py names the in-process back end"
        self.cfg, self.fed, self.inner = setup.cfg, setup.fed, setup.inner
        self.local = IN_PROCESS[setup.inner].build(setup)  # the main process's own slice
        slots = max(1, setup.workers)
        self.own_pool = pool is None
        self.pool = pool if pool is not None else WorkerPool(slots - 1)
        self.processes = min(slots, self.pool.num_workers + 1)  # recorded as train.workers
        self.name = "process + compile" if setup.cfg.train.compile else "process"
        self.token = (os.getpid(), next(self._tokens))

    def start(self) -> None:
        """Spawn the workers now (they import torch while the caller goes on)."""
        self.pool.start()

    def _ensure_bound(self) -> None:
        if self.pool.bound_token == self.token:
            return
        cfg = replace(self.cfg, train=replace(self.cfg.train, executor=self.inner, workers=1))
        spec = WorkerSpec(
            cfg=cfg,
            x=self.fed.x.share_memory_(),
            y=self.fed.y.share_memory_(),
            client_indices=self.fed.client_indices,
            inner=self.inner,
            user_data=shipped(cfg.data.file),
        )
        self.pool.bind(spec, self.token)

    def run(self, job: CohortJob) -> ClientOut:
        inputs = job.inputs
        split = split_cohort if self.inner == "vmap" else balanced_groups  # padded cost vs sum of steps
        groups = split(inputs.plan.steps_per_client, self.processes)
        if len(groups) == 1:
            return self.local.run(job)
        self._ensure_bound()
        remote = self.pool.workers[: len(groups) - 1]
        for worker, rows in zip(remote, groups[1:], strict=True):
            message = (job.broadcast, take_clients(inputs, rows), job.round_idx, job.chunk_size)
            new, worker.arena_in, data = pack(message, worker.arena_in)
            worker.conn.send(("run", new, data))
        try:
            with intra_op_threads(1):
                outs = [self.local.run(replace(job, inputs=take_clients(inputs, groups[0])))]
        except BaseException:  # an error, or a stop signal between the main process's clients or chunks
            self._receive(remote)  # keep the pipes in step (killing a worker mid-transfer breaks fd sharing)
            raise
        failures, replies = self._receive(remote)
        if failures:
            raise WorkerError(f"a worker process failed in round {job.round_idx}:\n{failures[0]}")
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


def refuses(w: Workload) -> str | None:
    """Worker processes split a CPU's cores; a GPU's cohort runs in the main process. A script run as
    `python script.py` whose top level calls fedcli.train without an `if __name__ == "__main__":` guard
    cannot have workers: `spawn` re-runs the script in each of them (they would train again)."""
    if w.device.type != "cpu":
        return (
            f"train.executor='process' splits the cohort over CPU processes; got device {w.device}. "
            "Use --executor vmap (or auto) on a GPU."
        )
    script = unguarded_main_script()
    if script is not None:
        return (
            f"train.executor='process' spawns worker processes, which re-run {script}: its top level has no "
            '`if __name__ == "__main__":` guard. Put the fedcli.train call under that guard, or use '
            "--executor loop or vmap."
        )
    return None


def unguarded_main_script() -> str | None:
    """The path of the running script when `spawn` would re-run it in a worker and it has no module-level
    `if __name__ == "__main__":` (read with ast, not run); None for `python -m`, notebooks, `-c` and pytest,
    whose main module multiprocessing does not re-run."""
    import ast
    import sys

    main = sys.modules.get("__main__")
    if main is None or getattr(getattr(main, "__spec__", None), "name", None) is not None:
        return None
    path = getattr(main, "__file__", None)
    if not isinstance(path, str) or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read())
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None

    def is_guard(node: ast.stmt) -> bool:
        test = node.test if isinstance(node, ast.If) else None
        if not isinstance(test, ast.Compare) or len(test.ops) != 1 or not isinstance(test.ops[0], ast.Eq):
            return False
        sides = [test.left, *test.comparators]
        return any(isinstance(x, ast.Name) and x.id == "__name__" for x in sides) and any(
            isinstance(x, ast.Constant) and x.value == "__main__" for x in sides
        )

    return None if any(is_guard(node) for node in tree.body) else path


INFO = BackendInfo(
    name="process",
    summary="CPU: the cohort split over persistent worker processes (one thread each, "
    "shared-memory transport), an in-process back end inside each (auto for convolutional models on 2+ cores)",
    refuses=refuses,
    prefers=None,
    build=ProcessBackend,
)
