"""A client state as bytes: `SlotLayout` packs a state pytree into one fixed-size slot (and back), and
what a checkpoint takes of the store (`ClientDelta`: the states changed since the previous one;
`SpilledSlot`: a changed state the cache had evicted, copied aside). engine/clientstate.py keeps the
slots; engine/checkpoint_writer.py writes a delta (docs/operations.md, "Checkpoints").
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree

from fedcli.errors import ConfigError, TrackingError

ALIGN = 16  # bytes: every leaf of a slot starts at a multiple of this
PRECISIONS: dict[str, torch.dtype | None] = {"state": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def storage_dtype(dtype: torch.dtype, precision: str) -> torch.dtype:
    """The dtype a leaf of `dtype` is stored in under `precision` (narrower floating types only)."""
    target = PRECISIONS[precision]
    if target is None or not dtype.is_floating_point or dtype.itemsize <= target.itemsize:
        return dtype
    return target


def delta_file_name(round_idx: int) -> str:
    """The file a checkpoint of `round_idx` writes its changed client states to (beside round-NNNNNN.pt)."""
    return f"round-{round_idx:06d}.clients.npy"


class SlotLayout:
    """Where each leaf of a client state sits in its fixed-size slot of bytes (storage dtypes).

    Built from the run's own fresh client state (`template`): the tree structure and the node
    types always come from the run, never from a file.
    """

    def __init__(self, template: Any, precision: str) -> None:
        if precision not in PRECISIONS:
            raise ConfigError(
                f"train.state_precision must be one of {', '.join(PRECISIONS)}; got {precision!r}."
            )
        leaves, self.spec = pytree.tree_flatten(template)
        if not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
            raise TypeError("a client state holds a leaf that is not a tensor")
        self.precision = precision
        self.dtypes = [leaf.dtype for leaf in leaves]  # the state's own dtypes
        self.stored = [storage_dtype(leaf.dtype, precision) for leaf in leaves]
        self.shapes = [tuple(leaf.shape) for leaf in leaves]
        aligned = [  # each leaf's bytes, rounded up to a multiple of ALIGN
            -(-int(np.prod(shape, dtype=np.int64)) * dtype.itemsize // ALIGN) * ALIGN
            for shape, dtype in zip(self.shapes, self.stored, strict=True)
        ]
        *self.offsets, end = itertools.accumulate(aligned, initial=0)  # where each leaf starts; the end
        self.slot_bytes = max(end, ALIGN)

    def describe(self) -> dict[str, Any]:
        """The layout as plain values (recorded in a checkpoint's manifest and compared on load)."""
        return {
            "precision": self.precision,
            "slot_bytes": self.slot_bytes,
            "offsets": list(self.offsets),
            "dtypes": [str(d) for d in self.stored],
            "shapes": [list(s) for s in self.shapes],
        }

    def round(self, state: Any, device: torch.device | None = None) -> Any:
        """The state in its storage dtypes (a copy; detached), on `device` (default: where it is)."""
        leaves = pytree.tree_leaves(state)
        out = [
            leaf.detach().to(device=device or leaf.device, dtype=dtype, copy=True)
            for leaf, dtype in zip(leaves, self.stored, strict=True)
        ]
        return pytree.tree_unflatten(out, self.spec)

    def pack(self, stored: Any) -> np.ndarray:
        """A stored state (storage dtypes, CPU) as its slot of bytes."""
        out = torch.zeros(self.slot_bytes, dtype=torch.uint8)
        for leaf, offset in zip(pytree.tree_leaves(stored), self.offsets, strict=True):
            raw = leaf.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            out[offset : offset + raw.numel()] = raw
        return out.numpy()

    def unpack(self, buffer: bytearray | np.ndarray) -> Any:
        """A stored state (storage dtypes) read back from its slot of bytes (views of `buffer`)."""
        raw = (
            torch.frombuffer(buffer, dtype=torch.uint8) if len(buffer) else torch.empty(0, dtype=torch.uint8)
        )
        leaves = [
            raw[offset : offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize]
            .view(dtype)
            .reshape(shape)
            for shape, dtype, offset in zip(self.shapes, self.stored, self.offsets, strict=True)
        ]
        return pytree.tree_unflatten(leaves, self.spec)

    def widen(self, stored: Any) -> Any:
        """A stored state back in the state's own dtypes (exact: every stored value is representable)."""
        leaves = [leaf.to(dtype) for leaf, dtype in zip(pytree.tree_leaves(stored), self.dtypes, strict=True)]
        return pytree.tree_unflatten(leaves, self.spec)


@dataclass
class ClientDelta:
    """The client states a checkpoint writes: those changed since the previous checkpoint.

    `states` are stored states (storage dtypes, never changed in place) or their packed slots;
    `index` is the manifest after this checkpoint: client -> (file, row) for every client with
    a state, the changed ones pointing at rows of `file`.
    """

    clients: list[int]
    states: list[Any]
    file: str
    index: dict[int, tuple[str, int]]
    layout: SlotLayout | None
    full: bool = False  # True: every state the run has (no previous checkpoint to build on)

    @classmethod
    def of_all(
        cls, states: Mapping[int, Any], file: str, template: Any = None, precision: str = "state"
    ) -> ClientDelta:
        """Every state of `states` (client -> state in its own dtypes), as a full checkpoint's delta."""
        clients = sorted(int(c) for c in states)
        if not clients:
            return cls([], [], file, {}, None, full=True)
        layout = SlotLayout(template if template is not None else states[clients[0]], precision)
        return cls(
            clients,
            [layout.round(states[c], torch.device("cpu")) for c in clients],
            file,
            {c: (file, row) for row, c in enumerate(clients)},
            layout,
            full=True,
        )


@dataclass(frozen=True)
class SpilledSlot:
    """A changed state's packed slot that the cache had evicted, copied at `take_changes` into the
    checkpoint's spill file (the next rounds may overwrite its slot): the writer reads it back one
    at a time, so a checkpoint holds one slot, not every evicted changed state, in memory."""

    path: Path
    offset: int
    nbytes: int

    def read(self) -> np.ndarray:
        buffer = np.empty(self.nbytes, dtype=np.uint8)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            got = os.preadv(fd, [buffer.data], self.offset)
        finally:
            os.close(fd)
        if got != self.nbytes:
            raise TrackingError(
                f"the checkpoint's spill file {self.path} is shorter than it should be; resume the run"
            )
        return buffer


def spill_name(round_idx: int) -> str:
    """The spill file of the checkpoint of `round_idx`, in the store's folder (removed once written)."""
    return f"spill-{round_idx:06d}.bin"
