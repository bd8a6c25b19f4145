"""Closed-form and reduction tests of FOLA, FOLA-offline and the FedCurv variant (fola.md §9.3).

The clients are hand-built quadratics. Client n's example i (sign s_i = ±1, balanced inside
every minibatch) has the loss

    l_i(θ) = ½ (θ − a)ᵀ diag(A) (θ − a) + s_i bᵀ(θ − a),

so the minibatch-mean gradient is A ⊙ (θ − a) (the signs cancel), the per-example gradient
is A ⊙ (θ − a) + s_i b, and therefore
    per-sample Fisher  mean_i g_i² = (A ⊙ (θ − a))² + b²     (the cross term cancels),
    batch-squared      (mean_i g_i)² = (A ⊙ (θ − a))².
The mean loss has Hessian diag(A) and optimum a; with b = √A the per-sample Fisher at the
optimum is exactly the Hessian A.
"""

from __future__ import annotations

import math

import pytest
import torch

from fedcli.algorithms import ALGORITHMS, fedavg, fedcurv, fola, fola_offline
from fedcli.algorithms.base import (
    Batch,
    ClientContext,
    ClientOut,
    HyperparameterError,
    OptimConfig,
    Params,
    flatten,
    tree_nbytes,
)
from fedcli.algorithms.fola_compression import compress_precision, decompress_precision, kept_count

F64 = torch.float64
SPLIT = (2, 3)  # the model is two leaves {"w": [2], "u": [3]}, θ = cat(w, u) ∈ R^5


def params_of(theta: torch.Tensor) -> Params:
    w, u = theta.split(SPLIT)
    return {"w": w.clone(), "u": u.clone()}


class Quad:
    """One quadratic client: optimum a, curvature A, per-example sign amplitude b."""

    def __init__(self, a: torch.Tensor, A: torch.Tensor, b: torch.Tensor) -> None:
        self.a, self.A, self.b = a, A, b

    def loss_fn(self, params: Params, batch: Batch) -> torch.Tensor:
        d = torch.cat([params["w"], params["u"]]) - self.a  # [5]
        per = 0.5 * (self.A * d * d).sum() + batch.x * (self.b * d).sum()  # [B]
        return (per * batch.weight).sum() / batch.weight.sum().clamp_min(1.0)


# One epoch = 3 steps: a full batch of 4, a batch with 2 real examples + 2 padded, and a
# masked (padding) step. The client holds 6 examples.
SIGNS = torch.tensor([[1.0, -1.0, 1.0, -1.0], [1.0, -1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]], dtype=F64)
WEIGHTS = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=F64)
MASK = torch.tensor([1.0, 1.0, 0.0], dtype=F64)


def context(q: Quad, round_idx: int, num_epochs: int) -> ClientContext:
    def batch(step: int) -> Batch:
        k = step % 3
        return Batch(
            x=SIGNS[k], y=torch.zeros(4, dtype=F64), weight=WEIGHTS[k], key=torch.zeros((), dtype=torch.int64)
        )

    return ClientContext(
        loss_fn=q.loss_fn,
        apply_fn=lambda p, x: x,
        batch=batch,
        step_mask=MASK.repeat(num_epochs),
        num_examples=torch.tensor(6.0, dtype=F64),
        num_epochs=num_epochs,
        steps_per_epoch=3,
        round_idx=round_idx,
        noise={},
    )


def stack(trees: list) -> object:
    """Stack a list of equally shaped nested dicts of tensors along a new client axis."""
    if isinstance(trees[0], dict):
        return {k: stack([t[k] for t in trees]) for k in trees[0]}
    return torch.stack(trees)


def cohort(outs: list[ClientOut]) -> ClientOut:
    return ClientOut(
        upload=stack([o.upload for o in outs]), state=None, metrics=stack([o.metrics for o in outs])
    )


def upload_of(means: list[torch.Tensor], precisions: list[torch.Tensor]) -> ClientOut:
    return ClientOut(
        upload={
            "mean": stack([params_of(m) for m in means]),
            "precision": stack([params_of(p) for p in precisions]),
        },
        state=None,
        metrics={},
    )


