"""Peak RSS of a run's set-up and first round, memory vs disk data store (issue 32 item 1).

    .venv/bin/python -m tests.datasets.bench_datastore_rss --task stackoverflow-nwp --data-dir DIR
        [--stores memory,disk,disk] [--clients-per-round 2]

Each store runs in a fresh process (`build` + one round of FedAvg, no evaluation, nothing stored),
which prints its peak RSS (`ru_maxrss`) after the set-up and after the round, and the set-up's
seconds; the same store named twice shows a cold build, then a warm open. FEDCLI_DATA_CACHE is
a fresh folder unless set. A measurement, not a test (docs/scaling.md, "Out-of-core data").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = """
import json, resource, sys, time
from fedcli.config.build import build_config
from fedcli.engine.clientstate import ClientStateStore
from fedcli.engine.rounds import Timing, run_round
from fedcli.engine.setup import build

overrides = json.loads(sys.argv[1])
start = time.perf_counter()
setup = build(build_config(overrides=overrides))
setup_s = time.perf_counter() - start
after_setup = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
state = setup.alg.server_init(setup.init_params, setup.hp, setup.opt)
start = time.perf_counter()
run_round(setup, state, ClientStateStore(None), 1, Timing())
print(json.dumps({"store": type(setup.fed).__name__, "clients": setup.fed.num_clients,
                  "examples": int(setup.fed.sizes.sum()), "setup_s": round(setup_s, 1),
                  "round_s": round(time.perf_counter() - start, 1), "peak_rss_after_setup_mb": after_setup // 1024,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", default="stackoverflow-nwp")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--stores", default="memory,disk,disk")
    parser.add_argument("--clients-per-round", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.setdefault("FEDCLI_DATA_CACHE", tempfile.mkdtemp(prefix="fedcli-rss-store-"))
    for store in args.stores.split(","):
        overrides = {
            "data.task": args.task,
            "data.data_store": store,
            "train.device": "cpu",
            "train.rounds": 1,
            "train.clients_per_round": args.clients_per_round,
            "train.batch_size": args.batch_size,
            "train.executor": "vmap",
            "train.threads": 1,
        }
        if args.data_dir:
            overrides["data.data_dir"] = args.data_dir
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(overrides)],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        if proc.returncode != 0:
            print(f"{store}: failed\n{proc.stderr[-2000:]}", flush=True)
            continue
        print(f"{store}: {proc.stdout.strip()}", flush=True)


if __name__ == "__main__":
    main()
