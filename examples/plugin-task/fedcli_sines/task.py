"""`sines`: which of 4 frequencies a noisy sine wave of 64 samples has; 12 clients, each with its own phase.

A fedcli task is a `Task` record of plain functions (fedcli/datasets/tasks.py). The data are
generated from `TaskOptions.seed` with a local numpy Generator (never a global RNG), so every
process that loads the task (worker processes, `--resume`, `fedcli evaluate`) gets the same
tensors; `fingerprint` lets partition files and resumes check that.
"""

from __future__ import annotations

from types import MappingProxyType

import numpy as np
import torch
from torch import nn

from fedcli.datasets.tasks import Task, TaskData, TaskOptions, fingerprint

CLIENTS, PER_CLIENT, TEST, STEPS, CLASSES = 12, 40, 200, 64, 4


def _signals(rng: np.random.Generator, n: int, phase: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    y = rng.integers(0, CLASSES, n)
    t = np.arange(STEPS) / STEPS
    x = np.sin(2 * np.pi * (y[:, None] + 1) * t[None, :] + phase[:, None]) + 0.3 * rng.normal(size=(n, STEPS))
    return x.astype(np.float32)[:, None, :], y.astype(np.int64)  # [N, 1, 64]: one channel


def load(options: TaskOptions) -> TaskData:
    """12 clients of 40 examples (client k's phases around k / 2), a test split of 200."""
    rng = np.random.default_rng(options.seed)
    owner = np.repeat(np.arange(CLIENTS), PER_CLIENT)
    x, y = _signals(rng, len(owner), owner / 2 + 0.1 * rng.normal(size=len(owner)))
    test_x, test_y = _signals(rng, TEST, rng.uniform(0, CLIENTS / 2, TEST))
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    return TaskData(x=xt, y=yt, client_indices=[np.flatnonzero(owner == k) for k in range(CLIENTS)],
                    client_names=[f"sensor-{k}" for k in range(CLIENTS)], test_x=torch.from_numpy(test_x),
                    test_y=torch.from_numpy(test_y), fingerprint=fingerprint(xt, yt), num_classes=CLASSES)


def _linear() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(STEPS, CLASSES))


TASK = Task(name="sines", description="noisy sine waves: which of 4 frequencies (12 clients by phase)",
            source="generated from the seed (fedcli-sines plugin)", offline=True, kind="classification",
            models=MappingProxyType({"linear": _linear}), default_model="linear", load=load, client_lr=0.1)
