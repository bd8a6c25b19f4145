"""The federated data contract: examples plus a client index, and per-round cohort plans.

`FederatedData` (the contract, docs/architecture.md §5, the data contract) produces, per round,
fixed-shape batch *indices* for a cohort (a `CohortPlan`): [C, S, B] example indices,
[C, S, B] example weights (0 = padding) and a [C, S] step mask. Local steps are laid out
epoch-major with K = the cohort's largest ceil(n_i / B) steps per epoch; a client with fewer
batches gets masked steps at the end of each epoch. No DataLoader: batches are gathered by
index inside the client step from `CohortPlan.data` when set (the cohort's own examples),
else from the container's `x` / `y`.

Two implementations: `MemoryData` keeps every training example on the run's device (small
data; the plan indexes the whole tensor), `DiskData` keeps them in a disk store's memory maps
(datasets/formats/diskstore.py) and gathers each cohort's examples into a small tensor (the plan's
indices remapped into it; padding slots point at the copy of example 0, as in memory, so both
give the same batches bit for bit). `choose_store` picks one for `--data-store auto|memory|disk`.
"""

from __future__ import annotations

import math
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class CohortPlan:
    """Fixed-shape local-training plan of one cohort for one round."""

    index: Tensor  # [C, S, B] int64 example indices into FederatedData.x (0 where padded)
    weight: Tensor  # [C, S, B] float 1 = real example, 0 = padding
    step_mask: Tensor  # [C, S] float 1 = real step
    num_examples: Tensor  # [C] float, examples per client (one pass)
    steps_per_client: np.ndarray  # [C] int, real steps per epoch ceil(n_i / B)
    num_epochs: int
    steps_per_epoch: int  # K, padded
    data: CohortData | None = (
        None  # the cohort's gathered examples that `index` points into (DiskData); None = fed.x
    )

    def to(self, device: torch.device) -> CohortPlan:
        """The plan's tensors on `device` (non-blocking from pinned host memory)."""
        if self.index.device == device:
            return self
        return CohortPlan(
            self.index.to(device, non_blocking=True),
            self.weight.to(device, non_blocking=True),
            self.step_mask.to(device, non_blocking=True),
            self.num_examples.to(device, non_blocking=True),
            self.steps_per_client,
            self.num_epochs,
            self.steps_per_epoch,
            None if self.data is None else self.data.to(device),
        )

    def for_client(self, c: int) -> CohortPlan:
        """Return client c's plan alone, trimmed to its own K_c steps per epoch."""
        k_c = int(self.steps_per_client[c])
        shape = (self.num_epochs, self.steps_per_epoch)

        def trim(t: Tensor) -> Tensor:
            t = t[c].reshape(*shape, *t.shape[2:])[:, :k_c]
            return t.reshape(self.num_epochs * k_c, *t.shape[2:]).unsqueeze(0)

        return CohortPlan(
            trim(self.index),
            trim(self.weight),
            trim(self.step_mask),
            self.num_examples[c : c + 1],
            self.steps_per_client[c : c + 1],
            self.num_epochs,
            k_c,
        )


@dataclass(frozen=True)
class CohortData:
    """A cohort's examples gathered from a disk store (stored form), what `CohortPlan.index` points into.

    Duck-types the container for the client step (`fns.data.x[ix]`, `.y`, `.device`, `.dtype`).
    """

    x: Tensor
    y: Tensor
    device: torch.device
    dtype: torch.dtype

    def to(self, device: torch.device) -> CohortData:
        if self.x.device == device:
            return self
        return CohortData(
            self.x.to(device, non_blocking=True), self.y.to(device, non_blocking=True), device, self.dtype
        )


AUTO_DISK_BYTES = (
    1 << 30
)  # --data-store auto: disk above 1 GiB of examples (docs/scaling.md "Out-of-core data")
STORES = ("auto", "memory", "disk")


