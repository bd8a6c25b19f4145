"""`make bench` on a GPU: fedcli's executors against a plain PyTorch loop on the same GPU and
against the FLOP floor of that GPU.

The same FedAvg workloads as the CPU tables (FEMNIST writers, 1 epoch, batch 20, SGD lr 0.01)
with `--device cuda`, plus the MLP at 100 clients, where the `auto` rule for CUDA switches from
fused to vmap (engine/backends/fused.py, `prefers`). fp32 throughout: `--precision fp32` turns
TF32 off for matmuls and cuDNN, and the floor's probes run with TF32 off too, so the floor is the
GPU's fp32 rate. Seconds per round = median of rounds 2..R; every round ends with a
torch.cuda.synchronize (run_round's, and the plain loop's own).

`fedcli vmap + graph` is `--graph` (engine/backends/graphed.py: the cohort update captured once and replayed
as one CUDA graph; its build time, in round 1, is kept as build_s). The CNN also runs with
`--precision tf32` beside a plain loop with TF32 on, since TF32 is only used where asked. The
issue's targets (GPU_TARGETS, GPU_VS_PLAIN) are checked on the --graph figures and listed under
the table.

Without a CUDA device everything here returns {"skipped": reason}, and the report says so.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tests.benchmarks import probes, workloads

GPU_WORKLOADS = (("mlp", 10), ("mlp", 100), ("cnn", 10), ("cnn", 100))
GPU_ROUNDS = {"full": 8, "quick": 3}
# The GPU-engine issue's targets, seconds per whole round (aggregation included), and the
# speed-up over the plain GPU loop at the same precision that every workload must reach.
GPU_TARGETS = {
    ("mlp-10", "fp32"): 0.002,
    ("mlp-100", "fp32"): 0.005,
    ("cnn-10", "fp32"): 0.012,
    ("cnn-10", "tf32"): 0.006,
    ("cnn-100", "fp32"): 0.100,
    ("cnn-100", "tf32"): 0.050,
}
GPU_VS_PLAIN = 20.0


def unavailable() -> str | None:
    """Why the GPU table cannot be measured here, or None where it can."""
    if not torch.cuda.is_available():
        return "no CUDA device here (torch.cuda.is_available() is False), so the GPU table is skipped"
    return None


def gpu_info() -> dict[str, object]:
    props = torch.cuda.get_device_properties(0)
    return {
        "name": torch.cuda.get_device_name(0),
        "capability": f"{props.major}.{props.minor}",
        "memory_gib": round(props.total_memory / 2**30, 1),
        "cuda": torch.version.cuda,
    }


def _rate(op: Callable[[], torch.Tensor], flops: float, seconds: float) -> float:
    """GFLOP/s of op on the GPU: best of repeated timed calls (CUDA events), after a warm-up."""
    for _ in range(3):
        op()
    torch.cuda.synchronize()
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        op()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return flops / best / 1e9


def gpu_throughput(seconds: float) -> dict[str, float]:
    """fp32 GEMM (8192^2) and convolution (the CPU probe's shape x 8 images) GFLOP/s, TF32 off."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        n = 8192
        a, b = torch.randn(n, n, device="cuda"), torch.randn(n, n, device="cuda")
        gemm = _rate(lambda: torch.mm(a, b), 2.0 * n**3, seconds)
        batch, c_in, h, w, c_out, k = probes.CONV
        batch *= 8
        x, weight = (
            torch.randn(batch, c_in, h, w, device="cuda"),
            torch.randn(c_out, c_in, k, k, device="cuda"),
        )
        conv = _rate(
            lambda: F.conv2d(x, weight),
            2.0 * batch * (h - k + 1) * (w - k + 1) * c_out * c_in * k * k,
            seconds,
        )
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    return {"gemm": gemm, "conv": conv}


class OneBlockFused(workloads.FedcliRunner):
    """fused with the whole cohort in one block: fused.BLOCK_BYTES sizes blocks for a CPU's cache,
    which a GPU does not need (the auto rule for CUDA was measured with the blocks)."""

    def round(self, round_idx: int) -> float:
        from fedcli.engine.backends import fused

        saved, fused.BLOCK_BYTES = fused.BLOCK_BYTES, 1 << 40
        try:
            return super().round(round_idx)
        finally:
            fused.BLOCK_BYTES = saved


def run_gpu_workloads(mode: str, reps: int) -> dict[str, object]:
    """Every GPU approach on every GPU workload (interleaved round by round, `reps` repetitions,
    best repetition's median), the auto choice and the GPU's floor; {"skipped": why} without CUDA."""
    from tests.benchmarks.run import floor_seconds, log

    reason = unavailable()
    if reason is not None:
        return {"skipped": reason}
    W = workloads
    info = gpu_info()
    log(f"GPU: {info['name']} (compute capability {info['capability']}, {info['memory_gib']} GiB)")
    rates = gpu_throughput(0.5 if mode == "quick" else 2.0)
    rounds = GPU_ROUNDS[mode]
    out: dict[str, object] = {"device": info, "throughput_gflops": rates, "workloads": {}}
    for model, cohort in GPU_WORKLOADS:
        key = f"{model}-{cohort}"

        def fedcli(
            executor: str, model: str = model, cohort: int = cohort, **kw: object
        ) -> Callable[[], workloads.FedcliRunner]:
            return lambda: W.FedcliRunner(
                model, cohort, executor, torch.get_num_threads(), device="cuda", **kw
            )  # type: ignore[arg-type]

        def plain(
            precision: str, model: str = model, cohort: int = cohort
        ) -> Callable[[], workloads.PlainRunner]:
            return lambda: W.PlainRunner(model, cohort, device="cuda", precision=precision)

        approaches: dict[str, Callable[[], workloads.FedcliRunner | workloads.PlainRunner]] = {}
        approaches["fedcli loop"] = fedcli("loop")
        if model == "mlp":
            approaches["fedcli fused"] = fedcli("fused")
            approaches["fedcli fused, one block"] = lambda model=model, cohort=cohort: OneBlockFused(
                model, cohort, "fused", torch.get_num_threads(), device="cuda"
            )
        approaches["fedcli vmap"] = fedcli("vmap")
        approaches["fedcli vmap + graph"] = fedcli("vmap", graph=True)
        approaches["plain GPU loop"] = plain("fp32")
        if model == "cnn":  # TF32 only where asked (--precision tf32), compared with the plain loop in TF32
            approaches["fedcli vmap + graph, tf32"] = fedcli("vmap", graph=True, precision="tf32")
            approaches["plain GPU loop, tf32"] = plain("tf32")
        runs: dict[str, list[dict[str, object]]] = {name: [] for name in approaches}
        for rep in range(reps):
            log(f"GPU {key} rep {rep + 1}/{reps}: {len(approaches)} approaches interleaved round by round")
            for name, result in W.interleaved(approaches, rounds).items():
                runs[name].append(result)
        best = {name: min(r["median_s"] for r in rs) for name, rs in runs.items()}
        ours = {k: v for k, v in best.items() if k.startswith("fedcli") and "tf32" not in k}
        auto = W.interleaved({"auto": fedcli("auto")}, 1)["auto"]  # one round: only the choice is kept
        examples = statistics.mean(W.cohort_examples(cohort, rounds)[1:] or W.cohort_examples(cohort, 1))
        fastest = min(ours, key=ours.get)  # type: ignore[arg-type]
        out["workloads"][key] = {  # type: ignore[index]
            "model": model,
            "cohort": cohort,
            "rounds": rounds,
            "runs": runs,
            "best_s": best,
            "fedcli_best": fastest,
            "fedcli_best_s": ours[fastest],
            "plain_s": best["plain GPU loop"],
            "auto": {"executor": auto["executor"], "reason": auto["reason"]},
            "floor": floor_seconds(model, examples, probes_rates(rates)),
            "build_s": {
                name: [r.get("compile_s") for r in rs] for name, rs in runs.items() if "graph" in name
            },
        }
    out["targets"] = gpu_targets(out["workloads"])  # type: ignore[arg-type]
    return out


def gpu_targets(work: dict[str, dict[str, object]]) -> list[dict[str, object]]:
    """Each workload's --graph figure (fp32, and tf32 for the CNN) against the issue's targets:
    seconds per round, and the speed-up over the plain GPU loop at the same precision."""
    rows: list[dict[str, object]] = []
    for key, w in work.items():
        best: dict[str, float] = w["best_s"]  # type: ignore[assignment]
        for precision in ("fp32", "tf32"):
            suffix = "" if precision == "fp32" else ", tf32"
            ours, plain = best.get(f"fedcli vmap + graph{suffix}"), best.get(f"plain GPU loop{suffix}")
            target = GPU_TARGETS.get((key, precision))
            if ours is None or target is None:
                continue
            rows.append(
                {
                    "name": f"{key} {precision}: seconds per round (--graph)",
                    "value": ours,
                    "target": f"<= {target:g}",
                    "status": "met" if ours <= target else "MISSED",
                }
            )
            if plain is not None:
                rows.append(
                    {
                        "name": f"{key} {precision}: plain GPU loop / --graph",
                        "value": plain / ours,
                        "target": f">= {GPU_VS_PLAIN:g}x",
                        "status": "met" if plain / ours >= GPU_VS_PLAIN else "MISSED",
                    }
                )
    return rows


def probes_rates(rates: dict[str, float]) -> probes.Throughput:
    """The GPU's rates in the shape floor_seconds takes (its best GEMM and convolution rates)."""
    return probes.Throughput(
        gemm_1t=rates["gemm"],
        gemm_threads=rates["gemm"],
        gemm_procs=rates["gemm"],
        conv_1t=rates["conv"],
        conv_threads=rates["conv"],
        conv_procs=rates["conv"],
    )


def markdown(gpu: dict[str, object] | None) -> list[str]:
    """The GPU section of bench.md: the table, or the reason it was skipped."""
    if gpu is None:
        return []
    if "skipped" in gpu:
        return ["## GPU", "", f"Skipped: {gpu['skipped']}.", ""]
    d, r = gpu["device"], gpu["throughput_gflops"]
    lines = [
        f"## GPU: {d['name']} (compute capability {d['capability']}, {d['memory_gib']} GiB, CUDA {d['cuda']})",
        "",
        "Seconds per round with `--device cuda`, fp32 (TF32 off), median of rounds 2..R, best repetition. "
        f"Measured now: fp32 GEMM {r['gemm'] / 1e3:.1f} TFLOP/s, convolution {r['conv'] / 1e3:.1f} TFLOP/s; "
        "the floor is the round's counted FLOPs at those rates.",
        "",
    ]
    work = gpu["workloads"]
    names = list(dict.fromkeys(n for w in work.values() for n in w["best_s"]))
    lines += [
        "| workload | floor s | " + " | ".join(names) + " | plain / fedcli best | fedcli best / floor "
        "| auto picks |",
        "|---|---|" + "---|" * len(names) + "---|---|---|",
    ]
    for key, w in work.items():
        floor_s, fastest = w["floor"]["floor_s"], w["fedcli_best_s"]
        cells = " | ".join(f"{w['best_s'][n]:.3g}" if n in w["best_s"] else "—" for n in names)
        lines.append(
            f"| {key} (R={w['rounds']}) | {floor_s:.3g} | {cells} | {w['plain_s'] / fastest:.2f}x | "
            f"{fastest / floor_s:.2f}x | {w['auto']['executor']} |"
        )
    if gpu.get("targets"):
        lines += [
            "",
            "Targets (reported here, not part of make bench's exit status):",
            "",
            "| target | value | required | status |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {t['name']} | {t['value']:.3g} | {t['target']} | {t['status']} |" for t in gpu["targets"]
        ]
    return lines + [""]
