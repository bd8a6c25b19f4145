"""Per-client state (duals, control variates, local precisions) kept only for visited clients.

Memory grows with clients visited x state size, not with a dense N x d tensor on the
device: states live on `storage_device` (CPU by default) and only the cohort's are stacked
and moved to the run's device each round (docs/architecture.md §3, "Client-state store").

Two forms behind one `ClientStateStore`:

- in RAM (no `folder`): client id -> state pytree in a dict, as small runs have always had it;
- on disk (`folder` given): every client's state is one fixed-size slot (all clients' states
  have the same pytree structure and shapes) in `folder/slots.bin`, at offset client id x slot
  size (a sparse file: unvisited clients take no disk blocks); an LRU cache of `cache_mb`
  holds the recently used states (the cohort's at least), written back to their slots when
  evicted. Slots are read and written with `os.pread`/`os.pwrite`, not through a memory map:
  pages of a mapping count in the process's resident memory until the kernel drops them, and
  a write through a mapping onto a full disk is a SIGBUS instead of an `ENOSPC` error.

`precision`: "state" (default) stores each leaf in its own dtype; "bf16" or "fp16" store
floating leaves wider than that in it (half the bytes; values are rounded when stored, in
both forms alike, so RAM and disk give the same results). The run records it
(`train.state_precision`, part of the config hash).

The store also tracks what changed since the last checkpoint (`take_changes`): a checkpoint
writes only those states (engine/checkpoint.py, format 3).
"""

from __future__ import annotations

import errno
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree

from fedcli.engine.slots import ClientDelta, SlotLayout, SpilledSlot, delta_file_name, spill_name
from fedcli.errors import TrackingError

SLOTS_FILE = "slots.bin"


# checkpoint compaction (ClientStateStore._to_compact): when the files a manifest names hold more than
# COMPACT_FACTOR rows per live state, and at least COMPACT_MIN_BYTES, the next checkpoint also rewrites the
# live states of the files with the fewest live rows (most superseded first) until they no longer do
COMPACT_FACTOR = 2
COMPACT_MIN_BYTES = 1 << 30


