"""Benchmark (issue 37 item 3): fedcli on user-style models against the plain per-client PyTorch loop and Flower.

    .venv/bin/python -m tests.benchmarks.bench_user_models --out bench-results          # `make bench` runs it
    .venv/bin/python -m tests.benchmarks.bench_user_models --quick --out /tmp/bu        # tests the harness only

Models: tests/byo/stock_models/ as a user writes them with stock torch layers: the BatchNorm + Dropout CNN, the GRU
classifier and the small nn.TransformerEncoder (ResNet-18 is left out: one round of 50 clients takes minutes on a
CPU for every approach alike). Workload: the bundled FEMNIST writers (105 clients, 62 classes), FedAvg, 1 local
epoch, batch 20, SGD lr 0.01, C = 10 and 50 clients a round (the cohorts of seed 0); seconds per round = median
of rounds 2..R (round 1 holds warm-up), evaluation excluded. Three approaches, timed in this one invocation:

- fedcli: `--model file.py:factory --executor auto` (whatever back end auto picks, named in the output), through
  the engine's round (`run_round`), as tests/benchmarks/workloads.py times the built-in models;
- the plain per-client PyTorch loop, written here as research code writes it: per client deepcopy the global
  model, torch.optim.SGD, shuffled minibatches from tensors already in memory, model.train(), the weighted
  average of the state dicts (BatchNorm's running statistics included);
- Flower's simulation engine (`start_simulation`, Ray, 1 CPU per client, FedAvg) with the same client loop,
  run by this file with `--flower-worker` in the interpreter that has flwr (workloads.flower_python: this one
  or .venv-flower); "not measured" where none has it.

fedcli and the plain loop run interleaved round by round (workloads.interleaved) so that both meet the same
machine; the ratios are plain loop / fedcli and Flower / fedcli (> 1: fedcli is faster). Targets (issue 37):
>= 2x the plain loop for the CNN and the transformer at 50 clients, not slower than the loop (>= 1x) for the
RNN. Writes OUT/user_models.json and OUT/user_models.md (the table, the machine, the load average) and exits 1
when a target is missed.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from tests.benchmarks import probes, workloads
from tests.byo.stock_models import MODELS

BENCH_MODELS = ("bn_cnn", "gru", "transformer")
KIND = {"bn_cnn": "cnn", "gru": "rnn", "transformer": "transformer"}
TARGET = {"cnn": 2.0, "transformer": 2.0, "rnn": 1.0}  # plain loop / fedcli at 50 clients
LR, BATCH = workloads.LR, workloads.BATCH


def build_model(ref: str) -> torch.nn.Module:
    """The user's factory called as fedcli calls it on FEMNIST (num_classes=62, input_shape=(1, 28, 28))."""
    path, _, name = ref.rpartition(":")
    spec = importlib.util.spec_from_file_location(f"bench_user_{Path(path).stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)(num_classes=62, input_shape=(1, 28, 28))


def femnist_clients() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    from fedcli.datasets.registry import TASKS
    from fedcli.datasets.tasks import TaskOptions

    task = TASKS["femnist"]
    data = task.load(TaskOptions())
    return (
        [task.prepare(data.x[ix]) for ix in data.client_indices],
        [data.y[ix] for ix in data.client_indices],
    )


def local_sgd(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int) -> None:
    """One epoch of minibatch SGD as a tutorial writes it (model.train(), zero_grad, backward, step)."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    for first in range(0, len(y), BATCH):
        idx = order[first : first + BATCH]
        if len(idx) < 2:  # BatchNorm1d cannot train on one example (a tutorial's loader: drop_last)
            continue
        opt.zero_grad()
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()


class PlainUserRunner:
    """The plain per-client PyTorch loop on a user's model (module docstring), one round at a time."""

    def __init__(self, ref: str, cohort: int, threads: int) -> None:
        self.xs, self.ys = femnist_clients()
        torch.manual_seed(0)
        self.model, self.cohort, self.threads = build_model(ref), cohort, threads

    def round(self, round_idx: int) -> float:
        from fedcli.engine.machine import intra_op_threads
        from fedcli.engine.seeding import sample_cohort

        with intra_op_threads(self.threads):
            start = time.perf_counter()
            state = self.model.state_dict()
            summed = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in state.items()}
            total = 0
            for client in sample_cohort(len(self.xs), self.cohort, seed=0, round_idx=round_idx):
                local = copy.deepcopy(self.model)
                local_sgd(local, self.xs[client], self.ys[client], round_idx * 10_000 + int(client))
                n = len(self.ys[client])
                for k, v in local.state_dict().items():
                    summed[k] += n * v.double()
                total += n
            self.model.load_state_dict({k: (v / total).to(state[k].dtype) for k, v in summed.items()})
            return time.perf_counter() - start

    def result(self, times: list[float]) -> dict[str, object]:
        return {"round_s": times, "median_s": workloads.median_after_first(times), "threads": self.threads}

    def close(self) -> None:
        pass


