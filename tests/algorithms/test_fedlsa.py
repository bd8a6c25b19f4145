"""FedLSA and SCAFFLSA (Mangold et al., NeurIPS 2024, arXiv:2402.04114; reference/fedlsa.md).

Noise-free federated LSA: agent c sees A^c(Z) = Abar^c and b^c(Z) = bbar^c at every step
(non-symmetric Abar^c whose symmetric part is >= I). One local step is the affine map
theta <- theta - eta (Abar^c theta - bbar^c), so H steps from theta give
theta*^c + Gamma_c (theta - theta*^c) with Gamma_c = (I - eta Abar^c)^H and
theta*^c = (Abar^c)^-1 bbar^c. Averaging with q_c (sum 1):
    theta_{t+1} - theta* = Gammabar (theta_t - theta*) + rho,
    Gammabar = sum_c q_c Gamma_c,  rho = sum_c q_c (I - Gamma_c)(theta*^c - theta*),
a contraction whose unique fixed point is theta* + (I - Gammabar)^-1 rho: FedLSA's bias
(fedlsa.md §3.3), zero when H = 1 (I - Gamma_c = eta Abar^c, and sum_c q_c Abar^c
(theta*^c - theta*) = sum_c q_c bbar^c - (sum_c q_c Abar^c) theta* = 0) or when all Abar^c are
equal (rho = (I - Gamma) sum_c q_c (theta*^c - theta*) = (I - Gamma) Abar^-1 (bbar - Abar theta*) = 0).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils import _pytree as pytree

from fedcli.algorithms import ALGORITHMS, fedavg, fedlsa, scafflsa, scaffold
from fedcli.algorithms.base import Batch, ClientContext, ClientOut, HyperparameterError, OptimConfig
from fedcli.config.build import build_config
from fedcli.datasets.bundled import garnet
from fedcli.datasets.registry import TASKS
from fedcli.datasets.tasks import TaskOptions
from fedcli.engine.clientstate import ClientStateStore
from fedcli.engine.rounds import Timing, run_round
from fedcli.engine.setup import build

DT = torch.float64
D, N = 3, 3
P = fedlsa.LSA_PARAM


def lsa_problem(seed: int, equal_a: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Return Abar [N, D, D] = Q diag(1..2) Q^T + 0.4 (R - R^T) (non-symmetric) and bbar [N, D]."""
    g = torch.Generator().manual_seed(seed)
    mats = []
    for _ in range(N):
        q, _ = torch.linalg.qr(torch.randn(D, D, generator=g, dtype=DT))
        r = torch.randn(D, D, generator=g, dtype=DT)
        mats.append(q @ torch.diag(1.0 + torch.rand(D, generator=g, dtype=DT)) @ q.T + 0.4 * (r - r.T))
    a_bar = torch.stack([mats[0]] * N) if equal_a else torch.stack(mats)
    return a_bar, 3.0 * torch.randn(N, D, generator=g, dtype=DT)


def lsa_loss(params: dict[str, torch.Tensor], batch: Batch) -> torch.Tensor:
    """Generic LSA surrogate <A theta.detach() - b, theta>: its gradient is A theta - b."""
    theta = params[P]
    field = torch.einsum("bde,e->bd", batch.x, theta.detach()) - batch.y
    return ((field @ theta) * batch.weight).sum() / batch.weight.sum()


def agent(a_mat: torch.Tensor, b_vec: torch.Tensor, steps: int) -> ClientContext:
    """A noise-free LSA agent taking `steps` local steps (one epoch of `steps` batches)."""
    batch = Batch(
        x=a_mat[None], y=b_vec[None], weight=torch.ones(1, dtype=DT), key=torch.zeros((), dtype=torch.int64)
    )
    return ClientContext(
        loss_fn=lsa_loss,
        apply_fn=lambda p, v: v,
        batch=lambda s: batch,
        step_mask=torch.ones(steps, dtype=DT),
        num_examples=torch.tensor(1.0, dtype=DT),
        num_epochs=1,
        steps_per_epoch=steps,
        round_idx=1,
        noise={},
    )


