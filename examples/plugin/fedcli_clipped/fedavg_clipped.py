"""FedAvg-clipped: FedAvg whose client updates are clipped to an L2 norm S before averaging.

McMahan, Ramage, Talwar, Zhang. Learning Differentially Private Recurrent Language Models.
ICLR 2018. arXiv:1710.06963 (Alg. 1, flat clipping).
Implements: the flat clipping of Alg. 1, ClipFn(Delta, S) = Delta * min(1, S / ||Delta||)
-> clip; the client's local SGD -> declared as FedAvg's (fedavg.local_request, Algorithm.local),
then finish (the clipped upload); the server step -> fedavg's server_update (weighted mean of the clipped deltas, then the --server-opt step).
Notation: Delta_k = x_t - x_k (old minus new) -> upload["delta"], S -> hp.clip_norm,
x_t -> bc.params.
Deviations:
  Paper: users sampled with probability q, a fixed-denominator weighted average and
  Gaussian noise of scale z S (the differential-privacy guarantee).
  Here: clipping only: uniform cohort sampling, fedavg's n_k-weighted mean, no noise, so no
  privacy guarantee; the example shows the plugin contract, not DP training.
"""

from __future__ import annotations  # the config layer reads the hyperparameter annotations as text

from dataclasses import dataclass

import torch
from torch import Tensor

from fedcli.algorithms import fedavg
from fedcli.algorithms.base import (
    Algorithm,
    ClientContext,
    ClientOut,
    Local,
    OptimConfig,
    Params,
    require,
    tree_norm,
    tree_scale,
    tree_sub,
)
from fedcli.algorithms.optim import LocalResult, local_update


@dataclass(frozen=True, kw_only=True)
class ClippedConfig:
    # S, the flat clipping bound on ||Delta_k|| (Alg. 1). The paper sweeps it per model, so it
    # has no universal default; 1.0 is this example's choice: pass --hp clip_norm=S.
    clip_norm: float = 1.0

    def __post_init__(self) -> None:
        require(self.clip_norm > 0, "hp.clip_norm", "> 0", self.clip_norm,
                "S bounds each client's update norm; try the median update norm of a FedAvg run.")


def clip(delta: Params, clip_norm: float) -> tuple[Params, Tensor]:
    """Return (Delta * min(1, S / ||Delta||), ||Delta||): flat clipping (Alg. 1 ClipFn).

    No Python branch on the norm, so it runs under torch.func.vmap; a zero update has an
    infinite ratio S / 0, which the min with 1 turns into the factor 1.
    """
    norm = tree_norm(delta)
    factor = torch.clamp(clip_norm / norm, max=1.0)
    return tree_scale(delta, factor), norm


def finish(ctx: ClientContext, bc: fedavg.Broadcast, client_state: None, hp: ClippedConfig, opt: OptimConfig,
           local: LocalResult) -> ClientOut:
    """Upload ClipFn(x_t - x_k, S) (old minus new, clipped) after FedAvg's local SGD from x_t."""
    delta, norm = clip(tree_sub(bc.params, local.params), hp.clip_norm)
    metrics = {"train_loss": local.mean_loss,
               "delta_norm": norm.detach(),  # ||Delta_k|| before clipping
               "clipped": (norm > hp.clip_norm).to(norm.dtype)}  # share of clients clipped, once averaged
    return ClientOut(upload={"delta": delta}, state=None, metrics=metrics)


# local training is FedAvg's plain local SGD from x_t, declared: every back end (fused included) trains it
LOCAL = Local(request=fedavg.local_request, finish=finish)
client_update = local_update(LOCAL)


ALGORITHM = Algorithm(
    name="fedavg-clipped",
    paper="McMahan, Ramage, Talwar, Zhang. ICLR 2018. arXiv:1710.06963 (flat clipping of Alg. 1, no noise)",
    config_cls=ClippedConfig,
    server_init=fedavg.server_init,
    broadcast=fedavg.broadcast,
    client_update=client_update,
    server_update=fedavg.server_update,
    global_params=fedavg.global_params,
    local=LOCAL,
    description="Example plugin: FedAvg with client updates clipped to L2 norm hp.clip_norm (no DP noise).",
)
