"""The three speed workloads of `make bench`, run three ways on the same machine in one invocation.

Workload: the bundled FEMNIST writers (105 clients), FedAvg, 1 local epoch, batch 20, SGD
lr 0.01, C clients per round; seconds per round = median of rounds 2..R (round 1 holds
warm-up: first vmap trace, worker spawn), evaluation excluded. The in-process approaches run
interleaved round by round (`interleaved`), so that each round of every approach meets the
same machine; Flower runs in its own process between them.

- fedcli: `run_round` with each back end (fused, vmap, loop, process, with and without
  `--compile` and `--graph`, and whatever `auto` picks), the cohorts of seed 0.
- plain PyTorch loop, as research code writes it: per client deepcopy the global model,
  torch.optim.SGD, shuffled minibatches from tensors already in memory, weighted average of
  the state dicts; the same cohorts and the same keyed dropout as fedcli's CNN.
- Flower: flwr's simulation engine (Ray backend, 1 CPU per client) with its FedAvg strategy
  (tests/benchmarks/flower_sim.py), run in the interpreter that has flwr installed.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fedcli.config.build import build_config
from fedcli.datasets.registry import TASKS
from fedcli.datasets.tasks import TaskOptions
from fedcli.engine.backends.compiled import CompiledVmap
from fedcli.engine.backends.graphed import GraphedVmap
from fedcli.engine.clientstate import ClientStateStore
from fedcli.engine.machine import intra_op_threads
from fedcli.engine.model import cuda_tf32_flags
from fedcli.engine.rounds import Timing, run_round
from fedcli.engine.seeding import sample_cohort
from fedcli.engine.setup import build

LR, BATCH = 0.01, 20


def median_after_first(times: list[float]) -> float:
    return statistics.median(times[1:] if len(times) > 1 else times)


class FedcliRunner:
    """fedcli's round loop with one back end, one round at a time (for interleaved timing).

    With `compile` (opt-in `--compile`) round 1 holds the compilation (or, with inductor's
    on-disk cache warm, its loading); `compile_s` reports it. `device` is pinned (cpu unless
    asked), so the CPU tables stay CPU figures on a machine with a GPU.
    """

    def __init__(
        self,
        model: str,
        cohort: int,
        executor: str,
        threads: int,
        precision: str = "fp32",
        compile: bool = False,
        device: str = "cpu",
        graph: bool = False,
    ) -> None:
        cfg = build_config(
            overrides={
                "algorithm.name": "fedavg",
                "data.task": "femnist",
                "data.model": model,
                "train.clients_per_round": cohort,
                "train.batch_size": BATCH,
                "train.client_lr": LR,
                "train.executor": executor,
                "seed": 0,
                "train.precision": precision,
                "train.compile": compile or None,
                "train.graph": graph or None,
                "train.device": device,
            }
        )
        self.setup, self.threads, self.compile, self.precision = build(cfg), threads, compile, precision
        self.state = self.setup.alg.server_init(self.setup.init_params, self.setup.hp, self.setup.opt)
        self.store = ClientStateStore(None)

    def round(self, round_idx: int) -> float:
        if self.setup.device.type == "cuda":  # process-wide flags: runners of other precisions interleave
            cuda_tf32_flags(self.precision)
        with intra_op_threads(self.threads):
            start = time.perf_counter()
            self.state, _ = run_round(self.setup, self.state, self.store, round_idx, Timing())
            return time.perf_counter() - start

    def result(self, times: list[float]) -> dict[str, object]:
        median = median_after_first(times)
        backend = self.setup.backend
        compile_s = (
            backend.compile_s
            if isinstance(backend, CompiledVmap)
            else backend.build_s
            if isinstance(backend, GraphedVmap)
            else None
        )
        if self.compile and compile_s is None:  # per-client compiled steps: round 1 minus a typical round
            compile_s = times[0] - median
        return {
            "executor": self.setup.executor,
            "backend": self.setup.backend.name,
            "reason": self.setup.executor_reason,
            "threads": self.threads,
            "round_s": times,
            "median_s": median,
            "compile_s": compile_s,
        }

    def close(self) -> None:
        self.setup.backend.close()


class PlainRunner:
    """The per-client PyTorch loop as research code writes it, one round at a time: per client
    deepcopy the global model, torch.optim.SGD, shuffled minibatches from tensors already in
    memory, weighted average of the state dicts. threads=None: PyTorch's default intra-op threads.
    On `device` cuda the data and model live on the GPU and each round ends with a synchronize."""

    def __init__(
        self,
        model: str,
        cohort: int,
        threads: int | None = None,
        device: str = "cpu",
        precision: str = "fp32",
    ) -> None:
        task = TASKS["femnist"]
        data = task.load(TaskOptions())
        self.device = torch.device(device)
        self.xs = [task.prepare(data.x[ix]).to(self.device) for ix in data.client_indices]  # prepared once
        self.ys = [data.y[ix].to(self.device) for ix in data.client_indices]
        torch.manual_seed(0)
        self.model, self.cohort = task.models[model]().to(self.device), cohort
        self.threads = threads or torch.get_num_threads()
        self.precision = precision  # on CUDA: fp32 = TF32 off for matmuls and cuDNN, tf32 = on

    def round(self, round_idx: int) -> float:
        if self.device.type == "cuda":
            cuda_tf32_flags(self.precision)
        with intra_op_threads(self.threads):
            start = time.perf_counter()
            global_model = self.model
            total, summed = 0, {k: torch.zeros_like(v) for k, v in global_model.state_dict().items()}
            for client in sample_cohort(len(self.xs), self.cohort, seed=0, round_idx=round_idx):
                local = copy.deepcopy(global_model)
                opt = torch.optim.SGD(local.parameters(), lr=LR)
                x, y = self.xs[client], self.ys[client]
                order = torch.randperm(
                    len(y), generator=torch.Generator().manual_seed(round_idx * 10_000 + int(client))
                )
                order = order.to(self.device)
                for step, first in enumerate(range(0, len(y), BATCH)):
                    idx = order[first : first + BATCH]
                    opt.zero_grad()
                    F.cross_entropy(
                        local(x[idx], key=torch.tensor(step, device=self.device)), y[idx]
                    ).backward()
                    opt.step()
                for k, v in local.state_dict().items():
                    summed[k] += len(y) * v
                total += len(y)
            global_model.load_state_dict({k: v / total for k, v in summed.items()})
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return time.perf_counter() - start

    def result(self, times: list[float]) -> dict[str, object]:
        return {"round_s": times, "median_s": median_after_first(times), "threads": self.threads}

    def close(self) -> None:
        pass


def interleaved(
    factories: dict[str, Callable[[], FedcliRunner | PlainRunner]], rounds: int
) -> dict[str, dict[str, object]]:
    """Build every runner, then time round r of each before round r + 1 of any, rotating who goes
    first: all approaches sample the same moments of a noisy machine (load, frequency, neighbours)."""
    runners = {name: make() for name, make in factories.items()}
    times: dict[str, list[float]] = {name: [] for name in runners}
    names = list(runners)
    try:
        for round_idx in range(1, rounds + 1):
            shift = round_idx % len(names)
            for name in names[shift:] + names[:shift]:
                times[name].append(runners[name].round(round_idx))
    finally:
        for runner in runners.values():
            runner.close()
    return {name: runners[name].result(times[name]) for name in names}


def fedcli_rounds(
    model: str,
    cohort: int,
    rounds: int,
    executor: str,
    threads: int,
    precision: str = "fp32",
    compile: bool = False,
) -> dict[str, object]:
    """Time `rounds` FedAvg rounds of fedcli with one executor alone; returns times and what ran."""
    return interleaved(
        {"one": lambda: FedcliRunner(model, cohort, executor, threads, precision, compile)}, rounds
    )["one"]


def cohort_examples(cohort: int, rounds: int) -> list[int]:
    """Examples trained per round (one epoch) for the cohorts of seed 0, rounds 1..R."""
    sizes = np.array([len(ix) for ix in TASKS["femnist"].load(TaskOptions()).client_indices])
    return [
        int(sizes[sample_cohort(len(sizes), cohort, seed=0, round_idx=r)].sum()) for r in range(1, rounds + 1)
    ]


def flower_python() -> str | None:
    """Return an interpreter that can import flwr (this one, or ./.venv-flower), or None."""
    candidates = [sys.executable, str(Path(".venv-flower/bin/python").absolute())]
    for python in candidates:
        if (
            Path(python).exists()
            and subprocess.run(
                [python, "-c", "import flwr, ray"], capture_output=True, timeout=120
            ).returncode
            == 0
        ):
            return python
    return None


def flower_rounds(python: str, model: str, cohort: int, rounds: int, timeout: float) -> dict[str, object]:
    """Run tests/benchmarks/flower_sim.py in `python`; returns its per-round times and start-up."""
    script = Path(__file__).with_name("flower_sim.py")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "flower.json"
        started = time.time()
        proc = subprocess.run(
            [
                python,
                str(script),
                "--model",
                model,
                "--clients-per-round",
                str(cohort),
                "--rounds",
                str(rounds),
                "--out",
                str(out),
                "--t0",
                repr(started),
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "RAY_DEDUP_LOGS": "0", "PYTHONWARNINGS": "ignore"},
        )
        if proc.returncode != 0 or not out.exists():
            return {"error": (proc.stderr or proc.stdout)[-2000:]}
        result = json.loads(out.read_text())
    result["median_s"] = median_after_first(result["round_s"])
    return result
