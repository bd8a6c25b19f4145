"""BayesADMM toys, Fig. 4: the 2-D logistic toy with an outlier cluster, FederatedADMM vs full-covariance BayesADMM.

Part of the `bayesadmm_toys` study (fedcli.studies.bayesadmm_toys: the paper, the deviations, `run`).
The released toy's data and client solvers (in numpy; tests/studies check them step for step
against the algorithms' client_update), the targets (MAP, Gaussian VB), the metrics and the numbers
the report shows (`fig4_numbers`); the report section with its tables, figure and checks is in
fedcli.studies.bayesadmm_toys_fig4_report.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedcli.algorithms import bayesadmm_full, fedadmm
from fedcli.algorithms.base import ClientOut
from fedcli.studies.bayesadmm_toys_shared import (
    F64,
    OPT,
    Cohort,
    Sizes,
    pad_cohort,
)

FIG4_WINDOW = (-6.0, 7.0, -3.0, 2.0)  # x1 and x2 range of the released plot (plot_illustration.py)
BOUNDARY_TOL = 0.01  # "reached": decision boundaries differ on <= 1% of FIG4_WINDOW


def fig4_clients() -> list[tuple[np.ndarray, np.ndarray]]:
    """The released toy's data (main_illustration.py dataset1(100), dataset2(200)); features [x1, x2, 1].

    Client 1: 45 points ~ N((-5, 0), 0.6^2 I), 5 outliers ~ N((-5, 0), 6^2 I), 3 fixed points near
    (-2.5, -2.5), all y = 1, then 50 points ~ N((5, 0), 0.6^2 I) with y = 0. Client 2: 100 points ~
    N((-3.2, 0.2), 0.25^2 I) with y = 1 and 100 ~ N((-0.4, 0.9), 0.25^2 I) with y = 0. Each data set is
    drawn from numpy's legacy generator seeded with 1, in the script's order, so the points are the authors'.
    """
    rng = np.random.RandomState(1)  # the script's np.random.seed(1) (legacy stream: same draws)
    left, right = np.tile([-5.0, 0.0], (50, 1)), np.tile([5.0, 0.0], (50, 1))
    x1 = np.concatenate(
        [
            rng.normal(loc=left[:45], scale=0.6),
            rng.normal(loc=left[45:], scale=6.0),
            [[-2.5, -2.5], [-2.4, -2.6], [-2.5, -2.4]],
            rng.normal(loc=right, scale=0.6),
        ]
    )
    y1 = np.r_[np.ones(53), np.zeros(50)]
    rng = np.random.RandomState(1)
    x2 = np.concatenate(
        [
            rng.normal(loc=np.tile([-3.2, 0.2], (100, 1)), scale=0.25),
            rng.normal(loc=np.tile([-0.4, 0.9], (100, 1)), scale=0.25),
        ]
    )
    y2 = np.r_[np.ones(100), np.zeros(100)]
    return [(np.hstack([x, np.ones((len(x), 1))]), y) for x, y in ((x1, y1), (x2, y2))]


def sigmoid(a: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-a)); exp(-a) = inf for a << 0 gives the exact limit 0."""
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-a))


def map_estimate(clients: list[tuple[np.ndarray, np.ndarray]], delta: float) -> np.ndarray:
    """theta* = argmin Sum_k l_k + delta/2 ||theta||^2 (l_k the summed logistic loss), by Newton's method."""
    x, y = np.vstack([c[0] for c in clients]), np.concatenate([c[1] for c in clients])
    theta = np.zeros(x.shape[1])
    for _ in range(50):
        p = sigmoid(x @ theta)
        hess = (x * (p * (1 - p))[:, None]).T @ x + delta * np.eye(len(theta))
        theta = theta - np.linalg.solve(hess, x.T @ (p - y) + delta * theta)
    return theta