def flower_worker(ref: str, cohort: int, rounds: int, out: Path, t0: float) -> None:
    """Flower's start_simulation with the plain client loop on the user's model (run in flwr's interpreter)."""
    import flwr as fl
    from flwr.common import ndarrays_to_parameters

    xs, ys = femnist_clients()
    torch.manual_seed(0)
    init = [v.numpy() for v in build_model(ref).state_dict().values()]
    marks: dict[str, list[float]] = {"configure": [], "aggregate": []}

    class UserClient(fl.client.NumPyClient):
        def __init__(self, cid: int) -> None:
            self.cid = cid

        def fit(self, parameters, config):  # noqa: ANN001, ANN201
            model = build_model(ref)
            model.load_state_dict(
                {k: torch.from_numpy(v) for k, v in zip(model.state_dict(), parameters, strict=True)}
            )
            local_sgd(model, xs[self.cid], ys[self.cid], int(time.time()))
            return [v.detach().numpy() for v in model.state_dict().values()], len(ys[self.cid]), {}

    class TimedFedAvg(fl.server.strategy.FedAvg):
        def configure_fit(self, server_round, parameters, client_manager):  # noqa: ANN001, ANN201
            marks["configure"].append(time.time())
            return super().configure_fit(server_round, parameters, client_manager)

        def aggregate_fit(self, server_round, results, failures):  # noqa: ANN001, ANN201
            result = super().aggregate_fit(server_round, results, failures)
            marks["aggregate"].append(time.time())
            return result

    strategy = TimedFedAvg(
        fraction_fit=cohort / len(xs),
        min_fit_clients=cohort,
        min_available_clients=len(xs),
        fraction_evaluate=0.0,
        min_evaluate_clients=0,
        initial_parameters=ndarrays_to_parameters(init),
    )
    fl.simulation.start_simulation(
        client_fn=lambda context: UserClient(int(context.node_config["partition-id"])).to_client(),
        num_clients=len(xs),
        config=fl.server.ServerConfig(num_rounds=rounds),
        strategy=strategy,
        client_resources={"num_cpus": 1, "num_gpus": 0.0},
        ray_init_args={"include_dashboard": False, "ignore_reinit_error": True},
    )
    ends = marks["aggregate"]
    starts = [marks["configure"][0], *ends[:-1]]
    out.write_text(
        json.dumps(
            {
                "round_s": [e - s for s, e in zip(starts, ends, strict=True)],
                "startup_s": marks["configure"][0] - t0,
                "flwr": fl.__version__,
            }
        )
    )


