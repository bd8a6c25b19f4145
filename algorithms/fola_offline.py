"""FOLA-offline: the offline Laplace baseline of the FOLA paper (Fisher once, after training).

Liu, Zheng. A Bayesian Federated Learning Framework with Multivariate Gaussian Product.
arXiv:2102.01936 (2021), Sec. 3.4 and Fig. 3 ("the offline method used in Kirkpatrick et
al. [2017], Shoham et al. [2019]"); code: cnn_lab/cnn_offline.py.

Implements: local training as FOLA (fola.local_train, without the online accumulation);
then the offline diagonal empirical Fisher, Eq. 14 at the final local iterate theta*, from
one extra pass over D_n -> offline_fisher; P_n = that Fisher, no Eq. 17 prior accumulation
-> client_update; the product aggregation of Eq. 9 -> fola.server_update.
Notation: as fola.py; F_n(theta*) -> the uploaded precision.
Deviations:
  Paper: no details beyond "offline". Code: reset the Fisher, one pass with batch_sq /
  sum_weighted Fisher, prior lam 0.5/r Omega_S with Omega_S the aggregated offline Fisher.
  Here: the same switches as fola with fola's defaults (per-sample Eq. 14, prior lam/2 P_S),
  so that fola vs fola-offline isolates online vs offline curvature; prior_form="code" gives
  the code's 0.5/r. The extra pass reuses the round's first-epoch minibatches (the code draws
  a fresh loader over D_n).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedcli.algorithms import fola
from fedcli.algorithms.base import (
    Algorithm,
    ClientContext,
    ClientOut,
    Degeneracy,
    OptimConfig,
    Params,
    RunFacts,
    tree_scale,
    tree_zeros_like,
)


@dataclass(frozen=True, kw_only=True)
class FOLAOfflineConfig(fola.FOLAConfig):
    """fola's hyperparameters and defaults (see FOLAConfig); only the Fisher timing differs."""

    def spec(self) -> fola.Spec:
        return super().spec()._replace(offline=True)


def offline_fisher(ctx: ClientContext, params: Params, spec: fola.Spec) -> Params:
    """Eq. 14 at theta = params: one pass over D_n (the first epoch's minibatches)."""
    grad_fn = torch.func.grad(ctx.loss_fn)
    fisher = tree_zeros_like(params)
    for step in range(ctx.steps_per_epoch):
        mask, batch = ctx.step_mask[step], ctx.batch(step)
        inc = fola.fisher_increment(ctx, params, batch, grad_fn(params, batch), spec.fisher)
        scale = mask * fola.step_weight(ctx, batch, spec.fisher_norm)
        fisher = {k: fisher[k] + scale * inc[k] for k in fisher}
    if spec.fisher_norm == "mean":
        fisher = tree_scale(fisher, 1.0 / ctx.step_mask[: ctx.steps_per_epoch].sum().clamp_min(1.0))
    return fisher


def client_update(
    ctx: ClientContext, bc: fola.Broadcast, client_state: None, hp: FOLAOfflineConfig, opt: OptimConfig
) -> ClientOut:
    """Local training from mu_S, then upload (mu_n, offline Fisher at mu_n)."""
    spec = hp.spec()
    fit = fola.local_train(ctx, bc, spec, opt)
    fit = fit._replace(fisher=offline_fisher(ctx, fit.params, spec))
    return fola.make_out(fit, fit.fisher, spec)


# The tasks where the 25-round, two-seed matrix (docs/out-of-the-box.md, "Known shortfalls") measured
# fola-offline below FedAvg - 3 points at the defaults: eval accuracy, fola-offline vs fedcurv vs FedAvg (%).
# fedcurv runs the same offline Fisher and prior with FedAvg's mean, so the gap is the product mean's.
SHORTFALLS = {
    "femnist": "40.3 vs fedcurv 47.5, FedAvg 47.5",
    "synthetic-0-0": "73.3 vs fedcurv 76.2, FedAvg 76.4",
    "synthetic-0.5-0.5": "58.9 vs fedcurv 68.9, FedAvg 71.3",
    "synthetic-1-1": "54.6 vs fedcurv 74.0, FedAvg 74.3",
}


def degenerate(hp: FOLAOfflineConfig, opt: OptimConfig, run: RunFacts) -> list[Degeneracy]:
    """A known shortfall (not a degeneracy): the paper's own finding for this ablation (Sec. 4.3, Fig. 3:
    the offline curves "vary dramatically"). The Fisher at the local optimum theta* is small on the
    coordinates a client fits well (its per-example gradients vanish there) and large where it fits
    badly, so the product mean sum a_n P_n mu_n / P_S leans on the clients that fit a coordinate worst;
    on heterogeneous tasks that costs accuracy. Measured where SHORTFALLS says; elsewhere (mnist, har,
    vehicle, synthetic-iid) it met FedAvg."""
    measured = SHORTFALLS.get(run.task)
    if measured is None:
        return []
    return [
        Degeneracy(
            "fola-offline:offline-product",
            f"the paper's offline-Laplace ablation (Sec. 4.3, Fig. 3): "
            "its product mean weights each client by the Fisher at its local optimum, small where the "
            f"client fits well, which on {run.task} cost accuracy at 25 rounds ({measured} %); run "
            "fola (online Fisher) for the method, fedcurv for the offline Fisher with FedAvg's mean.",
            kind="shortfall",
        )
    ]


ALGORITHM = Algorithm(
    name="fola-offline",
    paper="Liu, Zheng. arXiv:2102.01936 (2021), offline-Laplace baseline (Fig. 3; code cnn_offline.py)",
    config_cls=FOLAOfflineConfig,
    server_init=fola.server_init,
    broadcast=fola.broadcast,
    client_update=client_update,
    server_update=fola.server_update,
    global_params=fola.global_params,
    round_key=fola.prior_round,
    check_model=lambda model, hp, vmap_obstacle: fola.per_sample_obstacle(
        model, hp, vmap_obstacle, name="fola-offline"
    ),
    posterior=fola.posterior,
    degenerate=degenerate,
    caveats=(
        "The paper's offline-Laplace ablation: on heterogeneous tasks its product mean, weighted by the Fisher "
        "at each client's local optimum, trails FedAvg (FEMNIST 40.3 vs 47.5 %, synthetic-1-1 54.6 vs 74.3 % "
        "at 25 rounds); a warning says so before such a run starts."
    ),
    description="FOLA with the Fisher taken once at the end of local training (no online accumulation).",
)
