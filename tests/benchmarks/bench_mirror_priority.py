"""Benchmark: the MLflow mirror at nice 19 (now) against SCHED_IDLE (before issue 35), on round time.

The same `fedcli train` (MLflow on, a fresh root each run) is run alternately with the mirror at
SCHED_IDLE (arm A: a `sitecustomize` put on PYTHONPATH turns the mirror's `os.setpriority(..., 19)`
into `SCHED_IDLE`, the policy before) and at nice 19 (arm B: the code as it is). Per run: the median
of `time/round_s` over rounds 1..R, the wall time, and MLflow's status of the run when the command
exited (FINISHED: the mirror was done in time; RUNNING or absent: it was not). Prints the ratio B/A
of the medians. `--busy` runs two busy loops at nice 0 meanwhile (as a busy node does).

Run:  .venv/bin/python tests/benchmarks/bench_mirror_priority.py --pairs 4 -- --task lsq --rounds 40
(not part of `make test`; docs/architecture.md, "Tracking", has the figures and the load they had).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fedcli.tracking.store.sql_store import SqlStore

SITECUSTOMIZE = """import os
if os.environ.get("FEDCLI_BENCH_IDLE") == "1":
    _setpriority = os.setpriority
    def _idle_instead(which, who, prio):
        if prio == 19:
            return os.sched_setscheduler(who, os.SCHED_IDLE, os.sched_param(0))
        return _setpriority(which, who, prio)
    os.setpriority = _idle_instead
"""


def mlflow_status(root: Path, run_id: str) -> str:
    if not (root / "mlflow.db").exists():
        return "absent"
    with sqlite3.connect(f"file:{root / 'mlflow.db'}?mode=ro", uri=True, timeout=30) as conn:
        try:
            rows = conn.execute(
                "SELECT r.status FROM runs r JOIN tags t ON t.run_uuid = r.run_uuid AND "
                "t.key = 'fedcli.run_id' AND t.value = ?",
                (run_id,),
            ).fetchall()
        except sqlite3.OperationalError:
            return "absent"
    return rows[0][0] if rows else "absent"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--busy", action="store_true", help="two busy loops at nice 0 while the runs train")
    parser.add_argument("train", nargs="*", default=["--model", "mlp", "--rounds", "40"])
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fedcli-bench-priority-"))
    (work / "site").mkdir()
    (work / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    base = {k: v for k, v in os.environ.items() if k not in ("FEDCLI_STORE", "MLFLOW_TRACKING_URI")}
    base["OMP_NUM_THREADS"] = "1"
    loops = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 if args.busy else 0)
    ]
    medians: dict[str, list[float]] = {"A": [], "B": []}
    try:
        for pair in range(args.pairs):
            for arm in ("A", "B") if pair % 2 == 0 else ("B", "A"):
                root = work / f"{arm}{pair}"
                env = dict(base, PYTHONPATH=str(work / "site"), FEDCLI_BENCH_IDLE="1" if arm == "A" else "0")
                began = time.monotonic()
                done = subprocess.run(
                    [sys.executable, "-m", "fedcli", "-q", "train", *args.train, "--root", str(root)],
                    capture_output=True,
                    text=True,
                    env=env,
                )
                wall = time.monotonic() - began
                if done.returncode != 0:
                    raise SystemExit(f"{arm}{pair}: exit {done.returncode}: {done.stderr[-2000:]}")
                store = SqlStore(f"sqlite:///{root / 'fedcli.db'}")
                (run,) = store.list_runs()
                frame = store.metrics_frame([run.id])
                rounds = frame[(frame["key"] == "time/round_s") & (frame["round_idx"] >= 1)]["value"]
                medians[arm].append(statistics.median(rounds))
                warned = " ".join(done.stderr.split())[:160]
                print(
                    f"pair {pair} {'A SCHED_IDLE' if arm == 'A' else 'B nice 19  '}: median round "
                    f"{medians[arm][-1] * 1000:.1f} ms, wall {wall:.1f} s, MLflow at exit "
                    f"{mlflow_status(root, run.id)}, load {os.getloadavg()[0]:.1f}"
                    f"{'; ' + warned if warned else ''}",
                    flush=True,
                )
                shutil.rmtree(root, ignore_errors=True)
    finally:
        for loop in loops:
            loop.kill()
        shutil.rmtree(work, ignore_errors=True)
    a, b = statistics.median(medians["A"]), statistics.median(medians["B"])
    pairs = ", ".join(f"{y / x:.2f}" for x, y in zip(medians["A"], medians["B"], strict=True))
    print(
        f"median round: SCHED_IDLE {a * 1000:.1f} ms, nice 19 {b * 1000:.1f} ms; ratio nice19/idle {b / a:.3f} "
        f"(per pair {pairs})"
    )


if __name__ == "__main__":
    main()
