"""FedADMM: classic federated ADMM with a Gaussian prior regulariser.

Möllenhoff, Swaroop, Doshi-Velez, Khan. Federated ADMM from Bayesian Duality. arXiv:2506.13150
(v1, the seed text), Fig. 2a and App. C.1; after Boyd, Parikh, Chu, Peleato, Eckstein,
Distributed Optimization and Statistical Learning via ADMM, 2011, §7.1.1.

Implements: Eq. 21 (client primal step, argmin of l_k(theta) + <v_k, theta> + rho/2
||theta - theta_bar||^2, solved inexactly by the round's E x K local SGD steps) ->
client_update / proximal_sgd; Eq. 22 (dual step v_k <- v_k + gamma (theta_k - theta_bar))
-> client_update; Eqs. 23-25 (server step; for l_0 = delta/2 ||theta||^2 the argmin is
theta_bar = (rho K Mean(theta_k) + Sum(v_k)) / (delta + rho K), i.e. alpha = 1/(1 + rho K)
when delta = 1) -> server_update.
Notation: theta_bar -> state.params, v_k -> ClientState.v, rho -> hp.rho, delta -> hp.delta,
gamma = hp.dual_damping * rho, K -> the cohort size C, l_k -> N_k x (the engine's mean loss).
Deviations:
  Paper: l_k is the client's total loss; the client step is an exact argmin. Here: l_k =
  N_k x mean loss, and local SGD minimises the client objective divided by N_k (mean loss
  + <v_k, theta>/N_k + rho/(2 N_k) ||theta - theta_bar||^2: same argmin, per-example scale,
  so --client-lr means what it means for FedAvg).
  Paper: all K clients every round; the client sends theta_k and v_k. Here: the client sends
  theta_k only; the server tracks Sum(v_k) over every client seen so far from the same dual
  increments (the reference's server-side dual tracking) and the proximal terms of Eq. 23
  run over this round's cohort (K = C). Under full participation this is Fig. 2a exactly;
  under partial participation the fixed point (theta_k = theta_bar, delta theta_bar =
  Sum v_k = -Sum grad l_k) is still the regularised optimum.
  Released toy code (`dual_damping`): gamma = damping x rho; default 1 (Eq. 22). Its FedADMM
  baseline (Gong et al.) uses a non-squared prox norm: a bug, not reproduced.
  theta_bar starts at the model's initial parameters (the toy code starts at 0; pass zeros
  to server_init for that). The server step is closed form: --server-opt must be sgd, lr 1.
Defaults: rho = 0.2 (Fig. 4, App. F.3); delta = 0 (ell_0 = 0, the consensus ADMM of Boyd et al.
  §7.1.1), not Fig. 4's 0.2 (docs/out-of-the-box.md, "Defaults changed"). Fig. 4 is a
  200-point logistic toy whose theta_bar starts at 0, where the prior cannot pull. Here theta_bar
  starts at the model's initialisation and Sum v starts at 0, so each early server step scales the
  cohort mean by rho C / (delta + rho C) (2 / 2.2 at rho = delta = 0.2, C = 10) before the duals
  balance the prior: on HAR's CNN FedADMM ended 7 points below FedAvg at delta = 0.2 and 2.8 above
  at delta = 0 (25 rounds, seeds 0 and 1). At the fixed point the prior is delta/2 ||theta||^2
  against a loss summed over the N examples (delta / N per example), so 0.2 was a negligible
  regulariser there; --hp delta=0.2 restores Fig. 4's setting.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from fedcli.algorithms.base import (
    Algorithm,
    ClientContext,
    ClientOut,
    Diagnostics,
    OptimConfig,
    Params,
    require,
    tree_norm,
    tree_vdot,
    tree_zeros_like,
)
from fedcli.algorithms.optim import MaskedSGD


@dataclass(frozen=True, kw_only=True)
class FedADMMConfig:
    rho: float = 0.2  # rho, the proximal weight / inverse step size (Eq. 21); Fig. 4, App. F.3
    delta: float = (
        0.0  # delta, prior precision of l_0 = delta/2 ||theta||^2 (Eq. 23); 0 = no prior (Boyd §7.1.1).
    )
    # Fig. 4 / App. F.3's 0.2 is a 200-point toy started at 0: see Defaults in the module docstring.
    dual_damping: float = 1.0  # gamma = dual_damping * rho (Eq. 22 has 1); toy code `dual_damping`

    def __post_init__(self) -> None:
        require(self.rho > 0, "hp.rho", "> 0", self.rho)
        require(self.delta >= 0, "hp.delta", ">= 0", self.delta, "delta = 0 drops the prior (FedDyn's form).")
        require(self.dual_damping > 0, "hp.dual_damping", "> 0", self.dual_damping)


class ServerState(NamedTuple):
    params: Params  # theta_bar
    dual_sum: Params  # Sum_k v_k over every client seen so far


class Broadcast(NamedTuple):
    params: Params  # theta_bar


class ClientState(NamedTuple):
    v: Params  # the client's dual v_k (starts at 0)


def require_closed_form_server(opt: OptimConfig, name: str) -> None:
    """Refuse server optimiser settings that a closed-form server step would silently ignore."""
    require(
        opt.server_opt == "sgd",
        "train.server_opt",
        f"sgd for {name} (its server step is closed form)",
        opt.server_opt,
    )
    require(
        opt.server_lr == 1.0,
        "train.server_lr",
        f"1.0 for {name} (its server step is closed form)",
        opt.server_lr,
    )


def server_init(params: Params, hp: object, opt: OptimConfig, name: str = "fedadmm") -> ServerState:
    """Return theta_bar = the initial parameters and a zero dual sum (`name`: the algorithm the checks name)."""
    require_closed_form_server(opt, name)
    return ServerState(params=dict(params), dual_sum=tree_zeros_like(params))


def init_client_state(params: Params, hp: FedADMMConfig) -> ClientState:
    """Return v_k = 0."""
    return ClientState(v=tree_zeros_like(params))


def broadcast(state: ServerState, hp: FedADMMConfig) -> Broadcast:
    """Return theta_bar."""
    return Broadcast(params=state.params)


DataLoss = Callable[[Params, int], Tensor]  # (params, step) -> minibatch loss of that step


def proximal_sgd(
    ctx: ClientContext,
    start: Params,
    centre: Params,
    lin: Params,
    prox: Tensor | float,
    opt: OptimConfig,
    data_loss: DataLoss | None = None,
) -> tuple[Params, Tensor]:
    """Run the round's masked SGD(+momentum) steps on  loss + <lin, theta> + prox/2 ||theta - centre||^2.

    Returns (last iterate, mean data loss over the real steps); the reported loss excludes
    the linear and proximal terms. `data_loss` defaults to ctx.loss_fn on the step's batch.
    """
    loss_at = data_loss or (lambda p, step: ctx.loss_fn(p, ctx.batch(step)))

    def objective(params: Params, step: int) -> tuple[Tensor, Tensor]:
        loss = loss_at(params, step)
        sq = sum(((params[k] - centre[k]) ** 2).sum() for k in params)
        return loss + tree_vdot(lin, params) + 0.5 * prox * sq, loss.detach()

    grad_fn = torch.func.grad(objective, has_aux=True)
    sgd = MaskedSGD(start, opt.client_lr, opt.client_momentum)
    loss_sum = torch.zeros((), dtype=ctx.step_mask.dtype, device=ctx.step_mask.device)
    for step in range(ctx.num_steps):
        grads, loss = grad_fn(sgd.params, step)
        mask = ctx.step_mask[step]
        sgd.step(grads, mask)
        loss_sum = loss_sum + mask * loss
    return sgd.params, loss_sum / ctx.step_mask.sum().clamp_min(1.0)


def client_update(
    ctx: ClientContext,
    bc: Broadcast,
    client_state: ClientState,
    hp: FedADMMConfig,
    opt: OptimConfig,
    data_loss: DataLoss | None = None,
) -> ClientOut:
    """Eq. 21 by local SGD (objective / N_k), then Eq. 22; upload theta_k."""
    n = ctx.num_examples
    lin = {k: v / n for k, v in client_state.v.items()}
    theta, loss = proximal_sgd(ctx, bc.params, bc.params, lin, hp.rho / n, opt, data_loss)
    gamma = hp.dual_damping * hp.rho
    v = {k: client_state.v[k] + gamma * (theta[k] - bc.params[k]) for k in theta}
    metrics = {"train_loss": loss, "admm_dual_norm": tree_norm(v)}
    return ClientOut(upload={"params": theta}, state=ClientState(v=v), metrics=metrics)


def server_update(
    state: ServerState, outs: ClientOut, weights: Tensor, hp: FedADMMConfig, opt: OptimConfig
) -> tuple[ServerState, Diagnostics]:
    """Add the cohort's dual increments to Sum v; theta_bar = (rho C Mean theta_k + Sum v)/(delta + rho C).

    The client mean is unweighted (paper: Mean over clients, not N_k-weighted).
    """
    cohort = outs.upload["params"]  # [C, ...]
    num = next(iter(cohort.values())).shape[0]
    gamma = hp.dual_damping * hp.rho
    dual_sum = {k: state.dual_sum[k] + gamma * (t - state.params[k]).sum(0) for k, t in cohort.items()}
    params = {k: (hp.rho * t.sum(0) + dual_sum[k]) / (hp.delta + hp.rho * num) for k, t in cohort.items()}
    diagnostics = {
        "fedadmm/dual_sum_norm": tree_norm(dual_sum),
        "fedadmm/alpha": torch.tensor(1.0 / (hp.delta + hp.rho * num)),
    }
    return ServerState(params=params, dual_sum=dual_sum), diagnostics


def global_params(state: ServerState) -> Params:
    """Return theta_bar."""
    return state.params


ALGORITHM = Algorithm(
    name="fedadmm",
    paper="Möllenhoff, Swaroop, Doshi-Velez, Khan. Federated ADMM from Bayesian Duality (Fig. 2a). "
    "arXiv:2506.13150",
    config_cls=FedADMMConfig,
    server_init=server_init,
    broadcast=broadcast,
    client_update=client_update,
    server_update=server_update,
    global_params=global_params,
    init_client_state=init_client_state,
    description="Classic federated ADMM (duals per client, prior delta, alpha = 1/(delta + rho K)).",
)
