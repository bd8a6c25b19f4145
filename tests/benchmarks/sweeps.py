"""The sweep table of issue 27 (`make bench` step `sweeps`): what a sweep costs beside its training.

    .venv/bin/python -m tests.benchmarks.run --only sweeps,startup

The workload: 6 trials = {fedavg, fedprox mu=0.01} x seeds {0, 1, 2}, FEMNIST writers (the natural
partition), the MLP, 20 rounds per trial, defaults otherwise (MLflow on). Measured in one
invocation, each on a fresh --root: `fedcli sweep` with --workers 1, --workers 2 and --workers 1
--no-mlflow, `fedcli train --rounds 20` with and without MLflow, and, where Ray is installed, the
sweep on `--backend ray` (a Ray head on loopback with this machine's CPUs: --workers 1 with 2 CPUs
per trial, --workers 2 with 1). For each: the wall time of the
command, the training inside it (Σ over its runs of the last `time/cum_train_s`, the rounds' own
time), their ratio, and the time from the launch to the first run's creation in the store (its
round 1 follows at once; `fedcli train`'s own time to round 1 is the `startup` step's).

Targets (issue 27): --workers 1 wall <= 2x its Σ training; --workers 2 faster than --workers 1 with a
Σ training within 1.3x of --workers 1's (no oversubscription).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fedcli.tracking.store.sql_store import SqlStore

ROUNDS = {"full": 20, "quick": 2}
SPEC = (
    "experiment: bench-sweep\n"
    "base: {{task: femnist, model: mlp, rounds: {rounds}}}\n"
    "grid: {{algo: [fedavg, fedprox], hp.mu: [0.01]}}\n"
    "seeds: [0, 1, 2]\n"
)
SWEEPS = {
    "workers_1": ["--workers", "1"],
    "workers_2": ["--workers", "2"],
    "workers_1_no_mlflow": ["--workers", "1", "--no-mlflow"],
}
TRAINS = {"train": [], "train_no_mlflow": ["--no-mlflow"]}


def fedcli() -> str:
    return str(Path(sys.executable).with_name("fedcli"))


def trained(root: Path) -> dict[str, Any]:
    """Σ training seconds and the first round's timestamps of the runs under `root`."""
    db = SqlStore(f"sqlite:///{root / 'fedcli.db'}", setup_schema=False)
    records = db.list_runs()
    frame = db.metrics_frame([r.id for r in records], keys=["time/cum_train_s"])
    last = frame.sort_values("round_idx").groupby("run_id")["value"].last()
    return {
        "runs": len(records),
        "finished": sum(r.status == "finished" for r in records),
        "train_s": float(last.sum()),
        "first_created": min((r.created_at.timestamp() for r in records), default=None),
    }


def measure(args: list[str], root: Path) -> dict[str, Any]:
    """Run one command (`fedcli ARGS --root ROOT`); its wall time and the training inside it."""
    root.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("FEDCLI_STORE", "MLFLOW_TRACKING_URI")}
    launched = time.time()
    proc = subprocess.run(
        [fedcli(), "-q", *args, "--root", str(root)],
        capture_output=True,
        text=True,
        env=env,
        timeout=3600,
        cwd=root,
    )
    wall = time.time() - launched
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout)[-1500:]}
    inside = trained(root)
    first = inside.pop("first_created")
    return {
        "wall_s": wall,
        **inside,
        "wall_per_train": wall / inside["train_s"] if inside["train_s"] else None,
        "to_first_run_s": None if first is None else first - launched,
    }


def sweep_table(mode: str, folder: Path) -> dict[str, Any]:
    """Every row of the table, then the ratios the targets read."""
    rounds = ROUNDS[mode]
    spec = folder / "spec.yaml"
    folder.mkdir(parents=True, exist_ok=True)
    spec.write_text(SPEC.format(rounds=rounds))
    rows: dict[str, Any] = {}
    for name, extra in TRAINS.items():
        rows[name] = measure(
            ["train", "--task", "femnist", "--model", "mlp", "--rounds", str(rounds), *extra], folder / name
        )
    for name, extra in SWEEPS.items():
        rows[name] = measure(["sweep", str(spec), *extra], folder / name)
    rows.update(ray_rows(spec, folder))
    if mode == "full":  # for information: the same sweep with 5x the rounds, where the fixed costs weigh less
        longer = folder / "spec_100.yaml"
        longer.write_text(SPEC.format(rounds=100))
        rows["workers_1_100_rounds"] = measure(
            ["sweep", str(longer), "--workers", "1"], folder / "workers_1_100"
        )
    one, two = rows["workers_1"], rows["workers_2"]
    ratios = {}
    if "error" not in one and "error" not in two:
        ratios = {
            "workers_1_wall_per_train": one["wall_per_train"],
            "workers_2_vs_1_wall": two["wall_s"] / one["wall_s"],
            "workers_2_vs_1_train": two["train_s"] / one["train_s"] if one["train_s"] else None,
        }
    return {"rounds": rounds, "rows": rows, "ratios": ratios}


def ray_rows(spec: Path, folder: Path) -> dict[str, Any]:
    """The same sweep on `--backend ray` against a 2-CPU Ray head on loopback (started and stopped
    here; its start is not timed): one actor with 2 CPUs, and two with 1 CPU each. No rows where
    Ray is not installed (`pip install 'fedcli[ray]'`)."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return {}
    from tests.ray_head import ray_head_on_loopback

    rows: dict[str, Any] = {}
    with ray_head_on_loopback(cpus=os.cpu_count() or 2) as address:
        for name, extra in RAY_SWEEPS.items():
            rows[name] = measure(
                ["sweep", str(spec), "--backend", "ray", "--address", address, *extra], folder / name
            )
    return rows


RAY_SWEEPS = {
    "ray_workers_1": ["--workers", "1", "--cpus-per-trial", "2"],
    "ray_workers_2": ["--workers", "2", "--cpus-per-trial", "1"],
}
TARGETS = {"workers_1_wall_per_train": 2.0, "workers_2_vs_1_wall": 1.0, "workers_2_vs_1_train": 1.3}


def markdown(result: dict[str, Any]) -> str:
    """The issue's table: what, wall, training inside it, wall / training."""
    lines = [
        f"### Sweeps ({result['rounds']} rounds per trial; 6 trials; FEMNIST writers, MLP)",
        "",
        "| what | wall (s) | Σ time/cum_train_s (s) | wall / training | launch to first run (s) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, row in result["rows"].items():
        if "error" in row:
            lines.append(
                f"| {name} | error: {row['error'].splitlines()[-1] if row['error'] else '?'} | | | |"
            )
            continue
        first = row.get("to_first_run_s")
        lines.append(
            f"| {name} | {row['wall_s']:.1f} | {row['train_s']:.1f} | {row['wall_per_train']:.1f}x | "
            f"{'—' if first is None else f'{first:.1f}'} |"
        )
    for key, bound in TARGETS.items():
        value = result["ratios"].get(key)
        verdict = "not measured" if value is None else "met" if value <= bound else "missed"
        lines.append(f"\n{key}: {'—' if value is None else f'{value:.2f}'} (target <= {bound}; {verdict})")
    return "\n".join(lines)


if __name__ == "__main__":
    import json
    import tempfile

    out = sweep_table(
        "quick" if "--quick" in sys.argv else "full", Path(tempfile.mkdtemp(prefix="bench-sweeps-"))
    )
    print(json.dumps(out, indent=1, default=str))
    print(markdown(out))