def run_round(
    alg_name: str,
    hp: object,
    state: fola.ServerState,
    clients: list[Quad],
    sizes: torch.Tensor,
    round_idx: int,
    opt: OptimConfig,
    num_epochs: int,
) -> fola.ServerState:
    alg = ALGORITHMS[alg_name]
    bc = alg.broadcast(state, hp)
    outs = [alg.client_update(context(q, round_idx, num_epochs), bc, None, hp, opt) for q in clients]
    return alg.server_update(state, cohort(outs), sizes, hp, opt)[0]


def random_quads(n: int, seed: int, exact_hessian: bool) -> list[Quad]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        a = torch.randn(5, generator=g, dtype=F64)
        A = 0.5 + torch.rand(5, generator=g, dtype=F64)  # in [0.5, 1.5]
        b = A.sqrt() if exact_hessian else 0.3 + torch.rand(5, generator=g, dtype=F64)
        out.append(Quad(a, A, b))
    return out


SIZES = torch.tensor([3.0, 7.0, 12.0], dtype=F64)  # unequal m_n
OPT = OptimConfig(client_lr=0.2, client_momentum=0.5)


@pytest.mark.parametrize(
    ("fisher", "fisher_norm", "prior_form", "clip_norm"),
    [
        ("per_sample", "mean", "paper", 0.0),
        ("batch_sq", "sum_weighted", "code", 0.5),
        ("per_sample", "sum_weighted", "paper", 0.5),
    ],
)
def test_fola_client_matches_heavy_ball_recursion(
    fisher: str, fisher_norm: str, prior_form: str, clip_norm: float
) -> None:
    """Round r = 2, broadcast (μ_S, P_S) with P_S > 0, E = 2 epochs of 2 real steps + 1 masked.

    Each real step t: d = θ_t − a; g = A d + λ c_r P_S (θ_t − μ_S) with c_r = 1 (paper, Alg. 1)
    or 1/r (code); g ← g · min(1, κ / (‖g‖ + 1e-6)) when clipping with κ; heavy ball
    v ← m v + g, θ ← θ − η v. The Fisher increment is (A d)² + b² (per-sample) or (A d)²
    (batch-squared), weighted 1 and divided by the 4 real steps (mean, Eq. 15) or weighted
    |b_t| / 6 and summed (sum_weighted, code). Upload: μ_n = θ_T and P_n = F/r + (r−1)/r P_S
    (Eq. 17) or Ω_S + F (code). Masked steps change nothing.
    """
    q = random_quads(1, seed=1, exact_hessian=False)[0]
    g = torch.Generator().manual_seed(2)
    mu_s, p_s = torch.randn(5, generator=g, dtype=F64), 0.2 + torch.rand(5, generator=g, dtype=F64)
    lam, r, lr, m = 0.7, 2, OPT.client_lr, OPT.client_momentum
    hp = fola.FOLAConfig(
        lam=lam, fisher=fisher, fisher_norm=fisher_norm, prior_form=prior_form, clip_norm=clip_norm
    )
    c = 1.0 if prior_form == "paper" else 1.0 / r
    theta, v, fisher_sum = mu_s.clone(), torch.zeros(5, dtype=F64), torch.zeros(5, dtype=F64)
    for batch_size in (4, 2, 4, 2):  # the real steps of the two epochs
        d = theta - q.a
        inc = (q.A * d) ** 2 + (q.b**2 if fisher == "per_sample" else 0.0)
        fisher_sum = fisher_sum + inc * (1.0 if fisher_norm == "mean" else batch_size / 6.0)
        grad = q.A * d + lam * c * p_s * (theta - mu_s)
        if clip_norm > 0:
            grad = grad * min(1.0, clip_norm / (float(grad.norm()) + 1e-6))
        v = m * v + grad
        theta = theta - lr * v
    f_n = fisher_sum / 4 if fisher_norm == "mean" else fisher_sum
    expected_p = f_n / r + (r - 1) / r * p_s if prior_form == "paper" else p_s + f_n

    out = fola.client_update(
        context(q, r, 2), fola.ServerState(params_of(mu_s), params_of(p_s)), None, hp, OPT
    )

    torch.testing.assert_close(flatten(out.upload["mean"]), theta, rtol=0, atol=1e-12)
    torch.testing.assert_close(flatten(out.upload["precision"]), expected_p, rtol=0, atol=1e-12)


