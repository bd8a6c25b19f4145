"""Client-state store benchmark (issue 32 item 2): peak RSS, checkpoint bytes, round-time ratio.

Two modes (figures in docs/scaling.md, "Client state"):

    python -m tests.benchmarks.state_store run --data-dir DIR --root ROOT [fedcli train options...]
        `fedcli train --task emnist` on DIR (a TFF-format federation, e.g. from
        `python -m fedcli.datasets.formats.generate emnist --clients 3400 --mean-size 20 --sigma 0`) as a
        subprocess, sampling the summed RSS of its process tree every 0.2 s; then the bytes each
        checkpoint wrote (its round-NNNNNN.pt and round-NNNNNN.clients.npy; pass
        --keep-checkpoints large so none is pruned). Prints one JSON line. The options this harness
        also reads (--rounds, --algo, --executor, --local-epochs, --batch-size, --state-cache-mb) are
        passed on to `fedcli train`.

    python -m tests.benchmarks.state_store interleaved --data-dir DIR --rounds K [--bench-model mlp]
        One process, one set-up, two runs of SCAFFOLD side by side: round r of the RAM store, then
        round r of the disk store (cache --state-cache-mb), alternating, so that both see the same
        machine load; prints the median round time of each and their ratio. Run it under
        `quiet-run` for timings.

    python -m tests.benchmarks.state_store probe --data-dir DIR --store ram|disk --bench-model cnn --rounds K
            [--algo scaffold|bayesadmm|...] [--executor vmap|loop] [--chunk 10] [--batch-size 20]
        RSS after each round and the peak so far, in-process (`run_round` + a checkpoint a round);
        --chunk 0 runs without --cohort-chunk (the loop then streams groups from its own budget).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def tree_rss(pid: int) -> int:
    """Summed VmRSS (bytes) of `pid` and all its descendants (from /proc)."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/status") as fh:
                for line in fh:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
                        break
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as fh:
                    stack.extend(int(c) for c in fh.read().split())
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return total


def run(args: argparse.Namespace, extra: list[str]) -> dict[str, object]:
    cmd = [
        sys.executable,
        "-m",
        "fedcli",
        "-q",
        "train",
        "--task",
        "emnist",
        "--data-dir",
        args.data_dir,
        "--root",
        args.root,
        "--no-mlflow",
        "--rounds",
        str(args.rounds),
        *(["--algo", args.algo] if args.algo else []),
        *(["--executor", args.executor] if args.executor else []),
        *(["--local-epochs", str(args.local_epochs)] if args.local_epochs else []),
        "--batch-size",
        str(args.batch_size),
        "--state-cache-mb",
        str(args.state_cache_mb),
        *extra,
    ]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss(proc.pid))
        time.sleep(0.2)
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"fedcli train failed ({proc.returncode}): {err[-2000:]}")
    run_id = out.strip().splitlines()[-1]
    folder = Path(args.root) / "runs" / run_id / "checkpoints"
    per_round: dict[int, int] = {}
    for path in folder.iterdir():
        if path.name.startswith("round-"):
            per_round[int(path.name[6:12])] = per_round.get(int(path.name[6:12]), 0) + path.stat().st_size
    return {
        "cmd": " ".join(cmd[1:]),
        "run_id": run_id,
        "wall_s": round(time.perf_counter() - start, 1),
        "peak_tree_rss_mb": round(peak / 2**20),
        "checkpoint_bytes_by_round": dict(sorted(per_round.items())),
        "checkpoint_dir_mb": round(sum(per_round.values()) / 2**20, 1),
    }


def interleaved(args: argparse.Namespace) -> dict[str, object]:
    import torch

    from fedcli.config.build import build_config
    from fedcli.engine.clientstate import ClientStateStore
    from fedcli.engine.rounds import Timing, run_round
    from fedcli.engine.setup import build

    torch.set_num_threads(1)
    cfg = build_config(
        overrides={
            "data.task": "emnist",
            "data.data_dir": args.data_dir,
            "data.model": args.model,
            "algorithm.name": "scaffold",
            "train.clients_per_round": args.cohort,
            "train.rounds": args.rounds,
            "train.executor": "vmap",
            "train.device": "cpu",
        }
    )
    setup = build(cfg)
    init = lambda: setup.alg.init_client_state(setup.init_params, setup.hp)  # noqa: E731
    with tempfile.TemporaryDirectory(dir=args.scratch) as scratch:
        stores = {
            "ram": ClientStateStore(init),
            "disk": ClientStateStore(init, folder=Path(scratch) / "cs", cache_mb=args.state_cache_mb),
        }
        states = {k: setup.alg.server_init(setup.init_params, setup.hp, setup.opt) for k in stores}
        times: dict[str, list[float]] = {k: [] for k in stores}
        cpu: dict[str, list[float]] = {
            k: [] for k in stores
        }  # process CPU seconds: less noisy on a shared host
        store_s: dict[str, float] = {k: 0.0 for k in stores}  # wall seconds inside gather + scatter

        def timed(kind: str, fn: Any) -> Any:
            def wrapper(*a: Any) -> Any:
                start = time.perf_counter()
                try:
                    return fn(*a)
                finally:
                    store_s[kind] += time.perf_counter() - start

            return wrapper

        for kind, s in stores.items():
            s.gather, s.scatter = timed(kind, s.gather), timed(kind, s.scatter)  # type: ignore[method-assign]
        for round_idx in range(1, args.rounds + 1):
            order = ("ram", "disk") if round_idx % 2 else ("disk", "ram")
            for kind in order:
                start, start_cpu = time.perf_counter(), time.process_time()
                states[kind], _ = run_round(setup, states[kind], stores[kind], round_idx, Timing())
                times[kind].append(time.perf_counter() - start)
                cpu[kind].append(time.process_time() - start_cpu)
        params = [setup.alg.global_params(states[k]) for k in ("ram", "disk")]
        same = all(torch.equal(params[0][n], params[1][n]) for n in params[0])
        stores["disk"].close(remove=True)
    ram, disk = statistics.median(times["ram"][1:]), statistics.median(times["disk"][1:])
    return {
        "model": args.model,
        "cohort": args.cohort,
        "rounds": args.rounds,
        "state_cache_mb": args.state_cache_mb,
        "median_round_s": {"ram": round(ram, 4), "disk": round(disk, 4)},
        "ratio_disk_over_ram": round(disk / ram, 3),
        "median_round_cpu_s": {k: round(statistics.median(v[1:]), 4) for k, v in cpu.items()},
        "ratio_cpu_disk_over_ram": round(
            statistics.median(cpu["disk"][1:]) / statistics.median(cpu["ram"][1:]), 3
        ),
        "store_s_per_round": {k: round(v / args.rounds, 4) for k, v in store_s.items()},
        "rounds_s": {k: [round(t, 3) for t in v] for k, v in times.items()},
        "same_final_params": same,
    }


