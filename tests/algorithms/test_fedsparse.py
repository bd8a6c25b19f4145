"""FedSparse (Louizos et al., arXiv:2111.10192): reductions, closed forms and byte counts.

Notation as in algorithms/fedsparse.py: a group g is one output unit (a weight row plus its
bias); theta_g = sigmoid(a_g), a_g = (||w_g|| - softplus(v_g)) / T (Eq. 23); P = R(z > 0) =
sigmoid(a - beta log(-gamma / zeta)) of the hard-concrete (Eq. 41).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.nn.functional import softplus

from fedcli.algorithms import fedavg, fedprox, fedsparse
from fedcli.algorithms.base import (
    Batch,
    ClientContext,
    ClientOut,
    HyperparameterError,
    OptimConfig,
    tree_nbytes,
)
from fedcli.algorithms.fedsparse import HC_BETA, HC_GAMMA, HC_ZETA, FedSparseConfig
from fedcli.datasets.federated import FederatedData
from fedcli.engine.backends.loop import LoopBackend
from fedcli.engine.backends.vmap import VmapBackend
from fedcli.engine.cohort import CohortInputs, CohortJob
from fedcli.engine.model import ModelFunctions

DT = torch.float64


def mlp_params(hidden: int = 4, d: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    """A d-hidden-1 tanh network; 'hidden' is gated (one gate per unit), 'out' is the classifier."""
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden.weight": torch.randn(hidden, d, generator=g, dtype=DT),
        "hidden.bias": 0.5 * torch.randn(hidden, generator=g, dtype=DT),
        "out.weight": torch.randn(1, hidden, generator=g, dtype=DT),
        "out.bias": torch.zeros(1, dtype=DT),
    }


def mlp_apply(
    params: dict[str, torch.Tensor], x: torch.Tensor, key: torch.Tensor | None = None
) -> torch.Tensor:
    h = torch.tanh(x @ params["hidden.weight"].T + params["hidden.bias"])
    return (h @ params["out.weight"].T + params["out.bias"]).squeeze(-1)


def mlp_loss(params: dict[str, torch.Tensor], batch: Batch) -> torch.Tensor:
    return 0.5 * ((mlp_apply(params, batch.x) - batch.y) ** 2 * batch.weight).sum() / batch.weight.sum()


def federated(sizes: tuple[int, ...], d: int = 3) -> ModelFunctions:
    """Clients of unequal sizes with a shared tanh-regression target."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(sum(sizes), d, generator=g, dtype=DT)
    y = torch.sin(x.sum(1)) + 0.1 * torch.randn(sum(sizes), generator=g, dtype=DT)
    bounds = np.cumsum((0, *sizes))
    data = FederatedData(
        x,
        y,
        [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)],
        torch.device("cpu"),
        dtype=DT,
    )
    return ModelFunctions(apply_fn=mlp_apply, loss_fn=mlp_loss, data=data, prepare=lambda v: v)


def run(
    alg, hp, opt: OptimConfig, fns: ModelFunctions, rounds: int, executor=LoopBackend(), batch_size: int = 3
):
    """Run rounds of `alg` on every client of fns; return (state, per-round (bytes up, bytes down))."""
    state = alg.server_init(mlp_params(), hp, opt)
    cohort, comm = np.arange(fns.data.num_clients), []
    for r in range(1, rounds + 1):
        plan = fns.data.plan(
            cohort,
            num_epochs=opt.local_epochs,
            batch_size=batch_size,
            rngs=[np.random.default_rng([r, int(c)]) for c in cohort],
        )
        steps = plan.num_epochs * plan.steps_per_epoch
        shapes = alg.noise_shapes(alg.global_params(state), hp, steps) if alg.noise_shapes else {}
        g = torch.Generator().manual_seed(r)
        noise = {k: torch.randn(len(cohort), *s, generator=g) for k, s in sorted(shapes.items())}
        inputs = CohortInputs(plan, torch.zeros(len(cohort), steps, dtype=torch.int64), noise, None)
        bc = alg.broadcast(state, hp)
        outs = executor.run(CohortJob(alg, fns, bc, inputs, hp, opt, r))
        up = alg.upload_nbytes(outs.upload) if alg.upload_nbytes else tree_nbytes(outs.upload)
        down = alg.download_nbytes(bc) if alg.download_nbytes else tree_nbytes(bc)
        comm.append((float(up), float(down)))
        state, _ = alg.server_update(state, outs, plan.num_examples, hp, opt)
    return state, comm


OPT = OptimConfig(client_lr=0.1, client_momentum=0.9, local_epochs=2, server_opt="momentum", server_lr=0.5)


