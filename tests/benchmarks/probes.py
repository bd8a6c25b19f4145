"""Machine probes for `make bench`: matmul/conv throughput on all cores, FLOPs per example.

The FLOP floor of a round is its FLOPs divided by the throughput this machine reaches on
the same kind of operation, measured in the same invocation (reference/performance.md §4):
matmul FLOPs / best GEMM rate + convolution FLOPs / best convolution rate, where "best" is
the faster of one process with P intra-op threads and P single-thread processes at once.
"""

from __future__ import annotations

import multiprocessing
import os
import platform
import subprocess
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

GEMM = 2048  # square fp32 GEMM (the machine's ceiling for dense matmul)
CONV = (200, 32, 26, 26, 64, 3)  # conv2 of the Reddi CNN on 200 images: N, C_in, H, W, C_out, k


def machine() -> dict[str, object]:
    """Return what identifies the machine and the moment: CPU, cores, load, versions, date."""
    model = platform.processor()
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "cpu": model,
        "cores": len(os.sched_getaffinity(0)),
        "load_avg": os.getloadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def _rate(kind: str, threads: int, seconds: float) -> float:
    """GFLOP/s of `kind` (gemm | conv) with `threads` intra-op threads, best of repeated calls."""
    torch.set_num_threads(threads)
    if kind == "gemm":
        a, b = torch.randn(GEMM, GEMM), torch.randn(GEMM, GEMM)
        flops = 2.0 * GEMM**3

        def op() -> None:
            torch.mm(a, b)
    else:
        n, c_in, h, w, c_out, k = CONV
        x, weight = torch.randn(n, c_in, h, w), torch.randn(c_out, c_in, k, k)
        flops = 2.0 * n * (h - k + 1) * (w - k + 1) * c_out * c_in * k * k

        def op() -> None:
            F.conv2d(x, weight)

    op()
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        op()
        best = min(best, time.perf_counter() - start)
    return flops / best / 1e9


def _rate_in_child(args: tuple[str, float, float]) -> float:
    kind, seconds, start_at = args
    torch.set_num_threads(1)
    _rate(kind, 1, 0.2)  # warm up while the other processes start
    time.sleep(max(0.0, start_at - time.time()))
    return _rate(kind, 1, seconds)


@dataclass(frozen=True)
class Throughput:
    gemm_1t: float  # GFLOP/s, one thread
    gemm_threads: float  # one process, all cores as intra-op threads
    gemm_procs: float  # sum over one single-thread process per core, run at once
    conv_1t: float
    conv_threads: float
    conv_procs: float

    @property
    def gemm(self) -> float:
        return max(self.gemm_threads, self.gemm_procs, self.gemm_1t)

    @property
    def conv(self) -> float:
        return max(self.conv_threads, self.conv_procs, self.conv_1t)


def throughput(seconds: float = 2.0) -> Throughput:
    """Measure GEMM and convolution GFLOP/s: 1 thread, P threads, P processes x 1 thread."""
    cores = len(os.sched_getaffinity(0))
    previous = torch.get_num_threads()
    rates = {f"{kind}_1t": _rate(kind, 1, seconds) for kind in ("gemm", "conv")}
    rates.update({f"{kind}_threads": _rate(kind, cores, seconds) for kind in ("gemm", "conv")})
    torch.set_num_threads(previous)
    with multiprocessing.get_context("spawn").Pool(cores) as pool:
        for kind in ("gemm", "conv"):
            start_at = time.time() + 8.0  # every child has imported torch and warmed up by then
            rates[f"{kind}_procs"] = sum(pool.map(_rate_in_child, [(kind, seconds, start_at)] * cores))
    return Throughput(**rates)


def flops_per_example(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """Count one SGD step's forward+backward FLOPs per example, split into matmul and conv.

    Counted by torch.utils.flop_counter.FlopCounterMode on a real step (dropout on), divided
    by the batch size; elementwise ops are not counted (they are not FLOP-bound).
    """
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        out = model(x, key=torch.tensor(1))
        F.cross_entropy(out, y).backward()
    conv = sum(v for op, v in counter.get_flop_counts()["Global"].items() if "convolution" in str(op))
    total = counter.get_total_flops()
    return {"total": total / len(x), "conv": conv / len(x), "matmul": (total - conv) / len(x)}
