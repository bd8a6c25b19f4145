"""Scale-out benchmark: when do the Ray sweep backend and the distributed executor pay? (docs/scaling.md)

    .venv/bin/python -m tests.benchmarks.scaleout [--out bench-results] [--quick] [--skip ray,distributed]

Both measured as users run them, through the CLI with its defaults (MLflow on), fresh roots:

- **distributed**: seconds per round of one `fedcli train` on the FEMNIST writers (FedAvg, 1 local
  epoch, batch 20) under `torchrun --nproc-per-node 2 ... --executor distributed` (2 ranks x 1
  intra-op thread) against the same run in one process: `--executor auto` (2 threads) and
  `--executor process` (2 worker processes x 1 thread). Figure = median of time/round_s over rounds
  2..R from the store, median over repetitions; the approaches alternate within a repetition so
  each meets the same machine.
- **ray**: wall time of a whole `fedcli sweep` of N short trials (FEMNIST MLP, FedAvg) with
  `--backend ray --workers 1` and `--workers 2` against a Ray head started here on 127.0.0.1
  (2 CPUs; its start is not timed), beside the local backend with the same worker counts.
  Throughput = trials per minute.

Writes OUT/scaleout.json and OUT/scaleout.md. Not part of `make test`; `make bench` runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fedcli.tracking.store.sql_store import SqlStore

BIN = Path(sys.executable).parent
WORKLOADS = {"mlp-10": ("mlp", 10), "mlp-50": ("mlp", 50), "cnn-10": ("cnn", 10)}
ROUNDS = {"full": {"mlp-10": 12, "mlp-50": 8, "cnn-10": 5}, "quick": {"mlp-10": 3, "mlp-50": 3, "cnn-10": 2}}
APPROACHES = {  # name -> (launcher prefix, executor)
    "one process, auto (2 threads)": ([], "auto"),
    "one process, process (2 x 1 thread)": ([], "process"),
    "distributed, torchrun 2 ranks x 1 thread": (
        [str(BIN / "torchrun"), "--nproc-per-node", "2", "--master-port", "0", "-m", "fedcli"],
        "distributed",
    ),
}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def train(prefix: list[str], args: list[str], root: Path) -> dict[str, float]:
    """Run one `fedcli train` (a fresh root); return its wall time and median round time (rounds 2..R)."""
    command = (prefix or [sys.executable, "-m", "fedcli"]) + ["-q", "train", "--root", str(root), *args]
    if prefix:  # torchrun: the master port must be free; torchrun --master-port 0 is not accepted everywhere
        command[command.index("--master-port") + 1] = str(_free_port())
    started = time.monotonic()
    proc = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, "OMP_NUM_THREADS": "1"} if prefix else None,
    )
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {proc.stderr.strip()[-800:]}")
    store = SqlStore(f"sqlite:///{root / 'fedcli.db'}")
    run = store.list_runs()[-1]
    frame = store.metrics_frame([run.id], keys=["time/round_s"]).sort_values("round_idx")
    rounds = [float(v) for r, v in zip(frame["round_idx"], frame["value"], strict=True) if r >= 2]
    return {
        "wall_s": wall,
        "round_s": statistics.median(rounds),
        "workers": run.config["train"]["workers"],
        "executor": run.config["train"]["executor"],
    }


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def distributed(mode: str, reps: int, scratch: Path) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, (model, cohort) in WORKLOADS.items():
        rounds = ROUNDS[mode][key]
        args = [
            "--task",
            "femnist",
            "--model",
            model,
            "--algo",
            "fedavg",
            "--rounds",
            str(rounds),
            "--clients-per-round",
            str(cohort),
            "--device",
            "cpu",
            "--client-lr",
            "0.01",
            "--experiment",
            f"scaleout-{key}",
        ]
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in APPROACHES}
        for rep in range(reps):
            for i, (name, (prefix, executor)) in enumerate(APPROACHES.items()):
                log(f"distributed: {key} rep {rep + 1}/{reps}: {name}")
                runs[name].append(
                    train(prefix, [*args, "--executor", executor], scratch / f"{key}-{rep}-{i}")
                )
        summary = {
            name: {
                "round_s": statistics.median(r["round_s"] for r in rs),
                "wall_s": statistics.median(r["wall_s"] for r in rs),
                "executor": rs[0]["executor"],
                "workers": rs[0]["workers"],
            }
            for name, rs in runs.items()
        }
        best_single = min(summary[n]["round_s"] for n in APPROACHES if not n.startswith("distributed"))
        dist = summary["distributed, torchrun 2 ranks x 1 thread"]["round_s"]
        out[key] = {
            "rounds": rounds,
            "approaches": summary,
            "runs": runs,
            "distributed_over_best_single": dist / best_single,
        }
    return out


def ray_sweeps(mode: str, scratch: Path) -> dict[str, object]:
    """Sweep wall time, local vs Ray backend, 1 and 2 workers, against a 2-CPU head on loopback."""
    trials, rounds = (4, 3) if mode == "quick" else (6, 20)
    port, temp = _free_port(), Path(tempfile.mkdtemp(prefix="rb", dir="/tmp"))
    head_log = open(temp / "head.log", "wb")
    head = subprocess.Popen(
        [
            str(BIN / "ray"),
            "start",
            "--head",
            "--block",
            f"--port={port}",
            "--node-ip-address=127.0.0.1",
            "--num-cpus=2",
            "--num-gpus=0",
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--temp-dir={temp}",
        ],
        stdout=head_log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
    )
    out: dict[str, object] = {"trials": trials, "rounds": rounds}
    try:
        deadline = time.monotonic() + 180
        while b"Ray runtime started" not in (temp / "head.log").read_bytes():
            if head.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the Ray head did not start: " + (temp / "head.log").read_text()[-800:])
            time.sleep(0.5)
        for backend, workers in (("local", 1), ("ray", 1), ("local", 2), ("ray", 2)):
            folder = scratch / f"sweep-{backend}-{workers}"
            folder.mkdir(parents=True)
            spec = folder / "spec.yaml"
            spec.write_text(
                f"experiment: scaleout-sweep\nbase: {{task: femnist, algo: fedavg, rounds: {rounds}}}\n"
                f"grid: {{client_lr: [0.05, 0.1]}}\nseeds: {list(range(trials // 2))}\n"
            )
            extra = ["--backend", "ray", "--address", f"127.0.0.1:{port}"] if backend == "ray" else []
            log(f"ray: {backend} backend, {workers} worker(s), {trials} trials")
            started = time.monotonic()
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "fedcli",
                    "sweep",
                    str(spec),
                    "--root",
                    str(folder / "root"),
                    "--workers",
                    str(workers),
                    *extra,
                ],
                capture_output=True,
                text=True,
                timeout=1800,
                env={**os.environ, "COLUMNS": "160"},
            )
            wall = time.monotonic() - started
            if proc.returncode != 0:
                raise RuntimeError(f"sweep ({backend}, {workers}) failed: {proc.stderr.strip()[-800:]}")
            out[f"{backend}-{workers}"] = {"wall_s": wall, "trials_per_min": 60 * trials / wall}
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(head.pid, sig)
                head.wait(timeout=20)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        head_log.close()
        shutil.rmtree(temp, ignore_errors=True)
    for backend in ("local", "ray"):
        out[f"{backend}_speedup_2_over_1"] = out[f"{backend}-1"]["wall_s"] / out[f"{backend}-2"]["wall_s"]
    out["ray_over_local_2"] = out["ray-2"]["wall_s"] / out["local-2"]["wall_s"]
    return out


def markdown(results: dict[str, object]) -> str:
    lines = [
        "# Scale-out benchmark",
        "",
        f"{results['date']}; {results['machine']}; load average "
        f"{results['load_start']} at the start, {results['load_end']} at the end.",
        "",
    ]
    if "distributed" in results:
        names = list(APPROACHES)
        lines += [
            "## One run: distributed executor vs one process (FEMNIST writers, FedAvg, s per round)",
            "",
            "| workload | " + " | ".join(names) + " | distributed / best single |",
            "|---|" + "---:|" * (len(names) + 1),
        ]
        for key, w in results["distributed"].items():
            cells = [f"{w['approaches'][n]['round_s']:.4f} ({w['approaches'][n]['executor']})" for n in names]
            lines.append(
                f"| {key} ({w['rounds']} rounds) | "
                + " | ".join(cells)
                + f" | {w['distributed_over_best_single']:.2f}x |"
            )
        lines.append("")
    if "ray" in results:
        r = results["ray"]
        lines += [
            f"## Sweeps: {r['trials']} trials of {r['rounds']} rounds (FEMNIST MLP, FedAvg), whole sweep",
            "",
            "| backend | 1 worker (s) | 2 workers (s) | speed-up | trials/min at 2 |",
            "|---|---:|---:|---:|---:|",
        ]
        for backend in ("local", "ray"):
            lines.append(
                f"| {backend} | {r[f'{backend}-1']['wall_s']:.1f} | {r[f'{backend}-2']['wall_s']:.1f} | "
                f"{r[f'{backend}_speedup_2_over_1']:.2f}x | {r[f'{backend}-2']['trials_per_min']:.1f} |"
            )
        lines.append(f"\nRay / local at 2 workers: {r['ray_over_local_2']:.2f}x the wall time.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--quick", action="store_true", help="tiny settings, to test the harness")
    parser.add_argument("--skip", default="", help="comma list of: distributed, ray")
    parser.add_argument(
        "--reps", type=int, default=None, help="repetitions per approach (default 3; quick 1)"
    )
    args = parser.parse_args(argv)
    skip, mode = set(filter(None, args.skip.split(","))), "quick" if args.quick else "full"
    scratch = Path(tempfile.mkdtemp(prefix="fedcli-scaleout-"))
    results: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "mode": mode,
        "machine": f"{os.cpu_count()} CPUs, {sys.platform}",
        "load_start": [round(v, 2) for v in os.getloadavg()],
    }
    try:
        if "distributed" not in skip:
            results["distributed"] = distributed(mode, args.reps or (1 if args.quick else 3), scratch)
        if "ray" not in skip:
            try:
                import ray  # noqa: F401
            except ImportError:
                results["ray_skipped"] = "Ray is not installed (pip install 'fedcli[ray]')"
            else:
                results["ray"] = ray_sweeps(mode, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    results["load_end"] = [round(v, 2) for v in os.getloadavg()]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scaleout.json").write_text(json.dumps(results, indent=1, default=str))
    (args.out / "scaleout.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
