"""SCAFFOLD: stochastic controlled averaging (control variates against client drift).

Karimireddy, Kale, Mohri, Reddi, Stich, Suresh. SCAFFOLD: Stochastic Controlled Averaging
for Federated Learning. ICML 2020 (PMLR 119, pp. 5132-5143). arXiv:1910.06378.

Implements: Alg. 1 (client lines 7-13): K local steps y_i <- y_i - eta_l (g_i(y_i) - c_i + c),
declared as local SGD with the linear correction c - c_i -> local_request; then -> finish:
the control-variate update
  Option I   c_i+ = g_i(x)                               (a pass over the local data at x)
  Option II  c_i+ = c_i - c + (x - y_i) / (K eta_l)      (free: reuses the local steps)
and uploads (Delta y_i, Delta c_i) = (y_i - x, c_i+ - c_i); Alg. 1 (server lines 16-17)
-> server_update: x <- x + eta_g mean(Delta y_i) (here: any FedOpt server step on the
pseudo-gradient x - y_i; sgd with server_lr = eta_g is the paper), c <- c + |S|/N mean(Delta c_i).
Notation: x -> params, c -> broadcast control, c_i -> client state `control`, K -> real
local steps of the client (E epochs x ceil(n_i / B)), eta_l -> opt.client_lr,
eta_g -> opt.server_lr, q_i -> aggregation weights (hp.weighting).
Deviations:
  Paper: c = (1/N) sum_i c_i over ALL N clients (unvisited c_i = 0), updated with |S|/N;
  the algorithm contract does not tell an algorithm N. Here (default, hp.num_clients = 0):
  c = the q-weighted mean of c_i over the clients visited so far (the server counts first
  visits); this equals the paper's c from the first round under full participation and
  once every client has been visited. hp.num_clients = N > 0 with weighting "uniform" is
  the paper's rule exactly.
  Paper: uniform 1/|S| averaging. Here: hp.weighting "examples" (default; q_i = n_i, as
  this toolkit's FedAvg, so that Scaffold with one local step IS FedAvg-SGD under full
  participation and its first round equals FedAvg's) or "uniform" (the paper).
  Option I uses one pass over the client's data in its first-epoch batches (the paper:
  "possibly over a larger batch"); it costs K extra gradient evaluations.
  Client momentum (not in the paper) applies to the corrected gradient g - c_i + c.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from fedcli.algorithms import fedavg
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
    UploadSums,
    require,
    tree_norm,
    tree_sub,
    tree_zeros_like,
)
from fedcli.algorithms.optim import LocalResult, local_update, server_opt_init


@dataclass(frozen=True, kw_only=True)
class ScaffoldConfig:
    option: str = (
        "II"  # control-variate update of Alg. 1 line 12; §4: option II "cheaper and usually suffices"
    )
    weighting: str = "examples"  # q_i: "examples" (n_i, as fedavg) | "uniform" (Alg. 1, 1/|S|)
    num_clients: int = 0  # N of Alg. 1 line 17 (c += |S|/N mean Delta c); 0 = mean over visited clients

    def __post_init__(self) -> None:
        require(self.option in ("I", "II"), "hp.option", "'I' or 'II'", self.option)
        require(
            self.weighting in ("examples", "uniform"),
            "hp.weighting",
            "'examples' or 'uniform'",
            self.weighting,
        )
        require(self.num_clients >= 0, "hp.num_clients", ">= 0", self.num_clients)
        require(
            self.num_clients == 0 or self.weighting == "uniform",
            "hp.num_clients",
            "0 unless hp.weighting='uniform'",
            self.num_clients,
            "The paper's |S|/N rule averages control variates uniformly; set --hp weighting=uniform.",
        )


class ServerState(NamedTuple):
    params: Params  # x
    opt_state: ServerOptState  # server optimiser moments
    control_sum: Params  # sum over visited clients of q_i c_i
    visited_weight: Tensor  # [] sum over visited clients of q_i (the denominator of c)


class Broadcast(NamedTuple):
    params: Params  # x
    control: Params  # c


class ClientState(NamedTuple):
    control: Params  # c_i (0 before the first visit)
    visited: Tensor  # [] 1.0 once the client has taken part


def server_init(params: Params, hp: ScaffoldConfig, opt: OptimConfig) -> ServerState:
    """Return x_0 with c = 0 and no visited clients."""
    zero = torch.zeros((), dtype=next(iter(params.values())).dtype)
    return ServerState(dict(params), server_opt_init(params), tree_zeros_like(params), zero)


def init_client_state(params: Params, hp: ScaffoldConfig) -> ClientState:
    """Return c_i = 0 (Alg. 1 initialises every control variate at zero)."""
    return ClientState(control=tree_zeros_like(params), visited=torch.zeros(()))


def broadcast(state: ServerState, hp: ScaffoldConfig) -> Broadcast:
    """Return (x, c) with c = control_sum / (N or the visited weight)."""
    denominator = hp.num_clients if hp.num_clients > 0 else state.visited_weight.clamp_min(1e-30)
    return Broadcast(params=state.params, control={k: v / denominator for k, v in state.control_sum.items()})


def full_local_gradient(ctx: ClientContext, params: Params) -> Params:
    """Return grad f_i(params) over one pass of the client's data (the first epoch's batches)."""
    grad = torch.func.grad(ctx.loss_fn)
    total = tree_zeros_like(params)
    count = torch.zeros((), dtype=ctx.step_mask.dtype, device=ctx.step_mask.device)
    for step in range(ctx.steps_per_epoch):
        batch = ctx.batch(step)
        size = ctx.step_mask[step] * batch.weight.sum()  # examples in this batch, 0 if masked
        g = grad(params, batch)  # mean over the batch
        total = {k: total[k] + size * g[k] for k in total}
        count = count + size
    return {k: v / count.clamp_min(1.0) for k, v in total.items()}


def local_request(
    ctx: ClientContext, bc: Broadcast, client_state: ClientState, hp: ScaffoldConfig, opt: OptimConfig
) -> LocalSGD:
    """K local steps y_i <- y_i - eta_l (g_i(y_i) + c - c_i) from x (Alg. 1 line 10): a linear correction."""
    return LocalSGD(start=bc.params, linear=tree_sub(bc.control, client_state.control))  # c - c_i


def finish(
    ctx: ClientContext,
    bc: Broadcast,
    client_state: ClientState,
    hp: ScaffoldConfig,
    opt: OptimConfig,
    local: LocalResult,
) -> ClientOut:
    """Update c_i by option I or II; upload (x - y_i, Delta c_i)."""
    delta = tree_sub(bc.params, local.params)  # x - y_i (old minus new)
    if hp.option == "I":
        new_control = full_local_gradient(ctx, bc.params)
    else:
        steps = ctx.step_mask.sum().clamp_min(1.0)  # K_i, the client's real local steps
        new_control = {
            k: client_state.control[k] - bc.control[k] + delta[k] / (steps.to(v.dtype) * opt.client_lr)
            for k, v in delta.items()
        }
    upload = {
        "delta": delta,
        "delta_control": tree_sub(new_control, client_state.control),
        "first_visit": 1.0 - client_state.visited,
    }
    state = ClientState(control=new_control, visited=torch.ones_like(client_state.visited))
    metrics = {"train_loss": local.mean_loss, "control_norm": tree_norm(new_control)}
    return ClientOut(upload=upload, state=state, metrics=metrics)


LOCAL = Local(request=local_request, finish=finish)
client_update = local_update(LOCAL)


def upload_sums(
    upload: dict[str, Params | Tensor], weights: Tensor, bc: Broadcast, hp: ScaffoldConfig
) -> dict[str, Params | Tensor]:
    """Algorithm.upload_sums: what server_update reads of a group's uploads [G, ...], summed over the group:
    Sum q_i (x - y_i), Sum q_i Delta c_i, Sum q_i first_visit_i and Sum q_i.

    Summed over the groups of a cohort it equals the cohort's up to float rounding (summation order), so a
    streamed round never holds the cohort's [C, P] uploads (two models per client; docs/scaling.md, "Client
    state").
    """
    q = weights if hp.weighting == "examples" else torch.ones_like(weights)  # q_i: n_i or 1 ("uniform") [C]
    delta, delta_control, first = upload["delta"], upload["delta_control"], upload["first_visit"]
    assert isinstance(delta, dict) and isinstance(delta_control, dict) and isinstance(first, Tensor)
    return {
        "delta": {k: torch.tensordot(q.to(v.dtype), v, dims=([0], [0])) for k, v in delta.items()},
        "delta_control": {
            k: torch.tensordot(q.to(v.dtype), v, dims=([0], [0])) for k, v in delta_control.items()
        },
        "first_visit": (q.to(first.dtype) * first).sum(),
        "weight": q.sum(),
    }


def server_update(
    state: ServerState, outs: ClientOut, weights: Tensor, hp: ScaffoldConfig, opt: OptimConfig
) -> tuple[ServerState, Diagnostics]:
    """x <- server step on mean_q(x - y_i); sum_q c += sum_i q_i Delta c_i (Alg. 1 lines 16-17).

    outs.upload: the cohort's stacked uploads [C, ...], or an UploadSums the engine summed a group at a time
    (upload_sums); stacked uploads are summed by upload_sums here, the same arithmetic as fedavg's weighted mean.
    """
    if isinstance(outs.upload, UploadSums):
        sums = outs.upload.sums
    else:  # the cohort's stacked uploads [C, ...]
        sums = upload_sums(outs.upload, weights, broadcast(state, hp), hp)
    total = sums["weight"]
    mean = {k: v / total.to(v.dtype) for k, v in sums["delta"].items()}
    server = fedavg.ServerState(state.params, state.opt_state)
    moved, diagnostics = fedavg.step_on_pseudo_gradient(server, mean, opt)
    control_sum = {k: v + sums["delta_control"][k] for k, v in state.control_sum.items()}
    visited_weight = state.visited_weight + sums["first_visit"].to(state.visited_weight.dtype)
    new_state = ServerState(moved.params, moved.opt_state, control_sum, visited_weight)
    diagnostics["scaffold/server_control_norm"] = tree_norm(broadcast(new_state, hp).control)
    return new_state, diagnostics


ALGORITHM = Algorithm(
    name="scaffold",
    paper="Karimireddy, Kale, Mohri, Reddi, Stich, Suresh. SCAFFOLD. ICML 2020. arXiv:1910.06378",
    config_cls=ScaffoldConfig,
    server_init=server_init,
    broadcast=broadcast,
    client_update=client_update,
    server_update=server_update,
    global_params=fedavg.global_params,
    init_client_state=init_client_state,
    local=LOCAL,
    upload_sums=upload_sums,
    description="Control variates c_i, c correct client drift (options I/II of Alg. 1).",
)
