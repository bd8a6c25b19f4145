"""The FedPA toy: two clients with 2-D quadratic objectives and a known global optimum.

Al-Shedivat, Gillenwater, Xing, Rostamizadeh. Federated Learning via Posterior Averaging.
ICLR 2021. arXiv:2010.05273, Fig. 1 ("a toy 2D setting with two clients and quadratic
objectives"; reference/fedpa.md §3.1, §3.5). The paper does not give the quadratics; as
in the FedPA JAX `create_random_quadratics` defaults, client i has
f_i(theta) = 1/2 theta^T A_i theta - b_i^T theta with A_i SPD, eigenvalues ~ U[1, 10],
random eigenvectors, and b_i ~ 10 N(0, I); its optimum is mu_i = A_i^-1 b_i.

Each quadratic is written as least squares so the engine's regression path trains it:
with A_i = L L^T, client i holds r_i copies of the rows X0 = sqrt(2) L^T and y = X mu_i, so
its mean loss 1/(2 n_i) ||X theta - y||^2 = f_i(theta) + const with n_i = 2 r_i. Client sizes
are n = (2, 6), so the example-weighted global objective sum_i n_i f_i has the optimum
theta* = (sum_i n_i A_i)^-1 sum_i n_i A_i mu_i (logged as eval/dist_to_opt). The test set is
the training set, so eval/loss is the global objective up to a constant.
"""

from __future__ import annotations

from types import MappingProxyType

import numpy as np
import torch

from fedcli.datasets import models
from fedcli.datasets.sources import consecutive
from fedcli.datasets.tasks import Task, TaskData, TaskOptions, fingerprint

DIM = 2
COPIES = (1, 3)  # r_i: client sizes n_i = 2 r_i = (2, 6), unequal so weighting matters


def random_quadratic(dim: int, *, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Return (A, mu): A SPD with eigenvalues ~ U[1, 10], mu = A^-1 b with b ~ 10 N(0, I)."""
    q, _ = np.linalg.qr(rng.normal(size=(dim, dim)))
    a = q @ np.diag(rng.uniform(1.0, 10.0, dim)) @ q.T
    return a, np.linalg.solve(a, 10.0 * rng.normal(size=dim))


def quadratic_clients(
    *, copies: tuple[int, ...], dim: int, rng: np.random.Generator
) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """Least-squares rows per client, the global optimum, and each client's (A_i, mu_i)."""
    xs, ys, precisions, optima = [], [], [], []
    for r in copies:
        a, mu = random_quadratic(dim, rng=rng)
        rows = np.sqrt(dim) * np.linalg.cholesky(a).T  # X0^T X0 / dim = A
        x = np.tile(rows, (r, 1))
        xs.append(x)
        ys.append(x @ mu)
        precisions.append(a)
        optima.append(mu)
    weights = [len(x) for x in xs]
    pooled = sum(w * a for w, a in zip(weights, precisions, strict=True))
    optimum = np.linalg.solve(
        pooled, sum(w * a @ mu for w, a, mu in zip(weights, precisions, optima, strict=True))
    )
    return xs, ys, optimum, precisions, optima


def _load(options: TaskOptions) -> TaskData:
    xs, ys, optimum, _, _ = quadratic_clients(copies=COPIES, dim=DIM, rng=np.random.default_rng(options.seed))
    x = torch.as_tensor(np.concatenate(xs), dtype=torch.float32)
    y = torch.as_tensor(np.concatenate(ys), dtype=torch.float32)
    clients = consecutive([len(v) for v in ys])
    return TaskData(
        x=x,
        y=y,
        client_indices=clients,
        client_names=[f"client{i}" for i in range(len(xs))],
        test_x=x.clone(),
        test_y=y.clone(),
        optimum=torch.as_tensor(optimum, dtype=torch.float32),
        fingerprint=fingerprint(x, y),
        test_client_indices=clients,
    )


QUADRATIC_2D = Task(
    name="quadratic-2d",
    description="FedPA Fig. 1 toy: 2 clients, 2-D quadratics (as least squares), exact optimum known",
    source="generated from --seed",
    offline=True,
    kind="regression",
    models=MappingProxyType({"linear": lambda: models.Linear(DIM, 1, bias=False, squeeze=True)}),
    default_model="linear",
    load=_load,
)

TASKS = (QUADRATIC_2D,)