def test_gates_forced_on_is_fedavg_and_its_drift_is_fedprox() -> None:
    """theta_0 = 1 puts no mass on the spike: p(phi | w) = N(w, 1/lambda), so Eq. 17 reduces to
    mean loss + lambda/2 ||w_s - w||^2 (FedProx's Eq. 2 with mu = lambda), z = 1 makes Eq. 21's
    pseudo-gradient sum q z (w - w_s) FedAvg's, and no gate travels (dense bytes). Two rounds,
    client momentum 0.9, server momentum, clients of 5, 8 and 13 examples. float64; equal to
    rounding (FedAvg scales its gradient inside the backward pass, FedSparse after it)."""
    fns = federated((5, 8, 13))
    avg_state, avg_comm = run(fedavg.ALGORITHM, fedavg.FedAvgConfig(), OPT, fns, rounds=2)
    on_state, on_comm = run(
        fedsparse.ALGORITHM, FedSparseConfig(init_inclusion=1.0, prune_threshold=0.0), OPT, fns, rounds=2
    )
    for k in avg_state.params:
        torch.testing.assert_close(on_state.params[k], avg_state.params[k], rtol=1e-12, atol=1e-14)
    assert on_comm == avg_comm

    prox_state, _ = run(fedprox.ALGORITHM, fedprox.FedProxConfig(mu=0.8), OPT, fns, rounds=2)
    drift_state, _ = run(
        fedsparse.ALGORITHM, FedSparseConfig(init_inclusion=1.0, drift=0.8), OPT, fns, rounds=2
    )
    torch.testing.assert_close(drift_state.params, prox_state.params, rtol=0.0, atol=1e-12)


def linear_loss(params: dict[str, torch.Tensor], batch: Batch) -> torch.Tensor:
    """Multi-output least squares 1/(2n) sum_i ||W x_i + b - y_i||^2."""
    pred = batch.x @ params["lin.weight"].T + params["lin.bias"]
    return 0.5 * ((pred - batch.y) ** 2).sum(1).mean()


def full_batch_ctx(loss_fn, x: torch.Tensor, y: torch.Tensor, steps: int, noise: dict) -> ClientContext:
    """A ClientContext whose every step is one full-batch step on loss_fn."""
    batch = Batch(x=x, y=y, weight=torch.ones(len(y), dtype=DT), key=torch.zeros((), dtype=torch.int64))
    return ClientContext(
        loss_fn=loss_fn,
        apply_fn=lambda p, v: v,
        batch=lambda s: batch,
        step_mask=torch.ones(steps, dtype=DT),
        num_examples=torch.tensor(len(y), dtype=DT),
        num_epochs=1,
        steps_per_epoch=steps,
        round_idx=1,
        noise=noise,
    )


def test_client_rows_follow_least_squares_gd_and_upload_zero_temperature_gates() -> None:
    """Gated linear regression (use_output_layer_gates), T = 0.1, lambda = 0. With u = Phi(8) the
    hard-concrete gives s-bar > 1, so z = 1 exactly and grad_w of the data term is the usual one:
    each alive row r_k = [W_k, b_k] follows GD on 1/2 r^T A r - c_k^T r (A = X1^T X1 / n,
    c_k = X1^T y_k / n, X1 = [X, 1]): r_S = r* + (I - eta A)^S (r_0 - r*), r* = A^-1 c_k, whatever
    lambda0 and the cross-entropy do to v_s (the norm inside P is detached, Eq. 23). Unit 3 was
    pruned (alive 0): z = 0 and it stays 0. Upload z_k = I[logit u_k < a_k] (Bern(pi_s)): unit 1
    draws u = Phi(8) > pi and is not sent; units 0 and 2 draw Phi(-8) and are sent."""
    hp = FedSparseConfig(temperature=0.1, lambda0=1e-2, ce_scale=0.5, use_output_layer_gates=True)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(6, 2, generator=g, dtype=DT), torch.randn(6, 4, generator=g, dtype=DT)
    params = {
        "lin.weight": torch.randn(4, 2, generator=g, dtype=DT) + 1.0,
        "lin.bias": torch.randn(4, generator=g, dtype=DT),
    }
    state = fedsparse.server_init(params, hp, OptimConfig())
    alive = torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=DT)
    w0 = {"lin.weight": params["lin.weight"] * alive[:, None], "lin.bias": params["lin.bias"] * alive}
    bc = fedsparse.Broadcast(params=w0, gates=state.gates, alive={"lin.weight": alive})
    steps, lr = 5, 0.1
    noise = torch.full((steps, 2, 4), 8.0, dtype=torch.float32)
    noise[0, 1] = torch.tensor([-8.0, 8.0, -8.0, -8.0])

    ctx = full_batch_ctx(linear_loss, x, y, steps, {"fedsparse/lin.weight": noise})
    out = fedsparse.client_update(ctx, bc, None, hp, OptimConfig(client_lr=lr))

    x1 = torch.cat([x, torch.ones(6, 1, dtype=DT)], 1)
    a = x1.T @ x1 / 6
    r0 = torch.cat([w0["lin.weight"], w0["lin.bias"][:, None]], 1)  # [4, 3]
    r_star = torch.linalg.solve(a, x1.T @ y / 6).T
    r_s = r_star + (r0 - r_star) @ torch.linalg.matrix_power(torch.eye(3, dtype=DT) - lr * a, steps).T
    z = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=DT)
    expected = z[:, None] * (r0 - r_s)
    torch.testing.assert_close(out.upload["gates"]["lin.weight"], z, rtol=0.0, atol=0.0)
    torch.testing.assert_close(out.upload["delta"]["lin.weight"], expected[:, :2], rtol=0.0, atol=1e-12)
    torch.testing.assert_close(out.upload["delta"]["lin.bias"], expected[:, 2], rtol=0.0, atol=1e-12)