def probe(args: argparse.Namespace) -> dict[str, object]:
    """RSS after each round (and the peak so far) of `--algo` (SCAFFOLD) in-process: the engine's `run_round`
    with `--cohort-chunk --chunk` (10) and a `CheckpointWriter` every round, client states in `--store`."""
    import resource

    import torch

    from fedcli.config.build import build_config
    from fedcli.engine.checkpoint_writer import CheckpointWriter
    from fedcli.engine.clientstate import ClientStateStore
    from fedcli.engine.rounds import Timing, run_round
    from fedcli.engine.setup import build

    def rss_mb() -> int:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) // 1024 for line in fh if line.startswith("VmRSS"))

    torch.set_num_threads(1)
    cfg = build_config(
        overrides={
            "data.task": "emnist",
            "data.data_dir": args.data_dir,
            "data.model": args.model,
            "algorithm.name": args.algo or "scaffold",
            "train.clients_per_round": args.cohort,
            "train.rounds": args.rounds,
            "train.executor": args.executor or "vmap",
            "train.device": "cpu",
            "train.batch_size": args.batch_size,
            **({"train.cohort_chunk": args.chunk} if args.chunk else {}),
            **({"train.local_epochs": args.local_epochs} if args.local_epochs else {}),
        }
    )
    setup = build(cfg)
    init = lambda: setup.alg.init_client_state(setup.init_params, setup.hp)  # noqa: E731
    rows = [{"round": 0, "rss_mb": rss_mb()}]
    with tempfile.TemporaryDirectory(dir=args.scratch) as scratch:
        run_dir = Path(scratch) / "runs" / "probe"
        store = (
            ClientStateStore(init)
            if args.store == "ram"
            else ClientStateStore(init, folder=run_dir / "client-state", cache_mb=args.state_cache_mb)
        )
        writer = CheckpointWriter(
            run_dir, record=lambda r, p: None, forget=lambda r: None, existing=[], every=1, keep=2
        )
        state = setup.alg.server_init(setup.init_params, setup.hp, setup.opt)
        for round_idx in range(1, args.rounds + 1):
            start = time.perf_counter()
            state, _ = run_round(setup, state, store, round_idx, Timing())
            writer.submit(round_idx, state, store.take_changes(round_idx), cfg.to_dict(), cfg.seed)
            rows.append(
                {
                    "round": round_idx,
                    "rss_mb": rss_mb(),
                    "s": round(time.perf_counter() - start, 1),
                    "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
                }
            )
        writer.close()
        store.close(remove=True)
    return {
        "algo": args.algo or "scaffold",
        "executor": args.executor or "vmap",
        "chunk": args.chunk,
        "store": args.store,
        "model": args.model,
        "state_cache_mb": args.state_cache_mb,
        "rounds": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.benchmarks.state_store")
    parser.add_argument("mode", choices=("run", "interleaved", "probe"))
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--root", default="/tmp/state-store-bench")
    parser.add_argument("--scratch", default=None)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--cohort", type=int, default=100)
    parser.add_argument("--bench-model", dest="model", default="mlp")
    parser.add_argument("--state-cache-mb", type=int, default=512)
    parser.add_argument("--store", choices=("ram", "disk"), default="disk")
    parser.add_argument("--algo", default=None, help="the algorithm (probe: scaffold if not given)")
    parser.add_argument("--executor", default=None, help="the executor (probe: vmap if not given)")
    parser.add_argument("--chunk", type=int, default=10, help="probe: --cohort-chunk (0: none)")
    parser.add_argument("--batch-size", type=int, default=20, help="probe: --batch-size")
    parser.add_argument("--local-epochs", type=int, default=0, help="--local-epochs (0: the default)")
    args, extra = parser.parse_known_args()
    result = (
        run(args, extra)
        if args.mode == "run"
        else interleaved(args)
        if args.mode == "interleaved"
        else probe(args)
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
