"""Atomic checkpoints: server state + client states + round + resolved config.

Written to a temporary file in the same folder and renamed over the target, so a crash
or kill never leaves a half-written checkpoint; a temporary file left by a kill during a
write is removed when the run starts or resumes. Tensors are saved on CPU so a
checkpoint written on a GPU loads anywhere.

`CheckpointWriter` is what the round loop uses (docs/architecture.md, "Checkpoints"):
checkpoints are on by default, written on a background thread from a snapshot taken
between rounds, kept `keep` at a time (older files and rows are pruned), and in the
default `auto` cadence written after every round unless writing one takes longer than
`AUTO_BUDGET` of a round, in which case they are spaced so that they cost about that.
"""

from __future__ import annotations

import io
import logging
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fedcli.errors import TrackingError

log = logging.getLogger(__name__)

AUTO_BUDGET = 0.03  # auto cadence: checkpoint writing may take up to 3 % of the rounds' time
TEMP_PREFIX = "."  # atomic_save's temporary files: .<name>.<random>

FORMAT_VERSION = 1


def to_cpu(tree: Any) -> Any:
    return pytree.tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, tree)


def to_device(tree: Any, device: torch.device) -> Any:
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)


def atomic_save(obj: Any, path: Path) -> None:
    """torch.save to a temp file beside `path`, fsync, then rename over `path`.

    The object is serialised in memory first and written with plain file writes, so a full
    disk is an `OSError(ENOSPC)` (torch's zip writer reports it as an opaque RuntimeError);
    any failure leaves `path` as it was and removes the temp file.

    Raises:
        TrackingError: the file could not be written (the message names the path and, for a
            full disk, says "no space left on device").
    """
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{path.name}.", dir=path.parent)
    except OSError as err:
        raise TrackingError(_os_message(err, path)) from err
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(buffer.getbuffer())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise TrackingError(_os_message(err, path)) from err
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def checkpoint_payload(*, round_idx: int, server_state: Any, client_states: dict[int, Any],
                       config: dict[str, Any], seed: int) -> dict[str, Any]:
    """Everything needed to resume exactly after `round_idx`, as a snapshot on the CPU.

    The server state is copied (the caller goes on to the next round); client states are
    taken as they are: the client-state store replaces them, never changes them in place.
    """
    return {"format_version": FORMAT_VERSION, "round_idx": round_idx, "seed": seed, "config": config,
            "server_state": pytree.tree_map(_cpu_copy, server_state), "client_states": dict(client_states)}


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load a checkpoint (a `checkpoint_payload` written by `CheckpointWriter`) onto the CPU."""
    return torch.load(path, map_location="cpu", weights_only=False)


def checkpoint_path(run_dir: Path, round_idx: int) -> Path:
    return run_dir / "checkpoints" / f"round-{round_idx:06d}.pt"


def remove_temp_files(folder: Path) -> int:
    """Delete temporary files a killed write left in `folder`; return how many."""
    if not folder.is_dir():
        return 0
    removed = 0
    for path in folder.glob(f"{TEMP_PREFIX}*.pt.*"):
        path.unlink(missing_ok=True)
        removed += 1
    return removed


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

    def __init__(self, run_dir: Path, *, record: Callable[[int, str], None],
                 forget: Callable[[list[int]], None], existing: list[tuple[int, str]],
                 every: int | None, keep: int) -> None:
        self.folder = run_dir / "checkpoints"
        self.every, self.keep = every, max(1, keep)
        self._record, self._forget = record, forget
        self._kept = [round_idx for round_idx, _ in existing]
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedcli-checkpoint")
        self._pending: Future[None] | None = None
        self._lock = threading.Lock()
        self._write_s: float | None = None  # seconds of the last write (auto cadence)
        self._round_s = 0.0  # mean wall seconds of a round (auto cadence)
        self._rounds_seen = 0
        self._since = 0  # rounds since the last checkpoint
        self.last_round: int | None = max(self._kept) if self._kept else None
        if removed := remove_temp_files(self.folder):
            log.info("removed %d temporary checkpoint file(s) left by a killed write", removed)

    @property
    def interval(self) -> int:
        """Rounds between checkpoints now (auto: from the measured write and round times)."""
        if self.every is not None:
            return self.every
        if self._write_s is None or self._round_s <= 0:
            return 1
        return max(1, math.ceil(self._write_s / (AUTO_BUDGET * self._round_s)))

    def due(self, round_idx: int, round_s: float) -> bool:
        """Account one finished round; True when it should be checkpointed."""
        self._rounds_seen += 1
        self._round_s += (round_s - self._round_s) / self._rounds_seen
        self._since += 1
        return self.every != 0 and self._since >= self.interval

    def submit(self, round_idx: int, state: Any, client_states: dict[int, Any], config: dict[str, Any],
               seed: int) -> None:
        """Snapshot the state now; write it on the background thread (after the previous write)."""
        self.wait()  # at most one write in flight: memory stays bounded, errors surface a round later
        snapshot = checkpoint_payload(round_idx=round_idx, server_state=state, client_states=client_states,
                                      config=config, seed=seed)
        self._since = 0
        self.last_round = round_idx
        self._pending = self._pool.submit(self._write, round_idx, snapshot)

    def _write(self, round_idx: int, snapshot: dict[str, Any]) -> None:
        start = time.perf_counter()
        path = checkpoint_path(self.folder.parent, round_idx)
        atomic_save(snapshot, path)
        self._record(round_idx, str(path.resolve()))
        self._write_s = time.perf_counter() - start
        with self._lock:
            self._kept = sorted(set(self._kept) | {round_idx})
            old, self._kept = self._kept[: -self.keep], self._kept[-self.keep :]
        if old:
            self._forget(old)
            for stale in old:
                checkpoint_path(self.folder.parent, stale).unlink(missing_ok=True)

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


def _cpu_copy(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    return t.detach().to("cpu", copy=True)


def _os_message(err: OSError, path: Path) -> str:
    import errno

    if err.errno == errno.ENOSPC:
        return (f"no space left on device: could not write {path}; free disk space, then resume "
                "with `fedcli train --resume RUN` (the previous checkpoint is intact)")
    return f"could not write {path}: {err.strerror or err}; check the folder's permissions and free space"