def flower_rounds(python: str, model: str, cohort: int, rounds: int, timeout: float) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "flower.json"
        repo = Path(__file__).resolve().parents[2]
        proc = subprocess.run(
            [
                python,
                "-m",
                "tests.benchmarks.bench_user_models",
                "--flower-worker",
                MODELS[model],
                "--cohort",
                str(cohort),
                "--rounds",
                str(rounds),
                "--worker-out",
                str(out),
                "--t0",
                repr(time.time()),
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=repo,
            env={**os.environ, "RAY_DEDUP_LOGS": "0", "PYTHONWARNINGS": "ignore"},
        )
        if proc.returncode != 0 or not out.exists():
            return {"error": (proc.stderr or proc.stdout)[-2000:]}
        result = json.loads(out.read_text())
    result["median_s"] = workloads.median_after_first(result["round_s"])
    return result


def measure(model: str, cohort: int, rounds: int, threads: int) -> dict[str, Any]:
    ref = MODELS[model]
    timed = workloads.interleaved(
        {
            "fedcli": lambda: workloads.FedcliRunner(ref, cohort, "auto", threads),
            "plain": lambda: PlainUserRunner(ref, cohort, threads),
        },
        rounds,
    )
    fed, plain = timed["fedcli"], timed["plain"]
    return {
        "model": model,
        "kind": KIND[model],
        "cohort": cohort,
        "rounds": rounds,
        "fedcli": fed,
        "plain": plain,
        "vs_plain": float(plain["median_s"]) / float(fed["median_s"]),
    }  # type: ignore[arg-type]


def report(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        f"User-style models (tests/byo/stock_models), FedAvg on the bundled FEMNIST writers, seconds per round "
        f"(median of rounds 2..R); {results['date']}, {m.get('cpu', '?')}, {m.get('cores', '?')} cores, "
        f"{results['threads']} threads, load average {m.get('load_avg')} at the start, "
        f"{results.get('load_avg_end')} at the end.",
        "",
        "| model | clients/round | R | fedcli (auto: back end) | plain loop | Flower | plain / fedcli | "
        "Flower / fedcli | target |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        fed, plain, flower = row["fedcli"], row["plain"], row.get("flower") or {}
        flower_s = f"{flower['median_s']:.3f} s" if "median_s" in flower else "not measured"
        flower_ratio = f"{flower['median_s'] / fed['median_s']:.2f}x" if "median_s" in flower else "-"
        target = (
            f">= {TARGET[row['kind']]:g}x: {'met' if row['vs_plain'] >= TARGET[row['kind']] else 'MISSED'}"
            if row["cohort"] == 50
            else "-"
        )
        lines.append(
            f"| {row['model']} | {row['cohort']} | {row['rounds']} | {fed['median_s']:.3f} s "
            f"({fed['executor']}) | {plain['median_s']:.3f} s | {flower_s} | {row['vs_plain']:.2f}x | "
            f"{flower_ratio} | {target} |"
        )
    lines += [
        "",
        "auto's reasons: "
        + "; ".join(sorted({f"{r['model']}: {r['fedcli']['reason']}" for r in results["rows"]})),
    ]
    if results.get("flower_note"):
        lines += ["", f"Flower: {results['flower_note']}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--quick", action="store_true", help="cohorts of 3, 2 rounds: tests the harness only")
    parser.add_argument("--models", default=",".join(BENCH_MODELS))
    parser.add_argument("--cohorts", default="10,50")
    parser.add_argument("--rounds", type=int, default=3, help="R: rounds per measurement (median of 2..R)")
    parser.add_argument(
        "--threads", type=int, default=None, help="intra-op threads (default: the usable cores)"
    )
    parser.add_argument("--skip-flower", action="store_true")
    parser.add_argument("--flower-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cohort", type=int, default=10, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--t0", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.flower_worker:
        flower_worker(args.flower_worker, args.cohort, args.rounds, args.worker_out, args.t0)
        return 0
    from fedcli.engine.machine import available_cores

    cohorts = [3] if args.quick else [int(c) for c in args.cohorts.split(",")]
    rounds = 2 if args.quick else args.rounds
    threads = args.threads or available_cores()
    results: dict[str, Any] = {
        "machine": {**probes.machine(), "load_avg": os.getloadavg()},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "threads": threads,
        "rows": [],
    }
    python = None if args.skip_flower else workloads.flower_python()
    results["flower_note"] = (
        "skipped (--skip-flower)"
        if args.skip_flower
        else None
        if python
        else "not measured: no interpreter here imports flwr and ray "
        "(`make bench` builds .venv-flower where a package index is reachable)"
    )
    for model in args.models.split(","):
        for cohort in cohorts:
            start = time.perf_counter()
            row = measure(model, cohort, rounds, threads)
            if python:
                row["flower"] = flower_rounds(python, model, cohort, rounds, timeout=1800)
            results["rows"].append(row)
            print(
                f"{model} C={cohort}: fedcli {row['fedcli']['median_s']:.3f} s ({row['fedcli']['executor']}), "
                f"plain {row['plain']['median_s']:.3f} s, plain/fedcli {row['vs_plain']:.2f}x "
                f"[{time.perf_counter() - start:.0f} s]",
                file=sys.stderr,
                flush=True,
            )
    results["load_avg_end"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "user_models.json").write_text(json.dumps(results, indent=1, default=str))
    table = report(results)
    (args.out / "user_models.md").write_text(table)
    print(table)
    missed = [r for r in results["rows"] if r["cohort"] == 50 and r["vs_plain"] < TARGET[r["kind"]]]
    return 1 if missed and not args.quick else 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    raise SystemExit(main())