def vb_estimate(
    clients: list[tuple[np.ndarray, np.ndarray]], delta: float, iterations: int = 300
) -> tuple[np.ndarray, np.ndarray]:
    """The Gaussian VB optimum of Eq. 3 (tau = 1): (m, S) with S = E_q[H] + delta I, E_q[g] + delta m = 0.

    E_q over q = N(m, S^-1) of the logistic terms reduces to 1-D expectations over a_i = x_i^T theta ~
    N(x_i^T m, x_i^T S^-1 x_i), taken by 60-point Gauss-Hermite quadrature; the fixed point is iterated with
    step 1/2 from the Laplace approximation at the MAP.
    """
    x, y = np.vstack([c[0] for c in clients]), np.concatenate([c[1] for c in clients])
    nodes, weights = np.polynomial.hermite_e.hermegauss(60)
    weights = weights / weights.sum()
    m = map_estimate(clients, delta)
    p = sigmoid(x @ m)
    s = (x * (p * (1 - p))[:, None]).T @ x + delta * np.eye(len(m))
    for _ in range(iterations):
        sd = np.sqrt(np.einsum("ij,jk,ik->i", x, np.linalg.inv(s), x))
        p = sigmoid((x @ m)[:, None] + sd[:, None] * nodes)  # [N, 60]
        mean_p, mean_curv = p @ weights, (p * (1 - p)) @ weights
        s = 0.5 * s + 0.5 * ((x * mean_curv[:, None]).T @ x + delta * np.eye(len(m)))
        m = m - 0.5 * np.linalg.solve(s, x.T @ (mean_p - y) + delta * m)
    return m, s