class ClientStateStore:
    """client_id -> state pytree, created lazily by `init_fn` on first visit.

    Args:
        init_fn: A fresh client state (None: the algorithm keeps none).
        storage_device: Where states in RAM live (CPU by default).
        folder: On disk: the folder of the slots file (the run's `client-state/`); None keeps
            every state in RAM.
        cache_mb: On disk: the LRU cache of states kept in RAM, in MiB (the cohort's states
            are held during a round whatever this is).
        precision: "state", "bf16" or "fp16" (the module docstring).
    """

    def __init__(
        self,
        init_fn: Callable[[], Any] | None,
        storage_device: str | torch.device = "cpu",
        *,
        folder: Path | None = None,
        cache_mb: float = 512.0,
        precision: str = "state",
    ) -> None:
        self._init_fn = init_fn
        self._storage = torch.device(storage_device)
        # where each leaf of a state sits in its slot (the storage dtypes), from a fresh state; None: stateless
        self.layout = None if init_fn is None else SlotLayout(init_fn(), precision)
        self.folder = folder
        self._fd: int | None = None
        self._budget = -1 if folder is None else int(cache_mb * 2**20)  # the cache's bytes; < 0: unbounded
        self._states: OrderedDict[int, Any] = OrderedDict()  # the cached states, least recently used first
        self._dirty: set[int] = set()  # cached states not yet in their slot
        self._on_disk: set[int] = set()  # clients whose current state is in their slot
        self._changed: set[int] = set()  # clients changed since the last checkpoint
        self._index: dict[int, tuple[str, int]] = {}  # the last checkpoint's manifest
        self._full_next = False  # the next checkpoint writes every state (after a load from an older format)
        self._file_rows: dict[str, int] = {}  # rows of each .clients.npy file this store's checkpoints wrote
        self.compact_min_bytes = COMPACT_MIN_BYTES
        if folder is not None:
            self._open()

    @property
    def on_disk(self) -> bool:
        return self.folder is not None

    def __len__(self) -> int:
        return len(self._states.keys() | self._on_disk)

    def __contains__(self, client: object) -> bool:
        return client in self._states or client in self._on_disk

    def gather(self, cohort: np.ndarray, device: torch.device) -> Any:
        """Return the cohort's states stacked on a leading axis, on `device` (None if stateless)."""
        if self.layout is None:  # the algorithm keeps no client state
            return None
        stored = [self._get(int(c)) for c in cohort]
        columns = zip(*(pytree.tree_leaves(s) for s in stored), strict=True)
        leaves = [
            torch.stack(col).to(device=device, dtype=dtype)
            for col, dtype in zip(columns, self.layout.dtypes, strict=True)
        ]
        return pytree.tree_unflatten(leaves, self.layout.spec)

    def scatter(self, cohort: np.ndarray, stacked: Any) -> None:
        """Store each client's new state (rounded to the storage dtypes, on the storage device)."""
        if self.layout is None:
            return
        leaves = pytree.tree_leaves(stacked)
        for row, client in enumerate(cohort):
            # a copy: a row of the stacked output is a view that would keep (and checkpoint) the whole
            # cohort's storage alive; states are then never changed in place, so a checkpoint can
            # hold references to them as a consistent snapshot
            state = pytree.tree_unflatten(
                [
                    leaf[row].detach().to(device=self._storage, dtype=dtype, copy=True)
                    for leaf, dtype in zip(leaves, self.layout.stored, strict=True)
                ],
                self.layout.spec,
            )
            self._put(int(client), state, dirty=True)
            self._changed.add(int(client))
        self._evict()

    def state_dict(self) -> dict[int, Any]:
        """Every client's state in its own dtypes (reads all slots from disk: for tests and small runs)."""
        if self.layout is None:
            return {}
        out = {
            c: self.layout.widen(self._get(c, cache=False))
            for c in sorted(self._states.keys() | self._on_disk)
        }
        if (
            self.layout.precision == "state"
        ):  # the stored objects themselves, as the dict form always gave them
            out.update(self._states)
        return out

    def load_state_dict(
        self, states: Mapping[int, Any] | Any, index: dict[int, tuple[str, int]] | None = None
    ) -> None:
        """Replace every state with `states` (client -> state, or an object with `.items()` yielding them).

        `index`: the manifest of the checkpoint they come from (format 3): the next checkpoint
        then writes only what changes from here on. Without it the next one writes them all.
        """
        self._states.clear()
        self._dirty.clear()
        self._on_disk.clear()
        if self.folder is not None:
            self._open()
        for client, state in states.items():
            if self.layout is None:
                raise TypeError("client states given to a store of an algorithm that keeps none")
            self._put(int(client), self.layout.round(state, self._storage), dirty=True)
            self._evict()
        self._changed = set()
        self._index = dict(index or {})
        self._full_next = index is None

    def take_changes(self, round_idx: int) -> ClientDelta:
        """The states changed since the last checkpoint, for a checkpoint of `round_idx` (resets the tracking).

        The states are those objects themselves (never changed in place) or, for ones the
        cache evicted, their slots copied now into the checkpoint's spill file (`SpilledSlot`): the
        next rounds may overwrite the slots. The writer removes the spill file once written.
        """
        file = delta_file_name(round_idx)
        if self._full_next:
            self._changed = set(self._states.keys() | self._on_disk)
            self._index = {}
            self._full_next = False
        else:
            self._changed |= self._to_compact()
        clients = sorted(self._changed)
        evicted = [c for c in clients if c not in self._states]
        spilled = dict(zip(evicted, self._spill(evicted, round_idx), strict=True)) if evicted else {}
        states = [self._states[c] if c in self._states else spilled[c] for c in clients]
        self._index = {
            **{c: v for c, v in self._index.items() if c not in self._changed},
            **{c: (file, row) for row, c in enumerate(clients)},
        }
        self._changed = set()
        named = {name for name, _ in self._index.values()}
        self._file_rows = {
            **{name: n for name, n in self._file_rows.items() if name in named},
            file: len(clients),
        }
        return ClientDelta(clients, states, file, dict(self._index), self.layout)

    def _to_compact(self) -> set[int]:
        """The unchanged clients whose states this checkpoint rewrites to compact the files (segment
        cleaning, as log-structured stores do).

        A file stays while one client's latest state is in it, so with random sampling the files a
        manifest names fill up with superseded rows. While they hold more than COMPACT_FACTOR rows per
        live client state (and at least `compact_min_bytes`), the file with the fewest live rows per row
        is taken: its live states go into this checkpoint's file, and it goes once no kept checkpoint
        names it. The files then stay within COMPACT_FACTOR x the live states plus one checkpoint's
        file (and the older kept checkpoints'), and each checkpoint writes O(cohort) rows: the file
        taken is at most 1/COMPACT_FACTOR live, so the rows copied are at most the superseded rows
        freed, about a cohort a checkpoint (docs/operations.md, "Checkpoints")."""
        if self.layout is None or not self._file_rows:
            return set()
        live: dict[str, list[int]] = {}  # file -> its clients whose latest state stays in it
        for client, (name, _) in self._index.items():
            if client not in self._changed:
                live.setdefault(name, []).append(client)
        # a file of an earlier process (a resumed run) counts as wholly live: its superseded rows are unknown
        size = {name: self._file_rows.get(name, len(clients)) for name, clients in live.items()}
        rows = sum(size.values()) + len(self._changed)
        live_rows = sum(len(c) for c in live.values()) + len(self._changed)
        taken: set[int] = set()
        for name in sorted(live, key=lambda n: (len(live[n]) / size[n], n)):
            if rows <= COMPACT_FACTOR * live_rows or rows * self.layout.slot_bytes < self.compact_min_bytes:
                break
            if len(live[name]) >= size[name]:  # no superseded rows left to free
                break
            taken.update(live[name])
            rows -= size[name] - len(live[name])  # the file goes; its live rows move to this checkpoint's
        return taken

    def _spill(self, clients: list[int], round_idx: int) -> list[SpilledSlot]:
        """Copy `clients`' slots, one at a time, into this checkpoint's spill file."""
        assert self._fd is not None and self.layout is not None and self.folder is not None
        path, size = self.folder / spill_name(round_idx), self.layout.slot_bytes
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                for row, client in enumerate(clients):
                    if os.pwrite(fd, self._read_slot(client).data, row * size) != size:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            finally:
                os.close(fd)
        except OSError as err:
            path.unlink(missing_ok=True)
            raise state_write_error(err, self.folder) from err
        return [SpilledSlot(path, row * size, size) for row in range(len(clients))]

    def close(self, remove: bool = False) -> None:
        """Close the slots file; `remove` deletes it (the run's checkpoints hold what it held)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if remove and self.folder is not None:
            (self.folder / SLOTS_FILE).unlink(missing_ok=True)
            for spill in self.folder.glob("spill-*.bin"):  # a checkpoint's, if its write never ended
                spill.unlink(missing_ok=True)
            if self.folder.is_dir() and not any(self.folder.iterdir()):
                self.folder.rmdir()

    # --- the cache and the slots

    def _get(self, client: int, cache: bool = True) -> Any:
        assert self.layout is not None and self._init_fn is not None
        if client in self._states:
            if cache:
                self._states.move_to_end(client)
            return self._states[client]
        if client in self._on_disk:
            state = self.layout.unpack(self._read_slot(client))
            if cache:
                self._put(client, state, dirty=False)
                self._evict(keep=1)
            return state
        return self.layout.round(self._init_fn(), self._storage)  # never visited: a fresh state (not stored)

    def _put(self, client: int, state: Any, dirty: bool) -> None:
        self._states[client] = state
        self._states.move_to_end(client)
        if dirty:
            self._dirty.add(client)

    def _evict(self, keep: int = 0) -> None:
        """Write back and drop least recently used states beyond the budget (the newest `keep` stay)."""
        if self._budget < 0 or self.layout is None:
            return
        room = max(0, self._budget // self.layout.slot_bytes)
        while len(self._states) > max(room, keep):
            client, state = self._states.popitem(last=False)
            if client in self._dirty:
                self._write_slot(client, self.layout.pack(state))
                self._dirty.discard(client)
            self._on_disk.add(client)

    def _open(self) -> None:
        assert self.folder is not None
        path = self.folder / SLOTS_FILE
        if self._fd is not None:
            os.close(self._fd)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            for spill in self.folder.glob("spill-*.bin"):  # left by a process killed mid-checkpoint
                spill.unlink(missing_ok=True)
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)  # a run's slots start empty
        except OSError as err:
            raise state_write_error(err, self.folder) from err

    def _read_slot(self, client: int) -> np.ndarray:
        assert self._fd is not None and self.layout is not None and self.folder is not None
        size = self.layout.slot_bytes
        buffer = np.empty(size, dtype=np.uint8)
        got = os.preadv(self._fd, [buffer.data], client * size)
        if got != size:
            raise TrackingError(
                f"the client-state file {self.folder / SLOTS_FILE} is shorter than it should be "
                f"(client {client}); was it changed while the run trained? Resume the run."
            )
        return buffer

    def _write_slot(self, client: int, slot: np.ndarray) -> None:
        assert self._fd is not None and self.folder is not None
        size = len(slot)
        try:
            written = os.pwrite(self._fd, slot.data, client * size)
            if written != size:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as err:
            raise state_write_error(err, self.folder) from err


def make_store(
    init_fn: Callable[[], Any] | None,
    *,
    num_clients: int,
    folder: Path,
    kind: str = "auto",
    cache_mb: float = 512.0,
    precision: str = "state",
) -> ClientStateStore:
    """The run's store: on disk under `folder` when `kind` is "disk", or "auto" and every client's
    state would take more than `cache_mb`; else in RAM (faster: no packing, no file)."""
    if init_fn is None or kind == "ram":
        return ClientStateStore(init_fn, precision=precision)
    if kind == "auto" and num_clients * SlotLayout(init_fn(), precision).slot_bytes <= cache_mb * 2**20:
        return ClientStateStore(init_fn, precision=precision)
    return ClientStateStore(init_fn, folder=folder, cache_mb=cache_mb, precision=precision)


def state_write_error(err: OSError, folder: Path) -> TrackingError:
    """The one-line error of a failed write of client states under `folder` (a full disk: exit 2)."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return TrackingError(
            f"no space left on device: could not write client states to {folder}; free disk space, then resume "
            "with `fedcli train --resume RUN` (the previous checkpoint is intact)"
        )
    return TrackingError(
        f"could not write client states to {folder}: {err.strerror or err}; check the folder's permissions"
    )
