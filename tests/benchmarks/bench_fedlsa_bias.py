"""Benchmark: the FedLSA bias / SCAFFLSA experiment (SCAFFLSA, NeurIPS 2024, Theorem 4.1 and Figure 1).

A command-line front for fedcli/studies/scafflsa_garnet.py, which holds the simulation and its
documentation (the study recipe `fedcli sweep --recipe scafflsa-garnet` writes the report); this
script prints the rows as a table and optionally saves them as JSON. Not run by `make test`.

For every H it reports, averaged over the last 10 % of the rounds and over `reps` sample streams:

    bias2      ||theta_inf^bias||^2 from the closed form (Theorem 4.1, algorithms.fedlsa.fedlsa_bias)
    fedlsa     FedLSA's MSE ||theta_t - theta*||^2
    debiased   FedLSA's ||theta_t - theta* - theta_inf^bias||^2   (its variance around the predicted point)
    scafflsa   SCAFFLSA's MSE ||theta_t - theta*||^2

Run:  .venv/bin/python tests/benchmarks/bench_fedlsa_bias.py --agents 10 100 --out fedlsa_bias.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from fedcli.studies.scafflsa_garnet import FULL, Setup, simulate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, nargs="+", default=list(FULL.agents))
    parser.add_argument("--local-steps", type=int, nargs="+", default=list(FULL.local_steps))
    parser.add_argument("--hg", type=float, default=FULL.heterogeneity, help="Garnet heterogeneity")
    parser.add_argument("--eta", type=float, default=FULL.eta)
    parser.add_argument(
        "--budget", type=int, default=FULL.budget, help="local steps per agent (T = budget / H)"
    )
    parser.add_argument("--min-rounds", type=int, default=FULL.min_rounds)
    parser.add_argument("--reps", type=int, default=FULL.reps)
    parser.add_argument("--seed", type=int, default=FULL.seed)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    setup = Setup(
        agents=tuple(args.agents),
        local_steps=tuple(args.local_steps),
        heterogeneity=args.hg,
        eta=args.eta,
        budget=args.budget,
        min_rounds=args.min_rounds,
        reps=args.reps,
        seed=args.seed,
    )
    rows = []
    for n in setup.agents:
        start = time.perf_counter()
        rows += simulate(n, setup)
        print(f"N={n}: {time.perf_counter() - start:.1f} s")
    print("| N | H | T | bias^2 (closed form) | FedLSA MSE | FedLSA - bias | SCAFFLSA MSE |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['N']} | {r['H']} | {r['T']} | {r['bias2']:.3e} | {r['fedlsa']:.3e} | {r['debiased']:.3e} "
            f"| {r['scafflsa']:.3e} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