def von_client(
    cohort: Cohort,
    m_bar: np.ndarray,
    s_bar: np.ndarray,
    v: np.ndarray,
    V: np.ndarray,
    hp: bayesadmm_full.BayesADMMFullConfig,
    noise: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """bayesadmm_full.client_update's VON on the logistic loss, in numpy, for C clients x B runs at once.

    With lam = N_k/(rho tau), v~ = (tau/N_k) v, V~ = (tau/N_k) V, b_t = step_size / (1 + step_decay t):
    S <- (1 - b) S + b (lam (E[H] - V~) + S_bar);  m <- m - ratio b S^-1 (lam (E[g] + v~ - V~ m) + S_bar (m - m_bar)),
    E[g], E[H] (mean-loss gradient and Hessian) taken at theta = m + L^-T eps, S = L L^T, eps = noise[t] (one MC
    sample; eps = 0 is the delta method). Shapes: m_bar [B, D], s_bar [B, D, D] (the server of each run);
    v [C, B, D]; V [C, B, D, D]; noise [steps, C, B, D]. Returns (m [C, B, D], S [C, B, D, D]).
    """
    x, y, w = (t.numpy() for t in (cohort.x, cohort.y, cohort.weight))  # [C, N, D], [C, N], [C, N]
    n = cohort.num_examples.numpy()[:, None, None]  # [C, 1, 1]
    lam, scale = n / (hp.rho * hp.tau), hp.tau / n
    vt, Vt = scale * v, scale[..., None] * V
    m, s = np.broadcast_to(m_bar, v.shape).copy(), np.broadcast_to(s_bar, V.shape).copy()
    for t in range(len(noise)):
        chol_t = np.swapaxes(np.linalg.cholesky(s), -1, -2)
        theta = m + np.linalg.solve(chol_t, noise[t][..., None])[..., 0]  # [C, B, D]
        p = sigmoid(theta @ np.swapaxes(x, 1, 2))  # [C, B, N]
        g = ((p - y[:, None]) * w[:, None]) @ x / n  # [C, B, D]
        h = (
            np.swapaxes(x[:, None] * (p * (1 - p) * w[:, None])[..., None], -1, -2)
            @ x[:, None]
            / n[..., None]
        )
        b = hp.step_size / (1 + hp.step_decay * t)
        s = (1 - b) * s + b * (lam[..., None] * (h - Vt) + s_bar)
        direction = lam * (g + vt - (Vt @ m[..., None])[..., 0]) + (s_bar @ (m - m_bar)[..., None])[..., 0]
        m = m - hp.mean_step_ratio * b * np.linalg.solve(s, direction[..., None])[..., 0]
    return m, s


def admm_client(
    x: np.ndarray,
    y: np.ndarray,
    theta_bar: np.ndarray,
    v: np.ndarray,
    rho: float,
    lr: float,
    momentum: float,
    max_steps: int,
    tol: float,
) -> tuple[np.ndarray, int]:
    """The toy's ADMM client (admm.py solve_admm_subproblem): heavy-ball GD on l_k + v^T theta + rho/2 ||theta - theta_bar||^2.

    theta <- theta - lr g + momentum (theta - theta_prev) with g the summed-loss gradient; stops after the step
    at which ||g|| < tol (checked every 100 steps). fedadmm.client_update with client_lr = lr N_k takes the
    same steps (it minimises the objective / N_k). Returns (theta, steps taken).
    """
    theta, prev = theta_bar.copy(), theta_bar.copy()
    for step in range(max_steps):
        grad = x.T @ (sigmoid(x @ theta) - y) + rho * (theta - theta_bar) + v
        theta, prev = theta - lr * grad + momentum * (theta - prev), theta
        if step % 100 == 0 and np.linalg.norm(grad) < tol:
            return theta, step + 1
    return theta, max_steps


FIG4_DELTA, FIG4_RHO = 0.2, 0.2  # Fig. 4 / App. F.3: delta = rho = 0.2 for both methods


def fig4_bayes_config(mc_samples: int) -> bayesadmm_full.BayesADMMFullConfig:
    """The toy's BayesADMM: rho = 0.2, gamma = rho, tau = 1; VON lr_m = 0.01, lr_S = 0.005 on the summed loss
    with lam = 1/(tau rho) = 5, i.e. b_S = 0.001 / (1 + 0.1 t), b_m = 2 b_S (bayesadmm_full's docstring)."""
    return bayesadmm_full.BayesADMMFullConfig(
        rho=FIG4_RHO,
        dual_damping=1.0,
        delta=FIG4_DELTA,
        tau=1.0,
        step_size=0.001,
        step_decay=0.1,
        mean_step_ratio=2.0,
        mc_samples=mc_samples,
    )


def run_fig4_bayes(
    clients: list[tuple[np.ndarray, np.ndarray]],
    rounds: int,
    mc_runs: int,
    steps: int,
    rng: np.random.Generator,
) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """BayesADMM (full covariance) with the toy's inexact VON solves; per run, (m_bar, S_bar) per round.

    Runs 0..mc_runs-1 take one MC sample per VON step (the toy's setting); the last run uses the delta
    method (eps = 0, deterministic). Server start S = I (the toy's S_init), prior delta I; server steps by
    bayesadmm_full.server_update; duals by Eq. 36 with gamma = rho (each client keeps its own).
    """
    hp = fig4_bayes_config(1)
    cohort = pad_cohort([(torch.tensor(x), torch.tensor(y)) for x, y in clients])
    k, runs, dim = len(clients), mc_runs + 1, clients[0][0].shape[1]
    eye, zeros = torch.eye(dim, dtype=F64), torch.zeros(dim, dtype=F64)
    states = [
        bayesadmm_full.ServerState(mean={"w": zeros}, precision=eye, v_sum=zeros, V_sum=torch.zeros_like(eye))
        for _ in range(runs)
    ]
    v, V = np.zeros((k, runs, dim)), np.zeros((k, runs, dim, dim))
    history: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(runs)]
    for _ in range(rounds):
        m_bar = np.stack([st.mean["w"].numpy() for st in states])  # [B, D]
        s_bar = np.stack([st.precision.numpy() for st in states])  # [B, D, D]
        noise = rng.standard_normal((steps, k, runs, dim))
        noise[..., -1, :] = 0.0  # the delta-method run
        m, s = von_client(cohort, m_bar, s_bar, v, V, hp, noise)
        v += hp.dual_damping * hp.rho * ((s @ m[..., None])[..., 0] - (s_bar @ m_bar[..., None])[..., 0])
        V += hp.dual_damping * hp.rho * (s - s_bar)
        for b in range(runs):
            upload = {"mean": torch.tensor(m[:, b]), "precision": torch.tensor(s[:, b])}
            states[b], _ = bayesadmm_full.server_update(
                states[b], ClientOut(upload=upload, state=None, metrics={}), cohort.num_examples, hp, OPT
            )
            history[b].append((states[b].mean["w"].numpy().copy(), states[b].precision.numpy().copy()))
    return history


