"""Federated TD(0) on Garnet MDPs: the federated LSA tasks of SCAFFLSA (Mangold et al. 2024).

Mangold, Samsonov, Labbi, Levin, Alami, Naumov, Moulines. SCAFFLSA: Taming Heterogeneity
in Federated Linear Stochastic Approximation and TD Learning. NeurIPS 2024.
arXiv:2402.04114. Generator: reference/fedlsa.md §4.2 (the authors' `GarnetEnv.py`,
re-derived; the RNG consumption order is reproduced so that gen_seed 42 gives the same
MDPs, checked against the reference values in tests/datasets/test_garnet.py).

N agents share a policy pi and features phi but each has its own kernel P^c and reward
r^c. TD(0) with linear values V(s) = phi(s)^T theta is LSA with the sample Z = (s, r, s'),
s ~ mu^c (stationary), s' ~ P^c_pi(s, .):

    A^c(Z) = phi(s) (phi(s) - gamma phi(s'))^T,     b^c(Z) = r phi(s)
    Abar^c = Phi^T D_mu^c (I - gamma P^c_pi) Phi,    bbar^c = Phi^T D_mu^c r^c
    theta*^c = (Abar^c)^-1 bbar^c,   theta* = (sum_c Abar^c)^-1 sum_c bbar^c  (uniform agents)

Task encoding (the engine's LSA contract, datasets/tasks.py `example_loss`): one example
is x = [phi(s), phi(s')] (2D floats), y = r. The model `LSAModel` holds one parameter
`lsa_theta` [D] and returns it broadcast to the batch; the per-example loss is the
semi-gradient TD surrogate 1/2 (r + gamma phi(s')^T sg(theta) - phi(s)^T theta)^2 whose
gradient is exactly A(Z) theta - b(Z), so one local SGD step with rate eta is the LSA step.

Deviations:
  Paper/code: fresh i.i.d. samples at every local step (buffers of 1000 refilled).
  Here: each agent holds a pre-drawn pool of samples (from --seed) that the engine's
  epochs and batches iterate over, so the engine solves the empirical system
  (Ahat^c, bhat^c = pool means); TaskData.optimum is its solution thetahat*, the point a
  bias-free method converges to. The MDP itself is fixed by gen_seed = 42 (the paper's),
  not by --seed, exactly as the authors keep one environment and vary sample seeds.
  Values are float64 (reference §6 item 13).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from types import MappingProxyType

import numpy as np
import torch
from torch import Tensor, nn

from fedcli.datasets.tasks import Task, TaskData, TaskOptions, fingerprint

LSA_PARAM = "lsa_theta"  # the parameter name LSA algorithms check (= fedcli.algorithms.fedlsa.LSA_PARAM)
GEN_SEED = 42  # gen_seed of every paper run (reference §4.2)


@dataclass(frozen=True)
class GarnetMDP:
    """N Garnet environments sharing features and policy, and their exact LSA systems."""

    kernels: np.ndarray  # [N, S, A, S] P^c(s' | s, a)
    rewards: np.ndarray  # [N, S] r^c(s)
    features: np.ndarray  # [S, D] phi(s), rows on the simplex
    policy: np.ndarray  # [S, A] pi(a | s)
    gamma: float
    transition: np.ndarray  # [N, S, S] P^c_pi
    stationary: np.ndarray  # [N, S] mu^c
    a_bar: np.ndarray  # [N, D, D] Abar^c
    b_bar: np.ndarray  # [N, D] bbar^c
    local_solutions: np.ndarray  # [N, D] theta*^c
    theta_star: np.ndarray  # [D] solution of the uniformly averaged system

    @property
    def num_agents(self) -> int:
        return self.rewards.shape[0]


def make_garnet(
    *,
    num_agents: int,
    heterogeneity: float,
    rng: np.random.Generator,
    num_states: int = 30,
    num_actions: int = 2,
    branching: int = 2,
    dim: int = 8,
    gamma: float = 0.95,
) -> GarnetMDP:
    """Generate N Garnet MDPs in the authors' RNG order (reference §4.2 steps 1-7).

    heterogeneity < 1 perturbs one shared kernel and reward by U[0, hg]; >= 1 alternates
    two kernels between even and odd agents (plus U[0, 0.02]) and, when > 1, flips the
    reward sign of odd agents.
    """
    if num_agents < 1 or heterogeneity < 0 or not 1 <= branching <= num_states or num_actions < 2:
        raise ValueError(
            f"Garnet needs num_agents >= 1, heterogeneity >= 0, 1 <= branching <= num_states "
            f"and num_actions >= 2; got {num_agents}, {heterogeneity}, {branching}, {num_actions}."
        )
    shape = (num_states, num_actions, num_states)
    if heterogeneity < 1:
        base = np.zeros(shape)
        for s in range(num_states):
            for a in range(num_actions):
                base[s, a, :branching] = 1.0
                rng.shuffle(base[s, a])
        kernels = np.repeat(base[None], num_agents, axis=0)
        width = heterogeneity
    else:
        first, second = np.zeros(shape), np.zeros(shape)
        for s in range(num_states):
            for a in range(num_actions):
                first[s, a, :branching] = 1.0
                rng.shuffle(first[s, a])
                second[s, a, :branching] = 1.0
                rng.shuffle(second[s, a])
        kernels = np.stack([first if c % 2 == 0 else second for c in range(num_agents)])
        width = 0.02
    kernels = np.abs(kernels + rng.uniform(0, width, size=kernels.shape) * (kernels != 0))
    kernels = kernels / kernels.sum(axis=-1, keepdims=True)
    base_reward = rng.uniform(0, 1, size=num_states)
    rewards = base_reward[None] + rng.uniform(0, heterogeneity, size=(num_agents, num_states))
    if heterogeneity > 1:
        rewards = np.stack([base_reward * (1.0 if c % 2 == 0 else -1.0) for c in range(num_agents)])
    features = rng.uniform(0, 1, size=(num_states, dim))
    features = features / features.sum(axis=1, keepdims=True)
    policy = np.zeros((num_states, num_actions))
    for s in range(num_states):
        policy[s, : num_actions - 1] = 1.0 / (num_actions - 1)
        rng.shuffle(policy[s])
    transition = np.einsum("sa,csat->cst", policy, kernels)
    stationary = np.stack([_stationary(p) for p in transition])
    next_features = transition @ features  # [N, S, D] E[phi(s') | s]
    a_bar = np.einsum("cs,sd,cse->cde", stationary, features, features[None] - gamma * next_features)
    b_bar = np.einsum("cs,cs,sd->cd", stationary, rewards, features)
    local = np.linalg.solve(a_bar, b_bar[..., None])[..., 0]
    theta_star = np.linalg.solve(a_bar.sum(axis=0), b_bar.sum(axis=0))
    return GarnetMDP(
        kernels, rewards, features, policy, gamma, transition, stationary, a_bar, b_bar, local, theta_star
    )


def _stationary(transition: np.ndarray) -> np.ndarray:
    """mu with mu P = mu: the eigenvector of P^T for eigenvalue ~1, summed to 1, real, abs."""
    values, vectors = np.linalg.eig(transition.T)
    vector = vectors[:, np.flatnonzero(np.isclose(values, 1.0))[0]]
    return np.abs(np.real(vector / vector.sum()))


def sample_transitions(
    mdp: GarnetMDP, num_samples: int, *, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Draw i.i.d. (s, s') per agent: s ~ mu^c, s' ~ P^c_pi(s, .) by inverse CDF.

    Returns:
        states [N, M] and next states [N, M] (int64).
    """
    n, s_count = mdp.num_agents, mdp.features.shape[0]
    cdf = np.cumsum(mdp.stationary, axis=1)  # [N, S]
    states = np.minimum((cdf[:, None, :] <= rng.uniform(size=(n, num_samples, 1))).sum(-1), s_count - 1)
    row_cdf = np.cumsum(mdp.transition, axis=2)[np.arange(n)[:, None], states]  # [N, M, S]
    nxt = np.minimum((row_cdf <= rng.uniform(size=(n, num_samples, 1))).sum(-1), s_count - 1)
    return states.astype(np.int64), nxt.astype(np.int64)