def test_client_objective_gradients_match_eq_41() -> None:
    """Eq. 17 sums its per-parameter terms over j; group g shares one gate z_g, so P_j = P_g for
    its |g| parameters: drift sum_j lambda/2 P (w_sj - w_j)^2 = lambda/2 P ||w_sg - w_g||^2, L0
    sum_j lambda0 P = lambda0 |g| P, while the cross-entropy of q(z_g) to p(z_g) is one term per
    gate, -(P log theta + (1 - P) log(1 - theta)), with d/dP = -logit(theta) = -a_theta.
    With z clamped at 1 (u = Phi(8)) the data term has no v-gradient, P = R(z > 0) =
    sigmoid(a - beta log(-gamma / zeta)) has dP/da = P (1 - P) and da/dv = -sigmoid(v) / T:
      d/dv_g = (lambda/2 ||w_sg - w_g||^2 + lambda0 |g| - c a_theta) P (1 - P) (-sigmoid(v_g) / T),
    and d/dw_s = grad data(w_s) + lambda P_g (w_sg - w_g) on gated rows, lambda (w_s - w) elsewhere
    (the norm inside P is detached). |g| = 3 + 1 (row plus bias)."""
    hp = FedSparseConfig(temperature=0.05, lambda0=0.02, ce_scale=0.3, drift=0.7)
    w = mlp_params()
    state = fedsparse.server_init(w, hp, OptimConfig())
    bc = fedsparse.broadcast(state, hp)
    w_s = {k: v + 0.01 * torch.arange(v.numel(), dtype=DT).reshape(v.shape) for k, v in w.items()}
    v_s = {"hidden.weight": state.gates["hidden.weight"] + torch.tensor([0.01, -0.02, 0.0, 0.03], dtype=DT)}
    fns = federated((6,))
    ix = torch.arange(6)
    ctx = full_batch_ctx(mlp_loss, fns.data.x[ix], fns.data.y[ix], 1, {})
    batch = ctx.batch(0)
    prior = fedsparse.gate_logits(w, state.gates, {"hidden.weight": ("hidden.bias",)}, hp.temperature)

    (g_w, g_v), _ = torch.func.grad(fedsparse.client_objective, has_aux=True)(
        (w_s, v_s), batch, {"hidden.weight": torch.full((4,), 40.0, dtype=DT)}, ctx, bc, prior, hp
    )

    t, lam, size = hp.temperature, hp.drift, 4
    norm_s = (w_s["hidden.weight"].pow(2).sum(1) + w_s["hidden.bias"] ** 2).sqrt()
    p = torch.sigmoid((norm_s - softplus(v_s["hidden.weight"])) / t - HC_BETA * math.log(-HC_GAMMA / HC_ZETA))
    diff_sq = (w_s["hidden.weight"] - w["hidden.weight"]).pow(2).sum(1) + (
        w_s["hidden.bias"] - w["hidden.bias"]
    ) ** 2
    a_theta = prior["hidden.weight"]
    expected_v = (
        (lam / 2 * diff_sq + size * hp.lambda0 - hp.ce_scale * a_theta)
        * p
        * (1 - p)
        * -torch.sigmoid(v_s["hidden.weight"])
        / t
    )
    data_grad = torch.func.grad(mlp_loss)(w_s, batch)
    expected_w = {
        k: data_grad[k]
        + lam * (w_s[k] - w[k]) * (p[:, None] if k == "hidden.weight" else p if k == "hidden.bias" else 1.0)
        for k in w
    }
    torch.testing.assert_close(g_v["hidden.weight"], expected_v, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g_w, expected_w, rtol=1e-10, atol=1e-12)


def server_round(state, hp, opt, deltas, z, weights):
    outs = ClientOut(upload={"delta": deltas, "gates": {"hidden.weight": z}}, state=None, metrics={})
    return fedsparse.server_update(state, outs, weights, hp, opt)