def stack(outs: list[ClientOut]) -> ClientOut:
    def stacked(field: int) -> object:
        parts = [tuple(o)[field] for o in outs]
        return None if parts[0] is None else pytree.tree_map(lambda *xs: torch.stack(xs), *parts)

    return ClientOut(upload=stacked(0), state=stacked(1), metrics=stacked(2))


def run(alg, agents, theta0, rounds, hp, opt, weights, states=None, on_round=None):  # noqa: ANN001, ANN201
    """Full participation for `rounds` rounds; returns the final server state."""
    state = alg.server_init({P: theta0}, hp, opt)
    states = {} if states is None else states
    if alg.init_client_state is not None:
        for c in range(len(agents)):
            states.setdefault(c, alg.init_client_state({P: theta0}, hp))
    for _ in range(rounds):
        bc = alg.broadcast(state, hp)
        outs = [alg.client_update(ctx, bc, states.get(c), hp, opt) for c, ctx in enumerate(agents)]
        for c, out in enumerate(outs):
            states[c] = out.state
        state, _ = alg.server_update(state, stack(outs), weights, hp, opt)
        if on_round is not None:
            on_round(states)
    return state


def np_round_map(a_bar: torch.Tensor, b_bar: torch.Tensor, lr: float, h: int, q: torch.Tensor | None):
    """The noise-free FedLSA round in numpy, written from the step itself (not from fedcli):
    theta -> sum_c q_c theta_H^c with theta_{k+1}^c = theta_k^c - lr (Abar^c theta_k^c - bbar^c).
    It is affine, theta -> M theta + r; returns (M, r) by running it on 0 and on the unit vectors."""
    a, b = a_bar.numpy(), b_bar.numpy()
    w = np.full(len(a), 1.0 / len(a)) if q is None else q.numpy() / q.numpy().sum()

    def one_round(theta: np.ndarray) -> np.ndarray:
        out = np.zeros_like(theta)
        for c in range(len(a)):
            local = theta.copy()
            for _ in range(h):
                local = local - lr * (a[c] @ local - b[c])
            out += w[c] * local
        return out

    r = one_round(np.zeros(a.shape[-1]))
    return np.stack([one_round(e) - r for e in np.eye(a.shape[-1])], axis=1), r


def np_fixed_point(a_bar, b_bar, lr: float, h: int, q=None) -> torch.Tensor:  # noqa: ANN001
    """theta_inf = (I - M)^-1 r, the fixed point of the affine round map (a contraction here)."""
    m, r = np_round_map(a_bar, b_bar, lr, h, q)
    return torch.from_numpy(np.linalg.solve(np.eye(len(r)) - m, r))


def np_solution(a_bar, b_bar, q=None) -> torch.Tensor:  # noqa: ANN001
    """theta* of the averaged system (sum_c q_c Abar^c) theta = sum_c q_c bbar^c, in numpy."""
    a, b = a_bar.numpy(), b_bar.numpy()
    w = np.full(len(a), 1.0 / len(a)) if q is None else q.numpy() / q.numpy().sum()
    return torch.from_numpy(np.linalg.solve(np.einsum("c,cde->de", w, a), w @ b))