def test_product_of_exact_laplace_clients_is_the_global_optimum() -> None:
    """Quadratic clients F_n(θ) = ½ (θ − a_n)ᵀ A_n (θ − a_n), weights α_n = m_n / Σ m.

    argmin Σ α_n F_n solves (Σ α_n A_n) θ = Σ α_n A_n a_n. FOLA-offline with η = 1 contracts
    each coordinate by |1 − A| ≤ ½ per step, so 60 epochs reach a_n to ~1e-18; the offline
    per-sample Fisher there is b² = A_n, the exact Hessian. Eq. 9 (γ = 0) is then exact.
    """
    clients = random_quads(3, seed=3, exact_hessian=True)
    hp = fola_offline.FOLAOfflineConfig(damping=0.0)
    opt = OptimConfig(client_lr=1.0)
    state = fola.server_init(params_of(torch.zeros(5, dtype=F64)), hp, opt)
    alpha = SIZES / SIZES.sum()
    h = sum(a * torch.diag(q.A) for a, q in zip(alpha, clients, strict=True))
    rhs = sum(a * q.A * q.a for a, q in zip(alpha, clients, strict=True))
    optimum = torch.linalg.solve(h, rhs)

    state = run_round("fola-offline", hp, state, clients, SIZES, round_idx=1, opt=opt, num_epochs=60)

    torch.testing.assert_close(flatten(state.mean), optimum, rtol=0, atol=1e-12)
    torch.testing.assert_close(flatten(state.precision), torch.diagonal(h), rtol=0, atol=1e-12)


def test_equal_precisions_reduce_to_fedavg_weighted_mean() -> None:
    """P_n = P for every n: μ_S = Σ α_n P μ_n / Σ α_n P = Σ α_n μ_n, FedAvg's update with Δ_n = θ − μ_n."""
    g = torch.Generator().manual_seed(4)
    means = [torch.randn(5, generator=g, dtype=F64) for _ in range(3)]
    shared = 0.1 + torch.rand(5, generator=g, dtype=F64)
    theta0 = params_of(torch.randn(5, generator=g, dtype=F64))
    hp = fola.FOLAConfig(damping=0.0)
    deltas = stack([{k: theta0[k] - v for k, v in params_of(m).items()} for m in means])
    expected, _ = fedavg.server_update(
        fedavg.server_init(theta0, fedavg.FedAvgConfig(), OPT),
        ClientOut({"delta": deltas}, None, {}),
        SIZES,
        fedavg.FedAvgConfig(),
        OPT,
    )

    state, diagnostics = fola.server_update(
        fola.server_init(theta0, hp, OPT), upload_of(means, [shared] * 3), SIZES, hp, OPT
    )

    torch.testing.assert_close(flatten(state.mean), flatten(expected.params), rtol=0, atol=1e-12)
    torch.testing.assert_close(
        diagnostics["server/shift_from_fedavg"], torch.zeros((), dtype=F64), rtol=0, atol=1e-12
    )


def test_scaling_all_precisions_keeps_the_mean() -> None:
    """μ_S(cP) = Σ α c P μ / Σ α c P = μ_S(P) for γ = 0, and P_S(cP) = c P_S(P) (fola.md §3.3 #1)."""
    g = torch.Generator().manual_seed(5)
    means = [torch.randn(5, generator=g, dtype=F64) for _ in range(3)]
    precisions = [0.1 + torch.rand(5, generator=g, dtype=F64) for _ in range(3)]
    hp, c = fola.FOLAConfig(damping=0.0), 1e3
    state0 = fola.server_init(params_of(torch.zeros(5, dtype=F64)), hp, OPT)

    base, _ = fola.server_update(state0, upload_of(means, precisions), SIZES, hp, OPT)
    scaled, _ = fola.server_update(state0, upload_of(means, [c * p for p in precisions]), SIZES, hp, OPT)

    torch.testing.assert_close(flatten(scaled.mean), flatten(base.mean), rtol=1e-13, atol=0)
    torch.testing.assert_close(flatten(scaled.precision), c * flatten(base.precision), rtol=1e-13, atol=0)


