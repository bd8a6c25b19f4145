"""Tasks: data + model factory + loss + metrics, the unit `fedcli train --task` names.

A `Task` is a record of plain functions (no I/O at import). `TASKS` is the read-only
registry; `fedcli list tasks` prints it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import numpy as np
import torch
from torch import Tensor, nn

from fedcli.datasets import models


@dataclass(frozen=True)
class TaskOptions:
    """What a task's loader may depend on."""

    seed: int = 0  # synthetic generators draw from this seed
    data_dir: Path | None = None  # None = the bundled/default copy


@dataclass(frozen=True)
class TaskData:
    """A task's examples as tensors (CPU) plus the natural client index."""

    x: Tensor  # [N, ...] stored form (uint8 images or float features)
    y: Tensor  # [N] labels / targets
    client_indices: list[np.ndarray]  # natural partition: client k -> example indices
    client_names: list[str]
    test_x: Tensor
    test_y: Tensor
    optimum: Tensor | None = None  # [D] flattened exact optimum where known (dist_to_opt)
    fingerprint: str = ""  # sha256 over the training tensors (partition files check it)


@dataclass(frozen=True)
class Task:
    """One named task."""

    name: str
    description: str
    source: str
    offline: bool  # True when the default data ships with fedcli
    kind: str  # "classification" | "regression"
    models: Mapping[str, Callable[[], nn.Module]]
    default_model: str
    load: Callable[[TaskOptions], TaskData]
    prepare: Callable[[Tensor], Tensor] = field(default=lambda x: x)  # stored x -> model input
    # Optional per-example loss (output, x, y) -> [B]; None = by `kind` (see per_example_loss).
    # Lets e.g. linear stochastic approximation tasks define a surrogate whose gradient is the
    # LSA direction A_i theta - b_i.
    example_loss: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None


def fingerprint(*tensors: Tensor) -> str:
    """Return a sha256 hex digest of the tensors' bytes and shapes."""
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(str(tuple(t.shape)).encode())
        digest.update(t.contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def per_example_loss(task: Task, output: Tensor, x: Tensor, y: Tensor) -> Tensor:
    """Return the per-example loss [B]: task.example_loss, else cross-entropy / 1/2 squared error."""
    if task.example_loss is not None:
        return task.example_loss(output, x, y)
    if task.kind == "regression":
        return 0.5 * (output - y) ** 2
    return torch.nn.functional.cross_entropy(output, y, reduction="none")


# --- femnist ---------------------------------------------------------------------------


def _load_femnist(options: TaskOptions) -> TaskData:
    from fedcli.datasets.femnist import BUNDLED_DIR, load_femnist

    arrays = load_femnist(options.data_dir or BUNDLED_DIR)
    x, y = torch.from_numpy(arrays.train_x), torch.from_numpy(arrays.train_y)
    indices = [np.flatnonzero(arrays.train_writer == k) for k in range(len(arrays.writers))]
    return TaskData(x=x, y=y, client_indices=indices, client_names=arrays.writers,
                    test_x=torch.from_numpy(arrays.test_x), test_y=torch.from_numpy(arrays.test_y),
                    fingerprint=fingerprint(x, y))


def _images(x: Tensor) -> Tensor:
    """uint8 [..., 28, 28] -> float32 [..., 1, 28, 28] in [0, 1]."""
    return (x.to(torch.float32) / 255.0).unsqueeze(-3)


FEMNIST = Task(
    name="femnist",
    description="LEAF FEMNIST, 62 classes, natural partition by writer (bundled: 105 writers)",
    source="bundled LEAF sample (datasets/data/femnist); full LEAF via --data-dir",
    offline=True,
    kind="classification",
    models=MappingProxyType({
        "mlp": lambda: models.MLP(784, (200, 200), 62),
        "cnn": lambda: models.ReddiCNN(62),
    }),
    default_model="mlp",
    load=_load_femnist,
    prepare=_images,
)


# --- synthetic least squares -------------------------------------------------------------


def _load_lsq(options: TaskOptions) -> TaskData:
    from fedcli.datasets.synthetic import make_least_squares

    rng = np.random.default_rng(options.seed)
    data = make_least_squares(num_clients=20, dim=10, mean_size=50, heterogeneity=1.0,
                              noise=0.1, rng=rng)
    x = torch.as_tensor(data.x, dtype=torch.float32)
    y = torch.as_tensor(data.y, dtype=torch.float32)
    indices = [np.flatnonzero(data.client == k) for k in range(20)]
    return TaskData(x=x, y=y, client_indices=indices, client_names=[f"client{k}" for k in range(20)],
                    test_x=torch.as_tensor(data.test_x, dtype=torch.float32),
                    test_y=torch.as_tensor(data.test_y, dtype=torch.float32),
                    optimum=torch.as_tensor(data.optimum, dtype=torch.float32),
                    fingerprint=fingerprint(x, y))


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


TASKS: Mapping[str, Task] = MappingProxyType({t.name: t for t in (FEMNIST, LEAST_SQUARES)})