@pytest.mark.slow
@pytest.mark.parametrize("weighting", ["uniform", "examples"])
def test_fedlsa_fixed_point_is_the_closed_form_bias(weighting: str) -> None:
    """Heterogeneous Abar^c, H = 5, eta = 0.2, n = (1, 3, 2): after 25 rounds from 0 the iterate
    equals the fixed point (I - M)^-1 r of the affine round map theta -> M theta + r, built in
    numpy from the local step itself (np_round_map), with q = 1/N or q = n / sum n; fedlsa's
    closed forms theta* and (I - Gammabar)^-1 rho (module docstring) agree with it. The bias is
    large (> 0.05) so that the check can fail."""
    a_bar, b_bar = lsa_problem(0)
    n = torch.tensor([1.0, 3.0, 2.0], dtype=DT)
    q = None if weighting == "uniform" else n
    lr, h = 0.2, 5
    expected = np_fixed_point(a_bar, b_bar, lr, h, q)
    torch.testing.assert_close(
        fedlsa.lsa_solution(a_bar, b_bar, q), np_solution(a_bar, b_bar, q), rtol=0, atol=1e-12
    )
    torch.testing.assert_close(
        fedlsa.fedlsa_bias(a_bar, b_bar, lr, h, q),
        expected - np_solution(a_bar, b_bar, q),
        rtol=0.0,
        atol=1e-10,
    )
    hp, opt = fedlsa.FedLSAConfig(weighting=weighting), OptimConfig(client_lr=lr)

    final = run(
        ALGORITHMS["fedlsa"],
        [agent(a, b, h) for a, b in zip(a_bar, b_bar, strict=True)],
        torch.zeros(D, dtype=DT),
        25,
        hp,
        opt,
        n,
    )

    assert float(fedlsa.fedlsa_bias(a_bar, b_bar, lr, h, q).norm()) > 0.05
    torch.testing.assert_close(final.params[P], expected, rtol=0.0, atol=1e-10)


@pytest.mark.parametrize("h,equal_a", [(1, False), (5, True)])
def test_fedlsa_bias_vanishes_for_one_step_or_equal_matrices(h: int, equal_a: bool) -> None:
    """H = 1 or equal Abar^c (with different bbar^c): the closed form is 0 and theta* is a fixed
    point of the (contracting) round map: 3 rounds from theta* stay at theta*. With H = 5 and
    heterogeneous Abar^c, theta* moves, so the check can fail."""
    a_bar, b_bar = lsa_problem(1, equal_a=equal_a)
    theta_star = np_solution(a_bar, b_bar)
    hp, opt, n = fedlsa.FedLSAConfig(), OptimConfig(client_lr=0.2), torch.ones(N, dtype=DT)

    final = run(
        ALGORITHMS["fedlsa"],
        [agent(a, b, h) for a, b in zip(a_bar, b_bar, strict=True)],
        theta_star,
        3,
        hp,
        opt,
        n,
    )
    hetero_a, hetero_b = lsa_problem(1)
    moved = run(
        ALGORITHMS["fedlsa"],
        [agent(a, b, 5) for a, b in zip(hetero_a, hetero_b, strict=True)],
        np_solution(hetero_a, hetero_b),
        1,
        hp,
        opt,
        n,
    )

    torch.testing.assert_close(
        fedlsa.fedlsa_bias(a_bar, b_bar, 0.2, h), torch.zeros(D, dtype=DT), rtol=0.0, atol=1e-13
    )
    torch.testing.assert_close(np_fixed_point(a_bar, b_bar, 0.2, h), theta_star, rtol=0.0, atol=1e-11)
    torch.testing.assert_close(final.params[P], theta_star, rtol=0.0, atol=1e-12)
    assert float((moved.params[P] - np_solution(hetero_a, hetero_b)).norm()) > 1e-2


