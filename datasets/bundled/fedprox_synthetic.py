"""FedProx synthetic(alpha, beta): 30 users, 60 features, 10 classes, heavy-tailed sizes.

Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith. Federated Optimization in Heterogeneous
Networks. MLSys 2020. arXiv:1812.06127, §5.1 and `data/synthetic_*/generate_synthetic.py`
(reference/reference_code.md §6.5). For user k:

    n_k = int(LogNormal(4, 2)) + 50
    u_k ~ N(0, alpha^2),  B_k ~ N(0, beta^2)      (numpy scale = alpha, beta: std devs)
    W_k ~ N(u_k, 1)^{60x10},  b_k ~ N(u_k, 1)^{10},  v_k ~ N(B_k, 1)^{60}
    x ~ N(v_k, Sigma), Sigma = diag(j^-1.2), j = 1..60;   y = argmax(x W_k + b_k)

The IID variant (`generate_iid.py`) uses v_k = 0 and one global W, b ~ N(0, 1). Each
user's samples are shuffled and split 90 / 10 into train / test (int(0.9 n_k) train).
Model: multinomial logistic regression (610 parameters), as in the paper. There is no
closed-form optimum, so no dist_to_opt.

Deviations: Code: unseeded global numpy RNG (its committed JSON is canonical). Here: every
draw comes from np.random.default_rng(TaskOptions.seed), so the data is reproducible per seed
but not identical to the committed JSON. x is drawn as v_k + sqrt(diag(Sigma)) * N(0, I),
the same law as numpy's multivariate_normal for a diagonal covariance.
"""

from __future__ import annotations

from types import MappingProxyType

import numpy as np
import torch

from fedcli.datasets import models
from fedcli.datasets.sources import consecutive
from fedcli.datasets.tasks import Task, TaskData, TaskOptions, fingerprint

NUM_USERS, DIM, NUM_CLASSES = 30, 60, 10


def generate_synthetic(
    *, alpha: float, beta: float, iid: bool, rng: np.random.Generator, num_users: int = NUM_USERS
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Return per-user features [n_k, 60] float64 and argmax labels [n_k] (FedProx §5.1)."""
    sizes = rng.lognormal(4, 2, num_users).astype(int) + 50
    mean_w = rng.normal(0, alpha, num_users)  # u_k, shared by W_k and b_k
    mean_x_shift = rng.normal(0, beta, num_users)  # B_k
    scale = np.arange(1, DIM + 1) ** -0.6  # sqrt(j^-1.2)
    mean_x = np.zeros((num_users, DIM)) if iid else rng.normal(mean_x_shift[:, None], 1.0, (num_users, DIM))
    w_global, b_global = rng.normal(0, 1, (DIM, NUM_CLASSES)), rng.normal(0, 1, NUM_CLASSES)
    xs, ys = [], []
    for k in range(num_users):
        w = w_global if iid else rng.normal(mean_w[k], 1, (DIM, NUM_CLASSES))
        b = b_global if iid else rng.normal(mean_w[k], 1, NUM_CLASSES)
        x = mean_x[k] + scale * rng.normal(size=(sizes[k], DIM))
        xs.append(x)
        ys.append(np.argmax(x @ w + b, axis=1))
    return xs, ys


def _loader(alpha: float, beta: float, iid: bool):  # noqa: ANN202 - returns a Task.load
    def load(options: TaskOptions) -> TaskData:
        rng = np.random.default_rng(options.seed)
        xs, ys = generate_synthetic(alpha=alpha, beta=beta, iid=iid, rng=rng)
        parts: list[tuple[np.ndarray, ...]] = []  # (train x, train y, test x, test y) per user
        for x, y in zip(xs, ys, strict=True):
            order = rng.permutation(len(y))
            cut = int(0.9 * len(y))
            parts.append((x[order[:cut]], y[order[:cut]], x[order[cut:]], y[order[cut:]]))
        train_x, train_y, test_x, test_y = zip(*parts, strict=True)
        xt = torch.as_tensor(np.concatenate(train_x), dtype=torch.float32)
        yt = torch.as_tensor(np.concatenate(train_y), dtype=torch.int64)
        return TaskData(
            x=xt,
            y=yt,
            client_indices=consecutive([len(y) for y in train_y]),
            client_names=[f"f_{k:05d}" for k in range(len(xs))],
            test_x=torch.as_tensor(np.concatenate(test_x), dtype=torch.float32),
            test_y=torch.as_tensor(np.concatenate(test_y), dtype=torch.int64),
            fingerprint=fingerprint(xt, yt),
            num_classes=NUM_CLASSES,
            test_client_indices=consecutive([len(y) for y in test_y]),
        )

    return load


# The default train.client_lr (docs/out-of-the-box.md, "The synthetic tasks' client lr"). The
# paper's 0.01 goes with E = 20 local epochs of batch 10 (§5.1); at fedcli's E = 1, batch 20 FedAvg
# reached 43.6 % on synthetic-iid in 25 rounds (2x the majority class is 69.9 %). Measured grid
# (FedAvg, 25 rounds, seeds 0 and 1): IID features have small norms (v_k = 0, Sigma_jj = j^-1.2) and
# learn best at 0.5-1 (0.5: 72.4 %); the shifted ones (v_k ~ N(B_k, 1)) peak at 0.1.
CLIENT_LR_IID = 0.5
CLIENT_LR_SHIFTED = 0.1


def _task(name: str, alpha: float, beta: float, iid: bool) -> Task:
    label = "IID" if iid else f"alpha={alpha}, beta={beta}"
    return Task(
        client_lr=CLIENT_LR_IID if iid else CLIENT_LR_SHIFTED,
        name=name,
        description=f"FedProx synthetic ({label}): 30 users, 60 features, 10 classes, log-normal sizes",
        source="generated from --seed (FedProx generate_synthetic.py)",
        offline=True,
        kind="classification",
        models=MappingProxyType({"logreg": lambda: models.Linear(DIM, NUM_CLASSES)}),
        default_model="logreg",
        load=_loader(alpha, beta, iid),
    )


TASKS = (
    _task("synthetic-0-0", 0.0, 0.0, False),
    _task("synthetic-0.5-0.5", 0.5, 0.5, False),
    _task("synthetic-1-1", 1.0, 1.0, False),
    _task("synthetic-iid", 0.0, 0.0, True),
)
