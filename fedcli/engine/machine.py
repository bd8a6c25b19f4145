"""What this process may use of the machine: its CPU cores and intra-op threads."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def available_cores() -> int:
    """Return the number of CPU cores this process may use: its affinity, capped by a cgroup CPU quota.

    A container or a batch job limited to 1.5 CPUs by `cpu.max` gets 1 (rounded down, at least
    1), however many cores the machine has; intra-op threads beyond that only wait on each other.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    return max(1, min(cores, int(quota))) if quota is not None else cores


def _cgroup_cpu_quota() -> float | None:
    """CPUs allowed by the cgroup (v2 `cpu.max`, v1 `cpu.cfs_quota_us`), or None when unlimited."""
    for quota_file, period_file in (
        ("/sys/fs/cgroup/cpu.max", None),
        ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us"),
    ):
        try:
            text = open(quota_file).read().split()
            if period_file is None:
                quota, period = text[0], text[1]
            else:
                quota, period = text[0], open(period_file).read().strip()
        except (OSError, IndexError):
            continue
        if quota in ("max", "-1"):
            return None
        return float(quota) / float(period)
    return None


@contextmanager
def intra_op_threads(count: int) -> Iterator[None]:
    """Run the block with `count` intra-op threads, then restore the previous count."""
    previous = torch.get_num_threads()
    if previous != count:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if previous != count:
            torch.set_num_threads(previous)


@functools.cache
def libc_trim() -> Any:
    """glibc's malloc_trim, or None (another C library, another OS)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_free_memory() -> None:
    """Give the C heap's free pages back to the OS (glibc `malloc_trim(0)`; a no-op elsewhere).

    A round frees many tensors of a few MB (client states, gradients) that glibc keeps in its heap
    below its mmap threshold; over the rounds the freed pages, fragmented, stay resident. The
    round loop calls this once a round (docs/scaling.md, "Client state")."""
    trim = libc_trim()
    if trim is not None:
        trim(0)