def test_fedlsa_bias_finite_horizon_and_one_shot_limit() -> None:
    """From theta_0 = theta*, T rounds give theta_T - theta* = sum_{s=1}^T Gammabar^{T-s} rho
    (the finite-T form, fedlsa.md §3.3). As H -> inf, Gamma_c -> 0 and the bias tends to
    (1/N) sum_c theta*^c - theta* (one-shot averaging, fedlsa.md §2.1)."""
    a_bar, b_bar = lsa_problem(2)
    theta_star = np_solution(a_bar, b_bar)
    hp, opt = fedlsa.FedLSAConfig(), OptimConfig(client_lr=0.1)
    local = torch.linalg.solve(a_bar, b_bar.unsqueeze(-1)).squeeze(-1)
    m, r = np_round_map(a_bar, b_bar, 0.1, 4, None)
    expected = theta_star.numpy()
    for _ in range(3):
        expected = m @ expected + r

    final = run(
        ALGORITHMS["fedlsa"],
        [agent(a, b, 4) for a, b in zip(a_bar, b_bar, strict=True)],
        theta_star,
        3,
        hp,
        opt,
        torch.ones(N, dtype=DT),
    )

    torch.testing.assert_close(final.params[P], torch.from_numpy(expected), rtol=0.0, atol=1e-12)
    torch.testing.assert_close(
        fedlsa.fedlsa_bias(a_bar, b_bar, 0.1, 4, rounds=3),
        torch.from_numpy(expected) - theta_star,
        rtol=0.0,
        atol=1e-12,
    )
    torch.testing.assert_close(
        fedlsa.fedlsa_bias(a_bar, b_bar, 0.1, 3000), local.mean(0) - theta_star, rtol=0.0, atol=1e-10
    )


@pytest.mark.slow
@pytest.mark.parametrize("weighting", ["uniform", "examples"])
def test_scafflsa_fixed_point_is_the_true_solution(weighting: str) -> None:
    """Same heterogeneity as the FedLSA test (H = 5, eta = 0.2). The corrected SCAFFLSA's fixed
    point is theta* with xi^c = Abar^c theta* - bbar^c (a local step from theta* then moves by
    -eta (Abar^c theta* - bbar^c - xi^c) = 0, and xi^c changes by (theta* - theta*)/(eta H) = 0);
    sum_c q_c xi^c = 0 after every round (xi^c_0 = 0 and sum_c q_c (theta_{t+1} - theta^c_{t,H}) = 0)."""
    a_bar, b_bar = lsa_problem(0)
    n = torch.tensor([1.0, 3.0, 2.0], dtype=DT)
    q = torch.ones(N, dtype=DT) if weighting == "uniform" else n
    theta_star = np_solution(a_bar, b_bar, q)
    hp, opt = scafflsa.SCAFFLSAConfig(weighting=weighting), OptimConfig(client_lr=0.2)
    states: dict[int, scafflsa.ClientState] = {}
    sums: list[torch.Tensor] = []

    final = run(
        ALGORITHMS["scafflsa"],
        [agent(a, b, 5) for a, b in zip(a_bar, b_bar, strict=True)],
        torch.zeros(D, dtype=DT),
        45,
        hp,
        opt,
        n,
        states,
        on_round=lambda st: sums.append(sum(q[c] * s.xi[P] for c, s in st.items())),
    )

    assert float((np_fixed_point(a_bar, b_bar, 0.2, 5, q) - theta_star).norm()) > 0.05  # FedLSA's bias
    torch.testing.assert_close(final.params[P], theta_star, rtol=0.0, atol=1e-10)
    for c in range(N):
        torch.testing.assert_close(states[c].xi[P], a_bar[c] @ theta_star - b_bar[c], rtol=0.0, atol=1e-9)
    torch.testing.assert_close(torch.stack(sums), torch.zeros(45, D, dtype=DT), rtol=0.0, atol=1e-12)


def test_scafflsa_is_scaffold_option_two_under_full_participation() -> None:
    """With xi^c = c_c - c, SCAFFOLD option II with uniform weights, eta_g = 1 and full
    participation gives xi^c_{t+1} = xi^c_t + (theta_{t+1} - theta^c_{t,H}) / (eta H) (fedlsa.md
    §3.4 [D]), so both produce the same iterates round after round (checked for 4 rounds)."""
    a_bar, b_bar = lsa_problem(3)
    agents = [agent(a, b, 4) for a, b in zip(a_bar, b_bar, strict=True)]
    opt, n, theta0 = (
        OptimConfig(client_lr=0.15),
        torch.tensor([2.0, 1.0, 4.0], dtype=DT),
        torch.ones(D, dtype=DT),
    )
    for rounds in (1, 4):
        ours = run(ALGORITHMS["scafflsa"], agents, theta0, rounds, scafflsa.SCAFFLSAConfig(), opt, n)
        hp = scaffold.ScaffoldConfig(weighting="uniform")
        theirs = run(ALGORITHMS["scaffold"], agents, theta0, rounds, hp, opt, n)
        torch.testing.assert_close(ours.params[P], theirs.params[P], rtol=0.0, atol=1e-12)


