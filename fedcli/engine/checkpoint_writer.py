"""`CheckpointWriter`: what the round loop uses to write checkpoints (docs/operations.md, "Checkpoints").

Checkpoints are on by default, written on a background thread from a snapshot taken between
rounds, kept `keep` at a time (older files and rows are pruned), and in the default `auto` cadence
written after every round unless writing one takes longer than `AUTO_BUDGET` of a round, in which
case they are spaced so that they cost about that. The format (incremental client states in
`.clients.npy` files named by the `.pt`'s manifest) and its readers are engine/checkpoint.py.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from torch.utils import _pytree as pytree

from fedcli.engine.checkpoint import (
    FORMAT_VERSION,
    atomic_save,
    atomic_write,
    checkpoint_path,
    cpu_copy,
    read_file,
    remove_temp_files,
)
from fedcli.engine.plain import to_plain
from fedcli.engine.slots import ClientDelta, SpilledSlot, delta_file_name
from fedcli.errors import CheckpointError

log = logging.getLogger(__name__)

AUTO_BUDGET = 0.03  # auto cadence: checkpoint writing may take up to 3 % of the rounds' time


def write_delta(path: Path, delta: ClientDelta) -> int:
    """Write `delta`'s states as a [clients, slot bytes] uint8 .npy file, atomically; return its size.

    Streamed one slot at a time (no copy of the whole delta in memory), to a temp file that is
    fsynced and renamed over `path`; any failure removes the temp file and leaves `path` as it was.

    Raises:
        TrackingError: the file could not be written (a full disk says "no space left on device").
    """
    assert delta.layout is not None
    layout = delta.layout

    def write(fh: BinaryIO) -> None:
        np.lib.format.write_array_header_1_0(
            fh,
            {
                "descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)),
                "fortran_order": False,
                "shape": (len(delta.clients), layout.slot_bytes),
            },
        )
        for state in delta.states:
            if isinstance(state, SpilledSlot):
                slot = state.read()
            else:
                slot = state if isinstance(state, np.ndarray) else layout.pack(state)
            fh.write(slot.data)

    return atomic_write(path, write)


def manifest_of(delta: ClientDelta) -> dict[str, Any]:
    """A delta's `index` as a format-3 checkpoint stores it: tensors and plain values only."""
    files = sorted({name for name, _ in delta.index.values()})
    number = {name: i for i, name in enumerate(files)}
    clients = sorted(delta.index)
    return {
        "files": files,
        "clients": torch.tensor(clients, dtype=torch.int64),
        "file": torch.tensor([number[delta.index[c][0]] for c in clients], dtype=torch.int32),
        "row": torch.tensor([delta.index[c][1] for c in clients], dtype=torch.int64),
        "layout": delta.layout.describe() if delta.layout is not None else {},
    }


