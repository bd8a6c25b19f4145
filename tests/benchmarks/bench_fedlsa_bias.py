"""Benchmark: the FedLSA bias / SCAFFLSA experiment of reference/fedlsa.md §4.3 (not run by `make test`).

Federated TD(0) on the heterogeneous Garnet MDPs (hg = 10, gen_seed 42) with N agents, fresh
i.i.d. samples at every local step (the paper's oracle: s ~ mu^c, s' ~ P^c_pi(s, .)), step
size eta, H local steps per round and T = max(min_rounds, budget / H) rounds from
theta_0 = theta* + 1 (xi^c_0 = 0). For every H it reports, averaged over the last 10 % of
the rounds and over `reps` independent sample streams:

    bias2      ||theta_inf^bias||^2 from the closed form (fedlsa.md §3.3, algorithms.fedlsa.fedlsa_bias)
    fedlsa     FedLSA's MSE ||theta_t - theta*||^2
    debiased   FedLSA's ||theta_t - theta* - theta_inf^bias||^2   (its variance around the predicted point)
    scafflsa   SCAFFLSA's MSE ||theta_t - theta*||^2

The paper's claims (slides; fedlsa.md §4.3): FedLSA plateaus at its bias line, which grows
with H (~ (eta (H-1))^2 while eta H is small) and does not shrink with N; SCAFFLSA reaches the
variance floor ~ eta sigma^2 / (N a) (no bias), i.e. ~1/N.

This is an independent vectorised simulation (all H, both algorithms and all repetitions in
one batched recursion, rank-one A(Z) theta = phi(s) psi^T theta with psi = phi(s) - gamma
phi(s')), not the engine: the engine's tasks reuse a finite sample pool.

Run:  .venv/bin/python tests/benchmarks/bench_fedlsa_bias.py --agents 10 100 --out fedlsa_bias.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from fedcli.algorithms.fedlsa import fedlsa_bias
from fedcli.datasets.garnet import GEN_SEED, make_garnet


def atoms(mdp, dtype: torch.dtype = torch.float64):  # noqa: ANN001, ANN201
    """Return per-agent (s, s') atoms: probabilities [N, S*S], phi(s) [S*S, D], psi [S*S, D], r [N, S*S]."""
    n, s = mdp.num_agents, mdp.features.shape[0]
    probs = (mdp.stationary[:, :, None] * mdp.transition).reshape(n, s * s)
    phi = torch.as_tensor(np.repeat(mdp.features, s, axis=0), dtype=dtype)  # atom (i, j) -> phi(i)
    phi_next = torch.as_tensor(np.tile(mdp.features, (s, 1)), dtype=dtype)  # atom (i, j) -> phi(j)
    rewards = torch.as_tensor(np.repeat(mdp.rewards, s, axis=1), dtype=dtype)
    return torch.as_tensor(probs, dtype=dtype), phi, phi - mdp.gamma * phi_next, rewards


def simulate(num_agents: int, *, heterogeneity: float = 10.0, eta: float = 0.1, local_steps: tuple[int, ...] = (1, 10, 100, 1000),
             budget: int = 100_000, min_rounds: int = 50, reps: int = 5, seed: int = 0, chunk: int = 200) -> list[dict]:
    """Run FedLSA and SCAFFLSA for every H at once; return one result row per H."""
    mdp = make_garnet(num_agents=num_agents, heterogeneity=heterogeneity, rng=np.random.default_rng(GEN_SEED))
    probs, phi_atoms, psi_atoms, r_atoms = atoms(mdp)
    a_bar, b_bar = torch.as_tensor(mdp.a_bar), torch.as_tensor(mdp.b_bar)
    theta_star = torch.as_tensor(mdp.theta_star)
    rounds = [max(min_rounds, budget // h) for h in local_steps]
    total = max(t * h for t, h in zip(rounds, local_steps, strict=True))
    groups = 2 * len(local_steps)  # group 2k = FedLSA with H_k, 2k + 1 = SCAFFLSA with H_k
    d = a_bar.shape[-1]
    theta = (theta_star + 1.0).expand(groups, reps, num_agents, d).clone()  # [G, R, N, D]
    xi = torch.zeros_like(theta)
    biases = [fedlsa_bias(a_bar, b_bar, eta, h) for h in local_steps]
    sums = torch.zeros(groups, reps, dtype=torch.float64)
    debiased = torch.zeros(len(local_steps), reps, dtype=torch.float64)
    counts = [0] * len(local_steps)
    agent_ix = torch.arange(num_agents)
    gen = torch.Generator().manual_seed(seed)
    for start in range(0, total, chunk):
        steps = min(chunk, total - start)
        draws = torch.multinomial(probs, steps * groups * reps, replacement=True, generator=gen)  # [N, steps*G*R]
        draws = draws.reshape(num_agents, steps, groups, reps).permute(1, 2, 3, 0)  # [steps, G, R, N]
        phi_c, psi_c = phi_atoms[draws], psi_atoms[draws]  # [steps, G, R, N, D]
        r_c = r_atoms[agent_ix, draws]  # [steps, G, R, N]
        for i in range(steps):
            t = start + i
            field = (psi_c[i] * theta).sum(-1) - r_c[i]  # (A(Z) theta - b(Z)) / phi(s), [G, R, N]
            theta -= eta * (field[..., None] * phi_c[i] - xi)
            for k, h in enumerate(local_steps):
                if (t + 1) % h or (t + 1) // h > rounds[k]:
                    continue
                g = slice(2 * k, 2 * k + 2)
                mean = theta[g].mean(dim=2, keepdim=True)  # [2, R, 1, D]
                xi[2 * k + 1] += (mean[1] - theta[2 * k + 1]) / (eta * h)  # corrected SCAFFLSA update
                theta[g] = mean.expand_as(theta[g])
                round_idx = (t + 1) // h
                if round_idx > 0.9 * rounds[k]:
                    err = mean[:, :, 0] - theta_star  # [2, R, D]
                    sums[g] += (err**2).sum(-1)
                    debiased[k] += ((err[0] - biases[k]) ** 2).sum(-1)
                    counts[k] += 1
    rows = []
    for k, h in enumerate(local_steps):
        fed, scaf, deb = sums[2 * k] / counts[k], sums[2 * k + 1] / counts[k], debiased[k] / counts[k]
        rows.append({"N": num_agents, "hg": heterogeneity, "eta": eta, "H": h, "T": rounds[k],
                     "bias2": float((biases[k] ** 2).sum()), "fedlsa": float(fed.mean()), "fedlsa_std": float(fed.std()),
                     "debiased": float(deb.mean()), "scafflsa": float(scaf.mean()), "scafflsa_std": float(scaf.std()),
                     "reps": reps})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--local-steps", type=int, nargs="+", default=[1, 10, 100, 1000])
    parser.add_argument("--eta", type=float, default=0.1)
    parser.add_argument("--budget", type=int, default=100_000, help="local steps per agent (T = budget / H)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for n in args.agents:
        start = time.perf_counter()
        rows += simulate(n, eta=args.eta, local_steps=tuple(args.local_steps), budget=args.budget, reps=args.reps)
        print(f"N={n}: {time.perf_counter() - start:.1f} s")
    print("| N | H | T | bias^2 (closed form) | FedLSA MSE | FedLSA - bias | SCAFFLSA MSE |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['N']} | {r['H']} | {r['T']} | {r['bias2']:.3e} | {r['fedlsa']:.3e} | {r['debiased']:.3e} "
              f"| {r['scafflsa']:.3e} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
