"""FOLA: Gaussian-product aggregation with a federated online Laplace approximation.

Liu, Zheng. A Bayesian Federated Learning Framework with Multivariate Gaussian Product.
arXiv:2102.01936 v1 (2021); v3 "... with Online Laplace Approximation", TPAMI 2023. Code:
github.com/Klitter/A-Bayesian-Federated-Learning-Framework-with-Online-Laplace-Approximation.
Over the 250-line budget of docs/style.md rule 1: this module holds the Laplace family's shared
pieces (Fisher modes, prior forms, the product aggregation, the posterior) that fola_offline.py and
fedcurv.py reuse.

Implements: Eq. 9, diagonal (Sec. 3.4): P_S = sum a_n P_n, mu_S = sum a_n P_n mu_n /
(P_S + gamma) -> aggregate; Alg. 1 ClientUpdate (from mu_S, SGD on L_task + lam/2 sum
P_S (theta - mu_S)^2) -> local_train; Eq. 14/15 (diagonal empirical Fisher of the task loss
at every local iterate) -> fisher_increment; Eq. 17 -> client_precision; Sec. 3.5 ->
fola_compression. fola_offline.py and fedcurv.py (Sec. 4 baselines) reuse these.
Notation: mu_S, P_S -> state.mean, state.precision; mu_n, P_n -> upload; a_n = m_n/sum m
over the cohort -> weights; r -> ctx.round_idx; lam, gamma, p -> hp.lam, hp.damping,
hp.compress_p; F_n -> LocalFit.fisher.
Deviations:
  Paper: no values for lam, gamma, p; Eq. 9 has no damping. Here: damping gamma = 0, and
  coordinates where no client has curvature (P_S = 0) take FedAvg's mean (the limit of one
  delta -> 0 added to every P_n). Code: gamma = 1e-5 in the mean only (a zero-mean prior,
  Eq. 18; P_S undamped), which pulls coordinates with P_S << gamma to 0 (fola.md 11.5;
  server/low_precision_frac). lam = 1 (code grid value): explicit SGD on the prior needs
  lr lam c_r P_S < 2; the code's 100-1e4 suit its smaller batch-squared Fisher.
  Guard (not in paper or code): the prior's curvature lam c_r P_S is capped per coordinate at
  1 / lr (prior_stiffness), where one explicit step lands on mu_S instead of overshooting it.
  Without it FedCurv and FOLA-offline diverged on lsq at seed 1 (non-finite at rounds 8 and 10,
  docs/out-of-the-box.md, "The matrix"). Below the cap the run is unchanged bit for bit.
  Eq. 15 averages per-sample squares over all of D_n at every step. Here fisher="per_sample"
  averages them over the step's minibatch (Batch.weight) and fisher_norm="mean" over the
  real steps, a stochastic Eq. 15. Code/Alg. 1: fisher="batch_sq" (square of the minibatch
  gradient), fisher_norm="sum_weighted" (steps weighted |b|/|D_n|, summed over epochs).
  prior_form="paper": upload P_n = F_n/r + (r-1)/r P_S (Eq. 17), prior lam/2 P_S (Alg. 1).
  "code": Omega_n = Omega_S + F_n, prior lam 0.5/r Omega_S, gamma in Omega units. Same server
  mean (Omega = r P; gamma aside); the code's prior is the paper's times (r-1)/r (fola.md
  4.5). Neither has a prior in round 1 (P_S = 0).
  Code: total gradient clipped to norm 10. Paper and default here: no clip (clip_norm=0).
  Client momentum is allowed (paper: plain SGD, momentum 0). The server sets theta = mu_S:
  train.server_opt must be sgd with lr 1. Per-sample gradients reuse Batch.key, so under
  dropout the examples of a step share one mask.
  Posterior (for `fedcli evaluate --predictive ensemble`): P_S is a per-example Fisher (Eq. 15
  averages), so the product of the cohort's Laplace posteriors N(mu_n, (m_n P_n)^-1) has
  precision n P_S, n = sum m_n of the last cohort; Eq. 18's initial prior N(0, gamma I) has no
  value in the paper: here a zero-mean Gaussian per tensor l with precision delta_l = 1 /
  mean(mu_l^2) (the variance that fits the tensor's own weights). Variance = 1 / (n P_S +
  delta_l). (Before: 1 / P_S, the posterior of ONE example without a prior: median std ~4e3 on
  the FEMNIST MLP, ensemble NLL ~1e15.) Omega_S (prior_form="code") is r P_S: r x narrower.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from fedcli.algorithms.base import (
    Algorithm,
    Batch,
    ClientContext,
    ClientOut,
    Diagnostics,
    OptimConfig,
    Params,
    require,
    tree_add,
    tree_norm,
    tree_scale,
    tree_sub,
    tree_vdot,
    tree_zeros_like,
)
from fedcli.algorithms.fola_compression import cohort_precision, upload_precision
from fedcli.algorithms.optim import MaskedSGD

FISHER_MODES = ("per_sample", "batch_sq")
FISHER_NORMS = ("mean", "sum_weighted")
PRIOR_FORMS = ("paper", "code")


class Spec(NamedTuple):
    """Every setting of the Laplace family; each config class fills one (see .spec())."""

    lam: float
    fisher: str
    fisher_norm: str
    prior_form: str
    clip_norm: float
    damping: float = 0.0
    compress_p: float = 1.0
    offline: bool = False  # Fisher from one extra pass after local training, no Eq. 17
    product: bool = True  # product mean (Eq. 9); False = FedAvg mean (FedCurv)


def validate_common(lam: float, fisher: str, fisher_norm: str, prior_form: str, clip_norm: float) -> None:
    """Check the hyperparameters shared by fola, fola-offline and fedcurv."""
    require(lam >= 0, "hp.lam", ">= 0", lam, "lam = 0 is aggregation only (no prior loss).")
    for key, value, choices in (
        ("fisher", fisher, FISHER_MODES),
        ("fisher_norm", fisher_norm, FISHER_NORMS),
        ("prior_form", prior_form, PRIOR_FORMS),
    ):
        require(value in choices, f"hp.{key}", f"one of {', '.join(choices)}", value)
    require(clip_norm >= 0, "hp.clip_norm", ">= 0 (0 = no clipping)", clip_norm)


@dataclass(frozen=True, kw_only=True)
class FOLAConfig:
    lam: float = 1.0  # prior weight lambda (Alg. 1); no value in the paper; code grids {0,1,100}/{100,..,1e4}
    fisher: str = "per_sample"  # Eq. 14/15 per-sample squares; "batch_sq" = Alg. 1 / code
    fisher_norm: str = "mean"  # Eq. 15 mean over local steps; "sum_weighted" = code (|b|/|D_n|, all epochs)
    prior_form: str = "paper"  # Eq. 17 + Alg. 1 prior; "code" = cumulative Omega, prior 0.5/r
    damping: float = 0.0  # gamma: Eq. 9 has none (paper); code eps 1e-5 (zero-mean prior in the mean)
    clip_norm: float = 0.0  # total-gradient norm clip; 0 = off (paper); code 10
    compress_p: float = 1.0  # Sec. 3.5 kept fraction per layer; 1 = off (no value in the paper)

    def __post_init__(self) -> None:
        validate_common(self.lam, self.fisher, self.fisher_norm, self.prior_form, self.clip_norm)
        require(self.damping >= 0, "hp.damping", ">= 0", self.damping)
        require(0 < self.compress_p <= 1, "hp.compress_p", "in (0, 1] (1 = no compression)", self.compress_p)

    def spec(self) -> Spec:
        return Spec(
            self.lam,
            self.fisher,
            self.fisher_norm,
            self.prior_form,
            self.clip_norm,
            self.damping,
            self.compress_p,
        )


class ServerState(NamedTuple):
    mean: Params  # mu_S, the global model
    precision: Params  # P_S (prior_form="paper") or Omega_S ("code"), diagonal, zeros before round 1
    num_examples: float = (
        0.0  # sum m_n of the last cohort (the posterior's scale); 0 before round 1 and in older files
    )


class Broadcast(NamedTuple):
    """What clients download, (mu_S, P_S): both count as bytes down."""

    mean: Params
    precision: Params


def server_init(params: Params, hp: FOLAConfig, opt: OptimConfig) -> ServerState:
    """mu_S = theta_0, P_S = 0 (the code's Omega_S = 0; Alg. 1 gives no values)."""
    require(
        opt.server_opt == "sgd" and opt.server_lr == 1.0,
        "train.server_opt/server_lr",
        "sgd/1.0",
        f"{opt.server_opt}/{opt.server_lr}",
        "The server sets theta = mu_S (Alg. 1); it has no optimiser.",
    )
    return ServerState(mean=dict(params), precision=tree_zeros_like(params))


def broadcast(state: ServerState, hp: FOLAConfig) -> Broadcast:
    return Broadcast(mean=state.mean, precision=state.precision)


def fisher_increment(ctx: ClientContext, params: Params, batch: Batch, grads: Params, mode: str) -> Params:
    """One step's diagonal empirical Fisher of the task loss at the current iterate.

    batch_sq: g**2 with g the weighted minibatch-mean gradient (Alg. 1). per_sample:
    sum_i w_i g_i**2 / sum_i w_i with per-example gradients g_i (Eq. 14), by a nested vmap.
    """
    if mode == "batch_sq":
        return {k: g * g for k, g in grads.items()}

    def example_loss(p: Params, x: Tensor, y: Tensor) -> Tensor:
        one = torch.ones_like(batch.weight[:1])
        return ctx.loss_fn(p, Batch(x=x.unsqueeze(0), y=y.unsqueeze(0), weight=one, key=batch.key))

    per_example = torch.func.vmap(torch.func.grad(example_loss), in_dims=(None, 0, 0))(
        params, batch.x, batch.y
    )
    w = batch.weight  # [B]
    total = w.sum().clamp_min(1.0)
    return {
        k: torch.tensordot(w.to(g.dtype), g * g, dims=([0], [0])) / total.to(g.dtype)
        for k, g in per_example.items()
    }


def per_sample_obstacle(
    model: torch.nn.Module, hp: object, vmap_obstacle: str | None, name: str = "fola"
) -> str | None:
    """Why hp.fisher=per_sample (one gradient per example, a nested vmap over the batch) cannot run on
    `model`, or None (Algorithm.check_model of fola, fola-offline and fedcurv).

    BatchNorm normalises over the batch in training, so one example's gradient is not defined (on a
    batch of one, BatchNorm1d fails and BatchNorm2d normalises the example by itself); a model that
    cannot run under torch.func.vmap (`vmap_obstacle`, as the engine's model check found) cannot run
    the nested vmap either. --hp fisher=batch_sq (Alg. 1 and the released code: the
    square of the minibatch gradient) needs neither.
    """
    if getattr(hp, "fisher", None) != "per_sample":
        return None
    norms = [
        (n, type(m).__name__)
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
    ]
    fix = (
        "use --hp fisher=batch_sq (Alg. 1 / the released code: the square of the minibatch gradient), "
        "or GroupNorm in place of BatchNorm"
    )
    if norms:
        where, kind = norms[0]
        more = f" and {len(norms) - 1} more" if len(norms) > 1 else ""
        return (
            f"{name}'s default Fisher (hp.fisher=per_sample) needs one gradient per example, which this model's "
            f"BatchNorm ({where}: {kind}{more}) does not have: it normalises over the batch; {fix}."
        )
    if vmap_obstacle is not None:
        return (
            f"{name}'s default Fisher (hp.fisher=per_sample) takes per-example gradients under torch.func.vmap, "
            f"which this model cannot run ({vmap_obstacle}); use --hp fisher=batch_sq (the square of the minibatch "
            "gradient)."
        )
    return None


def step_weight(ctx: ClientContext, batch: Batch, norm: str) -> Tensor:
    """mean: 1 per step (divided by the step count later); sum_weighted: |b| / |D_n|."""
    if norm == "mean":
        return torch.ones_like(ctx.num_examples)
    return batch.weight.sum() / ctx.num_examples


def _clip(grads: Params, max_norm: float) -> Params:
    """torch.nn.utils.clip_grad_norm_ on the whole tree (no-op when max_norm = 0)."""
    if max_norm == 0.0:
        return grads
    return tree_scale(grads, (max_norm / (tree_norm(grads) + 1e-6)).clamp(max=1.0))


class LocalFit(NamedTuple):
    params: Params  # mu_n, the last local iterate
    fisher: Params  # F_n, the normalised accumulated diagonal Fisher
    task_loss: Tensor  # [] mean task loss over the real steps
    prior_loss: Tensor  # [] mean lam * c_r * 1/2 sum P_S (theta - mu_S)^2 over the real steps


def local_train(ctx: ClientContext, bc: Broadcast, spec: Spec, opt: OptimConfig) -> LocalFit:
    """Alg. 1 ClientUpdate: SGD on L_task + prior from mu_S, accumulating the online Fisher."""
    grad_and_loss = torch.func.grad_and_value(ctx.loss_fn)
    # c_r in the prior lam * c_r * 1/2 sum P_S (theta - mu_S)^2: 1 (Alg. 1) or 1/r (code)
    coef = spec.lam * (1.0 if spec.prior_form == "paper" else 1.0 / ctx.round_idx)
    stiffness = prior_stiffness(bc.precision, coef, opt.client_lr)
    sgd = MaskedSGD(bc.mean, opt.client_lr, opt.client_momentum)
    fisher = tree_zeros_like(bc.mean)
    task_sum = prior_sum = torch.zeros_like(ctx.num_examples)
    for step in range(ctx.num_steps):
        mask, batch, params = ctx.step_mask[step], ctx.batch(step), sgd.params
        grads, loss = grad_and_loss(params, batch)  # task loss only: the Fisher excludes the prior
        if not spec.offline:
            scale = mask * step_weight(ctx, batch, spec.fisher_norm)
            inc = fisher_increment(ctx, params, batch, grads, spec.fisher)
            fisher = {k: fisher[k] + scale * inc[k] for k in fisher}
        diff = tree_sub(params, bc.mean)
        prior_grads = {k: stiffness[k] * diff[k] for k in diff}
        total = _clip(tree_add(grads, prior_grads), spec.clip_norm)
        sgd.step(total, mask)
        task_sum = task_sum + mask * loss.detach()
        prior_sum = prior_sum + mask * 0.5 * tree_vdot(prior_grads, diff).detach()
    steps = ctx.step_mask.sum().clamp_min(1.0)
    if spec.fisher_norm == "mean":
        fisher = tree_scale(fisher, 1.0 / steps)
    return LocalFit(sgd.params, fisher, task_sum / steps, prior_sum / steps)


def prior_stiffness(precision: Params, coef: float, lr: float) -> Params:
    """The prior's per-coordinate curvature coef P_S, capped at 1 / lr (guard; Deviations): an explicit SGD step
    on a stiffer coordinate would overshoot mu_S, and one of lr c > 2 diverges. Below the cap the value is
    coef P_S exactly (the same floats as without the guard)."""
    if lr <= 0:
        return {k: coef * p for k, p in precision.items()}
    return {k: torch.clamp(coef * p, max=1.0 / lr) for k, p in precision.items()}


def client_precision(fisher: Params, prior: Params, round_idx: int, prior_form: str) -> Params:
    """Eq. 17: P_n = F_n / r + (r-1)/r P_S ("paper"); the code's Omega_n = Omega_S + F_n ("code")."""
    if prior_form == "code":
        return tree_add(prior, fisher)
    r = round_idx
    return {k: fisher[k] / r + (r - 1) / r * prior[k] for k in fisher}


def client_update(
    ctx: ClientContext, bc: Broadcast, client_state: None, hp: FOLAConfig, opt: OptimConfig
) -> ClientOut:
    """Local training from mu_S, then upload (mu_n, P_n) (P_n compressed when p < 1)."""
    spec = hp.spec()
    fit = local_train(ctx, bc, spec, opt)
    precision = client_precision(fit.fisher, bc.precision, ctx.round_idx, spec.prior_form)
    return make_out(fit, precision, spec)


def client_round(hp: FOLAConfig, round_idx: int) -> int:
    """Algorithm.round_key: the client update depends on the round itself (P_n = F_n / r + ..., Eq. 17;
    the code form's prior coefficient 1/r)."""
    return round_idx


def prior_round(hp: FOLAConfig, round_idx: int) -> int:
    """round_key of the offline variants (fola-offline, fedcurv): the round enters their client update
    only through the prior coefficient c_r, which is 1/r in the code form and 1 in the paper's."""
    return round_idx if hp.prior_form == "code" else 0


def make_out(fit: LocalFit, precision: Params, spec: Spec) -> ClientOut:
    """Upload {"mean": mu_n, "precision": P_n} (or "precision_compressed") and the metrics."""
    upload: dict[str, object] = {"mean": fit.params, **upload_precision(precision, spec.compress_p)}
    fisher_sum = sum(f.sum() for f in fit.fisher.values())
    assert isinstance(fisher_sum, Tensor)  # a model has parameters: a tensor, never sum()'s start 0
    fisher_mean = fisher_sum / sum(f.numel() for f in fit.fisher.values())
    metrics = {"train_loss": fit.task_loss, "prior_loss": fit.prior_loss, "fisher_mean": fisher_mean}
    return ClientOut(upload=upload, state=None, metrics=metrics)


def aggregate(
    means: Params, precisions: Params, weights: Tensor, damping: float, product: bool
) -> tuple[Params, Params]:
    """Eq. 9 diagonal: P_S = sum a_n P_n, mu_S = sum a_n P_n mu_n / (P_S + gamma); a_n = m_n / sum m.

    Where P_S + gamma is 0 (gamma = 0 and no client has curvature there) mu_S is FedAvg's
    sum a_n mu_n, the limit of adding the same delta -> 0 to every P_n. With product=False
    the mean is FedAvg's everywhere (the FedCurv variant).
    """
    a = weights / weights.sum()  # [C]
    precision = {k: torch.tensordot(a.to(p.dtype), p, dims=([0], [0])) for k, p in precisions.items()}
    average = {k: torch.tensordot(a.to(m.dtype), m, dims=([0], [0])) for k, m in means.items()}
    if not product:
        return average, precision
    mean = {}
    for k, m in means.items():
        denom = precision[k] + damping
        tiny = torch.finfo(denom.dtype).tiny
        product_mean = torch.tensordot(a.to(m.dtype), precisions[k] * m, dims=([0], [0])) / denom.clamp_min(
            tiny
        )
        mean[k] = torch.where(denom > tiny, product_mean, average[k])
    return mean, precision


def server_update(
    state: ServerState, outs: ClientOut, weights: Tensor, hp: FOLAConfig, opt: OptimConfig
) -> tuple[ServerState, Diagnostics]:
    """Aggregate the cohort's (mu_n, P_n); theta = mu_S (Alg. 1)."""
    spec = hp.spec()
    means = outs.upload["mean"]  # [C, ...]
    precisions = cohort_precision(outs.upload)  # [C, ...]
    mean, precision = aggregate(means, precisions, weights, spec.damping, spec.product)
    fedavg_mean, _ = aggregate(means, precisions, weights, 0.0, False)
    numel = sum(p.numel() for p in precision.values())
    low = sum((p < max(10 * spec.damping, torch.finfo(p.dtype).tiny)).sum() for p in precision.values())
    precision_sum = sum(p.sum() for p in precision.values())
    assert isinstance(precision_sum, Tensor)  # a model has parameters: a tensor, never sum()'s start 0
    diagnostics = {
        "server/precision_mean": precision_sum / numel,
        "server/low_precision_frac": torch.as_tensor(low, dtype=torch.float64) / numel,
        "server/shift_from_fedavg": tree_norm(tree_sub(mean, fedavg_mean))
        / tree_norm(fedavg_mean).clamp_min(1e-12),
    }
    return ServerState(mean=mean, precision=precision, num_examples=float(weights.sum())), diagnostics


def global_params(state: ServerState) -> Params:
    return state.mean


def posterior(state: ServerState) -> tuple[Params, Params]:
    """Return N(mu_S, 1 / (n P_S + delta_l)): the cohort's Laplace posterior with Eq. 18's prior (docstring)."""
    n = max(state.num_examples, 1.0)
    return state.mean, {  # the variances
        k: 1.0 / (n * p + 1.0 / state.mean[k].pow(2).mean().clamp_min(torch.finfo(p.dtype).tiny))
        for k, p in state.precision.items()
    }


ALGORITHM = Algorithm(
    name="fola",
    paper="Liu, Zheng. A Bayesian Federated Learning Framework with Multivariate Gaussian Product. "
    "arXiv:2102.01936 (2021)",
    config_cls=FOLAConfig,
    server_init=server_init,
    broadcast=broadcast,
    client_update=client_update,
    server_update=server_update,
    global_params=global_params,
    posterior=posterior,
    round_key=client_round,
    check_model=per_sample_obstacle,
    description="Gaussian-product aggregation of (mu_n, diag Fisher precision) + online Laplace prior "
    "(--hp lam=0: aggregation only).",
)