class CheckpointWriter:
    """Write a run's checkpoints in the background, with a cadence and a retention.

    Args:
        run_dir: The run's folder; checkpoints go to `run_dir/checkpoints/round-NNNNNN.pt`.
        record: Called on the writer thread after a file is in place, with (round, path),
            to record it in the store; `forget` likewise with the rounds pruned.
        every: Rounds between checkpoints; None = auto (see the module docstring); 0 = off
            (the run then resumes from its last recorded checkpoint, or from round 0).
        keep: How many of the newest checkpoints to keep (>= 1).
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        record: Callable[[int, str], None],
        forget: Callable[[list[int]], None],
        existing: list[tuple[int, str]],
        every: int | None,
        keep: int,
    ) -> None:
        self.folder = run_dir / "checkpoints"
        self.every, self.keep = every, max(1, keep)
        self._record, self._forget = record, forget
        self._kept = [round_idx for round_idx, _ in existing]
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedcli-checkpoint")
        self._pending: Future[None] | None = None
        self._write_s: float | None = None  # seconds of the last write (auto cadence)
        self._writes: deque[float] = deque(maxlen=self.WRITES_WINDOW)  # recent write times (auto cadence)
        self._rounds: deque[float] = deque(maxlen=self.ROUNDS_WINDOW)  # recent round times (auto cadence)
        self._sampled: float | None = None  # the `_write_s` object last put in `_writes`
        self._since = 0  # rounds since the last checkpoint
        self.last_round: int | None = max(self._kept) if self._kept else None
        self._files: dict[int, set[str]] = {}  # round -> the .clients.npy files its manifest names
        self.bytes_written: dict[int, int] = {}  # round -> bytes its checkpoint wrote (.pt + .clients.npy)
        if removed := remove_temp_files(self.folder):
            log.info("removed %d temporary checkpoint file(s) left by a killed write", removed)

    WRITES_WINDOW = 5  # auto cadence: the median of the last 5 write times ...
    ROUNDS_WINDOW = 25  # ... over AUTO_BUDGET x the median of the last 25 round times
    MAX_GAP_S = 600.0  # auto cadence: at most this many seconds of rounds between two checkpoints

    @property
    def interval(self) -> int:
        """Rounds between checkpoints now (auto: from the measured write and round times).

        Auto: ceil(median recent write / (AUTO_BUDGET x median recent round)), at least 1 and at
        most the rounds of `MAX_GAP_S` seconds. Medians (the lower one for an even count), not
        means, so one outlier cannot switch checkpoints off: a write that stalled for minutes (the
        process stopped, the store locked) counts as one sample of five; and the cap makes the
        next write, which measures again, come even when the stalled one was the first.
        """
        if self.every is not None:
            return self.every
        if not self._writes or not self._rounds:
            return 1
        write_s, round_s = statistics.median_low(self._writes), statistics.median_low(self._rounds)
        if round_s <= 0:
            return 1
        most = max(1, int(self.MAX_GAP_S / round_s))
        return max(1, min(most, math.ceil(write_s / (AUTO_BUDGET * round_s))))

    def due(self, round_idx: int, round_s: float) -> bool:
        """Account one finished round (`round_s`: its wall seconds); True when it should be checkpointed."""
        self._rounds.append(round_s)
        written = self._write_s  # set by the writer thread; each write stores a new float object
        if written is not None and written is not self._sampled:
            self._writes.append(written)
            self._sampled = written
        self._since += 1
        return self.every != 0 and self._since >= self.interval

    def submit(
        self,
        round_idx: int,
        state: Any,
        client_states: ClientDelta | dict[int, Any],
        config: dict[str, Any],
        seed: int,
        buffers: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Snapshot the state now; write it on the background thread (after the previous write).

        `client_states`: what changed since the previous checkpoint (ClientStateStore.take_changes),
        or a dict of every client's state (then all are written). `buffers`: the global model's
        BatchNorm running statistics (train.bn_stats aggregate), saved beside the server state
        under "buffers" (a file without them, written before, still loads: `load_checkpoint`).
        """
        self.wait()  # at most one write in flight: memory stays bounded, errors surface a round later
        delta = (
            client_states
            if isinstance(client_states, ClientDelta)
            else ClientDelta.of_all(client_states, delta_file_name(round_idx))
        )
        from fedcli.config.sections import config_hash_of

        snapshot = {
            "format_version": FORMAT_VERSION,
            "round_idx": round_idx,
            "seed": seed,
            "run_id": self.folder.parent.name,  # runs/<id>/
            "config_hash": config_hash_of(config),
            "config": config,
            "server_state": pytree.tree_map(cpu_copy, state),
        }
        if buffers is not None:
            snapshot["buffers"] = {k: cpu_copy(v) for k, v in buffers.items()}
        self._since = 0
        self.last_round = round_idx
        self._pending = self._pool.submit(self._write, round_idx, snapshot, delta)

    def _write(self, round_idx: int, snapshot: dict[str, Any], delta: ClientDelta) -> None:
        start = time.perf_counter()
        path = checkpoint_path(self.folder.parent, round_idx)
        written = 0
        if delta.clients:  # the changed states first: a .pt in place always has its files
            try:
                written += write_delta(self.folder / delta.file, delta)
            finally:
                for spill in {s.path for s in delta.states if isinstance(s, SpilledSlot)}:
                    spill.unlink(missing_ok=True)
        manifest = manifest_of(delta)
        payload = {**snapshot, "server_state": to_plain(snapshot["server_state"]), "client_index": manifest}
        written += atomic_save(payload, path)
        self._record(round_idx, str(path.resolve()))
        self._write_s = time.perf_counter() - start
        self.bytes_written[round_idx] = written
        log.debug(
            "checkpoint of round %d: %d bytes (%d client states)", round_idx, written, len(delta.clients)
        )
        # _files and _kept are this thread's alone (one write at a time, all on the pool's one thread)
        self._files[round_idx] = set(manifest["files"])
        self._kept = sorted(set(self._kept) | {round_idx})
        old, self._kept = self._kept[: -self.keep], self._kept[-self.keep :]
        if old:
            self._forget(old)
            for stale in old:
                checkpoint_path(self.folder.parent, stale).unlink(missing_ok=True)
                self._files.pop(stale, None)
            self._remove_unnamed_files()

    def _remove_unnamed_files(self) -> None:
        """Delete the .clients.npy files no kept checkpoint names (format 3 manifests)."""
        named: set[str] = set()
        for round_idx in self._kept:
            if round_idx not in self._files:  # a checkpoint of an earlier process: read its manifest
                try:
                    payload = read_file(checkpoint_path(self.folder.parent, round_idx), "a kept checkpoint")
                    self._files[round_idx] = {
                        str(f) for f in (payload.get("client_index") or {}).get("files", [])
                    }
                except CheckpointError:
                    self._files[round_idx] = set()
            named |= self._files[round_idx]
        for path in self.folder.glob("round-*.clients.npy"):
            if path.name not in named:
                path.unlink(missing_ok=True)

    def wait(self) -> None:
        """Block until the write in flight is done; re-raise its failure."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
