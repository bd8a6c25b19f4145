"""Tasks: data + model factory + loss + metrics, the unit `fedcli train --task` names.

A `Task` is a record of plain functions (no I/O at import). Each data module exports its
tasks as `TASKS: tuple[Task, ...]`; `fedcli.datasets.registry.TASKS` gathers them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class TaskOptions:
    """What a task's loader may depend on."""

    seed: int = 0  # synthetic generators draw from this seed
    data_dir: Path | None = None  # None = the bundled/default copy
    download: bool = False  # fetch missing public files into data_dir (needs a network); never implicit
    max_clients: int | None = None  # natural-client datasets: read only the first N clients in id order
    data_store: str = "auto"  # auto | memory | disk: big-file loaders (TFF h5) stream into a disk store (datasets/formats/diskstore.py)


@dataclass(frozen=True)
class TaskData:
    """A task's examples as tensors (CPU) plus the natural client index."""

    x: Tensor  # [N, ...] stored form (uint8 images or float features)
    y: Tensor  # [N] labels / targets
    # natural partition: client k -> example indices (a list, or a disk store's ClientIndex)
    client_indices: Sequence[np.ndarray]
    client_names: list[str]
    test_x: Tensor
    test_y: Tensor
    optimum: Tensor | None = None  # [D] flattened exact optimum where known (dist_to_opt)
    fingerprint: str = ""  # sha256 over the training tensors (partition files check it)
    num_classes: int | None = None  # classes (or tags / vocabulary) of y; None = not a class target
    # per-client test examples: client k -> indices into test_x (None = the task has none); `fedcli evaluate --per-client`
    test_client_indices: Sequence[np.ndarray] | None = None
    store: str | None = (
        None  # the disk store's folder when the tensors are its memory maps (datasets/formats/diskstore.py)
    )


@dataclass(frozen=True)
class Task:
    """One named task."""

    name: str
    description: str
    source: str
    offline: bool  # True when the default data ships with fedcli
    kind: str  # "classification" | "regression" | "multilabel" | "next_token" | "lsa"
    models: Mapping[str, Callable[[], nn.Module]]
    default_model: str
    load: Callable[[TaskOptions], TaskData]
    prepare: Callable[[Tensor], Tensor] = field(default=lambda x: x)  # stored x -> model input
    # Optional per-example loss (output, x, y) -> [B]; None = by `kind` (see per_example_loss).
    # Lets e.g. linear stochastic approximation tasks define a surrogate whose gradient is the
    # LSA direction A_i theta - b_i.
    example_loss: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None
    # Optional chunkable evaluation metrics (datasets.metrics.MetricFns); None = by `kind`.
    metrics: Any = None
    reads_max_clients: bool = (
        False  # True when `load` honours TaskOptions.max_clients (big natural-client data)
    )
    client_lr: float = 0.01  # the default train.client_lr (eta_l) on this task; tuned where the task says so
    # the number of clients where the task fixes it before any data is loaded (Garnet's N agents), so that an
    # algorithm's `recommend` can ask for full participation; None = known only after loading
    num_clients: int | None = None
    # partition keys (scheme, alpha, num_clients, ...) a run of this task gets when it names no scheme and no
    # partition file: for tasks without natural clients (docs/architecture.md §5); None = natural clients
    default_partition: Mapping[str, Any] | None = None
    default_partition_why: str = ""  # the source of default_partition, recorded with the run
    # facts recorded in the run's resolved config under data.* beside its name and fingerprint (e.g. the
    # source_sha256 of a `pkg.mod:fn` data reference; docs/your-data.md)
    record: Mapping[str, str] = field(default_factory=dict)


def fingerprint(*tensors: Tensor) -> str:
    """Return a sha256 hex digest of the tensors' bytes and shapes."""
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(str(tuple(t.shape)).encode())
        digest.update(t.contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def data_record(task: Task, data: TaskData) -> dict[str, str]:
    """What a run records of its data under data.*: the task's own name (`byo-<name>` for a user's data,
    never the default task), the content fingerprint of its training tensors and the task's `record`."""
    out = {"task": task.name, **task.record}
    if data.fingerprint:
        out["fingerprint"] = data.fingerprint
    return out


def per_example_loss(task: Task, output: Tensor, x: Tensor, y: Tensor) -> Tensor:
    """Return the per-example loss [B]: task.example_loss, else cross-entropy / 1/2 squared error."""
    if task.example_loss is not None:
        return task.example_loss(output, x, y)
    if task.kind == "regression":
        return 0.5 * (output - y) ** 2
    return torch.nn.functional.cross_entropy(output, y, reduction="none")
