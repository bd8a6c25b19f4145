"""Atomic checkpoints: server state + client states + round + resolved config.

Written to a temporary file in the same folder and renamed over the target, so a crash
or kill never leaves a half-written checkpoint (DESIGN.md §7). Tensors are saved on CPU
so a checkpoint written on a GPU loads anywhere.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

FORMAT_VERSION = 1


def to_cpu(tree: Any) -> Any:
    return pytree.tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, tree)


def to_device(tree: Any, device: torch.device) -> Any:
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tree)


def atomic_save(obj: Any, path: Path) -> None:
    """torch.save to a temp file beside `path`, fsync, then rename over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_checkpoint(path: Path, *, round_idx: int, server_state: Any, client_states: dict[int, Any],
                    config: dict[str, Any], seed: int) -> None:
    """Write everything needed to resume exactly after `round_idx`."""
    atomic_save({"format_version": FORMAT_VERSION, "round_idx": round_idx, "seed": seed, "config": config,
                 "server_state": to_cpu(server_state), "client_states": to_cpu(client_states)}, path)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load a checkpoint written by save_checkpoint onto the CPU."""
    return torch.load(path, map_location="cpu", weights_only=False)
