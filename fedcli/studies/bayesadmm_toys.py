"""BayesADMM toys: one-round ridge regression (Fig. 3b), the 2-D outlier classifier (Fig. 4), Fig. 3a reduced.

Möllenhoff, Swaroop, Doshi-Velez, Khan. Federated ADMM from Bayesian Duality. arXiv:2506.13150 (v1), §4
and App. F; code team-approx-bayes/bayes-admm, toyexamples/ (read, not copied).

Fig. 3b: full-covariance BayesADMM (App. C.4) reaches the optimum of a ridge problem in one round (Prop.
3.2: conjugate losses, rho = 1/K, server at the prior), FederatedADMM (Fig. 2a) needs many rounds.
Fig. 4: 2-D logistic regression, K = 2 clients, one with an outlier cluster, delta = rho = 0.2 for both:
"The server ... with ADMM takes 5 iterations while with Bayes only needs 2".
Fig. 3a: Bayesian softmax regression on MNIST, K = 5 class-pair clients: PVI can diverge, damped PVI is
slower than BayesADMM, and BayesADMM improves over BregmanADMM.

Implements: Fig. 3b with the algorithms themselves: fedcli.algorithms.bayesadmm_full (client_update with
one VON step of size 1, a Newton step that is the exact client solve on a quadratic; server_update) and
fedcli.algorithms.fedadmm (client_update by heavy ball with Polyak's rates, exact to ~1e-12; server_update),
both vmapped over the clients as the engine does (cohort_round).
Fig. 4: the client solves of the released toy (10,001 VON steps with b_S = 0.001 / (1 + 0.1 t),
b_m = 2 b_S, one MC sample; heavy-ball GD, lr 1e-3, momentum 0.8, at most 25,000 steps, stopped when the
gradient norm is < 1e-3) run in numpy (von_client, admm_client: the torch clients cost ~8 ms and ~1.5 ms
a step, i.e. minutes; tests/studies check both against bayesadmm_full.client_update and
fedadmm.client_update step for step); the server steps are bayesadmm_full.server_update and
fedadmm.server_update.
Deviations:
  Fig. 3b data: the released code uses the first 500 MNIST *training* images (7 x 7, one-hot targets);
  fedcli bundles only the official test set, so this uses the first 500 images of the bundled training
  split (datasets/mnist.py) and its own exact optimum; the code's reference objective 161.1069 belongs to
  other data. Metric: F at the server mean (the code evaluates client 1's mean).
  Fig. 3b BayesADMM: Prop. 3.2's setting (server at the prior delta I, exact client solves); the released
  code starts the server at S = I and runs 50 VON steps of size 0.2 / (1 + 0.1 t) (inexact). The S = I
  start is run as a second curve (exact client solves).
  Fig. 4 BayesADMM: MC draws theta = m + L^-T eps (S = L L^T, covariance S^-1, as bayesadmm_full); the
  toy code's `z @ inv(L^T)` has covariance (L^T L)^-1, and it adds jitter 1e-7 before the Cholesky. The
  toy's torch RNG is unseeded: here 5 runs with draws from numpy.random.default_rng(0). Server start
  S = I (the toy's S_init), prior delta I.
  "Reached the optimum" is not defined in the paper (the figure is visual). Here: the decision boundary
  of the server mean differs from the target's on at most 1% of the authors' plot window (x1 in [-6, 7],
  x2 in [-3, 2]); the tables give every iteration and the relative parameter error for other reading.
  Target: the MAP of Sum l_k + delta/2 ||theta||^2 for ADMM and for BayesADMM with the delta method; the
  Gaussian VB optimum (Eq. 3, computed with 60-point Gauss-Hermite expectations) for MC BayesADMM.
  Fig. 3a: diagonal BayesADMM (Alg. 1) with the toy's IVON clients (main_elbo.py: fresh IVON from q_bar,
  h0 = 0, beta2 = 0.9995, lr 0.002 with a cosine over each solve; optim.ivon_step on an analytic softmax
  gradient, all clients at once) at 6 rounds x 151 steps instead of 26 x 1251 (time budget), on the bundled
  training split; the reference is one batch IVON run, not batch VON to convergence.
Size: one module per recipe (fedcli.studies), three figures, so it is over the 250-line algorithm budget;
the parts are in figure order and each function stays under 50 lines.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import Tensor

from fedcli.algorithms import bayesadmm_full, fedadmm
from fedcli.algorithms.base import Batch, ClientContext, ClientOut, OptimConfig, Params
from fedcli.studies.common import check_line, figure, markdown_table, save_figure, write_report

F64 = torch.float64
OPT = OptimConfig()  # server steps are closed form (sgd, lr 1); client rates are set per solver below
FIG4_WINDOW = (-6.0, 7.0, -3.0, 2.0)  # x1 and x2 range of the released plot (plot_illustration.py)
BOUNDARY_TOL = 0.01  # "reached": decision boundaries differ on <= 1% of FIG4_WINDOW


# ------------------------------------------------------------------------------------------ shared


def full_batch_context(x: Tensor, y: Tensor, loss_fn: Any, steps: int, round_idx: int,
                       noise: dict[str, Tensor] | None = None) -> ClientContext:
    """A client context whose every step sees all N_k examples (the toys are full batch)."""
    batch = Batch(x=x, y=y, weight=torch.ones(len(y), dtype=F64), key=torch.zeros((), dtype=torch.int64))
    return ClientContext(loss_fn=loss_fn, apply_fn=lambda p, z: z, batch=lambda step: batch,
                         step_mask=torch.ones(steps, dtype=F64), num_examples=torch.tensor(float(len(y)), dtype=F64),
                         num_epochs=1, steps_per_epoch=steps, round_idx=round_idx, noise=noise or {})


class Cohort(NamedTuple):
    """Full-participation clients padded to one size, so that client_update runs under vmap."""

    x: Tensor  # [C, N_max, ...] inputs (padding repeats a real row)
    y: Tensor  # [C, N_max, ...] targets
    weight: Tensor  # [C, N_max] 1.0 real example, 0.0 padding
    num_examples: Tensor  # [C] N_k


def pad_cohort(clients: list[tuple[Tensor, Tensor]]) -> Cohort:
    """Stack (x_k, y_k) with zero-weight padding; the losses are weighted means, so padding changes nothing."""
    n_max = max(len(y) for _, y in clients)
    pad = lambda t: torch.cat([t, t[:1].expand(n_max - len(t), *t.shape[1:])])  # noqa: E731
    return Cohort(x=torch.stack([pad(x) for x, _ in clients]), y=torch.stack([pad(y) for _, y in clients]),
                  weight=torch.stack([(torch.arange(n_max) < len(y)).to(F64) for _, y in clients]),
                  num_examples=torch.tensor([float(len(y)) for _, y in clients], dtype=F64))


def stack_tree(trees: list[Any]) -> Any:
    """Stack pytrees (client states) on a leading client axis."""
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda *xs: torch.stack(xs), *trees)


def cohort_round(update: Any, cohort: Cohort, bc: Any, states: Any, hp: Any, opt: OptimConfig, loss_fn: Any,
                 steps: int, round_idx: int) -> ClientOut:
    """Run update(ctx, bc, state, hp, opt) for every client at once with torch.func.vmap (as the engine does)."""

    def one(x: Tensor, y: Tensor, w: Tensor, n: Tensor, state: Any) -> tuple[Any, Any]:
        batch = Batch(x=x, y=y, weight=w, key=torch.zeros((), dtype=torch.int64))
        ctx = ClientContext(loss_fn=loss_fn, apply_fn=lambda p, z: z, batch=lambda step: batch,
                            step_mask=torch.ones(steps, dtype=F64), num_examples=n, num_epochs=1,
                            steps_per_epoch=steps, round_idx=round_idx, noise={})
        out = update(ctx, bc, state, hp, opt)
        return out.upload, out.state

    upload, new_states = torch.func.vmap(one)(cohort.x, cohort.y, cohort.weight, cohort.num_examples, states)
    return ClientOut(upload=upload, state=new_states, metrics={})


def first_round(values: list[float], tol: float) -> int | None:
    """Return the first 1-based round whose value is <= tol (None if none)."""
    return next((r for r, v in enumerate(values, start=1) if v <= tol), None)


# ------------------------------------------------------------------------------------------ Fig. 3b


class Ridge(NamedTuple):
    clients: list[tuple[Tensor, Tensor]]  # (x_k [N_k, P], one-hot y_k [N_k, 10]) per class pair
    x: Tensor  # [N, P] all inputs
    y: Tensor  # [N, 10]
    delta: float  # prior precision, l_0 = delta/2 ||W||^2


def ridge_problem(count: int, side: int, delta: float = 25.0) -> Ridge:
    """First `count` images of the bundled MNIST training split, side x side (nearest), K = 5 class pairs."""
    from fedcli.datasets.mnist import load_bundled

    images, labels, _, _ = load_bundled()
    raw = torch.tensor(images[:count], dtype=F64)[:, None] / 255.0
    x = torch.nn.functional.interpolate(raw, size=(side, side)).reshape(count, -1)
    lab = torch.tensor(labels[:count])
    y = torch.nn.functional.one_hot(lab, 10).to(F64)
    clients = [(x[(lab == c) | (lab == c + 1)], y[(lab == c) | (lab == c + 1)]) for c in range(0, 10, 2)]
    return Ridge(clients, x, y, delta)


def ridge_loss(params: Params, batch: Batch) -> Tensor:
    """Mean over the batch of 1/2 ||W x_i - y_i||^2 (the toy's squared loss / N_k)."""
    per = 0.5 * ((batch.x @ params["w"].T - batch.y) ** 2).sum(-1)
    return (per * batch.weight).sum() / batch.weight.sum()


def ridge_objective(problem: Ridge, w: Tensor) -> float:
    """F(W) = Sum_i 1/2 ||W x_i - y_i||^2 + delta/2 ||W||^2 (Eq. 3's MAP objective, the code's global_loss)."""
    return float(0.5 * ((problem.x @ w.T - problem.y) ** 2).sum() + 0.5 * problem.delta * (w**2).sum())


def ridge_optimum(problem: Ridge) -> Tensor:
    """W* = ((X^T X + delta I)^-1 X^T Y)^T, the exact minimiser of F."""
    gram = problem.x.T @ problem.x + problem.delta * torch.eye(problem.x.shape[1], dtype=F64)
    return torch.linalg.solve(gram, problem.x.T @ problem.y).T


def run_ridge_bayes(problem: Ridge, rounds: int, init_precision: float) -> list[tuple[Tensor, Tensor]]:
    """Full-covariance BayesADMM, rho = gamma = 1/K, tau = 1, exact client solves; (m_bar, S_bar) per round.

    init_precision = delta is Prop. 3.2's start (the prior); 1.0 is the released toy's S_init = I.
    """
    k, dim = len(problem.clients), problem.x.shape[1] * 10
    hp = bayesadmm_full.BayesADMMFullConfig(rho=1 / k, dual_damping=1.0, delta=problem.delta, tau=1.0, max_params=dim)
    params = {"w": torch.zeros(10, problem.x.shape[1], dtype=F64)}
    start = bayesadmm_full.server_init(params, hp, OPT)
    state = bayesadmm_full.ServerState(mean=start.mean, precision=init_precision * torch.eye(dim, dtype=F64),
                                       v_sum=start.v_sum, V_sum=start.V_sum)
    cohort = pad_cohort(problem.clients)
    client_states = stack_tree([bayesadmm_full.init_client_state(params, hp) for _ in problem.clients])
    history = []
    for r in range(1, rounds + 1):
        outs = cohort_round(bayesadmm_full.client_update, cohort, bayesadmm_full.broadcast(state, hp),
                            client_states, hp, OPT, ridge_loss, 1, r)
        client_states = outs.state
        state, _ = bayesadmm_full.server_update(state, outs, cohort.num_examples, hp, OPT)
        history.append((state.mean["w"].clone(), state.precision.clone()))
    return history


def polyak_heavy_ball(problem: Ridge, rho: float) -> OptimConfig:
    """Polyak's heavy ball for the per-example client objectives A_k/N_k + rho/N_k I (fedadmm's scaling):
    lr = 4 / (sqrt(L) + sqrt(mu))^2, momentum = ((sqrt(L) - sqrt(mu)) / (sqrt(L) + sqrt(mu)))^2."""
    eig = [float(e) + rho / len(y) for x, y in problem.clients for e in torch.linalg.eigvalsh(x.T @ x / len(y))]
    lo, hi = min(eig) ** 0.5, max(eig) ** 0.5
    return OptimConfig(client_lr=4 / (lo + hi) ** 2, client_momentum=((hi - lo) / (hi + lo)) ** 2)


def run_ridge_admm(problem: Ridge, rounds: int, rho: float, steps: int) -> list[Tensor]:
    """FedADMM (Fig. 2a), the toy's rho = 200, gamma = rho, delta = 25; server means per round."""
    hp = fedadmm.FedADMMConfig(rho=rho, delta=problem.delta, dual_damping=1.0)
    opt = polyak_heavy_ball(problem, rho)
    params = {"w": torch.zeros(10, problem.x.shape[1], dtype=F64)}
    state = fedadmm.server_init(params, hp, OPT)
    cohort = pad_cohort(problem.clients)
    client_states = stack_tree([fedadmm.init_client_state(params, hp) for _ in problem.clients])
    means = []
    for r in range(1, rounds + 1):
        outs = cohort_round(fedadmm.client_update, cohort, fedadmm.broadcast(state, hp), client_states, hp, opt,
                            ridge_loss, steps, r)
        client_states = outs.state
        state, _ = fedadmm.server_update(state, outs, cohort.num_examples, hp, OPT)
        means.append(state.params["w"].clone())
    return means


# ------------------------------------------------------------------------------------------ Fig. 4


def fig4_clients() -> list[tuple[np.ndarray, np.ndarray]]:
    """The released toy's data (main_illustration.py dataset1(100), dataset2(200)); features [x1, x2, 1].

    Client 1: 45 points ~ N((-5, 0), 0.6^2 I), 5 outliers ~ N((-5, 0), 6^2 I), 3 fixed points near
    (-2.5, -2.5), all y = 1, then 50 points ~ N((5, 0), 0.6^2 I) with y = 0. Client 2: 100 points ~
    N((-3.2, 0.2), 0.25^2 I) with y = 1 and 100 ~ N((-0.4, 0.9), 0.25^2 I) with y = 0. Each data set is
    drawn from numpy's legacy generator seeded with 1, in the script's order, so the points are the authors'.
    """
    rng = np.random.RandomState(1)  # the script's np.random.seed(1) (legacy stream: same draws)
    left, right = np.tile([-5.0, 0.0], (50, 1)), np.tile([5.0, 0.0], (50, 1))
    x1 = np.concatenate([rng.normal(loc=left[:45], scale=0.6), rng.normal(loc=left[45:], scale=6.0),
                         [[-2.5, -2.5], [-2.4, -2.6], [-2.5, -2.4]], rng.normal(loc=right, scale=0.6)])
    y1 = np.r_[np.ones(53), np.zeros(50)]
    rng = np.random.RandomState(1)
    x2 = np.concatenate([rng.normal(loc=np.tile([-3.2, 0.2], (100, 1)), scale=0.25),
                         rng.normal(loc=np.tile([-0.4, 0.9], (100, 1)), scale=0.25)])
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


def vb_estimate(clients: list[tuple[np.ndarray, np.ndarray]], delta: float, iterations: int = 300
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


def von_client(cohort: Cohort, m_bar: np.ndarray, s_bar: np.ndarray, v: np.ndarray, V: np.ndarray,
               hp: bayesadmm_full.BayesADMMFullConfig, noise: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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
        h = np.swapaxes(x[:, None] * (p * (1 - p) * w[:, None])[..., None], -1, -2) @ x[:, None] / n[..., None]
        b = hp.step_size / (1 + hp.step_decay * t)
        s = (1 - b) * s + b * (lam[..., None] * (h - Vt) + s_bar)
        direction = lam * (g + vt - (Vt @ m[..., None])[..., 0]) + (s_bar @ (m - m_bar)[..., None])[..., 0]
        m = m - hp.mean_step_ratio * b * np.linalg.solve(s, direction[..., None])[..., 0]
    return m, s


def admm_client(x: np.ndarray, y: np.ndarray, theta_bar: np.ndarray, v: np.ndarray, rho: float, lr: float,
                momentum: float, max_steps: int, tol: float) -> tuple[np.ndarray, int]:
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
    return bayesadmm_full.BayesADMMFullConfig(rho=FIG4_RHO, dual_damping=1.0, delta=FIG4_DELTA, tau=1.0,
                                              step_size=0.001, step_decay=0.1, mean_step_ratio=2.0,
                                              mc_samples=mc_samples)


def run_fig4_bayes(clients: list[tuple[np.ndarray, np.ndarray]], rounds: int, mc_runs: int, steps: int,
                   rng: np.random.Generator) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """BayesADMM (full covariance) with the toy's inexact VON solves; per run, (m_bar, S_bar) per round.

    Runs 0..mc_runs-1 take one MC sample per VON step (the toy's setting); the last run uses the delta
    method (eps = 0, deterministic). Server start S = I (the toy's S_init), prior delta I; server steps by
    bayesadmm_full.server_update; duals by Eq. 36 with gamma = rho (each client keeps its own).
    """
    hp = fig4_bayes_config(1)
    cohort = pad_cohort([(torch.tensor(x), torch.tensor(y)) for x, y in clients])
    k, runs, dim = len(clients), mc_runs + 1, clients[0][0].shape[1]
    eye, zeros = torch.eye(dim, dtype=F64), torch.zeros(dim, dtype=F64)
    states = [bayesadmm_full.ServerState(mean={"w": zeros}, precision=eye, v_sum=zeros, V_sum=torch.zeros_like(eye))
              for _ in range(runs)]
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
            states[b], _ = bayesadmm_full.server_update(states[b], ClientOut(upload=upload, state=None, metrics={}),
                                                        cohort.num_examples, hp, OPT)
            history[b].append((states[b].mean["w"].numpy().copy(), states[b].precision.numpy().copy()))
    return history


def run_fig4_admm(clients: list[tuple[np.ndarray, np.ndarray]], rounds: int, max_steps: int
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
        solves = [admm_client(x, y, theta_bar, v[c], hp.rho, 1e-3, 0.8, max_steps, 1e-3)
                  for c, (x, y) in enumerate(clients)]
        v = [v[c] + hp.dual_damping * hp.rho * (theta - theta_bar) for c, (theta, _) in enumerate(solves)]
        steps.extend(n for _, n in solves)
        upload = {"params": {"w": torch.tensor(np.stack([theta for theta, _ in solves]))}}
        state, _ = fedadmm.server_update(state, ClientOut(upload=upload, state=None, metrics={}),
                                         torch.ones(len(clients), dtype=F64), hp, OPT)
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


# ------------------------------------------------------------------------------------------ Fig. 3a


class Softmax(NamedTuple):
    cohort: Cohort  # class-pair clients: x [C, N_max, P], one-hot y [C, N_max, 10]
    x: Tensor  # [N, P] all inputs
    y: Tensor  # [N, 10] one-hot
    delta: float  # prior precision (main_elbo.py: 10)


def softmax_problem(count: int, side: int, delta: float = 10.0) -> Softmax:
    """First `count` images of the bundled training split, side x side, K = 5 class-pair clients (main_elbo.py)."""
    ridge = ridge_problem(count, side, delta)
    return Softmax(pad_cohort(ridge.clients), ridge.x, ridge.y, delta)


def softmax_grad(theta: Tensor, cohort: Cohort) -> Tensor:
    """Gradient of each client's mean cross-entropy, (softmax(X W^T) - Y)^T X / N_k: [C, 10, P]."""
    probs = torch.softmax(cohort.x @ theta.transpose(1, 2), dim=-1)  # [C, N, 10]
    residual = (probs - cohort.y) * cohort.weight[..., None]
    return residual.transpose(1, 2) @ cohort.x / cohort.num_examples[:, None, None]


def neg_elbo(problem: Softmax, mean: Tensor, precision: Tensor, eps: Tensor) -> float:
    """main_elbo.py's objective of q = N(m, diag(1/s)): E_q[Sum_i l_i] (MC over eps [M, 10, P]) + delta/2 ||m||^2
    + 1/2 Sum log s + 1/2 Sum delta / s (the KL to the prior N(0, 1/delta) up to a constant)."""
    thetas = mean + eps / precision.sqrt()  # [M, 10, P]
    logits = problem.x @ thetas.transpose(1, 2)  # [M, N, 10]
    nll = (torch.logsumexp(logits, -1) - (logits * problem.y).sum(-1)).sum(-1).mean()
    kl = 0.5 * (problem.delta * mean**2 + precision.log() + problem.delta / precision).sum()
    return float(nll + kl)


def ivon_solve(cohort: Cohort, target: Any, start: Tensor, hp: Any, lr: float, steps: int,
               generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """A fresh IVON per client (main_elbo.py: h0, 1 MC sample, full batch, steps + 1 updates with the
    cosine lr(t) = lr (1 + cos(pi t / steps)) / 2), by optim.ivon_step; returns (m_k, s_k) [C, 10, P]."""
    from fedcli.algorithms.optim import IvonState, ivon_precision, ivon_sample, ivon_step

    state = IvonState(mean={"w": start}, hess={"w": torch.full_like(start, hp.h0)},
                      momentum={"w": torch.zeros_like(start)}, step=torch.zeros((), dtype=F64))
    for t in range(steps + 1):
        eps = {"w": torch.randn(start.shape, generator=generator, dtype=F64)}
        grad = softmax_grad(ivon_sample(state, target, eps)["w"], cohort)
        state = ivon_step(state, {"w": grad}, {"w": grad * eps["w"]}, target,
                          lr=lr * 0.5 * (1 + math.cos(math.pi * t / steps)), beta1=hp.beta1, beta2=hp.beta2,
                          debias=hp.debias)
    return state.mean["w"], ivon_precision(state, target)["w"]


def run_fig3a_method(problem: Softmax, hp: Any, rounds: int, steps: int, lr: float, eps: Tensor,
                     generator: torch.Generator) -> list[float]:
    """Diagonal BayesADMM and its relatives (hp: bayesadmm.BayesADMMConfig) with IVON clients; neg-ELBO per round.

    Client step as bayesadmm.client_update (ess N_k/(rho tau), multipliers (tau/N_k) v_k, (tau/N_k) u_k, prior
    q_bar), duals by bayesadmm.dual_increments, server by bayesadmm.server_update; clients start at m_bar.
    """
    from fedcli.algorithms import bayesadmm
    from fedcli.algorithms.optim import IvonTarget

    cohort = problem.cohort
    shape = (10, problem.x.shape[1])
    state = bayesadmm.server_init({"w": torch.zeros(shape, dtype=F64)}, hp, OPT)
    k = len(cohort.num_examples)
    v, u = torch.zeros(k, *shape, dtype=F64), torch.zeros(k, *shape, dtype=F64)
    ess = (cohort.num_examples / (hp.rho * hp.tau))[:, None, None]  # [C, 1, 1]
    scale = hp.tau / cohort.num_examples[:, None, None]
    curve = []
    for _ in range(rounds):
        m_bar, s_bar = state.mean["w"], state.precision["w"]
        target = IvonTarget(ess=ess, prior_mean={"w": m_bar}, prior_prec={"w": s_bar / ess}, lin={"w": scale * v},
                            quad={"w": scale * u})
        m, s = ivon_solve(cohort, target, m_bar.expand(k, *shape), hp, lr, steps, generator)
        dv, du = bayesadmm.dual_increments({"w": m}, {"w": s}, {"w": m_bar}, {"w": s_bar},
                                           hp.dual_damping * hp.rho, hp.dual_coordinates)
        v, u = v + dv["w"], u + du["w"]
        outs = ClientOut(upload={"mean": {"w": m}, "precision": {"w": s}}, state=None, metrics={})
        state, _ = bayesadmm.server_update(state, outs, cohort.num_examples, hp, OPT)
        curve.append(neg_elbo(problem, state.mean["w"], state.precision["w"], eps))
    return curve


def batch_vb(problem: Softmax, hp: Any, steps: int, lr: float, eps: Tensor, generator: torch.Generator) -> float:
    """The reference: one IVON on all N examples (ess N, prior N(0, 1/delta)) for `steps` steps; its neg-ELBO."""
    from fedcli.algorithms.optim import IvonTarget

    pooled = pad_cohort([(problem.x, problem.y)])
    n = pooled.num_examples[:, None, None]
    zeros = torch.zeros(1, 10, problem.x.shape[1], dtype=F64)
    target = IvonTarget(ess=n, prior_mean={"w": zeros}, prior_prec={"w": problem.delta / n + zeros}, lin={}, quad={})
    m, s = ivon_solve(pooled, target, zeros, hp, lr, steps, generator)
    return neg_elbo(problem, m[0], s[0], eps)


# ------------------------------------------------------------------------------------------ report


class Sizes(NamedTuple):
    """Every size of the study in one place (full mode; smoke mode shrinks them)."""

    ridge_count: int = 500  # Fig. 3b: N (main_onestep.py)
    ridge_side: int = 7  # 7 x 7 images, P = 49, D = 490
    ridge_admm_rounds: int = 20  # main_onestep.py runs 20
    ridge_admm_steps: int = 30  # heavy-ball steps per solve (error x 0.25 per step)
    ridge_bayes_rounds: int = 5
    fig4_admm_rounds: int = 8  # the toy runs 6 (plots 1, 3, 5)
    fig4_bayes_rounds: int = 5  # the toy runs 3 (plots 1, 2)
    fig4_mc_runs: int = 5
    fig4_von_steps: int = 10_001  # von_fullcov's num_iters + 1
    fig4_admm_max_steps: int = 25_000
    elbo_count: int = 5000  # Fig. 3a: N (main_elbo.py)
    elbo_side: int = 14  # 14 x 14 images, P = 196
    elbo_rounds: int = 6  # main_elbo.py: 25 (+1)
    elbo_steps: int = 150  # main_elbo.py: 1250 (+1)


SMOKE = Sizes(ridge_count=100, ridge_side=4, ridge_admm_rounds=2, ridge_admm_steps=10, ridge_bayes_rounds=2,
              fig4_admm_rounds=2, fig4_bayes_rounds=2, fig4_mc_runs=1, fig4_von_steps=100, fig4_admm_max_steps=500,
              elbo_count=300, elbo_side=7, elbo_rounds=2, elbo_steps=10)


def cell(values: list[float], r: int) -> float | str:
    """values[r] or "—" (the run has fewer rounds)."""
    return values[r] if r < len(values) else "—"


def semilogy(ax: Any, curves: dict[str, list[float]], floor: float, styles: dict[str, str]) -> None:
    """Plot max(|y|, floor) against the 1-based round on a log axis."""
    for name, ys in curves.items():
        ax.semilogy(range(1, len(ys) + 1), [max(abs(y), floor) for y in ys], styles.get(name, "o-"), label=name)
    ax.set_xlabel("server iteration (round)")
    integer_rounds(ax)
    ax.legend(fontsize=7)


RIDGE_NAMES = ("FedADMM (rho = 200)", "BayesADMM, server at the prior", "BayesADMM, server at S = I")


def fig3b_numbers(sizes: Sizes) -> dict[str, Any]:
    """Run Fig. 3b's three methods; return F*, the relative gaps, the errors and the S = I precision errors."""
    problem = ridge_problem(sizes.ridge_count, sizes.ridge_side)
    w_star = ridge_optimum(problem)
    f_star = ridge_objective(problem, w_star)
    p = problem.x.shape[1]
    s_star = torch.kron(torch.eye(10, dtype=F64), problem.x.T @ problem.x) + problem.delta * torch.eye(10 * p, dtype=F64)
    admm = run_ridge_admm(problem, sizes.ridge_admm_rounds, 200.0, sizes.ridge_admm_steps)
    prior = run_ridge_bayes(problem, sizes.ridge_bayes_rounds, problem.delta)
    eye = run_ridge_bayes(problem, sizes.ridge_bayes_rounds, 1.0)
    runs = dict(zip(RIDGE_NAMES, (admm, [m for m, _ in prior], [m for m, _ in eye]), strict=True))
    return {
        "f_star": f_star, "p": p,
        "gaps": {n: [(ridge_objective(problem, w) - f_star) / f_star for w in ws] for n, ws in runs.items()},
        "errs": {n: [float((w - w_star).norm() / w_star.norm()) for w in ws] for n, ws in runs.items()},
        "prec_err": [float((s - s_star).norm() / s_star.norm()) for _, s in eye],
    }


def fig3b_checks(n: dict[str, Any]) -> list[str]:
    """Prop. 3.2 (one round from the prior), FedADMM's many rounds, and the halving from S = I."""
    admm_gap, prior_err, prec_err = n["gaps"][RIDGE_NAMES[0]], n["errs"][RIDGE_NAMES[1]], n["prec_err"]
    admm_reach = first_round(admm_gap, 1e-6)
    halving = [b / a for a, b in zip(prec_err, prec_err[1:], strict=False)]
    return [
        check_line("BayesADMM (full covariance, rho = 1/K, server at the prior) is exact after one round (Prop. 3.2)",
                   prior_err[0] <= 1e-10, f"||m_bar_1 - W*|| / ||W*|| = {prior_err[0]:.1e}"),
        check_line("FederatedADMM needs many rounds (relative gap <= 1e-6)", admm_reach is None or admm_reach > 5,
                   f"reached at round {admm_reach}" if admm_reach else
                   f"not within {len(admm_gap)} rounds; gap {admm_gap[-1]:.2e} at the last"),
        check_line("Starting the server at S = I (the released code) instead of the prior loses one-round exactness; "
                   "the precision error then halves every round (alpha = 1/(1 + rho K) = 1/2)",
                   prec_err[0] > 1e-3 and all(abs(h - 0.5) < 1e-6 for h in halving),
                   "||S_bar_r - S*|| / ||S*|| = " + ", ".join(f"{e:.3g}" for e in prec_err)),
    ]


def fig3b_section(out: Path, sizes: Sizes) -> list[str]:
    """Fig. 3b: ridge regression, FedADMM vs full-covariance BayesADMM (two server starts)."""
    n = fig3b_numbers(sizes)
    gaps, errs = n["gaps"], n["errs"]
    rows = [[r + 1, *(x for name in RIDGE_NAMES for x in (cell(gaps[name], r), cell(errs[name], r)))]
            for r in range(sizes.ridge_admm_rounds)]
    fig = figure(6.0, 4.0)
    ax = fig.subplots()
    semilogy(ax, gaps, 1e-17, dict(zip(RIDGE_NAMES, ("s-", "^-", "v--"), strict=True)))
    ax.set_ylabel("(F(m_bar) - F*) / F*  (floor 1e-17)")
    png = save_figure(fig, out, "fig3b")
    return [
        "## Fig. 3b: one-round convergence on ridge regression", "",
        "**Claim (§4, Fig. 3b, Prop. 3.2).** On a quadratic (conjugate) problem, full-covariance BayesADMM with "
        "rho = 1/K and the server at the prior converges in a single round; FederatedADMM needs many.", "",
        f"**Setup.** The first {sizes.ridge_count} images of the bundled MNIST training split, {sizes.ridge_side} x "
        f"{sizes.ridge_side} (nearest), one-hot targets, W in R^(10 x {n['p']}) (D = {10 * n['p']}), K = 5 clients "
        "holding the class pairs (0,1), ..., (8,9); F(W) = Sum_i 1/2 ||W x_i - y_i||^2 + delta/2 ||W||^2, delta = "
        "25. BayesADMM: `bayesadmm_full` with rho = gamma = 1/K = 0.2, tau = 1, one VON step of size 1 per client "
        "(a Newton step: the exact client solve on a quadratic). FederatedADMM: `fedadmm` with rho = 200 "
        f"(the released code's), gamma = rho, {sizes.ridge_admm_steps} heavy-ball steps with Polyak's rates "
        "per solve (exact to ~1e-12). The released code's data are the first 500 MNIST *training* images, "
        f"which fedcli does not ship: its reference F* = 161.1069 is for other data; here F* = {n['f_star']:.4f} "
        "(exact solve). Metrics at the server mean m_bar (the code plots client 1's mean).", "",
        *markdown_table(["round", "FedADMM gap", "FedADMM err", "Bayes (prior) gap", "Bayes (prior) err",
                         "Bayes (S = I) gap", "Bayes (S = I) err"], rows), "",
        "gap = (F(m_bar) - F*) / F* (float64 rounding ~1e-16); err = ||m_bar - W*|| / ||W*||; — = not run.", "",
        f"![relative objective gap per round]({png})", "",
        *fig3b_checks(n),
    ]


def plot_boundaries(ax: Any, clients: list[tuple[np.ndarray, np.ndarray]], thetas: list[np.ndarray],
                    target: np.ndarray, title: str) -> None:
    """Fig. 4's picture: both clients' points and the server's decision lines theta^T [x, 1] = 0 per iteration."""
    for c, (x, y) in enumerate(clients):
        for label, marker in ((1, "o"), (0, "s")):
            pts = x[y == label]
            ax.scatter(pts[:, 0], pts[:, 1], s=12, marker=marker, alpha=0.6, rasterized=True,
                       color=("#6AC1DE", "#CF7A7A")[c] if label else ("#1565C0", "#8B2E2E")[c])
    xs = np.linspace(*FIG4_WINDOW[:2], 50)
    for r, theta in enumerate(thetas, start=1):
        ax.plot(xs, -(theta[0] * xs + theta[2]) / theta[1], color=plt_color(r, len(thetas)), lw=1.2, label=f"iter {r}")
    ax.plot(xs, -(target[0] * xs + target[2]) / target[1], "r--", lw=1.5, label="target")
    ax.set_xlim(FIG4_WINDOW[:2])
    ax.set_ylim(FIG4_WINDOW[2:])
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=6, loc="lower right", ncol=2)


def plt_color(r: int, total: int) -> tuple[float, float, float, float]:
    """Colour of iteration r of total (light to dark)."""
    from matplotlib import colormaps

    return colormaps["viridis"](0.9 - 0.8 * (r - 1) / max(total - 1, 1))


def integer_rounds(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def fig4_numbers(sizes: Sizes) -> dict[str, Any]:
    """Run Fig. 4's methods; return targets, per-iteration iterates and the metrics."""
    clients = fig4_clients()
    theta_map = map_estimate(clients, FIG4_DELTA)
    m_vb, s_vb = vb_estimate(clients, FIG4_DELTA)
    admm, admm_steps = run_fig4_admm(clients, sizes.fig4_admm_rounds, sizes.fig4_admm_max_steps)
    bayes = run_fig4_bayes(clients, sizes.fig4_bayes_rounds, sizes.fig4_mc_runs, sizes.fig4_von_steps,
                           np.random.default_rng(0))
    mc, laplace = bayes[:-1], bayes[-1]
    x = np.vstack([c[0] for c in clients])
    p = sigmoid(x @ theta_map)
    s_map = (x * (p * (1 - p))[:, None]).T @ x + FIG4_DELTA * np.eye(3)
    prec_err = lambda run, s_t: [float(np.linalg.norm(s - s_t) / np.linalg.norm(s_t)) for _, s in run]  # noqa: E731
    return {
        "clients": clients, "map": theta_map, "vb": m_vb, "admm": admm, "admm_steps": admm_steps, "mc": mc,
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


def spread(values: list[float]) -> str:
    """median [min, max] of the MC runs."""
    return f"{np.median(values):.3g} [{min(values):.3g}, {max(values):.3g}]"


def reach_text(count: int | None) -> str:
    return "—" if count is None else str(count)


def fig4_rows(n: dict[str, Any]) -> list[list[Any]]:
    """One row per server iteration."""
    rounds = max(len(n["admm"]), len(n["mc"][0]))
    rows = []
    for r in range(rounds):
        mc = [run[r] for run in n["mc_area"]] if r < len(n["mc"][0]) else None
        rows.append([r + 1, cell(n["admm_rel"], r), cell(n["admm_area"], r),
                     spread([run[r] for run in n["mc_rel"]]) if mc else "—", spread(mc) if mc else "—",
                     spread([run[r] for run in n["mc_prec"]]) if mc else "—",
                     cell(n["laplace_rel"], r), cell(n["laplace_area"], r), cell(n["laplace_prec"], r)])
    return rows


def fig4_figure(n: dict[str, Any], out: Path) -> str:
    """Server lines per iteration for ADMM and one MC run of BayesADMM, and the disagreement curves."""
    fig = figure(15.0, 4.2)
    axes = fig.subplots(1, 3)
    plot_boundaries(axes[0], n["clients"], n["admm"], n["map"], "FederatedADMM server (target: MAP)")
    plot_boundaries(axes[1], n["clients"], [m for m, _ in n["mc"][0]], n["vb"], "BayesADMM server, MC run 0 (target: VB)")
    for i, area in enumerate(n["mc_area"]):
        axes[2].semilogy(range(1, len(area) + 1), np.maximum(area, 1e-4), "b-", alpha=0.5,
                         label="BayesADMM, MC runs" if i == 0 else None)
    semilogy(axes[2], {"FederatedADMM": n["admm_area"], "BayesADMM, delta method": n["laplace_area"]}, 1e-4,
             {"FederatedADMM": "ks-", "BayesADMM, delta method": "g^--"})
    axes[2].axhline(BOUNDARY_TOL, color="r", ls=":", lw=1)
    axes[2].set_ylabel("boundary disagreement (fraction of window)")
    return save_figure(fig, out, "fig4")


def fig4_checks(n: dict[str, Any], reach: dict[str, Any], sizes: Sizes) -> list[str]:
    """The claims of Fig. 4, computed, and a reading of why they hold or not."""
    admm_reach, mc_reach, laplace_reach = reach["admm"], reach["mc"], reach["laplace"]
    ordered = sorted(math.inf if c is None else c for c in mc_reach)
    first = [area[0] for area in n["mc_area"]]
    best = int(np.argmin(n["admm_area"]))
    hp = fig4_bayes_config(1)
    moved = sum(hp.step_size / (1 + hp.step_decay * t) for t in range(sizes.fig4_von_steps))
    return [
        check_line("FederatedADMM's server reaches the optimum's decision boundary at iteration 5 (Fig. 4)",
                   admm_reach == 5, f"first iteration within tolerance: {reach_text(admm_reach)}"),
        check_line("BayesADMM (the authors' schedule, 1 MC sample) reaches it by iteration 2 in every run (Fig. 4)",
                   all(c is not None and c <= 2 for c in mc_reach),
                   "per run: " + ", ".join(reach_text(c) for c in mc_reach)),
        check_line("BayesADMM with the delta method (no MC noise) reaches it by iteration 2",
                   laplace_reach is not None and laplace_reach <= 2, f"first iteration: {reach_text(laplace_reach)}"),
        check_line("BayesADMM needs fewer server iterations than FederatedADMM (median over MC runs)",
                   ordered[len(ordered) // 2] < (math.inf if admm_reach is None else admm_reach),
                   f"median {ordered[len(ordered) // 2]} vs {reach_text(admm_reach)}"),
        check_line("After one round BayesADMM's decision line is closer to its target than ADMM's, in every run "
                   "(\"adapts in a single round\")", max(first) < n["admm_area"][0],
                   f"boundary disagreement {min(first):.4f}-{max(first):.4f} vs {n['admm_area'][0]:.4f}"),
        "",
        f"**Reading.** With the authors' schedule a client solve is far from exact: Sum_t b_S,t = {moved:.3f}, so "
        "each VON run moves the client precision only about that fraction of the way from S_bar to its fixed "
        "point, and after 2 server iterations the server precision is still "
        f"{np.median([run[1] for run in n['mc_prec']]):.0%} (median) away from the VB precision. The means "
        "adapt faster (the mean step is preconditioned by the small S), which is why BayesADMM's line is already "
        "close after one round, but whether it is within the tolerance by iteration 2 depends on the MC draws "
        "(the toy's torch RNG is unseeded, so the published figure shows one unknown draw). ADMM's line is "
        f"closest to the MAP's at iteration {best + 1} (Fig. 4 draws iterations 1, 3, 5), where its parameters "
        f"are still {n['admm_rel'][best]:.0%} off; at iteration {len(n['admm'])} the line disagrees on "
        f"{n['admm_area'][-1]:.2%} of the window and the parameters are {n['admm_rel'][-1]:.0%} off.",
    ]


def fig4_section(out: Path, sizes: Sizes) -> list[str]:
    """Fig. 4: 2-D logistic regression with an outlier cluster, FederatedADMM vs full-covariance BayesADMM."""
    n = fig4_numbers(sizes)
    reach: dict[str, Any] = {"admm": first_round(n["admm_area"], BOUNDARY_TOL),
                             "mc": [first_round(a, BOUNDARY_TOL) for a in n["mc_area"]],
                             "laplace": first_round(n["laplace_area"], BOUNDARY_TOL)}
    reach_rows = [["FederatedADMM", reach_text(reach["admm"]), reach_text(first_round(n["admm_rel"], 0.1))],
                  ["BayesADMM, 1 MC sample (per run)", ", ".join(reach_text(c) for c in reach["mc"]),
                   ", ".join(reach_text(first_round(a, 0.1)) for a in n["mc_rel"])],
                  ["BayesADMM, delta method", reach_text(reach["laplace"]),
                   reach_text(first_round(n["laplace_rel"], 0.1))]]
    steps = n["admm_steps"]
    return [
        "## Fig. 4: 2-D classification with an outlier", "",
        "**Claim (§4, Fig. 4).** With K = 2 clients (one holds an outlier cluster), delta = rho = 0.2 for both "
        "methods, \"the server ... with ADMM takes 5 iterations while with Bayes only needs 2\"; BayesADMM \"quickly "
        "adapts in a single round\".", "",
        "**Setup.** The released toy's data (103 + 200 points, features [x1, x2, 1], seeded as in the script, "
        "so the authors' points) and its client solvers: FederatedADMM with heavy-ball GD (lr 1e-3, momentum 0.8, "
        f"<= {sizes.fig4_admm_max_steps} steps, stop at gradient norm < 1e-3; the solves took {min(steps)}-"
        f"{max(steps)} steps); full-covariance BayesADMM with {sizes.fig4_von_steps} VON steps b_S = 0.001 / "
        "(1 + 0.1 t), b_m = 2 b_S (lr_S = 0.005, lr_m = 0.01 on the summed loss), one MC sample per step "
        f"({sizes.fig4_mc_runs} runs, numpy default_rng(0)) and, as a deterministic variant, the delta method; "
        "server start S = I as in the toy; server steps by `bayesadmm_full.server_update` and "
        "`fedadmm.server_update`. Targets: MAP theta* of Sum l_k + delta/2 ||theta||^2 for ADMM and the "
        "delta method, the Gaussian VB optimum (Eq. 3) for MC BayesADMM. Reached = the server's decision line "
        f"differs from the target's on <= {BOUNDARY_TOL:.0%} of the plotted window x1 in [-6, 7], x2 in [-3, 2] "
        "(our threshold: the paper judges the figure by eye). For scale: the MAP and VB lines differ on "
        f"{n['map_vs_vb']:.2%} of it.", "",
        f"theta* = ({', '.join(f'{t:.4f}' for t in n['map'])}); VB mean = ({', '.join(f'{t:.4f}' for t in n['vb'])}).",
        "",
        *markdown_table(["iter", "ADMM err", "ADMM boundary", "Bayes MC err", "Bayes MC boundary",
                         "Bayes MC prec. err", "Bayes delta err", "Bayes delta boundary", "Bayes delta prec. err"],
                        fig4_rows(n)), "",
        "err = ||theta_bar - target|| / ||target||; boundary = fraction of the window where the decisions differ; "
        "prec. err = ||S_bar - S*|| / ||S*|| (S* the VB precision, or the Laplace precision at theta*); MC columns: "
        "median [min, max] over the runs; — = not run.", "",
        *markdown_table(["method", f"iterations to boundary <= {BOUNDARY_TOL:.0%}", "iterations to err <= 10%"],
                        reach_rows), "",
        f"![decision lines per server iteration and the boundary disagreement]({fig4_figure(n, out)})", "",
        *fig4_checks(n, reach, sizes),
    ]


FIG3A_METHODS: dict[str, dict[str, Any]] = {  # main_elbo.py: rho = 1 for all; gamma = damping x rho; alpha = 1/(1 + rho K) unless fixed
    "BayesADMM": {"dual_damping": 1.0},
    "BregmanADMM": {"dual_damping": 0.2, "dual_coordinates": "expectation"},
    "PVI": {"dual_damping": 1.0, "server_alpha": 1.0},
    "damped PVI": {"dual_damping": 0.2, "server_alpha": 1.0},
}


def fig3a_figure(curves: dict[str, list[float]], reference: float, total: int, out: Path) -> str:
    """neg-ELBO per round for each method, with the batch reference."""
    fig = figure(6.0, 4.0)
    ax = fig.subplots()
    for name, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), ys, "o-", label=name)
    ax.axhline(reference, color="k", ls="--", lw=1, label=f"batch IVON, {total} updates")
    ax.set_xlabel("round")
    integer_rounds(ax)
    ax.set_ylabel("neg-ELBO of q_bar")
    ax.legend(fontsize=7)
    return save_figure(fig, out, "fig3a")


def fig3a_checks(curves: dict[str, list[float]]) -> list[str]:
    """Fig. 3a's three statements, computed from the curves."""
    bayes, bregman, pvi, damped = (curves[name] for name in FIG3A_METHODS)
    return [
        check_line("Undamped PVI does not converge (its neg-ELBO rises again)", pvi[-1] > 1.05 * min(pvi),
                   f"min {min(pvi):.1f}, last {pvi[-1]:.1f}"),
        check_line("Damping makes PVI decrease monotonically, but it stays above BayesADMM every round",
                   all(b < a for a, b in zip(damped, damped[1:], strict=False))
                   and all(b < d for b, d in zip(bayes, damped, strict=True)),
                   f"last round: damped PVI {damped[-1]:.1f}, BayesADMM {bayes[-1]:.1f}"),
        check_line("BayesADMM is below BregmanADMM every round", all(b < g for b, g in zip(bayes, bregman, strict=True)),
                   f"last round: {bayes[-1]:.1f} vs {bregman[-1]:.1f}"),
    ]


def fig3a_section(out: Path, sizes: Sizes) -> list[str]:
    """Fig. 3a at a reduced scale: diagonal BayesADMM, BregmanADMM, PVI and damped PVI with IVON clients."""
    from fedcli.algorithms import bayesadmm

    problem = softmax_problem(sizes.elbo_count, sizes.elbo_side)
    generator = torch.Generator().manual_seed(0)
    eps = torch.randn(32, 10, problem.x.shape[1], generator=generator, dtype=F64)
    common: dict[str, Any] = {"rho": 1.0, "delta": problem.delta, "tau": 1.0, "h0": 0.0, "beta1": 0.9, "beta2": 0.9995,
              "mc_samples": 1, "dual_scope": "seen"}  # Alg. 1's sums: every client uploads every round
    curves = {name: run_fig3a_method(problem, bayesadmm.BayesADMMConfig(**common, **extra), sizes.elbo_rounds,
                                     sizes.elbo_steps, 0.002, eps, generator)
              for name, extra in FIG3A_METHODS.items()}
    total = sizes.elbo_rounds * (sizes.elbo_steps + 1)  # as many IVON updates as each client made
    reference = batch_vb(problem, bayesadmm.BayesADMMConfig(**common), total - 1, 0.002, eps, generator)
    rows = [[r + 1, *(f"{curves[name][r]:.1f}" for name in FIG3A_METHODS)] for r in range(sizes.elbo_rounds)]
    ratio = 26 * 1251 / total
    return [
        "## Fig. 3a (reduced scale): PVI, damped PVI, BregmanADMM and BayesADMM", "",
        "**Claim (§4, Fig. 3a).** \"PVI can diverge on logistic regression (MNIST). The damping used by Ashman "
        "et al. improves this, but is slower than BayesADMM ... BayesADMM clearly improves over BregmanADMM.\"", "",
        f"**Setup.** The released script (main_elbo.py) at a smaller scale: the first {sizes.elbo_count} images of "
        f"the bundled training split, {sizes.elbo_side} x {sizes.elbo_side} (nearest), linear softmax without bias, "
        "K = 5 class-pair clients, diagonal Gaussians, prior delta = 10, tau = 1, rho = 1; gamma = rho "
        "(BayesADMM, PVI) or 0.2 rho (BregmanADMM, damped PVI); alpha = 1/(1 + rho K) or 1 (PVI). Each client "
        f"solve is a fresh IVON from q_bar (h0 = 0, beta2 = 0.9995, 1 MC sample, full batch, lr 0.002 with a "
        f"cosine over the solve) for {sizes.elbo_steps} + 1 steps instead of 1250 + 1, and {sizes.elbo_rounds} "
        f"rounds instead of 25 + 1 (the full scale has {ratio:.0f}x this run's client steps). IVON steps by "
        "`optim.ivon_step`, duals by `bayesadmm.dual_increments`, server by `bayesadmm.server_update` "
        "(BregmanADMM as fedcli implements it, lambda_hat += gamma (mu_k - mu_bar) with lambda_hat = (v, -u/2); "
        "the toy code's update of u is +gamma Delta(m^2 + 1/s), the opposite sign and half the size, not run "
        "here). Objective: the script's neg-ELBO of q_bar (32 fixed MC samples). The paper's "
        "reference (batch VON to convergence; 2312 on its data) is replaced by one batch IVON run of as many "
        "steps, an upper bound on the minimum.", "",
        *markdown_table(["round", *FIG3A_METHODS], rows), "",
        f"Batch IVON reference ({total} updates on all data, lr 0.002 with one cosine): {reference:.1f}.", "",
        f"![neg-ELBO per round]({fig3a_figure(curves, reference, total, out)})", "",
        *fig3a_checks(curves),
    ]


def run(out: Path, *, smoke: bool = False) -> None:
    """Run Figs. 3b, 4 and 3a; write one report with their tables, figures and checks.

    Torch runs single-threaded inside (restored afterwards): the tensors are tiny and on a 2-core machine
    two threads only contend (3x slower measured).
    """
    started = time.perf_counter()
    sizes = SMOKE if smoke else Sizes()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        sections = [fig3b_section(out, sizes), fig4_section(out, sizes), fig3a_section(out, sizes)]
    finally:
        torch.set_num_threads(threads)
    intro = ["Möllenhoff, Swaroop, Doshi-Velez, Khan. Federated ADMM from Bayesian Duality. arXiv:2506.13150 (v1), "
             "§4 and App. F; toy code team-approx-bayes/bayes-admm (toyexamples/). Everything runs on CPU, float64.", ""]
    lines = intro + [line for section in sections for line in [*section, ""]]
    write_report(out, "BayesADMM toys: Figs. 3b, 4 and 3a", lines, recipe="bayesadmm-toys", smoke=smoke,
                 started=started)
