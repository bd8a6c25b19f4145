"""Benchmark: `fedcli report` on 50 runs x 1,500 rounds (not part of `make test`).

Builds a SQLite store with 50 runs (5 configurations x 10 seeds; FedAvg and FedPA with two
rho values and two client learning rates) of 1,500 rounds each and 8 metric keys per round
(600k metric rows), then times the report three ways:

- the phases in-process: `build_report` (store read + numbers), markdown, the PNGs;
- the whole command in-process (`CliRunner`, imports warm);
- the whole command as a fresh process (`python -m fedcli report ...`, imports included).

Run:  .venv/bin/python tests/benchmarks/bench_report.py --out bench_report.json
The JSON holds wall and CPU seconds (CPU time is what an unshared core would take; on a
busy machine wall time is longer) and the sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from sqlalchemy import create_engine, insert

from fedcli.config.build import build_config
from fedcli.tracking.store.schema import RoundMetric
from fedcli.tracking.store.sql_store import SqlStore

NUM_SEEDS, NUM_ROUNDS = 10, 1500
CONFIGS = [
    ("fedavg", {}, 0.02),
    ("fedavg", {}, 0.05),
    ("fedpa", {"rho": 0.01, "burn_in_rounds": 100}, 0.02),
    ("fedpa", {"rho": 0.1, "burn_in_rounds": 100}, 0.02),
    ("fedpa", {"rho": 0.1, "burn_in_rounds": 100}, 0.05),
]
REPORT_ARGS = [
    "--metric",
    "accuracy",
    "--thresholds",
    "0.84,0.86",
    "--at",
    "500,1500",
    "--window",
    "100",
    "--smooth",
    "10",
]


def curves(rng: np.random.Generator, speed: float) -> dict[str, np.ndarray]:
    """Plausible per-round metrics for rounds 0..NUM_ROUNDS (round 0 has eval metrics only)."""
    r = np.arange(NUM_ROUNDS + 1, dtype=np.float64)
    acc = 0.88 * (1 - np.exp(-r / (120 / speed))) + rng.normal(0, 0.01, r.size)
    return {
        "eval/accuracy": acc,
        "eval/loss": 2.5 * np.exp(-r / 200) + 0.4 + rng.normal(0, 0.02, r.size),
        "train/loss": 2.4 * np.exp(-r / 180) + 0.3,
        "comm/bytes_up": np.full(r.size, 8.4e6),
        "comm/bytes_down": np.full(r.size, 8.4e6),
        "time/round_s": 0.03 + rng.random(r.size) * 0.01,
        "server/pseudo_grad_norm": rng.random(r.size),
        "client/delta_norm": rng.random(r.size),
    }


def populate(url: str) -> int:
    """Create the 50 runs through the store API, then bulk-insert their metric rows."""
    rows = []
    with SqlStore(url) as store:
        for index, (algo, hp, lr) in enumerate(CONFIGS):
            for seed in range(NUM_SEEDS):
                cfg = build_config(
                    overrides={
                        "algorithm.name": algo,
                        "data.task": "femnist",
                        "seed": seed,
                        "train.rounds": NUM_ROUNDS,
                        "train.client_lr": lr,
                    },
                    hp=hp,
                )
                run_id = store.start_run(
                    experiment="bench",
                    run_name=None,
                    config=cfg.to_dict(),
                    algo=algo,
                    task="femnist",
                    seed=seed,
                    tags={"fedcli.config_hash": cfg.config_hash},
                    fedcli_version="bench",
                    torch_version="bench",
                    git_commit=None,
                )
                rng = np.random.default_rng(1000 * index + seed)
                for key, values in curves(rng, speed=1.0 + 0.2 * index).items():
                    first = 0 if key.startswith("eval/") else 1
                    rows += [
                        {"run_id": run_id, "round_idx": r, "key": key, "value": float(values[r])}
                        for r in range(first, NUM_ROUNDS + 1)
                    ]
                store.end_run(run_id, "finished")
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(insert(RoundMetric), rows)
    engine.dispose()
    return len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench_report.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        url = f"sqlite:///{folder / 'bench.db'}"
        start = time.perf_counter()
        num_rows = populate(url)
        populate_s = time.perf_counter() - start

        from typer.testing import CliRunner

        from fedcli.cli.main import app
        from fedcli.tracking.report import plots
        from fedcli.tracking.report.build import build_report
        from fedcli.tracking.report.model import ReportSpec
        from fedcli.tracking.report.render import render_markdown

        spec = ReportSpec(experiments=("bench",), metric="accuracy", thresholds=(0.84, 0.86), at=(500, 1500))
        c0, t0 = time.process_time(), time.perf_counter()
        with SqlStore(url) as store:
            built = build_report(store, spec)
        c1, t1 = time.process_time(), time.perf_counter()
        figures = plots.report_figures(built, folder / "phases" / "report.md")
        c2, t2 = time.process_time(), time.perf_counter()
        render_markdown(built, figures)
        c3, t3 = time.process_time(), time.perf_counter()
        phases = {
            "build_report_s": t1 - t0,
            "figures_s": t2 - t1,
            "markdown_s": t3 - t2,
            "build_report_cpu_s": c1 - c0,
            "figures_cpu_s": c2 - c1,
            "markdown_cpu_s": c3 - c2,
        }

        command = ["report", "--experiment", "bench", *REPORT_ARGS, "--store", url, "--output"]
        c4, t4 = time.process_time(), time.perf_counter()
        result = CliRunner().invoke(app, [*command, str(folder / "inproc" / "report.md")])
        in_process_s, in_process_cpu_s = time.perf_counter() - t4, time.process_time() - c4
        assert result.exit_code == 0, result.output
        children, t5 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "fedcli", "-q", *command, str(folder / "proc" / "report.md")],
            check=True,
            capture_output=True,
        )
        subprocess_s = time.perf_counter() - t5
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess_cpu_s = (after.ru_utime + after.ru_stime) - (children.ru_utime + children.ru_stime)
        same = (folder / "inproc" / "report.md").read_text() == (
            folder / "proc" / "report.md"
        ).read_text().replace("/proc/", "/inproc/")
    doc = {
        "runs": len(CONFIGS) * NUM_SEEDS,
        "rounds": NUM_ROUNDS,
        "metric_rows": num_rows,
        "groups": len(CONFIGS),
        "populate_s": round(populate_s, 2),
        **{k: round(v, 3) for k, v in phases.items()},
        "command_in_process_s": round(in_process_s, 3),
        "command_in_process_cpu_s": round(in_process_cpu_s, 3),
        "command_subprocess_s": round(subprocess_s, 3),
        "command_subprocess_cpu_s": round(subprocess_cpu_s, 3),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "cpu_cores": os.cpu_count(),
        "same_markdown_in_and_out_of_process": same,
    }
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