class FederatedData(ABC):
    """The contract: client -> example indices, cohort plans, and reads of examples by index.

    `x` / `y` are the stored training examples (on `device` in memory; CPU memory maps on disk),
    `client_indices[k]` client k's example indices, `sizes` their counts. Read examples through
    `take` (any indices, on the run's device) or `examples` (a whole split, chunk-readable).
    """

    x: Tensor
    y: Tensor
    device: torch.device
    dtype: torch.dtype
    client_indices: Sequence[np.ndarray]
    sizes: np.ndarray
    store: str  # "memory" | "disk": what a run records (data.data_store)
    prefetches = False  # True: the round loop builds the next round's plan in a background thread

    def __new__(cls, *args: object, **kwargs: object) -> FederatedData:
        """`FederatedData(x, y, client_indices, device)` builds the in-memory container (`MemoryData`)."""
        return super().__new__(MemoryData if cls is FederatedData else cls)

    @property
    def num_clients(self) -> int:
        return len(self.client_indices)

    @abstractmethod
    def plan(
        self,
        cohort: np.ndarray,
        *,
        num_epochs: int,
        batch_size: int,
        rngs: list[np.random.Generator],
        on_host: bool = False,
    ) -> CohortPlan:
        """The cohort's fixed-shape plan (see the module docstring)."""

    def take(self, index: Tensor | np.ndarray) -> tuple[Tensor, Tensor]:
        """Examples `index` (stored form) on the run's device."""
        ix = torch.as_tensor(np.asarray(index) if not isinstance(index, Tensor) else index, dtype=torch.int64)
        return self.x[ix.to(self.x.device)].to(self.device), self.y[ix.to(self.y.device)].to(self.device)

    def examples(self, index: np.ndarray) -> tuple[Tensor, Tensor]:
        """Examples `index` in stored form, wherever they live (chunks go to the device as they are read)."""
        ix = torch.as_tensor(index, dtype=torch.int64, device=self.x.device)
        return self.x[ix], self.y[ix]


def layout(
    client_indices: Sequence[np.ndarray],
    sizes: np.ndarray,
    cohort: np.ndarray,
    num_epochs: int,
    batch_size: int,
    rngs: list[np.random.Generator],
) -> tuple[np.ndarray, ...]:
    """Shuffle each client's examples once per epoch with its own rng; pad to fixed shape.

    Returns index [C, E, K*B] int64, weight [C, E, K*B], step_mask [C, E, K], steps [C], K.
    """
    steps = np.array([math.ceil(sizes[c] / batch_size) for c in cohort], dtype=np.int64)
    k = int(steps.max())
    num_clients = len(cohort)
    index = np.zeros((num_clients, num_epochs, k * batch_size), dtype=np.int64)
    weight = np.zeros((num_clients, num_epochs, k * batch_size), dtype=np.float32)
    step_mask = np.zeros((num_clients, num_epochs, k), dtype=np.float32)
    for row, (client, rng) in enumerate(zip(cohort, rngs, strict=True)):
        own = client_indices[client]
        for epoch in range(num_epochs):
            order = own[rng.permutation(len(own))]
            index[row, epoch, : len(own)] = order
            weight[row, epoch, : len(own)] = 1.0
            step_mask[row, epoch, : steps[row]] = 1.0
    return index, weight, step_mask, steps, np.int64(k)


def _plan(
    fed: FederatedData,
    index: np.ndarray,
    weight: np.ndarray,
    step_mask: np.ndarray,
    steps: np.ndarray,
    k: int,
    cohort: np.ndarray,
    num_epochs: int,
    batch_size: int,
    on_host: bool,
    data: CohortData | None = None,
) -> CohortPlan:
    num_clients, num_steps = len(cohort), num_epochs * k
    device = torch.device("cpu") if on_host else fed.device
    pin = on_host and fed.device.type == "cuda"

    def tensor(array: np.ndarray, dtype: torch.dtype | None = None) -> Tensor:
        t = torch.as_tensor(array, dtype=dtype, device=device)
        return t.pin_memory() if pin else t

    return CohortPlan(
        index=tensor(index.reshape(num_clients, num_steps, batch_size)),
        weight=tensor(weight.reshape(num_clients, num_steps, batch_size), fed.dtype),
        step_mask=tensor(step_mask.reshape(num_clients, num_steps), fed.dtype),
        num_examples=tensor(fed.sizes[cohort], fed.dtype),
        steps_per_client=steps,
        num_epochs=num_epochs,
        steps_per_epoch=k,
        data=data,
    )


