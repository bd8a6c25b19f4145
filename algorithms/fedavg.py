"""FedAvg and the generalized FedOpt family (FedAvgM, FedAdam, FedAdagrad, FedYogi).

McMahan, Moore, Ramage, Hampson, Agüera y Arcas. Communication-Efficient Learning of
Deep Networks from Decentralized Data. AISTATS 2017. arXiv:1602.05629.
Reddi, Charles, Zaheer, Garrett, Rush, Konečný, Kumar, McMahan. Adaptive Federated
Optimization. ICLR 2021. arXiv:2003.00295 (v5; Alg. 1 and Alg. 2).

Implements: client update Alg. 1 of Reddi et al. (E epochs of local SGD, momentum
optional) -> local_request (declared, Algorithm.local) and finish; server update Alg. 2 (pseudo-gradient = weighted mean delta,
then SGD / momentum / Adam / Adagrad / Yogi) -> server_update.
Notation: x_t -> state.params, Delta_i = x_t - x_{i,K} -> upload["delta"] (old minus
new, a pseudo-gradient), p_i = n_i -> weights, eta_l -> opt.client_lr, eta -> opt.server_lr.
Deviations: Paper (Reddi Alg. 1): weights 1/|S| and a fixed number K of local steps.
Here: weights q_i = n_i normalised over the cohort (the TFF and FedPA-JAX code, FedPA
reference §2.1) and K = ceil(n_i / B) steps per epoch (McMahan et al.'s epochs).
FedAvgM/FedAdam/... are `--server-opt momentum|adam|...` on this one algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from torch import Tensor

from fedcli.algorithms.base import (
    Algorithm,
    ClientContext,
    ClientOut,
    Diagnostics,
    Local,
    LocalSGD,
    OptimConfig,
    Params,
    ServerOptState,
    tree_norm,
    tree_sub,
    weighted_mean,
)
from fedcli.algorithms.optim import LocalResult, local_update, server_opt_init, server_opt_step


@dataclass(frozen=True, kw_only=True)
class FedAvgConfig:
    """FedAvg has no hyperparameters beyond the shared OptimConfig (lrs, epochs, server opt)."""


class ServerState(NamedTuple):
    params: Params  # x_t, the global model
    opt_state: ServerOptState  # server optimiser moments


class Broadcast(NamedTuple):
    params: Params  # x_t, downloaded by every sampled client


def server_init(params: Params, hp: object, opt: OptimConfig) -> ServerState:
    """Return the initial server state x_0 with zero optimiser moments (hp unread: any algorithm's config)."""
    return ServerState(params=dict(params), opt_state=server_opt_init(params))


def broadcast(state: ServerState, hp: FedAvgConfig) -> Broadcast:
    """Return what a client downloads: the global parameters."""
    return Broadcast(params=state.params)


def local_request(
    ctx: ClientContext, bc: Broadcast, client_state: None, hp: FedAvgConfig, opt: OptimConfig
) -> LocalSGD:
    """Plain local SGD from x_t on the task loss (Reddi et al. Alg. 1)."""
    return LocalSGD(start=bc.params)


def finish(
    ctx: ClientContext, bc: Broadcast, client_state: None, hp: object, opt: OptimConfig, local: LocalResult
) -> ClientOut:
    """Upload Delta_i = x_t - x_{i,K} (old minus new); hp unread: any algorithm's config."""
    delta = tree_sub(bc.params, local.params)
    return ClientOut(upload={"delta": delta}, state=None, metrics={"train_loss": local.mean_loss})


LOCAL = Local(request=local_request, finish=finish)
client_update = local_update(LOCAL)  # local SGD, then the delta: what every back end computes


def apply_pseudo_gradient(
    state: ServerState, cohort_delta: Params, weights: Tensor, opt: OptimConfig
) -> tuple[ServerState, Diagnostics]:
    """Average deltas with weights q_i / sum q and take one server optimiser step."""
    return step_on_pseudo_gradient(state, weighted_mean(cohort_delta, weights), opt)


def step_on_pseudo_gradient(
    state: ServerState, pseudo_grad: Params, opt: OptimConfig
) -> tuple[ServerState, Diagnostics]:
    """One server optimiser step on the (already averaged) pseudo-gradient mean_q(x - y_i)."""
    params, opt_state = server_opt_step(state.params, pseudo_grad, state.opt_state, opt)
    return (
        ServerState(params=params, opt_state=opt_state),
        {"server/pseudo_grad_norm": tree_norm(pseudo_grad)},
    )


def server_update(
    state: ServerState, outs: ClientOut, weights: Tensor, hp: FedAvgConfig, opt: OptimConfig
) -> tuple[ServerState, Diagnostics]:
    """Apply the server optimiser to the weighted mean delta (Reddi et al. Alg. 2)."""
    return apply_pseudo_gradient(state, outs.upload["delta"], weights, opt)


def global_params(state: ServerState) -> Params:
    """Return the model to evaluate: x_t."""
    return state.params


ALGORITHM = Algorithm(
    name="fedavg",
    paper="McMahan et al. AISTATS 2017 (arXiv:1602.05629); Reddi et al. ICLR 2021 (arXiv:2003.00295)",
    config_cls=FedAvgConfig,
    server_init=server_init,
    broadcast=broadcast,
    client_update=client_update,
    server_update=server_update,
    global_params=global_params,
    local=LOCAL,
    description="FedAvg with a FedOpt server optimiser (--server-opt sgd|momentum|adam|adagrad|yogi).",
)
