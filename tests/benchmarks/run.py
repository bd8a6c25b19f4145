"""`make bench`: fedcli's speed against a plain PyTorch loop, Flower and the FLOP floor.

    .venv/bin/python -m tests.benchmarks.run [--out bench-results] [--quick] [--skip flower,memory]
    .venv/bin/python -m tests.benchmarks.run --only sweeps,startup   # issue 27's table (tests/benchmarks/sweeps.py)

With a CUDA device it also measures the GPU table (tests/benchmarks/gpu.py: fedcli's executors
vs a plain loop on the same GPU vs that GPU's FLOP floor, the GPU named); without one the
report says why that table is skipped.

Writes bench-results/bench.json (every measurement) and bench-results/bench.md (the tables,
each figure beside its target, the machine, the date and the load average) and exits 1 when
a target is missed or could not be measured (Flower missing counts: it is said, not met).
Never part of `make test`. Everything is measured in this one invocation, so ratios compare
runs on the same machine under the same load; absolute seconds move with the load (2x on a
busy machine), so read the load average printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fedcli.datasets.registry import TASKS
from fedcli.datasets.tasks import TaskOptions
from tests.benchmarks import extras, gpu, probes, workloads

WORKLOADS = (("mlp", 10), ("mlp", 50), ("cnn", 10))
# (workload key, rounds R) in full and quick mode; seconds per round = median of rounds 2..R
ROUNDS = {"full": {"mlp-10": 12, "mlp-50": 8, "cnn-10": 5}, "quick": {"mlp-10": 3, "mlp-50": 3, "cnn-10": 2}}
# The speed targets of the GPU-engine issue for the CPU: the MLP >= 10x Flower and >= 3x the plain
# loop, the CNN within 1.2x of its FLOP floor; the other ratios are reported beside their bounds
# (what the reference itself leaves: plain loop / floor, Flower / floor), without a target.
STEPS = ("flower", "workloads", "gpu", "fedpa", "tracking", "startup", "sweeps", "memory")
TARGETS = {
    "vs_flower_mlp": 10.0,
    "vs_plain_mlp": 3.0,
    "vs_floor_cnn": 1.2,
    "startup_s": 3.0,
    "tracking_pct": 5.0,
    "checkpoint_pct": 3.0,
}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def floor_seconds(model: str, examples: float, rates: probes.Throughput) -> dict[str, float]:
    """FLOPs of one round (real examples, forward+backward) and their time at the measured peak."""
    task = TASKS["femnist"]
    data = task.load(TaskOptions())
    torch.manual_seed(0)
    per = probes.flops_per_example(task.models[model](), task.prepare(data.x[:20]), data.y[:20])
    seconds = examples * (per["matmul"] / (rates.gemm * 1e9) + per["conv"] / (rates.conv * 1e9))
    return {
        "flop_per_example": per["total"],
        "conv_share": per["conv"] / per["total"],
        "examples_per_round": examples,
        "gflop_per_round": examples * per["total"] / 1e9,
        "floor_s": seconds,
    }


def workload_approaches(
    model: str, cohort: int, cores: int
) -> dict[str, Callable[[], workloads.FedcliRunner | workloads.PlainRunner]]:
    """Every approach timed on one workload: name -> a factory of its runner (built when timed)."""
    W = workloads

    def fedcli(executor: str, threads: int, **kw: object) -> Callable[[], workloads.FedcliRunner]:
        return lambda: W.FedcliRunner(model, cohort, executor, threads, **kw)  # type: ignore[arg-type]

    approaches: dict[str, Callable[[], workloads.FedcliRunner | workloads.PlainRunner]] = {}
    # every back end of engine/backends/ that can run the workload (docs/architecture.md §3, "Which back
    # ends stay" rests on these columns): auto's picks (fused for the MLP, loop for the CNN) and the opt-in ones
    if (
        model == "mlp"
    ):  # the dense classifier's hand-derived cohort SGD (engine/backends/fused.py), auto's pick
        approaches[f"fedcli fused {cores}t"] = fedcli("fused", cores)
        approaches["fedcli fused 1t"] = fedcli("fused", 1)
    approaches[f"fedcli vmap {cores}t"] = fedcli("vmap", cores)
    approaches[f"fedcli loop {cores}t"] = fedcli("loop", cores)  # the CNN's pick since issue 25
    approaches[f"fedcli process {cores}x1t"] = fedcli("process", cores)  # opt-in since issue 25
    approaches[f"plain loop {cores}t"] = lambda: W.PlainRunner(model, cohort)
    approaches["plain loop 1t"] = lambda: W.PlainRunner(model, cohort, threads=1)
    if model == "cnn":  # one thread: what each worker process of `process` runs
        approaches["fedcli loop 1t"] = fedcli("loop", 1)
    # opt-in --compile: round 1 (the compilation) is excluded like every warm-up; compile_s is shown
    if model == "mlp":  # the vmapped round unrolls every step: minutes for a convolutional model
        approaches[f"fedcli vmap+compile {cores}t"] = fedcli("vmap", cores, compile=True)
    # opt-in --graph (a GPU feature; on a CPU the traced program only drops torch.func's Python)
    approaches[f"fedcli vmap+graph {cores}t"] = fedcli("vmap", cores, graph=True)
    approaches[f"fedcli process+compile {cores}x1t"] = fedcli("process", cores, compile=True)
    if model == "cnn":  # compiled per-client steps in one process: does `process` add anything to --compile?
        approaches[f"fedcli loop+compile {cores}t"] = fedcli("loop", cores, compile=True)
    if model == "cnn":  # opt-in reduced precision: shown, never used for the targets
        approaches[f"fedcli process bf16 {cores}x1t"] = fedcli("process", cores, precision="bf16")
        approaches[f"fedcli loop bf16 {cores}t"] = fedcli("loop", cores, precision="bf16")
    return approaches


def run_workload(
    model: str, cohort: int, rounds: int, reps: int, flower: str | None, rates: probes.Throughput
) -> dict[str, object]:
    """Every approach on one workload, `reps` repetitions; figure = best rep's median.

    Within a repetition the in-process approaches run interleaved round by round
    (workloads.interleaved), then Flower runs in its own process.
    """
    cores = len(os.sched_getaffinity(0))
    approaches = workload_approaches(model, cohort, cores)
    W = workloads
    runs: dict[str, list[dict[str, object]]] = {name: [] for name in approaches}
    if flower is not None:
        runs["Flower (Ray)"] = []
    for rep in range(reps):
        log(f"{model}-{cohort} rep {rep + 1}/{reps}: {len(approaches)} approaches interleaved round by round")
        for name, result in W.interleaved(approaches, rounds).items():
            runs[name].append(result)
        if flower is not None:
            log(f"{model}-{cohort} rep {rep + 1}/{reps}: Flower (Ray)")
            runs["Flower (Ray)"].append(W.flower_rounds(flower, model, cohort, rounds, timeout=900))
    best = {
        name: min((r["median_s"] for r in rs if "median_s" in r), default=None) for name, rs in runs.items()
    }
    auto = W.fedcli_rounds(model, cohort, 1, "auto", cores)  # one round: only the choice is kept
    examples = statistics.mean(W.cohort_examples(cohort, rounds)[1:] or W.cohort_examples(cohort, 1))
    ours = {k: v for k, v in best.items() if k.startswith("fedcli") and "bf16" not in k and v is not None}
    plain = {k: v for k, v in best.items() if k.startswith("plain") and v is not None}
    best_name = min(ours, key=ours.get)  # type: ignore[arg-type]
    return {
        "model": model,
        "cohort": cohort,
        "rounds": rounds,
        "runs": runs,
        "best_s": best,
        "fedcli_best": best_name,
        "fedcli_best_s": ours[best_name],
        "plain_best_s": min(plain.values()),
        "flower_s": best.get("Flower (Ray)"),
        "auto": {"executor": auto["executor"], "reason": auto["reason"]},
        "floor": floor_seconds(model, examples, rates),
    }


def check(
    targets: list[dict[str, object]],
    name: str,
    value: float | None,
    target: float | None,
    *,
    at_most: bool,
    unit: str = "",
    bound: float | None = None,
) -> None:
    """Record a figure against its target (None: reported only, beside its bound when given)."""
    if target is None:
        targets.append(
            {
                "name": name,
                "value": value,
                "target": "reported" if bound is None else f"bound {bound:.3g}{unit}",
                "status": "not measured" if value is None else "reported",
            }
        )
        return
    met = None if value is None else (value <= target if at_most else value >= target)
    targets.append(
        {
            "name": name,
            "value": value,
            "target": f"{'<=' if at_most else '>='} {target:g}{unit}",
            "status": "not measured" if met is None else "met" if met else "MISSED",
        }
    )


def evaluate_targets(results: dict[str, object]) -> list[dict[str, object]]:
    targets: list[dict[str, object]] = []
    for key, w in results.get("workloads", {}).items():
        fedcli, plain, flower = w["fedcli_best_s"], w["plain_best_s"], w["flower_s"]
        floor = w["floor"]["floor_s"]
        mlp = w["model"] == "mlp"
        check(
            targets,
            f"{key}: Flower / fedcli",
            None if flower is None else flower / fedcli,
            TARGETS["vs_flower_mlp"] if mlp else None,
            at_most=False,
            unit="x",
            bound=None if flower is None else flower / floor,
        )
        check(
            targets,
            f"{key}: plain loop / fedcli",
            plain / fedcli,
            TARGETS["vs_plain_mlp"] if mlp else None,
            at_most=False,
            unit="x",
            bound=plain / floor,
        )
        check(
            targets,
            f"{key}: fedcli / FLOP floor",
            fedcli / floor,
            None if mlp else TARGETS["vs_floor_cnn"],
            at_most=True,
            unit="x",
            bound=1.0,
        )
    for row in results.get("fedpa", []):
        if row["paper_pct"] is not None:
            check(
                targets,
                f"FedPA overhead d={row['d']:g}",
                row["overhead_pct"],
                row["paper_pct"],
                at_most=True,
                unit="%",
            )
    for key, cost in (results.get("tracking") or {}).items():
        check(
            targets,
            f"MLflow's cost, {key.replace('_', ' ')} (wall time vs --no-mlflow)",
            cost["overhead_pct"],
            TARGETS["tracking_pct"],
            at_most=True,
            unit="%",
        )
        check(
            targets,
            f"MLflow's cost, {key.replace('_', ' ')}, rounds 1-10",
            cost["overhead_first_pct"],
            TARGETS["tracking_pct"],
            at_most=True,
            unit="%",
        )
    if "checkpoints" in results:
        check(
            targets,
            "default checkpoints' cost on the demo",
            results["checkpoints"]["overhead_pct"],
            TARGETS["checkpoint_pct"],
            at_most=True,
            unit="%",
        )
    if "startup" in results:
        check(
            targets,
            "start-up to round 1 (fedcli train, defaults)",
            results["startup"]["default"].get("to_first_round_s"),
            TARGETS["startup_s"],
            at_most=True,
            unit=" s",
        )
    if "sweeps" in results:
        from tests.benchmarks.sweeps import TARGETS as SWEEP_TARGETS

        for key, bound in SWEEP_TARGETS.items():
            check(
                targets, f"sweep {key}", results["sweeps"]["ratios"].get(key), bound, at_most=True, unit="x"
            )
    return targets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--quick", action="store_true", help="tiny settings, to test the harness")
    parser.add_argument(
        "--skip",
        default="",
        help="comma list of: flower, workloads, gpu, fedpa, tracking, startup, sweeps, memory",
    )
    parser.add_argument("--only", default="", help="comma list of the steps to run (the others skipped)")
    parser.add_argument(
        "--reps",
        type=int,
        default=None,
        help="repetitions per approach (default: 3 for the MLP workloads, which take seconds, and 2 "
        "for the CNN; quick 1)",
    )
    args = parser.parse_args(argv)
    skip, mode = set(filter(None, args.skip.split(","))), "quick" if args.quick else "full"
    if args.only:
        skip |= set(STEPS) - set(filter(None, args.only.split(",")))
    reps = args.reps or (1 if args.quick else 2)
    mlp_reps = args.reps or (
        1 if args.quick else 3
    )  # the machine is noisy: more repetitions where they are cheap
    started = time.time()
    results: dict[str, object] = {
        "machine": probes.machine(),
        "mode": mode,
        "reps": reps if mlp_reps == reps else f"{mlp_reps} (MLP), {reps} (CNN)",
    }
    results["machine"]["gpu"] = None if gpu.unavailable() else gpu.gpu_info()["name"]
    log(f"machine: {results['machine']}")
    flower = None if "flower" in skip else workloads.flower_python()
    results["flower"] = {
        "python": flower,
        "note": None
        if flower
        else (
            "skipped (--skip flower)"
            if "flower" in skip
            else "flwr[simulation] is not importable here or in .venv-flower: the Flower column is not "
            "measured (pip install -e '.[bench]' in a separate environment)"
        ),
    }
    if "workloads" not in skip:
        log("throughput probes")
        rates = probes.throughput(0.3 if args.quick else 2.0)
        results["throughput_gflops"] = {**rates.__dict__, "gemm_best": rates.gemm, "conv_best": rates.conv}
        results["workloads"] = {}
        for model, cohort in WORKLOADS:
            key = f"{model}-{cohort}"
            results["workloads"][key] = run_workload(
                model, cohort, ROUNDS[mode][key], mlp_reps if model == "mlp" else reps, flower, rates
            )
            _write(args.out, results)
    if "gpu" not in skip:
        log("GPU workloads" if gpu.unavailable() is None else f"GPU: {gpu.unavailable()}")
        results["gpu"] = gpu.run_gpu_workloads(mode, mlp_reps)
        _write(args.out, results)
    if "fedpa" not in skip:
        log("FedPA overhead")
        dims = [100, 1_000] if args.quick else [100, 1_000, 10_000, 100_000, 1_000_000]
        results["fedpa"] = extras.fedpa_overhead(dims, repeats=2 if args.quick else 5)
    if "tracking" not in skip:
        log("tracking overhead")
        results["tracking"] = extras.tracking_share(5 if args.quick else 30, extras.tmpdir())
        log("checkpoint overhead")
        results["checkpoints"] = extras.checkpoint_cost(5 if args.quick else 30, extras.tmpdir())
    if "startup" not in skip:
        log("start-up")
        results["startup"] = {
            "default": extras.startup(["--rounds", "1"], extras.tmpdir()),
            "no_mlflow": extras.startup(["--rounds", "1", "--no-mlflow"], extras.tmpdir()),
            # issue 27: `fedcli train --rounds 20` (FEMNIST writers, MLP) to round 1 and to its end, MLflow on/off
            "mlp_20": extras.startup(["--model", "mlp", "--rounds", "20"], extras.tmpdir()),
            "mlp_20_no_mlflow": extras.startup(
                ["--model", "mlp", "--rounds", "20", "--no-mlflow"], extras.tmpdir()
            ),
            "flower": {"to_first_round_s": _flower_startup(results)},
        }
    if "sweeps" not in skip:
        from tests.benchmarks import sweeps

        log("sweeps (issue 27's table)")
        results["sweeps"] = sweeps.sweep_table(mode, extras.tmpdir())
        _write(args.out, results)
    if "memory" not in skip:
        log("memory")
        results["memory"] = (
            extras.memory(num_clients=400, per_client=50, visits=60) if args.quick else extras.memory()
        )
    results["targets"] = evaluate_targets(results)
    results["machine"]["load_avg_end"] = os.getloadavg()
    results["wall_s"] = time.time() - started
    _write(args.out, results)
    print((args.out / "bench.md").read_text())
    missed = [t for t in results["targets"] if t["status"] != "met"]
    return 1 if missed else 0


def _flower_startup(results: dict[str, object]) -> float | None:
    values = [
        r.get("startup_s")
        for w in results.get("workloads", {}).values()
        for r in w["runs"].get("Flower (Ray)", [])
    ]
    values = [v for v in values if v is not None]
    return min(values) if values else None


def _write(out: Path, results: dict[str, object]) -> None:
    from tests.benchmarks.report import markdown

    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "bench.md").write_text(markdown(results))


if __name__ == "__main__":
    sys.exit(main())
