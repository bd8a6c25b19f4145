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


# numpy's SeedSequence (numpy/random/bit_generator.pyx; O'Neill's seed_seq hash), for derive_seeds
_POOL, _XSHIFT, _MASK = 4, 16, 0xFFFFFFFF
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R = 0xCA01F9DD, 0x4973F715


def derive_seeds(seed: int, stream: Stream, *keys: int, last: np.ndarray) -> np.ndarray:
    """Return [derive_seed(seed, stream, *keys, c) for c in last] as int64, bit for bit, at a
    fraction of the cost: a round derives two seeds per client (batch order, step keys), and one
    np.random.SeedSequence per seed added milliseconds of host time to a round of 100 clients
    (docs/benchmarks.md, "Figures behind the engine's choices").

    SeedSequence mixes its entropy words (the seed padded to the pool size, then the spawn key)
    into a pool of 4 words, word by word; every word but the last is the same for the whole
    batch, so the pool is mixed once with Python integers and only the last word, and the
    output words, are computed per client with numpy's wrapping uint32 arithmetic.
    tests/engine/test_seeding.py checks it against SeedSequence itself.
    """
    last = np.asarray(last)
    if seed < 0 or min(keys, default=0) < 0 or (last.size and (last.min() < 0 or last.max() > _MASK)):
        return np.array([derive_seed(seed, stream, *keys, int(c)) for c in last], dtype=np.int64)
    run = _words(seed)
    entropy = [*run, *[0] * max(0, _POOL - len(run))]
    for key in (stream.value, *keys):
        entropy += _words(key)
    hash_const = _INIT_A

    def hashmix(value: int) -> int:
        nonlocal hash_const
        value ^= hash_const
        hash_const = (hash_const * _MULT_A) & _MASK
        value = (value * hash_const) & _MASK
        return value ^ (value >> _XSHIFT)

    def mix(x: int, y: int) -> int:
        result = (_MIX_L * x - _MIX_R * y) & _MASK
        return result ^ (result >> _XSHIFT)

    pool = [hashmix(entropy[i]) for i in range(_POOL)]
    for src in range(_POOL):
        for dst in range(_POOL):
            if src != dst:
                pool[dst] = mix(pool[dst], hashmix(pool[src]))
    for word in entropy[_POOL:]:
        for dst in range(_POOL):
            pool[dst] = mix(pool[dst], hashmix(word))
    u32 = np.uint32
    with np.errstate(over="ignore"):
        column = last.astype(np.uint32)
        mixed = []
        for dst in range(_POOL):  # the last entropy word, per client
            value = (column ^ u32(hash_const)) * u32((hash_const * _MULT_A) & _MASK)
            hash_const = (hash_const * _MULT_A) & _MASK
            value ^= value >> u32(_XSHIFT)
            result = u32(_MIX_L) * u32(pool[dst]) - u32(_MIX_R) * value
            mixed.append(result ^ (result >> u32(_XSHIFT)))
        out, out_const = [], _INIT_B
        for i in range(2):  # generate_state(2, uint64)[0]: the first two uint32 words, low word first
            value = mixed[i] ^ u32(out_const)
            out_const = (out_const * _MULT_B) & _MASK
            value = value * u32(out_const)
            out.append((value ^ (value >> u32(_XSHIFT))).astype(np.uint64))
    first = out[0] | (out[1] << np.uint64(32))
    return (first >> np.uint64(1)).astype(np.int64)


def _words(value: int) -> list[int]:
    """An integer as SeedSequence reads it: 32-bit words, least significant first (0 -> [0])."""
    out = [value & _MASK]
    value >>= 32
    while value:
        out.append(value & _MASK)
        value >>= 32
    return out


def numpy_rng(seed: int, stream: Stream, *keys: int) -> np.random.Generator:
    """Return a numpy Generator on the derived stream."""
    return np.random.default_rng(derive_seed(seed, stream, *keys))


def torch_generator(
    seed: int, stream: Stream, *keys: int, device: str | torch.device = "cpu"
) -> torch.Generator:
    """Return a torch.Generator on the derived stream."""
    return torch.Generator(device=device).manual_seed(derive_seed(seed, stream, *keys))


def sample_cohort(num_clients: int, cohort_size: int, *, seed: int, round_idx: int) -> np.ndarray:
    """Sample cohort_size distinct client ids uniformly without replacement, sorted."""
    rng = numpy_rng(seed, Stream.COHORT, round_idx)
    return np.sort(rng.choice(num_clients, size=cohort_size, replace=False))


def step_keys(seed: int, round_idx: int, cohort: np.ndarray, num_steps: int) -> torch.Tensor:
    """Return [C, S] int64 per-step keys for in-model randomness (dropout) and data.augment's crops and flips
    (datasets/augment.py: a hash of the key and the example's slot in the batch)."""
    base = torch.from_numpy(
        derive_seeds(seed, Stream.NOISE, round_idx, last=np.asarray(cohort, dtype=np.int64))
    )
    return base[:, None] + torch.arange(num_steps, dtype=torch.int64)[None, :]


def numpy_rngs(seed: int, stream: Stream, round_idx: int, cohort: np.ndarray) -> list[np.random.Generator]:
    """[numpy_rng(seed, stream, round_idx, c) for c in cohort], with the seeds derived in one batch."""
    return [
        np.random.default_rng(int(s))
        for s in derive_seeds(seed, stream, round_idx, last=np.asarray(cohort, dtype=np.int64))
    ]