def test_damping_shrinks_low_precision_coordinates_towards_zero() -> None:
    """μ_S = Σ α P μ / (Σ α P + γ) and P_S = Σ α P (undamped): with P = 1e-9 ≪ γ = 1e-5 the
    mean is the FedAvg mean times 1e-9 / (1e-9 + 1e-5) ≈ 1e-4, and every coordinate counts
    as low precision (P_S < 10 γ)."""
    g = torch.Generator().manual_seed(6)
    means = [torch.randn(5, generator=g, dtype=F64) for _ in range(3)]
    tiny, gamma = 1e-9, 1e-5
    hp = fola.FOLAConfig(damping=gamma)
    alpha = SIZES / SIZES.sum()
    fedavg_mean = sum(a * m for a, m in zip(alpha, means, strict=True))

    state, diagnostics = fola.server_update(
        fola.server_init(params_of(torch.zeros(5, dtype=F64)), hp, OPT),
        upload_of(means, [torch.full((5,), tiny, dtype=F64)] * 3),
        SIZES,
        hp,
        OPT,
    )

    torch.testing.assert_close(flatten(state.mean), fedavg_mean * tiny / (tiny + gamma), rtol=1e-12, atol=0)
    torch.testing.assert_close(
        flatten(state.precision), torch.full((5,), tiny, dtype=F64), rtol=1e-12, atol=0
    )
    assert float(diagnostics["server/low_precision_frac"]) == 1.0


def test_coordinates_without_curvature_take_the_fedavg_mean() -> None:
    """γ = 0 and P_n[i] = 0 for every client n: Eq. 9 is 0/0 there. Adding the same δ to every
    P_n gives Σ α (P + δ) μ / Σ α (P + δ) → Σ α μ[i] as δ → 0 on those coordinates, and Eq. 9
    elsewhere; the test takes δ = 1e-9 as the reference (its error there is O(δ))."""
    g = torch.Generator().manual_seed(12)
    means = [torch.randn(5, generator=g, dtype=F64) for _ in range(3)]
    zero = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0], dtype=F64)
    precisions = [zero * (0.1 + torch.rand(5, generator=g, dtype=F64)) for _ in range(3)]
    hp = fola.FOLAConfig(damping=0.0)
    state0 = fola.server_init(params_of(torch.zeros(5, dtype=F64)), hp, OPT)
    delta = 1e-9
    reference, _ = fola.server_update(
        state0, upload_of(means, [p + delta for p in precisions]), SIZES, hp, OPT
    )

    state, diagnostics = fola.server_update(state0, upload_of(means, precisions), SIZES, hp, OPT)

    torch.testing.assert_close(flatten(state.mean), flatten(reference.mean), rtol=0, atol=1e-7)
    assert torch.isfinite(flatten(state.mean)).all()
    assert float(diagnostics["server/low_precision_frac"]) == 2 / 5


def test_eq17_recursion_keeps_a_constant_fisher_and_code_form_sums_it() -> None:
    """Eq. 17 with the same F every round: P_r = F/r + (r−1)/r F = F. The code's cumulative
    form Ω_r = Ω_{r−1} + F gives Ω_r = r F (fola.md §4.5)."""
    f = {"w": torch.tensor([0.3, 2.0], dtype=F64)}
    paper, code = {"w": torch.zeros(2, dtype=F64)}, {"w": torch.zeros(2, dtype=F64)}
    for r in range(1, 6):
        paper = fola.client_precision(f, paper, r, "paper")
        code = fola.client_precision(f, code, r, "code")
        torch.testing.assert_close(paper["w"], f["w"], rtol=1e-15, atol=0)
        torch.testing.assert_close(code["w"], r * f["w"], rtol=1e-15, atol=0)


