"""Synthetic federated least squares with a known global optimum (FedPA App. A).

Client i holds X_i [n_i, D+1] (features plus an appended ones column, as the FedPA JAX
code does) and y_i = X_i w_i + noise, where each client has its own feature mean and its
own true weights w_i = w + heterogeneity * N(0, I): the local optima mu_i differ, so
FedAvg with many local steps is biased (FedPA §3, Fig. 1).

With the mean loss f_i(theta) = 1/(2 n_i) ||X_i theta - y_i||^2 and q_i = n_i, the global
optimum of F = sum_i q_i f_i / sum_i q_i is the pooled least-squares solution
theta* = (sum_i X_i^T X_i)^-1 sum_i X_i^T y_i = (sum q_i A_i)^-1 sum q_i A_i mu_i with
A_i = X_i^T X_i / n_i (FedPA Eq. 3, pairing (b) of the reference, §1.3).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import numpy as np
import torch

from fedcli.datasets import models
from fedcli.datasets.tasks import Task, TaskData, TaskOptions, fingerprint


@dataclass(frozen=True)
class LeastSquaresData:
    x: np.ndarray  # [N, D+1] float64, last column = 1
    y: np.ndarray  # [N] float64
    client: np.ndarray  # [N] client id of each example
    test_x: np.ndarray
    test_y: np.ndarray
    optimum: np.ndarray  # [D+1] theta*, the exact minimiser of the pooled mean loss


def make_least_squares(
    *,
    num_clients: int,
    dim: int,
    mean_size: int,
    heterogeneity: float,
    noise: float,
    rng: np.random.Generator,
) -> LeastSquaresData:
    """Generate heterogeneous least-squares clients and the exact global optimum."""
    sizes = np.maximum(dim + 2, rng.lognormal(np.log(mean_size), 0.5, size=num_clients).astype(int))
    w = rng.normal(size=dim + 1)
    xs, ys, owners = [], [], []
    for client in range(num_clients):
        shift = rng.normal(scale=1.0, size=dim)
        scale = rng.uniform(0.5, 2.0, size=dim)
        features = rng.normal(size=(sizes[client], dim)) * scale + shift
        x = np.hstack([features, np.ones((sizes[client], 1))])
        w_client = w + heterogeneity * rng.normal(size=dim + 1)
        xs.append(x)
        ys.append(x @ w_client + noise * rng.normal(size=sizes[client]))
        owners.append(np.full(sizes[client], client))
    x_all, y_all = np.vstack(xs), np.concatenate(ys)
    optimum = np.linalg.solve(x_all.T @ x_all, x_all.T @ y_all)
    test_idx = rng.choice(len(y_all), size=min(len(y_all), 1000), replace=False)
    return LeastSquaresData(x_all, y_all, np.concatenate(owners), x_all[test_idx], y_all[test_idx], optimum)


def _load_lsq(options: TaskOptions) -> TaskData:
    data = make_least_squares(
        num_clients=20,
        dim=10,
        mean_size=50,
        heterogeneity=1.0,
        noise=0.1,
        rng=np.random.default_rng(options.seed),
    )
    x = torch.as_tensor(data.x, dtype=torch.float32)
    y = torch.as_tensor(data.y, dtype=torch.float32)
    return TaskData(
        x=x,
        y=y,
        client_indices=[np.flatnonzero(data.client == k) for k in range(20)],
        client_names=[f"client{k}" for k in range(20)],
        test_x=torch.as_tensor(data.test_x, dtype=torch.float32),
        test_y=torch.as_tensor(data.test_y, dtype=torch.float32),
        optimum=torch.as_tensor(data.optimum, dtype=torch.float32),
        fingerprint=fingerprint(x, y),
    )


LEAST_SQUARES = Task(
    name="lsq",
    description="synthetic federated least squares (FedPA App. A): 20 heterogeneous clients, d=11",
    source="generated from --seed",
    offline=True,
    kind="regression",
    models=MappingProxyType({"linear": lambda: models.Linear(11, 1, bias=False, squeeze=True)}),
    default_model="linear",
    load=_load_lsq,
)

TASKS = (LEAST_SQUARES,)
