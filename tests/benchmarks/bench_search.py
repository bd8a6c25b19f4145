"""Issue 27's search figure: a 100-trial search with a median pruner on FEMNIST against a random search of the
same budget without pruning (docs/sweeps.md, "What pruning saves").

    OMP_NUM_THREADS=1 python -m tests.benchmarks.bench_search [--trials 100] [--workers 1] [--root DIR] [--seed S]

Runs examples/search-pruning.yaml (TPE + median pruner) and the same spec with `sampler: random` and no
pruner, each as its own experiment in one store (`fedcli sweep ... --no-mlflow`), then prints, per search:
trials by state, trial-rounds trained against trials x rounds (the share pruning saved) and the best
accuracy found (the metric at a trial's last round). Accuracy, not timing: any machine gives the same
numbers for the same seeds (the wall time is printed for information only).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "search-pruning.yaml"


def variants(trials: int, seed: int | None = None) -> dict[str, dict]:
    spec = yaml.safe_load(EXAMPLE.read_text())
    spec.pop("smoke", None)
    spec["search"]["trials"] = trials
    if (
        seed is not None
    ):  # the samplers' seed (both searches draw their first 10 trials alike: TPE starts at random)
        spec["search"]["seed"] = seed
    tpe = {**spec, "experiment": "bench-search-tpe-median"}
    random = {**spec, "experiment": "bench-search-random", "search": {**spec["search"], "sampler": "random"}}
    random.pop("pruner")
    return {"tpe + median pruner": tpe, "random, no pruner": random}


def summary(url: str, experiment: str, rounds: int) -> dict[str, float | int | str]:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(
        study_name=f"fedcli:{experiment}", storage=optuna.storages.RDBStorage(url, skip_table_creation=True)
    )
    trials = [t for t in study.get_trials() if "fedcli.void" not in t.user_attrs]
    states = {s: sum(t.state.name == s for t in trials) for s in ("COMPLETE", "PRUNED", "FAIL", "RUNNING")}
    trained = sum(
        rounds if t.state.name == "COMPLETE" else max(t.intermediate_values, default=0) for t in trials
    )
    best = study.best_trial
    return {
        "trials": len(trials),
        **{k.lower(): v for k, v in states.items()},
        "trial_rounds": trained,
        "budget_rounds": rounds * len(trials),
        "saved": 1 - trained / (rounds * len(trials)),
        "best": best.value,
        "best_trial": best.number,
        "best_params": str(best.params),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--root", type=Path, default=None)
    parser.add_argument(
        "--seed", type=int, default=None, help="the search's seed (default: the example's, 0)"
    )
    args = parser.parse_args()
    root = args.root or Path(tempfile.mkdtemp(prefix="fedcli-bench-search-"))
    root.mkdir(parents=True, exist_ok=True)
    url = f"sqlite:///{root / 'fedcli.db'}"
    rows = {}
    for label, spec in variants(args.trials, args.seed).items():
        path = root / f"{spec['experiment']}.yaml"
        path.write_text(yaml.safe_dump(spec, sort_keys=False))
        start = time.perf_counter()
        code = subprocess.call(
            [
                sys.executable,
                "-m",
                "fedcli",
                "-q",
                "sweep",
                str(path),
                "--no-mlflow",
                "--root",
                str(root),
                "--workers",
                str(args.workers),
            ],
            stdout=subprocess.DEVNULL,
        )
        wall = time.perf_counter() - start
        if code != 0:
            print(f"{label}: fedcli sweep exited {code}", file=sys.stderr)
            return code
        rows[label] = {**summary(url, spec["experiment"], spec["base"]["rounds"]), "wall_s": wall}
    print(f"store: {url}\n")
    print(
        "| search | trials (complete / pruned / failed) | trial-rounds trained | saved by pruning | best accuracy "
        "| best trial | wall (s, information only) |"
    )
    print("|---|---|---:|---:|---:|---|---:|")
    for label, r in rows.items():
        print(
            f"| {label} | {r['trials']} ({r['complete']} / {r['pruned']} / {r['fail']}) | {r['trial_rounds']} of "
            f"{r['budget_rounds']} | {r['saved']:.1%} | {r['best']:.4f} | #{r['best_trial']} {r['best_params']} | "
            f"{r['wall_s']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