def td_examples(mdp: GarnetMDP, states: np.ndarray, next_states: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Encode samples as x = [phi(s), phi(s')] [N, M, 2D] and y = r^c(s) [N, M]."""
    x = np.concatenate([mdp.features[states], mdp.features[next_states]], axis=-1)
    y = np.take_along_axis(mdp.rewards, states, axis=1)
    return x, y


def empirical_system(x: Tensor, y: Tensor, gamma: float) -> tuple[Tensor, Tensor]:
    """Return the pool means Ahat = mean phi (phi - gamma phi')^T [D, D] and bhat = mean r phi [D]."""
    dim = x.shape[-1] // 2
    phi, phi_next = x[..., :dim], x[..., dim:]
    a_hat = torch.einsum("...md,...me->...de", phi, phi - gamma * phi_next) / x.shape[-2]
    b_hat = torch.einsum("...m,...md->...d", y, phi) / x.shape[-2]
    return a_hat, b_hat


def td_loss(output: Tensor, x: Tensor, y: Tensor, *, gamma: float) -> Tensor:
    """Semi-gradient TD(0) surrogate [B]: grad_theta = phi (phi - gamma phi')^T theta - r phi.

    output: [B, D] theta broadcast by LSAModel; x: [B, 2D] = [phi(s), phi(s')]; y: [B] rewards.
    """
    dim = output.shape[-1]
    value = (x[:, :dim] * output).sum(-1)
    next_value = (x[:, dim:] * output).sum(-1).detach()
    return 0.5 * (y + gamma * next_value - value) ** 2


class LSAModel(nn.Module):
    """The LSA 'model': one parameter theta [D] (zeros), returned broadcast to the batch [B, D]."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        setattr(self, LSA_PARAM, nn.Parameter(torch.zeros(dim, dtype=torch.float64)))

    def forward(self, x: Tensor, key: Tensor | None = None) -> Tensor:
        theta = getattr(self, LSA_PARAM)
        return theta.expand(x.shape[0], theta.shape[0])


def load_garnet(
    options: TaskOptions,
    *,
    num_agents: int,
    heterogeneity: float,
    train_per_agent: int = 1000,
    test_per_agent: int = 100,
) -> TaskData:
    """Pools of TD samples per agent (from options.seed) on the gen_seed-42 Garnet MDPs."""
    mdp = make_garnet(num_agents=num_agents, heterogeneity=heterogeneity, rng=np.random.default_rng(GEN_SEED))
    rng = np.random.default_rng(options.seed)
    x, y = td_examples(mdp, *sample_transitions(mdp, train_per_agent, rng=rng))
    test_x, test_y = td_examples(mdp, *sample_transitions(mdp, test_per_agent, rng=rng))
    x_t, y_t = torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(y, dtype=torch.float64)
    a_hat, b_hat = empirical_system(x_t, y_t, mdp.gamma)  # [N, D, D], [N, D]
    optimum = torch.linalg.solve(a_hat.sum(0), b_hat.sum(0))  # uniform agents, as the paper
    dim = x.shape[-1]
    x_flat, y_flat = x_t.reshape(-1, dim), y_t.reshape(-1)
    return TaskData(
        x=x_flat,
        y=y_flat,
        client_indices=[np.arange(c * train_per_agent, (c + 1) * train_per_agent) for c in range(num_agents)],
        client_names=[f"agent{c}" for c in range(num_agents)],
        test_x=torch.as_tensor(test_x.reshape(-1, dim), dtype=torch.float64),
        test_y=torch.as_tensor(test_y.reshape(-1), dtype=torch.float64),
        optimum=optimum,
        fingerprint=fingerprint(x_flat, y_flat),
    )


def _task(num_agents: int, heterogeneity: float, label: str) -> Task:
    return Task(
        name=f"garnet-{label}-n{num_agents}",
        description=(
            f"federated TD(0) on {num_agents} Garnet MDPs (30 states, d=8, gamma=0.95), "
            f"{'heterogeneous' if heterogeneity >= 1 else 'homogeneous'} hg={heterogeneity}; "
            "1000 samples/agent; SCAFFLSA paper §5"
        ),
        source="generated (MDP gen_seed 42, samples from --seed)",
        offline=True,
        kind="lsa",
        models=MappingProxyType({"linear": partial(LSAModel, 8)}),
        default_model="linear",
        load=partial(load_garnet, num_agents=num_agents, heterogeneity=heterogeneity),
        num_clients=num_agents,
        example_loss=partial(td_loss, gamma=0.95),
    )


TASKS = (_task(10, 10.0, "het"), _task(100, 10.0, "het"), _task(10, 0.02, "hom"), _task(100, 0.02, "hom"))