def garnet_setup(algo: str, executor: str, **overrides: object):  # noqa: ANN201
    cfg = build_config(
        overrides={
            "algorithm.name": algo,
            "data.task": "garnet-het-n10",
            "train.executor": executor,
            "train.client_lr": 0.5,
            **overrides,
        }
    )
    setup = build(cfg)
    state = setup.alg.server_init(setup.init_params, setup.hp, setup.opt)
    init = setup.alg.init_client_state
    store = ClientStateStore(None if init is None else (lambda: init(setup.init_params, setup.hp)))
    return setup, state, store


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["fedlsa", "scafflsa"])
def test_loop_and_vmap_executors_agree_on_garnet(algo: str) -> None:
    """Loop and vmap give the same theta and per-agent state on garnet-het-n10 (float64),
    4 of 10 agents per round, 2 epochs of 2 minibatches, 3 rounds (xi crosses rounds)."""
    results = {}
    for executor in ("loop", "vmap"):
        setup, state, store = garnet_setup(
            algo, executor, **{"train.clients_per_round": 4, "train.batch_size": 500, "train.local_epochs": 2}
        )
        for r in (1, 2, 3):
            state, _ = run_round(setup, state, store, r, Timing())
        results[executor] = (state.params, store.state_dict())
    torch.testing.assert_close(results["vmap"][0], results["loop"][0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(results["vmap"][1], results["loop"][1], rtol=1e-12, atol=1e-14)


@pytest.mark.slow
def test_engine_fedlsa_on_garnet_matches_the_deterministic_recursion() -> None:
    """Through the engine and the task's TD surrogate: one full-pool batch per step (B = 1000 = n)
    makes every step the empirical LSA step with Ahat^c, bhat^c (pool means), so with E = 3
    epochs (H = 3) and all 10 agents, theta_{t+1} = (1/N) sum_c [thetahat*^c + Gammahat_c (theta_t -
    thetahat*^c)], Gammahat_c = (I - eta Ahat^c)^3, from theta_0 = 0 for 2 rounds."""
    data = TASKS["garnet-het-n10"].load(TaskOptions(seed=0))
    x = torch.stack([data.x[ix] for ix in data.client_indices])
    y = torch.stack([data.y[ix] for ix in data.client_indices])
    a_hat, b_hat = garnet.empirical_system(x, y, gamma=0.95)
    local = torch.linalg.solve(a_hat, b_hat.unsqueeze(-1)).squeeze(-1)
    gammas = torch.linalg.matrix_power(torch.eye(8, dtype=DT) - 0.5 * a_hat, 3)
    theta = torch.zeros(8, dtype=DT)
    for _ in range(2):
        theta = (local + torch.einsum("cde,ce->cd", gammas, theta - local)).mean(0)
    setup, state, store = garnet_setup(
        "fedlsa", "vmap", **{"train.clients_per_round": 10, "train.batch_size": 1000, "train.local_epochs": 3}
    )

    for r in (1, 2):
        state, _ = run_round(setup, state, store, r, Timing())

    torch.testing.assert_close(state.params[P], theta, rtol=1e-10, atol=1e-12)


def test_lsa_algorithms_refuse_other_tasks_and_settings() -> None:
    """FedLSA/SCAFFLSA need an LSA model and no client momentum; SCAFFLSA the plain average."""
    cfg = build_config(overrides={"algorithm.name": "fedlsa", "data.task": "lsq"})
    setup = build(cfg)
    with pytest.raises(
        HyperparameterError, match=r"data.task must be a linear stochastic approximation task"
    ):
        setup.alg.server_init(setup.init_params, setup.hp, setup.opt)
    theta = {P: torch.zeros(D, dtype=DT)}
    with pytest.raises(
        HyperparameterError, match=r"train.client_momentum must be 0 for fedlsa .*; got 0.9\."
    ):
        fedlsa.server_init(theta, fedlsa.FedLSAConfig(), OptimConfig(client_momentum=0.9))
    with pytest.raises(
        HyperparameterError, match=r"train.server_opt/train.server_lr must be sgd/1.0 .*got 'sgd/0.5'"
    ):
        scafflsa.server_init(theta, scafflsa.SCAFFLSAConfig(), OptimConfig(server_lr=0.5))
    with pytest.raises(HyperparameterError, match=r"hp.weighting must be 'uniform' or 'examples'; got 'n'\."):
        fedlsa.FedLSAConfig(weighting="n")
    assert garnet.LSA_PARAM == fedlsa.LSA_PARAM
    assert (
        fedavg.global_params(fedlsa.server_init(theta, fedlsa.FedLSAConfig(), OptimConfig()))[P] is not None
    )


def test_fedlsa_warns_where_it_computes_fedavgs_model():
    """FedLSA's server mean is (1/N) sum_c theta_c (Mangold et al. §3.3); FedAvg's is sum_c n_c theta_c / sum n_c.

    They are the same number when every n_c is equal (every garnet task: 1,000 samples an agent) or when
    hp.weighting=examples: both say so before the run starts, and a task with unequal clients does not.
    """
    from fedcli.algorithms import ALGORITHMS
    from fedcli.algorithms.base import OptimConfig, RunFacts
    from fedcli.algorithms.fedlsa import FedLSAConfig

    record = ALGORITHMS["fedlsa"]

    def facts(task: str) -> RunFacts:
        return RunFacts(task=task, kind="lsa", model="linear", rounds=10, clients_per_round=10)

    on_garnet = record.degenerate(FedLSAConfig(), OptimConfig(), facts("garnet-het-n10"))
    assert [d.code for d in on_garnet] == ["fedlsa:is-fedavg"] and "same number of samples" in on_garnet[
        0
    ].message
    by_examples = record.degenerate(FedLSAConfig(weighting="examples"), OptimConfig(), facts("lsq"))
    assert [d.code for d in by_examples] == ["fedlsa:is-fedavg"] and "weighting=examples" in by_examples[
        0
    ].message
    assert record.degenerate(FedLSAConfig(), OptimConfig(), facts("lsq")) == []


def test_scafflsa_recommends_full_participation_where_the_task_fixes_n() -> None:
    """The paper runs all N agents every round. Under partial participation SCAFFLSA's control
    variates lag a visit, and on garnet-het-n100 at 10 of 100 agents a round the distance to theta*
    grew from 5.9 to 398 in 25 rounds. A Garnet task (N known before loading) gets a cohort of N,
    recorded as recommended. An explicit --clients-per-round is kept, and a task whose N is
    unknown gets no advice."""
    cfg = build_config(overrides={"algorithm.name": "scafflsa", "data.task": "garnet-het-n100"})
    assert cfg.train.clients_per_round == 100 and set(cfg.recommended) == {"train.clients_per_round"}
    mine = build_config(
        overrides={
            "algorithm.name": "scafflsa",
            "data.task": "garnet-het-n100",
            "train.clients_per_round": 10,
        }
    )
    assert (mine.train.clients_per_round, dict(mine.recommended)) == (10, {})
    small = build_config(overrides={"algorithm.name": "scafflsa", "data.task": "garnet-het-n10"})
    assert (small.train.clients_per_round, dict(small.recommended)) == (10, {})
    assert TASKS["garnet-hom-n100"].num_clients == 100 and TASKS["femnist"].num_clients is None
    fedavg_cfg = build_config(overrides={"algorithm.name": "fedavg", "data.task": "garnet-het-n100"})
    assert fedavg_cfg.train.clients_per_round == 10  # only SCAFFLSA asks for it
