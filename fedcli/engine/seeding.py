"""Deterministic RNG plumbing: one independent stream per (seed, purpose, round, client).

docs/style.md rule 8. Results depend only on the config and the seed, never on the executor,
the cohort order or the cohort size: each client's batch order and noise come from its
own stream keyed by (seed, stream, round_idx, client_id).
"""

from __future__ import annotations

from enum import Enum

import numpy as np
import torch


class Stream(Enum):
    COHORT = 1  # which clients take part in a round
    BATCH_ORDER = 2  # each client's shuffling of its examples
    INIT = 3  # model initialisation
    NOISE = 4  # sampler noise, dropout keys
    PARTITION = 5  # synthetic partitions generated at train time


def derive_seed(seed: int, stream: Stream, *keys: int) -> int:
    """Return an independent 63-bit seed for (seed, stream, *keys)."""
    sequence = np.random.SeedSequence(entropy=seed, spawn_key=(stream.value, *[int(k) for k in keys]))
    return int(sequence.generate_state(2, dtype=np.uint64)[0] >> np.uint64(1))


def numpy_rng(seed: int, stream: Stream, *keys: int) -> np.random.Generator:
    """Return a numpy Generator on the derived stream."""
    return np.random.default_rng(derive_seed(seed, stream, *keys))


def torch_generator(seed: int, stream: Stream, *keys: int, device: str | torch.device = "cpu") -> torch.Generator:
    """Return a torch.Generator on the derived stream."""
    return torch.Generator(device=device).manual_seed(derive_seed(seed, stream, *keys))


def sample_cohort(num_clients: int, cohort_size: int, *, seed: int, round_idx: int) -> np.ndarray:
    """Sample cohort_size distinct client ids uniformly without replacement, sorted."""
    rng = numpy_rng(seed, Stream.COHORT, round_idx)
    return np.sort(rng.choice(num_clients, size=cohort_size, replace=False))


def step_keys(seed: int, round_idx: int, cohort: np.ndarray, num_steps: int) -> torch.Tensor:
    """Return [C, S] int64 per-step keys for in-model randomness (dropout)."""
    base = [derive_seed(seed, Stream.NOISE, round_idx, int(c)) for c in cohort]
    return torch.tensor(base, dtype=torch.int64)[:, None] + torch.arange(num_steps, dtype=torch.int64)[None, :]
