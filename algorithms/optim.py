"""Functional client and server optimisers (pure functions on Params).

Client: SGD with heavy-ball momentum, `v <- m v + g; theta <- theta - lr v` (the form
of the FedPA JAX code and of torch.optim.SGD with dampening 0; Keras' form is the same
trajectory for a constant learning rate).

Server: the generalized FedOpt step of Reddi et al. (Adaptive Federated Optimization,
ICLR 2021, arXiv:2003.00295, Alg. 2), applied to the pseudo-gradient
g = weighted mean of client deltas (old minus new):

    sgd       theta <- theta - lr g
    momentum  v <- beta v + g;            theta <- theta - lr v          (FedAvgM, FedPA JAX form)
    adam      m <- b1 m + (1-b1) g;  v <- b2 v + (1-b2) g^2;  theta <- theta - lr m / (sqrt(v) + tau)
    adagrad   m <- a1 m + (1-a1) g;  v <- v + g^2;  theta <- theta - lr m / (sqrt(v) + tau)
    yogi      m as adam;  v <- v - (1-b2) g^2 sign(v - g^2);  theta <- theta - lr m / (sqrt(v) + tau)

with a1 = server_adagrad_beta1 (FedAdagrad's own beta1; a1 = 0 gives m = g).
Deviations: Paper (Alg. 2): v_{-1} >= tau^2 and no bias correction. Here: v_{-1} = 0 (the
Reddi et al. framework code's initial accumulator, FedPA reference §4.4) and no bias
correction by default (the paper's form); `server_bias_correction=True` gives PyTorch's
Adam, theta <- theta - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + tau). Keras' Adam (and
TFF's, which wraps it) is not this: it folds the corrections into the step size,
theta <- theta - lr sqrt(1 - b2^t) / (1 - b1^t) m / (sqrt(v) + tau), so its tau is not
rescaled by sqrt(1 - b2^t); the two agree only when tau << sqrt(v_hat).
Paper (Alg. 2, FedAdagrad as printed): momentum m_t = b1 m_{t-1} + (1-b1) Delta_t. Here:
server_adagrad_beta1 = 0 by default, no momentum, the Keras Adagrad of the released
framework code (v_{-1} = 0, eps = tau); set it (e.g. to 0.9, the paper's b1) for Alg. 2.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fedcli.algorithms.base import (
    Batch,
    ClientContext,
    ClientOut,
    Local,
    LocalSGD,
    LossFn,
    OptimConfig,
    Params,
    ServerOptState,
    tree_vdot,
    tree_where,
    tree_zeros_like,
)


def server_opt_init(params: Params) -> ServerOptState:
    """Return zero moments and step 0 for any server optimiser."""
    return ServerOptState(
        first=tree_zeros_like(params), second=tree_zeros_like(params), step=torch.zeros((), dtype=torch.int64)
    )


def server_opt_step(
    params: Params, pseudo_grad: Params, state: ServerOptState, opt: OptimConfig
) -> tuple[Params, ServerOptState]:
    """Apply one server step with g = pseudo_grad (old minus new); see the module table."""
    kind, lr, tau = opt.server_opt, opt.server_lr, opt.server_tau
    first, second = state.first, state.second
    if kind == "sgd":
        new = {k: p - lr * pseudo_grad[k] for k, p in params.items()}
    elif kind == "momentum":
        first = {k: opt.server_momentum * first[k] + pseudo_grad[k] for k in params}
        new = {k: p - lr * first[k] for k, p in params.items()}
    elif kind == "adagrad":
        a1 = opt.server_adagrad_beta1
        first = {k: a1 * first[k] + (1 - a1) * pseudo_grad[k] for k in params} if a1 else first
        direction = first if a1 else pseudo_grad
        second = {k: second[k] + pseudo_grad[k] ** 2 for k in params}
        new = {k: p - lr * direction[k] / (second[k].sqrt() + tau) for k, p in params.items()}
    else:  # adam or yogi (OptimConfig admits only SERVER_OPTIMIZERS)
        b1, b2 = opt.server_beta1, opt.server_beta2
        first = {k: b1 * first[k] + (1 - b1) * pseudo_grad[k] for k in params}
        second = {k: _second_moment(kind, second[k], pseudo_grad[k], b2) for k in params}
        c1, c2 = 1.0, 1.0
        if opt.server_bias_correction:  # PyTorch Adam: m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^t)
            t = int(state.step) + 1  # the server step runs outside vmap, so a Python int is fine
            c1, c2 = 1.0 - b1**t, 1.0 - b2**t
        new = {k: p - lr * (first[k] / c1) / ((second[k] / c2).sqrt() + tau) for k, p in params.items()}
    return new, ServerOptState(first=first, second=second, step=state.step + 1)


def _second_moment(kind: str, v: Tensor, g: Tensor, beta2: float) -> Tensor:
    """Return Adam's EMA of g^2, or Yogi's additive sign-controlled update."""
    g2 = g * g
    if kind == "adam":
        return beta2 * v + (1 - beta2) * g2
    return v - (1 - beta2) * g2 * torch.sign(v - g2)


class LocalResult(NamedTuple):
    """What a run of local SGD returns."""

    params: Params  # last iterate theta_K
    epoch_means: list[Params]  # per epoch: mean of the post-step iterates (IASG samples)
    mean_loss: Tensor  # [] mean minibatch loss over the real steps


class MaskedSGD:
    """Masked SGD(+momentum) on an iterate it owns, `v <- m v + g; theta <- theta - lr v`.

    A step with mask 0 leaves parameters and momentum unchanged; a step with mask 1 is one
    SGD(+momentum) step. Steps take the *scaled* gradient s = -lr * mask * g (`coef(mask) * g`): callers
    that differentiate coef * loss get it from the backward pass for free. The velocity is
    kept scaled too, u = -lr v, so a step is `u <- keep u + s; theta <- theta + mask u` with
    keep = m for a real step and 1 for a masked one (s = 0 there).

    The first step is out of place (the caller's tensors are never written); later steps
    update the owned tensors in place (add_/mul_, which have vmap batching rules), one pass
    per tensor instead of the passes and fresh allocations of `where(mask, p - lr g, p)`:
    on a cohort stacked under vmap the update is memory-bound and this was most of its cost
    (tests/benchmarks). Inside torch.func.vmap, the first step's result carries the client
    axis that the in-place steps need.
    """

    def __init__(self, params: Params, lr: float, momentum: float) -> None:
        self.params: Params = dict(params)
        self.velocity: Params = {}
        self.lr, self.momentum, self._owned = lr, momentum, False

    def coef(self, mask: Tensor) -> Tensor:
        """Return -lr * mask, the factor that turns a gradient into a step."""
        return mask * -self.lr

    def step(self, grads: Params, mask: Tensor) -> None:
        """Apply one step from unscaled gradients (non-finite gradients of masked steps are ignored)."""
        coef, real = self.coef(mask), mask.bool()
        self.apply({k: torch.where(real, g * coef, 0.0) for k, g in grads.items()}, mask)

    def apply(self, scaled: Params, mask: Tensor) -> None:
        """Apply one step from scaled gradients s = coef(mask) * g."""
        if self.momentum == 0.0:
            if self._owned:
                for k, p in self.params.items():
                    p.add_(scaled[k])
            else:
                self.params = {k: p + scaled[k] for k, p in self.params.items()}
        elif self._owned:
            keep = 1.0 + mask * (self.momentum - 1.0)
            for k, p in self.params.items():
                p.add_(self.velocity[k].mul_(keep).add_(scaled[k]) * mask)
        else:  # the velocity starts at zero, so u_1 = s (copied: s may be a view of a constant)
            self.velocity = {k: scaled[k].clone() for k in self.params}
            self.params = {k: p + self.velocity[k] for k, p in self.params.items()}
        self._owned = True


def accumulate(total: Params | None, x: Params) -> Params:
    """Return total + x, in place on `total` after the first call (total None: a copy of x)."""
    if total is None:
        return {k: v.clone() for k, v in x.items()}
    for k, v in total.items():
        v.add_(x[k])
    return total


def scaled_objective(loss_fn: LossFn) -> Callable[[Params, Batch, Tensor], tuple[Tensor, Tensor]]:
    """Return (params, batch, coef) -> (coef * loss, loss): its gradient is MaskedSGD's step."""

    def scaled_loss(params: Params, batch: Batch, coef: Tensor) -> tuple[Tensor, Tensor]:
        loss = loss_fn(params, batch)
        return coef * loss, loss.detach()

    return scaled_loss


GradStep = Callable[
    [Params, Batch, Tensor], tuple[Params, Tensor]
]  # (params, batch, coef) -> (coef * grad, loss)


def local_sgd(
    ctx: ClientContext,
    params: Params,
    opt: OptimConfig,
    objective: LossFn | None = None,
    *,
    average_epochs: bool = False,
    grad_step: GradStep | None = None,
) -> LocalResult:
    """Run E epochs x K masked SGD(+momentum) steps on `objective` from `params`.

    Momentum persists across the epochs of a round and starts at zero every round
    (clients are stateless across rounds, as in FedPA §2.10 [TFF]). A masked step leaves
    parameters and momentum unchanged. With `average_epochs`, each epoch also yields the
    average of its post-step iterates (the IASG sample of FedPA Alg. 4, lines 5-10).
    `params` is never written: the iterate is a copy made by the first step (MaskedSGD).

    The epoch average sums the iterate after every step, real or masked, and then removes
    the masked ones: masked steps come after the real ones of their epoch (CohortPlan's
    layout, the ClientContext contract) and leave the iterate unchanged, so each of them
    added the epoch's last iterate. One in-place add per step, no temporary.

    `grad_step` replaces the autograd step grad(coef * objective) (the engine's compiled
    per-client step, engine/local.py); it must compute the same thing.
    """
    scaled_grad = grad_step or torch.func.grad(scaled_objective(objective or ctx.loss_fn), has_aux=True)
    sgd = MaskedSGD(params, opt.client_lr, opt.client_momentum)
    loss_sum = torch.zeros((), dtype=ctx.step_mask.dtype, device=ctx.step_mask.device)
    epoch_means: list[Params] = []
    for epoch in range(ctx.num_epochs):
        running: Params | None = None
        for k in range(ctx.steps_per_epoch):
            step = epoch * ctx.steps_per_epoch + k
            mask = ctx.step_mask[step]
            scaled, loss = scaled_grad(sgd.params, ctx.batch(step), sgd.coef(mask))
            sgd.apply(scaled, mask)
            loss_sum = loss_sum + mask * loss
            if average_epochs:
                running = accumulate(running, sgd.params)
        if average_epochs and running is not None:
            real = ctx.step_mask[epoch * ctx.steps_per_epoch : (epoch + 1) * ctx.steps_per_epoch].sum()
            masked, count = ctx.steps_per_epoch - real, real.clamp_min(1.0)
            epoch_means.append({n: (v - masked * sgd.params[n]) / count for n, v in running.items()})
    mean_loss = loss_sum / ctx.step_mask.sum().clamp_min(1.0)
    return LocalResult(params=sgd.params, epoch_means=epoch_means, mean_loss=mean_loss)


def proximal_term(params: Params, anchor: Params, mu: float) -> Tensor:
    """Return mu/2 * ||w - w^t||^2 summed over every parameter tensor (FedProx, Li et al. Eq. 2)."""
    return 0.5 * mu * sum(((params[k] - anchor[k]) ** 2).sum() for k in params)  # type: ignore[return-value]


def local_objective(loss_fn: LossFn, request: LocalSGD) -> LossFn:
    """Return the loss whose gradient is LocalSGD's: g + mu (theta - start) + linear, valued F alone.

    The added terms enter as `t - t.detach()`: exactly 0 in value, their full gradient in
    backward, so the reported loss stays the task loss (comparable with FedAvg's train/loss).
    Without terms it is `loss_fn` itself.
    """
    mu, start, linear = request.prox_mu, request.start, request.linear
    if mu == 0.0 and linear is None:
        return loss_fn

    def objective(params: Params, batch: Batch) -> Tensor:
        loss = loss_fn(params, batch)
        if mu != 0.0:
            prox = proximal_term(params, start, mu)
            loss = loss + (prox - prox.detach())
        if linear is not None:
            lin = tree_vdot(params, linear)
            loss = loss + lin - lin.detach()
        return loss

    return objective


def train_local(
    ctx: ClientContext, request: LocalSGD, opt: OptimConfig, grad_step: GradStep | None = None
) -> LocalResult:
    """Run the local SGD `request` declares, through autograd: the trainer of the generic back ends."""
    return local_sgd(
        ctx,
        request.start,
        opt,
        local_objective(ctx.loss_fn, request),
        average_epochs=request.average_epochs,
        grad_step=grad_step,
    )


def local_update(local: Local) -> Callable[..., ClientOut]:
    """Return the client_update of an algorithm that declares its local training (Algorithm.local).

    `client_update(ctx, bc, state, hp, opt) = local.finish(..., train_local(ctx, local.request(...), opt))`:
    what the engine runs with the autograd trainer, callable on its own (tests, studies).
    """

    def client_update(ctx: ClientContext, bc: Any, client_state: Any, hp: Any, opt: OptimConfig) -> ClientOut:
        request = local.request(ctx, bc, client_state, hp, opt)
        return local.finish(ctx, bc, client_state, hp, opt, train_local(ctx, request, opt))

    client_update.__doc__ = f"{local.request.__doc__ or ''} Then: {local.finish.__doc__ or ''}".strip()
    return client_update


# ---------------------------------------------------------------------------------------
# IVON: Shen, Daheim, Cong, Nickl, Marconi, Bazan, Yokota, Gurevych, Cremers, Khan,
# Möllenhoff. Variational Learning is Effective for Large Deep Networks. ICML 2024.
# arXiv:2402.17641 (Alg. 1), with the general diagonal prior and the two Lagrange-multiplier
# terms of Möllenhoff, Swaroop, Doshi-Velez, Khan, Federated ADMM from Bayesian Duality
# (Alg. 2). It minimises, over q = N(m, diag(sigma^2)),
#
#     ess * E_q[ loss(theta) + <lin, theta> - 1/2 theta^T (quad * theta) ] + KL(q || p),
#     p = N(prior_mean, 1 / (ess * prior_prec))          (prior_prec = IVON's "weight decay")
#
# one step (eps ~ N(0, I) pre-drawn, M Monte-Carlo samples averaged):
#     theta = m + sigma eps,  sigma = 1 / sqrt(ess (h + prior_prec))
#     g_hat = grad loss(theta);  h_hat = g_hat (theta - m) / sigma^2 - quad      (Price estimator)
#     g <- b1 g + (1 - b1) g_hat
#     h <- b2 h + (1 - b2) h_hat + 1/2 (1 - b2)^2 (h - h_hat)^2 / (h + prior_prec)
#     m <- m - lr (g / (1 - b1^t) + lin - quad m + prior_prec (m - prior_mean)) / (h + prior_prec)
# The posterior precision is ess (h + prior_prec). With lin = quad = 0 and prior_mean = 0 it
# is Shen et al.'s IVON with weight decay prior_prec. Debiasing (1 - b1^t) is Shen et al.'s
# Alg. 1 line 6 (and the released code's default); BayesADMM's Alg. 2 as printed omits it.
# ---------------------------------------------------------------------------------------


class IvonState(NamedTuple):
    """IVON's variational mean, Hessian estimate, momentum and step count."""

    mean: Params  # m
    hess: Params  # h, per-example Hessian estimate (the posterior precision is ess (h + prior_prec))
    momentum: Params  # g, EMA of the gradients
    step: Tensor  # [] float, steps taken t (for the bias correction 1 - b1^t)


class IvonTarget(NamedTuple):
    """The objective IVON minimises (see the table above); lin/quad may be empty dicts (= 0)."""

    ess: Tensor  # [] lambda, the effective sample size (loss scaling)
    prior_mean: Params  # m_p
    prior_prec: Params  # delta = 1 / (ess sigma_p^2), per parameter
    lin: Params  # v, the linear Lagrange term ({} for none)
    quad: Params  # u, the quadratic Lagrange term ({} for none)


def ivon_precision(state: IvonState, target: IvonTarget) -> Params:
    """Return the posterior precision 1 / sigma^2 = ess (h + prior_prec)."""
    return {k: target.ess * (h + target.prior_prec[k]) for k, h in state.hess.items()}


def ivon_sample(state: IvonState, target: IvonTarget, eps: Params) -> Params:
    """Return theta = m + eps / sqrt(ess (h + prior_prec)) for standard-normal eps."""
    prec = ivon_precision(state, target)
    return {k: m + eps[k] / torch.sqrt(prec[k]) for k, m in state.mean.items()}


def ivon_step(
    state: IvonState,
    grad: Params,
    grad_eps: Params,
    target: IvonTarget,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    debias: bool = True,
) -> IvonState:
    """Return one IVON update (the table above).

    Args:
        grad: mean over the MC samples of g_hat.
        grad_eps: mean over the MC samples of g_hat * eps (eps the standard-normal draw of
            that sample), so that h_hat = grad_eps * sqrt(ess (h + prior_prec)) - quad.
    """
    step = state.step + 1
    correction = 1.0 - beta1**step if debias else torch.ones_like(step)
    mean, hess, momentum = {}, {}, {}
    for k, m in state.mean.items():
        h, wd = state.hess[k], target.prior_prec[k]
        h_hat = grad_eps[k] * torch.sqrt(target.ess * (h + wd))
        if k in target.quad:
            h_hat = h_hat - target.quad[k]
        momentum[k] = beta1 * state.momentum[k] + (1 - beta1) * grad[k]
        hess[k] = beta2 * h + (1 - beta2) * h_hat + 0.5 * (1 - beta2) ** 2 * (h - h_hat) ** 2 / (h + wd)
        direction = momentum[k] / correction + wd * (m - target.prior_mean[k])
        if k in target.lin:
            direction = direction + target.lin[k]
        if k in target.quad:
            direction = direction - target.quad[k] * m
        mean[k] = m - lr * direction / (hess[k] + wd)
    return IvonState(mean=mean, hess=hess, momentum=momentum, step=step)


def local_ivon(
    ctx: ClientContext,
    state: IvonState,
    target: IvonTarget,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    mc_samples: int,
    debias: bool = True,
) -> tuple[IvonState, Tensor]:
    """Run the E x K masked IVON steps of a round on ctx.loss_fn; return (state, mean loss).

    The standard-normal draws come from ctx.noise["ivon." + name][step, sample]
    (declare shapes (S, mc_samples, *param.shape)). A masked step leaves the state unchanged.
    The returned loss is the mean over real steps of the mean over samples of the minibatch loss.
    """
    grad_and_loss = torch.func.grad_and_value(ctx.loss_fn)
    loss_sum = torch.zeros((), dtype=ctx.step_mask.dtype, device=ctx.step_mask.device)
    for step in range(ctx.num_steps):
        batch = ctx.batch(step)
        grad = {k: torch.zeros_like(m) for k, m in state.mean.items()}
        grad_eps = {k: torch.zeros_like(m) for k, m in state.mean.items()}
        loss = torch.zeros((), dtype=loss_sum.dtype, device=loss_sum.device)
        for j in range(mc_samples):
            eps = {k: ctx.noise["ivon." + k][step, j].to(m.dtype) for k, m in state.mean.items()}
            g, value = grad_and_loss(ivon_sample(state, target, eps), batch)
            grad = {k: grad[k] + g[k] / mc_samples for k in grad}
            grad_eps = {k: grad_eps[k] + g[k] * eps[k] / mc_samples for k in grad}
            loss = loss + value.detach() / mc_samples
        new = ivon_step(state, grad, grad_eps, target, lr=lr, beta1=beta1, beta2=beta2, debias=debias)
        mask = ctx.step_mask[step]
        state = tree_where(mask, new, state)
        loss_sum = loss_sum + mask * loss
    return state, loss_sum / ctx.step_mask.sum().clamp_min(1.0)