def test_paper_and_code_bookkeeping_give_the_same_means_over_rounds() -> None:
    """With λ = 0 and γ = 0 both forms train identically; the server holds P_r (paper) or
    Ω_r = r P_r (code, by induction: Ω_r = Ω_{r−1} + Σα F_r = (r−1) P_{r−1} + Σα F_r = r P_r),
    and μ_S is invariant to the common factor r (§3.3 #1). Three rounds, unequal sizes."""
    clients = random_quads(3, seed=7, exact_hessian=False)
    forms = {f: fola.FOLAConfig(lam=0.0, damping=0.0, prior_form=f) for f in ("paper", "code")}
    states = {f: fola.server_init(params_of(torch.zeros(5, dtype=F64)), hp, OPT) for f, hp in forms.items()}
    for r in (1, 2, 3):
        states = {f: run_round("fola", forms[f], states[f], clients, SIZES, r, OPT, 1) for f in forms}

        torch.testing.assert_close(
            flatten(states["code"].mean), flatten(states["paper"].mean), rtol=0, atol=1e-12
        )
        torch.testing.assert_close(
            flatten(states["code"].precision), r * flatten(states["paper"].precision), rtol=1e-12, atol=0
        )


def test_fedcurv_keeps_fedavg_mean_and_averages_offline_fishers() -> None:
    """FedCurv (FOLA code variant): μ_S = Σ α_n μ_n even though the precisions differ, and
    P_S = Σ α_n F_n(μ_n) = Σ α_n A_n for converged exact-Hessian quadratic clients (see above)."""
    clients = random_quads(3, seed=8, exact_hessian=True)
    hp, opt = fedcurv.FedCurvConfig(), OptimConfig(client_lr=1.0)
    alpha = SIZES / SIZES.sum()

    state = run_round(
        "fedcurv",
        hp,
        fola.server_init(params_of(torch.zeros(5, dtype=F64)), hp, opt),
        clients,
        SIZES,
        1,
        opt,
        60,
    )

    torch.testing.assert_close(
        flatten(state.mean), sum(a * q.a for a, q in zip(alpha, clients, strict=True)), rtol=0, atol=1e-12
    )
    torch.testing.assert_close(
        flatten(state.precision),
        sum(a * q.A for a, q in zip(alpha, clients, strict=True)),
        rtol=0,
        atol=1e-12,
    )


def test_compression_keeps_top_p_and_fills_with_dropped_mean() -> None:
    """Sec. 3.5 per layer: keep the k = round(p n) largest entries, set the others to the mean
    of the dropped ones (so the layer sum is preserved)."""
    p_layer = torch.tensor([0.5, 4.0, 1.0, 3.0, 0.25, 2.0], dtype=F64)
    k = kept_count(6, 0.5)
    order = p_layer.argsort(descending=True)
    fill = p_layer[order[k:]].mean()
    expected = torch.where(torch.isin(torch.arange(6), order[:k]), p_layer, fill)

    compressed = compress_precision({"w": p_layer}, 0.5)
    dense = decompress_precision(stack([compressed]), {"w": p_layer[None]})["w"][0]

    assert k == 3
    torch.testing.assert_close(dense, expected, rtol=0, atol=1e-15)
    torch.testing.assert_close(dense.sum(), p_layer.sum(), rtol=1e-15, atol=0)


def test_compressed_upload_bytes_and_server_reconstruction() -> None:
    """Bytes up = dense μ_n (5 float64) + per layer k (8 + 4) + 8 (values, int32 indices,
    fill); with p = 0.5: k_w = round(1) = 1, k_u = round(1.5) = 2. The server's P_S is the
    weighted mean of the decompressed uploads."""
    clients = random_quads(2, seed=9, exact_hessian=False)
    hp = fola.FOLAConfig(compress_p=0.5, lam=0.3)
    state0 = fola.server_init(params_of(torch.zeros(5, dtype=F64)), hp, OPT)
    dense_hp = fola.FOLAConfig(compress_p=1.0, lam=0.3)
    outs = [fola.client_update(context(q, 1, 1), state0, None, hp, OPT) for q in clients]
    dense = [fola.client_update(context(q, 1, 1), state0, None, dense_hp, OPT) for q in clients]
    expected_bytes = 5 * 8 + sum(kept_count(n, 0.5) * 12 + 8 for n in SPLIT)
    recon = [
        decompress_precision(stack([o.upload["precision_compressed"]]), stack([o.upload["mean"]]))
        for o in outs
    ]
    sizes = SIZES[:2]
    expected_p = sum(s * flatten({k: v[0] for k, v in r.items()}) for s, r in zip(sizes, recon, strict=True))

    state, _ = fola.server_update(state0, cohort(outs), sizes, hp, OPT)

    assert tree_nbytes(outs[0].upload) == expected_bytes
    assert tree_nbytes(dense[0].upload) == 2 * 5 * 8
    torch.testing.assert_close(flatten(state.precision), expected_p / sizes.sum(), rtol=1e-14, atol=0)