def test_server_steps_are_eqs_21_22_with_adamax_and_prune_below_eps() -> None:
    """q = n / sum n. Eq. 21: w' = w - sum_s q_s z_s (w - w_s) (server SGD, lr 1). Eq. 22 by the
    chain rule: g_v = sigmoid(v) (sum_s q_s z_s - theta) / T; Adamax from m_0 = 0 and u_0 =
    sigmoid(v_0) / T (the bound of |g_v|, hp.use_gate_grad_bound):
    m_t = b1 m + (1 - b1) g, u_t = max(b2 u, |g| + eps), v' = v - lr / (1 - b1^t) m_t / u_t.
    Then unit g stays alive iff sigmoid((||w'_g|| - softplus(v'_g)) / T) > 0.1. All three
    clients report w_s = 0 for unit 0, so ||w'_0|| = 0 and it is pruned in round 1; 2 rounds."""
    hp, opt = FedSparseConfig(), OptimConfig(server_opt="sgd", server_lr=1.0)
    w = mlp_params()
    state = fedsparse.server_init(w, hp, opt)
    weights = torch.tensor([3.0, 5.0, 8.0], dtype=DT)
    q = weights / weights.sum()
    z = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]], dtype=DT)
    b1, b2, eps, lr_v, t = 0.9, 0.999, 1e-8, hp.server_gate_lr, hp.temperature
    v, alive = state.gates["hidden.weight"], torch.ones(4)
    m, u = torch.zeros(4, dtype=DT), torch.sigmoid(v) / t
    for r in (1, 2):
        g = torch.Generator().manual_seed(r)
        deltas = {k: 0.01 * torch.randn(3, *p.shape, generator=g, dtype=DT) for k, p in w.items()}
        deltas["hidden.weight"] = deltas["hidden.weight"] * z[:, :, None]
        deltas["hidden.bias"] = deltas["hidden.bias"] * z
        if r == 1:  # every client drives unit 0 to zero
            deltas["hidden.weight"][:, 0] = state.params["hidden.weight"][0]
            deltas["hidden.bias"][:, 0] = state.params["hidden.bias"][0]
        norm = (state.params["hidden.weight"].pow(2).sum(1) + state.params["hidden.bias"] ** 2).sqrt()
        theta = torch.sigmoid((norm - softplus(v)) / t)
        grad = torch.sigmoid(v) * (q @ z - theta) / t
        m, u = b1 * m + (1 - b1) * grad, torch.maximum(b2 * u, grad.abs() + eps)
        v = torch.where(alive.bool(), v - lr_v / (1 - b1**r) * m / u, v)
        w_new = {k: state.params[k] - torch.tensordot(q, deltas[k], 1) for k in w}
        norm_new = (w_new["hidden.weight"].pow(2).sum(1) + w_new["hidden.bias"] ** 2).sqrt()
        alive = alive * (torch.sigmoid((norm_new - softplus(v)) / t) > 0.1)
        w_new["hidden.weight"], w_new["hidden.bias"] = (
            w_new["hidden.weight"] * alive[:, None],
            w_new["hidden.bias"] * alive,
        )

        state, diag = server_round(state, hp, opt, deltas, z, weights)

        torch.testing.assert_close(state.params, w_new, rtol=0.0, atol=1e-14)
        torch.testing.assert_close(state.gates["hidden.weight"], v, rtol=1e-12, atol=1e-14)
        assert state.alive["hidden.weight"].tolist() == alive.tolist()
    assert alive[0] == 0.0
    assert float(diag["fedsparse/sparsity"]) == pytest.approx(
        float(4 - alive.sum()) * 4 / 21
    )  # |g| = 4 of 21


def test_pruned_units_never_revive() -> None:
    """Round 1: both clients report w_s = 0 for unit 0 (other units unchanged, z = 1), so
    ||w'_0|| = 0, theta_0 ~ 0 and unit 0 is pruned while server momentum (beta 0.9) keeps
    u_0 != 0. Then v_0 = -30 gives theta_0 = sigmoid(-softplus(-30) / T) ~ 1/2 > eps, so Alg. 1's
    per-round re-evaluation would revive it. Clients send z_0 = 0, delta_0 = 0 (alive_0 = 0).
    Pruning here is permanent: w_0 stays exactly 0 and alive_0 = 0 for the next two rounds."""
    hp, opt = FedSparseConfig(), OptimConfig(server_opt="momentum", server_lr=1.0, server_momentum=0.9)
    state = fedsparse.server_init(mlp_params(), hp, opt)
    weights = torch.tensor([2.0, 7.0], dtype=DT)
    deltas = {k: torch.zeros(2, *p.shape, dtype=DT) for k, p in state.params.items()}
    deltas["hidden.weight"][:, 0], deltas["hidden.bias"][:, 0] = (
        state.params["hidden.weight"][0],
        state.params["hidden.bias"][0],
    )
    state, _ = server_round(state, hp, opt, deltas, torch.ones(2, 4, dtype=DT), weights)
    assert state.alive["hidden.weight"].tolist() == [0.0, 1.0, 1.0, 1.0]
    assert state.opt_state.first["hidden.weight"][0].abs().sum() > 0
    gates = {
        "hidden.weight": torch.where(state.alive["hidden.weight"].bool(), state.gates["hidden.weight"], -30.0)
    }
    state = fedsparse.ServerState(
        params=state.params,
        opt_state=state.opt_state,
        gates=gates,
        alive=state.alive,
        gate_opt=state.gate_opt,
    )
    logits = fedsparse.gate_logits(
        state.params, state.gates, {"hidden.weight": ("hidden.bias",)}, hp.temperature
    )
    assert torch.sigmoid(logits["hidden.weight"][0]) > hp.prune_threshold
    z = torch.tensor([[0.0, 1.0, 1.0, 1.0]] * 2, dtype=DT)
    for _ in range(2):
        state, _ = server_round(state, hp, opt, {k: d * 0.0 for k, d in deltas.items()}, z, weights)
        assert state.alive["hidden.weight"].tolist() == [0.0, 1.0, 1.0, 1.0]
        assert state.params["hidden.weight"][0].abs().sum() == 0 and state.params["hidden.bias"][0] == 0


