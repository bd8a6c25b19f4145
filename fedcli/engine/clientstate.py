"""Per-client state (duals, control variates, local precisions) kept only for visited clients.

Memory grows with clients visited x state size, not with a dense N x d tensor on the
device: states live on `storage_device` (CPU by default) and only the cohort's are stacked
and moved to the run's device each round (docs/architecture.md §3).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree


class ClientStateStore:
    """client_id -> state pytree, created lazily by `init_fn` on first visit."""

    def __init__(self, init_fn: Callable[[], Any] | None, storage_device: str | torch.device = "cpu") -> None:
        self._init_fn = init_fn
        self._storage = torch.device(storage_device)
        self._states: dict[int, Any] = {}

    @property
    def stateful(self) -> bool:
        return self._init_fn is not None

    def __len__(self) -> int:
        return len(self._states)

    def gather(self, cohort: np.ndarray, device: torch.device) -> Any:
        """Return the cohort's states stacked on a leading axis, on `device` (None if stateless)."""
        if self._init_fn is None:
            return None
        states = [self._states.get(int(c)) for c in cohort]
        states = [self._to(self._init_fn(), self._storage) if s is None else s for s in states]
        return pytree.tree_map(lambda *xs: torch.stack(xs).to(device), *states)

    def scatter(self, cohort: np.ndarray, stacked: Any) -> None:
        """Store each client's new state (moved to the storage device)."""
        if self._init_fn is None:
            return
        for row, client in enumerate(cohort):
            # clone: a row of the stacked output is a view that would keep (and checkpoint) the whole
            # cohort's storage alive; states are then never changed in place, so a checkpoint can
            # take a shallow copy of this dict as a consistent snapshot
            self._states[int(client)] = pytree.tree_map(
                lambda t, r=row: t[r].detach().to(self._storage).clone(), stacked)

    def state_dict(self) -> dict[int, Any]:
        return dict(self._states)

    def load_state_dict(self, states: dict[int, Any]) -> None:
        self._states = {int(k): self._to(v, self._storage) for k, v in states.items()}

    @staticmethod
    def _to(tree: Any, device: torch.device) -> Any:
        return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)