def test_client_update_under_vmap_matches_loop() -> None:
    """vmap over two clients (nested per-example vmap, momentum, clipping, compression) equals
    calling client_update client by client."""
    clients = random_quads(2, seed=10, exact_hessian=False)
    hp = fola.FOLAConfig(lam=0.5, clip_norm=1.0, compress_p=0.5)
    g = torch.Generator().manual_seed(11)
    bc = fola.ServerState(
        params_of(torch.randn(5, generator=g, dtype=F64)),
        params_of(0.2 + torch.rand(5, generator=g, dtype=F64)),
    )

    def one(a: torch.Tensor, A: torch.Tensor, b: torch.Tensor) -> tuple:
        out = fola.client_update(context(Quad(a, A, b), 2, 2), bc, None, hp, OPT)
        return out.upload, out.metrics

    looped = [one(q.a, q.A, q.b) for q in clients]
    vmapped = torch.func.vmap(one)(*(torch.stack([getattr(q, n) for q in clients]) for n in ("a", "A", "b")))

    torch.testing.assert_close(
        vmapped, tuple(stack([lp[i] for lp in looped]) for i in range(2)), rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lam": -1.0}, r"hp.lam must be >= 0; got -1.0"),
        ({"fisher": "exact"}, r"hp.fisher must be one of per_sample, batch_sq; got 'exact'"),
        ({"fisher_norm": "sum"}, r"hp.fisher_norm must be one of mean, sum_weighted; got 'sum'"),
        ({"prior_form": "eq18"}, r"hp.prior_form must be one of paper, code; got 'eq18'"),
        ({"damping": -1e-5}, r"hp.damping must be >= 0; got -1e-05"),
        ({"compress_p": 0.0}, r"hp.compress_p must be in \(0, 1\] \(1 = no compression\); got 0.0"),
        ({"clip_norm": -1.0}, r"hp.clip_norm must be >= 0 \(0 = no clipping\); got -1.0"),
    ],
)
def test_invalid_hyperparameters_are_rejected(kwargs: dict, message: str) -> None:
    with pytest.raises(HyperparameterError, match=message):
        fola.FOLAConfig(**kwargs)


def test_server_optimiser_is_rejected() -> None:
    with pytest.raises(
        HyperparameterError, match=r"train.server_opt/server_lr must be sgd/1.0; got 'adam/1.0'"
    ):
        fola.server_init(
            params_of(torch.zeros(5, dtype=F64)), fola.FOLAConfig(), OptimConfig(server_opt="adam")
        )


# ---------------------------------------------------------------------------------------
# fola.md §9.2: two crossed 2-D Gaussian local posteriors
# ---------------------------------------------------------------------------------------