def test_byte_counters_match_a_hand_count() -> None:
    """float32, 'h.weight' [40, 3] + 'h.bias' [40] gated (G = 40 units of |g| = 4 values), the
    classifier 'o.weight' [2, 40] + 'o.bias' [2] ungated (82 values, dense). A unit set of k groups
    costs 4 |g| k bytes of values plus min(4 k, ceil(G / 8) = 5) bytes of positions.
    Up, 3 clients sending 1, 3 and 0 units: (16 + min(4, 5)) + (48 + min(12, 5)) + 0 + 3 * 4 * 82.
    Down, 38 alive units: 4 * 4 * 38 + min(152, 5) + 4 * 38 (one v each) + 4 * 82.
    Dense FedAvg would be 4 * (120 + 40 + 82) = 968 bytes per client and direction."""
    params = {
        "h.weight": torch.ones(40, 3),
        "h.bias": torch.ones(40),
        "o.weight": torch.ones(2, 40),
        "o.bias": torch.ones(2),
    }
    z = torch.zeros(3, 40)
    z[0, 5], z[1, [0, 9, 39]] = 1.0, 1.0
    upload = {"delta": {k: torch.stack([p] * 3) for k, p in params.items()}, "gates": {"h.weight": z}}
    alive = torch.ones(40)
    alive[[3, 17]] = 0.0
    bc = fedsparse.Broadcast(params=params, gates={"h.weight": torch.zeros(40)}, alive={"h.weight": alive})
    group, classifier = 4 * 4, 4 * 82
    assert (
        float(fedsparse.upload_nbytes(upload))
        == (group + min(4, 5)) + (3 * group + min(12, 5)) + 3 * classifier
    )
    assert float(fedsparse.download_nbytes(bc)) == 38 * group + min(4 * 38, 5) + 4 * 38 + classifier
    assert tree_nbytes(params) == 968


