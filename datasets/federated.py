"""The on-device federated container: examples as tensors plus a client index.

`FederatedData` keeps every training example on the run's device and produces, per
round, fixed-shape batch *indices* for a cohort (a `CohortPlan`): [C, S, B] example
indices, [C, S, B] example weights (0 = padding) and a [C, S] step mask. Local steps are
laid out epoch-major with K = the cohort's largest ceil(n_i / B) steps per epoch; a client
with fewer batches gets masked steps at the end of each epoch. No DataLoader: batches are
gathered from the device tensor by index inside the client step.
"""

from __future__ import annotations

import math
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

    def to(self, device: torch.device) -> CohortPlan:
        """The plan's tensors on `device` (non-blocking from pinned host memory)."""
        if self.index.device == device:
            return self
        return CohortPlan(self.index.to(device, non_blocking=True), self.weight.to(device, non_blocking=True),
                          self.step_mask.to(device, non_blocking=True), self.num_examples.to(device, non_blocking=True),
                          self.steps_per_client, self.num_epochs, self.steps_per_epoch)

    def for_client(self, c: int) -> CohortPlan:
        """Return client c's plan alone, trimmed to its own K_c steps per epoch."""
        k_c = int(self.steps_per_client[c])
        shape = (self.num_epochs, self.steps_per_epoch)

        def trim(t: Tensor) -> Tensor:
            t = t[c].reshape(*shape, *t.shape[2:])[:, :k_c]
            return t.reshape(self.num_epochs * k_c, *t.shape[2:]).unsqueeze(0)

        return CohortPlan(trim(self.index), trim(self.weight), trim(self.step_mask),
                          self.num_examples[c : c + 1], self.steps_per_client[c : c + 1],
                          self.num_epochs, k_c)


class FederatedData:
    """Training examples on a device plus client -> example indices."""

    def __init__(self, x: Tensor, y: Tensor, client_indices: list[np.ndarray], device: torch.device,
                 dtype: torch.dtype = torch.float32) -> None:
        self.x = x.to(device)
        self.y = y.to(device)
        self.device = device
        self.dtype = dtype
        self.client_indices = [np.asarray(ix, dtype=np.int64) for ix in client_indices]
        self.sizes = np.array([len(ix) for ix in self.client_indices], dtype=np.int64)

    @property
    def num_clients(self) -> int:
        return len(self.client_indices)

    def plan(self, cohort: np.ndarray, *, num_epochs: int, batch_size: int,
             rngs: list[np.random.Generator], on_host: bool = False) -> CohortPlan:
        """Shuffle each client's examples once per epoch with its own rng; pad to fixed shape.

        on_host: build the tensors in host memory (pinned where the data lives on a GPU), to be
        moved with `CohortPlan.to` later (train.py builds the next round's plan while the GPU
        trains the current one).
        """
        steps = np.array([math.ceil(self.sizes[c] / batch_size) for c in cohort], dtype=np.int64)
        k = int(steps.max())
        num_clients, num_steps = len(cohort), num_epochs * k
        index = np.zeros((num_clients, num_epochs, k * batch_size), dtype=np.int64)
        weight = np.zeros((num_clients, num_epochs, k * batch_size), dtype=np.float32)
        step_mask = np.zeros((num_clients, num_epochs, k), dtype=np.float32)
        for row, (client, rng) in enumerate(zip(cohort, rngs, strict=True)):
            own = self.client_indices[client]
            for epoch in range(num_epochs):
                order = own[rng.permutation(len(own))]
                index[row, epoch, : len(own)] = order
                weight[row, epoch, : len(own)] = 1.0
                step_mask[row, epoch, : steps[row]] = 1.0
        device = torch.device("cpu") if on_host else self.device
        pin = on_host and self.device.type == "cuda"

        def tensor(array: np.ndarray, dtype: torch.dtype | None = None) -> Tensor:
            t = torch.as_tensor(array, dtype=dtype, device=device)
            return t.pin_memory() if pin else t

        return CohortPlan(
            index=tensor(index.reshape(num_clients, num_steps, batch_size)),
            weight=tensor(weight.reshape(num_clients, num_steps, batch_size), self.dtype),
            step_mask=tensor(step_mask.reshape(num_clients, num_steps), self.dtype),
            num_examples=tensor(self.sizes[cohort], self.dtype),
            steps_per_client=steps,
            num_epochs=num_epochs,
            steps_per_epoch=k,
        )