def log_gauss(theta: torch.Tensor, mu: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """log N(θ | μ, diag(var)) for θ [..., 2]."""
    return -0.5 * ((theta - mu) ** 2 / var).sum(-1) - 0.5 * torch.log(2 * math.pi * var).sum()


def mixture_density(theta: torch.Tensor, alpha: torch.Tensor, mus: list, variances: list) -> torch.Tensor:
    return sum(a * log_gauss(theta, m, v).exp() for a, m, v in zip(alpha, mus, variances, strict=True))


def run_toy(sizes: tuple[float, float], mus: list, variances: list) -> dict[str, object]:
    """Aggregate the exact local posteriors q_n = N(μ_n, Σ_n) with FOLA's server (γ = 0) and
    with FedAvg; find the mixture mode by a 0.01 grid on [−1, 2]² refined by 200
    gradient-ascent steps on log q_mix; return the points and the mixture densities."""
    weights = torch.tensor(sizes, dtype=F64)
    alpha = weights / weights.sum()
    hp = fola.FOLAConfig(damping=0.0)
    upload = ClientOut(
        upload={"mean": {"t": torch.stack(mus)}, "precision": {"t": 1.0 / torch.stack(variances)}},
        state=None,
        metrics={},
    )
    state, _ = fola.server_update(
        fola.server_init({"t": torch.zeros(2, dtype=F64)}, hp, OPT), upload, weights, hp, OPT
    )
    prod, avg = state.mean["t"], (alpha[:, None] * torch.stack(mus)).sum(0)
    axis = torch.linspace(-1.0, 2.0, 301, dtype=F64)
    grid = torch.stack(torch.meshgrid(axis, axis, indexing="ij"), -1).reshape(-1, 2)
    mode = grid[mixture_density(grid, alpha, mus, variances).argmax()].clone()
    for _ in range(200):
        mode.requires_grad_(True)
        step = torch.autograd.grad(mixture_density(mode, alpha, mus, variances).log(), mode)[0]
        mode = (mode + 0.01 * step).detach()
    density = {
        name: float(mixture_density(p, alpha, mus, variances))
        for name, p in (("prod", prod), ("avg", avg), ("mode", mode), ("mu1", mus[0]), ("mu2", mus[1]))
    }
    return {
        "prod": prod.tolist(),
        "avg": avg.tolist(),
        "mode": mode.tolist(),
        "precision": state.precision["t"].tolist(),
        "density": density,
        "prod_to_mode": float((prod - mode).norm()),
    }


CROSSED_MUS = [torch.tensor([0.0, 1.0], dtype=F64), torch.tensor([1.0, 0.0], dtype=F64)]
CROSSED_VARS = [torch.tensor([4.0, 0.05], dtype=F64), torch.tensor([0.05, 4.0], dtype=F64)]


@pytest.mark.parametrize("sizes", [(50.0, 50.0), (80.0, 20.0)])
def test_toy_product_finds_mixture_mode_where_fedavg_lands_in_the_valley(sizes: tuple[float, float]) -> None:
    """fola.md §9.2 cases A (α = ½, ½) and B (α = 0.8, 0.2): q_1 = N((0,1), diag(4, 0.05)),
    q_2 = N((1,0), diag(0.05, 4)). The product point θ = (Σ α P_n)⁻¹ Σ α P_n μ_n lies on the
    ridgeline and here at the mixture's global mode; the average Σ α μ_n has a mixture density
    below both component means (a valley in case A), and below the product in both cases."""
    toy = run_toy(sizes, CROSSED_MUS, CROSSED_VARS)
    print(f"§9.2 toy α ∝ {sizes}: {toy}")
    dens = toy["density"]

    assert toy["prod_to_mode"] < 0.01 * float((CROSSED_MUS[0] - CROSSED_MUS[1]).norm())
    assert dens["prod"] >= 0.999 * dens["mode"]
    assert dens["avg"] < dens["prod"]
    if sizes[0] == sizes[1]:
        assert dens["avg"] < min(dens["mu1"], dens["mu2"])
        assert dens["prod"] > 10 * dens["avg"]


def test_toy_equal_covariances_product_is_the_average_in_the_valley() -> None:
    """fola.md §9.2 case C: Σ_1 = Σ_2 = 0.3 I, μ_1 = (0,0), μ_2 = (3,0), α = (½, ½). Equal
    precisions make the product the average (1.5, 0), and both sit in the valley between the
    two modes (the product rule gives no advantage; fola.md §11.10)."""
    mus = [torch.tensor([0.0, 0.0], dtype=F64), torch.tensor([3.0, 0.0], dtype=F64)]
    variances = [torch.full((2,), 0.3, dtype=F64)] * 2

    toy = run_toy((50.0, 50.0), mus, variances)
    print(f"§9.2 toy case C: {toy}")

    torch.testing.assert_close(
        torch.tensor(toy["prod"], dtype=F64), torch.tensor(toy["avg"], dtype=F64), rtol=0, atol=1e-15
    )
    assert toy["density"]["avg"] < 0.1 * toy["density"]["mu1"]


@pytest.mark.slow
def test_posterior_is_the_eq9_gaussian_product() -> None:
    """Eq. 9 makes the global posterior the product of the clients' Gaussians N(a_n, A_n^-1) with
    weights alpha_n: precision sum alpha_n A_n, mean (sum alpha_n A_n)^-1 sum alpha_n A_n a_n (exact
    Laplace clients, as in the test above). A_n is per example (Eq. 15 averages), so the cohort's data
    (n = sum m_n examples) gives precision n sum alpha_n A_n, and Eq. 18's prior adds delta_l = 1 / mean(mu_l^2)
    per tensor l (w, u): posterior() returns that mean and the variances 1 / (n sum alpha_n A_n + delta). A
    coordinate where every A_n is 0 (improper product) gets the prior's variance 1 / delta, so posterior
    samples (engine's sample_posterior) stay finite. fola and fola-offline both offer it; FedCurv
    (FedAvg mean, not a product) does not."""
    from fedcli.engine.evaluation import sample_posterior

    clients = random_quads(3, seed=3, exact_hessian=True)
    for q in clients:
        q.A[4], q.b[4] = 0.0, 0.0
    hp, opt = fola_offline.FOLAOfflineConfig(damping=0.0), OptimConfig(client_lr=1.0)
    state = fola.server_init(params_of(torch.zeros(5, dtype=F64)), hp, opt)
    alpha = SIZES / SIZES.sum()
    precision = sum(a * q.A for a, q in zip(alpha, clients, strict=True))
    mean = sum(a * q.A * q.a for a, q in zip(alpha, clients, strict=True))[:4] / precision[:4]

    state = run_round("fola-offline", hp, state, clients, SIZES, round_idx=1, opt=opt, num_epochs=60)
    post_mean, post_var = ALGORITHMS["fola-offline"].posterior(state)

    torch.testing.assert_close(flatten(post_mean)[:4], mean, rtol=0, atol=1e-12)
    delta = torch.cat([torch.full_like(m, 1.0 / float(m.pow(2).mean())) for m in post_mean.values()])
    want = 1.0 / (float(SIZES.sum()) * torch.cat([precision[:4], torch.zeros(1, dtype=F64)]) + delta)
    torch.testing.assert_close(flatten(post_var), want, rtol=1e-12, atol=0)
    assert float(state.num_examples) == float(SIZES.sum())
    members = sample_posterior(post_mean, post_var, 3, torch.Generator().manual_seed(0))
    assert all(torch.isfinite(flatten(m)).all() for m in members)
    assert ALGORITHMS["fola"].posterior is fola.posterior and ALGORITHMS["fedcurv"].posterior is None


def test_prior_stiffness_caps_the_prior_curvature_at_one_over_lr() -> None:
    """Explicit SGD on lam/2 P (theta - mu)^2 multiplies theta - mu by 1 - lr lam P per step: it diverges
    once lr lam P > 2. The guard caps lam P at 1 / lr, where a step lands on mu exactly. Below the cap
    the curvature is lam P, the same floats."""
    from fedcli.algorithms.fola import prior_stiffness

    precision = {"w": torch.tensor([0.5, 10.0, 400.0])}
    got = prior_stiffness(precision, coef=1.0, lr=0.01)["w"]
    assert torch.equal(got[:2], 1.0 * precision["w"][:2]) and got[2].item() == pytest.approx(100.0)
    mu, theta = torch.zeros(3), torch.ones(3)
    for stiff, diverges in ((1.0 * precision["w"], True), (got, False)):
        x = theta.clone()
        for _ in range(20):
            x = x - 0.01 * stiff * (x - mu)
        assert (x.abs().max().item() > 1e3) is diverges
    assert torch.equal(prior_stiffness(precision, coef=2.0, lr=0.0)["w"], 2.0 * precision["w"])
