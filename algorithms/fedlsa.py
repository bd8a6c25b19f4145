"""FedLSA: federated linear stochastic approximation (local LSA steps + averaging).

Mangold, Samsonov, Labbi, Levin, Alami, Naumov, Moulines. SCAFFLSA: Taming Heterogeneity
in Federated Linear Stochastic Approximation and TD Learning. NeurIPS 2024.
arXiv:2402.04114. Seed: slides "Taming Heterogeneity in Federated Linear Stochastic
Approximation" (Mangold, ARGO seminar 2024), extracted in reference/fedlsa.md.

Implements: the FedLSA algorithm (fedlsa.md §3.3): every agent starts from theta_t and
takes H steps theta <- theta - eta (A^c(Z) theta - b^c(Z)) -> client_update (local SGD
on the task's LSA surrogate, whose gradient is A(Z) theta - b(Z), see datasets/bundled/garnet.py);
theta_{t+1} = (1/N) sum_c theta^c_{t,H} -> server_update. The bias closed form of §3.3
-> fedlsa_bias; the solution of the averaged system -> lsa_solution.
Notation: theta -> params["lsa_theta"], eta -> opt.client_lr, H -> the client's real local
steps (E epochs x ceil(n_c / B)), Abar^c, bbar^c -> a_bar[c], b_bar[c], N -> agents.
Deviations:
  Paper: uniform 1/N, full participation, no server step size. Here: hp.weighting
  "uniform" (default) or "examples" (n_c); any cohort size and FedOpt server optimiser
  may be chosen (the bias formula assumes the paper's setting: full participation,
  --server-opt sgd --server-lr 1).
  Paper: one fresh sample per step. Here: a minibatch of B samples per step from the
  agent's pool (B = 1 is the paper's step).
Applies only to LSA tasks (models whose only parameter is `lsa_theta`); server_init
refuses other models and client momentum (the LSA step has none).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fedcli.algorithms import fedavg
from fedcli.algorithms.base import (
    Algorithm,
    ClientOut,
    Degeneracy,
    Diagnostics,
    OptimConfig,
    Params,
    RunFacts,
    require,
)

LSA_PARAM = "lsa_theta"  # parameter name of LSA models (= fedcli.datasets.bundled.garnet.LSA_PARAM)


@dataclass(frozen=True, kw_only=True)
class FedLSAConfig:
    weighting: str = "uniform"  # "uniform" (§3.3: theta_{t+1} = 1/N sum_c) | "examples" (n_c)

    def __post_init__(self) -> None:
        require(
            self.weighting in ("uniform", "examples"),
            "hp.weighting",
            "'uniform' or 'examples'",
            self.weighting,
        )


def check_lsa_setting(params: Params, opt: OptimConfig, algo: str) -> None:
    """Raise HyperparameterError unless the model is an LSA model and client momentum is 0."""
    names = sorted(params)
    require(
        names == [LSA_PARAM] and params[LSA_PARAM].dim() == 1,
        "data.task",
        f"a linear stochastic approximation task (kind 'lsa', a model whose only parameter is "
        f"'{LSA_PARAM}', e.g. --task garnet-het-n10) for {algo}",
        f"a model with parameters {', '.join(names[:4])}{', ...' if len(names) > 4 else ''}",
        f"{algo} runs local LSA steps; on neural tasks use scaffold or fedavg.",
    )
    require(
        opt.client_momentum == 0.0,
        "train.client_momentum",
        f"0 for {algo} (the LSA step has no momentum)",
        opt.client_momentum,
    )


def server_init(params: Params, hp: FedLSAConfig, opt: OptimConfig) -> fedavg.ServerState:
    """Check the task is LSA, then return theta_0 (FedAvg's server state)."""
    check_lsa_setting(params, opt, "fedlsa")
    return fedavg.server_init(params, hp, opt)


def server_update(
    state: fedavg.ServerState, outs: ClientOut, weights: Tensor, hp: FedLSAConfig, opt: OptimConfig
) -> tuple[fedavg.ServerState, Diagnostics]:
    """theta_{t+1} = theta_t - server step on mean_q(theta_t - theta^c_{t,H}), q_c = 1 ("uniform", the paper)
    or n_c ("examples")."""
    q = weights if hp.weighting == "examples" else torch.ones_like(weights)  # [C]
    return fedavg.apply_pseudo_gradient(state, outs.upload["delta"], q, opt)


def lsa_solution(a_bar: Tensor, b_bar: Tensor, weights: Tensor | None = None) -> Tensor:
    """Return theta* solving (sum_c q_c Abar^c) theta = sum_c q_c bbar^c (uniform q by default).

    Args:
        a_bar: [N, D, D] mean matrices; b_bar: [N, D]; weights: [N] q_c or None.
    """
    q = _normalised(weights, a_bar)
    return torch.linalg.solve(torch.einsum("c,cde->de", q, a_bar), q @ b_bar)


def fedlsa_bias(
    a_bar: Tensor,
    b_bar: Tensor,
    eta: float,
    local_steps: int,
    weights: Tensor | None = None,
    rounds: int | None = None,
) -> Tensor:
    """Return FedLSA's bias theta_inf - theta* (fedlsa.md §3.3), exact for the expected iterate.

        Gamma_c = (I - eta Abar^c)^H,  Gammabar = sum_c q_c Gamma_c,
        rho = sum_c q_c (I - Gamma_c)(theta*^c - theta*),
        bias = (I - Gammabar)^-1 rho          (stationary; rounds=None)
        bias_T = sum_{s=1}^T Gammabar^{T-s} rho (finite T, started at theta*).

    With q_c = 1/N this is the slides' formula; it is 0 when H = 1 or when all Abar^c are equal.
    """
    q = _normalised(weights, a_bar)
    eye = torch.eye(a_bar.shape[-1], dtype=a_bar.dtype, device=a_bar.device)
    gammas = torch.linalg.matrix_power(eye - eta * a_bar, local_steps)  # [N, D, D]
    theta_star = lsa_solution(a_bar, b_bar, q)
    local = torch.linalg.solve(a_bar, b_bar.unsqueeze(-1)).squeeze(-1)  # [N, D] theta*^c
    rho = torch.einsum("c,cde,ce->d", q, eye - gammas, local - theta_star)
    gamma_bar = torch.einsum("c,cde->de", q, gammas)
    if rounds is None:
        return torch.linalg.solve(eye - gamma_bar, rho)
    bias = torch.zeros_like(rho)
    for _ in range(rounds):
        bias = gamma_bar @ bias + rho
    return bias


def _normalised(weights: Tensor | None, like: Tensor) -> Tensor:
    q = (
        torch.ones(like.shape[0], dtype=like.dtype, device=like.device)
        if weights is None
        else weights.to(like.dtype)
    )
    return q / q.sum()


EQUAL_CLIENT_TASKS = ("garnet-",)  # task-name prefixes whose clients all hold the same number of samples


def degenerate(hp: FedLSAConfig, opt: OptimConfig, run: RunFacts) -> list[Degeneracy]:
    """FedLSA's mean equals FedAvg's example-weighted mean: with weighting=examples, or equal-size clients."""
    if hp.weighting == "examples":
        return [
            Degeneracy(
                "fedlsa:is-fedavg",
                "hp.weighting=examples weights clients by their samples, as FedAvg "
                "does: the run computes --algo fedavg's model; the paper's FedLSA is --hp weighting=uniform "
                "(Mangold et al. §3.3).",
            )
        ]
    if run.task.startswith(EQUAL_CLIENT_TASKS):
        return [
            Degeneracy(
                "fedlsa:is-fedavg",
                f"task {run.task!r} gives every agent the same number of samples, so "
                "FedLSA's uniform mean (Mangold et al. §3.3) is FedAvg's example-weighted mean: the run "
                "computes --algo fedavg's model (FedLSA is the biased baseline that --algo scafflsa "
                "corrects).",
            )
        ]
    return []


ALGORITHM = Algorithm(
    name="fedlsa",
    paper="Mangold, Samsonov, Labbi, Levin, Alami, Naumov, Moulines. SCAFFLSA. NeurIPS 2024. arXiv:2402.04114",
    config_cls=FedLSAConfig,
    server_init=server_init,
    broadcast=fedavg.broadcast,
    client_update=fedavg.client_update,
    local=fedavg.LOCAL,
    server_update=server_update,
    global_params=fedavg.global_params,
    description="Federated LSA / TD(0): H local LSA steps, then averaging; biased under heterogeneity.",
    degenerate=degenerate,
    caveats=(
        "FedLSA is FedAvg on a linear stochastic approximation task (Mangold et al. §3): with clients of equal "
        "size (its uniform mean = FedAvg's example-weighted mean, as on the garnet tasks) the two runs are "
        "identical; it is the biased baseline that SCAFFLSA corrects."
    ),
)
