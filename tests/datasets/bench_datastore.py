"""Round time of the disk data store against memory, interleaved in one process (issue 32 item 1).

    quiet-run .venv/bin/python -m tests.datasets.bench_datastore [--task femnist] [--rounds 12]
        [--clients-per-round 10] [--data-dir DIR] [--max-clients N]

Builds the run twice (`--data-store memory` and `disk`, same seed and settings), runs one warm-up
round of each, then alternates rounds memory, disk, memory, ... and prints each round's seconds
and the ratio disk / memory (median and total). A disk round's time includes waiting for its next
cohort's prefetch if that is still reading when the round ends (in a run that wait would open
the next round), so the interleaving does not hide reads behind the memory run's rounds. The
metrics of both are checked equal round by round. Not a test: a measurement (docs/scaling.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import Future
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", default="femnist")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--clients-per-round", type=int, default=10)
    parser.add_argument("--executor", default="auto")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--max-clients", type=int, default=None)
    args = parser.parse_args()
    os.environ.setdefault("FEDCLI_DATA_CACHE", tempfile.mkdtemp(prefix="fedcli-bench-store-"))

    from fedcli.config.build import build_config
    from fedcli.engine.clientstate import ClientStateStore
    from fedcli.engine.rounds import Timing, run_round
    from fedcli.engine.setup import build

    def setup_of(store: str) -> tuple[Any, Any]:
        overrides: dict[str, Any] = {
            "data.task": args.task,
            "data.data_store": store,
            "train.device": "cpu",
            "train.rounds": args.rounds + 1,
            "train.executor": args.executor,
            "train.clients_per_round": args.clients_per_round,
            "train.threads": 1,
        }
        if args.data_dir:
            overrides["data.data_dir"] = args.data_dir
        if args.max_clients:
            overrides["data.max_clients"] = args.max_clients
        start = time.perf_counter()
        setup = build(build_config(overrides=overrides))
        print(
            f"{store}: set-up {time.perf_counter() - start:.2f} s, {type(setup.fed).__name__}, "
            f"back end {setup.backend.name}",
            flush=True,
        )
        return setup, setup.alg.server_init(setup.init_params, setup.hp, setup.opt)

    runs = {store: setup_of(store) for store in ("memory", "disk")}
    seconds: dict[str, list[float]] = {"memory": [], "disk": []}
    metrics: dict[str, list[dict[str, float]]] = {"memory": [], "disk": []}
    for r in range(1, args.rounds + 2):
        for store in ("memory", "disk"):
            setup, state = runs[store]
            start = time.perf_counter()
            state, row = run_round(setup, state, ClientStateStore(None), r, Timing())
            ahead = setup.prefetched.get(r + 1)
            if isinstance(ahead, Future):
                ahead.result()
            took = time.perf_counter() - start
            runs[store] = (setup, state)
            metrics[store].append(row)
            if r > 1:  # round 1 warms up
                seconds[store].append(took)
    same = all(a == b for a, b in zip(metrics["memory"], metrics["disk"], strict=True))
    ratio = [d / m for d, m in zip(seconds["disk"], seconds["memory"], strict=True)]
    print(
        json.dumps(
            {
                "task": args.task,
                "rounds": args.rounds,
                "clients_per_round": args.clients_per_round,
                "memory_s": [round(s, 4) for s in seconds["memory"]],
                "disk_s": [round(s, 4) for s in seconds["disk"]],
                "median_memory_s": round(statistics.median(seconds["memory"]), 4),
                "median_disk_s": round(statistics.median(seconds["disk"]), 4),
                "median_ratio": round(statistics.median(ratio), 3),
                "total_ratio": round(sum(seconds["disk"]) / sum(seconds["memory"]), 3),
                "metrics_equal": same,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
