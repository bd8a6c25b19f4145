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
    OptimConfig,
    Params,
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


def client_update(ctx: ClientContext, bc: fola.Broadcast, client_state: None, hp: FOLAOfflineConfig,
                  opt: OptimConfig) -> ClientOut:
    """Local training from mu_S, then upload (mu_n, offline Fisher at mu_n)."""
    spec = hp.spec()
    fit = fola.local_train(ctx, bc, spec, opt)
    fit = fit._replace(fisher=offline_fisher(ctx, fit.params, spec))
    return fola.make_out(fit, fit.fisher, spec)


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
    check_model=lambda model, hp, vmap_obstacle: fola.per_sample_obstacle(model, hp, vmap_obstacle, name="fola-offline"),
    posterior=fola.posterior,
    description="FOLA with the Fisher taken once at the end of local training (no online accumulation).",
)