def run_fig4_admm(
    clients: list[tuple[np.ndarray, np.ndarray]], rounds: int, max_steps: int
) -> tuple[list[np.ndarray], list[int]]:
    """FederatedADMM with the toy's client solver (lr 1e-3, momentum 0.8, tol 1e-3); server by fedadmm.server_update.

    Returns the server mean per round and the client steps taken per solve.
    """
    hp = fedadmm.FedADMMConfig(rho=FIG4_RHO, delta=FIG4_DELTA, dual_damping=1.0)
    dim = clients[0][0].shape[1]
    state = fedadmm.server_init({"w": torch.zeros(dim, dtype=F64)}, hp, OPT)
    v = [np.zeros(dim) for _ in clients]
    means: list[np.ndarray] = []
    steps: list[int] = []
    for _ in range(rounds):
        theta_bar = state.params["w"].numpy()
        solves = [
            admm_client(x, y, theta_bar, v[c], hp.rho, 1e-3, 0.8, max_steps, 1e-3)
            for c, (x, y) in enumerate(clients)
        ]
        v = [v[c] + hp.dual_damping * hp.rho * (theta - theta_bar) for c, (theta, _) in enumerate(solves)]
        steps.extend(n for _, n in solves)
        upload = {"params": {"w": torch.tensor(np.stack([theta for theta, _ in solves]))}}
        state, _ = fedadmm.server_update(
            state,
            ClientOut(upload=upload, state=None, metrics={}),
            torch.ones(len(clients), dtype=F64),
            hp,
            OPT,
        )
        means.append(state.params["w"].numpy().copy())
    return means, steps


def boundary_disagreement(theta: np.ndarray, target: np.ndarray, size: int = 201) -> float:
    """Fraction of FIG4_WINDOW where sign(theta^T [x, 1]) != sign(target^T [x, 1]): 0 iff the drawn lines agree.

    The 0.5-contour of the Bayesian predictive E_q[sigmoid(theta^T x)] is the line m^T x = 0 (the logit is
    symmetric about its mean), so this compares the lines drawn in Fig. 4 for both methods.
    """
    x0, x1, y0, y1 = FIG4_WINDOW
    mesh = np.stack(np.meshgrid(np.linspace(x0, x1, size), np.linspace(y0, y1, size)), axis=-1).reshape(-1, 2)
    points = np.hstack([mesh, np.ones((len(mesh), 1))])
    return float(np.mean(np.sign(points @ theta) != np.sign(points @ target)))


def relative_error(theta: np.ndarray, target: np.ndarray) -> float:
    """||theta - target|| / ||target||."""
    return float(np.linalg.norm(theta - target) / np.linalg.norm(target))


def fig4_numbers(sizes: Sizes) -> dict[str, Any]:
    """Run Fig. 4's methods; return targets, per-iteration iterates and the metrics."""
    clients = fig4_clients()
    theta_map = map_estimate(clients, FIG4_DELTA)
    m_vb, s_vb = vb_estimate(clients, FIG4_DELTA)
    admm, admm_steps = run_fig4_admm(clients, sizes.fig4_admm_rounds, sizes.fig4_admm_max_steps)
    bayes = run_fig4_bayes(
        clients, sizes.fig4_bayes_rounds, sizes.fig4_mc_runs, sizes.fig4_von_steps, np.random.default_rng(0)
    )
    mc, laplace = bayes[:-1], bayes[-1]
    x = np.vstack([c[0] for c in clients])
    p = sigmoid(x @ theta_map)
    s_map = (x * (p * (1 - p))[:, None]).T @ x + FIG4_DELTA * np.eye(3)
    prec_err = lambda run, s_t: [float(np.linalg.norm(s - s_t) / np.linalg.norm(s_t)) for _, s in run]  # noqa: E731
    return {
        "clients": clients,
        "map": theta_map,
        "vb": m_vb,
        "admm": admm,
        "admm_steps": admm_steps,
        "mc": mc,
        "admm_area": [boundary_disagreement(t, theta_map) for t in admm],
        "admm_rel": [relative_error(t, theta_map) for t in admm],
        "mc_area": [[boundary_disagreement(m, m_vb) for m, _ in run] for run in mc],
        "mc_rel": [[relative_error(m, m_vb) for m, _ in run] for run in mc],
        "mc_prec": [prec_err(run, s_vb) for run in mc],
        "laplace_area": [boundary_disagreement(m, theta_map) for m, _ in laplace],
        "laplace_rel": [relative_error(m, theta_map) for m, _ in laplace],
        "laplace_prec": prec_err(laplace, s_map),
        "map_vs_vb": boundary_disagreement(m_vb, theta_map),
    }