class MemoryData(FederatedData):
    """Training examples on a device plus client -> example indices (the plan indexes `x` itself)."""

    store = "memory"

    def __init__(
        self,
        x: Tensor,
        y: Tensor,
        client_indices: Sequence[np.ndarray],
        device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.x = x.to(device)
        self.y = y.to(device)
        self.device = device
        self.dtype = dtype
        self.client_indices = [np.asarray(ix, dtype=np.int64) for ix in client_indices]
        self.sizes = np.array([len(ix) for ix in self.client_indices], dtype=np.int64)

    def plan(
        self,
        cohort: np.ndarray,
        *,
        num_epochs: int,
        batch_size: int,
        rngs: list[np.random.Generator],
        on_host: bool = False,
    ) -> CohortPlan:
        """The cohort's plan, indices into `x`.

        on_host: build the tensors in host memory (pinned where the data lives on a GPU), to be
        moved with `CohortPlan.to` later (train.py builds the next round's plan while the GPU
        trains the current one).
        """
        index, weight, step_mask, steps, k = layout(
            self.client_indices, self.sizes, cohort, num_epochs, batch_size, rngs
        )
        return _plan(self, index, weight, step_mask, steps, int(k), cohort, num_epochs, batch_size, on_host)


class DiskData(FederatedData):
    """Training examples in a disk store's memory maps (CPU); each plan carries its cohort's examples.

    `plan` reads the cohort's examples (and example 0, which padding slots point at) in index
    order from the memory maps into one small tensor (pinned on a CUDA run with on_host), and
    remaps the plan's indices into it. It is safe to call from a background thread: the round
    loop builds the next round's plan there while the current one trains (engine/rounds.py).
    """

    store = "disk"
    prefetches = True

    def __init__(
        self,
        x: Tensor,
        y: Tensor,
        client_indices: Sequence[np.ndarray],
        device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.x, self.y = x, y  # CPU tensors over np.memmap: nothing is read until indexed
        self.x_np, self.y_np = x.numpy(), y.numpy()
        self.device, self.dtype = device, dtype
        self.client_indices = client_indices
        sizes = getattr(client_indices, "sizes", None)
        self.sizes = (
            sizes() if callable(sizes) else np.array([len(ix) for ix in client_indices], dtype=np.int64)
        )
        self.lock = threading.Lock()  # one gather at a time (the prefetch thread and a plan built inline)

    def plan(
        self,
        cohort: np.ndarray,
        *,
        num_epochs: int,
        batch_size: int,
        rngs: list[np.random.Generator],
        on_host: bool = False,
    ) -> CohortPlan:
        index, weight, step_mask, steps, k = layout(
            self.client_indices, self.sizes, cohort, num_epochs, batch_size, rngs
        )
        own = [np.zeros(1, dtype=np.int64)] + [self.client_indices[c] for c in cohort]
        needed = np.unique(np.concatenate(own))  # sorted, with example 0 (the padding slots' example)
        data = self.gather(needed, on_host)
        local = np.searchsorted(needed, index)
        return _plan(
            self, local, weight, step_mask, steps, int(k), cohort, num_epochs, batch_size, on_host, data
        )

    def gather(self, needed: np.ndarray, on_host: bool) -> CohortData:
        """Examples `needed` (sorted) from the memory maps, on the device (or pinned host memory)."""
        with self.lock:
            x = torch.from_numpy(np.take(self.x_np, needed, axis=0))
            y = torch.from_numpy(np.take(self.y_np, needed, axis=0))
        if on_host or self.device.type == "cpu":
            if on_host and self.device.type == "cuda":
                x, y = x.pin_memory(), y.pin_memory()
            return CohortData(x, y, torch.device("cpu"), self.dtype)
        return CohortData(x.to(self.device), y.to(self.device), self.device, self.dtype)

    def take(self, index: Tensor | np.ndarray) -> tuple[Tensor, Tensor]:
        ix = np.asarray(index.cpu() if isinstance(index, Tensor) else index, dtype=np.int64)
        with self.lock:
            x = torch.from_numpy(np.take(self.x_np, ix, axis=0))
            y = torch.from_numpy(np.take(self.y_np, ix, axis=0))
        return x.to(self.device), y.to(self.device)

    def examples(self, index: np.ndarray) -> tuple[Tensor, Tensor]:
        if len(index) == len(self.x) and np.array_equal(index, np.arange(len(self.x))):
            return self.x, self.y  # the memory maps themselves: evaluation reads them chunk by chunk
        return torch.from_numpy(np.take(self.x_np, index, axis=0)), torch.from_numpy(
            np.take(self.y_np, index, axis=0)
        )


def choose_store(requested: str, nbytes: int, on_disk: bool) -> str:
    """memory | disk for --data-store `requested` (auto: disk above AUTO_DISK_BYTES of examples,
    or when the loader already streamed the data into a disk store)."""
    if requested not in STORES:
        raise ValueError(requested)
    if requested == "auto":
        return "disk" if on_disk or nbytes > AUTO_DISK_BYTES else "memory"
    return requested


def federated_data(
    x: Tensor, y: Tensor, client_indices: Sequence[np.ndarray], device: torch.device, store: str = "memory"
) -> FederatedData:
    """The container for `store` (memory | disk; disk needs x / y that are a disk store's memory maps)."""
    if store == "disk":
        return DiskData(x, y, client_indices, device)
    return MemoryData(x, y, client_indices, device)