def test_loop_and_vmap_agree_with_learned_gates() -> None:
    """The loop executor runs each client alone on its own steps, vmap the padded cohort; the
    same noise and batches give the same uploads, gates and server state (T = 0.01 so that the
    hard-concrete gates are fractional and carry gradient). 2 rounds, 3 unequal clients whose
    1, 2 and 2 batches per epoch leave padded (masked) steps in the vmapped plan."""
    hp = FedSparseConfig(temperature=0.01, lambda0=1e-3)
    fns = federated((3, 5, 7))
    loop_state, loop_comm = run(
        fedsparse.ALGORITHM, hp, OPT, fns, rounds=2, executor=LoopBackend(), batch_size=4
    )
    vmap_state, vmap_comm = run(
        fedsparse.ALGORITHM, hp, OPT, fns, rounds=2, executor=VmapBackend(), batch_size=4
    )
    torch.testing.assert_close(loop_state.params, vmap_state.params, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(loop_state.gates, vmap_state.gates, rtol=1e-10, atol=1e-12)
    assert loop_comm == vmap_comm


def test_groups_are_units_with_their_bias_and_norm_affine() -> None:
    """Shapes decide the groups: each >= 2-d parameter but the last gets one gate per row, and the
    parameters right after it with one entry per row (bias, norm weight and bias) share that gate;
    gate z_g = 0 zeroes the whole unit, so the channel is removed, not only its filter."""
    params = {
        "conv.weight": torch.ones(4, 2, 3),
        "conv.bias": torch.ones(4),
        "norm.weight": torch.ones(4),
        "norm.bias": torch.ones(4),
        "fc.weight": torch.ones(3, 4),
        "fc.bias": torch.ones(3),
        "out.weight": torch.ones(2, 3),
        "out.bias": torch.ones(2),
    }
    layout = fedsparse.gated_layers(params, FedSparseConfig())
    assert layout == {"conv.weight": ("conv.bias", "norm.weight", "norm.bias"), "fc.weight": ("fc.bias",)}
    assert fedsparse.gated_layers(params, FedSparseConfig(init_inclusion=1.0)) == {}
    gated = fedsparse.apply_gates(
        params, {"conv.weight": torch.tensor([1.0, 0.0, 1.0, 1.0]), "fc.weight": torch.ones(3)}, layout
    )
    assert [k for k, p in gated.items() if p.eq(0).any()] == [
        "conv.weight",
        "conv.bias",
        "norm.weight",
        "norm.bias",
    ]
    assert all(
        float(gated[k][1].abs().sum()) == 0 for k in ("conv.weight", "conv.bias", "norm.weight", "norm.bias")
    )


def test_init_sets_theta0_and_rejects_unreachable_models() -> None:
    """v = softplus^-1(||w_g|| - T logit theta_0) gives theta_g = theta_0 exactly (Eq. 23); a unit
    with ||w_g|| <= T logit theta_0 would need tau <= 0, which softplus cannot give."""
    hp = FedSparseConfig()
    state = fedsparse.server_init(mlp_params(), hp, OptimConfig())
    logits = fedsparse.gate_logits(
        state.params, state.gates, {"hidden.weight": ("hidden.bias",)}, hp.temperature
    )
    torch.testing.assert_close(
        torch.sigmoid(logits["hidden.weight"]), torch.full((4,), 0.99, dtype=DT), rtol=0.0, atol=1e-9
    )
    zero_unit = mlp_params()
    zero_unit["hidden.weight"][1], zero_unit["hidden.bias"][1] = 0.0, 0.0
    with pytest.raises(
        HyperparameterError, match=r"hp.init_inclusion must be < sigmoid\(min \|\|w_g\|\| / T\)"
    ):
        fedsparse.server_init(zero_unit, hp, OptimConfig())


def test_hyperparameters_are_validated() -> None:
    """Messages name the key, the constraint and the value (STYLE rule 11)."""
    with pytest.raises(
        HyperparameterError, match=r"hp.prune_threshold must be in \[0, hp.init_inclusion=0.5\)"
    ):
        FedSparseConfig(init_inclusion=0.5, prune_threshold=0.5)
    with pytest.raises(HyperparameterError, match=r"hp.temperature must be > 0; got 0.0\."):
        FedSparseConfig(temperature=0.0)
    with pytest.raises(HyperparameterError, match=r"hp.init_inclusion must be in \(0, 1\]; got 1.5\."):
        FedSparseConfig(init_inclusion=1.5)


def silent_net(fan_in: tuple[int, int], width: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Two gated tanh layers (groups of |g| = fan_in + 1, ||w_g|| ~ 3) and a zero classifier."""
    g = torch.Generator().manual_seed(seed)
    return {
        "h1.weight": 3 * torch.randn(fan_in[1], fan_in[0], generator=g, dtype=DT) / math.sqrt(fan_in[0]),
        "h1.bias": torch.zeros(fan_in[1], dtype=DT),
        "h2.weight": 3 * torch.randn(width, fan_in[1], generator=g, dtype=DT) / math.sqrt(fan_in[1]),
        "h2.bias": torch.zeros(width, dtype=DT),
        "out.weight": torch.zeros(1, width, dtype=DT),
        "out.bias": torch.zeros(1, dtype=DT),
    }


def silent_apply(
    params: dict[str, torch.Tensor], x: torch.Tensor, key: torch.Tensor | None = None
) -> torch.Tensor:
    h = torch.tanh(x @ params["h1.weight"].T + params["h1.bias"])
    h = torch.tanh(h @ params["h2.weight"].T + params["h2.bias"])
    return (h @ params["out.weight"].T + params["out.bias"]).squeeze(-1)


def silent_loss(params: dict[str, torch.Tensor], batch: Batch) -> torch.Tensor:
    return 0.5 * ((silent_apply(params, batch.x) - batch.y) ** 2 * batch.weight).sum() / batch.weight.sum()


APP_A_GATE_LR = 1e-2  # App. A's server Adamax lr on v


def sparsity_after(hp: FedSparseConfig, rounds: int = 1, d: int = 200) -> tuple[float, list[float]]:
    """Run FedSparse on the silent net (fan-ins d = 200 and 16, y = 0); return the pruned fraction of
    all parameters and the alive fraction of each gated layer."""
    sizes = (20, 30)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(sum(sizes), d, generator=g, dtype=DT)
    bounds = np.cumsum((0, *sizes))
    data = FederatedData(
        x,
        torch.zeros(sum(sizes), dtype=DT),
        [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)],
        torch.device("cpu"),
        dtype=DT,
    )
    fns = ModelFunctions(apply_fn=silent_apply, loss_fn=silent_loss, data=data, prepare=lambda v: v)
    opt = OptimConfig(
        client_lr=0.05, local_epochs=4, server_opt="adam", server_lr=1e-3, server_beta2=0.999, server_tau=1e-8
    )
    state = fedsparse.server_init(silent_net((d, 16), 8), hp, opt)
    cohort = np.arange(len(sizes))
    for r in range(1, rounds + 1):
        plan = data.plan(
            cohort,
            num_epochs=opt.local_epochs,
            batch_size=5,
            rngs=[np.random.default_rng([r, int(c)]) for c in cohort],
        )
        steps = plan.num_epochs * plan.steps_per_epoch
        shapes = fedsparse.noise_shapes(state.params, hp, steps)
        gen = torch.Generator().manual_seed(r)
        noise = {k: torch.randn(len(cohort), *s, generator=gen) for k, s in sorted(shapes.items())}
        inputs = CohortInputs(plan, torch.zeros(len(cohort), steps, dtype=torch.int64), noise, None)
        outs = LoopBackend().run(
            CohortJob(fedsparse.ALGORITHM, fns, fedsparse.broadcast(state, hp), inputs, hp, opt, r)
        )
        state, diag = fedsparse.server_update(state, outs, plan.num_examples, hp, opt)
    return float(diag["fedsparse/sparsity"]), [float(m.mean()) for m in state.alive.values()]


@pytest.mark.slow
def test_paper_lambda0_prunes_the_groups_whose_l0_cost_beats_the_cross_entropy() -> None:
    """The classifier is 0 and y = 0, so the data term has no gradient and w never moves: only
    terms (3)-(4) act on the gates. One gate per group, so with P = R(z_g > 0)
      d/dP [lambda0 |g| P - c (P log theta + (1 - P) log(1 - theta))] = lambda0 |g| - c logit(theta).
    At round 1 logit(theta_0) = log 99 and c log 99 = 4.6e-4 (c = 1e-4, App. A): clients lower P_g,
    send z ~ Bern(pi_s) below theta, and the server lowers theta_g below eps = 0.1 (pruning g)
    iff lambda0 |g| > 4.6e-4; otherwise they raise it. At App. A's mid lambda0 = 5e-6 that is
    |g| > 92: layer h1 (|g| = 201) is pruned, h2 (|g| = 17) kept. A cross-entropy weighted by |g|
    like the L0 term gives |g| (lambda0 - 4.6e-4) < 0 for every group: nothing would be pruned.
    With App. A's server gate lr 1e-2 (fedcli's default is 5e-3: test below): every client votes z = 0 on h1, so the server's
    first step lowers a_g by lr sigmoid(v_g) / T (theta_0 - 0) / b2 ~ 9 (||w_g|| ~ 3); a unit whose
    logit stays above logit(0.1) goes in round 2 (the step follows the votes: docstring)."""
    sparsity, alive = sparsity_after(FedSparseConfig(lambda0=5e-6, server_gate_lr=APP_A_GATE_LR), rounds=2)

    assert alive == [0.0, 1.0]
    assert sparsity == pytest.approx(16 * 201 / (16 * 201 + 8 * 17 + 9))


@pytest.mark.slow
def test_sparsity_grows_with_lambda0() -> None:
    """As above, pruning needs lambda0 |g| > c log 99 = 4.6e-4. App. A's low lambda0 = 5e-7 prunes
    no group of |g| <= 201; the high 5e-5 prunes |g| > 9.2, both layers. With mid (above):
    0 < sparsity(mid) < sparsity(high). Two rounds each, as above."""
    low, high = (
        sparsity_after(FedSparseConfig(lambda0=lam, server_gate_lr=APP_A_GATE_LR), rounds=2)
        for lam in (5e-7, 5e-5)
    )

    assert low == (0.0, [1.0, 1.0])
    assert high[1] == [0.0, 0.0]
    assert high[0] == pytest.approx((16 * 201 + 8 * 17) / (16 * 201 + 8 * 17 + 9))


@pytest.mark.slow
def test_fedcli_defaults_push_only_wide_units_and_prune_them_over_several_rounds() -> None:
    """fedcli's defaults (docstring: lambda0 1.5e-6, server gate lr 5e-3, not App. A's 5e-6 / 1e-2).
    Without a data gradient a group is pushed off iff lambda0 |g| > c log 99 = 4.6e-4, |g| > 307:
    on the silent net a first layer of fan-in 200 (|g| = 201) is never pruned (8 rounds), one of
    fan-in 400 (|g| = 401) is. The server's step on v is at most lr (zbar - theta) / b2, so at 5e-3
    a_g falls by at most ~4.7 a round (||w_g|| ~ 3: sigmoid(v) ~ 0.95) of the 4.6 + 2.2 to the 0.1
    threshold: part of the layer is alive after round 2 (App. A's 1e-2 has pruned all of it by
    then, test above) and it is gone by round 3."""
    assert (FedSparseConfig().lambda0, FedSparseConfig().server_gate_lr) == (1.5e-6, 5e-3)
    assert sparsity_after(FedSparseConfig(), rounds=8) == (0.0, [1.0, 1.0])
    assert sparsity_after(FedSparseConfig(), rounds=1, d=400) == (0.0, [1.0, 1.0])
    assert 0.0 < sparsity_after(FedSparseConfig(), rounds=2, d=400)[1][0] < 1.0
    assert sparsity_after(FedSparseConfig(server_gate_lr=APP_A_GATE_LR), rounds=2, d=400)[1] == [0.0, 1.0]
    sparsity, alive = sparsity_after(FedSparseConfig(), rounds=3, d=400)
    assert alive == [0.0, 1.0]
    assert sparsity == pytest.approx(16 * 401 / (16 * 401 + 8 * 17 + 9))


def test_server_adam_on_w_is_pytorchs_bias_corrected_adam_by_default() -> None:
    """The authors' server optimiser on w is PyTorch's Adam(lr 1e-3, betas (0.9, 0.999), eps 1e-8)
    (App. A): m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^t), w -= lr m_hat / (sqrt(v_hat) + eps),
    fed the weighted mean of z (w - w_s). Checked against torch.optim.Adam itself over 2 rounds,
    from a run config whose train.server_bias_correction is off (Reddi et al.'s FedAdam form);
    with hp.use_server_bias_correction = False FedSparse follows the run's setting again."""
    opt = OptimConfig(server_opt="adam", server_lr=1e-3, server_beta2=0.999, server_tau=1e-8)
    hp = FedSparseConfig()
    state = fedsparse.server_init(mlp_params(), hp, opt)
    weights, z = torch.tensor([2.0, 5.0], dtype=DT), torch.ones(2, 4, dtype=DT)
    shadow = {k: torch.nn.Parameter(p.clone()) for k, p in state.params.items()}
    torch_adam = torch.optim.Adam(shadow.values(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    plain = state
    for r in (1, 2):
        g = torch.Generator().manual_seed(r)
        deltas = {k: 0.01 * torch.randn(2, *p.shape, generator=g, dtype=DT) for k, p in state.params.items()}
        for k, p in shadow.items():
            p.grad = torch.tensordot(weights / weights.sum(), deltas[k], 1)
        torch_adam.step()

        state, _ = server_round(state, hp, opt, deltas, z, weights)
        plain, _ = server_round(
            plain, FedSparseConfig(use_server_bias_correction=False), opt, deltas, z, weights
        )

        torch.testing.assert_close(
            state.params, {k: p.detach() for k, p in shadow.items()}, rtol=0.0, atol=1e-15
        )
    assert not torch.allclose(plain.params["out.weight"], state.params["out.weight"], rtol=0.0, atol=1e-6)


def test_round_one_gate_step_follows_the_votes_and_prunes_only_what_eq_20_would() -> None:
    """Round 1 at App. A's settings (theta_0 = 0.99, T = 1e-3, server Adamax lr 1e-2, eps = 0.1).
    Eq. 20's M-step puts theta_g at the clients' mean vote zbar_g, so a unit is prunable in round 1
    only if fewer than one client in ten keeps it (zbar_g < eps). Ten equal clients, w unchanged
    (zero deltas), units of ||w_g|| ~ 0.58 (PyTorch's init) voted zbar = 1, 0.9, 0.5, 0.2, 0.1, 0.
    With u_0 = sigmoid(v_0) / T the first step is lr (zbar - theta) / b2 on v, so theta_g moves
    towards zbar_g and not past it, and a_g falls by at most lr sigmoid(v) / T 0.99 / b2 = 4.3
    (sigmoid(v) ~ 0.44) of a_0 = logit(0.99) = 4.6: even zbar = 0 leaves theta > 0.5, nothing is
    pruned. Adamax from u_0 = 0 (App. A read literally) steps lr sign(g): one vote off in ten drops
    theta from 0.99 to ~0.55, far below Eq. 20's 0.9."""
    fan_in, votes = 300, torch.tensor([1.0, 0.9, 0.5, 0.2, 0.1, 0.0], dtype=DT)
    g = torch.Generator().manual_seed(5)
    bound = 1 / math.sqrt(fan_in)  # torch.nn.Linear's default init: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    params = {
        "hidden.weight": (2 * torch.rand(6, fan_in, generator=g, dtype=DT) - 1) * bound,
        "hidden.bias": (2 * torch.rand(6, generator=g, dtype=DT) - 1) * bound,
        "out.weight": torch.zeros(1, 6, dtype=DT),
        "out.bias": torch.zeros(1, dtype=DT),
    }
    opt = OptimConfig(server_opt="adam", server_lr=1e-3, server_beta2=0.999, server_tau=1e-8)
    clients = torch.arange(10, dtype=DT)[:, None]
    z = (clients < 10 * votes).to(DT)  # [10, 6]: client s keeps unit g iff s < 10 zbar_g
    torch.testing.assert_close(z.mean(0), votes)
    deltas = {k: torch.zeros(10, *p.shape, dtype=DT) for k, p in params.items()}
    layout = {"hidden.weight": ("hidden.bias",)}
    theta = {}
    for bounded in (True, False):
        hp = FedSparseConfig(server_gate_lr=APP_A_GATE_LR, use_gate_grad_bound=bounded)
        state, _ = server_round(
            fedsparse.server_init(params, hp, opt), hp, opt, deltas, z, torch.ones(10, dtype=DT)
        )
        logits = fedsparse.gate_logits(state.params, state.gates, layout, hp.temperature)["hidden.weight"]
        theta[bounded] = torch.sigmoid(logits)
        if bounded:
            assert state.alive["hidden.weight"].tolist() == [1.0] * 6
    theta_0 = torch.full_like(votes, 0.99)
    assert bool((theta[True] >= torch.minimum(votes, theta_0)).all())  # towards zbar, never past it
    assert bool((theta[True] <= torch.maximum(votes, theta_0) + 1e-12).all())
    assert float(theta[True][-1]) > 0.5  # zbar = 0: a_g falls by lr sigmoid(v) / T 0.99 / b2 = 4.3 of 4.6
    assert float(theta[True][1]) > 0.98  # one vote off in ten: theta 0.99 -> 0.985
    assert float(theta[False][1]) < 0.6 < 0.9  # u_0 = 0: past Eq. 20's target in one step
